// The daemon's plain counters (DaemonCounters' std::uint64_t fields), one row each: the
// one place that says what each is called in `stats --json`, in a snapshot and in
// Prometheus, whether the server counts it (DaemonCounters::add) and whether a snapshot
// keeps it (Collector::adopt adds it back). The struct fields are in types.h; everything
// else that names one of these counters derives from this table:
//   - DaemonCounters::add and Collector::adopt (daemon/state/collector.cpp),
//   - the snapshot codec's counters object (daemon/persist/snapshot_codec.cpp),
//   - `stats --json` (daemon/report/report_json.cpp) and the metrics
//     (daemon/report/metrics_text.cpp).
// The counters kept by kind (drop causes, protocol errors, limits) and the families of
// their own (HTTP, rings, flight recorder, NVML) are not in it.
#pragma once

#include <array>
#include <cstdint>
#include <string_view>

#include "daemon/state/types.h"

namespace steptrace::daemon {

// Where a counter's metric family sits in the Prometheus text (metrics_text.cpp writes
// each group's rows at one place, in table order).
enum class MetricGroup : std::uint8_t { kIngest, kConnections, kSnapshots };

// Whether a snapshot keeps a counter, and since when.
enum class Kept : std::uint8_t {
  kNo,       // the server's live state, or counted again from nothing at start
  kSinceV1,  // in every snapshot: required when reading
  kLater,    // added after version 1: absent in older snapshots (read as 0)
};

struct CounterRow {
  std::uint64_t DaemonCounters::*field;
  std::uint64_t ServerCounters::*server;  // the server's own count, added by add(); or null
  std::string_view stats_group;           // the object of `stats --json` it sits in ("": top)
  std::string_view stats_key;
  Kept kept;
  std::string_view snapshot_key;  // its key in a snapshot's "counters" object
  MetricGroup metric_group;
  std::string_view metric;  // the Prometheus family
  std::string_view metric_type;
  std::string_view help;
};

inline constexpr std::array<CounterRow, 18> kCounterTable = {{
    {&DaemonCounters::events_received, nullptr, "", "events_received", Kept::kSinceV1,
     "events_received", MetricGroup::kIngest, "steptrace_events_received_total", "counter",
     "Span events received from clients."},
    {&DaemonCounters::frames_received, &ServerCounters::frames_received, "", "frames_received",
     Kept::kSinceV1, "frames_received", MetricGroup::kIngest, "steptrace_frames_received_total",
     "counter", "Frames received from clients."},
    {&DaemonCounters::bytes_received, &ServerCounters::bytes_received, "", "bytes_received",
     Kept::kSinceV1, "bytes_received", MetricGroup::kIngest, "steptrace_received_bytes_total",
     "counter", "Bytes received from clients."},
    {&DaemonCounters::events_dropped_by_clients, nullptr, "", "events_dropped_by_clients",
     Kept::kSinceV1, "events_dropped_by_clients", MetricGroup::kIngest,
     "steptrace_events_dropped_by_clients_total", "counter",
     "Events clients reported they could not deliver (daemon absent or slow)."},
    {&DaemonCounters::frames_resent_skipped, nullptr, "", "frames_resent_skipped", Kept::kLater,
     "frames_resent_skipped", MetricGroup::kIngest, "steptrace_frames_resent_skipped_total",
     "counter",
     "Frames of socket batches a client resent after a lost connection that the daemon had "
     "applied before (skipped: never counted twice)."},
    {&DaemonCounters::connections_now, &ServerCounters::connections_now, "connections", "now",
     Kept::kNo, "", MetricGroup::kConnections, "steptrace_connections", "gauge",
     "Client connections open now."},
    {&DaemonCounters::connections_total, &ServerCounters::connections_total, "connections", "total",
     Kept::kSinceV1, "connections_total", MetricGroup::kConnections,
     "steptrace_connections_accepted_total", "counter", "Client connections accepted."},
    {&DaemonCounters::connections_rejected, &ServerCounters::connections_rejected, "connections",
     "rejected", Kept::kSinceV1, "connections_rejected", MetricGroup::kConnections,
     "steptrace_connections_rejected_total", "counter",
     "Client connections refused over max_connections or max_connections_per_uid."},
    {&DaemonCounters::connections_undrained, &ServerCounters::connections_undrained, "connections",
     "undrained", Kept::kLater, "connections_undrained", MetricGroup::kConnections,
     "steptrace_connections_undrained_total", "counter",
     "Connections queued at shutdown that were closed unread (no room to drain)."},
    {&DaemonCounters::liveness_probe_errors, nullptr, "", "liveness_probe_errors", Kept::kLater,
     "liveness_probe_errors", MetricGroup::kConnections, "steptrace_liveness_probe_errors_total",
     "counter", "/proc probes that failed (EMFILE...); never taken for a process's death."},
    {&DaemonCounters::commands_served, &ServerCounters::commands_served, "", "commands_served",
     Kept::kSinceV1, "commands_served", MetricGroup::kConnections,
     "steptrace_commands_served_total", "counter", "Text commands answered."},
    {&DaemonCounters::replies_refused, &ServerCounters::replies_refused, "", "replies_refused",
     Kept::kLater, "replies_refused", MetricGroup::kConnections, "steptrace_replies_refused_total",
     "counter", "Replies replaced by 'error: busy': too many reply bytes waited to be read."},
    // Counted again from nothing at start: a live connection's fate, like connections.now.
    {&DaemonCounters::closed_waiting, &ServerCounters::closed_waiting, "connections",
     "closed_waiting", Kept::kNo, "", MetricGroup::kConnections,
     "steptrace_connections_closed_waiting_total", "counter",
     "Connections their client closed while a trace reply waited (trace --for's wait, or a "
     "piece's turn on the render thread): the wait ended at once, its capture, reply and "
     "connection freed."},
    // Memory the daemon holds beside its state: replies rendered, not yet read.
    {&DaemonCounters::reply_bytes_pending, &ServerCounters::reply_bytes_pending, "memory",
     "reply_bytes_pending", Kept::kNo, "", MetricGroup::kConnections,
     "steptrace_reply_bytes_pending", "gauge",
     "Bytes queued to clients (text replies, binary acks and errors) and not yet taken by "
     "their sockets."},
    {&DaemonCounters::snapshots_written, &ServerCounters::snapshots_written, "snapshots", "written",
     Kept::kNo, "", MetricGroup::kSnapshots, "steptrace_snapshots_written_total", "counter",
     "State snapshots written."},
    {&DaemonCounters::snapshot_errors, &ServerCounters::snapshot_errors, "snapshots", "errors",
     Kept::kNo, "", MetricGroup::kSnapshots, "steptrace_snapshot_errors_total", "counter",
     "State snapshots that failed to write."},
    {&DaemonCounters::snapshot_records_skipped, nullptr, "snapshots", "records_skipped", Kept::kNo,
     "", MetricGroup::kSnapshots, "steptrace_snapshot_records_skipped_total", "counter",
     "Snapshot records skipped at start-up: damaged, torn, past the limits or breaking a "
     "rule (the rest was restored)."},
    {&DaemonCounters::snapshot_records_left_out, &ServerCounters::snapshot_records_left_out,
     "snapshots", "records_left_out", Kept::kNo, "", MetricGroup::kSnapshots,
     "steptrace_snapshot_records_left_out_total", "counter",
     "Records left out of snapshots written, past limits.max_snapshot_bytes (summed over "
     "snapshots; the uid with the most loses its last processes first)."},
}};

}  // namespace steptrace::daemon
