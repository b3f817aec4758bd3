// `steptrace trace merge A.json B.json ... -o JOB.json`: one timeline of a job spread over
// nodes, from the `trace` documents each node's steptraced wrote (proto/PROTOCOL.md
// section 10.5).
//
// Each input's times are since its own origin; otherData.ts_origin_unix_ns anchors that
// origin to the wall clock, so the files are joined on their anchors: the earliest anchor
// becomes the merged trace's 0 and every other file is shifted by the difference (whole
// nanoseconds, no rounding). When the nodes' clocks disagree by more than the spans
// (no NTP, a skewed host), --align-step NAME[:K] instead lines the files up on step NAME:
// in each file every rank (every process when it has no rank) has its K-th span (from 1)
// of NAME, the file's align point is the median of those starts over its ranks, and each
// file is shifted so that its align point meets the first file's. All ranks of a file
// share its clock, so one shift per file; the median keeps one late rank from dragging
// its whole node. Processes get new pids (pids of two nodes may be equal) and tracks
// named `node / rank N / comm [pid]`, ordered by rank.
//
// Memory: each file is parsed as a stream (nlohmann's SAX interface), one event at a
// time, into compact records (the event's other members as text, its pid and times as
// numbers), and the merged document is written from them as it is made: the peak is
// ~1.3x the inputs' size, not the ~12x that whole JSON trees took (bench/RESULTS.md).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cli/trace_command.h"

namespace steptrace::cli {

struct MergeRequest {
  std::vector<std::string> inputs;  // at least one
  std::string output;               // -o FILE ("-": standard output)
  std::string align_step;           // --align-step NAME[:K] as typed, empty when not given
  bool force = false;               // replace an existing FILE
  std::uint64_t max_mb = kDefaultMaxTraceMb;  // --max-mb, as `trace`'s: 0 for no bound
};

// NAME[:K] of --align-step: the step and the span's index from 1 (1 when no K).
struct AlignStep {
  std::string step;
  std::uint64_t index = 1;
};
std::optional<AlignStep> parse_align_step(const std::string& text);

// The merged document of `documents` (their text; `names` name them in errors), or the
// reason it cannot be made. Exposed for tests; run_trace_merge() streams files instead.
struct MergeResult {
  std::string document;  // empty on error
  std::string error;     // empty on success
};
MergeResult merge_traces(const std::vector<std::string>& documents,
                         const std::vector<std::string>& names,
                         const std::optional<AlignStep>& align);

// Runs `steptrace trace merge`; the exit status (0, 1 bad or unreadable input or write
// failure, 2 bad usage or FILE exists). Messages go to stderr.
int run_trace_merge(const MergeRequest& request);

}  // namespace steptrace::cli
