// Rank skew: in a job of several ranks, which rank is slow in which step. Each rank's
// mean span time per step is compared with the median over the job's ranks, over the
// whole run and over a recent window (`report --window N`); a straggler is a rank both
// clearly off the median (ratio AND a robust spread, the median absolute deviation) and
// sustained: over the run its median span is off too (one slow iteration moves the mean,
// not the median), over a window it is off in at least half of the sample intervals the
// window covers. A waiting step (WaitPoll, or a configured collective) reads the other
// way round: the rank everyone waits for is the one that waits least.
//
// The figures come from the read model (read_model.h) and the rank windows
// (rank_window.h); this file only computes, so it is tested on synthetic ranks.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace steptrace::daemon {

// The thresholds (config "rank_skew", config/README.md).
struct RankSkewRules {
  double ratio = 1.25;          // mean / median (waiting steps: median / mean) at least this
  double mad_factor = 3.0;      // and |mean - median| at least this many MADs over the ranks
  std::uint64_t min_spans = 3;  // spans of the rank in the scope, below: not judged
  // Waiting steps: the one that waits least is the suspect. WaitPoll is always one.
  std::vector<std::string> waiting_steps;
  // The rank windows: a cumulative sample per (job, rank, step) every sample_interval_ms,
  // window_samples of them kept (so `--window` reaches interval x samples seconds back).
  std::uint64_t sample_interval_ms = 5000;
  std::uint64_t window_samples = 72;
};

// One rank's figures for one step in one scope.
struct RankStepInput {
  std::uint32_t rank = 0;
  std::uint64_t spans = 0;
  std::uint64_t total_ns = 0;
  // Sustained: values comparable across ranks index by index (the run: its median span;
  // a window: the mean of each sample interval, NaN where it ended no span).
  std::vector<double> pieces;
  // The pieces the suspect must have to be called sustained: the run's single piece is
  // its median span (1); a window needs two sample intervals at least (2), so that one
  // slow interval (a job's uneven start, say) is never enough.
  std::size_t min_pieces = 1;
};

struct RankStepFigure {
  std::uint32_t rank = 0;
  std::uint64_t spans = 0;
  double mean_ns = 0;
  double ratio = 0;  // mean / median
};

// One step of one job in one scope, over the ranks with at least one span.
struct StepSkew {
  std::string step;
  bool waiting = false;
  double median_ns = 0;
  double mad_ns = 0;
  RankStepFigure slowest;
  RankStepFigure fastest;
  std::vector<RankStepFigure> ranks;  // by rank
  // The rank flagged (at most one per step and scope: the farthest off), if any.
  std::optional<RankStepFigure> straggler;
};

// A job's skew (CollectorView::rank_skew): per step with two ranks or more, over the
// processes a report covers and, when asked, over the last window_ns of the rank windows.
struct JobRankSkew {
  std::vector<StepSkew> run;
  std::optional<std::uint64_t> window_ns;  // asked (`--window`)
  std::uint64_t covered_ns = 0;            // what the window's samples span (0: none yet)
  std::vector<StepSkew> window;
};

// None when fewer than two ranks ended a span of the step.
std::optional<StepSkew> step_skew(std::string step, bool waiting,
                                  const std::vector<RankStepInput>& ranks,
                                  const RankSkewRules& rules);

bool is_waiting_step(std::string_view step, const RankSkewRules& rules);

}  // namespace steptrace::daemon
