#include "daemon/serve/trace_selection.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <sstream>

#include "daemon/state/proc_probe.h"
#include "proto/printable.h"

namespace steptrace::daemon {

bool TraceSelection::selects(const TraceCapture::Process& p) const {
  if (everything()) return true;
  if (pids.contains(p.key.pid) || keys.contains(p.key)) return true;
  return job && p.uid == job->uid && p.job == job->job;
}

namespace {

constexpr std::size_t kMaxStatBytes = 4096;

// Up to `max` bytes of `file` into `out`: the errno of a failed open or read, else 0.
int read_file(const std::string& file, std::size_t max, std::string& out) {
  out.clear();
  const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno;
  std::array<char, 4096> buf{};
  int error = 0;
  while (out.size() < max) {
    const ssize_t n = ::read(fd, buf.data(), std::min(buf.size(), max - out.size()));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) error = errno;
    if (n <= 0) break;
    out.append(buf.data(), static_cast<std::size_t>(n));
  }
  ::close(fd);
  return error;
}

std::optional<std::int32_t> parse_pid(std::string_view text) {
  std::int32_t pid = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), pid);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || pid <= 0) {
    return std::nullopt;
  }
  return pid;
}

// A live (not zombie) process `pid` and its parent, from PROC/PID/stat ("PID (comm) S PPID
// ..."; comm may hold spaces and parentheses, so the fields start after the last ')').
struct LiveChild {
  ProcessKey key;
  std::int32_t parent = 0;
};
std::optional<LiveChild> live_child(std::int32_t pid, const std::string& proc_root) {
  std::string stat;
  if (read_file(proc_root + "/" + std::to_string(pid) + "/stat", kMaxStatBytes, stat) != 0) {
    return std::nullopt;
  }
  const auto probe = parse_proc_stat(stat);
  if (!probe || probe->zombie) return std::nullopt;
  std::istringstream fields(stat.substr(stat.rfind(')') + 1));
  std::string state;
  LiveChild out{{pid, probe->start_time}, 0};
  if (!(fields >> state >> out.parent)) return std::nullopt;
  return out;
}

constexpr std::string_view kChoose = "; choose the processes with --pid or --job instead\n";

// The pids the threads of process `pid` forked (PROC/PID/task/*/children), appended to
// `out`; each thread read counts against `tasks_left`. Or the refusal.
std::optional<TraceRefusal> children_of(std::int32_t pid, const std::string& proc_root,
                                        const DescendantBounds& bounds, std::size_t& tasks_left,
                                        std::vector<std::int32_t>& out) {
  // Each pid and its separator take at most 8 bytes (pid_max is at most 4194304): a file
  // cut at this size still holds more children than the walk may take.
  const std::size_t max_bytes = (bounds.processes + 2) * 8;
  std::error_code ec;
  std::string text;
  const auto tasks = std::filesystem::path(proc_root) / std::to_string(pid) / "task";
  for (std::filesystem::directory_iterator it(tasks, ec), end; !ec && it != end; it.increment(ec)) {
    if (!parse_pid(it->path().filename().string())) continue;
    if (tasks_left == 0) {
      return TraceRefusal{"error: trace: --children reads at most " + std::to_string(bounds.tasks) +
                              " threads' children files, and the --pid processes and their "
                              "descendants have more threads" +
                              std::string(kChoose),
                          LimitKind::kTraceChildrenThreads};
    }
    --tasks_left;
    const std::string file = (it->path() / "children").string();
    if (const int error = read_file(file, max_bytes, text); error != 0) {
      std::error_code gone;
      if (!std::filesystem::is_directory(it->path(), gone)) continue;  // the thread ended
      if (error != ENOENT) {
        return TraceRefusal{
            "error: trace: --children cannot read " + file + ": " + std::strerror(error) + "\n",
            std::nullopt};
      }
      return TraceRefusal{std::string("error: trace: --children needs /proc/PID/task/TID/children, "
                                      "which this kernel does not have (Linux 3.5 on, "
                                      "CONFIG_PROC_CHILDREN)") +
                              std::string(kChoose),
                          std::nullopt};
    }
    if (text.size() == max_bytes) text.resize(text.find_last_of(" \n") + 1);  // no cut pid
    std::istringstream words(text);
    for (std::string word; words >> word;) {
      if (const auto child = parse_pid(word)) out.push_back(*child);
    }
  }
  return std::nullopt;
}

}  // namespace

std::optional<ProcessKey> live_process(std::int32_t pid, const std::string& proc_root) {
  const auto child = live_child(pid, proc_root);
  if (!child) return std::nullopt;
  return child->key;
}

std::variant<std::vector<ProcessKey>, TraceRefusal> live_descendants(
    const std::vector<std::int32_t>& roots, const std::string& proc_root, DescendantBounds bounds) {
  std::vector<ProcessKey> out;
  std::vector<std::int32_t> todo(roots.begin(), roots.end());
  std::set<std::int32_t> seen(roots.begin(), roots.end());
  std::size_t tasks_left = bounds.tasks;
  std::size_t read = 0;  // descendants' stat files
  std::vector<std::int32_t> children;
  while (!todo.empty()) {
    const std::int32_t parent = todo.back();
    todo.pop_back();
    children.clear();
    if (auto error = children_of(parent, proc_root, bounds, tasks_left, children)) {
      return std::move(*error);
    }
    for (const std::int32_t child : children) {
      if (!seen.insert(child).second) continue;  // a root, or a cycle of a stand-in /proc
      if (++read > bounds.processes) {
        return TraceRefusal{
            "error: trace: --children takes at most " + std::to_string(bounds.processes) +
                " descendants of the --pid processes, and they have more" + std::string(kChoose),
            LimitKind::kTraceChildrenDescendants};
      }
      const auto found = live_child(child, proc_root);
      // Another parent: the child ended and its pid was reused since the list was read.
      if (!found || found->parent != parent) continue;
      out.push_back(found->key);
      todo.push_back(child);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::variant<std::uint32_t, std::string> trace_job_uid(const TraceCapture& capture,
                                                       std::string_view id,
                                                       std::optional<std::uint32_t> uid,
                                                       std::uint32_t caller, bool privileged) {
  std::set<std::uint32_t> runners;
  for (const TraceCapture::Process& p : capture.processes) {
    if (p.job == id) runners.insert(p.uid);
  }
  const std::uint32_t asked = uid.value_or(caller);
  if (runners.contains(asked)) return asked;
  const std::string shown = proto::printable(id);
  if (!uid && privileged && runners.size() == 1) return *runners.begin();
  std::string uids;
  for (const std::uint32_t u : runners) {
    if (!uids.empty()) uids += *runners.rbegin() == u ? " and " : ", ";
    uids += std::to_string(u);
  }
  if (!uid && privileged && runners.size() > 1) {
    return "error: trace: job '" + shown + "' is run by uids " + uids +
           ": name one with --job UID:" + shown + "\n";
  }
  std::string hint;
  if (!runners.empty()) {
    hint = runners.size() == 1 ? "; uid " + uids + " has one: use --job " + uids + ":" + shown
                               : "; uids " + uids + " have one: use --job UID:" + shown;
  }
  return "error: trace: no process of job '" + shown + "' for uid " + std::to_string(asked) +
         " in the flight recorder's window" + hint + "\n";
}

std::shared_ptr<const TraceCapture> select_processes(const TraceCapture& capture,
                                                     const TraceSelection& selection) {
  auto out = std::make_shared<TraceCapture>();
  out->now_ns = capture.now_ns;
  out->since_ns = capture.since_ns;
  out->wall_offset_ns = capture.wall_offset_ns;
  out->daemon_pid = capture.daemon_pid;
  out->host = capture.host;
  out->counters = capture.counters;
  std::set<ProcessKey> kept;
  for (const TraceCapture::Process& p : capture.processes) {
    if (!selection.selects(p)) continue;
    kept.insert(p.key);
    out->processes.push_back(p);  // the chunks are shared, not copied
  }
  for (const TraceMark& m : capture.marks) {
    if (kept.contains(m.sender)) out->marks.push_back(m);
  }
  return out;
}

}  // namespace steptrace::daemon
