// The daemon's state: every process seen, its per-step aggregates and open spans, the
// VRAM ledger view, and the daemon's counters; plus the reports built from them.
//
// Data flow: Session (one per connection, daemon/serve/session.*) decodes frames with
// proto::Decoder and hands each validated message to the Collector through the
// ProcessHandle it got from attach(). Everything runs on the one io_context thread, so
// the Collector takes no locks. Reports, metrics and snapshots read the same state.
//
// A process is identified by (pid, start_time) from SO_PEERCRED and /proc, never by a
// pid the client claims; a recycled pid is a new process. Several connections of one
// process (reconnects, a library reopened) share one process record.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>

#include <nlohmann/json_fwd.hpp>

#include "daemon/state/proc_probe.h"
#include "daemon/state/types.h"
#include "proto/codec.h"

namespace steptrace::daemon {

struct CollectorState;
class CollectorView;

// Text rendered from a view, possibly on another thread (daemon/serve/render_worker.h).
using RenderJob = std::function<std::string(const CollectorView&)>;

// The collector's state at one instant, for rendering: cheap to make (process records,
// the ledger and the retired histograms are shared copy-on-write, see
// collector_state.h), immutable, and safe to read on another thread while ingest goes on.
// Made and destroyed on the io thread only (Collector::freeze, daemon/serve/render_worker.h).
class CollectorView {
 public:
  ~CollectorView();
  CollectorView(const CollectorView&) = delete;
  CollectorView& operator=(const CollectorView&) = delete;

  // Each process object also carries "current": per thread the innermost open span and
  // how long it has been open (what the CLI's `top` shows), plus "unmatched_ends" and
  // "abandoned" per step. Schema: proto/PROTOCOL.md section 10.4.
  nlohmann::json report_json(std::optional<std::int32_t> pid) const;
  std::string report_text(std::optional<std::int32_t> pid) const;
  nlohmann::json ledger_json() const;
  std::string ledger_text() const;
  nlohmann::json stats_json() const;
  std::string stats_text() const;
  // Prometheus text exposition format 0.0.4.
  std::string metrics_text() const;
  // The persistent state (Collector::restore reads it back).
  nlohmann::json snapshot() const;

  // CLOCK_MONOTONIC when the view was made: "open for" and "exited ago" count to it.
  std::uint64_t now_ns() const { return now_ns_; }

 private:
  friend class Collector;
  CollectorView(const CollectorState& state, const DaemonCounters& counters, std::uint64_t now_ns);

  std::unique_ptr<const CollectorState> state_;
  DaemonCounters counters_;
  std::uint64_t now_ns_;
  std::chrono::steady_clock::duration uptime_;  // at the view's instant
};

class Collector {
 public:
  Collector(Limits limits, Environment env);
  ~Collector();
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  // ---- ingest (one call per decoded message) --------------------------------------
  // A new connection from `peer`. Fails with errc::limit_reached when the process table
  // is full of live processes.
  std::error_code attach(const PeerIdentity& peer, ProcessHandle& out);
  void hello(ProcessHandle process, const proto::Hello& hello);
  // Folds a validated batch. An event for a custom step the process never registered
  // fails with errc::unregistered_step (events before it are kept).
  std::error_code events(ProcessHandle process, proto::EventSpan events);
  // errc::limit_reached past max_custom_steps; re-registering an id with another name
  // fails with errc::bad_string.
  std::error_code register_step(ProcessHandle process, const proto::RegisterStep& step);
  void ledger(ProcessHandle process, const proto::LedgerRecord& record);
  void dropped(ProcessHandle process, std::uint64_t total_dropped);
  // Protocol version 2: the same, per cause (each cumulative; the total is their sum).
  void dropped_by_cause(ProcessHandle process, const proto::DroppedByCause& causes);
  // The connection closed. Spans it left open are counted as abandoned when the process
  // has no other connection; liveness is then checked against /proc.
  void detach(ProcessHandle process);

  // Re-checks processes without a connection against /proc (called on a timer and
  // before reports): marks the dead ones exited, flags their ledger reservations.
  void refresh_liveness();

  // ---- control ----------------------------------------------------------------------
  // Clears aggregates (all, or one pid's); the ledger view and counters stay.
  // Returns how many processes were cleared (with `pid`: 0 when it is not tracked).
  std::size_t reset(std::optional<std::int32_t> pid);

  // ---- reports ---------------------------------------------------------------------
  // The state now, to render (on any thread). The daemon renders every report from a
  // view on its render thread; the functions below render one on the caller's thread.
  std::shared_ptr<const CollectorView> freeze() const;

  nlohmann::json report_json(std::optional<std::int32_t> pid) const;
  std::string report_text(std::optional<std::int32_t> pid) const;
  nlohmann::json ledger_json() const;
  std::string ledger_text() const;
  nlohmann::json stats_json() const;
  std::string stats_text() const;
  // Prometheus text exposition format 0.0.4.
  std::string metrics_text() const;

  // ---- persistence -------------------------------------------------------------------
  nlohmann::json snapshot() const;
  // Replaces the state with a snapshot's. Fails (state unchanged) with errc::bad_config
  // when the document is not a steptrace snapshot of a version this build reads.
  std::error_code restore(const nlohmann::json& snapshot);

  DaemonCounters& counters() { return counters_; }
  const DaemonCounters& counters() const { return counters_; }
  const Limits& limits() const { return limits_; }

 private:
  struct State;
  Limits limits_;
  Environment env_;
  DaemonCounters counters_;
  std::unique_ptr<State> state_;
};

}  // namespace steptrace::daemon
