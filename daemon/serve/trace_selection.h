// Which processes a `trace` takes: `--pid N` (every window of that pid, as before),
// `--children` (each --pid's live descendants, by ProcessKey) and `--job [UID:]ID` (every
// window of the job's processes). Chosen in the daemon, which knows each process's
// (uid, job) and start time, so that neither a job's size nor a reused pid changes what a
// trace holds (PROTOCOL.md 10.5).
//
// Why --children goes by ProcessKey: the CLI used to walk /proc and send the descendants'
// pids, and `--pid` takes every window of a pid, exited ones included: a descendant on a
// pid an earlier, exited process had (pid_max is 32768 on many hosts; parallel builds go
// through it in minutes) brought that process's window along. The daemon finds the live
// descendants and their start times and keeps only windows of exactly those processes (a
// live --pid's own too).
//
// How it finds them (issue 26): from each --pid down, through each thread's list of the
// children it forked (PROC/N/task/T/children), reading only the descendants' files,
// never every process of the host, and at most kMaxTraceDescendants processes and
// kMaxTraceDescendantTasks threads of them: a uid cannot make one trace read all of /proc.
// The selection runs on the render thread while the uid's trace slot is held, as one job
// of the bulk lane: a review timed 64k threads' files at 0.25-0.5 s, so the bound of 16,384
// is a quarter of that: plenty for a trainer and its workers, short beside a report.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "daemon/state/flight_recorder.h"
#include "daemon/state/read_model.h"
#include "daemon/state/types.h"

namespace steptrace::daemon {

struct TraceSelection {
  std::set<std::int32_t> pids;  // --pid: every window of these pids
  std::set<ProcessKey> keys;    // --children: exactly these processes
  std::optional<JobRef> job;    // --job: every window of the job's processes
  bool everything() const { return pids.empty() && keys.empty() && !job; }
  bool selects(const TraceCapture::Process& p) const;
};

// What one --children walk reads at most (all its --pids together): past either bound the
// trace is refused, with an error naming it.
inline constexpr std::size_t kMaxTraceDescendants = 4096;       // descendants' stat files
inline constexpr std::size_t kMaxTraceDescendantTasks = 16384;  // threads' children files
struct DescendantBounds {
  std::size_t processes = kMaxTraceDescendants;
  std::size_t tasks = kMaxTraceDescendantTasks;
};

// A trace refused while choosing its processes: the whole reply, `error: trace: ...`, and
// the bound it passed, if one (counted in stats' limits_hit on the io thread).
struct TraceRefusal {
  std::string reply;
  std::optional<LimitKind> limit;
};

// The processes descended from `roots` (children, their children...) that run now, by
// ProcessKey; the roots themselves not included. Each thread T of a process N lists the
// pids it forked in PROC/N/task/T/children (Linux 3.5 on, CONFIG_PROC_CHILDREN); each
// such pid's PROC/C/stat gives its start time, and its parent, which must be N (else the
// pid was reused meanwhile and is skipped, as are zombies, garbage and files that went
// away with their process). Or the refusal: past `bounds` (with its LimitKind), or a
// kernel without the children files (there is no bounded way to find descendants then).
std::variant<std::vector<ProcessKey>, TraceRefusal> live_descendants(
    const std::vector<std::int32_t>& roots, const std::string& proc_root = "/proc",
    DescendantBounds bounds = {});

// The process that has `pid` now (PROC/PID/stat's start time); nullopt when none runs.
std::optional<ProcessKey> live_process(std::int32_t pid, const std::string& proc_root = "/proc");

// The uid whose job `id` a `trace --job` takes (PROTOCOL.md 10.3's rules, over the
// processes in the capture): `uid` when given, else the caller's; root and the daemon's
// uid (`privileged`) also reach the one other uid with processes of that job. Or the
// error reply, `error: trace: ...`.
std::variant<std::uint32_t, std::string> trace_job_uid(const TraceCapture& capture,
                                                       std::string_view id,
                                                       std::optional<std::uint32_t> uid,
                                                       std::uint32_t caller, bool privileged);

// The capture with only the processes `selection` takes, and the marks they sent.
std::shared_ptr<const TraceCapture> select_processes(const TraceCapture& capture,
                                                     const TraceSelection& selection);

}  // namespace steptrace::daemon
