// Which processes a `trace` takes (daemon/serve/trace_selection.h): --children by
// ProcessKey from a stand-in /proc, --job by (uid, job), and the marks that go along.
#include "daemon/serve/trace_selection.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "tests/daemon/serve/fake_proc.h"

namespace steptrace::daemon {
namespace {

namespace fs = std::filesystem;
using test::FakeProc;

using Descendants = std::variant<std::vector<ProcessKey>, TraceRefusal>;

std::vector<ProcessKey> keys_of(const Descendants& found) {
  if (const auto* refusal = std::get_if<TraceRefusal>(&found)) {
    ADD_FAILURE() << refusal->reply;
    return {};
  }
  return std::get<std::vector<ProcessKey>>(found);
}

TraceRefusal refusal_of(const Descendants& found) {
  const auto* refusal = std::get_if<TraceRefusal>(&found);
  EXPECT_NE(refusal, nullptr) << "no error";
  return refusal != nullptr ? *refusal : TraceRefusal{};
}

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
  EXPECT_EQ(keys_of(live_descendants({100}, proc.path())),
            (std::vector<ProcessKey>{{101, 11}, {102, 12}, {103, 13}}));
  EXPECT_TRUE(keys_of(live_descendants({103}, proc.path())).empty());
  EXPECT_TRUE(keys_of(live_descendants({100}, proc.path() + "/absent")).empty());
  EXPECT_EQ(keys_of(live_descendants({100, 200}, proc.path())),
            (std::vector<ProcessKey>{{101, 11}, {102, 12}, {103, 13}, {201, 21}}));
  EXPECT_EQ(live_process(100, proc.path()), (ProcessKey{100, 10}));
  EXPECT_FALSE(live_process(104, proc.path()));  // a zombie
  EXPECT_FALSE(live_process(999, proc.path()));
}

// Issue 26: the walk reads each thread's children file from the --pid down, never every
// process of /proc: a process that names the root as its parent but that no children
// file lists is not found (a walk of all of /proc would take it).
TEST(TraceSelection, DescendantsComeFromEachThreadsChildrenFile) {
  FakeProc proc;
  proc.add(100, 1, 10);
  proc.add(101, 100, 11);
  proc.add(102, 100, 12, "w", 'S', /*parent_tid=*/150);  // forked by a thread of 100
  proc.add(103, 102, 13, "w", 'S', /*parent_tid=*/160);  // by a thread of 102
  proc.stat(500, 100, 50);                               // in no children file
  EXPECT_EQ(keys_of(live_descendants({100}, proc.path())),
            (std::vector<ProcessKey>{{101, 11}, {102, 12}, {103, 13}}));
}

// What a stand-in (or a racing) /proc may hold: a cycle, garbage, a listed pid that has
// ended, one reused by a process of another parent. The walk ends, skips them, and
// finds the rest.
TEST(TraceSelection, DescendantWalkSurvivesCyclesGarbageAndEndedProcesses) {
  FakeProc proc;
  proc.add(100, 1, 10);
  proc.add(101, 100, 11);
  proc.add(102, 101, 12);
  proc.append(101, 101, "100 101 ");                      // the root and itself: a cycle
  proc.append(102, 102, "101\n");                         // its parent
  proc.append(100, 100, "abc -5 0 12x 99999999999 +7 ");  // garbage
  proc.append(100, 100, "300 ");                          // listed, ended (no PROC/300)
  proc.append(100, 100, "301 ");                          // listed, its pid reused since:
  proc.stat(301, 7, 31);                                  // another parent's process
  proc.append(301, 301, "302 ");
  proc.add(302, 301, 32);
  EXPECT_EQ(keys_of(live_descendants({100}, proc.path())),
            (std::vector<ProcessKey>{{101, 11}, {102, 12}}));
}

// A thread without a children file: the kernel lacks them (CONFIG_PROC_CHILDREN off), and
// no bounded walk can find the descendants; the trace is refused saying so.
TEST(TraceSelection, AKernelWithoutChildrenFilesIsAnError) {
  FakeProc proc;
  proc.add(100, 1, 10);
  proc.add(101, 100, 11);
  fs::remove(proc.task(101, 101) / "children");
  const TraceRefusal refusal = refusal_of(live_descendants({100}, proc.path()));
  EXPECT_EQ(refusal.reply,
            "error: trace: --children needs /proc/PID/task/TID/children, which this kernel does "
            "not have (Linux 3.5 on, CONFIG_PROC_CHILDREN); choose the processes with --pid or "
            "--job instead\n");
  EXPECT_EQ(refusal.limit, std::nullopt);  // no bound: not a limit hit
}

// At most `processes` descendants' stat files and `tasks` threads' children files, all
// roots together; past either the walk stops with an error naming the bound, and the
// LimitKind it is counted under.
TEST(TraceSelection, DescendantWalkIsBounded) {
  FakeProc proc;
  proc.add(100, 1, 10);
  for (int i = 0; i < 6; ++i) proc.add(200 + i, 100, 20);
  proc.add(300, 1, 30);
  proc.add(301, 300, 31);
  EXPECT_EQ(keys_of(live_descendants({100, 300}, proc.path(), {.processes = 7})).size(), 7u);
  const TraceRefusal processes =
      refusal_of(live_descendants({100, 300}, proc.path(), {.processes = 6}));
  EXPECT_EQ(processes.reply,
            "error: trace: --children takes at most 6 descendants of the --pid processes, and "
            "they have more; choose the processes with --pid or --job instead\n");
  EXPECT_EQ(processes.limit, LimitKind::kTraceChildrenDescendants);
  // Threads: 100, 300, 301 and each of 100's children have one: 9 in all.
  EXPECT_EQ(keys_of(live_descendants({100, 300}, proc.path(), {.tasks = 9})).size(), 7u);
  for (int tid = 150; tid < 160; ++tid) proc.append(100, tid, "");  // 17 threads now
  EXPECT_EQ(keys_of(live_descendants({100}, proc.path(), {.tasks = 17})).size(), 6u);
  const TraceRefusal threads = refusal_of(live_descendants({100}, proc.path(), {.tasks = 16}));
  EXPECT_EQ(threads.reply,
            "error: trace: --children reads at most 16 threads' children files, and the --pid "
            "processes and their descendants have more threads; choose the processes with "
            "--pid or --job instead\n");
  EXPECT_EQ(threads.limit, LimitKind::kTraceChildrenThreads);
}

// The real kernel's files: a forked child and the child it forked, with their start times.
TEST(TraceSelection, RealProcFindsAChildAndItsChild) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const pid_t grandchild = ::fork();
    if (grandchild == 0) {
      ::pause();
      ::_exit(0);
    }
    if (::write(fds[1], &grandchild, sizeof grandchild) != sizeof grandchild) ::_exit(1);
    ::pause();
    ::_exit(0);
  }
  pid_t grandchild = 0;
  const bool told = ::read(fds[0], &grandchild, sizeof grandchild) == sizeof grandchild;
  const auto found = live_descendants({::getpid()});
  const auto child_key = live_process(child);
  const auto grandchild_key = told ? live_process(grandchild) : std::nullopt;
  if (told) ::kill(grandchild, SIGKILL);
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
  ::close(fds[0]);
  ::close(fds[1]);
  ASSERT_TRUE(told && child_key && grandchild_key);
  std::vector<ProcessKey> expected{*child_key, *grandchild_key};
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(keys_of(found), expected);
  EXPECT_NE(child_key->start_time, 0u);
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
  for (const ProcessKey& key : keys_of(live_descendants({100}, proc.path()))) {
    selection.keys.insert(key);
  }
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
