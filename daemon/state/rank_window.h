// Rank windows: what each rank of a job did over the last N seconds (`report --window
// N`). Totals only say what a rank did since it started; to see the last minute the
// daemon keeps, per (uid, job, rank), a small ring of cumulative per-step samples taken on
// the liveness tick every RankSkewRules::sample_interval_ms (window_samples of them), and
// a window is the difference between the newest sample and the one N seconds before it.
//
// The cumulative figures are those of steptrace_job_rank_step_*: the rank's processes
// in the table plus what its evicted ones left (RetiredJob::ranks), so a rank's restart
// (a new pid) does not reset its window. Only ranks with a process in the table are
// sampled, so the rings are bounded by the process table (max_processes, and each uid's
// max_processes_per_uid); their heap is charged to the state budget like the retired
// totals (charge.h), never refused.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <string>
#include <vector>

namespace steptrace::daemon {

struct CollectorState;

struct RankWindowKey {
  std::uint32_t uid = 0;
  std::string job;
  std::uint32_t rank = 0;
  auto operator<=>(const RankWindowKey&) const = default;
};

struct RankCumulative {
  std::uint64_t spans = 0;
  std::uint64_t total_ns = 0;
};

// One rank's ring: sample i of every step was taken at times_ns[i].
struct RankWindow {
  std::deque<std::uint64_t> times_ns;
  std::map<std::string, std::deque<RankCumulative>, std::less<>> steps;
};
using RankWindows = std::map<RankWindowKey, RankWindow, std::less<>>;

// The steps a rank's ring keeps at most: as many as its retired totals
// (RetiredJob::kMaxJobSteps, tied in rank_window.cpp).
inline constexpr std::size_t kRankWindowMaxSteps = 256;

// A rank's cumulative figures per step at one sample.
using RankSample = std::map<std::string, RankCumulative, std::less<>>;

// On the liveness tick: a sample of every ranked process's job when the interval has
// passed since the last one (and the rings of ranks no longer in the table dropped).
void sample_rank_windows(CollectorState& state, std::uint64_t now_ns);

// `ring` with `sample`, taken at now_ns, added: what sample_rank_windows does to each
// rank's ring. A step first seen had nothing before (zeros in the earlier samples); at
// most kRankWindowMaxSteps steps a ring, past which a new step is left out. A step the
// sample lacks keeps its last figures while they still make a difference to some
// window, and goes once every sample of it is the same. The oldest samples go past
// window_samples.
RankWindow add_rank_sample(RankWindow ring, const RankSample& sample, std::uint64_t now_ns,
                           std::uint64_t window_samples);

// A rank's step over a window: spans and time between the newest sample and the one at
// or before newest - window_ns (the oldest kept when the ring is shorter), and the mean
// span of each sample interval in between (NaN where it ended none).
struct RankWindowStep {
  std::uint64_t spans = 0;
  std::uint64_t total_ns = 0;
  std::vector<double> interval_means;
};
struct RankWindowFigures {
  std::uint64_t covered_ns = 0;  // what the window really spans (0: under two samples)
  std::map<std::string, RankWindowStep, std::less<>> steps;
};
RankWindowFigures window_figures(const RankWindow& ring, std::uint64_t window_ns);

// The heap a rank's ring holds (charge.h's estimate).
std::size_t rank_window_bytes(const RankWindowKey& key, const RankWindow& ring);

}  // namespace steptrace::daemon
