// The daemon's own process metrics, named as Prometheus client libraries name them
// (process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds, ...), and
// steptrace_build_info: what an operator needs to see that the collector itself stays
// small and which build answers. Read from /proc/self at render time (render thread).
#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <steptrace/version.h>
#include <fstream>
#include <sstream>
#include <string>

#include "daemon/report/report.h"
#include "daemon/report/report_format.h"
#include "daemon/state/collector.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {
namespace {

struct SelfStat {
  bool ok = false;
  double cpu_seconds = 0;
  double start_time_seconds = 0;  // since the epoch
  std::uint64_t virtual_bytes = 0;
  std::uint64_t resident_bytes = 0;
};

// The boot time in seconds since the epoch (/proc/stat "btime"), 0 when unreadable.
std::uint64_t boot_time() {
  std::ifstream in("/proc/stat");
  std::string key;
  std::uint64_t value = 0;
  while (in >> key) {
    if (key == "btime" && in >> value) return value;
    in.ignore(1 << 20, '\n');
  }
  return 0;
}

SelfStat read_self_stat() {
  SelfStat s;
  std::ifstream in("/proc/self/stat");
  std::string line;
  if (!std::getline(in, line)) return s;
  // Field 2 (comm) may hold spaces and parentheses: the fields after it start after the
  // last ')'.
  const auto close = line.rfind(')');
  if (close == std::string::npos) return s;
  std::istringstream fields(line.substr(close + 2));
  std::string field;
  // fields[0] is field 3 (state); utime 14, stime 15, starttime 22, vsize 23, rss 24.
  std::vector<std::string> f;
  while (fields >> field) f.push_back(field);
  if (f.size() < 22) return s;
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  const auto num = [&](std::size_t stat_field) { return std::stoull(f[stat_field - 3]); };
  s.cpu_seconds = static_cast<double>(num(14) + num(15)) / ticks;
  s.start_time_seconds = static_cast<double>(boot_time()) + static_cast<double>(num(22)) / ticks;
  s.virtual_bytes = num(23);
  s.resident_bytes = num(24) * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
  s.ok = true;
  return s;
}

// Open descriptors: the entries of /proc/self/fd, less the one reading it.
std::uint64_t open_fds() {
  DIR* dir = ::opendir("/proc/self/fd");
  if (dir == nullptr) return 0;
  std::uint64_t n = 0;
  while (const dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(dir);
  return n > 0 ? n - 1 : 0;
}

}  // namespace

void report::append_process_metrics(const CollectorView& view, std::string& out) {
  (void)view;
  MetricFamily(out, "steptrace_build_info", "gauge",
               "Always 1: the daemon's version and wire protocol version as labels.")
      .sample({{"version", STEPTRACE_VERSION_STRING},
               {"protocol_version", std::to_string(proto::kProtocolVersion)}},
              std::uint64_t{1});
  const SelfStat stat = read_self_stat();
  if (stat.ok) {
    MetricFamily(out, "process_cpu_seconds_total", "counter",
                 "User and system CPU time the daemon spent, in seconds.")
        .sample({}, stat.cpu_seconds);
    MetricFamily(out, "process_start_time_seconds", "gauge",
                 "Start time of the daemon since the Unix epoch, in seconds.")
        .sample({}, stat.start_time_seconds);
    MetricFamily(out, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.")
        .sample({}, stat.virtual_bytes);
    MetricFamily(out, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.")
        .sample({}, stat.resident_bytes);
  }
  MetricFamily(out, "process_open_fds", "gauge", "Open file descriptors of the daemon.")
      .sample({}, open_fds());
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    MetricFamily(out, "process_max_fds", "gauge", "The daemon's limit of open file descriptors.")
        .sample({}, static_cast<std::uint64_t>(limit.rlim_cur));
  }
}

}  // namespace steptrace::daemon
