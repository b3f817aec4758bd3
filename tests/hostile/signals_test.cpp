// Signals a neighbour in the same uid (or an admin's reflex) may send: SIGHUP, SIGUSR1,
// SIGUSR2 and SIGALRM must not end the daemon (their default action would, with no
// snapshot and a stale socket); each is logged and the daemon keeps serving. SIGINT
// stops it like SIGTERM: drained, snapshotted, exit 0.
#include <signal.h>
#include <sys/stat.h>

#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

// Waits until the daemon's log contains `text` (it logs asynchronously to the signal).
bool log_shows(const DaemonProcess& daemon, const std::string& text) {
  for (int i = 0; i < 200; ++i) {
    if (daemon.log().find(text) != std::string::npos) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST(HostileSignalsTest, HupUsrAndAlrmAreLoggedAndTheDaemonKeepsServing) {
  TempDir dir;
  DaemonProcess daemon(dir.file("d.sock"));
  ASSERT_TRUE(daemon.start()) << daemon.log();
  daemon.signal(SIGHUP);
  ASSERT_TRUE(log_shows(daemon, "SIGHUP received: nothing to reload")) << daemon.log();
  for (const int sig : {SIGUSR1, SIGUSR2, SIGALRM}) {
    daemon.signal(sig);
    EXPECT_TRUE(log_shows(daemon, std::string(strsignal(sig)) + " received")) << sig;
    ASSERT_TRUE(daemon.running());
    EXPECT_EQ(command(daemon.socket(), "ping"), "pong\n");
  }
  daemon.signal(SIGHUP);  // a second one does not end it either
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_EQ(command(daemon.socket(), "ping"), "pong\n");
  EXPECT_TRUE(daemon.running());
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

TEST(HostileSignalsTest, SigintStopsLikeSigtermWithASnapshot) {
  TempDir dir;
  const std::string state = dir.file("state");
  ::mkdir(state.c_str(), 0700);
  DaemonProcess daemon(dir.file("d.sock"), {"--state-dir", state});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  EXPECT_EQ(daemon.stop(SIGINT), 0) << daemon.log();
  struct stat st {};
  EXPECT_EQ(::stat((state + "/steptraced.snapshot.json").c_str(), &st), 0);
  EXPECT_NE(::stat(dir.file("d.sock").c_str(), &st), 0);  // no stale socket left
}

}  // namespace
}  // namespace steptrace::testing
