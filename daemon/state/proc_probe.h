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
struct ProcessProbe {
  std::uint64_t start_time = 0;
  bool zombie = false;
  std::string comm;
};

// Hooks to the outside world, replaceable in unit tests.
struct Environment {
  std::function<std::uint64_t()> monotonic_now_ns;  // CLOCK_MONOTONIC, as clients stamp
  std::function<std::optional<ProcessProbe>(std::int32_t pid)> probe;  // reads /proc
  static Environment system();                                         // the real clock and /proc
};

// Parses /proc/PID/stat: the state (zombie or not) and the start time (field 22).
// nullopt when malformed.
std::optional<ProcessProbe> parse_proc_stat(std::string_view stat);

}  // namespace steptrace::daemon
