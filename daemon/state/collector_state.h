// The Collector's private state (daemon/state/collector.h), shared by the files that
// implement it: collector.cpp (the table, views, adopt), collector_ingest.cpp (ingest,
// the state budget), collector_liveness.cpp (liveness, limits, eviction),
// collector_ledger.cpp (the ledger, device truth), read_model.cpp (the plain values the
// reports read, read_model.h) and state_image.cpp, which describes it as a StateImage for
// the snapshot codec (daemon/persist/) and builds a RestoredState of an image it decoded.
// Private to daemon/state/ (docs/ARCHITECTURE.md, checked by scripts/check-includes.py).
//
// Layout for the ingest hot path (Collector::events): the process table is a vector of
// slots indexed by ProcessHandle. A process keeps its per-step aggregates in one dense
// vector: slots 0..11 are the built-in steps, custom steps get the next slots in
// registration order, found through a 1024-entry id -> slot table allocated on the
// first registration. Open spans live per thread, per step slot, as a stack of start
// timestamps; the thread is found through a one-entry cache of the last thread, else a
// hash map. Nothing on that path allocates once a (thread, step) stack has grown.
//
// Copy-on-write, so reports render on another thread (CollectorView, collector.h): process
// records, the ledger view's state and the retired histograms are held by shared_ptr.
// Collector::freeze() copies the pointers (not the data) into a CollectorView; every
// mutation goes through CollectorState::write() / write_retired() (and LedgerView's own
// check), which first clones an object a view still holds. A record's threads (most of a
// big record: their open-span stacks) are shared the same way, one level down: a record's
// clone shares them with the view's, and write_thread() clones one only when ingest
// writes to it, so a view costs ingest a copy of the threads it touches, not of every
// thread of every record it touches (a process filling 256 threads one after another
// copies the one it is in). The io thread alone creates and destroys views and mutates,
// so the use counts it reads are its own.
#pragma once

#include <algorithm>
#include <array>
#include <bitset>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <unistd.h>

#include "daemon/state/charge.h"
#include "daemon/state/collector.h"
#include "daemon/state/histogram.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/ledger_view.h"
#include "daemon/state/rank_window.h"
#include "daemon/state/saturating.h"

namespace steptrace::daemon {

using DropCounts = std::array<std::uint64_t, proto::kReportDropCauseCount>;

struct StepAgg {
  Histogram hist;  // count, total, min, max, percentiles, Prometheus buckets
  std::uint64_t unmatched_ends = 0;
  std::uint64_t abandoned = 0;
  std::uint64_t depth_dropped = 0;  // starts dropped past max_open_depth
  // Time of ended spans minus the time of the spans that ended nested inside them on
  // the same thread (exact when a thread's spans nest; clamped to [0, duration]).
  std::uint64_t self_ns = 0;

  bool has_data() const {
    return hist.count() != 0 || unmatched_ends != 0 || abandoned != 0 || depth_dropped != 0;
  }
  void clear() { *this = StepAgg{}; }
  void merge(const StepAgg& other) {
    hist.merge(other.hist);
    unmatched_ends = saturating_add(unmatched_ends, other.unmatched_ends);
    abandoned = saturating_add(abandoned, other.abandoned);
    depth_dropped = saturating_add(depth_dropped, other.depth_dropped);
    self_ns = saturating_add(self_ns, other.self_ns);
  }
};

// A unique_ptr whose copy copies what it points to, so that a ProcessRecord copies
// deeply with its defaulted copy constructor (ProcessRecord::clone).
template <typename T>
class DeepPtr : public std::unique_ptr<T> {
 public:
  DeepPtr() = default;
  DeepPtr(std::unique_ptr<T> p) : std::unique_ptr<T>(std::move(p)) {}  // NOLINT
  DeepPtr(const DeepPtr& other)
      : std::unique_ptr<T>(other ? std::make_unique<T>(*other) : nullptr) {}
  DeepPtr(DeepPtr&&) noexcept = default;
  DeepPtr& operator=(DeepPtr&&) noexcept = default;
  DeepPtr& operator=(const DeepPtr&) = delete;
};

struct ThreadSpans {
  ThreadSpans() = default;
  // A copy (a record cloned for copy-on-write) keeps every vector's capacity: what a
  // thread was charged for its stacks is their capacity (charge.h), and a copy that held
  // less would be charged again as it grew back.
  ThreadSpans(const ThreadSpans& other);
  ThreadSpans& operator=(const ThreadSpans&) = delete;
  ThreadSpans(ThreadSpans&&) noexcept = default;
  ThreadSpans& operator=(ThreadSpans&&) noexcept = default;

  std::uint32_t tid = 0;
  std::uint32_t open = 0;  // spans open on this thread, all steps
  // By step slot: start timestamps. Only as long as the highest slot this thread used.
  std::vector<std::vector<std::uint64_t>> stacks;
  // By nesting depth (0 = outermost open span): the time of the spans that ended one
  // level deeper while it was open, for self time. At most max_open_depth entries.
  std::vector<std::uint64_t> child_ns;
  std::size_t charged = 0;  // bytes charged for it to the state budget (charge())
};

struct ProcessRecord {
  PeerIdentity peer;
  std::string client_name;      // from the hello
  std::string library_version;  // from the hello
  bool alive = true;
  std::uint32_t connections = 0;
  std::uint64_t attached_at_ns = 0;
  std::uint64_t exited_at_ns = 0;  // CLOCK_MONOTONIC when the exit was noticed
  std::uint64_t exit_order = 0;    // increasing per exit: oldest exited goes first
  std::uint64_t dropped = 0;       // max of the client's cumulative reports
  DropCounts dropped_by_cause{};   // max per cause; daemon_crash: Collector::delivered
  // Event records folded for it (in the snapshot, so across restarts): what a Delivered
  // frame is compared with. Not known for a process restored from an older snapshot.
  std::uint64_t events = 0;
  bool events_known = true;
  // Protocol version 7: the next frame of the process's socket batches not yet applied
  // (batch sequence, index in it); frames before it are a resend's duplicates, skipped.
  // In the snapshot with the totals it describes.
  std::uint64_t batch_sequence = 0;
  std::uint32_t batch_next = 0;
  // The last Delivered frame's count and what the daemon had then (events + refused), and
  // the events of resent batch frames skipped since: Collector::resent_events_skipped.
  // Not in snapshots (each connection sends its own Delivered).
  std::uint64_t hello_delivered = 0;
  std::uint64_t hello_taken = 0;
  std::uint64_t resent_skipped = 0;
  // Ledger records of this process the shared view did not apply (refused, or an anomaly
  // only: each also in stats' ledger_anomalies by kind). The trainer is not answered per
  // record, so its report says it.
  std::uint64_t ledger_refused = 0;
  bool hello_known = false;
  // From the Identity frame (protocol version 4); empty / proto::kNoRank / 0: not sent.
  std::string job;
  std::uint32_t rank = proto::kNoRank;
  std::uint32_t local_rank = proto::kNoRank;
  std::uint32_t world_size = 0;

  std::vector<StepAgg> steps;             // by slot; size kBuiltinStepCount + custom_ids.size()
  std::vector<std::uint32_t> custom_ids;  // slot - kBuiltinStepCount -> step id
  std::vector<std::string> custom_names;  // slot - kBuiltinStepCount -> name
  DeepPtr<std::array<std::uint16_t, proto::kMaxCustomSteps>> custom_slot;  // id -> slot
  // Custom step ids whose RegisterStep a limit refused (max_custom_steps, the state
  // budget): their events are refused and counted, the connection goes on (ending it
  // would only make the client reconnect and register them again, in a loop). Not kept
  // in snapshots: a client registers its steps again on its next connection.
  DeepPtr<std::bitset<proto::kMaxCustomSteps>> refused_custom;

  // Shared with the clones of this record (copy on write: CollectorState::write_thread),
  // so const here; each was made non-const (make_shared<ThreadSpans>), which is what lets
  // write_thread hand out a mutable one once no view shares it.
  std::vector<std::shared_ptr<const ThreadSpans>> threads;
  std::size_t charged = 0;  // state budget bytes: its threads' and custom steps' (charge())
  std::unordered_map<std::uint32_t, std::uint32_t> thread_index;  // tid -> index in threads
  std::uint32_t last_tid = 0;
  // The thread last written, unique to this record (write_thread); a clone of the record
  // starts without it.
  ThreadSpans* last_thread = nullptr;

  ProcessRecord() : steps(proto::kBuiltinStepCount) {}
  // A copy that shares the threads (each cloned when first written, write_thread); the
  // thread cache starts empty.
  std::shared_ptr<ProcessRecord> clone() const;

  const ProcessKey& key() const { return peer.key; }
  std::string_view step_name(std::size_t slot) const {
    return slot < proto::kBuiltinStepCount
               ? proto::kBuiltinStepNames[slot]
               : std::string_view(custom_names[slot - proto::kBuiltinStepCount]);
  }
  std::uint32_t step_id(std::size_t slot) const {
    return slot < proto::kBuiltinStepCount ? static_cast<std::uint32_t>(slot)
                                           : custom_ids[slot - proto::kBuiltinStepCount];
  }
  // Spans open now, per step slot.
  std::vector<std::uint64_t> open_per_slot() const;
  std::uint64_t open_total() const;
  std::size_t memory_bytes() const;
};

using RetiredHistograms = std::map<std::string, Histogram, std::less<>>;

// A job is a uid's processes that sent one job id: keyed by both, so a tenant who
// claims another user's job id makes a job of its own rather than join theirs. The
// processes without a job id are the uid's job "".
struct JobKey {
  std::uint32_t uid = 0;
  std::string job;
  auto operator<=>(const JobKey&) const = default;
};
struct JobStepTotals {
  std::uint64_t count = 0;
  std::uint64_t total_ns = 0;
  std::uint64_t self_ns = 0;
};
// What the processes of a job that left the table (evicted) had, so that per-job
// counters keep counting after them. Jobs with no process left in the table are bounded
// by Limits::max_jobs / max_jobs_per_uid; a job that still has one is kept (forgetting it
// would make its counters go backwards), and there are at most max_processes of those.
using JobStepMap = std::map<std::string, JobStepTotals, std::less<>>;
struct RetiredJob {
  JobStepMap steps;  // at most kMaxJobSteps names
  // The same per rank, for the evicted processes that sent one, so that per-rank
  // counters (steptrace_job_rank_step_*) keep counting across a rank's restarts (a new
  // pid, the same rank) and its old pid's eviction. At most kMaxJobRanks ranks (beyond:
  // not kept per rank, still in `steps`), each at most kMaxJobSteps names. In
  // snapshots (RetiredJobImage::ranks), so the counters go on across a restart.
  std::map<std::uint32_t, JobStepMap> ranks;
  std::uint64_t processes = 0;
  std::uint64_t dropped = 0;
  std::uint64_t retired_order = 0;                  // increasing: the least recent goes first
  static constexpr std::size_t kMaxJobSteps = 256;  // beyond: merged into "(other)"
  static constexpr std::size_t kMaxJobRanks = 1024;
  // (rank, step) names over all its ranks: past it, a rank's new step name goes to that
  // rank's "(other)", so a job's per-rank totals (and their metric series) stay bounded
  // however many ranks x names its processes bring (at most this + kMaxJobRanks).
  static constexpr std::size_t kMaxJobRankSteps = 4096;
  std::size_t rank_steps = 0;  // (rank, step) names in `ranks`
};
using RetiredJobs = std::map<JobKey, RetiredJob, std::less<>>;
// The most retired jobs the state can hold (see RetiredJob), for a snapshot's reader.
inline std::size_t max_retired_jobs(const Limits& limits) {
  return limits.max_jobs + limits.max_processes;
}

struct CollectorState {
  CollectorState(const Limits& limits, DaemonCounters& counters)
      : view_copies(&freed_memory),
        ledger(limits, counters),
        retired(std::make_shared<RetiredHistograms>()),
        retired_jobs(std::make_shared<RetiredJobs>()),
        job_limits(limits),
        counters(&counters) {}
  // Copies share every record (see above): only a view is made this way.
  CollectorState(const CollectorState&) = default;

  // The record of `handle`, cloned first when a view still holds it. Requires a record.
  ProcessRecord& write(ProcessHandle handle) {
    ++generation;
    auto& slot = slots[handle];
    if (slot.use_count() > 1) {
      view_copies.held(slot, heap::record_shell_bytes(*slot));  // charge.h; threads apart
      slot = slot->clone();
    }
    return *slot;
  }
  // Thread `index` of `rec` (a record write() returned), cloned first when a view's copy
  // of the record still holds it.
  ThreadSpans& write_thread(ProcessRecord& rec, std::size_t index) {
    auto& thread = rec.threads[index];
    if (thread.use_count() > 1) {
      view_copies.held(thread, heap::thread_heap_bytes(*thread));
      thread = std::make_shared<ThreadSpans>(*thread);
    }
    // Made non-const (ProcessRecord::threads), and no view holds it now.
    return const_cast<ThreadSpans&>(*thread);  // NOLINT(cppcoreguidelines-pro-type-const-cast)
  }
  // `rec` lets go of `thread` (eviction of its threads, reclaim): a view's copy of the
  // record may still hold it, which then holds it alone.
  void drop_thread(const std::shared_ptr<const ThreadSpans>& thread) {
    if (thread.use_count() > 1) view_copies.held(thread, heap::thread_heap_bytes(*thread));
  }
  RetiredHistograms& write_retired() {
    ++generation;
    if (retired.use_count() > 1) retired = std::make_shared<RetiredHistograms>(*retired);
    return *retired;
  }
  RetiredJobs& write_retired_jobs() {
    ++generation;
    if (retired_jobs.use_count() > 1) retired_jobs = std::make_shared<RetiredJobs>(*retired_jobs);
    return *retired_jobs;
  }

  // The retired histograms and jobs grew or shrank by `bytes` (charge.h): charged, never
  // refused (their bounds are counts: kMaxRetiredNames, max_jobs, kMaxJobSteps).
  void add_retired(std::size_t bytes) {
    retired_charged += bytes;
    charged += bytes;
  }
  void remove_retired(std::size_t bytes) {
    bytes = std::min({bytes, retired_charged, charged});
    retired_charged -= bytes;
    charged -= bytes;
    freed_memory.freed(bytes);
  }

  // Counts the mutations (write(), write_retired*(), a record added): with the ledger's
  // changes(), what tells the snapshot timer the state changed since the last one.
  std::uint64_t generation = 0;
  std::vector<std::shared_ptr<ProcessRecord>> slots;  // by ProcessHandle
  std::vector<ProcessHandle> free_slots;
  std::map<ProcessKey, ProcessHandle> by_key;
  std::size_t exited = 0;
  std::uint64_t next_exit_order = 1;
  // The state budget in use: the records' `charged` summed, and retired_charged.
  std::size_t charged = 0;
  // The retired histograms' and jobs' heap (charge.h), part of `charged`.
  std::size_t retired_charged = 0;
  FreedMemory freed_memory;  // what evictions and closed threads freed, trimmed now and then
  ViewCopies view_copies;    // records cloned by write() that views still hold (charge.h)
  // The records' `charged` by their uid, a uid holding none left out: what the share rule
  // of charge() weighs (how many uids hold state, and who is furthest over its share).
  std::map<std::uint32_t, std::size_t> charged_by_uid;
  // The daemon's own uid: with root, the uids whose state keeps a reserve (charge()).
  std::uint32_t own_uid = ::geteuid();
  LedgerView ledger;
  // Liveness bookkeeping of the ledger's holders (Collector::refresh_liveness): a
  // process's liveness changed since the holders were last checked, and the holders
  // the table does not have that were alive then (probed again each tick).
  bool holders_stale = true;
  std::set<ProcessKey> untracked_live_holders;

  // Prometheus step histograms of processes that were evicted, so the exported
  // per-step counters never go backwards when a process leaves the table.
  std::shared_ptr<RetiredHistograms> retired;
  static constexpr std::size_t kMaxRetiredNames = 4096;  // beyond: merged into "(other)"
  // Per job, the same for per-job counters (max_jobs, max_jobs_per_uid).
  std::shared_ptr<RetiredJobs> retired_jobs;
  std::uint64_t next_retired_order = 1;
  // Per (uid, job, rank) with a process in the table, a ring of cumulative per-step
  // samples (rank_window.h), replaced whole at each sample; its heap (charged like the
  // retired totals, part of retired_charged) and when it was last sampled.
  std::shared_ptr<const RankWindows> rank_windows = std::make_shared<const RankWindows>();
  std::size_t rank_windows_charged = 0;
  std::map<std::uint32_t, std::size_t> rank_windows_by_uid;  // of it, per uid (charged_by_uid)
  std::uint64_t rank_windows_sampled_ns = 0;
  Limits job_limits;                   // max_jobs, max_jobs_per_uid, rank_skew
  DaemonCounters* counters = nullptr;  // the io thread's (a view never writes)
};

// The state budget (Limits::max_process_state_bytes, max_state_bytes): the heap a
// process's input makes the daemon hold, charged before it is allocated, as charge.h
// estimates it: its record, custom steps (aggregate, name), histogram chunks, threads
// and their open-span stacks. charge() is false, with the limit counted, when either
// bound would be passed.
//
// max_state_bytes is shared fairly between uids (issue 26), as a producer of Perfetto's
// gets its own buffer: a uid's share is what it may charge (max_state_bytes, less the
// reserve below unless it is root or the daemon) / the number of uids holding state
// (itself included). While the budget has room anyone is admitted, so a lone
// tenant may use all of it; once it is full, a uid still within its share is admitted
// by reclaiming from the uid furthest over its share (reclaim_state()), and a uid at or
// over its share is refused. So a greedy tenant that filled the budget alone gives back
// what the next tenant's share needs, and can never push anyone under their share.
// Within a uid nothing changes: first come, first kept. Root and the daemon's own uid
// keep a reserve (max_state_bytes / kPrivilegedReserveDivisor) that other uids may not
// charge, so the operator's tools are never starved even before any reclaim.
// A share is counted per uid, not per process: a tenant does not get more by starting
// more processes (max_processes_per_uid bounds those). What ingest cannot keep is
// counted as the process's `refused` drops, never silently. The retired histograms and
// jobs (no uid's alone) count against max_state_bytes, not against any uid's share.
inline constexpr std::size_t kPrivilegedReserveDivisor = 16;
bool charge(CollectorState& state, ProcessRecord& rec, std::size_t bytes, const Limits& limits,
            DaemonCounters& counters);
void uncharge(CollectorState& state, ProcessRecord& rec, std::size_t bytes);
// The per-uid side of the budget (CollectorState::charged_by_uid), for the code that
// adds or removes a whole record's charge (eviction, adopt, a uid that changed).
void charge_uid(CollectorState& state, std::uint32_t uid, std::size_t bytes);
void uncharge_uid(CollectorState& state, std::uint32_t uid, std::size_t bytes);
// Gives back some of `uid`'s state for another uid's share (charge()), cheapest loss
// first: its exited process that exited first (evicted, into the retired totals, a
// max_state_bytes hit); else the threads of its largest live process that have nothing
// open (nothing lost: made again on their next event); else that process's threads with
// open spans (the spans counted as abandoned, as when a connection closes). Custom steps
// of a live process hold its aggregates and stay, those with no span yet too: the client
// registers a step once per connection, so one forgotten would make its next event an
// unregistered_step error that closes the connection (PROTOCOL.md 9.3); keeping just the
// name to re-admit it would save the aggregate alone (a fixed ~360 bytes, in a dense slot
// vector the threads' stacks index) and could refuse an event later for a registration
// once accepted. They are charged to their uid's share, so they cost no other uid
// anything. Threads are taken until `wanted` bytes are free (an exited process goes
// whole). The bytes freed; 0: nothing to take.
std::size_t reclaim_state(CollectorState& state, std::uint32_t uid, std::size_t wanted,
                          DaemonCounters& counters);

// Liveness and eviction, shared by the Collector's ingest, liveness and ledger code.
// Every /proc probe of the Collector: a failed one is counted.
Liveness probe_liveness(const Environment& env, const ProcessKey& key, DaemonCounters& counters);
void mark_exited(CollectorState& state, ProcessRecord& rec, std::uint64_t now);
void mark_alive(CollectorState& state, ProcessRecord& rec);
// Evicts an exited process: of the uid holding the most exited processes (so one
// tenant's churn pushes out its own before anyone's), the one that exited first. False
// when none is exited.
bool evict_oldest_exited(CollectorState& state);
// Evicts exited processes past max_exited_processes (evict_oldest_exited()), each a
// limit hit. A uid holding no more than max_exited_processes / the uids holding exited
// processes is never the one that holds the most while the limit is passed.
void enforce_exited_limit(CollectorState& state, const Limits& limits, DaemonCounters& counters);
// Re-flags the ledger's reservations from the table (and a probe of the untracked ones).
void check_ledger_holders(CollectorState& state, const Environment& env, DaemonCounters& counters);

struct Collector::State : CollectorState {
  using CollectorState::CollectorState;
};

// A StateImage as the table's records (state_image.cpp), for Collector::adopt_restored.
struct RestoredState {
  std::vector<std::shared_ptr<ProcessRecord>> processes;  // distinct keys, no connections
  RetiredHistograms retired;
  RetiredJobs retired_jobs;
  ledger::State ledger;
  DaemonCounters counters;  // added to the daemon's
};

}  // namespace steptrace::daemon
