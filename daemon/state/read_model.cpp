// CollectorView's read model (read_model.h): the ingest layout (collector_state.h)
// described as plain values for the renderers.
#include "daemon/state/read_model.h"

#include <algorithm>
#include <limits>
#include <map>
#include <string_view>
#include <tuple>

#include "daemon/state/collector.h"
#include "daemon/state/collector_state.h"

namespace steptrace::daemon {
namespace {

using proto::kBuiltinStepCount;

static_assert(RetiredJobFigures::kMaxSteps == RetiredJob::kMaxJobSteps);

// Aggregates of one step name over several processes.
struct NamedTotals {
  std::string name;
  StepAgg agg;
  std::uint64_t open = 0;
  std::uint64_t processes = 0;                  // processes with this step
  const ProcessRecord* last_process = nullptr;  // so a process counts once
};

// Processes in (pid, start_time) order; all of them, one pid's, one job's (uid and job
// id both match: another uid's processes that claim the same id are another job), or
// those of both.
std::vector<const ProcessRecord*> select_processes(const CollectorState& state,
                                                   std::optional<std::int32_t> pid,
                                                   const std::optional<JobRef>& job) {
  std::vector<const ProcessRecord*> out;
  for (const auto& [key, handle] : state.by_key) {
    if (pid && key.pid != *pid) continue;
    const ProcessRecord* rec = state.slots[handle].get();
    if (job && (rec->peer.uid != job->uid || rec->job != job->job)) continue;
    out.push_back(rec);
  }
  return out;
}

// Per-step aggregates merged by step name over `processes`, built-ins first in enum
// order then custom names alphabetically. Steps without data are left out.
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

// Per thread, the innermost open span (the latest start still open) and the depth.
std::vector<OpenSpanNow> open_spans_now(const ProcessRecord& rec, std::uint64_t now) {
  std::vector<const ThreadSpans*> threads;
  for (const auto& t : rec.threads) {
    if (t->open != 0) threads.push_back(t.get());
  }
  std::sort(threads.begin(), threads.end(),
            [](const ThreadSpans* a, const ThreadSpans* b) { return a->tid < b->tid; });
  std::vector<OpenSpanNow> out;
  for (const ThreadSpans* t : threads) {
    std::size_t best_slot = 0;
    std::uint64_t best_start = 0;
    bool found = false;
    for (std::size_t slot = 0; slot < t->stacks.size(); ++slot) {
      if (t->stacks[slot].empty()) continue;
      const std::uint64_t start = t->stacks[slot].back();
      if (!found || start >= best_start) {
        best_slot = slot;
        best_start = start;
        found = true;
      }
    }
    if (!found) continue;
    out.push_back({t->tid, std::string(rec.step_name(best_slot)),
                   now > best_start ? now - best_start : 0, t->open});
  }
  return out;
}

}  // namespace

std::vector<ProcessFigures> CollectorView::processes(std::optional<std::int32_t> pid,
                                                     const std::optional<JobRef>& job) const {
  std::vector<ProcessFigures> out;
  for (const ProcessRecord* rec : select_processes(*state_, pid, job)) {
    ProcessFigures p;
    p.record_ = rec;
    p.key = rec->key();
    p.uid = rec->peer.uid;
    p.gid = rec->peer.gid;
    p.comm = rec->peer.comm;
    p.client = rec->client_name;
    p.library_version = rec->library_version;
    p.job = rec->job;
    p.rank = rec->rank;
    p.local_rank = rec->local_rank;
    p.world_size = rec->world_size;
    p.alive = rec->alive;
    p.connections = rec->connections;
    p.exited_at_ns = rec->exited_at_ns;
    p.dropped = rec->dropped;
    p.dropped_by_cause = rec->dropped_by_cause;
    p.ledger_refused = rec->ledger_refused;
    if (rec->events_known) p.events = rec->events;
    const auto open = rec->open_per_slot();
    for (std::size_t slot = 0; slot < rec->steps.size(); ++slot) {
      const StepAgg& agg = rec->steps[slot];
      p.unmatched_ends = saturating_add(p.unmatched_ends, agg.unmatched_ends);
      p.abandoned = saturating_add(p.abandoned, agg.abandoned);
      p.open += open[slot];
      if (!agg.has_data() && open[slot] == 0) continue;
      StepFigures s;
      s.name = rec->step_name(slot);
      s.open = open[slot];
      s.unmatched_ends = agg.unmatched_ends;
      s.abandoned = agg.abandoned;
      s.depth_dropped = agg.depth_dropped;
      s.self_ns = agg.self_ns;
      s.processes = 1;
      s.in_view_ = &agg.hist;
      p.steps.push_back(std::move(s));
    }
    p.current = open_spans_now(*rec, now_ns_);
    out.push_back(std::move(p));
  }
  return out;
}

std::vector<std::uint32_t> CollectorView::uids_with_job(std::string_view job) const {
  std::vector<std::uint32_t> out;
  for (const auto& slot : state_->slots) {
    if (slot && slot->job == job) out.push_back(slot->peer.uid);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

std::vector<StepFigures> CollectorView::totals(
    std::span<const ProcessFigures* const> processes) const {
  std::vector<const ProcessRecord*> records;
  records.reserve(processes.size());
  for (const ProcessFigures* p : processes) records.push_back(p->record_);
  std::vector<StepFigures> out;
  for (NamedTotals& t : totals_by_name(records)) {
    StepFigures s;
    s.name = std::move(t.name);
    s.open = t.open;
    s.unmatched_ends = t.agg.unmatched_ends;
    s.abandoned = t.agg.abandoned;
    s.depth_dropped = t.agg.depth_dropped;
    s.self_ns = t.agg.self_ns;
    s.processes = t.processes;
    s.merged_ = std::make_shared<const Histogram>(std::move(t.agg.hist));
    out.push_back(std::move(s));
  }
  return out;
}

std::vector<StepFigures> CollectorView::totals(std::span<const ProcessFigures> processes) const {
  std::vector<const ProcessFigures*> all;
  all.reserve(processes.size());
  for (const ProcessFigures& p : processes) all.push_back(&p);
  return totals(std::span<const ProcessFigures* const>(all));
}

std::vector<JobFigures> CollectorView::jobs(std::span<const ProcessFigures> processes) const {
  std::map<JobKey, JobFigures> groups;
  for (const ProcessFigures& p : processes) {
    JobFigures& group = groups[JobKey{p.uid, p.job}];
    group.uid = p.uid;
    group.job = p.job;
    group.processes.push_back(&p);
    group.live += p.alive ? 1 : 0;
    group.world_size = std::max(group.world_size, p.world_size);
    if (p.rank != proto::kNoRank) group.ranks.push_back(p.rank);
  }
  std::vector<JobFigures> out;
  out.reserve(groups.size());
  for (auto& [key, group] : groups) {
    std::sort(group.ranks.begin(), group.ranks.end());
    group.ranks.erase(std::unique(group.ranks.begin(), group.ranks.end()), group.ranks.end());
    out.push_back(std::move(group));
  }
  return out;
}

std::vector<JobFigures> CollectorView::jobs_and_retired(
    std::span<const ProcessFigures> processes) const {
  std::vector<JobFigures> in_table = jobs(processes);
  std::vector<JobFigures> out;
  out.reserve(in_table.size() + state_->retired_jobs->size());
  // Both are in (uid, job id) order: merged as they come.
  auto next = in_table.begin();
  const auto key_of = [](const JobFigures& j) { return std::tie(j.uid, j.job); };
  for (const auto& [key, retired] : *state_->retired_jobs) {
    const auto retired_key = std::tie(key.uid, key.job);
    while (next != in_table.end() && key_of(*next) < retired_key) out.push_back(std::move(*next++));
    if (next == in_table.end() || key_of(*next) != retired_key) {
      JobFigures& only = out.emplace_back();
      only.uid = key.uid;
      only.job = key.job;
    } else {
      out.push_back(std::move(*next++));
    }
    RetiredJobFigures& r = out.back().retired.emplace();
    r.processes = retired.processes;
    r.dropped = retired.dropped;
    r.steps.reserve(retired.steps.size());
    for (const auto& [name, t] : retired.steps)
      r.steps.push_back({name, t.count, t.total_ns, t.self_ns});
    r.ranks.reserve(retired.ranks.size());
    for (const auto& [rank, steps] : retired.ranks) {
      RetiredRankFigures& rr = r.ranks.emplace_back();
      rr.rank = rank;
      rr.steps.reserve(steps.size());
      for (const auto& [name, t] : steps)
        rr.steps.push_back({name, t.count, t.total_ns, t.self_ns});
    }
  }
  for (; next != in_table.end(); ++next) out.push_back(std::move(*next));
  return out;
}

JobRankSkew CollectorView::rank_skew(const JobFigures& job,
                                     std::optional<std::uint64_t> window_ns) const {
  JobRankSkew out;
  out.window_ns = window_ns;
  if (job.ranks.size() < 2) return out;
  const RankSkewRules& rules = state_->job_limits.rank_skew;
  // The run: per step and rank, its processes' spans, and their merged histogram for the
  // rank's median span (what makes a slow rank "sustained": one slow iteration moves the
  // mean, not the median).
  struct Acc {
    std::uint64_t spans = 0;
    std::uint64_t total_ns = 0;
    Histogram hist;
  };
  std::map<std::string, std::map<std::uint32_t, Acc>, std::less<>> run;
  for (const ProcessFigures* p : job.processes) {
    if (p->rank == proto::kNoRank) continue;
    for (const StepFigures& step : p->steps) {
      const Histogram& h = step.hist();
      if (h.count() == 0) continue;
      Acc& acc = run[step.name][p->rank];
      acc.spans = saturating_add(acc.spans, h.count());
      acc.total_ns = saturating_add(acc.total_ns, h.sum());
      acc.hist.merge(h);
    }
  }
  for (const auto& [name, ranks] : run) {
    std::vector<RankStepInput> inputs;
    for (const auto& [rank, acc] : ranks) {
      inputs.push_back(
          {rank, acc.spans, acc.total_ns, {static_cast<double>(acc.hist.percentile(0.5))}});
    }
    auto skew = step_skew(name, is_waiting_step(name, rules), inputs, rules);
    if (skew) out.run.push_back(std::move(*skew));
  }
  if (!window_ns) return out;
  // The window: per rank its ring's figures, the interval means aligned on the newest
  // sample (a rank whose ring began later has fewer intervals).
  std::map<std::uint32_t, RankWindowFigures> windows;
  std::size_t intervals = 0;
  for (const std::uint32_t rank : job.ranks) {
    const auto ring = state_->rank_windows->find(RankWindowKey{job.uid, job.job, rank});
    if (ring == state_->rank_windows->end()) continue;
    RankWindowFigures f = window_figures(ring->second, *window_ns);
    out.covered_ns = std::max(out.covered_ns, f.covered_ns);
    for (const auto& [name, step] : f.steps)
      intervals = std::max(intervals, step.interval_means.size());
    windows.emplace(rank, std::move(f));
  }
  std::map<std::string, std::vector<RankStepInput>, std::less<>> by_step;
  for (auto& [rank, f] : windows) {
    for (auto& [name, step] : f.steps) {
      std::vector<double> pieces(intervals - step.interval_means.size(),
                                 std::numeric_limits<double>::quiet_NaN());
      pieces.insert(pieces.end(), step.interval_means.begin(), step.interval_means.end());
      by_step[name].push_back({rank, step.spans, step.total_ns, std::move(pieces), 2});
    }
  }
  for (const auto& [name, inputs] : by_step) {
    auto skew = step_skew(name, is_waiting_step(name, rules), inputs, rules);
    if (skew) out.window.push_back(std::move(*skew));
  }
  return out;
}

std::vector<StepHistogram> CollectorView::step_histograms() const {
  std::vector<StepHistogram> out;
  // Name -> index in out; the names point into the view, which outlives this call.
  std::map<std::string_view, std::size_t, std::less<>> index;
  const auto merge = [&](std::string_view name, const Histogram& hist) {
    const auto [it, fresh] = index.try_emplace(name, out.size());
    if (fresh) out.push_back({std::string(name), Histogram{}});
    out[it->second].hist.merge(hist);
  };
  for (const auto& slot : state_->slots) {
    if (!slot) continue;
    for (std::size_t s = 0; s < slot->steps.size(); ++s) {
      const Histogram& hist = slot->steps[s].hist;
      if (hist.count() != 0) merge(slot->step_name(s), hist);
    }
  }
  for (const auto& [name, hist] : *state_->retired) merge(name, hist);
  return out;
}

const RankSkewRules& CollectorView::rank_skew_rules() const { return state_->job_limits.rank_skew; }

TableFigures CollectorView::table() const {
  const CollectorState& state = *state_;
  TableFigures t;
  t.state_bytes_estimate = sizeof(CollectorState) +
                           state.slots.capacity() * sizeof(state.slots[0]) +
                           state.by_key.size() * 64;
  for (const auto& slot : state.slots) {
    if (!slot) continue;
    t.state_bytes_estimate += slot->memory_bytes();
    t.live += slot->alive ? 1 : 0;
    t.connected += slot->connections > 0 ? 1 : 0;
    t.custom_steps += slot->custom_ids.size();
  }
  for (const auto& [name, hist] : *state.retired)
    t.state_bytes_estimate += name.capacity() + hist.memory_bytes() + 48;
  t.tracked = state.by_key.size();
  t.exited = state.exited;
  t.state_bytes_charged = state.charged;
  t.view_copy_bytes = state.view_copies.bytes();
  return t;
}

const ledger::State& CollectorView::ledger() const { return state_->ledger.state(); }

}  // namespace steptrace::daemon
