// A stand-in /proc in a temporary directory, for `trace --children`'s walk
// (daemon/serve/trace_selection.h): PROC/PID/stat and PROC/PID/task/TID/children as the
// kernel writes them, only the fields the walk reads.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

namespace steptrace::daemon::test {

namespace fs = std::filesystem;

class FakeProc {
 public:
  FakeProc() {
    std::string pattern = (fs::temp_directory_path() / "steptrace-proc-XXXXXX").string();
    root_ = ::mkdtemp(pattern.data());
  }
  ~FakeProc() {
    std::error_code ec;
    fs::remove_all(root_, ec);
  }
  FakeProc(const FakeProc&) = delete;
  FakeProc& operator=(const FakeProc&) = delete;
  // PROC/PID/stat with the parent (field 4), the state (field 3) and the start time
  // (field 22); PID's main thread with an empty children file; and PID in the children
  // file of its parent's thread `parent_tid` (the parent's main thread when 0).
  void add(int pid, int parent, std::uint64_t start, const std::string& comm = "w",
           char state = 'S', int parent_tid = 0) {
    stat(pid, parent, start, comm, state);
    append(pid, pid, "");
    append(parent, parent_tid == 0 ? parent : parent_tid, std::to_string(pid) + " ");
  }
  // PROC/PID/stat alone: a process no children file lists.
  void stat(int pid, int parent, std::uint64_t start, const std::string& comm = "w",
            char state = 'S') {
    fs::create_directories(root_ / std::to_string(pid));
    std::ofstream out(root_ / std::to_string(pid) / "stat");
    out << pid << " (" << comm << ") " << state << " " << parent;
    for (int field = 5; field < 22; ++field) out << " 0";
    out << " " << start << " 0 0\n";
  }
  // `text` appended to PROC/PID/task/TID/children (made as needed).
  void append(int pid, int tid, const std::string& text) {
    const fs::path task = root_ / std::to_string(pid) / "task" / std::to_string(tid);
    fs::create_directories(task);
    std::ofstream(task / "children", std::ios::app) << text;
  }
  fs::path task(int pid, int tid) const {
    return root_ / std::to_string(pid) / "task" / std::to_string(tid);
  }
  std::string path() const { return root_.string(); }

 private:
  fs::path root_;
};

}  // namespace steptrace::daemon::test
