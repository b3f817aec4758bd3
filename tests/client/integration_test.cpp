// libsteptrace against the real steptraced, with real trainer processes
// (steptrace_test_trainer, the C program, fork/exec). Counts are read back with
// `report --json --pid N`. Every scenario runs with the library's default clock choice
// and with each clock forced (STEPTRACE_CLOCK=monotonic, STEPTRACE_CLOCK=tsc: the TSC
// when cpuid says it is invariant, whatever the kernel's clocksource).
#include <signal.h>
#include <sys/stat.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/sanitizer.h"

namespace steptrace::testing {
namespace {

using Values = std::map<std::string, long long>;

std::optional<Values> read_values(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  Values v;
  std::string key;
  long long value;
  while (in >> key >> value) v[key] = value;
  return v;
}

Values wait_values(const std::string& path, int timeout_ms = 30000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto v = read_values(path)) return *v;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ADD_FAILURE() << "no " << path;
  return {};
}

nlohmann::json process_report(const std::string& socket, long long pid) {
  const auto reply = command(socket, "report --json --pid " + std::to_string(pid));
  EXPECT_TRUE(reply.has_value());
  if (!reply) return {};
  const auto doc = nlohmann::json::parse(*reply, nullptr, false);
  EXPECT_FALSE(doc.is_discarded()) << *reply;
  if (doc.is_discarded()) return {};
  for (const auto& p : doc.at("processes")) {
    if (p.at("pid").get<long long>() == pid) return p;
  }
  ADD_FAILURE() << "pid " << pid << " not in report: " << *reply;
  return {};
}

long long step_count(const nlohmann::json& process, const std::string& step,
                     const char* field = "count") {
  if (!process.is_object()) return -1;
  for (const auto& s : process.at("steps")) {
    if (s.at("step") == step) return s.at(field).get<long long>();
  }
  return 0;
}

long long dropped_of(const nlohmann::json& process) {
  return process.is_object() ? process.at("dropped").get<long long>() : -1;
}

// Span events the daemon has applied, from all its clients.
long long events_received(const std::string& socket) {
  const auto reply = command(socket, "report --json");
  EXPECT_TRUE(reply.has_value());
  if (!reply) return -1;
  const auto doc = nlohmann::json::parse(*reply, nullptr, false);
  EXPECT_FALSE(doc.is_discarded()) << *reply;
  if (doc.is_discarded()) return -1;
  return doc.at("daemon").at("events_received").get<long long>();
}

// The documented memory bound (client/src/ring_budget.h, steptrace.h): one ring of
// 262,144 16-byte records (4 MiB) per recording thread by default.
constexpr long long kRingRecords = 262'144;
constexpr long long kRingKib = kRingRecords * 16 / 1024;

// A trainer's drop counts add up: `key` is the sum of key_<cause> over the four causes.
void expect_causes_add_up(const Values& v, const std::string& key = "dropped") {
  long long sum = 0;
  for (const char* cause : {"buffer_full", "not_connected", "in_flight", "invalid"}) {
    sum += v.at(key + "_" + cause);
  }
  EXPECT_EQ(sum, v.at(key)) << key;
}

// What the trainer's "fork" mode with 1000 spans wrote to `file` and sent to the daemon on
// `socket`: the parent's 1100 Forward spans under its pid, the child's 1000 Backward spans
// under its own, nothing of the parent's sent twice, nothing dropped.
void expect_fork_reported(const std::string& socket, const std::string& file) {
  const Values v = wait_values(file);
  const auto parent = process_report(socket, v.at("pid"));
  const auto child = process_report(socket, v.at("child"));
  EXPECT_EQ(step_count(parent, "Forward"), 1100);
  EXPECT_EQ(step_count(parent, "Backward"), 0);
  EXPECT_EQ(step_count(child, "Backward"), 1000);
  EXPECT_EQ(step_count(child, "Forward"), 0);
  EXPECT_EQ(dropped_of(parent), 0);
  EXPECT_EQ(dropped_of(child), 0);
}

// A real steptraced on d.sock in the test's own directory, started before each test.
// Base: ::testing::Test or ::testing::TestWithParam.
template <class Base>
class WithDaemon : public Base {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(socket());
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  std::string socket() const { return dir_.file("d.sock"); }
  std::string out(const std::string& name) const { return dir_.file(name); }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

class ClientIntegration : public WithDaemon<::testing::TestWithParam<std::string>> {
 protected:
  std::vector<std::string> env() const {
    if (GetParam() == "default") return {};
    return {"STEPTRACE_CLOCK=" + GetParam()};
  }
  std::vector<std::string> env_with(const std::string& extra) const {
    auto e = env();
    e.push_back(extra);
    return e;
  }
  pid_t trainer(std::vector<std::string> args) const {
    args.insert(args.begin(), STEPTRACE_TEST_TRAINER);
    return spawn_process(args, env());
  }
  int run_trainer(std::vector<std::string> args) const {
    args.insert(args.begin(), STEPTRACE_TEST_TRAINER);
    return run_process(args, env(), 60000);
  }
};

TEST_P(ClientIntegration, ProcessesTimesSpansArriveExactly) {
  constexpr int kProcesses = 4;
  constexpr int kSpans = 3000;
  std::vector<pid_t> pids;
  for (int p = 0; p < kProcesses; ++p) {
    pids.push_back(
        trainer({"basic", socket(), out("p" + std::to_string(p)), std::to_string(kSpans)}));
  }
  for (pid_t pid : pids) EXPECT_EQ(wait_process(pid, 60000), 0);
  for (int p = 0; p < kProcesses; ++p) {
    const Values v = wait_values(out("p" + std::to_string(p)));
    EXPECT_EQ(v.at("dropped"), 0);
    expect_causes_add_up(v);
    const auto proc = process_report(socket(), v.at("pid"));
    EXPECT_EQ(step_count(proc, "Forward"), kSpans);
    EXPECT_EQ(step_count(proc, "Tokenize"), kSpans);
    EXPECT_EQ(step_count(proc, "Forward", "open"), 0);
    EXPECT_EQ(dropped_of(proc), 0);
  }
}

TEST_P(ClientIntegration, EightThreadsInOneProcessArriveExactly) {
  ASSERT_EQ(run_trainer({"threads", socket(), out("t"), "8", "2000"}), 0);
  const Values v = wait_values(out("t"));
  EXPECT_EQ(v.at("dropped"), 0);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Matmul"), 8 * 2000);
  EXPECT_EQ(step_count(proc, "Matmul", "open"), 0);
  EXPECT_EQ(dropped_of(proc), 0);
}

TEST_P(ClientIntegration, NestedSpansAreMatchedAsAStack) {
  ASSERT_EQ(run_trainer({"nested", socket(), out("n"), "1000"}), 0);
  const Values v = wait_values(out("n"));
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), 1000);
  EXPECT_EQ(step_count(proc, "Attention"), 1000);
  EXPECT_EQ(step_count(proc, "Matmul"), 2000);
  EXPECT_EQ(proc.at("unmatched_ends").get<long long>(), 0);
  // Nesting: a Forward span lasts at least as long as the Matmuls inside it.
  EXPECT_GE(step_count(proc, "Forward", "total_ns"), step_count(proc, "Matmul", "total_ns"));
}

// Forward inside Forward: one step's spans on one thread nest as a stack. Each round is
// Forward { 40 ms; Forward { 10 ms }; 40 ms }, so the inner span lasts >= 10 ms and the
// outer >= 90 ms. Matched first-in-first-out instead, both would last >= 50 ms; keyed by
// step alone (the reference's map), the inner start would overwrite the outer's and half
// the spans would be lost. Bounds are lower ones, except the minimum's: of 8 inner spans
// at least one must end within 40 ms of its 10 ms sleep.
TEST_P(ClientIntegration, SameStepNestedSpansAreMatchedAsAStack) {
  constexpr int kRounds = 8;
  constexpr long long kMs = 1'000'000;
  ASSERT_EQ(
      run_trainer({"nested_same", socket(), out("ns"), std::to_string(kRounds), "10", "40", "40"}),
      0);
  const Values v = wait_values(out("ns"));
  EXPECT_EQ(v.at("dropped"), 0);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), 2 * kRounds);
  EXPECT_EQ(step_count(proc, "Forward", "open"), 0);
  EXPECT_EQ(proc.at("unmatched_ends").get<long long>(), 0);
  EXPECT_GE(step_count(proc, "Forward", "min_ns"), 10 * kMs);  // every span holds a sleep
  EXPECT_LT(step_count(proc, "Forward", "min_ns"), 50 * kMs);  // inner spans stay inner
  EXPECT_GE(step_count(proc, "Forward", "max_ns"), 90 * kMs);  // outer spans hold it all
  EXPECT_GE(step_count(proc, "Forward", "total_ns"), kRounds * (10 + 90) * kMs);
}

TEST_P(ClientIntegration, ForkedChildReportsUnderItsOwnPidAndNothingIsSentTwice) {
  ASSERT_EQ(run_trainer({"fork", socket(), out("f"), "1000"}), 0);
  expect_fork_reported(socket(), out("f"));
}

TEST_P(ClientIntegration, DaemonAbsentAtStartThenStarted) {
  daemon_.reset();  // SIGKILL: no daemon, the socket path is stale or missing
  // Spans before the daemon is back: 300,000 events, more than a ring holds.
  constexpr long long kBefore = 150'000;
  const pid_t pid = trainer({"late", socket(), out("l"), std::to_string(kBefore), "1000"});
  const Values phase1 = wait_values(out("l.phase1"));
  EXPECT_NE(phase1.at("connect_rc"), 0);
  // Recording never waited for the absent daemon: what did not fit was counted, as
  // not_connected.
  EXPECT_EQ(phase1.at("dropped_phase1"), 2 * kBefore - kRingRecords);
  EXPECT_EQ(phase1.at("dropped_phase1_not_connected"), 2 * kBefore - kRingRecords);
  expect_causes_add_up(phase1, "dropped_phase1");
  std::cerr << "daemon absent: phase 1 took " << phase1.at("phase1_ms") << " ms; connect "
            << phase1.at("connect_unqueued_ns") << " ns, longest other call "
            << phase1.at("max_call_ns") << " ns (" << phase1.at("max_call_unqueued_ns")
            << " ns not waiting for a CPU), " << phase1.at("phase1_voluntary_switches")
            << " voluntary context switches\n";
  // No call waited for the daemon (its reconnect backoff, a connect timeout, a full
  // ring): waiting is sleeping or blocking, a voluntary context switch of the recording
  // thread, as in StoppedDaemonDefaultModeDropsAndNeverBlocks. Not a bound on call times:
  // on a shared machine preemption alone stalls a call for 100 ms now and then (the
  // figures above are printed, not judged). A few switches come from starting the
  // flusher thread and first-touch faults, not from any wait on the daemon.
  ASSERT_GE(phase1.at("phase1_voluntary_switches"), 0) << "/proc/thread-self/status unreadable";
  EXPECT_LT(phase1.at("phase1_voluntary_switches"), 20);
  daemon_ = std::make_unique<DaemonProcess>(socket());
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  ASSERT_EQ(wait_process(pid, 60000), 0);
  const Values v = wait_values(out("l"));
  const auto proc = process_report(socket(), v.at("pid"));
  const long long delivered = 2 * step_count(proc, "Forward");
  EXPECT_EQ(delivered + v.at("dropped"), v.at("recorded_events"));
  EXPECT_EQ(step_count(proc, "Forward"), kRingRecords / 2 + 1000);
  EXPECT_EQ(dropped_of(proc), v.at("dropped"));
  // The annotation recorded while the daemon was absent arrived too.
  const auto ledger = command(socket(), "ledger --json");
  ASSERT_TRUE(ledger);
  EXPECT_NE(ledger->find("GPU-late"), std::string::npos) << *ledger;
}

TEST_P(ClientIntegration, DaemonKilledAndRestartedIsSurvived) {
  const pid_t pid = trainer({"restart", socket(), out("r"), "300"});
  wait_values(out("r.phase1"));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  daemon_->stop(SIGKILL);
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  daemon_ = std::make_unique<DaemonProcess>(socket());
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  std::ofstream(out("r.go")) << "go\n";
  ASSERT_EQ(wait_process(pid, 60000), 0);  // the trainer never noticed
  const Values v = wait_values(out("r"));
  std::cerr << "restart: recorded " << v.at("recorded_events") << " dropped " << v.at("dropped")
            << "\n";
  const auto proc = process_report(socket(), v.at("pid"));
  // The new daemon's events: whole spans, and at most one end whose start the killed
  // daemon took (its last pass over the ring may have ended inside a span): an unmatched
  // end, counted as an event here, its start among what died with the killed daemon.
  const long long unmatched = proc.at("unmatched_ends").get<long long>();
  EXPECT_LE(unmatched, 1);
  const long long delivered = 2 * step_count(proc, "Transfer") + unmatched;
  EXPECT_GT(delivered, 0);  // reconnected and kept sending
  EXPECT_EQ(proc.at("events").get<long long>(), delivered);
  expect_causes_add_up(v);
  EXPECT_EQ(v.at("dropped_invalid"), 0);
  EXPECT_EQ(v.at("dropped_buffer_full"), 0);  // no daemon fell behind
  // What the killed daemon had taken died with it (it keeps no snapshots here): the new
  // one counts it as daemon_crash when the process says what it delivered (Delivered),
  // on top of the library's own drops. Nothing is missing and nothing counted twice.
  const long long crash = proc.at("dropped_by_cause").at("daemon_crash").get<long long>();
  std::cerr << "restart: delivered to the new daemon " << delivered << ", taken by the killed "
            << "one and lost with it " << crash << "\n";
  EXPECT_EQ(dropped_of(proc), v.at("dropped") + crash);
  EXPECT_EQ(delivered + dropped_of(proc), v.at("recorded_events"));
}

// What systemctl restart does, under load: SIGTERM, and a new daemon on the same socket
// and state directory. Nothing is lost or counted twice, and a span open across the
// restart ends after it (matched, not abandoned or unmatched).
TEST_P(ClientIntegration, DaemonStoppedAndRestartedLosesNothingAndKeepsOpenSpans) {
  const std::string state = out("state");
  daemon_ =
      std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--state-dir", state});
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  const pid_t pid = trainer({"restart", socket(), out("r"), "300", "1"});
  wait_values(out("r.phase1"));
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  daemon_ =
      std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--state-dir", state});
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  std::ofstream(out("r.go")) << "go\n";
  ASSERT_EQ(wait_process(pid, 60000), 0);
  const Values v = wait_values(out("r"));
  const auto proc = process_report(socket(), v.at("pid"));
  std::cerr << "graceful restart: recorded " << v.at("recorded_events") << ", counted "
            << proc.at("events") << ", dropped " << dropped_of(proc) << "\n";
  EXPECT_EQ(step_count(proc, "Forward"), 1);
  EXPECT_EQ(proc.at("abandoned"), 0);
  EXPECT_EQ(proc.at("unmatched_ends"), 0);
  EXPECT_EQ(proc.at("dropped_by_cause").at("daemon_crash"), 0);
  EXPECT_EQ(dropped_of(proc), 0);
  EXPECT_EQ(2 * (step_count(proc, "Transfer") + 1), v.at("recorded_events"));
  EXPECT_EQ(proc.at("events").get<long long>(), v.at("recorded_events"));
}

TEST_P(ClientIntegration, StoppedDaemonNeverBlocksAndMemoryStaysBounded) {
  daemon_->signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  // Blocking mode on: its bounded wait must still let the trainer finish.
  const int status = run_trainer({"stopped", socket(), out("s"), "300000", "1"});
  const auto took = std::chrono::steady_clock::now() - t0;
  daemon_->signal(SIGCONT);
  ASSERT_EQ(status, 0);
  EXPECT_LT(took, std::chrono::seconds(30));  // generous: only a hang fails this
  const Values v = wait_values(out("s"));
  std::cerr << "stopped: recorded " << v.at("recorded_events") << " dropped " << v.at("dropped")
            << " rss " << v.at("rss_before_kib") << " -> " << v.at("rss_after_kib") << " KiB in "
            << v.at("record_ms") << " ms\n";
  EXPECT_EQ(v.at("connect_rc"), 0);  // the kernel accepts into the backlog
  EXPECT_NE(v.at("flush_rc"), 0);
  EXPECT_GT(v.at("dropped"), 0);
  EXPECT_LE(v.at("dropped"), v.at("recorded_events"));
  EXPECT_LT(v.at("rss_after_kib") - v.at("rss_before_kib"), 32 * 1024);
}

// The default mode (no blocking) against a SIGSTOPped daemon: the connection waits in
// the listen backlog, the socket buffer, the flusher's batch and then every ring fill up,
// and from then on each steptrace_start/end returns at once and counts a drop. After
// SIGCONT the daemon gets every recorded event, either delivered or in the drop report.
TEST_P(ClientIntegration, StoppedDaemonDefaultModeDropsAndNeverBlocks) {
  constexpr int kThreads = 3;
  constexpr int kSpans = 1'000'000;  // per thread: 6 M events, far past every buffer
  daemon_->signal(SIGSTOP);
  const pid_t pid = trainer(
      {"nonblocking", socket(), out("nb"), std::to_string(kThreads), std::to_string(kSpans)});
  const Values rec = wait_values(out("nb.phase1"), 60000);  // (a) recording finished
  daemon_->signal(SIGCONT);
  const int status = wait_or_kill(pid, 60000);
  ASSERT_TRUE(rec.contains("max_call_ns")) << "the trainer never finished recording";
  std::cerr << "default mode, daemon stopped: recorded " << rec.at("recorded_events") << " dropped "
            << rec.at("dropped_phase1") << " in " << rec.at("record_ms") << " ms; longest call "
            << rec.at("max_call_ns") << " ns (" << rec.at("max_call_unqueued_ns")
            << " ns not waiting for a CPU), " << rec.at("calls_over_1ms")
            << " calls over 1 ms; rss " << rec.at("rss_before_kib") << " -> "
            << rec.at("rss_after_kib") << " KiB\n";
  EXPECT_EQ(rec.at("connect_rc"), 0);  // connected: the flusher really is stuck on the socket
  // (b) No call waited for the flusher. A call that waits sleeps (the opt-in mode's
  // bounded wait is a loop of 50 us sleeps, about 2,000 voluntary context switches) or
  // blocks on a lock: either is a voluntary context switch of the recording thread. Not a
  // time bound: a loaded or throttled machine stalls single calls for 100 ms without any
  // of them waiting (seen on this VM with the library of before the shared rings too), so
  // the call times above are printed, not judged.
  ASSERT_GE(rec.at("max_voluntary_switches"), 0) << "/proc/thread-self/status unreadable";
  EXPECT_LT(rec.at("max_voluntary_switches"), 20);
  // (c) What did not fit was counted, as buffer_full: connected, the daemon fell behind.
  EXPECT_GT(rec.at("dropped_phase1"), 0);
  EXPECT_LT(rec.at("dropped_phase1"), rec.at("recorded_events"));
  EXPECT_EQ(rec.at("dropped_phase1_buffer_full"), rec.at("dropped_phase1"));
  expect_causes_add_up(rec, "dropped_phase1");
  // (d) Memory: one ring per recording thread, plus slack for thread stacks and the
  // allocator's per-thread arenas (4 MiB; 16 MiB under ASan, whose allocator, shadow memory and
  // fake stacks add RSS that has nothing to do with the rings: tests/support/sanitizer.h).
  const long long slack_kib = kAddressSanitizer ? 16 * 1024 : 4 * 1024;
  EXPECT_LT(rec.at("rss_after_kib") - rec.at("rss_before_kib"), kThreads * kRingKib + slack_kib);
  // (e) After SIGCONT the flush went through (the trainer exits 0 only then) and the
  // daemon holds the trainer's final drop count; nothing was lost on the way: every
  // recorded event was either applied by the daemon or counted as dropped.
  ASSERT_EQ(status, 0);
  const Values v = wait_values(out("nb"));
  EXPECT_EQ(v.at("dropped"), rec.at("dropped_phase1"));
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(dropped_of(proc), v.at("dropped"));
  EXPECT_EQ(events_received(socket()) + v.at("dropped"), v.at("recorded_events"));
}

// Exit while the daemon is SIGSTOPped. main returns without a flush, with a thread still
// recording; the at-exit hook (Client::at_exit) then flushes for at most 500 ms and stops
// the flusher. The trainer is connected (the kernel queued the connection) and has more
// than the socket can take, so that flush is really attempted and can only time out.
TEST_P(ClientIntegration, StoppedDaemonExitIsBounded) {
  daemon_->signal(SIGSTOP);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = trainer({"exit", socket(), out("x"), "2", "200000", "1"});
  const int status = wait_or_kill(pid, 30000);
  const auto exited = std::chrono::steady_clock::now();
  daemon_->signal(SIGCONT);
  ASSERT_EQ(status, 0);
  const Values v = wait_values(out("x"));
  // steady_clock is CLOCK_MONOTONIC, the clock the trainer stamped main's return with.
  const std::chrono::nanoseconds exit_path(
      std::chrono::nanoseconds(exited.time_since_epoch()).count() - v.at("main_return_ns"));
  std::cerr << "exit with the daemon stopped: spawn to exit "
            << std::chrono::duration_cast<std::chrono::milliseconds>(exited - t0).count()
            << " ms, main's return to exit "
            << std::chrono::duration_cast<std::chrono::milliseconds>(exit_path).count()
            << " ms, dropped " << v.at("dropped") << "\n";
  EXPECT_EQ(v.at("connect_rc"), 0);
  EXPECT_GT(v.at("dropped"), 0);
  // The library's bound is 500 ms; the rest is headroom for a loaded machine.
  EXPECT_LT(exited - t0, std::chrono::seconds(3));
  EXPECT_LT(exit_path, std::chrono::seconds(3));
}

// STEPTRACE_DISABLE=1: the library records nothing and never connects. The daemon
// never hears of the process, and nothing counts as dropped (disabled is not lost).
TEST_P(ClientIntegration, DisableEnvRecordsNothingAndDropsNothing) {
  ASSERT_EQ(run_process({STEPTRACE_TEST_TRAINER, "burst", socket(), out("d"), "2", "100000"},
                        env_with("STEPTRACE_DISABLE=1"), 60000),
            0);
  const Values v = wait_values(out("d"));
  EXPECT_EQ(v.at("dropped"), 0);
  EXPECT_EQ(v.at("flush_rc"), -ENOTCONN);
  EXPECT_EQ(events_received(socket()), 0);
  const auto stats = command(socket(), "stats --json");
  ASSERT_TRUE(stats);
  const auto doc = nlohmann::json::parse(*stats, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << *stats;
  EXPECT_EQ(doc.at("processes").at("tracked").get<long long>(), 0) << *stats;
  const auto ledger = command(socket(), "ledger --json");
  ASSERT_TRUE(ledger);
  EXPECT_EQ(ledger->find("GPU-burst"), std::string::npos) << *ledger;
}

// STEPTRACE_BLOCK_WHEN_FULL=1 is steptrace_set_block_when_full(1) without the call: an
// unpaced burst, far faster than the flusher and the daemon drain, waits instead of
// dropping, and every span arrives. The same burst without the variable drops (the
// premise: this burst really fills the rings, here the smallest, 64 KiB).
TEST_P(ClientIntegration, BlockWhenFullEnvLosesNothingInABurst) {
  constexpr int kThreads = 2;
  constexpr int kSpans = 200'000;
  constexpr long long kBlockWaitNs = 100'000'000;  // the library's bound (client.cpp)
  const std::string small = "STEPTRACE_BUFFER_BYTES=64K";
  auto e = env_with(small);
  e.push_back("STEPTRACE_BLOCK_WHEN_FULL=1");
  ASSERT_EQ(run_process({STEPTRACE_TEST_TRAINER, "burst", socket(), out("b"),
                         std::to_string(kThreads), std::to_string(kSpans)},
                        e, 60000),
            0);
  const Values v = wait_values(out("b"));
  std::cerr << "burst of " << v.at("recorded_events")
            << " events with STEPTRACE_BLOCK_WHEN_FULL=1: dropped " << v.at("dropped")
            << ", longest call " << v.at("max_call_ns") << " ns\n";
  EXPECT_EQ(v.at("connect_rc"), 0);
  EXPECT_EQ(v.at("flush_rc"), 0);
  // Nothing dropped. The wait is bounded, though: a machine loaded enough to stall the
  // flusher or the daemon for the whole 100 ms makes the library drop (as documented),
  // and then some call must have waited that long; the default mode drops at once.
  const auto proc = process_report(socket(), v.at("pid"));
  if (v.at("dropped") == 0) {
    EXPECT_EQ(step_count(proc, "Forward"), kThreads * kSpans);
    EXPECT_EQ(step_count(proc, "Forward", "open"), 0);
  } else {
    EXPECT_GE(v.at("max_call_ns"), kBlockWaitNs) << "dropped without waiting";
  }
  EXPECT_EQ(dropped_of(proc), v.at("dropped"));
  EXPECT_EQ(events_received(socket()) + v.at("dropped"), v.at("recorded_events"));

  ASSERT_EQ(run_process({STEPTRACE_TEST_TRAINER, "burst", socket(), out("b0"),
                         std::to_string(kThreads), std::to_string(kSpans)},
                        env_with(small), 60000),
            0);
  const Values control = wait_values(out("b0"));
  std::cerr << "the same burst without it: dropped " << control.at("dropped") << ", longest call "
            << control.at("max_call_ns") << " ns\n";
  EXPECT_EQ(control.at("flush_rc"), 0);
  EXPECT_GT(control.at("dropped"), 0);
  EXPECT_EQ(control.at("dropped_buffer_full"), control.at("dropped"));
}

// The default mode with the default buffers loses nothing in bursts of 64k spans per
// thread (128k events, half a ring), unpaced, started every 50 ms (about 1.3 M spans/s
// per thread on average): each burst lands in the ring whole while the daemon, nudged
// at the high-water mark, drains it. The premise is a daemon that keeps up, made sure
// of rather than timed: each thread's ring is mapped by the daemon before the first
// burst (a warm-up span and a flush), and a burst starts only once the daemon took the
// one before (a flush after each). On a loaded machine the period alone did not hold
// it: the flusher thread that hands a new ring over, or the daemon, could be kept from
// running for longer than a period, and whole bursts were then dropped (counted as
// buffer_full, as they should be). Under ASan (a Debug build in CI) a burst alone takes
// over 100 ms, so the bursts come a second apart there.
TEST_P(ClientIntegration, DefaultModeLosesNothingInBurstsOfSixtyFourThousandSpans) {
  constexpr int kThreads = 2;
  constexpr int kBursts = 4;
  constexpr int kSpans = 65'536;
  constexpr int kPeriodMs = kAddressSanitizer ? 1000 : 50;
  ASSERT_EQ(
      run_trainer({"bursts", socket(), out("bb"), std::to_string(kThreads), std::to_string(kBursts),
                   std::to_string(kSpans), std::to_string(kPeriodMs)}),
      0);
  const Values v = wait_values(out("bb"));
  std::cerr << "bursts: " << v.at("recorded_events") << " events, longest burst "
            << v.at("longest_burst_ns") / 1000 << " us, dropped " << v.at("dropped") << "\n";
  EXPECT_EQ(v.at("connect_rc"), 0);
  EXPECT_EQ(v.at("flush_rc"), 0);
  EXPECT_EQ(v.at("dropped"), 0);
  expect_causes_add_up(v);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), kThreads * (kBursts * kSpans + 1));  // + warm-ups
  EXPECT_EQ(step_count(proc, "Forward", "open"), 0);
  EXPECT_EQ(dropped_of(proc), 0);
}

TEST_P(ClientIntegration, CProgramRoundTrip) {
  ASSERT_EQ(run_process({STEPTRACE_C_ABI_TEST, socket(), out("c")}, env(), 60000), 0);
  const Values v = wait_values(out("c"));
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), 100);
  EXPECT_EQ(step_count(proc, "CStep"), 50);
  EXPECT_EQ(step_count(proc, "LedgerReserve"), 1);
  EXPECT_EQ(dropped_of(proc), 0);
  const auto ledger = command(socket(), "ledger --json");
  ASSERT_TRUE(ledger);
  const auto doc = nlohmann::json::parse(*ledger, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << *ledger;
  bool found = false;
  long long attributed = 0;
  for (const auto& gpu : doc.at("gpus")) {
    if (gpu.at("gpu") != "GPU-c-abi") continue;
    for (const auto& r : gpu.at("reservations")) {
      if (r.at("id") == 7 && r.at("pid") == v.at("pid") && r.at("bytes") == 1 << 20) found = true;
    }
    // The LedgerReserve span around the annotation is credited to this GPU: the
    // annotation arrived between the span's start and end, and the VRAM sample recorded
    // after the end did not overtake it.
    for (const auto& p : gpu.at("processes")) {
      if (p.at("pid") != v.at("pid")) continue;
      for (const auto& st : p.at("steps")) {
        if (st.at("step") == "LedgerReserve") attributed = st.at("count").get<long long>();
      }
    }
  }
  EXPECT_TRUE(found) << *ledger;
  EXPECT_EQ(attributed, 1) << *ledger;
}

INSTANTIATE_TEST_SUITE_P(Clocks, ClientIntegration,
                         ::testing::Values("default", "monotonic", "tsc"));

// Auto-connect (issue 12): programs that never call steptrace_connect, pointed at the
// daemon by $STEPTRACE_SOCKET.
class AutoConnect : public WithDaemon<::testing::Test> {
 protected:
  int run_trainer(std::vector<std::string> args, std::vector<std::string> env = {}) const {
    args.insert(args.begin(), STEPTRACE_TEST_TRAINER);
    env.push_back("STEPTRACE_SOCKET=" + socket());
    env.push_back("STEPTRACE_QUIET=1");
    return run_process(args, env, 60000);
  }
  // Whether the daemon ever saw process `pid`.
  bool daemon_knows(long long pid) const {
    const auto reply = command(socket(), "report --json");
    EXPECT_TRUE(reply.has_value());
    if (!reply) return false;
    const auto doc = nlohmann::json::parse(*reply, nullptr, false);
    EXPECT_FALSE(doc.is_discarded()) << *reply;
    if (doc.is_discarded()) return false;
    for (const auto& p : doc.at("processes")) {
      if (p.at("pid").get<long long>() == pid) return true;
    }
    return false;
  }
};

TEST_F(AutoConnect, SpansOfAProgramThatNeverConnectsArriveExactly) {
  // "nowhere" is argv's socket, unused: the library finds the daemon by itself.
  ASSERT_EQ(run_trainer({"auto", "nowhere", out("a"), "3000"}), 0);
  const Values v = wait_values(out("a"));
  EXPECT_EQ(v.at("flush_rc"), 0);  // the flush waited for the background connection
  EXPECT_EQ(v.at("dropped"), 0);
  expect_causes_add_up(v);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), 3000);
  EXPECT_EQ(step_count(proc, "Tokenize"), 3000);
  EXPECT_EQ(step_count(proc, "Forward", "open"), 0);
  EXPECT_EQ(dropped_of(proc), 0);
}

// No flush at all: the at-exit flush of an auto-connected process delivers everything.
TEST_F(AutoConnect, AtExitFlushDeliversWithoutAnyFlushCall) {
  ASSERT_EQ(run_trainer({"auto", "nowhere", out("x"), "500", "0"}), 0);
  const Values v = wait_values(out("x"));
  EXPECT_EQ(v.at("dropped"), 0);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), 500);
  EXPECT_EQ(step_count(proc, "Tokenize"), 500);
  EXPECT_EQ(dropped_of(proc), 0);
}

TEST_F(AutoConnect, RecordingAloneStartsTheFlusherAndConnects) {
  ASSERT_EQ(run_trainer({"noconnect", "nowhere", out("n"), "200"}), 0);
  const Values v = wait_values(out("n"));
  EXPECT_EQ(v.at("threads"), 2);  // main + the flusher
  EXPECT_EQ(v.at("flush_rc"), 0);
  EXPECT_EQ(v.at("dropped"), 0);
  const auto proc = process_report(socket(), v.at("pid"));
  EXPECT_EQ(step_count(proc, "Forward"), v.at("spans"));
}

// The child of an auto-connected parent restarts its own flusher like after an
// explicit connect: its own pid, nothing of the parent's sent twice.
TEST_F(AutoConnect, ForkedChildOfAnAutoConnectedParent) {
  ASSERT_EQ(run_trainer({"fork", "auto", out("f"), "1000"}), 0);
  expect_fork_reported(socket(), out("f"));
}

// STEPTRACE_DISABLE=1 and STEPTRACE_AUTOCONNECT=0: no thread, no connection.
TEST_F(AutoConnect, DisableAndOptOutStartNothing) {
  for (const char* env : {"STEPTRACE_DISABLE=1", "STEPTRACE_AUTOCONNECT=0"}) {
    SCOPED_TRACE(env);
    const std::string file = out(env[10] == 'D' ? "d" : "o");
    ASSERT_EQ(run_trainer({"noconnect", "nowhere", file, "200"}, {env}), 0);
    const Values v = wait_values(file);
    EXPECT_GT(v.at("spans"), 0);
    EXPECT_EQ(v.at("threads"), 1);
    EXPECT_EQ(v.at("flush_rc"), -ENOTCONN);  // at once: nothing was ever started
    EXPECT_FALSE(daemon_knows(v.at("pid")));
    if (env[10] == 'D') {
      EXPECT_EQ(v.at("dropped"), 0);  // disabled records (and counts) nothing
    }
  }
  EXPECT_EQ(events_received(socket()), 0);
}

// Protocol version 5: the rings travel in shared memory when the daemon maps them, and on
// the socket when it refuses them or the library is told not to offer them. Same counts
// either way; `stats --json`'s shared_rings says which path they took.
class Transport : public ::testing::Test {
 protected:
  // A daemon with `limits` (a JSON object) as its config's "limits".
  void start_daemon(const std::string& limits = "{}") {
    const std::string config = dir_.file("config.json");
    std::ofstream(config) << "{\"limits\": " << limits << "}\n";
    daemon_ = std::make_unique<DaemonProcess>(dir_.file("d.sock"),
                                              std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  std::string socket() const { return dir_.file("d.sock"); }
  nlohmann::json shared_rings() const {
    const auto reply = command(socket(), "stats --json");
    EXPECT_TRUE(reply.has_value());
    if (!reply) return {};
    return nlohmann::json::parse(*reply).at("shared_rings");
  }
  // 4 threads x 2000 Matmul spans, exact in the daemon.
  void expect_threads_arrive(const std::vector<std::string>& env = {}) {
    const std::string out = dir_.file("t");
    ASSERT_EQ(
        run_process({STEPTRACE_TEST_TRAINER, "threads", socket(), out, "4", "2000"}, env, 60000),
        0);
    const Values v = wait_values(out);
    EXPECT_EQ(v.at("dropped"), 0);
    const auto proc = process_report(socket(), v.at("pid"));
    EXPECT_EQ(step_count(proc, "Matmul"), 4 * 2000);
    EXPECT_EQ(step_count(proc, "Matmul", "open"), 0);
    EXPECT_EQ(dropped_of(proc), 0);
    EXPECT_EQ(events_received(socket()), 4 * 2000 * 2);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(Transport, TheDaemonReadsTheRingsInSharedMemory) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  ASSERT_NO_FATAL_FAILURE(expect_threads_arrive());
  const auto rings = shared_rings();
  EXPECT_GE(rings.at("attached").get<long long>(), 4) << rings;
  EXPECT_EQ(rings.at("events").get<long long>(), 4 * 2000 * 2) << rings;
  EXPECT_EQ(rings.at("refused").get<long long>(), 0) << rings;
  // The process exited: its rings are unmapped, their bytes returned.
  EXPECT_EQ(rings.at("mapped").get<long long>(), 0) << rings;
  EXPECT_EQ(rings.at("bytes_mapped").get<long long>(), 0) << rings;
}

TEST_F(Transport, RingsTheDaemonRefusesGoOnTheSocketAndLoseNothing) {
  ASSERT_NO_FATAL_FAILURE(start_daemon(R"({"max_rings_per_process": 0})"));
  ASSERT_NO_FATAL_FAILURE(expect_threads_arrive());
  const auto rings = shared_rings();
  EXPECT_EQ(rings.at("attached").get<long long>(), 0) << rings;
  EXPECT_GE(rings.at("refused").get<long long>(), 4) << rings;
  EXPECT_EQ(rings.at("events").get<long long>(), 0) << rings;
  const auto stats = nlohmann::json::parse(*command(socket(), "stats --json"));
  EXPECT_GE(stats.at("limits_hit").value("max_rings_per_process", 0), 4) << stats;
}

TEST_F(Transport, ShmRingsOffKeepsEveryRingOnTheSocket) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  ASSERT_NO_FATAL_FAILURE(expect_threads_arrive({"STEPTRACE_SHM_RINGS=0"}));
  const auto rings = shared_rings();
  EXPECT_EQ(rings.at("attached").get<long long>(), 0) << rings;
  EXPECT_EQ(rings.at("refused").get<long long>(), 0) << rings;
}

}  // namespace
}  // namespace steptrace::testing
