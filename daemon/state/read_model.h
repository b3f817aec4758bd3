// The read model: what a CollectorView (collector.h) answers, as plain values, so that
// the renderers (daemon/report/) read the state without knowing how ingest lays it out
// (collector_state.h). A row may point into the view (a step's histogram, see
// StepFigures::hist): it is valid while the view it came from lives.
//
// Data flow: the render thread holds a view -> CollectorView::processes() selects and
// describes the processes -> totals() merges their steps by name, jobs() groups them by
// (uid, job id) -> the renderers write text, JSON or Prometheus from these rows.
// Counters that must never go backwards (Prometheus) also need what processes evicted
// from the table left behind: step_histograms() adds it to the node's per-step
// histograms, jobs_and_retired() to each job (RetiredJobFigures).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "daemon/state/histogram.h"
#include "daemon/state/types.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {

struct ProcessRecord;

// A job as a command names it (`report --job`): one uid's processes that sent one job
// id. Two uids that send the same id run two jobs; "" is a uid's processes without one.
struct JobRef {
  std::uint32_t uid = 0;
  std::string job;
  auto operator<=>(const JobRef&) const = default;
};

// One step's figures: a process's own, or merged by name over several processes.
struct StepFigures {
  std::string name;
  std::uint64_t open = 0;  // spans open now
  std::uint64_t unmatched_ends = 0;
  std::uint64_t abandoned = 0;
  std::uint64_t depth_dropped = 0;  // starts dropped past max_open_depth
  std::uint64_t self_ns = 0;        // time not spent in spans nested inside
  std::uint64_t processes = 0;      // processes with this step (1 for a process's own)
  // Count, sum, min, max, percentiles and Prometheus buckets.
  const Histogram& hist() const { return merged_ ? *merged_ : *in_view_; }

 private:
  friend class CollectorView;
  const Histogram* in_view_ = nullptr;  // a process's own: the view's
  // Merged over processes: its own, on the heap so that a process's row (metrics make
  // one per (process, step)) stays small.
  std::shared_ptr<const Histogram> merged_;
};

// A thread's innermost open span now (what `steptrace top` shows, e.g. a trainer stuck
// in WaitPoll).
struct OpenSpanNow {
  std::uint32_t thread = 0;
  std::string step;
  std::uint64_t open_for_ns = 0;
  std::uint32_t depth = 0;  // spans open on the thread
};

struct ProcessFigures {
  ProcessKey key;
  std::uint32_t uid = 0;
  std::uint32_t gid = 0;
  std::string comm;  // as the process set it: sanitise before a terminal
  std::string client;
  std::string library_version;
  std::string job;  // "" when it sent none
  std::uint32_t rank = proto::kNoRank;
  std::uint32_t local_rank = proto::kNoRank;
  std::uint32_t world_size = 0;  // 0: not sent
  bool alive = true;
  std::uint32_t connections = 0;
  std::uint64_t exited_at_ns = 0;  // when its exit was noticed (not alive)
  std::uint64_t dropped = 0;
  std::array<std::uint64_t, proto::kReportDropCauseCount> dropped_by_cause{};
  // Event records folded for it, over the daemon's restarts; none when restored from a
  // snapshot of a build that did not count them.
  std::optional<std::uint64_t> events;
  // Over all its steps.
  std::uint64_t unmatched_ends = 0;
  std::uint64_t abandoned = 0;
  std::uint64_t open = 0;
  std::uint64_t ledger_refused = 0;  // its Ledger records the shared view did not apply
  std::vector<StepFigures> steps;    // with data or open spans, built-ins first
  std::vector<OpenSpanNow> current;  // per thread with an open span, by thread id

 private:
  friend class CollectorView;
  const ProcessRecord* record_ = nullptr;
};

// One step's totals that a job's evicted processes left.
struct RetiredStepTotals {
  std::string name;
  std::uint64_t count = 0;  // ended spans
  std::uint64_t total_ns = 0;
  std::uint64_t self_ns = 0;
};

// What the processes of a job that left the table (evicted) had, kept so that per-job
// counters keep counting after them. The state bounds these jobs (Limits::max_jobs,
// max_jobs_per_uid, for jobs with no process left in the table) and their step names.
// One rank's step totals that a job's evicted processes with that rank left.
struct RetiredRankFigures {
  std::uint32_t rank = 0;
  std::vector<RetiredStepTotals> steps;  // by name
};

struct RetiredJobFigures {
  std::vector<RetiredStepTotals> steps;   // by name
  std::vector<RetiredRankFigures> ranks;  // by rank, those that sent one (a share of steps)
  std::uint64_t processes = 0;            // evicted
  std::uint64_t dropped = 0;              // events they could not deliver
  // Step names kept per job; beyond, merged into "(other)".
  static constexpr std::size_t kMaxSteps = 256;
};

// A uid's processes that sent one job id (the ones without one are the uid's job "").
struct JobFigures {
  std::uint32_t uid = 0;
  std::string job;
  std::vector<const ProcessFigures*> processes;  // into the span jobs() was given
  std::size_t live = 0;
  std::uint32_t world_size = 0;      // the largest sent (0: none)
  std::vector<std::uint32_t> ranks;  // sent, each once, ascending
  // jobs_and_retired() only: what its evicted processes left (none: none left the table).
  std::optional<RetiredJobFigures> retired;
};

// One step name's histogram summed over processes (CollectorView::step_histograms).
struct StepHistogram {
  std::string name;
  Histogram hist;
};

// The process table as a whole (stats).
struct TableFigures {
  std::uint64_t tracked = 0;
  std::uint64_t live = 0;
  std::uint64_t exited = 0;
  std::uint64_t connected = 0;  // with at least one connection open
  std::uint64_t custom_steps = 0;
  std::uint64_t state_bytes_estimate = 0;  // the table and its histograms
  std::uint64_t state_bytes_charged = 0;   // against max_process_state_bytes / max_state_bytes
  // Records ingest cloned while views held them, still held by a view when this one was
  // frozen (ViewCopies, charge.h): heap beside the charge, not against the budget.
  std::uint64_t view_copy_bytes = 0;
};

}  // namespace steptrace::daemon
