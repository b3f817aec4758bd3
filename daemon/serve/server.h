// steptraced's server: one Boost.Asio event loop that owns everything with a lifetime
// tied to the process: the io_context, the signal set (SIGTERM/SIGINT), the listening
// socket (Listener, listener.h), the connections (ConnectionRegistry, connections.h), the
// liveness, ring and snapshot timers, the render worker and the optional HTTP metrics
// listener and GPU sampler.
//
// Data flow: start() restores the snapshot into the Collector, binds the socket (or
// adopts the one systemd passed) and tells systemd READY=1 -> run() accepts connections
// (each a Session, see session.h; over max_connections a connection is answered with an
// error and closed) and runs until a signal -> shutdown: stop accepting, apply what
// binary clients already sent (bounded time), write the snapshot, close, return.
// Everything runs on one thread, event-driven: no polling loop; except rendering (reports,
// metrics, periodic snapshots), which the RenderWorker does on two threads of its own (a
// bulk and a fast lane, each fair between uids) from copy-on-write views, so that ingest
// never waits for it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/signal_set.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/serve/commands.h"
#include "daemon/serve/config.h"
#include "daemon/serve/connections.h"
#include "daemon/serve/failure_log.h"
#include "daemon/serve/gpu_sampler.h"
#include "daemon/serve/http_metrics.h"
#include "daemon/serve/listener.h"
#include "daemon/serve/render_worker.h"
#include "daemon/serve/session.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

// What writing one snapshot came to.
struct WrittenSnapshot {
  std::string error;           // "" when written
  std::uint64_t left_out = 0;  // records past limits.max_snapshot_bytes, not written
  std::string first_left_out;  // which was the first of them
};

class Server {
 public:
  Server(const Config& config, Collector& collector);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Restores the snapshot, binds the socket and the HTTP listener. On failure a
  // one-line message (the daemon exits 1), with nothing left listening.
  std::optional<std::string> start();
  // Serves until SIGTERM/SIGINT, then drains, snapshots and returns. False when the
  // final snapshot could not be written (logged; the daemon then exits non-zero).
  bool run();

 private:
  std::optional<std::string> check_fd_limit();
  void restore_snapshot();
  bool save_snapshot_now();    // on this thread (shutdown); false when it failed
  void save_snapshot_later();  // on the render thread (the timer)
  // Counts and logs (rate-limited) a snapshot write; false when its failure was not
  // logged (the previous line is recent).
  bool snapshot_written(const WrittenSnapshot& written);
  void started_empty(const std::string& error);  // the snapshot at start could not be used
  void drain_backlog();
  void drain_and_stop(std::vector<std::shared_ptr<Session>>& live);
  void schedule_liveness();
  // The ring timer: drains every connection's shared-memory rings, every 1 ms while they
  // carry events, every 10 ms while they do not (a ring past its high-water mark makes its
  // library send a Flush, which drains at once), and not at all without rings.
  void schedule_ring_drain(std::chrono::milliseconds delay);
  void schedule_snapshot();
  void watch_other_signals();
  void shutdown(int signal_number);
  void finish_shutdown();

  const Config& config_;
  Collector& collector_;
  boost::asio::io_context io_;
  boost::asio::signal_set signals_;        // SIGTERM, SIGINT: stop
  boost::asio::signal_set other_signals_;  // SIGHUP, SIGUSR1, SIGUSR2, SIGALRM: log, go on
  boost::asio::steady_timer liveness_timer_;
  boost::asio::steady_timer ring_timer_;
  bool ring_timer_armed_ = false;
  boost::asio::steady_timer snapshot_timer_;
  RateLimitedLog log_;
  Listener listener_;        // the Unix socket, its file and the accept loop
  ServerCounters counters_;  // connections, bytes, frames, protocol errors, commands, snapshots
  RenderWorker renderer_;
  bool snapshot_pending_ = false;  // a snapshot job is queued or writing
  // Collector::generation() of the state the last good snapshot (or the restored one)
  // holds: the timer writes none while the state is the same.
  std::optional<std::uint64_t> snapshot_generation_;
  FailureLog snapshot_log_{"snapshots"};
  std::uint64_t last_left_out_ = 0;  // records the last snapshot left out (logged on change)
  CommandTable commands_;
  SessionShared shared_;
  ConnectionRegistry connections_;  // the sessions, their counts and limits
  std::unique_ptr<HttpMetricsServer> http_;
  GpuSampler gpu_sampler_;

  bool stopping_ = false;
  bool final_snapshot_written_ = true;
};

}  // namespace steptrace::daemon
