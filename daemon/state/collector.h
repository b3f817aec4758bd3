// The daemon's state: every process seen, its per-step aggregates and open spans, the
// VRAM ledger view, and the counters of ingest (reports: daemon/report/).
//
// Data flow: Session (one per connection, daemon/serve/session.*) decodes frames with
// proto::Decoder and hands each validated message to the Collector through the
// ProcessHandle it got from attach(). Everything runs on the one io_context thread, so
// the Collector takes no locks. Reports, metrics and snapshots read the same state.
// Snapshots are not made here: the snapshot codec (daemon/persist/snapshot_codec.h)
// encodes a CollectorView's image() (daemon/state/state_image.h) and decodes a document
// into a StateImage, which Collector::adopt() installs.
//
// A process is identified by (pid, start_time) from SO_PEERCRED and /proc, never by a
// pid the client claims; a recycled pid is a new process. Several connections of one
// process (reconnects, a library reopened) share one process record.
//
// The Collector's code, by role: collector.cpp (the table: attach, hello, identity,
// reset, views, adopt), collector_ingest.cpp (events, step registration, drop reports,
// the state budget), collector_liveness.cpp (detach, the liveness tick, exits,
// eviction), collector_ledger.cpp (ledger records, cleanup, device truth).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "daemon/state/flight_recorder.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/proc_probe.h"
#include "daemon/state/read_model.h"
#include "daemon/state/types.h"
#include "proto/codec.h"

namespace steptrace::daemon {

struct CollectorState;
struct ProcessRecord;
struct RestoredState;
struct StateImage;
class CollectorView;

// The collector's state at one instant, for rendering: cheap to make (process records,
// the ledger and the retired histograms are shared copy-on-write, see
// collector_state.h), immutable, and safe to read on another thread while ingest goes on.
// Made and destroyed on the io thread only (Collector::freeze, daemon/serve/render_worker.h).
class CollectorView {
 public:
  ~CollectorView();
  CollectorView(const CollectorView&) = delete;
  CollectorView& operator=(const CollectorView&) = delete;

  // CLOCK_MONOTONIC when the view was made: "open for" and "exited ago" count to it.
  std::uint64_t now_ns() const { return now_ns_; }

  // ---- the read model (read_model.h; read_model.cpp) ----------------------------------
  // Processes in (pid, start_time) order: all, one pid's, one job's (that uid's
  // processes with that job id), or those of both.
  std::vector<ProcessFigures> processes(std::optional<std::int32_t> pid = std::nullopt,
                                        const std::optional<JobRef>& job = {}) const;
  // The uids with a process in the table that sent job id `job`, ascending: whom a
  // `--job ID` could mean (commands.cpp resolves it).
  std::vector<std::uint32_t> uids_with_job(std::string_view job) const;
  // Their steps merged by name, built-ins first in enum order, then custom names
  // alphabetically; steps without data left out.
  std::vector<StepFigures> totals(std::span<const ProcessFigures> processes) const;
  std::vector<StepFigures> totals(std::span<const ProcessFigures* const> processes) const;
  // Grouped by (uid, job id), in that order; each group's processes in the given order.
  std::vector<JobFigures> jobs(std::span<const ProcessFigures> processes) const;
  // The same, each job with what its evicted processes left (JobFigures::retired), and
  // the jobs that only those have included: the per-job counters (metrics pass every
  // process).
  std::vector<JobFigures> jobs_and_retired(std::span<const ProcessFigures> processes) const;
  // A job points into the processes it was given: a temporary would leave it dangling
  // (`view.jobs(view.processes())`), so that does not compile.
  std::vector<JobFigures> jobs(std::vector<ProcessFigures>&&) const = delete;
  std::vector<JobFigures> jobs_and_retired(std::vector<ProcessFigures>&&) const = delete;
  // Per step name, the histogram over every process in the table and every one evicted
  // from it, so that it never goes backwards. Names in the order first met: the table's
  // processes in the order it holds them (each process's steps in registration order,
  // built-ins first), then names only evicted processes had, alphabetically. A step of
  // the table's without an ended span is left out. (The order decides which names a
  // renderer that bounds its series keeps.)
  std::vector<StepHistogram> step_histograms() const;
  // Rank skew of a job (rank_skew.h): over its processes given (a report's) and, with
  // `window_ns`, over the rank windows (rank_window.h). Empty below two ranks.
  JobRankSkew rank_skew(const JobFigures& job, std::optional<std::uint64_t> window_ns) const;
  const RankSkewRules& rank_skew_rules() const;  // which steps are waiting ones (metrics)
  TableFigures table() const;
  const ledger::State& ledger() const;
  // What a snapshot keeps of it, as plain values (state_image.h; state_image.cpp). Spans
  // open now are counted as abandoned: whoever installs the image cannot end them.
  StateImage image() const;

  const DaemonCounters& counters() const { return counters_; }
  std::chrono::steady_clock::duration uptime() const { return uptime_; }

 private:
  friend class Collector;
  CollectorView(const CollectorState& state, const DaemonCounters& counters, std::uint64_t now_ns);

  std::unique_ptr<const CollectorState> state_;
  DaemonCounters counters_;
  std::uint64_t now_ns_;
  std::chrono::steady_clock::duration uptime_;  // at the view's instant
};

// What `ledger cleanup GPU ID` did (Collector::operator_cleanup).
struct CleanupOutcome {
  enum class Result : std::uint8_t {
    kCleaned,        // removed, credited to the sender
    kNoReservation,  // no such GPU, or no such reservation on it
    kBadGpu,         // the GPU UUID does not fit a Cleanup record
    kDenied,         // the holder is alive and its lease not expired; not root, not its uid
  };
  enum class Holder : std::uint8_t { kAlive, kLeaked, kExpired };
  Result result = Result::kNoReservation;
  // The reservation as it was (kCleaned, kDenied).
  std::int32_t holder_pid = 0;
  std::uint32_t holder_uid = kUnknownUid;  // kUnknownUid: restored from an older snapshot
  Holder holder = Holder::kAlive;
};

class Collector {
 public:
  Collector(Limits limits, Environment env, FlightRecorderConfig recorder = {});
  ~Collector();
  Collector(const Collector&) = delete;
  Collector& operator=(const Collector&) = delete;

  // ---- ingest (one call per decoded message) --------------------------------------
  // A new connection from `peer`. Fails with errc::limit_reached when the process table
  // is full of live processes.
  std::error_code attach(const PeerIdentity& peer, ProcessHandle& out);
  void hello(ProcessHandle process, const proto::Hello& hello);
  // Protocol version 4: the process's job id and ranks (the decoder validated them).
  void identity(ProcessHandle process, const proto::Identity& identity);
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
  // A Delivered frame (protocol version 6): what earlier daemons took of the process's
  // events. Beyond what this daemon counted for it, they were lost with a daemon that
  // stopped before it made them durable: counted as the process's daemon_crash drops.
  void delivered(ProcessHandle process, std::uint64_t delivered);
  // Records of the process's shared rings the daemon consumed (moved the tail past) and
  // folded nowhere: bad ones, or of a custom step never registered. Its `refused` drops,
  // cumulative and kept in snapshots, so that they are in what the daemon took when a
  // later Delivered frame (which counts every record past the tail) is compared with it.
  void refused_records(ProcessHandle process, std::uint64_t records);
  // Protocol version 7: frame `index` of socket batch `sequence` of the process arrived.
  // True when it is to be applied (it follows every frame applied so far: the process's
  // cursor moves past it); false for a frame applied before (a batch the client resent
  // after a lost connection, or one that overtook it on another connection), counted.
  bool batch_frame(ProcessHandle process, std::uint64_t sequence, std::uint32_t index);
  // The `events` of a skipped batch frame: they are in what the daemon had when the
  // Delivered frame came and not in that frame's count, so its daemon_crash comparison
  // is made again with them.
  void resent_events_skipped(ProcessHandle process, std::uint64_t events);
  // The daemon is stopping gracefully: the connections it closes from now on keep their
  // processes' open spans (for the final snapshot) instead of abandoning them.
  void stopping() { stopping_ = true; }
  // Whether an event of `step` can be folded for the process now: a built-in step, a
  // custom one it registered, or one whose registration a limit refused (events() counts
  // those as refused). Shared-memory rings wait for the registration of any other.
  bool step_known(ProcessHandle process, std::uint32_t step) const;
  // A configured bound of the server's was hit (shared-memory rings).
  void count_limit(LimitKind kind) { counters_.hit(kind); }
  // The connection closed. Spans it left open are counted as abandoned when the process
  // has no other connection; liveness is then checked against /proc.
  void detach(ProcessHandle process);

  // The liveness tick (a timer; never a report): re-checks processes without a
  // connection against /proc, one probe each, marks the dead ones exited and re-flags
  // the ledger's reservations from that. Its cost does not grow with the reservations.
  // A probe that fails (EMFILE...) is counted, not taken for a death.
  void refresh_liveness();

  // ---- control ----------------------------------------------------------------------
  // Clears aggregates (all, or one pid's); the ledger view and counters stay.
  // Returns how many processes were cleared (with `pid`: 0 when it is not tracked).
  std::size_t reset(std::optional<std::int32_t> pid);
  // Clears the ledger's GPUs (all, or the one named); how many went. Root only: the
  // command checks.
  std::size_t reset_ledger(std::optional<std::string_view> gpu);
  // `ledger cleanup GPU ID`: `peer` (the command's sender) removes a reservation under
  // the rules of a Cleanup record (PROTOCOL.md 4.6), credited to it. What happened, as
  // plain values (the reply line is report::cleanup_reply's).
  CleanupOutcome operator_cleanup(const PeerIdentity& peer, std::string_view gpu, std::uint64_t id);

  // ---- reports ---------------------------------------------------------------------
  // The state now, to render on any thread with the functions of daemon/report/report.h.
  // The daemon renders every report from a view on its render thread.
  // `server`: the server's counters, added to the view's (none in unit tests of state).
  std::shared_ptr<const CollectorView> freeze(const ServerCounters* server = nullptr) const;
  // Grows with every change of the state (processes, retired totals, ledger): equal
  // values mean nothing a snapshot holds changed in between, but the counters.
  std::uint64_t generation() const;
  // Records cloned while views held them, still held by one (ViewCopies, charge.h), are
  // over view_copy_bound() of the charge now: the render worker freezes no second view.
  bool view_copies_over_bound() const;

  // ---- timeline (daemon/state/flight_recorder.h) --------------------------------------
  // The flight recorder's window now, for `trace` (all processes, or those pids; events
  // and marks stamped before since_ns left out). Exited processes' windows included.
  std::shared_ptr<const TraceCapture> capture_trace(const std::set<std::int32_t>& pids,
                                                    std::uint64_t since_ns) const;
  // `trace --for`: begin_capture() / end_capture().
  FlightRecorder& recorder() { return recorder_; }
  std::uint64_t now_ns() const { return env_.monotonic_now_ns(); }

  // ---- device truth (daemon/serve/gpu_sampler.h) --------------------------------------
  // NVML's latest sample of every GPU, by UUID; `error`: what failed ("" if nothing);
  // `slow_samples`: the sampler's count of samples slower than its interval so far.
  void apply_devices(std::map<std::string, ledger::Device, std::less<>> devices, std::string error,
                     std::uint64_t now_ns, std::uint64_t slow_samples);
  void set_device_rules(const ledger::DeviceRules& rules);

  // ---- persistence -------------------------------------------------------------------
  // Replaces the state with `image` (one the snapshot codec decoded: restore_from_snapshot,
  // daemon/persist/snapshot_codec.h) and adds its counters to the daemon's. Restored
  // processes have no connection, so their liveness is checked against /proc at once,
  // and exited ones beyond the limits are evicted. Fails (state unchanged) with
  // std::errc::device_or_resource_busy while a connection is attached: its session holds
  // a handle into the table this replaces; with std::errc::invalid_argument when the
  // image breaks its own rules (state_image.h: a key or a step id twice, a step id
  // neither built-in nor registered), which the codec refuses with a reason first.
  std::error_code adopt(StateImage image);

  // Ingest's own counts and limit hits, plus what a snapshot restored of the server's.
  const DaemonCounters& counters() const { return counters_; }
  const Limits& limits() const { return limits_; }

 private:
  struct State;
  // adopt(), once the image is the table's records (state_image.cpp).
  std::error_code adopt_restored(RestoredState restored);
  Limits limits_;
  Environment env_;
  DaemonCounters counters_;
  std::unique_ptr<State> state_;
  void refresh_holder(const proto::LedgerRecord& record);
  void age_ledger_rows();  // collector_ledger.cpp; on the liveness tick
  std::uint64_t raise_dropped(ProcessRecord& rec, std::uint64_t total_dropped);
  // Spans of `rec` past max_span_ns, refused at their end: counted (Limits::max_span_ns).
  void refuse_spans(ProcessRecord& rec, std::uint64_t spans);
  // Events of `rec` the daemon took, counted in its `events`, and keeps nowhere: out of
  // `events`, into its `refused` drops (count_refused).
  void refuse_events(ProcessRecord& rec, std::uint64_t events);
  // Records of `rec` the daemon took and never counted: its `refused` drops.
  void count_refused(ProcessRecord& rec, std::uint64_t records);
  // daemon_crash becomes `lost` if that is more (cumulative, the maximum kept).
  void raise_crash(ProcessRecord& rec, std::uint64_t lost);
  // A drop as a TraceMark, stamped `ts_ns` (a client timestamp), else now.
  void mark_drop(const ProcessKey& sender, std::uint8_t cause, std::uint64_t more,
                 std::optional<std::uint64_t> ts_ns = std::nullopt);
  FlightRecorder recorder_;

  bool attach_refreshed_ = false;        // attach() refreshed liveness since the last tick
  bool stopping_ = false;                // stopping(): detach keeps open spans
  std::set<ProcessKey> holders_probed_;  // by refresh_holder() since the last tick
};

}  // namespace steptrace::daemon
