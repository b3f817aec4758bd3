// Renders reports, metrics and snapshots off the io thread, so that ingest never waits
// for them (a 100,000-key report takes hundreds of milliseconds; the clients' buffers
// would fill meanwhile), and fairly between tenants.
//
// Two lanes, each a thread of its own (RenderLane, render_job.h): the bulk lane renders
// reports, the ledger, trace pieces and snapshots; the fast lane stats, metrics and the
// HTTP scrape, so that those never wait behind anyone's report (a report over a big
// table takes seconds; a stats reply microseconds, a scrape one metrics render, which
// HttpMetricsServer shares among every scraper waiting). Within a lane, jobs wait per
// owner (RenderOwner, render_queue.h: a peer uid, the HTTP scrapers, the daemon) and are
// served round-robin, at most one job of an owner in progress, FIFO within an owner.
//
// Data flow: a text session, the HTTP listener or the snapshot timer calls submit(job,
// done, owner) on the io thread -> when its lane is idle the io thread takes a round
// (the front job of each owner waiting, up to kMaxBatch), freezes the Collector once for
// all of them (a CollectorView: pointers copied, records shared copy-on-write, see
// CollectorView in collector.h) and posts the round with its view to the lane's thread
// -> the thread runs each job(view) and posts each result back to the io thread, which
// calls done(result) and frees the owner's turn; then the io thread releases the view
// (so only the io thread ever touches the records' use counts) and starts the lane's
// next round, at most one view per lane per kMinViewInterval (requests meanwhile wait
// and share the next view).
//
// While a job renders, ingest goes on: the first mutation of a record a view holds
// clones that record (one process's aggregates), once per view. Those copies are heap
// the state budget does not charge (a render flood must not refuse anyone's spans), so
// the worker bounds what views make them hold instead:
//  - a lane that needs a view renders from the one the other lane holds when that was
//    frozen after every job waiting in the lane was submitted (a freeze numbered past
//    the lane's last submission): each reply still shows everything applied before its
//    command, and no second view makes a second copy of each record written;
//  - while the copies are over their bound (Collector::view_copies_over_bound, charge.h's
//    view_copy_bound: an eighth of the charge, at least 16 MiB), the bulk lane freezes no
//    view of its own while the fast lane holds one: it waits for that view's release
//    (one round of stats and metrics renders), then freezes first, so the fast lane's
//    jobs waiting by then render from its view; and it renders one job per view, so each
//    view lives one render. The fast lane never waits for a view (stats, metrics and
//    scrapes never wait behind a report): it freezes its own when the bulk lane's is
//    older than its jobs. The copies then exceed the bound by at most what ingest writes
//    during the renders in progress when they crossed it (a copy per record written in
//    the bulk render, a second one only for those the fast lane's view holds meanwhile).
#pragma once

#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>

#include "daemon/serve/render_job.h"
#include "daemon/serve/render_queue.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

// Reply bytes each peer uid has queued for its clients and the sockets not yet taken
// (Session::send and its writes keep it), checked against
// limits.max_pending_reply_bytes_per_uid. io thread only.
class ReplyBytes {
 public:
  void add(std::uint32_t uid, std::size_t n) {
    if (n != 0) by_uid_[uid] += n;
  }
  void remove(std::uint32_t uid, std::size_t n) {
    const auto it = by_uid_.find(uid);
    if (it == by_uid_.end()) return;
    it->second -= std::min(it->second, n);
    if (it->second == 0) by_uid_.erase(it);
  }
  std::size_t of(std::uint32_t uid) const {
    const auto it = by_uid_.find(uid);
    return it == by_uid_.end() ? 0 : it->second;
  }

 private:
  std::map<std::uint32_t, std::size_t> by_uid_;  // uids with bytes pending only
};

class RenderWorker {
 public:
  using Done = std::function<void(std::string)>;
  static constexpr std::size_t kMaxBatch = 64;  // jobs (one per owner) rendered from one view
  static constexpr std::chrono::milliseconds kMinViewInterval{10};

  // `server`: the server's counters, which every view shows beside the collector's.
  RenderWorker(boost::asio::io_context& io, Collector& collector,
               const ServerCounters* server = nullptr);
  ~RenderWorker();  // stop()
  RenderWorker(const RenderWorker&) = delete;
  RenderWorker& operator=(const RenderWorker&) = delete;

  // io thread (asserted in debug builds, io_thread.h). `done` gets the job's text, or "error:
  // internal error: ...\n" when the job threw; it is never called once stop() has run.
  // The job runs on its lane (job.lane()) in `owner`'s turn.
  void submit(RenderJob job, Done done, RenderOwner owner = RenderOwner::daemon());
  // The same for work that needs no view (a piece of a streamed reply, which holds its
  // own capture): run on the bulk lane in `owner`'s turn, without a freeze or its pacing.
  using Task = std::function<std::string()>;
  void submit_task(Task task, Done done, RenderOwner owner = RenderOwner::daemon());
  // Waits for the jobs being rendered and joins the threads; queued jobs are dropped.
  void stop();
  // Jobs waiting or rendering (for stats and tests), in all or in one lane.
  std::size_t pending() const { return pending(RenderLane::kBulk) + pending(RenderLane::kFast); }
  std::size_t pending(RenderLane lane) const;
  std::size_t waiting(RenderLane lane, RenderOwner owner) const;

  ReplyBytes& reply_bytes() { return reply_bytes_; }

 private:
  struct Queued {
    RenderJob job;  // or
    Task task;
    Done done;
  };
  struct Lane {
    Lane(boost::asio::io_context& io, RenderLane which) : which(which), pace_timer(io) {}
    RenderLane which;
    RenderQueue<Queued> queue;
    boost::asio::steady_timer pace_timer;
    std::chrono::steady_clock::time_point last_freeze{};
    bool busy = false;  // a round is out (or its pacing timer waits)
    // The view its round renders from (none between rounds, or for a round of tasks) and
    // that view's freeze number (freezes_ once it was made).
    std::shared_ptr<const CollectorView> view;
    std::uint64_t view_freeze = 0;
    // freezes_ when a job that needs a view last came: a view numbered past it was frozen
    // after every job waiting here was submitted.
    std::uint64_t last_submit = 0;
    boost::asio::thread_pool pool{1};
  };
  Lane& lane(RenderLane which) { return *lanes_[static_cast<std::size_t>(which)]; }
  const Lane& lane(RenderLane which) const { return *lanes_[static_cast<std::size_t>(which)]; }
  static RenderLane other(RenderLane which) {
    return which == RenderLane::kBulk ? RenderLane::kFast : RenderLane::kBulk;
  }
  void enqueue(RenderLane which, RenderOwner owner, Queued queued);
  void start_next(Lane& lane);
  // How start_next gets the round's view: the other lane's, a new one, or not yet.
  enum class ViewSource : std::uint8_t { kShare, kFreeze, kPace, kWait };
  ViewSource view_source(const Lane& lane, bool copies_over_bound,
                         std::chrono::steady_clock::time_point now) const;
  void start_round(Lane& lane, std::shared_ptr<const CollectorView> view, std::uint64_t freeze,
                   std::size_t max_jobs);

  boost::asio::io_context& io_;
  Collector& collector_;
  const ServerCounters* server_;
  std::array<std::unique_ptr<Lane>, 2> lanes_;  // by RenderLane
  std::uint64_t freezes_ = 0;                   // views this worker froze so far
  ReplyBytes reply_bytes_;
  bool stopped_ = false;
};

// Runs `job` over `view`, turning an exception into the error reply every report uses.
std::string run_render_job(const RenderJob& job, const CollectorView& view);

}  // namespace steptrace::daemon
