// How the daemon sees the outside world: the monotonic clock clients stamp with, and
// /proc/PID (liveness, start time, comm). Replaceable in unit tests through Environment.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace steptrace::daemon {

// What /proc says about a pid right now; nullopt when gone. `zombie` counts as dead.
// A probe that failed for another reason than the process being gone (EMFILE, ENFILE,
// ENOMEM, EACCES...) has `error` set: it says nothing of the process, and must never be
// taken for a death (a live holder's reservations would be flagged leaked for good).
struct ProcessProbe {
  std::uint64_t start_time = 0;
  bool zombie = false;
  std::string comm;
  int error = 0;  // errno of a failed probe; then nothing else is meaningful
};

// Whether the process (pid, start_time) runs, from a probe of its pid.
enum class Liveness { kAlive, kDead, kUnknown };
Liveness liveness_of(const std::optional<ProcessProbe>& probe, std::uint64_t start_time);

// Hooks to the outside world, replaceable in unit tests.
struct Environment {
  std::function<std::uint64_t()> monotonic_now_ns;  // CLOCK_MONOTONIC, as clients stamp
  std::function<std::optional<ProcessProbe>(std::int32_t pid)> probe;  // reads /proc
  static Environment system();                                         // the real clock and /proc
};

// Parses /proc/PID/stat: the comm (between the first '(' and the last ')'), the state
// (zombie or not) and the start time (field 22). nullopt when malformed.
std::optional<ProcessProbe> parse_proc_stat(std::string_view stat);

}  // namespace steptrace::daemon
