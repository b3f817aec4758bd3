// Collector liveness: which processes are alive (a connection, else one /proc probe per
// liveness tick), exits, the ledger's holders re-flagged from that, and eviction past
// the limits, which retires what a process leaves into the retired histograms and jobs.
#include "daemon/state/collector.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "daemon/state/collector_state.h"

namespace steptrace::daemon {

// ---- helpers over the state (collector_state.h) -----------------------------------------

// Every probe of the collector goes through here: a failed one is counted.
Liveness probe_liveness(const Environment& env, const ProcessKey& key, DaemonCounters& counters) {
  const Liveness liveness = liveness_of(env.probe(key.pid), key.start_time);
  if (liveness == Liveness::kUnknown) ++counters.liveness_probe_errors;
  return liveness;
}

namespace {

// Spans still open when the process's last connection closed (or, restored from a
// snapshot, when it is found dead) will never end.
void abandon_open_spans(CollectorState& state, ProcessRecord& rec) {
  for (auto& thread : rec.threads) {
    for (std::size_t slot = 0; slot < thread->stacks.size(); ++slot) {
      rec.steps[slot].abandoned += thread->stacks[slot].size();
    }
    uncharge(state, rec, thread->charged);
    state.drop_thread(thread);
  }
  rec.threads.clear();
  rec.thread_index.clear();
  rec.last_thread = nullptr;
  rec.last_tid = 0;
}

}  // namespace

void mark_exited(CollectorState& state, ProcessRecord& rec, std::uint64_t now) {
  if (!rec.alive) return;
  abandon_open_spans(state, rec);  // a restored process's: it never reconnected
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
    const std::size_t before = heap::histogram_heap_bytes(it->second);
    it->second.merge(hist);
    state.add_retired(heap::histogram_heap_bytes(it->second) - before);
  }
}

// Past max_jobs_per_uid (that uid's) retired jobs, that uid's job retired least recently
// is forgotten; past max_jobs (anyone's), that of the uid holding the most (forget_oldest
// below); each counted as a hit of that limit. Only jobs with no
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
  // `of_uid`: that uid's least recently retired job. Else (max_jobs) the least recently
  // retired of the uid holding the most forgettable jobs (of two holding as many, the one
  // whose job retired first), so that other uids' jobs together cannot push out the jobs
  // of a uid holding no more than max_jobs / the uids holding any. False when no job can
  // be forgotten.
  const auto forget_oldest = [&](bool of_uid) {
    struct Held {
      std::size_t count = 0;
      RetiredJobs::iterator oldest;
    };
    RetiredJobs& jobs = state.write_retired_jobs();
    std::map<std::uint32_t, Held> by_uid;
    for (auto it = jobs.begin(); it != jobs.end(); ++it) {
      if (!forgettable(*it, of_uid)) continue;
      Held& held = by_uid[it->first.uid];
      if (held.count++ == 0 || it->second.retired_order < held.oldest->second.retired_order)
        held.oldest = it;
    }
    const Held* largest = nullptr;
    for (const auto& [owner, held] : by_uid) {
      if (largest == nullptr || held.count > largest->count ||
          (held.count == largest->count &&
           held.oldest->second.retired_order < largest->oldest->second.retired_order)) {
        largest = &held;
      }
    }
    if (largest == nullptr) return false;
    state.remove_retired(heap::retired_job_bytes(largest->oldest->first, largest->oldest->second));
    jobs.erase(largest->oldest);
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
  const auto [entry, fresh] = jobs.try_emplace(std::move(key));
  RetiredJob& job = entry->second;
  if (fresh) state.add_retired(heap::retired_job_bytes(entry->first, job));
  ++job.processes;
  job.dropped = saturating_add(job.dropped, rec.dropped);
  job.retired_order = state.next_retired_order++;
  JobStepMap* rank_steps = nullptr;
  if (rec.rank != proto::kNoRank) {
    auto it = job.ranks.find(rec.rank);
    if (it == job.ranks.end() && job.ranks.size() < RetiredJob::kMaxJobRanks) {
      it = job.ranks.try_emplace(rec.rank).first;
      state.add_retired(heap::retired_job_rank_bytes());
    }
    if (it != job.ranks.end()) rank_steps = &it->second;
  }
  const auto add_to = [&](JobStepMap& steps, std::string_view name, const StepAgg& agg) {
    const bool per_rank = &steps != &job.steps;
    auto step = steps.find(name);
    if (step == steps.end()) {
      if (steps.size() >= RetiredJob::kMaxJobSteps ||
          (per_rank && job.rank_steps >= RetiredJob::kMaxJobRankSteps)) {
        name = "(other)";
      }
      const auto added = steps.try_emplace(std::string(name));
      step = added.first;
      if (added.second) {
        state.add_retired(heap::retired_job_step_bytes(name));
        if (per_rank) ++job.rank_steps;
      }
    }
    step->second.count = saturating_add(step->second.count, agg.hist.count());
    step->second.total_ns = saturating_add(step->second.total_ns, agg.hist.sum());
    step->second.self_ns = saturating_add(step->second.self_ns, agg.self_ns);
  };
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    const StepAgg& agg = rec.steps[slot];
    if (agg.hist.count() == 0) continue;
    const std::string_view name = rec.step_name(slot);
    add_to(job.steps, name, agg);
    if (rank_steps != nullptr) add_to(*rank_steps, name, agg);
  }
}

void evict(CollectorState& state, ProcessHandle handle) {
  const ProcessRecord& rec = *state.slots[handle];
  retire(state, rec);
  retire_job(state, rec);
  state.ledger.forget_process(rec.key());
  state.charged -= std::min(state.charged, rec.charged);
  uncharge_uid(state, rec.peer.uid, rec.charged);
  state.freed_memory.freed(rec.charged);
  state.by_key.erase(rec.key());
  if (!rec.alive) --state.exited;
  const std::uint32_t uid = rec.peer.uid;
  // A view's copy of the table still holding the record holds it alone now.
  if (state.slots[handle].use_count() > 1) {
    state.view_copies.held(state.slots[handle], heap::record_bytes(rec));
  }
  state.slots[handle].reset();
  state.free_slots.push_back(handle);
  enforce_job_limits(state, uid);
}

}  // namespace

namespace {

// The exited process (no connection) of the uid holding the most of them, the one that
// exited first; of two uids holding as many, the one whose exited first. `only_uid`:
// that uid's only, and only those still charged to the state budget (evicting the others
// would give back nothing). None: nothing exited.
std::optional<ProcessHandle> oldest_exited_of_largest(const CollectorState& state,
                                                      std::optional<std::uint32_t> only_uid) {
  struct Held {
    std::size_t count = 0;
    std::uint64_t oldest_order = std::numeric_limits<std::uint64_t>::max();
    ProcessHandle oldest = 0;
  };
  std::map<std::uint32_t, Held> by_uid;
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* rec = state.slots[h].get();
    if (!rec || rec->alive || rec->connections != 0) continue;
    if (only_uid && (rec->peer.uid != *only_uid || rec->charged == 0)) continue;
    Held& held = by_uid[rec->peer.uid];
    ++held.count;
    if (rec->exit_order < held.oldest_order) {
      held.oldest_order = rec->exit_order;
      held.oldest = h;
    }
  }
  const Held* largest = nullptr;
  for (const auto& [uid, held] : by_uid) {
    if (largest == nullptr || held.count > largest->count ||
        (held.count == largest->count && held.oldest_order < largest->oldest_order)) {
      largest = &held;
    }
  }
  if (largest == nullptr) return std::nullopt;
  return largest->oldest;
}

}  // namespace

// Evicts an exited process, of the uid holding the most. False when none is exited.
bool evict_oldest_exited(CollectorState& state) {
  const std::optional<ProcessHandle> victim = oldest_exited_of_largest(state, std::nullopt);
  if (!victim) return false;
  evict(state, *victim);
  return true;
}

std::size_t reclaim_state(CollectorState& state, std::uint32_t uid, std::size_t wanted,
                          DaemonCounters& counters) {
  const std::size_t before = state.charged;
  // Its exited processes first: their reports stay in the retired totals.
  if (const auto exited = oldest_exited_of_largest(state, uid)) {
    evict(state, *exited);
    counters.hit(LimitKind::kMaxStateBytes);
    return before - state.charged;
  }
  // Else its live process holding the most threads' state.
  std::optional<ProcessHandle> largest;
  std::size_t largest_bytes = 0;
  for (ProcessHandle h = 0; h < state.slots.size(); ++h) {
    const ProcessRecord* rec = state.slots[h].get();
    if (!rec || rec->peer.uid != uid || rec->threads.empty()) continue;
    std::size_t bytes = 0;
    for (const auto& thread : rec->threads) bytes += thread->charged;
    if (bytes > largest_bytes) {
      largest_bytes = bytes;
      largest = h;
    }
  }
  if (!largest) return 0;
  ProcessRecord& rec = state.write(*largest);
  // Threads with nothing open: nothing is lost but their slots, made again when they
  // send. Only when none is idle, the open spans (counted as abandoned). As many as
  // `wanted` needs, not the process's all: it keeps what is not needed.
  const bool any_idle = std::any_of(rec.threads.begin(), rec.threads.end(),
                                    [](const auto& t) { return t->open == 0; });
  std::erase_if(rec.threads, [&](const auto& t) {
    if (before - state.charged >= wanted || (any_idle && t->open != 0)) return false;
    for (std::size_t slot = 0; slot < t->stacks.size(); ++slot)
      rec.steps[slot].abandoned += t->stacks[slot].size();
    uncharge(state, rec, t->charged);
    state.drop_thread(t);
    return true;
  });
  rec.thread_index.clear();
  for (std::uint32_t i = 0; i < rec.threads.size(); ++i) rec.thread_index[rec.threads[i]->tid] = i;
  rec.last_thread = nullptr;
  rec.last_tid = 0;
  return before > state.charged ? before - state.charged : 0;
}

// Past max_exited_processes an exited process of the uid holding the most leaves the
// reports, its oldest (evict_oldest_exited); each one is counted as a hit of that limit.
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

// ---- Collector: liveness ----------------------------------------------------------------

void Collector::detach(ProcessHandle process) {
  State& state = *state_;
  if (process >= state.slots.size() || !state.slots[process]) return;
  ProcessRecord& rec = state.write(process);
  if (rec.connections > 0) --rec.connections;
  if (rec.connections > 0) return;
  // At a graceful stop the daemon closes the connection, not the process: its open spans
  // go into the final snapshot and end after the restart.
  if (!stopping_) abandon_open_spans(state, rec);
  // One probe: the process itself. Its reservations are re-flagged by the next liveness
  // tick (check_ledger_holders), not here, so churn of short-lived clients costs one
  // probe each, whatever the ledger holds. A failed probe is no death: the tick asks again.
  if (probe_liveness(env_, rec.key(), counters_) == Liveness::kDead)
    mark_exited(state, rec, env_.monotonic_now_ns());
  enforce_exited_limit(state, limits_, counters_);
  state.freed_memory.release_if_due(env_.monotonic_now_ns());  // its threads, evictions
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
  age_ledger_rows();
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
  sample_rank_windows(state, env_.monotonic_now_ns());
  recorder_.tick(env_.monotonic_now_ns());
  state.freed_memory.release_if_due(env_.monotonic_now_ns());
}

}  // namespace steptrace::daemon
