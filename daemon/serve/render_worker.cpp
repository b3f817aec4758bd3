#include "daemon/serve/render_worker.h"

#include <algorithm>
#include <cassert>
#include <chrono>
#include <exception>
#include <memory>
#include <vector>

#include <boost/asio/post.hpp>

#include "daemon/serve/io_thread.h"

namespace steptrace::daemon {

std::string run_render_job(const RenderJob& job, const CollectorView& view) {
  try {
    return job(view);
  } catch (const std::exception& e) {
    // A report bug must not take the connection (or the daemon) down.
    return std::string("error: internal error: ") + e.what() + "\n";
  }
}

RenderWorker::RenderWorker(boost::asio::io_context& io, Collector& collector,
                           const ServerCounters* server)
    : io_(io), collector_(collector), server_(server), pace_timer_(io) {}

RenderWorker::~RenderWorker() { stop(); }

void RenderWorker::submit(RenderJob job, Done done) {
  assert(on_io_thread(io_));
  if (stopped_) return;
  queue_.push_back({std::move(job), {}, std::move(done)});
  if (!busy_) start_next();
}

void RenderWorker::submit_task(Task task, Done done) {
  assert(on_io_thread(io_));
  if (stopped_) return;
  queue_.push_back({{}, std::move(task), std::move(done)});
  if (!busy_) start_next();
}

void RenderWorker::start_next() {
  if (stopped_ || queue_.empty()) return;
  assert(on_io_thread(io_));  // freezes the Collector: makes the view
  busy_ = true;
  const std::size_t batch_size = std::min(queue_.size(), kMaxBatch);
  const bool needs_view = std::any_of(queue_.begin(), queue_.begin() + batch_size,
                                      [](const Queued& q) { return !q.task; });
  // At most one view per kMinViewInterval: each view costs ingest a clone of every
  // record it then touches, so a client asking in a tight loop must not multiply that.
  const auto now = std::chrono::steady_clock::now();
  if (needs_view && now < last_freeze_ + kMinViewInterval) {
    pace_timer_.expires_at(last_freeze_ + kMinViewInterval);
    pace_timer_.async_wait([this](const boost::system::error_code& ec) {
      if (ec || stopped_) return;
      last_freeze_ = {};
      busy_ = false;
      start_next();
    });
    return;
  }
  // Every job waiting now renders from one view: each was submitted before it, so each
  // reply still shows everything applied before its command, and a burst of requests
  // costs one freeze (and one round of clones), not one per request.
  std::vector<Queued> batch;
  while (batch.size() < batch_size) {
    batch.push_back(std::move(queue_.front()));
    queue_.pop_front();
  }
  std::shared_ptr<const CollectorView> view;
  if (needs_view) {
    last_freeze_ = now;
    view = collector_.freeze(server_);
  }
  boost::asio::post(pool_, [this, batch = std::move(batch), view = std::move(view)]() mutable {
    for (auto& [job, task, done] : batch) {
      std::string text = task ? task() : run_render_job(job, *view);
      // Each reply goes back as soon as it is ready (posts run in order).
      boost::asio::post(io_, [this, done = std::move(done), text = std::move(text)]() mutable {
        assert(on_io_thread(io_));
        if (!stopped_) done(std::move(text));
      });
    }
    // Back on the io thread: the view is released there, after the replies.
    boost::asio::post(io_, [this, view = std::move(view)]() mutable {
      assert(on_io_thread(io_));  // releases the view: only this thread changes use counts
      view.reset();
      busy_ = false;
      start_next();
    });
  });
}

void RenderWorker::stop() {
  if (stopped_) return;
  stopped_ = true;
  queue_.clear();
  pace_timer_.cancel();
  pool_.join();
}

}  // namespace steptrace::daemon
