// libsteptrace against the real steptraced, with real trainer processes
// (steptrace_test_trainer, the C program, fork/exec). Counts are read back with
// `report --json --pid N`. Every scenario runs with the library's default clock choice
// and with each clock forced (STEPTRACE_CLOCK=monotonic, STEPTRACE_CLOCK=tsc: the TSC
// when cpuid says it is invariant, whatever the kernel's clocksource).
#include <signal.h>
#include <sys/stat.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"

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

class ClientIntegration : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(socket());
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  std::string socket() const { return dir_.file("d.sock"); }
  std::string out(const std::string& name) const { return dir_.file(name); }
  std::vector<std::string> env() const {
    if (GetParam() == "default") return {};
    return {"STEPTRACE_CLOCK=" + GetParam()};
  }
  pid_t trainer(std::vector<std::string> args) const {
    args.insert(args.begin(), STEPTRACE_TEST_TRAINER);
    return spawn_process(args, env());
  }
  int run_trainer(std::vector<std::string> args) const {
    args.insert(args.begin(), STEPTRACE_TEST_TRAINER);
    return run_process(args, env(), 60000);
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
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

TEST_P(ClientIntegration, ForkedChildReportsUnderItsOwnPidAndNothingIsSentTwice) {
  ASSERT_EQ(run_trainer({"fork", socket(), out("f"), "1000"}), 0);
  const Values v = wait_values(out("f"));
  const auto parent = process_report(socket(), v.at("pid"));
  const auto child = process_report(socket(), v.at("child"));
  EXPECT_EQ(step_count(parent, "Forward"), 1100);
  EXPECT_EQ(step_count(parent, "Backward"), 0);
  EXPECT_EQ(step_count(child, "Backward"), 1000);
  EXPECT_EQ(step_count(child, "Forward"), 0);
  EXPECT_EQ(dropped_of(parent), 0);
  EXPECT_EQ(dropped_of(child), 0);
}

TEST_P(ClientIntegration, DaemonAbsentAtStartThenStarted) {
  daemon_.reset();  // SIGKILL: no daemon, the socket path is stale or missing
  const pid_t pid = trainer({"late", socket(), out("l"), "10000", "1000"});
  const Values phase1 = wait_values(out("l.phase1"));
  EXPECT_NE(phase1.at("connect_rc"), 0);
  // Recording never waited for the absent daemon: what did not fit was counted.
  EXPECT_EQ(phase1.at("dropped_phase1"), 20000 - 8192);
  daemon_ = std::make_unique<DaemonProcess>(socket());
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  ASSERT_EQ(wait_process(pid, 60000), 0);
  const Values v = wait_values(out("l"));
  const auto proc = process_report(socket(), v.at("pid"));
  const long long delivered = 2 * step_count(proc, "Forward");
  EXPECT_EQ(delivered + v.at("dropped"), v.at("recorded_events"));
  EXPECT_EQ(step_count(proc, "Forward"), 4096 + 1000);
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
  const long long delivered = 2 * step_count(proc, "Transfer");
  EXPECT_GT(delivered, 0);                       // reconnected and kept sending
  EXPECT_EQ(dropped_of(proc), v.at("dropped"));  // its drop count reached the new daemon
  EXPECT_TRUE(v.at("dropped") > 0 || delivered == v.at("recorded_events"));
  EXPECT_LE(delivered + v.at("dropped"), v.at("recorded_events"));
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

}  // namespace
}  // namespace steptrace::testing
