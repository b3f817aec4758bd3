// A uid's fair share of the daemon's global budgets against a greedy tenant (issue 26,
// items 1 and 8), with the real steptraced and raw clients (tests/server/raw_client.cpp)
// that are processes of two temporary unprivileged users (useradd; removed after):
//   - one uid's processes fill limits.max_state_bytes with thread state; another uid's
//     trainer then still keeps every span it got a FlushAck for (its share is taken back
//     from the greedy uid), and every process's identity holds exactly: events + its
//     `refused` drops == what it sent, so nothing acknowledged is lost uncounted;
//   - another uid's churn of short-lived processes past limits.max_exited_processes
//     evicts its own exited processes, not the one that just exited under the other uid.
// The clients are forked from the test and drop to the user's uid before they exec
// raw_client (SO_PEERCRED is taken at connect). The users are the point: CI runs as
// root, and without root this test is skipped.
#include <fcntl.h>
#include <grp.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/temporary_user.h"
#include "tests/support/two_users.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// raw_client run as `user`: fork, drop to the user, exec. Its pid (-1: fork failed).
pid_t spawn_as(const TemporaryUser& user, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {RAW_CLIENT_BIN};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int null = ::open("/dev/null", O_RDWR);
    if (null >= 0) ::dup2(null, STDOUT_FILENO);
    if (::setgroups(0, nullptr) != 0 || ::setgid(user.gid()) != 0 || ::setuid(user.uid()) != 0 ||
        ::setuid(0) == 0) {
      ::_exit(126);  // could not drop root (or could get it back)
    }
    std::vector<char*> raw;
    for (auto& a : argv) raw.push_back(a.data());
    raw.push_back(nullptr);
    ::execv(raw[0], raw.data());
    ::_exit(127);
  }
  return pid;
}

const json* process_of(const json& report, pid_t pid) {
  for (const json& p : report.at("processes")) {
    if (p.at("pid") == pid) return &p;
  }
  return nullptr;
}

std::uint64_t forward_count(const json& process) {
  for (const json& s : process.at("steps")) {
    if (s.at("step") == "Forward") return s.at("count").get<std::uint64_t>();
  }
  return 0;
}

// What it sent that the daemon accounts for: folded, or refused (counted).
std::uint64_t accounted(const json& process) {
  return process.value("events", std::uint64_t{0}) +
         process.at("dropped_by_cause").value("refused", std::uint64_t{0});
}

class HostileShareTest : public ::testing::Test {
 protected:
  void SetUp() override {
    make_two_users("stshare", greedy_, innocent_);
    if (IsSkipped() || HasFatalFailure()) return;
    // The users must reach the socket: the directory searchable, the socket for everyone.
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
  }
  void TearDown() override {
    for (const pid_t pid : holders_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }

  void start_daemon(const json& limits) {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << json{{"socket_mode", "0666"}, {"limits", limits}}.dump();
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  json report() const { return json::parse(command(socket(), "report --json").value_or("{}")); }
  json stats() const { return json::parse(command(socket(), "stats --json").value_or("{}")); }
  // Polls until `pred` holds, for at most `timeout_ms`; whether it held.
  static bool eventually(const std::function<bool()>& pred, int timeout_ms) {
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    while (!pred()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(milliseconds(50));
    }
    return true;
  }
  // raw_client `good` as `user` with `args`, run to its FlushAck and exit: its pid (-1
  // when it failed).
  pid_t run_good(const TemporaryUser& user, const std::vector<std::string>& args) {
    std::vector<std::string> all = {socket(), "good"};
    all.insert(all.end(), args.begin(), args.end());
    const pid_t pid = spawn_as(user, all);
    return pid > 0 && wait_or_kill(pid, 60000) == 0 ? pid : -1;
  }

  TempDir dir_;
  std::unique_ptr<TemporaryUser> greedy_;
  std::unique_ptr<TemporaryUser> innocent_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<pid_t> holders_;  // clients that stay connected, killed at the end
};

// Issue 26, item 1: before, the innocent trainer got a FlushAck for every batch and its
// spans were nowhere (no steps, no drop).
TEST_F(HostileShareTest, AGreedyUidsStateLeavesAnotherUidItsShareAndNothingGoesUncounted) {
  // 2 MiB: each greedy process's 1,024 thread ids cost about 1.2 MiB of thread state.
  start_daemon({{"max_state_bytes", 1u << 20}});
  constexpr int kGreedyProcesses = 3;
  constexpr std::uint64_t kGreedyThreads = 1024;
  for (int n = 0; n < kGreedyProcesses; ++n) {
    // One span per thread id, then connected for a minute (their threads stay charged).
    holders_.push_back(
        spawn_as(*greedy_, {socket(), "good", "--threads", std::to_string(kGreedyThreads),
                            "--pairs", "1", "--hold-ms", "60000"}));
    ASSERT_GT(holders_.back(), 0);
  }
  // Every greedy span is taken (folded or refused) before the innocent trainer starts.
  ASSERT_TRUE(eventually(
      [&] {
        const json r = report();
        if (!r.contains("processes")) return false;
        for (const pid_t pid : holders_) {
          const json* p = process_of(r, pid);
          if (p == nullptr || accounted(*p) != 2 * kGreedyThreads) return false;
        }
        return true;
      },
      30000))
      << report().dump() << daemon_->log();
  EXPECT_GT(stats().at("limits_hit").value("max_state_bytes", 0), 0) << stats().dump();

  // The innocent uid's trainer: 300 threads x 10 spans, each batch acknowledged.
  const pid_t trainer =
      run_good(*innocent_, {"--threads", "300", "--pairs", "10", "--dur", "1000"});
  ASSERT_GT(trainer, 0) << daemon_->log();

  const json r = report();
  const json* t = process_of(r, trainer);
  ASSERT_NE(t, nullptr) << r.dump();
  EXPECT_EQ(t->at("uid"), innocent_->uid());
  EXPECT_EQ(t->at("events"), 300 * 10 * 2) << t->dump();  // all kept: within its share
  EXPECT_EQ(t->at("dropped"), 0) << t->dump();
  EXPECT_EQ(forward_count(*t), 300u * 10) << t->dump();

  // The greedy uid's losses are its own, and counted exactly.
  std::uint64_t greedy_refused = 0;
  for (const pid_t pid : holders_) {
    const json* g = process_of(r, pid);
    ASSERT_NE(g, nullptr) << r.dump();
    EXPECT_EQ(accounted(*g), 2 * kGreedyThreads) << g->dump();
    EXPECT_EQ(g->at("dropped"), g->at("dropped_by_cause").at("refused")) << g->dump();
    greedy_refused += g->at("dropped_by_cause").value("refused", std::uint64_t{0});
  }
  EXPECT_GT(greedy_refused, 0u);
  const json s = stats();
  EXPECT_LE(s.at("memory").at("state_bytes_charged").get<std::uint64_t>(), 2u << 20) << s.dump();
  const std::string metrics = command(socket(), "metrics").value_or("");
  EXPECT_NE(metrics.find("steptrace_events_dropped_by_clients_by_cause_total{cause=\"refused\"} " +
                         std::to_string(greedy_refused) + "\n"),
            std::string::npos)
      << metrics;
  EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
}

// Issue 26, item 8: before, 1.5 s of another uid's churn removed a just-exited process.
TEST_F(HostileShareTest, AnotherUidsChurnDoesNotEvictAJustExitedProcess) {
  start_daemon({{"max_exited_processes", 4}});
  const pid_t trainer = run_good(*innocent_, {"--threads", "2", "--pairs", "5"});
  ASSERT_GT(trainer, 0) << daemon_->log();
  ASSERT_TRUE(eventually(
      [&] {
        const json r = report();
        const json* p = process_of(r, trainer);
        return p != nullptr && !p->at("alive").get<bool>();
      },
      10000))
      << report().dump();

  std::vector<pid_t> churn;
  for (int n = 0; n < 20; ++n) {
    churn.push_back(run_good(*greedy_, {"--threads", "1", "--pairs", "1"}));
    ASSERT_GT(churn.back(), 0) << daemon_->log();
  }
  // Each churned process is seen exited (its connection closed, /proc says it is gone).
  ASSERT_TRUE(eventually(
      [&] {
        const json r = report();
        const json* last = process_of(r, churn.back());
        return r.at("processes").size() <= 4 && (last == nullptr || !last->at("alive").get<bool>());
      },
      10000))
      << report().dump();

  const json r = report();
  const json* t = process_of(r, trainer);
  ASSERT_NE(t, nullptr) << r.dump();  // the other uid's churn evicted its own
  EXPECT_EQ(forward_count(*t), 2u * 5) << t->dump();
  EXPECT_EQ(process_of(r, churn.front()), nullptr) << r.dump();  // its oldest went
  EXPECT_GE(stats().at("limits_hit").value("max_exited_processes", 0), 16) << stats().dump();
  EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
}

}  // namespace
}  // namespace steptrace::testing
