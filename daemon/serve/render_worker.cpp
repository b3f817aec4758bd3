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
    : io_(io),
      collector_(collector),
      server_(server),
      lanes_{std::make_unique<Lane>(io), std::make_unique<Lane>(io)} {}

RenderWorker::~RenderWorker() { stop(); }

void RenderWorker::submit(RenderJob job, Done done, RenderOwner owner) {
  const RenderLane which = job.lane();
  enqueue(which, owner, {std::move(job), {}, std::move(done)});
}

void RenderWorker::submit_task(Task task, Done done, RenderOwner owner) {
  enqueue(RenderLane::kBulk, owner, {{}, std::move(task), std::move(done)});
}

void RenderWorker::enqueue(RenderLane which, RenderOwner owner, Queued queued) {
  assert(on_io_thread(io_));
  if (stopped_) return;
  Lane& l = lane(which);
  l.queue.push(owner, std::move(queued));
  if (!l.busy) start_next(l);
}

std::size_t RenderWorker::pending(RenderLane which) const {
  const Lane& l = lane(which);
  return l.queue.waiting() + l.queue.in_progress();
}

std::size_t RenderWorker::waiting(RenderLane which, RenderOwner owner) const {
  return lane(which).queue.waiting(owner);
}

void RenderWorker::start_next(Lane& l) {
  if (stopped_ || l.busy || !l.queue.ready()) return;
  assert(on_io_thread(io_));  // freezes the Collector: makes the view
  // At most one view per lane per kMinViewInterval: each view costs ingest a clone of
  // every record it then touches, so a client asking in a tight loop must not multiply
  // that. (A round of tasks alone needs no view: it is not paced.)
  const auto now = std::chrono::steady_clock::now();
  const bool needs_view = l.queue.ready([](const Queued& q) { return !q.task; });
  if (needs_view && now < l.last_freeze + kMinViewInterval) {
    l.busy = true;
    l.pace_timer.expires_at(l.last_freeze + kMinViewInterval);
    l.pace_timer.async_wait([this, &l](const boost::system::error_code& ec) {
      if (ec || stopped_) return;
      l.last_freeze = {};
      l.busy = false;
      start_next(l);
    });
    return;
  }
  // A round, one job per owner, renders from one view: each was submitted before it, so
  // each reply still shows everything applied before its command, and a burst of
  // requests from many owners costs one freeze (and one round of clones), not one each.
  auto round = l.queue.take_round(kMaxBatch);
  l.busy = true;
  std::shared_ptr<const CollectorView> view;
  if (needs_view) {
    l.last_freeze = now;
    view = collector_.freeze(server_);
  }
  boost::asio::post(l.pool, [this, &l, round = std::move(round), view = std::move(view)]() mutable {
    for (auto& [owner, queued] : round) {
      auto& [job, task, done] = queued;
      std::string text = task ? task() : run_render_job(job, *view);
      // Each reply goes back as soon as it is ready (posts run in order), and with it
      // the owner's turn: its next job goes in the lane's next round.
      boost::asio::post(
          io_, [this, &l, owner = owner, done = std::move(done), text = std::move(text)]() mutable {
            assert(on_io_thread(io_));
            if (stopped_) return;
            l.queue.done(owner);
            done(std::move(text));
          });
    }
    // Back on the io thread: the view is released there, after the replies.
    boost::asio::post(io_, [this, &l, view = std::move(view)]() mutable {
      assert(on_io_thread(io_));  // releases the view: only this thread changes use counts
      view.reset();
      l.busy = false;
      start_next(l);
    });
  });
}

void RenderWorker::stop() {
  if (stopped_) return;
  stopped_ = true;
  for (auto& l : lanes_) {
    l->queue.clear();
    l->pace_timer.cancel();
  }
  for (auto& l : lanes_) l->pool.join();
}

}  // namespace steptrace::daemon
