// Which processes a `trace` takes: `--pid N` (every window of that pid, as before),
// `--children` (each --pid's live descendants, by ProcessKey) and `--job [UID:]ID` (every
// window of the job's processes). Chosen in the daemon, which knows each process's
// (uid, job) and start time, so that neither a job's size nor a reused pid changes what a
// trace holds (PROTOCOL.md 10.5).
//
// Why --children goes by ProcessKey: the CLI used to walk /proc and send the descendants'
// pids, and `--pid` takes every window of a pid, exited ones included: a descendant on a
// pid an earlier, exited process had (pid_max is 32768 on many hosts; parallel builds go
// through it in minutes) brought that process's window along. The daemon reads each
// live process's parent and start time from one walk of /proc and keeps only windows of
// exactly those processes (a live --pid's own too).
#pragma once

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

// The processes descended from `pid` (children, their children...) that run now, from
// one read of PROC/N/stat each (parent and start time); `pid` itself not included.
std::vector<ProcessKey> live_descendants(std::int32_t pid, const std::string& proc_root = "/proc");

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
