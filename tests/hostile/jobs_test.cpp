// Jobs of different users with the same id (issue 26, item 7), with the real steptraced
// and real trainers of two temporary unprivileged users (useradd; removed after). Both
// users name their job `team-llm`:
//   - each one's `report --job team-llm` (text and JSON) shows only its own processes,
//     ranks and totals: the other's spans never change its headline;
//   - `--job UID:team-llm` reaches the other's job explicitly;
//   - a job the asking uid does not run is an error naming who does
//     ("no job 'solo' for uid A; uid B has one: use --job B:solo"), also through the
//     CLI (exit status 1); root's bare `--job team-llm` names both uids;
//   - `metrics` has a series per (uid, job id), and every per-process series a uid.
// A trainer is this test program run again as the user (fork, drop to the user's uid,
// exec /proc/self/exe with kTrainerEnv set): the library reads STEPTRACE_JOB and RANK
// when it is loaded, so they must be in the environment of a fresh program. Commands are
// sent from a process forked as the user: the daemon takes the asking uid from
// SO_PEERCRED. The users are the point: CI runs as root, and without root this test is
// skipped.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/temporary_user.h"
#include "tests/support/two_users.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kTrainerEnv = "STEPTRACE_TEST_JOBS_TRAINER";  // "SOCKET FD SPANS"

// The trainer mode of this program: connects, records SPANS Forward spans, flushes, says
// so with one byte on FD and waits to be killed (so the daemon sees it alive).
__attribute__((constructor)) void run_trainer_when_asked() {
  const char* env = std::getenv(kTrainerEnv);
  if (env == nullptr) return;
  const std::string arg = env;
  const std::size_t last = arg.rfind(' ');
  const std::size_t middle = arg.rfind(' ', last - 1);
  const std::string socket = arg.substr(0, middle);
  const int ready = std::atoi(arg.substr(middle + 1, last - middle - 1).c_str());
  const int spans = std::atoi(arg.substr(last + 1).c_str());
  if (steptrace_connect(socket.c_str()) != 0) ::_exit(3);
  for (int i = 0; i < spans; ++i) {
    steptrace_start(STEPTRACE_FORWARD);
    steptrace_end(STEPTRACE_FORWARD);
  }
  if (steptrace_flush(10000) != 0) ::_exit(4);
  const char byte = 1;
  if (::write(ready, &byte, 1) != 1) ::_exit(5);
  for (;;) ::pause();
}

// In a forked child: drop root for `user` for good (false when that failed).
bool become(const TemporaryUser& user) {
  return ::setgroups(0, nullptr) == 0 && ::setgid(user.gid()) == 0 && ::setuid(user.uid()) == 0 &&
         ::setuid(0) != 0;
}

// Reads `fd` to its end (or `timeout_ms`).
std::string read_all(int fd, int timeout_ms) {
  std::string out;
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    char buf[4096];
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n <= 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  return out;
}

// A trainer of `user` in job `job` with rank `rank` of 2 that recorded `spans` Forward
// spans; killed and reaped by the destructor.
class TrainerAs {
 public:
  TrainerAs(const TemporaryUser& user, const std::string& socket, const std::string& job, int rank,
            int spans) {
    int fds[2];
    if (::pipe(fds) != 0) return;  // the write end must survive the exec
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(fds[0]);
      if (!become(user)) ::_exit(126);
      const std::string trainer = std::string(kTrainerEnv) + "=" + socket + " " +
                                  std::to_string(fds[1]) + " " + std::to_string(spans);
      const std::string job_env = "STEPTRACE_JOB=" + job;
      const std::string rank_env = "RANK=" + std::to_string(rank);
      char* const argv[] = {const_cast<char*>("/proc/self/exe"), nullptr};
      char* const envp[] = {
          const_cast<char*>(trainer.c_str()),     const_cast<char*>(job_env.c_str()),
          const_cast<char*>(rank_env.c_str()),    const_cast<char*>("WORLD_SIZE=2"),
          const_cast<char*>("STEPTRACE_QUIET=1"), nullptr};
      ::execve(argv[0], argv, envp);
      ::_exit(127);
    }
    ::close(fds[1]);
    char byte = 0;
    ready_ = pid_ > 0 && ::read(fds[0], &byte, 1) == 1;
    ::close(fds[0]);
  }
  ~TrainerAs() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  TrainerAs(const TrainerAs&) = delete;
  TrainerAs& operator=(const TrainerAs&) = delete;

  bool ready() const { return ready_; }
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
  bool ready_ = false;
};

// What a process forked as `user` printed (stdout and stderr together) and its exit
// status: `body` runs in the child after it dropped root, with stdout and stderr on a pipe.
struct Output {
  int status = -1;
  std::string text;
};
template <typename Body>
Output run_as(const TemporaryUser& user, const Body& body) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::dup2(fds[1], STDERR_FILENO);
    if (!become(user)) ::_exit(126);
    ::_exit(body());
  }
  ::close(fds[1]);
  Output out;
  out.text = read_all(fds[0], 20000);
  ::close(fds[0]);
  out.status = wait_or_kill(pid, 10000);
  return out;
}

// The daemon's reply to `line` sent by `user` (its uid from SO_PEERCRED).
std::string ask_as(const TemporaryUser& user, const std::string& socket, const std::string& line) {
  return run_as(user,
                [&] {
                  const auto reply = command(socket, line);
                  if (!reply) return 1;
                  return ::write(STDOUT_FILENO, reply->data(), reply->size()) ==
                                 static_cast<ssize_t>(reply->size())
                             ? 0
                             : 1;
                })
      .text;
}

std::vector<std::int64_t> pids_of(const json& report) {
  std::vector<std::int64_t> out;
  for (const json& p : report.at("processes")) out.push_back(p.at("pid"));
  std::sort(out.begin(), out.end());
  return out;
}

std::uint64_t forward_total(const json& report) {
  for (const json& t : report.at("totals")) {
    if (t.at("step") == "Forward") return t.at("count");
  }
  return 0;
}

class HostileJobsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    make_two_users("stjobs", owner_, other_);
    if (IsSkipped() || HasFatalFailure()) return;
    // The users must reach the socket: the directory searchable, the socket for everyone.
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << json{{"socket_mode", "0666"}}.dump();
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  json report_as(const TemporaryUser& user, const std::string& options) const {
    const std::string reply = ask_as(user, socket(), "report --json " + options);
    const json doc = json::parse(reply, nullptr, /*allow_exceptions=*/false);
    EXPECT_TRUE(doc.is_object()) << options << ": " << reply;
    return doc.is_object() ? doc : json{{"processes", json::array()}, {"totals", json::array()}};
  }

  TempDir dir_;
  std::unique_ptr<TemporaryUser> owner_;
  std::unique_ptr<TemporaryUser> other_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(HostileJobsTest, SameJobIdOfAnotherUidIsAnotherJobEverywhere) {
  // The owner's job: ranks 0 and 1, 3 + 4 spans. The other uid claims the same id (rank
  // 0, 50 spans, enough to swing any headline) and runs a job "solo" of its own.
  TrainerAs owner0(*owner_, socket(), "team-llm", 0, 3);
  TrainerAs owner1(*owner_, socket(), "team-llm", 1, 4);
  TrainerAs claimer(*other_, socket(), "team-llm", 0, 50);
  TrainerAs solo(*other_, socket(), "solo", 1, 2);
  for (const TrainerAs* t : {&owner0, &owner1, &claimer, &solo}) {
    ASSERT_TRUE(t->ready()) << daemon_->log();
  }
  const std::string a = std::to_string(owner_->uid());
  const std::string b = std::to_string(other_->uid());
  const std::vector<std::int64_t> owners = {std::min(owner0.pid(), owner1.pid()),
                                            std::max(owner0.pid(), owner1.pid())};

  // Each one's `--job team-llm` is its own job: its processes, ranks and totals.
  const json mine = report_as(*owner_, "--job team-llm");
  EXPECT_EQ(pids_of(mine), owners);
  EXPECT_EQ(forward_total(mine), 7u);
  ASSERT_EQ(mine.at("jobs").size(), 1u);
  EXPECT_EQ(mine["jobs"][0]["uid"], owner_->uid());
  EXPECT_EQ(mine["jobs"][0]["ranks"], json::array({0, 1}));
  const json theirs = report_as(*other_, "--job team-llm");
  EXPECT_EQ(pids_of(theirs), std::vector<std::int64_t>{claimer.pid()});
  EXPECT_EQ(forward_total(theirs), 50u);
  // The text headline: two processes, 7 spans, none of the other uid's.
  const std::string text = ask_as(*owner_, socket(), "report --job team-llm");
  EXPECT_NE(text.find("STEPTRACE REPORT (job team-llm (uid " + a + "))"), std::string::npos)
      << text;
  EXPECT_NE(text.find("Processes: 2"), std::string::npos) << text;
  EXPECT_EQ(text.find("Process " + std::to_string(claimer.pid())), std::string::npos) << text;

  // UID:ID reaches another uid's job explicitly, from either side.
  EXPECT_EQ(pids_of(report_as(*owner_, "--job " + b + ":team-llm")),
            std::vector<std::int64_t>{claimer.pid()});
  EXPECT_EQ(pids_of(report_as(*other_, "--job=" + a + ":team-llm")), owners);

  // A job the asking uid does not run: an error that says whose it is.
  EXPECT_EQ(ask_as(*owner_, socket(), "report --job solo"),
            "error: report: no job 'solo' for uid " + a + "; uid " + b + " has one: use --job " +
                b + ":solo\n");
  EXPECT_EQ(ask_as(*other_, socket(), "report --json --job " + a + ":solo"),
            "error: report: no job 'solo' for uid " + a + "; uid " + b + " has one: use --job " +
                b + ":solo\n");
  // Root's bare id: one uid runs "solo", so that one; two run "team-llm", so it says which.
  const auto root_solo = command(socket(), "report --json --job solo");
  ASSERT_TRUE(root_solo);
  EXPECT_EQ(pids_of(json::parse(*root_solo)), std::vector<std::int64_t>{solo.pid()});
  const std::string low = std::min(a, b, [](const std::string& x, const std::string& y) {
    return std::stoul(x) < std::stoul(y);
  });
  const std::string high = low == a ? b : a;
  EXPECT_EQ(command(socket(), "report --job team-llm"),
            "error: report: job 'team-llm' is run by uids " + low + " and " + high +
                ": name one with --job UID:team-llm\n");

  // The CLI as the owner: the same error on stderr, exit status 1; its own job prints.
  const std::string cli = STEPTRACE_CLI_BIN;
  const std::string sock = socket();
  const Output missing = run_as(*owner_, [&] {
    const char* argv[] = {cli.c_str(), "--socket", sock.c_str(), "report",
                          "--job",     "solo",     nullptr};
    ::execv(argv[0], const_cast<char* const*>(argv));
    return 127;
  });
  EXPECT_EQ(missing.status, 1) << missing.text;
  EXPECT_NE(missing.text.find("no job 'solo' for uid " + a + "; uid " + b + " has one: use --job " +
                              b + ":solo"),
            std::string::npos)
      << missing.text;
  const Output own = run_as(*owner_, [&] {
    const char* argv[] = {cli.c_str(), "--socket", sock.c_str(), "report",
                          "--job",     "team-llm", nullptr};
    ::execv(argv[0], const_cast<char* const*>(argv));
    return 127;
  });
  EXPECT_EQ(own.status, 0) << own.text;
  EXPECT_NE(own.text.find("Processes: 2"), std::string::npos) << own.text;

  // Metrics (an HTTP scrape has no caller): a series per (uid, job id), a uid on each
  // process's series.
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics);
  const auto has = [&](const std::string& line) {
    return metrics->find("\n" + line + "\n") != std::string::npos;
  };
  EXPECT_TRUE(has("steptrace_job_step_spans_total{job_id=\"team-llm\",uid=\"" + a +
                  "\",step=\"Forward\"} 7"))
      << *metrics;
  EXPECT_TRUE(has("steptrace_job_step_spans_total{job_id=\"team-llm\",uid=\"" + b +
                  "\",step=\"Forward\"} 50"))
      << *metrics;
  const std::string claimer_series =
      "steptrace_process_step_spans_total{pid=\"" + std::to_string(claimer.pid()) + "\",";
  const std::size_t at = metrics->find(claimer_series);
  ASSERT_NE(at, std::string::npos) << *metrics;
  const std::string line = metrics->substr(at, metrics->find('\n', at) - at);
  EXPECT_NE(line.find(",job_id=\"team-llm\",uid=\"" + b + "\",rank=\"0\",step=\"Forward\"} 50"),
            std::string::npos)
      << line;
  EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
}

}  // namespace
}  // namespace steptrace::testing
