#include "daemon/render_worker.h"

#include <exception>
#include <memory>

#include <boost/asio/post.hpp>

namespace steptrace::daemon {

std::string run_render_job(const RenderJob& job, const CollectorView& view) {
  try {
    return job(view);
  } catch (const std::exception& e) {
    // A report bug must not take the connection (or the daemon) down.
    return std::string("error: internal error: ") + e.what() + "\n";
  }
}

RenderWorker::RenderWorker(boost::asio::io_context& io, Collector& collector)
    : io_(io), collector_(collector) {}

RenderWorker::~RenderWorker() { stop(); }

void RenderWorker::submit(RenderJob job, Done done) {
  if (stopped_) return;
  queue_.emplace_back(std::move(job), std::move(done));
  if (!busy_) start_next();
}

void RenderWorker::start_next() {
  if (stopped_ || queue_.empty()) return;
  busy_ = true;
  auto [job, done] = std::move(queue_.front());
  queue_.pop_front();
  collector_.refresh_liveness();
  std::shared_ptr<const CollectorView> view = collector_.freeze();
  boost::asio::post(pool_, [this, job = std::move(job), done = std::move(done),
                            view = std::move(view)]() mutable {
    std::string text = run_render_job(job, *view);
    // Back on the io thread: the view is released there, with the reply.
    boost::asio::post(io_, [this, done = std::move(done), view = std::move(view),
                            text = std::move(text)]() mutable {
      view.reset();
      busy_ = false;
      if (stopped_) return;
      done(std::move(text));
      start_next();
    });
  });
}

void RenderWorker::stop() {
  if (stopped_) return;
  stopped_ = true;
  queue_.clear();
  pool_.join();
}

}  // namespace steptrace::daemon
