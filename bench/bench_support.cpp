#include "bench/bench_support.h"

#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

#include "tests/support/daemon_process.h"

namespace steptrace::bench {
namespace {

std::optional<std::uint64_t> status_field_kib(pid_t pid, const std::string& field) {
  const std::string path =
      pid == 0 ? std::string("/proc/self/status") : "/proc/" + std::to_string(pid) + "/status";
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) != 0) continue;
    std::istringstream fields(line.substr(field.size() + 1));
    std::uint64_t kib = 0;
    if (fields >> kib) return kib;
    return std::nullopt;
  }
  return std::nullopt;
}

}  // namespace

std::string machine_description() {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  std::string model = "unknown";
  while (std::getline(in, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(colon + 2);
      break;
    }
  }
  return "nproc=" + std::to_string(sysconf(_SC_NPROCESSORS_ONLN)) + ", CPU=" + model;
}

std::optional<std::uint64_t> vm_rss_kib(pid_t pid) { return status_field_kib(pid, "VmRSS"); }
std::optional<std::uint64_t> vm_hwm_kib(pid_t pid) { return status_field_kib(pid, "VmHWM"); }

std::optional<double> cpu_seconds(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto paren = stat.rfind(')');
  if (paren == std::string::npos) return std::nullopt;
  // Fields after "comm)": 3 state, 4 ppid, ... 14 utime, 15 stime.
  std::istringstream fields(stat.substr(paren + 1));
  std::string skip;
  for (int field = 3; field <= 13; ++field) fields >> skip;
  std::uint64_t utime = 0;
  std::uint64_t stime = 0;
  if (!(fields >> utime >> stime)) return std::nullopt;
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

std::optional<nlohmann::json> daemon_json(const std::string& socket, const std::string& command) {
  const auto reply = testing::command(socket, command, 30000);
  if (!reply) {
    std::fprintf(stderr, "daemon did not answer '%s' on %s\n", command.c_str(), socket.c_str());
    return std::nullopt;
  }
  auto doc = nlohmann::json::parse(*reply, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) {
    std::fprintf(stderr, "daemon's answer to '%s' is not JSON: %.200s\n", command.c_str(),
                 reply->c_str());
    return std::nullopt;
  }
  return doc;
}

std::uint64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace steptrace::bench
