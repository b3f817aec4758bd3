// Collector: the process table, ingest (the hot path), liveness, limits, reset and
// adopting a restored snapshot. Reports are rendered by daemon/report/ from a CollectorView; the
// snapshot codec is in daemon/persist/snapshot_codec.cpp.
#include "daemon/state/collector.h"

#include <algorithm>
#include <limits>
#include <set>
#include <utility>

#include "daemon/state/collector_state.h"
#include "daemon/state/counter_table.h"
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
  for (const auto& [kind, n] : server.protocol_errors) protocol_errors[kind] += n;
}

std::uint64_t DaemonCounters::protocol_errors_total() const {
  std::uint64_t total = 0;
  for (const auto& [kind, n] : protocol_errors) total += n;
  return total;
}

// ---- ProcessRecord -------------------------------------------------------------------

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
  auto copy = std::make_shared<ProcessRecord>(*this);  // deep: DeepPtr members
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
  for (const auto& thread : threads) {
    bytes += sizeof(DeepPtr<ThreadSpans>) + sizeof(ThreadSpans) +
             thread->stacks.capacity() * sizeof(std::vector<std::uint64_t>);
    for (const auto& stack : thread->stacks) bytes += stack.capacity() * sizeof(std::uint64_t);
  }
  // unordered_map: one bucket pointer per bucket plus one node per entry.
  bytes += thread_index.bucket_count() * sizeof(void*) +
           thread_index.size() * (sizeof(void*) + sizeof(std::pair<std::uint32_t, std::uint32_t>) +
                                  sizeof(std::size_t));
  return bytes;
}

// ---- the state budget (collector_state.h) ----------------------------------------------

bool charge(CollectorState& state, ProcessRecord& rec, std::size_t bytes, const Limits& limits,
            DaemonCounters& counters) {
  if (rec.charged + bytes > limits.max_process_state_bytes) {
    counters.hit(LimitKind::kMaxProcessStateBytes);
    return false;
  }
  if (state.charged + bytes > limits.max_state_bytes) {
    counters.hit(LimitKind::kMaxStateBytes);
    return false;
  }
  rec.charged += bytes;
  state.charged += bytes;
  return true;
}

void uncharge(CollectorState& state, ProcessRecord& rec, std::size_t bytes) {
  bytes = std::min({bytes, rec.charged, state.charged});
  rec.charged -= bytes;
  state.charged -= bytes;
}

// ---- helpers over the state ----------------------------------------------------------

namespace {

using proto::kBuiltinStepCount;

}  // namespace

// Every probe of the collector goes through here: a failed one is counted.
Liveness probe_liveness(const Environment& env, const ProcessKey& key, DaemonCounters& counters) {
  const Liveness liveness = liveness_of(env.probe(key.pid), key.start_time);
  if (liveness == Liveness::kUnknown) ++counters.liveness_probe_errors;
  return liveness;
}

void mark_exited(CollectorState& state, ProcessRecord& rec, std::uint64_t now) {
  if (!rec.alive) return;
  rec.alive = false;
  rec.exited_at_ns = now;
  rec.exit_order = state.next_exit_order++;
  ++state.exited;
  state.holders_stale = true;
}

void mark_alive(CollectorState& state, ProcessRecord& rec) {
  if (rec.alive) return;
  rec.alive = true;
  rec.exited_at_ns = 0;
  rec.exit_order = 0;
  --state.exited;
  state.holders_stale = true;
}

namespace {

// Spans still open when the process's last connection closed will never end.
void abandon_open_spans(CollectorState& state, ProcessRecord& rec) {
  for (auto& thread : rec.threads) {
    for (std::size_t slot = 0; slot < thread->stacks.size(); ++slot) {
      rec.steps[slot].abandoned += thread->stacks[slot].size();
    }
    uncharge(state, rec, thread->charged);
  }
  rec.threads.clear();
  rec.thread_index.clear();
  rec.last_thread = nullptr;
  rec.last_tid = 0;
}

void retire(CollectorState& state, const ProcessRecord& rec) {
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    const Histogram& hist = rec.steps[slot].hist;
    if (hist.count() == 0) continue;
    std::string name(rec.step_name(slot));
    RetiredHistograms& retired = state.write_retired();
    auto it = retired.find(name);
    if (it == retired.end()) {
      if (retired.size() >= CollectorState::kMaxRetiredNames) name = "(other)";
      it = retired.try_emplace(name).first;
    }
    it->second.merge(hist);
  }
}

// Past max_jobs_per_uid (that uid's) or max_jobs (anyone's) retired jobs, the job
// retired least recently is forgotten, counted as a hit of that limit. Only jobs with no
// process left in the table count and can be forgotten: forgetting one that still has
// processes would make its counters go backwards (the table's share stays, the retired
// share goes). Run after an eviction, when the evicted process's job may have lost its
// last process.
void enforce_job_limits(CollectorState& state, std::uint32_t uid) {
  const std::size_t retired = state.retired_jobs->size();
  if (retired <= state.job_limits.max_jobs_per_uid && retired <= state.job_limits.max_jobs) {
    return;  // within both limits even if none had a process left
  }
  std::set<JobKey, std::less<>> in_table;
  for (const auto& slot : state.slots) {
    if (slot) in_table.insert(JobKey{slot->peer.uid, slot->job});
  }
  const auto forgettable = [&](const RetiredJobs::value_type& j, bool of_uid) {
    return (!of_uid || j.first.uid == uid) && !in_table.contains(j.first);
  };
  const auto count = [&](bool of_uid) {
    const RetiredJobs& jobs = *state.retired_jobs;
    return static_cast<std::size_t>(std::count_if(
        jobs.begin(), jobs.end(), [&](const auto& j) { return forgettable(j, of_uid); }));
  };
  // False when no job can be forgotten.
  const auto forget_oldest = [&](bool of_uid) {
    RetiredJobs& jobs = state.write_retired_jobs();
    auto oldest = jobs.end();
    for (auto it = jobs.begin(); it != jobs.end(); ++it) {
      if (!forgettable(*it, of_uid)) continue;
      if (oldest == jobs.end() || it->second.retired_order < oldest->second.retired_order)
        oldest = it;
    }
    if (oldest == jobs.end()) return false;
    jobs.erase(oldest);
    return true;
  };
  std::size_t of_uid = count(true), all = count(false);
  while (of_uid > state.job_limits.max_jobs_per_uid && forget_oldest(true)) {
    --of_uid;
    --all;
    if (state.counters != nullptr) state.counters->hit(LimitKind::kMaxJobsPerUid);
  }
  while (all > state.job_limits.max_jobs && forget_oldest(false)) {
    --all;
    if (state.counters != nullptr) state.counters->hit(LimitKind::kMaxJobs);
  }
}

// What an evicted process leaves to its job's totals.
void retire_job(CollectorState& state, const ProcessRecord& rec) {
  RetiredJobs& jobs = state.write_retired_jobs();
  JobKey key{rec.peer.uid, rec.job};
  RetiredJob& job = jobs[std::move(key)];
  ++job.processes;
  job.dropped += rec.dropped;
  job.retired_order = state.next_retired_order++;
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    const StepAgg& agg = rec.steps[slot];
    if (agg.hist.count() == 0) continue;
    std::string_view name = rec.step_name(slot);
    auto step = job.steps.find(name);
    if (step == job.steps.end()) {
      if (job.steps.size() >= RetiredJob::kMaxJobSteps) name = "(other)";
      step = job.steps.try_emplace(std::string(name)).first;
    }
    step->second.count += agg.hist.count();
    step->second.total_ns = saturating_add(step->second.total_ns, agg.hist.sum());
    step->second.self_ns = saturating_add(step->second.self_ns, agg.self_ns);
  }
}

void evict(CollectorState& state, ProcessHandle handle) {
  const ProcessRecord& rec = *state.slots[handle];
  retire(state, rec);
  retire_job(state, rec);
  state.ledger.forget_process(rec.key());
  state.charged -= std::min(state.charged, rec.charged);
  state.by_key.erase(rec.key());
  if (!rec.alive) --state.exited;
  const std::uint32_t uid = rec.peer.uid;
  state.slots[handle].reset();
  state.free_slots.push_back(handle);
  enforce_job_limits(state, uid);
}

}  // namespace

// Evicts the exited process that exited first. False when none is exited.
bool evict_oldest_exited(CollectorState& state) {
  ProcessHandle oldest = 0;
  std::uint64_t oldest_order = std::numeric_limits<std::uint64_t>::max();
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* rec = state.slots[h].get();
    if (rec && !rec->alive && rec->connections == 0 && rec->exit_order < oldest_order) {
      oldest = h;
      oldest_order = rec->exit_order;
    }
  }
  if (oldest_order == std::numeric_limits<std::uint64_t>::max()) return false;
  evict(state, oldest);
  return true;
}

// Past max_exited_processes the oldest exited process leaves the reports; each one is
// counted as a hit of that limit.
void enforce_exited_limit(CollectorState& state, const Limits& limits, DaemonCounters& counters) {
  while (state.exited > limits.max_exited_processes && evict_oldest_exited(state)) {
    counters.hit(LimitKind::kMaxExitedProcesses);
  }
}

// Re-flags the ledger's reservations from the table, which the liveness tick keeps
// current: no /proc probe for a holder the table has, one probe per tick for a holder
// it does not have (restored from a snapshot, or evicted while still running) that was
// alive last time, none for one known dead (a (pid, start time) never lives again).
// Skipped when nothing changed since the last check, so a ledger full of dead holders
// costs nothing per tick.
void check_ledger_holders(CollectorState& state, const Environment& env, DaemonCounters& counters) {
  if (!state.holders_stale && state.untracked_live_holders.empty()) return;
  std::map<ProcessKey, bool> untracked;  // this check's answers, one probe per process
  state.ledger.check_holders([&](const ProcessKey& key) {
    const auto it = state.by_key.find(key);
    if (it != state.by_key.end()) return state.slots[it->second]->alive;
    if (const auto known = untracked.find(key); known != untracked.end()) return known->second;
    bool alive = false;
    if (state.holders_stale || state.untracked_live_holders.contains(key)) {
      // Unknown (the probe failed): keep it alive and ask again next tick.
      alive = probe_liveness(env, key, counters) != Liveness::kDead;
    }
    untracked.emplace(key, alive);
    return alive;
  });
  state.untracked_live_holders.clear();
  for (const auto& [key, alive] : untracked) {
    if (alive) state.untracked_live_holders.insert(key);
  }
  state.holders_stale = false;
}

namespace {

std::size_t live_processes_of(const CollectorState& state, std::uint32_t uid) {
  std::size_t n = 0;
  for (const auto& slot : state.slots) {
    if (slot && slot->alive && slot->peer.uid == uid) ++n;
  }
  return n;
}

ThreadSpans* find_thread(CollectorState& state, ProcessRecord& rec, std::uint32_t tid,
                         const Limits& limits, DaemonCounters& counters) {
  if (const auto it = rec.thread_index.find(tid); it != rec.thread_index.end()) {
    rec.last_tid = tid;
    rec.last_thread = rec.threads[it->second].get();
    return rec.last_thread;
  }
  if (rec.threads.size() >= limits.max_threads_per_process) {
    // Threads with nothing open hold no state worth keeping: drop them first.
    std::erase_if(rec.threads, [&](const auto& t) {
      if (t->open != 0) return false;
      uncharge(state, rec, t->charged);
      return true;
    });
    rec.thread_index.clear();
    for (std::uint32_t i = 0; i < rec.threads.size(); ++i)
      rec.thread_index[rec.threads[i]->tid] = i;
    rec.last_thread = nullptr;
    rec.last_tid = 0;
    if (rec.threads.size() >= limits.max_threads_per_process) {
      counters.hit(LimitKind::kMaxThreadsPerProcess);
      return nullptr;
    }
  }
  // Its record, and room for max_open_depth timestamps in its stacks (their capacity).
  const std::size_t cost = kThreadCharge + 2 * limits.max_open_depth * sizeof(std::uint64_t);
  if (!charge(state, rec, cost, limits, counters)) return nullptr;
  auto thread = std::make_unique<ThreadSpans>();
  thread->tid = tid;
  thread->charged = cost;
  rec.thread_index.emplace(tid, static_cast<std::uint32_t>(rec.threads.size()));
  rec.threads.push_back(std::move(thread));
  rec.last_tid = tid;
  rec.last_thread = rec.threads.back().get();
  return rec.last_thread;
}

}  // namespace

// ---- Collector -----------------------------------------------------------------------

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

bool Collector::step_known(ProcessHandle process, std::uint32_t step) const {
  if (step < kBuiltinStepCount) return proto::is_builtin_step(step);
  if (!proto::is_custom_step(step) || process >= state_->slots.size()) return false;
  const ProcessRecord* rec = state_->slots[process].get();
  return rec != nullptr && rec->custom_slot &&
         (*rec->custom_slot)[step - proto::kFirstCustomStep] != 0;
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

std::error_code Collector::events(ProcessHandle process, proto::EventSpan events) {
  if (process >= state_->slots.size() || !state_->slots[process]) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  ProcessRecord* rec = &state_->write(process);
  counters_.events_received += events.size();

  const std::size_t max_depth = limits_.max_open_depth;
  const std::size_t n = events.size();
  std::uint64_t depth_hits = 0;
  std::uint64_t state_lost = 0;  // events of threads/slots refused by the limits
  std::uint64_t first_depth_ts = 0;
  std::uint64_t first_state_ts = 0;
  std::error_code result;
  std::size_t applied = n;  // events before a bad one are kept
  for (std::size_t i = 0; i < n; ++i) {
    const proto::EventRecord e = events[i];
    std::uint32_t slot = e.step;
    if (slot >= kBuiltinStepCount) [[unlikely]] {
      const std::uint32_t index = slot - proto::kFirstCustomStep;
      if (index >= proto::kMaxCustomSteps) {
        result = make_error_code(errc::bad_step_id);
        applied = i;
        break;
      }
      slot = rec->custom_slot ? (*rec->custom_slot)[index] : 0;
      if (slot == 0) {
        result = make_error_code(errc::unregistered_step);
        applied = i;
        break;
      }
    }
    ThreadSpans* thread = rec->last_thread;
    if (e.thread_id != rec->last_tid || thread == nullptr) [[unlikely]] {
      thread = find_thread(*state_, *rec, e.thread_id, limits_, counters_);
      if (thread == nullptr) {
        if (state_lost++ == 0) first_state_ts = e.timestamp_ns;
        continue;
      }
    }
    if (slot >= thread->stacks.size()) [[unlikely]] {
      // A thread's stacks reach only as far as the highest step slot it used.
      const std::size_t cost = (slot + 1 - thread->stacks.size()) * kStackSlotCharge;
      if (!charge(*state_, *rec, cost, limits_, counters_)) {
        if (state_lost++ == 0) first_state_ts = e.timestamp_ns;
        continue;
      }
      thread->charged += cost;
      thread->stacks.resize(slot + 1);
    }
    std::vector<std::uint64_t>& stack = thread->stacks[slot];
    if (e.kind == static_cast<std::uint8_t>(proto::EventKind::kStart)) {
      // Bounded per thread over all its steps, so a thread's open spans cost at most
      // max_open_depth timestamps however many steps it nests.
      if (thread->open >= max_depth) [[unlikely]] {
        ++rec->steps[slot].depth_dropped;
        if (depth_hits++ == 0) first_depth_ts = e.timestamp_ns;
        continue;
      }
      stack.push_back(e.timestamp_ns);
      if (thread->child_ns.size() <= thread->open) [[unlikely]] {
        thread->child_ns.resize(thread->open + 1);  // at most max_open_depth entries
      }
      thread->child_ns[thread->open] = 0;
      ++thread->open;
    } else if (e.kind == static_cast<std::uint8_t>(proto::EventKind::kEnd)) {
      if (stack.empty()) [[unlikely]] {
        ++rec->steps[slot].unmatched_ends;
        continue;
      }
      const std::uint64_t start = stack.back();
      stack.pop_back();
      --thread->open;
      // One monotonic clock on the client; a backwards pair can only be a broken
      // client, and counts as zero rather than wrapping.
      const std::uint64_t duration = e.timestamp_ns > start ? e.timestamp_ns - start : 0;
      StepAgg& agg = rec->steps[slot];
      agg.hist.record(duration);
      // Self time: its duration less what ended one level deeper while it was open (the
      // depth is the thread's, so it is exact when the thread's spans nest).
      const std::uint32_t depth = thread->open;
      agg.self_ns += duration - std::min(duration, thread->child_ns[depth]);
      if (depth > 0) thread->child_ns[depth - 1] += duration;
      if (proto::is_ledger_step(slot)) [[unlikely]] {
        state_->ledger.attribute_span(rec->key(), e.thread_id, slot, start, e.timestamp_ns);
      }
    } else {
      result = make_error_code(errc::bad_event_kind);
      applied = i;
      break;
    }
  }
  if (depth_hits != 0) counters_.hit(LimitKind::kMaxOpenDepth, depth_hits);
  if (recorder_.on()) [[likely]] {
    const std::uint64_t now = env_.monotonic_now_ns();
    recorder_.record(process, events.first(applied), now);
    // What the daemon could not fold shows where it happened (the events themselves are
    // in the window: the aggregates, not the timeline, miss them).
    if (depth_hits != 0) mark_drop(rec->key(), kDaemonDropOpenDepth, depth_hits, first_depth_ts);
    if (state_lost != 0) mark_drop(rec->key(), kDaemonDropStateLimit, state_lost, first_state_ts);
  }
  return result;
}

std::error_code Collector::register_step(ProcessHandle process, const proto::RegisterStep& step) {
  if (process >= state_->slots.size() || !state_->slots[process]) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  ProcessRecord& rec = state_->write(process);
  if (!proto::is_custom_step(step.step)) return make_error_code(errc::bad_step_id);
  if (!proto::valid_field(step.name, false)) return make_error_code(errc::bad_string);
  const std::string_view name = proto::field_view(step.name);
  const std::uint32_t index = step.step - proto::kFirstCustomStep;
  if (rec.custom_slot && (*rec.custom_slot)[index] != 0) {
    return rec.step_name((*rec.custom_slot)[index]) == name ? std::error_code{}
                                                            : make_error_code(errc::bad_string);
  }
  if (rec.custom_ids.size() >= limits_.max_custom_steps) {
    counters_.hit(LimitKind::kMaxCustomSteps);
    return make_error_code(errc::limit_reached);
  }
  const std::size_t cost = kCustomStepCharge + (rec.custom_slot ? 0 : sizeof(*rec.custom_slot));
  if (!charge(*state_, rec, cost, limits_, counters_)) return make_error_code(errc::limit_reached);
  if (!rec.custom_slot) {
    rec.custom_slot = std::make_unique<std::array<std::uint16_t, proto::kMaxCustomSteps>>();
    rec.custom_slot->fill(0);
  }
  (*rec.custom_slot)[index] = static_cast<std::uint16_t>(rec.steps.size());
  rec.steps.emplace_back();
  rec.custom_ids.push_back(step.step);
  rec.custom_names.emplace_back(name);
  recorder_.register_step(process, step.step, std::string(name));
  return {};
}

void Collector::ledger(ProcessHandle process, const proto::LedgerRecord& record) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  if (record.op == static_cast<std::uint8_t>(proto::LedgerOp::kCleanup)) refresh_holder(record);
  const ProcessRecord& rec = *state_->slots[process];
  const std::uint64_t now = env_.monotonic_now_ns();
  const bool applied =
      state_->ledger.apply(LedgerActor{rec.key(), rec.peer.comm, rec.peer.uid}, record, now);
  if (!recorder_.on()) return;
  TraceMark mark;
  mark.kind = TraceMark::Kind::kLedger;
  mark.ts_ns = record.timestamp_ns;
  mark.arrived_ns = now;
  mark.sender = rec.key();
  mark.record = record;
  mark.applied = applied;
  const auto& gpus = state_->ledger.state().gpus;
  if (const auto gpu = gpus.find(proto::field_view(record.gpu_uuid)); gpu != gpus.end()) {
    mark.gpu_reserved_bytes = gpu->second.reserved_bytes;
    if (gpu->second.sample) {
      mark.gpu_free_bytes = gpu->second.sample->free_bytes;
      mark.gpu_total_bytes = gpu->second.sample->total_bytes;
    }
  }
  recorder_.mark(mark);
}

// A cleanup by another uid is allowed only of a dead holder (ledger_view.h): a holder
// that died since the last tick must be known dead before the view decides. One probe,
// at most once per holder per tick, and only of a disconnected holder believed alive.
void Collector::refresh_holder(const proto::LedgerRecord& record) {
  State& state = *state_;
  const auto& gpus = state.ledger.state().gpus;
  const auto gpu = gpus.find(proto::field_view(record.gpu_uuid));
  if (gpu == gpus.end()) return;
  const auto reservation = gpu->second.reservations.find(record.reservation_id);
  if (reservation == gpu->second.reservations.end() || !reservation->second.holder_alive) return;
  const ProcessKey holder = reservation->second.holder;
  const auto tracked = state.by_key.find(holder);
  if (tracked != state.by_key.end() && state.slots[tracked->second]->connections > 0) return;
  if (!holders_probed_.insert(holder).second) return;
  if (probe_liveness(env_, holder, counters_) != Liveness::kDead) return;
  if (tracked != state.by_key.end()) {
    mark_exited(state, state.write(tracked->second), env_.monotonic_now_ns());
  } else {
    state.holders_stale = true;
  }
  check_ledger_holders(state, env_, counters_);
}

void Collector::dropped(ProcessHandle process, std::uint64_t total_dropped) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  // A version-1 report: no cause.
  const std::uint64_t more = raise_dropped(rec, total_dropped);
  if (more != 0) mark_drop(rec.key(), proto::kDropCauseCount, more);
}

std::uint64_t Collector::raise_dropped(ProcessRecord& rec, std::uint64_t total_dropped) {
  // Reports are cumulative and may arrive out of order across reconnects: keep the max.
  if (total_dropped <= rec.dropped) return 0;
  const std::uint64_t more = total_dropped - rec.dropped;
  // Saturating: one process's huge report must not wrap the daemon's total (which would
  // make its Prometheus counter go down).
  counters_.events_dropped_by_clients = saturating_add(counters_.events_dropped_by_clients, more);
  rec.dropped = total_dropped;
  return more;
}

void Collector::mark_drop(const ProcessKey& sender, std::uint8_t cause, std::uint64_t more,
                          std::optional<std::uint64_t> ts_ns) {
  if (!recorder_.on()) return;
  TraceMark mark;
  mark.kind = TraceMark::Kind::kDropped;
  mark.arrived_ns = env_.monotonic_now_ns();
  mark.ts_ns = ts_ns.value_or(mark.arrived_ns);
  mark.sender = sender;
  mark.cause = cause;
  mark.dropped = more;
  recorder_.mark(mark);
}

void Collector::dropped_by_cause(ProcessHandle process, const proto::DroppedByCause& causes) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < proto::kDropCauseCount; ++i) {
    if (causes.count[i] > rec.dropped_by_cause[i]) {
      const std::uint64_t more = causes.count[i] - rec.dropped_by_cause[i];
      counters_.events_dropped_by_cause[i] =
          saturating_add(counters_.events_dropped_by_cause[i], more);
      rec.dropped_by_cause[i] = causes.count[i];
      mark_drop(rec.key(), static_cast<std::uint8_t>(i), more);
    }
    // Saturating: a hostile client's counts must not wrap the total.
    total = saturating_add(total, rec.dropped_by_cause[i]);
  }
  raise_dropped(rec, total);
}

void Collector::detach(ProcessHandle process) {
  State& state = *state_;
  if (process >= state.slots.size() || !state.slots[process]) return;
  ProcessRecord& rec = state.write(process);
  if (rec.connections > 0) --rec.connections;
  if (rec.connections > 0) return;
  abandon_open_spans(state, rec);
  // One probe: the process itself. Its reservations are re-flagged by the next liveness
  // tick (check_ledger_holders), not here, so churn of short-lived clients costs one
  // probe each, whatever the ledger holds. A failed probe is no death: the tick asks again.
  if (probe_liveness(env_, rec.key(), counters_) == Liveness::kDead)
    mark_exited(state, rec, env_.monotonic_now_ns());
  enforce_exited_limit(state, limits_, counters_);
}

void Collector::refresh_liveness() {
  State& state = *state_;
  attach_refreshed_ = false;
  holders_probed_.clear();
  // One probe per disconnected process believed alive; none for the connected (their
  // connection proves them alive) or the exited.
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* slot = state.slots[h].get();
    if (!slot || !slot->alive || slot->connections > 0) continue;
    const Liveness liveness = probe_liveness(env_, slot->key(), counters_);
    if (liveness == Liveness::kDead) mark_exited(state, state.write(h), env_.monotonic_now_ns());
  }
  check_ledger_holders(state, env_, counters_);
  std::vector<LedgerView::ExpiredLease> expired;
  state.ledger.expire_leases(env_.monotonic_now_ns(), recorder_.on() ? &expired : nullptr);
  for (const LedgerView::ExpiredLease& e : expired) {
    TraceMark mark;
    mark.kind = TraceMark::Kind::kLeaseExpired;
    mark.ts_ns = e.reservation.lease_deadline_ns;
    mark.arrived_ns = env_.monotonic_now_ns();
    mark.sender = e.reservation.holder;
    proto::set_field(mark.record.gpu_uuid, e.gpu);
    mark.record.reservation_id = e.id;
    mark.record.bytes = e.reservation.bytes;
    mark.record.total_bytes = e.reservation.lease_ms;
    recorder_.mark(mark);
  }
  enforce_exited_limit(state, limits_, counters_);
  recorder_.tick(env_.monotonic_now_ns());
}

std::size_t Collector::reset(std::optional<std::int32_t> pid) {
  State& state = *state_;
  std::size_t cleared = 0;
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* slot = state.slots[h].get();
    if (!slot || (pid && slot->key().pid != *pid)) continue;
    for (auto& step : state.write(h).steps) step.clear();
    ++cleared;
  }
  if (!pid) {
    state.retired = std::make_shared<RetiredHistograms>();
    state.retired_jobs = std::make_shared<RetiredJobs>();
  }
  return cleared;
}

CleanupOutcome Collector::operator_cleanup(const PeerIdentity& peer, std::string_view gpu,
                                           std::uint64_t id) {
  using Result = CleanupOutcome::Result;
  CleanupOutcome out;
  const auto& gpus = state_->ledger.state().gpus;
  const auto g = gpus.find(gpu);
  if (g == gpus.end() || !g->second.reservations.contains(id)) return out;  // kNoReservation
  proto::LedgerRecord record{};
  record.op = static_cast<std::uint8_t>(proto::LedgerOp::kCleanup);
  record.timestamp_ns = env_.monotonic_now_ns();
  record.reservation_id = id;
  record.holder_pid = static_cast<std::uint32_t>(g->second.reservations.at(id).holder.pid);
  if (!proto::set_field(record.gpu_uuid, gpu)) {
    out.result = Result::kBadGpu;
    return out;
  }
  refresh_holder(record);  // a holder that died since the last tick counts as dead
  const auto& r = state_->ledger.state().gpus.find(gpu)->second.reservations.at(id);
  out.holder_pid = r.holder.pid;
  out.holder_uid = r.uid;
  out.holder = !r.holder_alive ? CleanupOutcome::Holder::kLeaked
               : r.expired     ? CleanupOutcome::Holder::kExpired
                               : CleanupOutcome::Holder::kAlive;
  out.result =
      state_->ledger.apply(LedgerActor{peer.key, peer.comm, peer.uid}, record, record.timestamp_ns)
          ? Result::kCleaned
          : Result::kDenied;
  return out;
}

std::size_t Collector::reset_ledger(std::optional<std::string_view> gpu) {
  return state_->ledger.reset(gpu);
}

// ---- views -----------------------------------------------------------------------------

CollectorView::CollectorView(const CollectorState& state, const DaemonCounters& counters,
                             std::uint64_t now_ns)
    : state_(std::make_unique<const CollectorState>(state)),
      counters_(counters),
      now_ns_(now_ns),
      uptime_(std::chrono::steady_clock::now() - counters.started) {}

CollectorView::~CollectorView() = default;

std::shared_ptr<const CollectorView> Collector::freeze(const ServerCounters* server) const {
  DaemonCounters counters = counters_;
  counters.flight_recorder = recorder_.counters();
  if (server != nullptr) counters.add(*server);
  return std::shared_ptr<const CollectorView>(
      new CollectorView(*state_, counters, env_.monotonic_now_ns()));
}

void Collector::apply_devices(std::map<std::string, ledger::Device, std::less<>> devices,
                              std::string error, std::uint64_t now_ns, std::uint64_t slow_samples) {
  NvmlCounters& c = counters_.nvml;
  ++c.samples;
  if (!error.empty()) ++c.sample_errors;
  c.slow_samples = slow_samples;
  c.devices = devices.size();
  state_->ledger.apply_devices(std::move(devices), std::move(error), now_ns);
  if (!recorder_.on()) return;
  // Each GPU's sample and findings, as counter tracks of the trace.
  const ledger::State& ledger = state_->ledger.state();
  for (const auto& [uuid, device] : ledger.devices) {
    TraceMark mark;
    mark.kind = TraceMark::Kind::kDevice;
    mark.ts_ns = now_ns;
    mark.arrived_ns = now_ns;
    if (!proto::set_field(mark.record.gpu_uuid, uuid)) continue;
    mark.gpu_total_bytes = device.total_bytes;
    mark.gpu_free_bytes = device.free_bytes;
    mark.gpu_reserved_bytes = device.used_bytes;
    for (const ledger::Finding& f : ledger::device_findings(ledger, uuid, now_ns)) {
      ++mark.findings[f.kind];
    }
    recorder_.mark(mark);
  }
}

void Collector::set_device_rules(const ledger::DeviceRules& rules) {
  state_->ledger.set_device_rules(rules);
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
      p.job = rec.job;
      p.rank = rec.rank;
    }
  }
  return capture;
}

// ---- selection shared by the reports ---------------------------------------------------

std::vector<const ProcessRecord*> select_processes(const CollectorState& state,
                                                   std::optional<std::int32_t> pid,
                                                   const std::optional<std::string>& job) {
  std::vector<const ProcessRecord*> out;
  for (const auto& [key, handle] : state.by_key) {
    if (pid && key.pid != *pid) continue;
    const ProcessRecord* rec = state.slots[handle].get();
    if (job && rec->job != *job) continue;
    out.push_back(rec);
  }
  return out;
}

std::vector<JobGroup> group_by_job(const CollectorState& state,
                                   const std::vector<const ProcessRecord*>& processes,
                                   bool with_retired) {
  std::map<JobKey, JobGroup> groups;
  const auto group_of = [&](const JobKey& key) -> JobGroup& {
    JobGroup& group = groups[key];
    group.key = key;
    return group;
  };
  for (const ProcessRecord* rec : processes) {
    group_of(JobKey{rec->peer.uid, rec->job}).processes.push_back(rec);
  }
  if (with_retired) {
    for (const auto& [key, retired] : *state.retired_jobs) group_of(key).retired = &retired;
  }
  std::vector<JobGroup> out;
  out.reserve(groups.size());
  for (auto& [key, group] : groups) {
    for (const ProcessRecord* rec : group.processes) {
      group.live += rec->alive ? 1 : 0;
      group.world_size = std::max(group.world_size, rec->world_size);
      if (rec->rank != proto::kNoRank) group.ranks.push_back(rec->rank);
    }
    std::sort(group.ranks.begin(), group.ranks.end());
    group.ranks.erase(std::unique(group.ranks.begin(), group.ranks.end()), group.ranks.end());
    out.push_back(std::move(group));
  }
  return out;
}

std::vector<NamedTotals> totals_by_name(const std::vector<const ProcessRecord*>& processes) {
  // A custom step that took a built-in's name merges into that built-in's row.
  std::vector<NamedTotals> builtin(kBuiltinStepCount);
  std::map<std::string, NamedTotals, std::less<>> custom;
  const auto entry = [&](std::string_view name) -> NamedTotals& {
    for (std::uint32_t i = 0; i < kBuiltinStepCount; ++i) {
      if (proto::kBuiltinStepNames[i] == name) return builtin[i];
    }
    auto it = custom.find(name);
    if (it == custom.end()) it = custom.try_emplace(std::string(name)).first;
    return it->second;
  };
  for (const ProcessRecord* rec : processes) {
    const auto open = rec->open_per_slot();
    for (std::size_t slot = 0; slot < rec->steps.size(); ++slot) {
      const StepAgg& agg = rec->steps[slot];
      if (!agg.has_data() && open[slot] == 0) continue;
      NamedTotals& t = slot < kBuiltinStepCount ? builtin[slot] : entry(rec->step_name(slot));
      t.name = rec->step_name(slot);
      t.agg.merge(agg);
      t.open += open[slot];
      if (t.last_process != rec) ++t.processes;
      t.last_process = rec;
    }
  }
  std::vector<NamedTotals> out;
  for (auto& t : builtin) {
    if (t.processes != 0) out.push_back(std::move(t));
  }
  for (auto& [name, t] : custom) out.push_back(std::move(t));
  return out;
}

// ---- adopt (a snapshot's state, from daemon/persist/snapshot_codec.cpp) -------------------

std::error_code Collector::adopt(RestoredState restored) {
  for (const auto& slot : state_->slots) {
    // Live sessions hold handles into the table that this would invalidate.
    if (slot && slot->connections > 0)
      return std::make_error_code(std::errc::device_or_resource_busy);
  }
  auto next = std::make_unique<State>(limits_, counters_);
  std::uint64_t max_order = 0;
  for (auto& rec : restored.processes) {
    // Restored records have no threads: their custom steps are all they are charged.
    rec->charged = rec->custom_ids.size() * kCustomStepCharge +
                   (rec->custom_slot ? sizeof(*rec->custom_slot) : 0);
    next->charged += rec->charged;
    if (!rec->alive) {
      ++next->exited;
      max_order = std::max(max_order, rec->exit_order);
    }
    next->by_key.emplace(rec->key(), static_cast<ProcessHandle>(next->slots.size()));
    next->slots.push_back(std::move(rec));
  }
  next->next_exit_order = max_order + 1;
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
    if (row.kept != Kept::kNo) c.*row.field += r.*row.field;
  }
  for (std::size_t i = 0; i < proto::kDropCauseCount; ++i)
    c.events_dropped_by_cause[i] += r.events_dropped_by_cause[i];
  for (const auto& [k, v] : r.protocol_errors) c.protocol_errors[k] += v;
  for (const auto& [k, v] : r.limits_hit) c.limits_hit[k] += v;
  // Restored processes have no connection: ask /proc who is still there.
  refresh_liveness();
  while (state_->by_key.size() > limits_.max_processes && evict_oldest_exited(*state_)) {
  }
  return {};
}

}  // namespace steptrace::daemon
