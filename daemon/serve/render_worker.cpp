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
      lanes_{std::make_unique<Lane>(io, RenderLane::kBulk),
             std::make_unique<Lane>(io, RenderLane::kFast)} {}

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
  if (!queued.task) l.last_submit = freezes_;
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

RenderWorker::ViewSource RenderWorker::view_source(
    const Lane& l, bool copies_over_bound, std::chrono::steady_clock::time_point now) const {
  const Lane& o = lane(other(l.which));
  // Frozen after every job waiting here came: it shows all they may ask to see.
  if (o.view && o.view_freeze > l.last_submit) return ViewSource::kShare;
  // The bulk lane adds no second view to the copies over their bound; the fast lane never
  // waits behind a report (see the top of render_worker.h).
  if (copies_over_bound && l.which == RenderLane::kBulk && o.view) return ViewSource::kWait;
  // At most one view per lane per kMinViewInterval: each view costs ingest a clone of
  // every record it then touches, so a client asking in a tight loop must not multiply
  // that, nor a lane that waited for the other's view (over the bound each wait ends at
  // the other's release, as often as another tenant's stats calls make it).
  if (now < l.last_freeze + kMinViewInterval) return ViewSource::kPace;
  return ViewSource::kFreeze;
}

void RenderWorker::start_next(Lane& l) {
  if (stopped_ || l.busy || !l.queue.ready()) return;
  assert(on_io_thread(io_));  // freezes the Collector: makes the view
  // (A round of tasks alone needs no view: it is neither shared, held back nor paced.)
  if (!l.queue.ready([](const Queued& q) { return !q.task; })) {
    start_round(l, nullptr, 0, kMaxBatch);
    return;
  }
  const bool over = collector_.view_copies_over_bound();
  // Over the bound, the bulk lane's view lives one render, not a round of them.
  const std::size_t max_jobs = over && l.which == RenderLane::kBulk ? 1 : kMaxBatch;
  const auto now = std::chrono::steady_clock::now();
  switch (view_source(l, over, now)) {
    case ViewSource::kShare: {
      const Lane& o = lane(other(l.which));
      start_round(l, o.view, o.view_freeze, max_jobs);
      return;
    }
    case ViewSource::kWait:
      return;  // the other lane's release starts this one (start_round)
    case ViewSource::kPace:
      l.busy = true;
      l.pace_timer.expires_at(l.last_freeze + kMinViewInterval);
      l.pace_timer.async_wait([this, &l](const boost::system::error_code& ec) {
        if (ec || stopped_) return;
        l.last_freeze = {};
        l.busy = false;
        start_next(l);
      });
      return;
    case ViewSource::kFreeze:
      break;
  }
  l.last_freeze = now;
  std::shared_ptr<const CollectorView> view = collector_.freeze(server_);
  start_round(l, std::move(view), ++freezes_, max_jobs);
}

void RenderWorker::start_round(Lane& l, std::shared_ptr<const CollectorView> view,
                               std::uint64_t freeze, std::size_t max_jobs) {
  // A round, one job per owner, renders from one view: each was submitted before it, so
  // each reply still shows everything applied before its command, and a burst of
  // requests from many owners costs one freeze (and one round of clones), not one each.
  auto round = l.queue.take_round(max_jobs);
  l.busy = true;
  l.view = view;  // the other lane may share it meanwhile
  l.view_freeze = freeze;
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
      l.view.reset();
      l.busy = false;
      // A lane waiting for this view goes first: it freezes, and this lane's jobs waiting
      // by then share its view.
      start_next(lane(other(l.which)));
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
  for (auto& l : lanes_) l->view.reset();
}

}  // namespace steptrace::daemon
