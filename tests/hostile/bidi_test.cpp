// Bidi controls from a real process (issue 26, item 10): a trainer names itself with
// U+202E RIGHT-TO-LEFT OVERRIDE (prctl(PR_SET_NAME), so its /proc comm holds the bytes
// E2 80 AE) and sets a job id with one (STEPTRACE_JOB). Through the real daemon, no
// output carries those bytes raw: `metrics` (U+FFFD), `report` ('?'), `report --json`
// and `trace` (the escape \u202e, which reads back as the same string).
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;

constexpr const char* kRlo = "\xE2\x80\xAE";  // U+202E in UTF-8
// 15 bytes, what PR_SET_NAME keeps: "ev", RLO, "il-trainer".
constexpr const char kComm[] =
    "ev\xE2\x80\xAE"
    "il-trainer";

constexpr const char* kTrainerEnv = "STEPTRACE_TEST_BIDI_TRAINER";  // "SOCKET FD"

// A trainer of its own: this test program run again with kTrainerEnv set (the library
// reads STEPTRACE_JOB when it is loaded, so the job id must be in the environment of a
// fresh program). Before main, it names itself kComm with prctl (before it connects: the
// daemon reads /proc/PID/comm then), records Forward spans and a step whose name holds
// U+202E, flushes, says so on FD and waits to be killed, so the daemon sees it alive.
// (The library cuts a job id and refuses a step name that is not printable ASCII, as the
// wire takes printable ASCII only; the comm is the client string that reaches the
// outputs as the process chose it.)
__attribute__((constructor)) void run_trainer_when_asked() {
  const char* env = std::getenv(kTrainerEnv);
  if (env == nullptr) return;
  const std::string arg = env;
  const std::string socket = arg.substr(0, arg.rfind(' '));
  const int ready = std::atoi(arg.substr(arg.rfind(' ') + 1).c_str());
  ::prctl(PR_SET_NAME, kComm, 0, 0, 0);
  if (steptrace_connect(socket.c_str()) != 0) ::_exit(3);
  const std::uint32_t custom = steptrace_register_step((std::string("step") + kRlo).c_str());
  for (int i = 0; i < 10; ++i) {
    steptrace_start(STEPTRACE_FORWARD);
    if (custom != 0) steptrace_start(custom);
    if (custom != 0) steptrace_end(custom);
    steptrace_end(STEPTRACE_FORWARD);
  }
  if (steptrace_flush(10000) != 0) ::_exit(4);
  const char byte = 1;
  if (::write(ready, &byte, 1) != 1) ::_exit(5);
  for (;;) ::pause();
}

pid_t start_trainer(const std::string& socket, int ready) {
  const std::string job = std::string("job") + kRlo + "\xE2\x81\xA6" + "1";  // and U+2066
  return spawn_process({"/proc/self/exe"},
                       {std::string(kTrainerEnv) + "=" + socket + " " + std::to_string(ready),
                        "STEPTRACE_JOB=" + job});
}

TEST(HostileBidiTest, ACommAndJobWithU202ENeverReachAnOutputRaw) {
  TempDir dir;
  DaemonProcess daemon(dir.file("d.sock"));
  ASSERT_TRUE(daemon.start()) << daemon.log();
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t trainer = start_trainer(daemon.socket(), fds[1]);
  ASSERT_GT(trainer, 0);
  ::close(fds[1]);
  char byte = 0;
  const bool ready = ::read(fds[0], &byte, 1) == 1;
  ::close(fds[0]);
  if (!ready) {
    ::kill(trainer, SIGKILL);
    FAIL() << "the trainer exited with " << wait_process(trainer, 10000) << "\n" << daemon.log();
  }
  std::string comm;  // what /proc says, to show the test really made a hostile name
  {
    std::FILE* f = std::fopen(("/proc/" + std::to_string(trainer) + "/comm").c_str(), "r");
    ASSERT_NE(f, nullptr);
    char buf[64] = {};
    comm = std::fgets(buf, sizeof buf, f) != nullptr ? buf : "";
    std::fclose(f);
  }
  EXPECT_EQ(comm, std::string(kComm) + "\n");

  const auto metrics = command(daemon.socket(), "metrics");
  const auto text = command(daemon.socket(), "report");
  const auto report = command(daemon.socket(), "report --json");
  const auto trace = command(daemon.socket(), "trace");
  ::kill(trainer, SIGKILL);
  wait_process(trainer, 10000);
  ASSERT_TRUE(metrics && text && report && trace);
  for (const std::string* out : {&*metrics, &*text, &*report, &*trace}) {
    EXPECT_EQ(out->find(kRlo), std::string::npos) << *out;
    EXPECT_EQ(out->find("\xE2\x81\xA6"), std::string::npos) << *out;
  }
  // The process is there, under a safe spelling of its name, in every output.
  const std::string pid = std::to_string(trainer);
  EXPECT_NE(metrics->find("comm=\"ev\xEF\xBF\xBDil-trainer\""), std::string::npos) << *metrics;
  EXPECT_NE(metrics->find("job_id=\"job" + std::string(6, '?') + "1\""), std::string::npos)
      << *metrics;
  EXPECT_NE(text->find("Process " + pid + " (ev???il-trainer)"), std::string::npos) << *text;
  EXPECT_NE(report->find(R"("comm":"ev\u202eil-trainer")"), std::string::npos) << *report;
  EXPECT_NE(trace->find(R"(ev\u202eil-trainer [)" + pid + "]"), std::string::npos) << *trace;
  // JSON readers get the name back as it is.
  bool found = false;
  const json doc = json::parse(*report);
  for (const json& p : doc.at("processes")) {
    if (p.at("pid") == trainer) {
      found = true;
      EXPECT_EQ(p.at("comm"), kComm);
      EXPECT_EQ(p.at("job"), "job" + std::string(6, '?') + "1");  // cut by the library
    }
  }
  EXPECT_TRUE(found) << *report;
  EXPECT_TRUE(json::accept(*trace));
}

}  // namespace
}  // namespace steptrace::testing
