// Collector: the process table (attach, hello, identity), reset, views (freeze, the
// trace capture) and adopting a restored snapshot. Ingest is collector_ingest.cpp,
// liveness and eviction collector_liveness.cpp, the ledger and device truth
// collector_ledger.cpp; what a view answers read_model.cpp, and what a snapshot keeps
// state_image.cpp. Reports are rendered by daemon/report/ from a CollectorView's read
// model; the snapshot codec is in daemon/persist/snapshot_codec.cpp.
#include "daemon/state/collector.h"

#include <algorithm>
#include <set>
#include <utility>

#include "daemon/state/collector_state.h"
#include "daemon/state/counter_table.h"
#include "daemon/state/rank_window.h"
#include "proto/printable.h"

namespace steptrace::daemon {

void DaemonCounters::add(const ServerCounters& server) {
  for (const CounterRow& row : kCounterTable) {
    if (row.server != nullptr) this->*row.field += server.*row.server;
  }
  // Every refused connection is a hit of the limit that refused it.
  const std::uint64_t per_uid = server.connections_rejected_per_uid;
  if (server.connections_rejected > per_uid)
    hit(LimitKind::kMaxConnections, server.connections_rejected - per_uid);
  if (per_uid != 0) hit(LimitKind::kMaxConnectionsPerUid, per_uid);
  http = server.http;
  rings = server.rings;
  durability = server.durability;
  for (const auto& [kind, n] : server.protocol_errors) protocol_errors[kind] += n;
}

std::uint64_t DaemonCounters::protocol_errors_total() const {
  std::uint64_t total = 0;
  for (const auto& [kind, n] : protocol_errors) total += n;
  return total;
}

// ---- ProcessRecord ----------------------------------------------------------------------

std::vector<std::uint64_t> ProcessRecord::open_per_slot() const {
  std::vector<std::uint64_t> open(steps.size(), 0);
  for (const auto& thread : threads) {
    if (thread->open == 0) continue;
    for (std::size_t slot = 0; slot < thread->stacks.size() && slot < open.size(); ++slot) {
      open[slot] += thread->stacks[slot].size();
    }
  }
  return open;
}

std::uint64_t ProcessRecord::open_total() const {
  std::uint64_t n = 0;
  for (const auto& thread : threads) n += thread->open;
  return n;
}

std::shared_ptr<ProcessRecord> ProcessRecord::clone() const {
  // Deep but for the threads, which it shares (copied when written: write_thread).
  auto copy = std::make_shared<ProcessRecord>(*this);
  // The cache points into this record's threads: the next event finds its thread by index.
  copy->last_thread = nullptr;
  copy->last_tid = 0;
  return copy;
}

std::size_t ProcessRecord::memory_bytes() const {
  std::size_t bytes = sizeof(*this) + steps.capacity() * sizeof(StepAgg);
  for (const auto& step : steps) bytes += step.hist.memory_bytes() - sizeof(Histogram);
  bytes += custom_ids.capacity() * sizeof(std::uint32_t);
  for (const auto& name : custom_names) bytes += sizeof(std::string) + name.capacity();
  if (custom_slot) bytes += sizeof(*custom_slot);
  if (refused_custom) bytes += sizeof(*refused_custom);
  for (const auto& thread : threads) {
    bytes += sizeof(std::shared_ptr<const ThreadSpans>) + sizeof(ThreadSpans) +
             thread->stacks.capacity() * sizeof(std::vector<std::uint64_t>);
    for (const auto& stack : thread->stacks) bytes += stack.capacity() * sizeof(std::uint64_t);
  }
  // unordered_map: one bucket pointer per bucket plus one node per entry.
  bytes += thread_index.bucket_count() * sizeof(void*) +
           thread_index.size() * (sizeof(void*) + sizeof(std::pair<std::uint32_t, std::uint32_t>) +
                                  sizeof(std::size_t));
  return bytes;
}

namespace {

using proto::kBuiltinStepCount;

std::size_t live_processes_of(const CollectorState& state, std::uint32_t uid) {
  std::size_t n = 0;
  for (const auto& slot : state.slots) {
    if (slot && slot->alive && slot->peer.uid == uid) ++n;
  }
  return n;
}

}  // namespace

// ---- Collector --------------------------------------------------------------------------

Collector::Collector(Limits limits, Environment env, FlightRecorderConfig recorder)
    : limits_(limits), env_(std::move(env)), recorder_(recorder) {
  limits_.max_custom_steps =
      std::min<std::size_t>(limits_.max_custom_steps, proto::kMaxCustomSteps);
  const Environment system = Environment::system();
  if (!env_.monotonic_now_ns) env_.monotonic_now_ns = system.monotonic_now_ns;
  if (!env_.probe) env_.probe = system.probe;
  state_ = std::make_unique<State>(limits_, counters_);
}

Collector::~Collector() = default;

std::error_code Collector::attach(const PeerIdentity& peer, ProcessHandle& out) {
  State& state = *state_;
  const std::uint64_t now = env_.monotonic_now_ns();
  if (const auto it = state.by_key.find(peer.key); it != state.by_key.end()) {
    ProcessRecord& rec = state.write(it->second);
    mark_alive(state, rec);
    ++rec.connections;
    if (rec.peer.uid != peer.uid) {  // it changed its uid: its state is the new uid's
      uncharge_uid(state, rec.peer.uid, rec.charged);
      charge_uid(state, peer.uid, rec.charged);
    }
    rec.peer.uid = peer.uid;
    rec.peer.gid = peer.gid;
    if (!peer.comm.empty()) rec.peer.comm = peer.comm;
    out = it->second;
    recorder_.begin_process(out, rec.peer);  // a restored process has no window yet
    return {};
  }
  // An older process with this pid that has no connection is gone: its pid was reused.
  // Not when this peer's start time is unknown (its probe failed): then the older record
  // may be this very process, and marking it exited would flag its reservations leaked.
  for (auto it = state.by_key.lower_bound(ProcessKey{peer.key.pid, 0});
       peer.key.start_time != 0 && it != state.by_key.end() && it->first.pid == peer.key.pid;
       ++it) {
    if (state.slots[it->second]->connections == 0) {
      mark_exited(state, state.write(it->second), now);
    }
  }
  enforce_exited_limit(state, limits_, counters_);
  // One uid may not fill the table the others share: its live processes are bounded
  // (exited ones make room by themselves, oldest first).
  if (live_processes_of(state, peer.uid) >= limits_.max_processes_per_uid) {
    counters_.hit(LimitKind::kMaxProcessesPerUid);
    return make_error_code(errc::limit_reached);
  }
  if (state.by_key.size() >= limits_.max_processes && !evict_oldest_exited(state)) {
    // A disconnected process may have died since the last tick: look once per tick, so
    // a flood of refused connections does not probe the whole table each.
    if (!attach_refreshed_) {
      refresh_liveness();
      attach_refreshed_ = true;
    }
    if (state.by_key.size() >= limits_.max_processes && !evict_oldest_exited(state)) {
      counters_.hit(LimitKind::kMaxProcesses);
      return make_error_code(errc::limit_reached);
    }
  }
  auto rec = std::make_shared<ProcessRecord>();
  // Its record is charged, never refused: the process limits bound how many there are.
  rec->charged = heap::record_base_bytes();
  state.charged += rec->charged;
  charge_uid(state, peer.uid, rec->charged);
  rec->peer = peer;
  rec->connections = 1;
  rec->attached_at_ns = now;
  ProcessHandle handle;
  if (!state.free_slots.empty()) {
    handle = state.free_slots.back();
    state.free_slots.pop_back();
    state.slots[handle] = std::move(rec);
  } else {
    handle = static_cast<ProcessHandle>(state.slots.size());
    state.slots.push_back(std::move(rec));
  }
  state.by_key.emplace(peer.key, handle);
  ++state.generation;
  out = handle;
  recorder_.begin_process(handle, peer);
  return {};
}

void Collector::hello(ProcessHandle process, const proto::Hello& hello) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  rec.client_name = proto::field_view(hello.process_name);
  rec.library_version = proto::field_view(hello.library_version);
}

void Collector::identity(ProcessHandle process, const proto::Identity& identity) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  // Every connection of a process sends what its environment said at start: the latest
  // one is kept.
  rec.job = proto::field_view(identity.job);
  rec.rank = identity.rank;
  rec.local_rank = identity.local_rank;
  rec.world_size = identity.world_size;
}

std::size_t Collector::reset(std::optional<std::int32_t> pid) {
  State& state = *state_;
  std::size_t cleared = 0;
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* slot = state.slots[h].get();
    if (!slot || (pid && slot->key().pid != *pid)) continue;
    ProcessRecord& rec = state.write(h);
    for (auto& step : rec.steps) {
      uncharge(state, rec, heap::histogram_heap_bytes(step.hist));  // its chunks go
      step.clear();
    }
    // Its rank's window starts again: cumulative figures that went backwards would
    // make nonsense of the window's deltas (a view keeps the old map; the next sample
    // recounts the windows' charge).
    if (pid && rec.rank != proto::kNoRank) {
      auto windows = std::make_shared<RankWindows>(*state.rank_windows);
      if (windows->erase(RankWindowKey{rec.peer.uid, rec.job, rec.rank}) != 0) {
        state.rank_windows = std::move(windows);
      }
    }
    ++cleared;
  }
  if (!pid) {
    for (const auto& [uid, held] : state.rank_windows_by_uid) uncharge_uid(state, uid, held);
    state.rank_windows_by_uid.clear();
    state.remove_retired(state.retired_charged);
    state.retired = std::make_shared<RetiredHistograms>();
    state.retired_jobs = std::make_shared<RetiredJobs>();
    state.rank_windows = std::make_shared<const RankWindows>();  // its charge went above
    state.rank_windows_charged = 0;
  }
  return cleared;
}

// ---- views ------------------------------------------------------------------------------

CollectorView::CollectorView(const CollectorState& state, const DaemonCounters& counters,
                             std::uint64_t now_ns)
    : state_(std::make_unique<const CollectorState>(state)),
      counters_(counters),
      now_ns_(now_ns),
      uptime_(std::chrono::steady_clock::now() - counters.started) {}

CollectorView::~CollectorView() = default;

std::uint64_t Collector::generation() const {
  return state_->generation + state_->ledger.changes();
}

bool Collector::view_copies_over_bound() const {
  return state_->view_copies.held_bytes() > view_copy_bound(state_->charged);
}

std::shared_ptr<const CollectorView> Collector::freeze(const ServerCounters* server) const {
  DaemonCounters counters = counters_;
  counters.flight_recorder = recorder_.counters();
  if (server != nullptr) counters.add(*server);
  return std::shared_ptr<const CollectorView>(
      new CollectorView(*state_, counters, env_.monotonic_now_ns()));
}

std::shared_ptr<const TraceCapture> Collector::capture_trace(const std::set<std::int32_t>& pids,
                                                             std::uint64_t since_ns) const {
  std::shared_ptr<TraceCapture> capture =
      recorder_.capture(pids, since_ns, env_.monotonic_now_ns());
  // Liveness is the table's (a window outlives its process's record).
  for (TraceCapture::Process& p : capture->processes) {
    const auto it = state_->by_key.find(p.key);
    p.alive = it != state_->by_key.end() && state_->slots[it->second]->alive;
    if (it != state_->by_key.end()) {
      const ProcessRecord& rec = *state_->slots[it->second];
      p.uid = rec.peer.uid;
      p.job = rec.job;
      p.rank = rec.rank;
    }
  }
  return capture;
}

// ---- adopt (a snapshot's state: Collector::adopt(StateImage), state_image.cpp) ---------

namespace {

// A restored record's open spans under this daemon's limits (they may be lower than the
// snapshot's writer's): each thread charged as ingest charges one; a thread past
// max_threads_per_process, or nested deeper than max_open_depth, is abandoned.
void charge_restored_threads(ProcessRecord& rec, const Limits& limits) {
  std::vector<std::shared_ptr<const ThreadSpans>> kept;
  for (auto& thread : rec.threads) {
    if (kept.size() >= limits.max_threads_per_process || thread->open > limits.max_open_depth) {
      for (std::size_t slot = 0; slot < thread->stacks.size(); ++slot)
        rec.steps[slot].abandoned += thread->stacks[slot].size();
      continue;
    }
    // Restored: made non-const (state_image.cpp), and no view holds it yet.
    const_cast<ThreadSpans&>(*thread).charged =  // NOLINT(cppcoreguidelines-pro-type-const-cast)
        heap::thread_bytes(*thread);
    kept.push_back(std::move(thread));
  }
  rec.threads = std::move(kept);
  rec.thread_index.clear();
  for (std::uint32_t i = 0; i < rec.threads.size(); ++i) rec.thread_index[rec.threads[i]->tid] = i;
}

}  // namespace

std::error_code Collector::adopt_restored(RestoredState restored) {
  for (const auto& slot : state_->slots) {
    // Live sessions hold handles into the table that this would invalidate.
    if (slot && slot->connections > 0)
      return std::make_error_code(std::errc::device_or_resource_busy);
  }
  auto next = std::make_unique<State>(limits_, counters_);
  std::uint64_t max_order = 0;
  for (auto& rec : restored.processes) {
    // What it holds (charge.h), its threads with open spans included.
    charge_restored_threads(*rec, limits_);
    rec->charged = heap::record_bytes(*rec);
    next->charged += rec->charged;
    charge_uid(*next, rec->peer.uid, rec->charged);
    if (!rec->alive) {
      ++next->exited;
      max_order = std::max(max_order, rec->exit_order);
    }
    next->by_key.emplace(rec->key(), static_cast<ProcessHandle>(next->slots.size()));
    next->slots.push_back(std::move(rec));
  }
  next->next_exit_order = max_order + 1;
  for (const auto& [name, hist] : restored.retired)
    next->add_retired(heap::retired_histogram_bytes(name, hist));
  for (const auto& [key, job] : restored.retired_jobs)
    next->add_retired(heap::retired_job_bytes(key, job));
  *next->retired = std::move(restored.retired);
  for (const auto& [key, job] : restored.retired_jobs) {
    next->next_retired_order = std::max(next->next_retired_order, job.retired_order + 1);
  }
  *next->retired_jobs = std::move(restored.retired_jobs);
  next->ledger.adopt(std::move(restored.ledger), env_.monotonic_now_ns());
  state_ = std::move(next);

  DaemonCounters& c = counters_;
  const DaemonCounters& r = restored.counters;
  for (const CounterRow& row : kCounterTable) {
    if (row.kept != Kept::kNo) c.*row.field = saturating_add(c.*row.field, r.*row.field);
  }
  for (std::size_t i = 0; i < proto::kReportDropCauseCount; ++i)
    c.events_dropped_by_cause[i] =
        saturating_add(c.events_dropped_by_cause[i], r.events_dropped_by_cause[i]);
  for (const auto& [k, v] : r.protocol_errors)
    c.protocol_errors[k] = saturating_add(c.protocol_errors[k], v);
  for (const auto& [k, v] : r.limits_hit) c.limits_hit[k] = saturating_add(c.limits_hit[k], v);
  // Restored processes have no connection: ask /proc who is still there.
  refresh_liveness();
  while (state_->by_key.size() > limits_.max_processes && evict_oldest_exited(*state_)) {
  }
  return {};
}

}  // namespace steptrace::daemon
