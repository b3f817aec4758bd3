// The VRAM ledger against a hostile neighbour (issue 15, items 3, 7 and 8), with the real
// steptraced and real client processes (tests/ledger/ledger_worker.cpp, the steptrace CLI)
// run as two temporary unprivileged users created for the test (useradd; removed after):
//   - another uid can neither release nor clean up a live holder's reservation: it stays,
//     and the refusal is counted (ledger_anomalies) and credited to the actor's row; root
//     can; anyone can clean up a dead holder's;
//   - a uid past max_reservations_per_uid / max_gpus_per_uid is refused and counted (limit
//     hits and anomalies) while another uid still reserves and creates GPUs;
//   - `reset --ledger` / `reset --gpu UUID` clear the ledger for root, not for a user;
//   - a process named with escape codes and a newline shows sanitised in the text `report`,
//     `ledger`, `stats` and in `steptrace top`;
//   - (issue 26, items 5 and 9) 4,096 refused `steptrace ledger cleanup` calls of one uid
//     leave no rows, its reservation of 2^64-1 bytes and its VRAM sample of total 1 are
//     refused, and another uid's reserve and release get their row and sane numbers; a
//     uid's rows per GPU are capped; rows of exited processes age out.
// The users are the point: CI runs as root, and without root this test is skipped.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/ledger_json.h"
#include "tests/support/temporary_user.h"
#include "tests/support/two_users.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::uint64_t kGiB = 1024ull * 1024 * 1024;

// A user to run clients as.
struct User {
  std::string name;
  uid_t uid = 0;
  gid_t gid = 0;
};
const User kRoot{"root", 0, 0};

User as_user(const TemporaryUser& t) { return {t.name(), t.uid(), t.gid()}; }

// A child process run as `user` (fork, setgroups/setgid/setuid, exec), with its stdin,
// stdout and stderr on pipes.
class Child {
 public:
  Child(const User& user, const std::vector<std::string>& argv) {
    int in[2], out[2], err[2];
    if (::pipe2(in, O_CLOEXEC) != 0 || ::pipe2(out, O_CLOEXEC) != 0 ||
        ::pipe2(err, O_CLOEXEC) != 0) {
      return;
    }
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(in[0], STDIN_FILENO);
      ::dup2(out[1], STDOUT_FILENO);
      ::dup2(err[1], STDERR_FILENO);
      if (user.uid != 0 && (::setgroups(0, nullptr) != 0 || ::setgid(user.gid) != 0 ||
                            ::setuid(user.uid) != 0 || ::setuid(0) == 0)) {
        ::_exit(126);  // could not drop root (or could get it back)
      }
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
    ::close(in[0]);
    ::close(out[1]);
    ::close(err[1]);
    stdin_ = in[1];
    stdout_ = out[0];
    stderr_ = err[0];
  }
  ~Child() {
    if (pid_ > 0 && status_ < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    for (int fd : {stdin_, stdout_, stderr_}) {
      if (fd >= 0) ::close(fd);
    }
  }
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  const std::string& out() const { return out_; }
  const std::string& err() const { return err_; }

  // Reads stdout until a whole line equal to `line` arrived (false at EOF or timeout).
  bool expect_line(const std::string& line, int timeout_ms = 30000) {
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    while (true) {
      const auto nl = out_.find('\n', scanned_);
      if (nl != std::string::npos) {
        const std::string got = out_.substr(scanned_, nl - scanned_);
        scanned_ = nl + 1;
        if (got == line) return true;
        continue;
      }
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
      if (left <= 0 || !read_some(stdout_, out_, static_cast<int>(left))) return false;
    }
  }
  bool send(const std::string& line) {
    const std::string text = line + "\n";
    return ::write(stdin_, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  }
  // Closes stdin, reads stdout and stderr to their end and reaps it: its exit status
  // (128+signal), -1 when it did not end within the timeout.
  int finish(int timeout_ms = 60000) {
    if (stdin_ >= 0) ::close(stdin_);
    stdin_ = -1;
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    bool out_open = true, err_open = true;
    while ((out_open || err_open) && Clock::now() < deadline) {
      pollfd fds[2] = {{stdout_, POLLIN, 0}, {stderr_, POLLIN, 0}};
      if (::poll(fds, 2, 100) <= 0) continue;
      if (out_open && fds[0].revents != 0) out_open = drain(stdout_, out_);
      if (err_open && fds[1].revents != 0) err_open = drain(stderr_, err_);
    }
    status_ = wait_or_kill(
        pid_, static_cast<int>(std::max<long long>(
                  1, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count())));
    return status_;
  }
  void kill_and_reap() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    status_ = 128 + SIGKILL;
  }

 private:
  static bool read_some(int fd, std::string& into, int timeout_ms) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) <= 0) return false;
    return drain(fd, into);
  }
  // One read; false at EOF or an error.
  static bool drain(int fd, std::string& into) {
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) return false;
    into.append(buf, static_cast<std::size_t>(n));
    return true;
  }

  pid_t pid_ = -1;
  int stdin_ = -1, stdout_ = -1, stderr_ = -1;
  int status_ = -1;
  std::string out_, err_;
  std::size_t scanned_ = 0;
};

class HostileLedgerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    make_two_users("sthostile", holder_user_, other_user_);
    if (IsSkipped() || HasFatalFailure()) return;
    holder_ = as_user(*holder_user_);
    other_ = as_user(*other_user_);
    // The users must reach the socket: the directory searchable, the socket for everyone
    // (a shared host puts tenants in the socket's group; any member is such a neighbour).
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
  }

  void start_daemon(const json& limits = json::object()) {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << json{{"socket_mode", "0666"}, {"limits", limits}}.dump();
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  const User& holder() const { return holder_; }
  const User& other() const { return other_; }

  // ledger_worker SOCKET ARGS... as `user`, started (not waited for).
  std::unique_ptr<Child> worker(const User& user, std::vector<std::string> args,
                                const std::string& binary = STEPTRACE_LEDGER_WORKER) const {
    args.insert(args.begin(), {binary, socket()});
    return std::make_unique<Child>(user, args);
  }
  // A one-shot worker: its exit status and, in `pid`, its pid.
  int run_worker(const User& user, std::vector<std::string> args, pid_t* pid = nullptr) const {
    auto child = worker(user, std::move(args));
    if (pid != nullptr) *pid = child->pid();
    const int status = child->finish();
    EXPECT_EQ(child->err(), "") << "worker " << child->pid();
    return status;
  }
  // The steptrace CLI as `user`; its exit status, stdout and stderr.
  struct CliResult {
    int status;
    std::string out, err;
  };
  CliResult cli(const User& user, std::vector<std::string> args) const {
    args.insert(args.begin(), {STEPTRACE_CLI_BIN, "--socket", socket()});
    Child child(user, args);
    const int status = child.finish();
    return {status, child.out(), child.err()};
  }

  json ledger() const { return json::parse(command(socket(), "ledger --json").value_or("{}")); }
  json stats() const { return json::parse(command(socket(), "stats --json").value_or("{}")); }
  std::uint64_t anomaly(const char* kind) const {
    return stats()["ledger_anomalies"].value(kind, std::uint64_t{0});
  }
  std::uint64_t limit_hits(const char* limit) const {
    return stats()["limits_hit"].value(limit, std::uint64_t{0});
  }
  // Polls `ledger --json` until `done` holds (5 s at most).
  json poll_ledger(const std::function<bool(const json&)>& done) const {
    const auto deadline = Clock::now() + milliseconds(5000);
    json view = ledger();
    while (!done(view) && Clock::now() < deadline) {
      std::this_thread::sleep_for(milliseconds(20));
      view = ledger();
    }
    return view;
  }

  TempDir dir_;
  std::unique_ptr<TemporaryUser> holder_user_;
  std::unique_ptr<TemporaryUser> other_user_;
  User holder_;
  User other_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(HostileLedgerTest, AnotherUidCannotReleaseOrCleanUpALiveHoldersReservationRootCan) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  auto holder_proc =
      worker(holder(), {"hold", "GPU-A", "1", std::to_string(3 * kGiB), "job", "GPU-A", "2",
                        std::to_string(kGiB), "kv", "GPU-B", "3", std::to_string(kGiB), "eval"});
  ASSERT_TRUE(holder_proc->expect_line("ready")) << holder_proc->err();
  const pid_t holder_pid = holder_proc->pid();
  const std::string holder_text = std::to_string(holder_pid);
  {
    const json view = ledger();
    const json* a = find_gpu(view, "GPU-A");
    ASSERT_NE(a, nullptr) << view.dump();
    ASSERT_NE(find_reservation(*a, 1), nullptr) << view.dump();
    EXPECT_EQ((*find_reservation(*a, 1))["uid"], holder().uid);
  }

  // The other uid tries both on the live holder: refused and counted; no row for it.
  pid_t intruder = -1;
  ASSERT_EQ(run_worker(other(), {"release", "GPU-A", "1"}, &intruder), 0);
  pid_t intruder2 = -1;
  ASSERT_EQ(run_worker(other(), {"cleanup", "GPU-A", "2", holder_text}, &intruder2), 0);
  json view = ledger();
  const json* a = find_gpu(view, "GPU-A");
  ASSERT_NE(a, nullptr) << view.dump();
  EXPECT_NE(find_reservation(*a, 1), nullptr) << view.dump();
  EXPECT_NE(find_reservation(*a, 2), nullptr) << view.dump();
  EXPECT_EQ((*a)["reserved_bytes"], 4 * kGiB);
  EXPECT_EQ((*a)["operations"]["release"], 0);
  EXPECT_EQ((*a)["operations"]["cleanup"], 0);
  EXPECT_EQ(find_row(*a, intruder), nullptr) << a->dump();
  EXPECT_EQ(find_row(*a, intruder2), nullptr) << a->dump();
  EXPECT_EQ(anomaly("release_refused"), 1u);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_NE(metrics->find("steptrace_ledger_anomalies_total{kind=\"release_refused\"} 1\n"),
            std::string::npos);

  // Root may do both.
  pid_t admin = -1;
  ASSERT_EQ(run_worker(kRoot, {"release", "GPU-A", "1"}, &admin), 0);
  ASSERT_EQ(run_worker(kRoot, {"cleanup", "GPU-A", "2", holder_text}), 0);
  view = ledger();
  a = find_gpu(view, "GPU-A");
  ASSERT_NE(a, nullptr) << view.dump();
  EXPECT_EQ((*a)["reservations"].size(), 0u) << a->dump();
  EXPECT_EQ((*find_row(*a, admin))["releases"], 1);
  EXPECT_EQ(anomaly("release_refused"), 1u);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);

  // Once the holder is dead (flagged by the liveness check), anyone may clean up.
  holder_proc->kill_and_reap();
  view = poll_ledger([](const json& v) {
    const json* b = find_gpu(v, "GPU-B");
    const json* r = b ? find_reservation(*b, 3) : nullptr;
    return r != nullptr && (*r)["holder_alive"] == false;
  });
  ASSERT_EQ((*find_reservation(*find_gpu(view, "GPU-B"), 3))["holder_alive"], false) << view.dump();
  ASSERT_EQ(run_worker(other(), {"cleanup", "GPU-B", "3", holder_text}), 0);
  view = ledger();
  EXPECT_EQ((*find_gpu(view, "GPU-B"))["reservations"].size(), 0u) << view.dump();
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(HostileLedgerTest, AUidPastItsQuotasIsRefusedAndCountedWhileAnotherUidWorks) {
  ASSERT_NO_FATAL_FAILURE(start_daemon({{"max_gpus_per_uid", 2}, {"max_reservations_per_uid", 2}}));
  auto greedy = worker(holder(), {"hold", "GPU-Q1", "1", "4096", "a", "GPU-Q2", "2", "4096", "b"});
  ASSERT_TRUE(greedy->expect_line("ready")) << greedy->err();

  // A third reservation of the uid (another process of it, another GPU it made): refused.
  ASSERT_EQ(run_worker(holder(), {"reserve", "GPU-Q1", "3", "4096", "c"}), 0);
  // A third GPU of the uid (a sample would create it): refused.
  ASSERT_EQ(run_worker(holder(), {"sample", "GPU-junk", "1", "2"}), 0);
  json view = ledger();
  EXPECT_EQ(view["gpus"].size(), 2u) << view.dump();
  EXPECT_EQ(find_gpu(view, "GPU-junk"), nullptr) << view.dump();
  EXPECT_EQ(find_reservation(*find_gpu(view, "GPU-Q1"), 3), nullptr) << view.dump();
  EXPECT_EQ(limit_hits("max_reservations_per_uid"), 1u);
  EXPECT_EQ(limit_hits("max_gpus_per_uid"), 1u);
  EXPECT_EQ(anomaly("max_reservations_per_uid"), 1u);
  EXPECT_EQ(anomaly("max_gpus_per_uid"), 1u);
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_NE(metrics->find("steptrace_limit_hits_total{limit=\"max_gpus_per_uid\"} 1\n"),
            std::string::npos)
      << *metrics;

  // Another uid still reserves on the GPUs there and creates its own.
  auto fair = worker(other(), {"hold", "GPU-Q1", "10", "4096", "x", "GPU-junk", "11", "4096", "y"});
  ASSERT_TRUE(fair->expect_line("ready")) << fair->err();
  view = ledger();
  EXPECT_NE(find_reservation(*find_gpu(view, "GPU-Q1"), 10), nullptr) << view.dump();
  ASSERT_NE(find_gpu(view, "GPU-junk"), nullptr) << view.dump();
  EXPECT_EQ((*find_gpu(view, "GPU-junk"))["creator_uid"], other().uid);
  EXPECT_NE(find_reservation(*find_gpu(view, "GPU-junk"), 11), nullptr) << view.dump();
  EXPECT_EQ(limit_hits("max_reservations_per_uid"), 1u);
  EXPECT_EQ(limit_hits("max_gpus_per_uid"), 1u);

  // The greedy uid gets room back by releasing.
  ASSERT_TRUE(greedy->send("release GPU-Q2 2"));
  ASSERT_TRUE(greedy->expect_line("released"));
  ASSERT_EQ(run_worker(holder(), {"reserve", "GPU-Q1", "4", "4096", "d"}), 0);
  EXPECT_NE(find_reservation(*find_gpu(ledger(), "GPU-Q1"), 4), nullptr);
  EXPECT_EQ(greedy->finish(), 0) << greedy->err();
  EXPECT_EQ(fair->finish(), 0) << fair->err();
}

TEST_F(HostileLedgerTest, ResetOfTheLedgerIsRootsNotAUsers) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  auto h = worker(holder(), {"hold", "GPU-R1", "1", "4096", "a", "GPU-R2", "2", "4096", "b",
                             "GPU-R3", "3", "4096", "c"});
  ASSERT_TRUE(h->expect_line("ready")) << h->err();

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"reset", "--ledger"},
        std::vector<std::string>{"reset", "--gpu", "GPU-R1"}}) {
    const CliResult r = cli(holder(), args);
    EXPECT_EQ(r.status, 1) << args[1];
    EXPECT_EQ(r.err, "steptrace: steptraced answered: error: permission denied\n") << args[1];
  }
  EXPECT_EQ(ledger()["gpus"].size(), 3u);

  CliResult r = cli(kRoot, {"reset", "--gpu", "GPU-R1"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "ok: 1 GPU cleared from the ledger\n");
  json view = ledger();
  EXPECT_EQ(view["gpus"].size(), 2u) << view.dump();
  EXPECT_EQ(find_gpu(view, "GPU-R1"), nullptr) << view.dump();

  r = cli(kRoot, {"reset", "--gpu", "GPU-none"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "steptrace: steptraced answered: error: no GPU 'GPU-none' in the ledger\n");
  r = cli(kRoot, {"reset", "--gpu", "GPU-R2", "--ledger"});
  EXPECT_EQ(r.status, 2) << r.err;  // a usage error of the CLI

  r = cli(kRoot, {"reset", "--ledger"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "ok: 2 GPUs cleared from the ledger\n");
  EXPECT_EQ(ledger()["gpus"].size(), 0u);
  // The holder's release of what is gone is an unknown release, nothing worse.
  ASSERT_TRUE(h->send("release GPU-R2 2"));
  ASSERT_TRUE(h->expect_line("released"));
  EXPECT_EQ(anomaly("unknown_release"), 1u);
  EXPECT_EQ(h->finish(), 0) << h->err();
}

TEST_F(HostileLedgerTest, AProcessNamedWithEscapeCodesIsPrintedSanitised) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  // Exec through a link so named: the kernel takes the process's comm from it.
  const std::string name = "\x1b[31mEV\nIL";  // 10 bytes: fits comm's 15
  const std::string link = dir_.file(name);
  ASSERT_EQ(::symlink(STEPTRACE_LEDGER_WORKER, link.c_str()), 0);
  auto evil = worker(holder(), {"hold", "GPU-E", "1", "4096", "t"}, link);
  ASSERT_TRUE(evil->expect_line("ready")) << evil->err();
  const std::string shown = "?[31mEV?IL";

  const json report = json::parse(command(socket(), "report --json").value_or("{}"));
  bool found = false;
  for (const auto& p : report["processes"]) {
    if (p["pid"] == evil->pid()) found = p["comm"] == name;  // JSON keeps it, escaped
  }
  EXPECT_TRUE(found) << report.dump();

  std::vector<std::pair<std::string, std::string>> outputs;
  for (const char* c : {"report", "ledger", "stats"}) {
    outputs.emplace_back(c, command(socket(), c).value_or(""));
  }
  const CliResult top = cli(holder(), {"top", "--iterations", "1"});
  EXPECT_EQ(top.status, 0) << top.err;
  outputs.emplace_back("steptrace top", top.out);
  const CliResult report_cli = cli(holder(), {"report"});
  outputs.emplace_back("steptrace report", report_cli.out);
  for (const auto& [what, out] : outputs) {
    EXPECT_FALSE(out.empty()) << what;
    EXPECT_EQ(out.find('\x1b'), std::string::npos) << what << ":\n" << out;
    EXPECT_EQ(out.find("EV\nIL"), std::string::npos) << what << ":\n" << out;
  }
  for (const std::size_t i : {0u, 1u, 3u, 4u}) {  // stats names no process
    EXPECT_NE(outputs[i].second.find(shown), std::string::npos) << outputs[i].first << ":\n"
                                                                << outputs[i].second;
  }
  EXPECT_EQ(evil->finish(), 0) << evil->err();
}

// Issue 26, items 5 and 9: a greedy uid's refused CLI callers, huge reservation and false
// total against an innocent uid that established the GPU's total first.
TEST_F(HostileLedgerTest, RefusedCallersLeaveNoRowsAndNoUidDistortsTheSharedView) {
  ASSERT_NO_FATAL_FAILURE(start_daemon({{"max_processes", 512}}));  // the GPU's rows
  constexpr std::uint64_t kTotal = 80 * kGiB;
  ASSERT_EQ(
      run_worker(other(), {"sample", "GPU-V", std::to_string(70 * kGiB), std::to_string(kTotal)}),
      0);
  auto holder_proc = worker(other(), {"hold", "GPU-V", "1", std::to_string(kGiB), "job"});
  ASSERT_TRUE(holder_proc->expect_line("ready")) << holder_proc->err();

  // 4,096 short-lived CLI callers of the greedy uid, each refused with a clear error.
  constexpr int kCalls = 4096;
  int denied = 0;
  for (int i = 0; i < kCalls; ++i) {
    const CliResult r = cli(holder(), {"ledger", "cleanup", "GPU-V", "1"});
    if (r.status == 1 && r.err.find("error: permission denied") != std::string::npos) ++denied;
  }
  EXPECT_EQ(denied, kCalls);
  // Its huge reservation and its false total: refused, counted.
  ASSERT_EQ(run_worker(holder(), {"reserve", "GPU-V", "2", "18446744073709551615", "greedy"}), 0);
  ASSERT_EQ(run_worker(holder(), {"sample", "GPU-V", "0", "1"}), 0);

  // The innocent uid's reserve and release get their row.
  auto fair = worker(other(), {"hold", "GPU-V", "3", std::to_string(2 * kGiB), "fair"});
  ASSERT_TRUE(fair->expect_line("ready")) << fair->err();
  ASSERT_TRUE(fair->send("release GPU-V 3"));
  ASSERT_TRUE(fair->expect_line("released"));
  const json view = ledger();
  const json* v = find_gpu(view, "GPU-V");
  ASSERT_NE(v, nullptr) << view.dump();
  const json* row = find_row(*v, fair->pid());
  ASSERT_NE(row, nullptr) << v->dump();
  EXPECT_EQ((*row)["reserves"], 1);
  EXPECT_EQ((*row)["releases"], 1);
  EXPECT_EQ((*v)["processes"].size(), 2u) << v->dump();  // the two innocent processes
  EXPECT_EQ((*v)["reserved_bytes"], kGiB);
  EXPECT_EQ((*v)["total_bytes"], kTotal);
  EXPECT_EQ((*v)["available_bytes"], kTotal - kGiB);
  EXPECT_EQ((*v)["overcommitted"], false);
  EXPECT_EQ((*v)["reservations"].size(), 1u);
  const std::string text = command(socket(), "ledger").value_or("");
  EXPECT_EQ(text.find("EiB"), std::string::npos) << text;
  EXPECT_NE(text.find("total 80.00 GiB"), std::string::npos) << text;

  // Each refusal counted, in stats and in metrics.
  const json s = stats();
  EXPECT_EQ(s["ledger_anomalies"]["cleanup_refused"], kCalls);
  EXPECT_EQ(s["ledger_anomalies"]["reservation_over_total"], 1);
  EXPECT_EQ(s["ledger_anomalies"]["vram_total_mismatch"], 1);
  EXPECT_EQ(s["ledger_anomalies"]["process_rows_full"], 0);
  const std::string metrics = command(socket(), "metrics").value_or("");
  EXPECT_NE(metrics.find("steptrace_ledger_anomalies_total{kind=\"reservation_over_total\"} 1\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("steptrace_ledger_anomalies_total{kind=\"vram_total_mismatch\"} 1\n"),
            std::string::npos);
  EXPECT_EQ(fair->finish(), 0) << fair->err();
  EXPECT_EQ(holder_proc->finish(), 0) << holder_proc->err();
}

TEST_F(HostileLedgerTest, AUidsRowsPerGpuAreCappedAndRowsOfExitedProcessesAgeOut) {
  ASSERT_NO_FATAL_FAILURE(
      start_daemon({{"max_ledger_rows_per_uid", 2}, {"max_ledger_row_age_s", 1}}));
  std::vector<std::unique_ptr<Child>> greedy;
  for (int i = 0; i < 3; ++i) {
    greedy.push_back(worker(holder(), {"hold", "GPU-C", std::to_string(10 + i), "4096", "g"}));
    ASSERT_TRUE(greedy.back()->expect_line("ready")) << greedy.back()->err();
  }
  auto fair = worker(other(), {"hold", "GPU-C", "20", "4096", "f"});
  ASSERT_TRUE(fair->expect_line("ready")) << fair->err();
  json view = ledger();
  const json* c = find_gpu(view, "GPU-C");
  ASSERT_NE(c, nullptr) << view.dump();
  EXPECT_NE(find_row(*c, greedy[0]->pid()), nullptr) << c->dump();
  EXPECT_NE(find_row(*c, greedy[1]->pid()), nullptr) << c->dump();
  EXPECT_EQ(find_row(*c, greedy[2]->pid()), nullptr) << c->dump();  // past its uid's cap
  EXPECT_NE(find_row(*c, fair->pid()), nullptr) << c->dump();
  EXPECT_EQ((*c)["reservations"].size(), 4u);  // every reservation applied
  EXPECT_EQ(limit_hits("max_ledger_rows_per_uid"), 1u);
  EXPECT_EQ(anomaly("max_ledger_rows_per_uid"), 1u);

  // The greedy processes exit: their rows are marked exited, then go a second later
  // (their reservations stay, LEAKED); the live process's row stays.
  for (auto& g : greedy) EXPECT_EQ(g->finish(), 0) << g->err();
  view = poll_ledger([&](const json& v) {
    const json* g = find_gpu(v, "GPU-C");
    return g != nullptr && (*g)["processes"].size() == 1;
  });
  c = find_gpu(view, "GPU-C");
  ASSERT_NE(c, nullptr) << view.dump();
  EXPECT_EQ((*c)["processes"].size(), 1u) << c->dump();
  ASSERT_NE(find_row(*c, fair->pid()), nullptr) << c->dump();
  EXPECT_EQ((*find_row(*c, fair->pid()))["exited"], false);
  EXPECT_EQ((*c)["reservations"].size(), 4u);
  EXPECT_EQ(fair->finish(), 0) << fair->err();
}

}  // namespace
}  // namespace steptrace::testing
