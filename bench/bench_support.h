// Helpers shared by the benchmarks: what machine they ran on, a process's resident
// memory and CPU time from /proc, the real daemon's JSON report, and a small reporter
// that keeps each Google Benchmark's median so a benchmark can print ratios between
// figures of the same run.
//
// Data flow: a benchmark starts steptraced (tests/support/daemon_process.h), drives it,
// then reads figures back through these helpers and prints them next to a baseline
// measured in the same process and run. Nothing here asserts a timing.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

namespace steptrace::bench {

// "nproc=2, CPU=AMD EPYC ..." from sysconf and /proc/cpuinfo.
std::string machine_description();

// VmRSS / VmHWM of a process in KiB (pid 0: this process); nullopt when unreadable.
std::optional<std::uint64_t> vm_rss_kib(pid_t pid = 0);
std::optional<std::uint64_t> vm_hwm_kib(pid_t pid = 0);

// utime + stime of a process in seconds, from /proc/PID/stat; nullopt when unreadable.
std::optional<double> cpu_seconds(pid_t pid);

// Sends `command` (e.g. "report --json") to the daemon and parses the answer as JSON;
// nullopt (with a message on stderr) when the daemon does not answer or the answer is
// not JSON.
std::optional<nlohmann::json> daemon_json(const std::string& socket, const std::string& command);

// CLOCK_MONOTONIC in nanoseconds (what the client stamps events with).
std::uint64_t monotonic_ns();

}  // namespace steptrace::bench
