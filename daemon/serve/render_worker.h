// Renders reports, metrics and snapshots off the io thread, so that ingest never waits
// for them (a 100,000-key report takes hundreds of milliseconds; the clients' buffers
// would fill meanwhile).
//
// Data flow: a text session, the HTTP listener or the snapshot timer calls submit(job,
// done) on the io thread -> jobs run in order: when the worker is idle the io thread
// takes every job waiting (up to kMaxBatch), re-checks liveness and freezes the
// Collector once for all of them (a CollectorView: pointers
// copied, records shared copy-on-write, see CollectorView in collector.h) and posts the job with
// its view to the worker thread -> the worker runs each job(view) and posts each result
// back to the io thread, which calls done(result); then the io thread releases the view
// (so only the io thread ever touches the records' use counts) and starts the next, at
// most one view per kMinViewInterval (requests meanwhile wait and share the next view).
//
// While a job renders, ingest goes on: the first mutation of a record the view holds
// clones that record (one process's aggregates), once per view.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>

#include "daemon/serve/render_job.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

class RenderWorker {
 public:
  using Done = std::function<void(std::string)>;
  static constexpr std::size_t kMaxBatch = 64;  // jobs rendered from one view
  static constexpr std::chrono::milliseconds kMinViewInterval{10};

  // `server`: the server's counters, which every view shows beside the collector's.
  RenderWorker(boost::asio::io_context& io, Collector& collector,
               const ServerCounters* server = nullptr);
  ~RenderWorker();  // stop()
  RenderWorker(const RenderWorker&) = delete;
  RenderWorker& operator=(const RenderWorker&) = delete;

  // io thread (asserted in debug builds, io_thread.h). `done` gets the job's text, or "error:
  // internal error: ...\n" when the job threw; it is never called once stop() has run.
  void submit(RenderJob job, Done done);
  // The same for work that needs no view (a piece of a streamed reply, which holds its
  // own capture): run in turn with the jobs, without a freeze or its pacing.
  using Task = std::function<std::string()>;
  void submit_task(Task task, Done done);
  // Waits for the job being rendered and joins the thread; queued jobs are dropped.
  void stop();
  // Jobs waiting or rendering (for stats and tests).
  std::size_t pending() const { return queue_.size() + (busy_ ? 1 : 0); }

 private:
  void start_next();

  boost::asio::io_context& io_;
  Collector& collector_;
  const ServerCounters* server_;
  boost::asio::steady_timer pace_timer_;
  std::chrono::steady_clock::time_point last_freeze_{};
  boost::asio::thread_pool pool_{1};
  struct Queued {
    RenderJob job;  // or
    Task task;
    Done done;
  };
  std::deque<Queued> queue_;
  bool busy_ = false;
  bool stopped_ = false;
};

// Runs `job` over `view`, turning an exception into the error reply every report uses.
std::string run_render_job(const RenderJob& job, const CollectorView& view);

}  // namespace steptrace::daemon
