// Which processes a `trace` takes (daemon/serve/trace_selection.h): --children by
// ProcessKey from a stand-in /proc, --job by (uid, job), and the marks that go along.
#include "daemon/serve/trace_selection.h"

#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <fstream>
#include <string>

namespace steptrace::daemon {
namespace {

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
  // (field 22).
  void add(int pid, int parent, std::uint64_t start, const std::string& comm = "w",
           char state = 'S') {
    fs::create_directories(root_ / std::to_string(pid));
    std::ofstream out(root_ / std::to_string(pid) / "stat");
    out << pid << " (" << comm << ") " << state << " " << parent;
    for (int field = 5; field < 22; ++field) out << " 0";
    out << " " << start << " 0 0\n";
  }
  std::string path() const { return root_.string(); }

 private:
  fs::path root_;
};

TraceCapture::Process process(std::int32_t pid, std::uint64_t start, std::uint32_t uid = 0,
                              std::string job = "") {
  TraceCapture::Process p;
  p.key = {pid, start};
  p.uid = uid;
  p.job = std::move(job);
  return p;
}

TEST(TraceSelection, LiveDescendantsFollowTheParentChainWithStartTimes) {
  FakeProc proc;
  proc.add(100, 1, 10);
  proc.add(101, 100, 11);
  proc.add(102, 100, 12, "a) S 1 (odd");  // a comm with ") S " in it
  proc.add(103, 101, 13);
  proc.add(104, 100, 14, "zombie", 'Z');  // has ended: not taken
  proc.add(200, 1, 20);
  proc.add(201, 200, 21);
  fs::create_directories(proc.path() + "/self");
  EXPECT_EQ(live_descendants(100, proc.path()),
            (std::vector<ProcessKey>{{101, 11}, {102, 12}, {103, 13}}));
  EXPECT_TRUE(live_descendants(103, proc.path()).empty());
  EXPECT_TRUE(live_descendants(100, proc.path() + "/absent").empty());
  EXPECT_EQ(live_process(100, proc.path()), (ProcessKey{100, 10}));
  EXPECT_FALSE(live_process(104, proc.path()));  // a zombie
  EXPECT_FALSE(live_process(999, proc.path()));
}

// The bug of issue 27's closing note: `trace --pid P --children --last 2` took in a
// process of an earlier trainer. The CLI sent each descendant's pid, and --pid takes every
// window of a pid: the exited process that had a worker's pid before (a reused pid) came
// along. By ProcessKey only the live worker does.
TEST(TraceSelection, ChildrenTakeNoEarlierProcessOfAReusedPid) {
  FakeProc proc;
  proc.add(100, 1, 500);     // the launcher
  proc.add(4242, 100, 510);  // its worker, on a pid an earlier process had
  TraceCapture capture;
  capture.processes = {process(4242, 7), process(4242, 510), process(999, 8)};
  TraceMark old_mark;
  old_mark.sender = {4242, 7};
  TraceMark new_mark;
  new_mark.sender = {4242, 510};
  capture.marks = {old_mark, new_mark};

  TraceSelection selection;
  for (const ProcessKey& key : live_descendants(100, proc.path())) selection.keys.insert(key);
  const auto selected = select_processes(capture, selection);
  ASSERT_EQ(selected->processes.size(), 1u);
  EXPECT_EQ(selected->processes[0].key, (ProcessKey{4242, 510}));
  ASSERT_EQ(selected->marks.size(), 1u);
  EXPECT_EQ(selected->marks[0].sender, (ProcessKey{4242, 510}));

  // --pid alone keeps its meaning: every window of the pid.
  TraceSelection by_pid;
  by_pid.pids = {4242};
  EXPECT_EQ(select_processes(capture, by_pid)->processes.size(), 2u);
}

// --job takes every process of (uid, job), however many, exited ones with windows too.
TEST(TraceSelection, JobTakesEveryProcessOfItsUidAndNoOther) {
  TraceCapture capture;
  for (int i = 0; i < 300; ++i) capture.processes.push_back(process(1000 + i, 1, 1001, "j"));
  capture.processes.push_back(process(5000, 1, 1002, "j"));  // another uid's job j
  capture.processes.push_back(process(5001, 1, 1001, "k"));
  capture.processes[7].alive = false;
  TraceSelection selection;
  selection.job = JobRef{1001, "j"};
  const auto selected = select_processes(capture, selection);
  ASSERT_EQ(selected->processes.size(), 300u);  // no 64-pid bound
  for (const auto& p : selected->processes) {
    EXPECT_EQ(p.uid, 1001u);
    EXPECT_EQ(p.job, "j");
  }
}

TEST(TraceSelection, JobUidFollowsTheReportsRules) {
  TraceCapture capture;
  capture.processes = {process(1, 1, 1001, "j"), process(2, 1, 1002, "j"),
                       process(3, 1, 1003, "k")};
  EXPECT_EQ(std::get<std::uint32_t>(trace_job_uid(capture, "j", std::nullopt, 1001, false)), 1001u);
  EXPECT_EQ(std::get<std::uint32_t>(trace_job_uid(capture, "j", 1002, 1001, false)), 1002u);
  // Root reaches the one other uid's job by its bare id; with two, it must name one.
  EXPECT_EQ(std::get<std::uint32_t>(trace_job_uid(capture, "k", std::nullopt, 0, true)), 1003u);
  EXPECT_EQ(std::get<std::string>(trace_job_uid(capture, "j", std::nullopt, 0, true)),
            "error: trace: job 'j' is run by uids 1001 and 1002: name one with --job UID:j\n");
  // Anyone else: their own job only, with a hint.
  EXPECT_EQ(std::get<std::string>(trace_job_uid(capture, "k", std::nullopt, 1001, false)),
            "error: trace: no process of job 'k' for uid 1001 in the flight recorder's window; "
            "uid 1003 has one: use --job 1003:k\n");
  EXPECT_EQ(std::get<std::string>(trace_job_uid(capture, "none", 7, 1001, false)),
            "error: trace: no process of job 'none' for uid 7 in the flight recorder's window\n");
}

}  // namespace
}  // namespace steptrace::daemon
