// A state image: what a snapshot keeps of the Collector's state, as plain values, so
// that the snapshot codec (daemon/persist/snapshot_codec.h) reads and writes the daemon's
// state without knowing how ingest lays it out (collector_state.h, private to state/).
// It mirrors the snapshot, not the process table: per process its identity, drops and
// steps (those with data), what evicted processes left (retired histograms by step name,
// retired jobs), the ledger's state and the counters a snapshot carries.
//
// Data flow: CollectorView::image() makes one from a frozen view (on the render thread,
// or at shutdown) -> encode_snapshot writes it; at start decode_snapshot reads a document
// into one, checked field by field -> Collector::adopt(image) installs it
// (state_image.cpp turns it into the table's records).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "daemon/state/histogram.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/types.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {

// One step of a process with data: its built-in or registered id and its aggregates.
struct StepImage {
  std::uint32_t id = 0;
  std::string name;  // the built-in's, or the registered one (Collector::adopt goes by id)
  Histogram hist;    // the ended spans
  std::uint64_t unmatched_ends = 0;
  // Spans abandoned, plus those open when the image was made: whoever installs it has no
  // connection to end them.
  std::uint64_t abandoned = 0;
  std::uint64_t depth_dropped = 0;  // starts dropped past max_open_depth
  std::uint64_t self_ns = 0;        // time not spent in spans nested inside (<= hist.sum())
};

// A custom step the process registered (id in proto::kFirstCustomStep and up).
struct CustomStepImage {
  std::uint32_t id = 0;
  std::string name;
};

// The spans of one thread that were open when the image was taken (the process was
// connected, or the daemon stopped gracefully): restored open, so that their ends still
// match when the process reconnects to the next daemon; abandoned if it is found dead.
struct OpenStackImage {
  std::uint32_t id = 0;               // a built-in or registered step id, once per thread
  std::vector<std::uint64_t> starts;  // CLOCK_MONOTONIC ns, outermost first; not empty
};
struct OpenThreadImage {
  std::uint32_t tid = 0;  // once per process
  // Per nesting depth (outermost first), the time of the spans that ended one level
  // deeper while it was open (for self time): one per open span of the thread, so its
  // size is the sum of the stacks' sizes (at most limits.max_open_depth).
  std::vector<std::uint64_t> child_ns;
  std::vector<OpenStackImage> stacks;
};

struct ProcessImage {
  PeerIdentity peer;            // (pid, start_time), uid, gid, comm
  std::string client;           // from the hello
  std::string library_version;  // from the hello
  bool alive = true;
  std::uint64_t exited_at_ns = 0;  // CLOCK_MONOTONIC when its exit was noticed
  std::uint64_t exit_order = 0;    // increasing per exit (nonzero once exited)
  std::uint64_t dropped = 0;
  std::array<std::uint64_t, proto::kReportDropCauseCount> dropped_by_cause{};
  // Event records folded for it; none when a snapshot of an older build did not say.
  std::optional<std::uint64_t> events;
  std::uint64_t ledger_refused = 0;  // ProcessRecord::ledger_refused
  // The process's socket-batch cursor (ProcessRecord::batch_sequence, batch_next).
  std::uint64_t batch_sequence = 0;
  std::uint32_t batch_next = 0;
  // From the Identity frame; "" / proto::kNoRank / 0: not sent.
  std::string job;
  std::uint32_t rank = proto::kNoRank;
  std::uint32_t local_rank = proto::kNoRank;
  std::uint32_t world_size = 0;
  std::vector<CustomStepImage> custom_steps;  // in registration order, each id once
  // The steps with data, each id once: built-ins in id order, then custom steps in
  // registration order. An id must be built-in or in custom_steps.
  std::vector<StepImage> steps;
  std::vector<OpenThreadImage> open;  // threads with open spans, in thread id order
};

// What the processes of one job that left the table had (per-job counters count on).
struct JobStepImage {
  std::uint64_t count = 0;
  std::uint64_t total_ns = 0;
  std::uint64_t self_ns = 0;  // <= total_ns
};
struct RetiredJobImage {
  std::uint32_t uid = 0;
  std::string job;  // "" for the uid's processes that sent none
  std::uint64_t processes = 0;
  std::uint64_t dropped = 0;
  std::uint64_t retired_order = 0;  // increasing: the least recent goes first
  std::map<std::string, JobStepImage, std::less<>> steps;  // by step name
  // The same per rank (RetiredJob::ranks), by rank; empty from snapshots before them.
  std::map<std::uint32_t, std::map<std::string, JobStepImage, std::less<>>> ranks;
};

struct StateImage {
  std::uint64_t taken_at_ns = 0;        // CLOCK_MONOTONIC of the view it was made of
  std::vector<ProcessImage> processes;  // in (pid, start_time) order, each key once
  // Prometheus step histograms of evicted processes, by step name.
  std::map<std::string, Histogram, std::less<>> retired;
  std::vector<RetiredJobImage> retired_jobs;  // in (uid, job) order, each once
  ledger::State ledger;
  // The daemon's counters and the server's (a snapshot keeps those of the counter table
  // it marks kept, and the counts by kind); Collector::adopt adds them to its own.
  DaemonCounters counters;
  // Records of the document that broke a rule and were left out ("path: reason"): one
  // bad process record costs that process, not the whole state.
  std::vector<std::string> skipped;
  // More records left out, past the reasons a reader keeps (counted all the same).
  std::uint64_t skipped_unnamed = 0;
};

// The most an image of state under `limits` holds of what the state bounds itself (beyond
// these it merges into "(other)" or forgets), so that a reader can refuse more.
struct ImageBounds {
  std::size_t retired_names = 0;   // StateImage::retired, "(other)" included
  std::size_t retired_jobs = 0;    // StateImage::retired_jobs
  std::size_t job_steps = 0;       // RetiredJobImage::steps, "(other)" included
  std::size_t job_ranks = 0;       // RetiredJobImage::ranks
  std::size_t job_rank_steps = 0;  // names over all of RetiredJobImage::ranks
};
ImageBounds image_bounds(const Limits& limits);

}  // namespace steptrace::daemon
