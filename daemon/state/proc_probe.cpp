// Environment::system(): the real CLOCK_MONOTONIC and /proc/PID probes.
#include <time.h>

#include <charconv>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include "daemon/state/proc_probe.h"

namespace steptrace::daemon {
namespace {

std::uint64_t read_monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

bool read_file(const std::string& path, std::string& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  std::ostringstream s;
  s << in.rdbuf();
  out = s.str();
  return !in.bad();
}

std::optional<ProcessProbe> probe_proc(std::int32_t pid) {
  if (pid <= 0) return std::nullopt;
  const std::string dir = "/proc/" + std::to_string(pid);
  std::string stat;
  if (!read_file(dir + "/stat", stat)) return std::nullopt;
  auto probe = parse_proc_stat(stat);
  if (!probe) return std::nullopt;
  std::string comm;
  if (read_file(dir + "/comm", comm)) {
    while (!comm.empty() && (comm.back() == '\n' || comm.back() == '\0')) comm.pop_back();
    probe->comm = std::move(comm);
  }
  return probe;
}

}  // namespace

// /proc/PID/stat is "pid (comm) state f4 f5 ...". comm may hold spaces and parentheses,
// so fields are counted from after the LAST ')': field 3 (state) comes first, the start
// time is field 22.
std::optional<ProcessProbe> parse_proc_stat(std::string_view stat) {
  const auto close = stat.rfind(')');
  if (close == std::string_view::npos) return std::nullopt;
  std::string_view rest = stat.substr(close + 1);
  int field = 2;
  ProcessProbe probe;
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

Environment Environment::system() {
  Environment env;
  env.monotonic_now_ns = &read_monotonic_ns;
  env.probe = &probe_proc;
  return env;
}

}  // namespace steptrace::daemon
