#include "daemon/state/rank_skew.h"

#include <algorithm>
#include <cmath>
#include <string_view>
#include <utility>

namespace steptrace::daemon {
namespace {

double median_of(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// How far `value` is off `median` the suspect's way: slower for a step, less waiting for
// a waiting step (the rank everyone else waits for).
double off_ratio(double value, double median, bool waiting) {
  if (waiting) return value > 0 ? median / value : (median > 0 ? INFINITY : 1.0);
  return median > 0 ? value / median : (value > 0 ? INFINITY : 1.0);
}

// Sustained: the suspect is off in its pieces too, index by index against the median of
// the other ranks' pieces there (its own left out); in at least half of the pieces it
// has, in two when it has two or more, and in no fewer than min_pieces (so one slow
// sample interval of a window is not enough).
bool sustained(const RankStepInput& suspect, const std::vector<RankStepInput>& ranks, bool waiting,
               const RankSkewRules& rules) {
  std::size_t valid = 0, off = 0;
  for (std::size_t i = 0; i < suspect.pieces.size(); ++i) {
    const double mine = suspect.pieces[i];
    if (std::isnan(mine)) continue;
    std::vector<double> all;
    for (const RankStepInput& r : ranks) {
      if (r.rank == suspect.rank) continue;
      if (i < r.pieces.size() && !std::isnan(r.pieces[i])) all.push_back(r.pieces[i]);
    }
    if (all.size() < 2) continue;
    ++valid;
    if (off_ratio(mine, median_of(std::move(all)), waiting) >= rules.ratio) ++off;
  }
  if (valid == 0 || valid < suspect.min_pieces) return false;
  return off * 2 >= valid && (valid < 2 || off >= 2);
}

}  // namespace

bool is_waiting_step(std::string_view step, const RankSkewRules& rules) {
  if (step == "WaitPoll") return true;  // proto/steps.h: the built-in waiting step
  return std::find(rules.waiting_steps.begin(), rules.waiting_steps.end(), step) !=
         rules.waiting_steps.end();
}

std::optional<StepSkew> step_skew(std::string step, bool waiting,
                                  const std::vector<RankStepInput>& ranks,
                                  const RankSkewRules& rules) {
  std::vector<const RankStepInput*> with_spans;
  for (const RankStepInput& r : ranks) {
    if (r.spans > 0) with_spans.push_back(&r);
  }
  if (with_spans.size() < 2) return std::nullopt;
  StepSkew out;
  out.step = std::move(step);
  out.waiting = waiting;
  std::vector<double> means;
  for (const RankStepInput* r : with_spans) {
    const double mean = static_cast<double>(r->total_ns) / static_cast<double>(r->spans);
    means.push_back(mean);
    out.ranks.push_back({r->rank, r->spans, mean, 0});
  }
  out.median_ns = median_of(means);
  std::vector<double> deviations;
  for (const double m : means) deviations.push_back(std::abs(m - out.median_ns));
  out.mad_ns = median_of(std::move(deviations));
  for (RankStepFigure& f : out.ranks) {
    f.ratio = out.median_ns > 0 ? f.mean_ns / out.median_ns : 1.0;
  }
  const auto by_mean = [](const RankStepFigure& a, const RankStepFigure& b) {
    return a.mean_ns < b.mean_ns;
  };
  out.slowest = *std::max_element(out.ranks.begin(), out.ranks.end(), by_mean);
  out.fastest = *std::min_element(out.ranks.begin(), out.ranks.end(), by_mean);
  // The suspect: the slowest, or for a waiting step the one that waits least. A MAD of
  // zero (every other rank alike) counts as 1% of the median, so that ranks a few
  // nanoseconds apart are never "many MADs" off.
  const RankStepFigure& suspect = waiting ? out.fastest : out.slowest;
  const double mad = std::max(out.mad_ns, out.median_ns * 0.01);
  const bool off = off_ratio(suspect.mean_ns, out.median_ns, waiting) >= rules.ratio &&
                   std::abs(suspect.mean_ns - out.median_ns) >= rules.mad_factor * mad &&
                   suspect.spans >= rules.min_spans;
  if (off) {
    const auto input = std::find_if(ranks.begin(), ranks.end(),
                                    [&](const RankStepInput& r) { return r.rank == suspect.rank; });
    if (input != ranks.end() && sustained(*input, ranks, waiting, rules)) out.straggler = suspect;
  }
  return out;
}

}  // namespace steptrace::daemon
