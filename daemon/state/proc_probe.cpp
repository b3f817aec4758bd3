// Environment::system(): the real CLOCK_MONOTONIC and /proc/PID probes.
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <string>
#include <string_view>

#include "daemon/state/proc_probe.h"
#include "proto/unique_fd.h"

namespace steptrace::daemon {
namespace {

std::uint64_t read_monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

// Reads /proc/PID/stat (one open, one or two reads, one close: a liveness tick pays
// this once per process). 0, or the errno that stopped it.
int read_stat(std::int32_t pid, std::string& out) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const proto::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd) return errno;
  char buffer[1024];
  int error = 0;
  for (;;) {
    const ssize_t n = ::read(fd.get(), buffer, sizeof buffer);
    if (n > 0) {
      out.append(buffer, static_cast<std::size_t>(n));
      if (out.size() > 4096) break;  // far beyond any stat line: stop, the parser decides
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = errno;
    break;
  }
  return error;
}

std::optional<ProcessProbe> probe_proc(std::int32_t pid) {
  if (pid <= 0) return std::nullopt;
  std::string stat;
  if (const int error = read_stat(pid, stat); error != 0) {
    // Gone (ENOENT), or exiting while read (ESRCH): dead. Anything else (EMFILE, ENFILE,
    // ENOMEM, EACCES...) is the probe's own failure.
    if (error == ENOENT || error == ESRCH) return std::nullopt;
    ProcessProbe failed;
    failed.error = error;
    return failed;
  }
  if (auto probe = parse_proc_stat(stat)) return probe;
  ProcessProbe failed;  // the kernel wrote something we cannot read: say so, not "dead"
  failed.error = EPROTO;
  return failed;
}

}  // namespace

// /proc/PID/stat is "pid (comm) state f4 f5 ...". comm may hold spaces and parentheses,
// so fields are counted from after the LAST ')': field 3 (state) comes first, the start
// time is field 22.
std::optional<ProcessProbe> parse_proc_stat(std::string_view stat) {
  const auto open = stat.find('(');
  const auto close = stat.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open)
    return std::nullopt;
  std::string_view rest = stat.substr(close + 1);
  int field = 2;
  ProcessProbe probe;
  probe.comm = std::string(stat.substr(open + 1, close - open - 1));
  bool have_state = false;
  while (!rest.empty()) {
    const auto begin = rest.find_first_not_of(' ');
    if (begin == std::string_view::npos) break;
    rest.remove_prefix(begin);
    const auto end = rest.find(' ');
    const std::string_view token = rest.substr(0, end);
    ++field;
    if (field == 3) {
      if (token.empty()) return std::nullopt;
      probe.zombie = token[0] == 'Z' || token[0] == 'X' || token[0] == 'x';
      have_state = true;
    } else if (field == 22) {
      const auto [ptr, ec] =
          std::from_chars(token.data(), token.data() + token.size(), probe.start_time);
      if (ec != std::errc{} || ptr != token.data() + token.size()) return std::nullopt;
      return have_state ? std::optional<ProcessProbe>(probe) : std::nullopt;
    }
    if (end == std::string_view::npos) break;
    rest.remove_prefix(end);
  }
  return std::nullopt;
}

Liveness liveness_of(const std::optional<ProcessProbe>& probe, std::uint64_t start_time) {
  if (!probe) return Liveness::kDead;
  if (probe->error != 0) return Liveness::kUnknown;
  return !probe->zombie && probe->start_time == start_time ? Liveness::kAlive : Liveness::kDead;
}

Environment Environment::system() {
  Environment env;
  env.monotonic_now_ns = &read_monotonic_ns;
  env.probe = &probe_proc;
  return env;
}

}  // namespace steptrace::daemon
