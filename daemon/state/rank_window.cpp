#include "daemon/state/rank_window.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <utility>

#include "daemon/state/charge.h"
#include "daemon/state/collector_state.h"
#include "daemon/state/saturating.h"

namespace steptrace::daemon {

static_assert(kRankWindowMaxSteps == RetiredJob::kMaxJobSteps);

namespace {

// libstdc++'s deque: a map of block pointers and blocks of 512 bytes.
template <typename T>
std::size_t deque_bytes(std::size_t n) {
  constexpr std::size_t kPerBlock = sizeof(T) < 512 ? 512 / sizeof(T) : 1;
  return heap::heap_block(8 * sizeof(void*)) +
         (n / kPerBlock + 1) * heap::heap_block(kPerBlock * sizeof(T));
}

void add(RankSample& steps, std::string_view name, std::uint64_t spans, std::uint64_t total) {
  auto it = steps.find(name);
  if (it == steps.end()) it = steps.try_emplace(std::string(name)).first;
  it->second.spans = saturating_add(it->second.spans, spans);
  it->second.total_ns = saturating_add(it->second.total_ns, total);
}

}  // namespace

std::size_t rank_window_bytes(const RankWindowKey& key, const RankWindow& ring) {
  std::size_t bytes = heap::tree_node_bytes<RankWindows::value_type>() +
                      heap::string_heap_bytes(key.job.size()) +
                      deque_bytes<std::uint64_t>(ring.times_ns.size());
  for (const auto& [name, samples] : ring.steps) {
    bytes += heap::tree_node_bytes<std::pair<const std::string, std::deque<RankCumulative>>>() +
             heap::string_heap_bytes(name.size()) + deque_bytes<RankCumulative>(samples.size());
  }
  return bytes;
}

RankWindow add_rank_sample(RankWindow ring, const RankSample& sample, std::uint64_t now_ns,
                           std::uint64_t window_samples) {
  const std::size_t before = ring.times_ns.size();
  ring.times_ns.push_back(now_ns);
  for (const auto& [name, c] : sample) {
    auto it = ring.steps.find(name);
    // A step first seen now had nothing before. At most kRankWindowMaxSteps steps a rank
    // (as its retired totals): past them a new name is left out of the windows.
    if (it == ring.steps.end()) {
      if (ring.steps.size() >= kRankWindowMaxSteps) continue;
      it = ring.steps.try_emplace(name, std::deque<RankCumulative>(before)).first;
    }
    it->second.push_back(c);
  }
  // A step the rank no longer has (its process was forgotten) keeps its last figures
  // while they still make a difference to some window; once every sample is the same,
  // it adds nothing to any window and goes (so churned step names do not pile up).
  for (auto it = ring.steps.begin(); it != ring.steps.end();) {
    auto& samples = it->second;
    if (samples.size() == before) {
      samples.push_back(samples.empty() ? RankCumulative{} : samples.back());
      const RankCumulative last = samples.back();
      if (std::all_of(samples.begin(), samples.end(), [&](const RankCumulative& c) {
            return c.spans == last.spans && c.total_ns == last.total_ns;
          })) {
        it = ring.steps.erase(it);
        continue;
      }
    }
    ++it;
  }
  while (ring.times_ns.size() > window_samples) {
    ring.times_ns.pop_front();
    for (auto& [name, samples] : ring.steps) samples.pop_front();
  }
  return ring;
}

void sample_rank_windows(CollectorState& state, std::uint64_t now_ns) {
  const RankSkewRules& rules = state.job_limits.rank_skew;
  if (rules.window_samples == 0) return;
  if (state.rank_windows_sampled_ns != 0 &&
      now_ns - state.rank_windows_sampled_ns < rules.sample_interval_ms * 1'000'000) {
    return;
  }
  state.rank_windows_sampled_ns = now_ns;
  // The cumulative figures of every rank with a process in the table.
  std::map<RankWindowKey, RankSample, std::less<>> now;
  for (const auto& slot : state.slots) {
    if (!slot || slot->rank == proto::kNoRank) continue;
    RankSample& steps = now[RankWindowKey{slot->peer.uid, slot->job, slot->rank}];
    for (std::size_t s = 0; s < slot->steps.size(); ++s) {
      const Histogram& hist = slot->steps[s].hist;
      if (hist.count() != 0) add(steps, slot->step_name(s), hist.count(), hist.sum());
    }
  }
  for (auto& [key, steps] : now) {
    const auto job = state.retired_jobs->find(JobKey{key.uid, key.job});
    if (job == state.retired_jobs->end()) continue;
    const auto rank = job->second.ranks.find(key.rank);
    if (rank == job->second.ranks.end()) continue;
    for (const auto& [name, t] : rank->second) add(steps, name, t.count, t.total_ns);
  }
  // The new rings, from the old ones (a view may hold those: never written in place).
  auto next = std::make_shared<RankWindows>();
  std::size_t bytes = 0;
  std::map<std::uint32_t, std::size_t> by_uid;
  for (auto& [key, steps] : now) {
    const auto old = state.rank_windows->find(key);
    RankWindow ring = add_rank_sample(old != state.rank_windows->end() ? old->second : RankWindow{},
                                      steps, now_ns, rules.window_samples);
    const std::size_t ring_bytes = rank_window_bytes(key, ring);
    bytes += ring_bytes;
    by_uid[key.uid] += ring_bytes;
    next->emplace(key, std::move(ring));
  }
  state.remove_retired(state.rank_windows_charged);
  state.rank_windows_charged = bytes;
  state.add_retired(bytes);
  // Each uid's windows count in its share of the budget too (admit_state): a tenant whose
  // ranks bring many steps pays for their windows with its own room, not everyone's.
  for (const auto& [uid, held] : state.rank_windows_by_uid) uncharge_uid(state, uid, held);
  for (const auto& [uid, held] : by_uid) charge_uid(state, uid, held);
  state.rank_windows_by_uid = std::move(by_uid);
  state.rank_windows = std::move(next);
}

RankWindowFigures window_figures(const RankWindow& ring, std::uint64_t window_ns) {
  RankWindowFigures out;
  const std::size_t n = ring.times_ns.size();
  if (n < 2) return out;
  const std::uint64_t newest = ring.times_ns.back();
  // The newest sample at or before newest - window_ns, else the oldest.
  std::size_t first = 0;
  for (std::size_t i = n - 1; i-- > 0;) {
    if (newest - ring.times_ns[i] >= window_ns) {
      first = i;
      break;
    }
  }
  out.covered_ns = newest - ring.times_ns[first];
  for (const auto& entry : ring.steps) {
    // Named, not bound: the lambda below captures them (clang 14 cannot capture a
    // structured binding).
    const std::string& name = entry.first;
    const auto& samples = entry.second;
    RankWindowStep step;
    // Counters that went backwards (the retired totals forgotten) count as nothing.
    const auto delta = [&](std::size_t a, std::size_t b) {
      return RankCumulative{
          samples[b].spans > samples[a].spans ? samples[b].spans - samples[a].spans : 0,
          samples[b].total_ns > samples[a].total_ns ? samples[b].total_ns - samples[a].total_ns
                                                    : 0};
    };
    const RankCumulative all = delta(first, n - 1);
    step.spans = all.spans;
    step.total_ns = all.total_ns;
    for (std::size_t i = first; i + 1 < n; ++i) {
      const RankCumulative d = delta(i, i + 1);
      step.interval_means.push_back(d.spans == 0 ? std::numeric_limits<double>::quiet_NaN()
                                                 : static_cast<double>(d.total_ns) /
                                                       static_cast<double>(d.spans));
    }
    if (step.spans != 0) out.steps.emplace(name, std::move(step));
  }
  return out;
}

}  // namespace steptrace::daemon
