#include "daemon/serve/trace_selection.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <map>
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

std::string read_stat(const std::filesystem::path& file) {
  std::ifstream in(file);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace

std::optional<ProcessKey> live_process(std::int32_t pid, const std::string& proc_root) {
  const auto probe =
      parse_proc_stat(read_stat(std::filesystem::path(proc_root) / std::to_string(pid) / "stat"));
  if (!probe || probe->zombie) return std::nullopt;
  return ProcessKey{pid, probe->start_time};
}

std::vector<ProcessKey> live_descendants(std::int32_t pid, const std::string& proc_root) {
  // Every live process's parent and start time, read together from PROC/N/stat
  // ("N (comm) S PPID ..."; comm may hold spaces and parentheses, so the fields start
  // after the last ')'). A process that ends during the walk is left out.
  struct Entry {
    std::int32_t pid = 0;
    std::uint64_t start_time = 0;
  };
  std::map<std::int32_t, std::vector<Entry>> children;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(proc_root, ec), end; !ec && it != end;
       it.increment(ec)) {
    const std::string name = it->path().filename();
    std::int32_t child = 0;
    const auto [ptr, parse_ec] = std::from_chars(name.data(), name.data() + name.size(), child);
    if (name.empty() || parse_ec != std::errc() || ptr != name.data() + name.size()) continue;
    const std::string stat = read_stat(it->path() / "stat");
    const auto probe = parse_proc_stat(stat);
    if (!probe || probe->zombie) continue;
    std::istringstream fields(stat.substr(stat.rfind(')') + 1));
    std::string state;
    std::int32_t parent = 0;
    if (fields >> state >> parent) children[parent].push_back({child, probe->start_time});
  }
  std::vector<ProcessKey> out;
  std::vector<std::int32_t> todo{pid};
  std::set<std::int32_t> seen{pid};
  while (!todo.empty()) {
    const std::int32_t next = todo.back();
    todo.pop_back();
    for (const Entry& child : children[next]) {
      if (!seen.insert(child.pid).second) continue;
      out.push_back({child.pid, child.start_time});
      todo.push_back(child.pid);
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
