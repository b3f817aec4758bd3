// The daemon's vocabulary: who a peer is, the bounds it runs under, the counters it
// keeps, and the handle a connection holds. Every room of the daemon includes this; it
// includes no other daemon header, and nothing here needs Asio.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include "daemon/state/rank_skew.h"
#include "proto/codec.h"

namespace steptrace::daemon {

struct ProcessKey {
  std::int32_t pid = 0;
  std::uint64_t start_time = 0;  // /proc/PID/stat field 22, clock ticks since boot
  friend bool operator==(const ProcessKey&, const ProcessKey&) = default;
  friend auto operator<=>(const ProcessKey&, const ProcessKey&) = default;
};

// (uid_t)-1: a uid no process has (setuid(-1) is an error). What the ledger records as
// the holder's uid of a reservation restored from a snapshot written before uids were
// kept, so that only the holder process itself or root may release it.
inline constexpr std::uint32_t kUnknownUid = 0xFFFFFFFF;
// The uid and gid ("nobody") a peer without credentials (SO_PEERCRED failed) is taken
// for: it holds no one's reservations and may reset nothing.
inline constexpr std::uint32_t kNobodyUid = 65534;
inline constexpr std::uint32_t kNobodyGid = 65534;

// What the daemon knows of a peer from the kernel (SO_PEERCRED + /proc).
struct PeerIdentity {
  ProcessKey key;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::string comm;  // /proc/PID/comm
};

struct Limits {
  std::size_t max_processes = 4096;        // kept in total; exited ones go first, oldest out
  std::size_t max_exited_processes = 256;  // exited processes kept for reports
  std::size_t max_custom_steps = 1024;     // per process (<= proto::kMaxCustomSteps)
  std::size_t max_open_depth = 64;         // open spans per (process, thread, step)
  std::size_t max_threads_per_process = 1024;
  std::size_t max_gpus = 64;
  std::size_t max_reservations_per_gpu = 4096;
  // Per-uid quotas (the uid from SO_PEERCRED), so one local user cannot fill a table the
  // others share. The ledger's (enforced by LedgerView): GPU entries a uid created (its
  // Reserve or VramSample added the UUID to the view) that are still there, and
  // reservations a uid holds across all GPUs.
  std::size_t max_gpus_per_uid = 16;
  std::size_t max_reservations_per_uid = 4096;
  // Processes of one uid tracked at once (enforced by the Collector): a quarter of the
  // default max_processes.
  std::size_t max_processes_per_uid = 1024;
  // Jobs (a uid's processes that sent one job id, PROTOCOL.md 4.7b) whose totals are
  // kept after their processes left the table, so per-job counters keep counting; past
  // either bound the job whose last process left longest ago is forgotten.
  std::size_t max_jobs = 256;
  std::size_t max_jobs_per_uid = 64;
  // The state a process's spans make (threads, their open-span stacks, custom steps),
  // per process and in all; past either a new thread, stack slot or custom step is
  // refused and counted (collector_state.h, charge()).
  std::size_t max_process_state_bytes = 16u << 20;
  std::size_t max_state_bytes = 1u << 30;
  // The largest snapshot file written and read (records past it are left out, counted):
  // read a record at a time (a version-1 file, read whole, costs ten times its size).
  std::size_t max_snapshot_bytes = 256u << 20;
  // The longest span kept (a week): one past it, a client's clock or a hostile one, is
  // refused when its end arrives, added to no total and counted (a limit hit, and its two
  // events as the process's `refused` drops), so no tenant's durations set everyone's
  // shares of the time.
  std::uint64_t max_span_ns = 604'800'000'000'000;
  // The ledger's per-GPU activity rows (ledger_state.h): a uid's rows on one GPU, so one
  // uid's churn of short-lived callers cannot fill the GPU's table (max_processes rows);
  // and how long a row stays after its process was seen exited, so rows of processes that
  // are gone (CLI callers, processes of a former daemon) never pile up.
  std::size_t max_ledger_rows_per_uid = 256;
  std::uint64_t max_ledger_row_age_s = 3600;
  // Not a bound: when a rank of a job is flagged a straggler, and the rank windows'
  // sampling (config "rank_skew"; state/rank_skew.h, rank_window.h).
  RankSkewRules rank_skew;
};

// Every bound whose hits are counted (DaemonCounters::limits_hit), named as in the config
// and in stats, metrics and snapshots. Metrics export each at zero before any is hit.
// The configured ones come first; from kFirstFixedLimit on, bounds the config does not
// set (constants of the code), named after what they bound rather than a config key.
enum class LimitKind : std::uint8_t {
  kMaxConnections,  // ServerLimits (serve/config.h)
  kMaxProcesses,
  kMaxExitedProcesses,
  kMaxCustomSteps,
  kMaxOpenDepth,
  kMaxThreadsPerProcess,
  kMaxGpus,
  kMaxReservationsPerGpu,
  kMaxGpusPerUid,
  kMaxReservationsPerUid,
  kMaxProcessesPerUid,
  kMaxConnectionsPerUid,  // ServerLimits (serve/config.h)
  kMaxProcessStateBytes,
  kMaxStateBytes,
  kMaxJobs,
  kMaxJobsPerUid,
  kMaxRingsPerProcess,  // ServerLimits: shared-memory rings (a RingAttach refused)
  kMaxRingsPerUid,
  kMaxRingBytesPerProcess,
  kMaxRingBytesPerUid,
  kMaxRings,  // ServerLimits: rings mapped over all connections (each holds a descriptor)
  kMaxPendingTracesPerUid,  // ServerLimits: `trace --for` replies one uid has waiting
  kMaxSpanNs,
  kMaxPendingReplyBytesPerUid,  // ServerLimits: reply bytes one uid's clients have not read
  kMaxLedgerRowsPerUid,
  // Fixed: a `trace --children` refused past kMaxTraceDescendants descendants or
  // kMaxTraceDescendantTasks threads' children files (serve/trace_selection.h).
  kTraceChildrenDescendants,
  kTraceChildrenThreads,
};
inline constexpr LimitKind kFirstFixedLimit = LimitKind::kTraceChildrenDescendants;
inline constexpr std::array<std::string_view, 27> kLimitNames = {"max_connections",
                                                                 "max_processes",
                                                                 "max_exited_processes",
                                                                 "max_custom_steps",
                                                                 "max_open_depth",
                                                                 "max_threads_per_process",
                                                                 "max_gpus",
                                                                 "max_reservations_per_gpu",
                                                                 "max_gpus_per_uid",
                                                                 "max_reservations_per_uid",
                                                                 "max_processes_per_uid",
                                                                 "max_connections_per_uid",
                                                                 "max_process_state_bytes",
                                                                 "max_state_bytes",
                                                                 "max_jobs",
                                                                 "max_jobs_per_uid",
                                                                 "max_rings_per_process",
                                                                 "max_rings_per_uid",
                                                                 "max_ring_bytes_per_process",
                                                                 "max_ring_bytes_per_uid",
                                                                 "max_rings",
                                                                 "max_pending_traces_per_uid",
                                                                 "max_span_ns",
                                                                 "max_pending_reply_bytes_per_uid",
                                                                 "max_ledger_rows_per_uid",
                                                                 "trace_children_descendants",
                                                                 "trace_children_threads"};
static_assert(static_cast<std::size_t>(LimitKind::kTraceChildrenThreads) + 1 == kLimitNames.size());
constexpr std::string_view limit_name(LimitKind kind) {
  return kLimitNames[static_cast<std::size_t>(kind)];
}

// What the server and its sessions count (daemon/serve/): they own these, the collector
// never touches them. A CollectorView adds them to the collector's own (Collector::freeze).
// What the Prometheus HTTP listener counted (daemon/serve/http_metrics.h).
struct HttpCounters {
  std::uint64_t accepted = 0;         // connections admitted
  std::uint64_t refused = 0;          // over a cap with no connection to evict
  std::uint64_t evicted = 0;          // closed to admit a new connection
  std::uint64_t header_timeouts = 0;  // no complete request within the header timeout
  std::uint64_t idle_closed = 0;      // keep-alive connections idle that long
  std::uint64_t write_timeouts = 0;   // response not taken within the write timeout
  std::uint64_t bad_requests = 0;     // answered 400, 413 or 431
  std::uint64_t responses = 0;        // responses written in full
  // Bytes of metrics texts held for responses not yet written in full (a gauge): each
  // render's text, shared by the scrapes waiting for it, counted once from when the render
  // hands it over until the last of them lets it go (stats memory.http_reply_bytes).
  std::uint64_t reply_bytes = 0;
};

// Shared-memory rings (protocol version 5; daemon/serve/shared_rings.h): the server's
// counts, as they are now (not kept in snapshots).
struct RingCounters {
  std::uint64_t mapped = 0;           // rings mapped now
  std::uint64_t bytes_mapped = 0;     // their bytes
  std::uint64_t attached = 0;         // RingAttach frames answered kMapped, since start
  std::uint64_t refused = 0;          // answered with a refusal (limit or descriptor)
  std::uint64_t events = 0;           // events read from rings
  std::uint64_t records_refused = 0;  // records skipped as invalid (drop cause invalid)
  std::uint64_t bad_rings = 0;        // rings dropped for a head out of range
};

// Whether the daemon's state is durable, as the server (daemon/serve/server.cpp) knows it:
// stats, metrics and the report show it. Times are wall-clock Unix seconds, to compare
// with logs and other hosts (not kept in snapshots).
struct Durability {
  bool enabled = false;  // a state directory is set: snapshots are written
  // The first failure of the current run of failed snapshot writes; none once one succeeds.
  std::optional<std::int64_t> failing_since;
  // The latest snapshot error (a write, or a snapshot unusable at start), kept after a
  // success; "" while none happened.
  std::string last_error;
  // The last good snapshot write, or the restore at start: what a crash would fall back to.
  std::optional<std::int64_t> last_written;
  // When the daemon started empty because the snapshot it found was unusable or rejected
  // (moved aside): totals from before then are missing.
  std::optional<std::int64_t> started_empty_after;
};

struct ServerCounters {
  std::uint64_t frames_received = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t connections_now = 0;
  std::uint64_t connections_total = 0;
  std::uint64_t connections_rejected = 0;          // over max_connections (also a limit hit)
  std::uint64_t connections_rejected_per_uid = 0;  // of those, over max_connections_per_uid
  std::uint64_t connections_undrained = 0;         // queued at shutdown, closed unread
  std::uint64_t commands_served = 0;
  std::uint64_t replies_refused = 0;  // busy: too many reply bytes waiting to be read
  std::uint64_t closed_waiting = 0;   // closed by the client while a trace reply waited
  // Reply bytes queued for text clients that their sockets have not taken yet (a gauge).
  std::uint64_t reply_bytes_pending = 0;
  std::uint64_t snapshots_written = 0;
  std::uint64_t snapshot_errors = 0;
  std::uint64_t snapshot_records_left_out = 0;  // past max_snapshot_bytes, summed per snapshot
  std::map<std::string, std::uint64_t> protocol_errors;  // by errc_name() or session kind
  HttpCounters http;
  RingCounters rings;
  Durability durability;
};

// What the recorder counts (stats, metrics).
struct FlightRecorderCounters {
  std::uint64_t events_recorded = 0;
  std::uint64_t events_evicted = 0;
  std::uint64_t marks_recorded = 0;
  std::uint64_t marks_evicted = 0;
  std::size_t bytes = 0;         // charged now (chunks, marks, windows)
  std::size_t budget_bytes = 0;  // in force now (a capture may raise it)
  std::size_t captures_active = 0;
};

// The NVML device sampler's (daemon/serve/gpu_sampler.h), counted as its samples reach the
// io thread; all 0 when NVML is off or not found.
struct NvmlCounters {
  std::uint64_t samples = 0;        // samples applied to the ledger view
  std::uint64_t sample_errors = 0;  // of those, samples with an error (a call failed)
  std::uint64_t slow_samples = 0;   // samples that took longer than nvml_interval_ms
  std::uint64_t devices = 0;        // GPUs in the last sample
};

// Every counter the daemon shows: stats, metrics, the "daemon" object of report --json,
// and snapshots. The Collector owns one (ingest, limits, and what a snapshot restored of
// the server's); a view holds that plus the server's live ServerCounters.
struct DaemonCounters {
  std::uint64_t events_received = 0;
  std::uint64_t frames_received = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t events_dropped_by_clients = 0;  // sum over processes of their reports
  // The same by proto::DropCause (version-2 clients; a version-1 client's drops have no
  // cause and are only in the total).
  std::array<std::uint64_t, proto::kReportDropCauseCount> events_dropped_by_cause{};
  std::uint64_t connections_now = 0;
  std::uint64_t connections_total = 0;
  std::uint64_t connections_rejected = 0;   // over max_connections
  std::uint64_t connections_undrained = 0;  // queued at shutdown, closed unread
  std::uint64_t liveness_probe_errors = 0;  // /proc probes that failed (EMFILE...): no death
  std::uint64_t commands_served = 0;
  std::uint64_t replies_refused = 0;  // busy: too many reply bytes waiting to be read
  std::uint64_t closed_waiting = 0;   // closed by the client while a trace reply waited
  // Reply bytes queued for text clients that their sockets have not taken yet (a gauge).
  std::uint64_t reply_bytes_pending = 0;
  std::uint64_t snapshots_written = 0;
  std::uint64_t snapshot_errors = 0;
  std::uint64_t snapshot_records_skipped = 0;   // bad records left out at restore
  std::uint64_t snapshot_records_left_out = 0;  // past max_snapshot_bytes, summed per snapshot
  std::uint64_t frames_resent_skipped = 0;      // resent batch frames applied before (version 7)
  std::map<std::string, std::uint64_t> protocol_errors;  // by errc_name()
  HttpCounters http;                       // the server's, as it is now (not kept in snapshots)
  RingCounters rings;                      // the server's, as it is now (not kept in snapshots)
  Durability durability;                   // the server's, as it is now (not kept in snapshots)
  FlightRecorderCounters flight_recorder;  // as it is now (not kept in snapshots)
  NvmlCounters nvml;                       // since start (not kept in snapshots)
  std::map<std::string, std::uint64_t> limits_hit;  // by limit name, e.g. "max_open_depth"
  std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();

  std::uint64_t protocol_errors_total() const;
  // Adds what the server counted (a rejected connection is a max_connections hit).
  void add(const ServerCounters& server);
  void hit(LimitKind kind, std::uint64_t n = 1) { limits_hit[std::string(limit_name(kind))] += n; }
};

// An index into the collector's process table, valid while the connection lives.
using ProcessHandle = std::uint32_t;

}  // namespace steptrace::daemon
