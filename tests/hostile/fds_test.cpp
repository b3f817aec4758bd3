// File descriptors (issue 15, item 4): the daemon checks limits.max_connections against
// its open-file limit at start (raising the soft limit up to the hard one, or refusing
// with a message that says what to change), so that a flood of connections is refused
// with a reply and never starves /proc probes, snapshots or the next client of fds.
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

// The soft and hard open-file limits /proc/PID/limits shows for `pid`.
std::pair<std::string, std::string> open_file_limits(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/limits");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Max open files", 0) != 0) continue;
    std::istringstream fields(line.substr(std::strlen("Max open files")));
    std::string soft, hard;
    fields >> soft >> hard;
    return {soft, hard};
  }
  return {};
}

// Sets this process's RLIMIT_NOFILE for the daemon it is about to fork (the child
// inherits it) and puts the old one back when it goes out of scope.
class ScopedFileLimit {
 public:
  ScopedFileLimit(rlim_t soft, rlim_t hard) {
    ::getrlimit(RLIMIT_NOFILE, &old_);
    const rlimit next{soft, hard};
    ok_ = ::setrlimit(RLIMIT_NOFILE, &next) == 0;
  }
  ~ScopedFileLimit() { ::setrlimit(RLIMIT_NOFILE, &old_); }
  bool ok() const { return ok_; }

 private:
  rlimit old_{};
  bool ok_ = false;
};

int connect_to(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::string write_config(const TempDir& dir, int max_connections) {
  const std::string path = dir.file("steptraced.json");
  std::ofstream(path) << "{\"limits\": {\"max_connections\": " << max_connections
                      << ", \"max_rings\": 32}}\n";
  return path;
}

TEST(HostileFdsTest, AMaxConnectionsTheHardLimitCannotHoldIsRefusedAtStartSayingWhatToChange) {
  if (::geteuid() != 0) GTEST_SKIP() << "lowering the hard limit and back needs root (CI is)";
  TempDir dir;
  ScopedFileLimit limit(256, 256);
  ASSERT_TRUE(limit.ok());
  DaemonProcess daemon(dir.file("d.sock"));  // max_connections 1024 by default
  EXPECT_FALSE(daemon.start());
  const std::string log = daemon.log();
  EXPECT_NE(log.find("limits.max_connections 1024 and limits.max_rings 4096 need 5344 open files"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("the open-file limit is 256 (hard limit 256)"), std::string::npos) << log;
  EXPECT_NE(
      log.find(
          "lower limits.max_connections and limits.max_rings so that they add up to 32 or less"),
      std::string::npos)
      << log;
}

TEST(HostileFdsTest, TheSoftLimitIsRaisedToWhatMaxConnectionsNeeds) {
  rlimit now{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &now), 0);
  if (now.rlim_max != RLIM_INFINITY && now.rlim_max < 5344) {
    GTEST_SKIP() << "the hard open-file limit here (" << now.rlim_max << ") is below 5344";
  }
  TempDir dir;
  ScopedFileLimit limit(256, now.rlim_max);
  ASSERT_TRUE(limit.ok());
  DaemonProcess daemon(dir.file("d.sock"));
  ASSERT_TRUE(daemon.start()) << daemon.log();
  EXPECT_EQ(open_file_limits(daemon.pid()).first, "5344");
  EXPECT_NE(daemon.log().find("raised the open-file limit from 256 to 5344"), std::string::npos)
      << daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << daemon.log();
}

// At exactly the limit the daemon takes a flood of connections four times its
// max_connections: every one beyond the limit is refused or closed, none starves the
// daemon of fds (no accept failure, the snapshot at stop is written), and once the
// flood ends the next client is served.
TEST(HostileFdsTest, AFloodOfConnectionsAtTheLimitNeverRunsTheDaemonOutOfFds) {
  if (::geteuid() != 0) GTEST_SKIP() << "lowering the hard limit and back needs root (CI is)";
  TempDir dir;
  const std::string state = dir.file("state");
  ASSERT_EQ(::mkdir(state.c_str(), 0700), 0);
  const std::string config = write_config(dir, 64);
  std::unique_ptr<DaemonProcess> daemon;
  {
    ScopedFileLimit limit(320, 320);  // 64 + 32 rings + 64 refusing + 32 passed fds + 128 reserved
    ASSERT_TRUE(limit.ok());
    daemon = std::make_unique<DaemonProcess>(
        dir.file("d.sock"), std::vector<std::string>{"--config", config, "--state-dir", state});
    ASSERT_TRUE(daemon->start()) << daemon->log();
  }
  EXPECT_EQ(open_file_limits(daemon->pid()).first, "320");

  std::vector<int> flood;
  for (int i = 0; i < 4 * 64 + 64; ++i) {
    const int fd = connect_to(daemon->socket());
    if (fd >= 0) flood.push_back(fd);
  }
  EXPECT_GT(flood.size(), 128u);
  // The daemon still answers on the connections it admitted...
  const std::string ping = "ping\n";
  ASSERT_EQ(::write(flood.front(), ping.data(), ping.size()), static_cast<ssize_t>(ping.size()));
  char reply[16] = {};
  EXPECT_EQ(::read(flood.front(), reply, sizeof reply), 5);
  EXPECT_STREQ(reply, "pong\n");
  for (const int fd : flood) ::close(fd);
  // ...and the next client after the flood.
  std::optional<std::string> pong;
  for (int i = 0; i < 100 && pong != "pong\n"; ++i) {
    pong = command(daemon->socket(), "ping", 2000);
    if (pong != "pong\n") ::usleep(50'000);
  }
  EXPECT_EQ(pong, "pong\n");
  EXPECT_EQ(daemon->log().find("accept failed"), std::string::npos) << daemon->log();
  EXPECT_EQ(daemon->stop(), 0) << daemon->log();  // the final snapshot was written
}

}  // namespace
}  // namespace steptrace::testing
