// Deferred replies against a hostile (or merely careless) tenant (issue 26, item 4), with
// the real steptraced and clients that are real processes of temporary unprivileged users
// (useradd; removed after):
//   - `trace --for 3600` connections whose client dies are gone within a few seconds
//     (connections.now back down, the captures ended, counted in connections.closed_waiting),
//     so the uid's connection slots are free again: before, they were held for the hour
//     and that uid's next client was refused;
//   - a shut-down writing side (how the CLI asks) is not a close: such a trace still waits;
//   - past limits.max_pending_traces_per_uid a uid's next `trace --for` is refused with an
//     `error: busy: ...` line (counted as that limit; the connection stays usable) while
//     another uid's trace is answered.
// The clients are forked from the test and drop to the user's uid before they connect
// (SO_PEERCRED is taken at connect), so no binary needs staging where the users reach it.
// The users are the point: CI runs as root, and without root this test is skipped.
#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
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

int connect_to(const std::string& path) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  return fd;
}

bool send_all(int fd, const std::string& bytes) {
  return ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size());
}

// Reads from `fd` until a '\n' (the line, with it) or EOF, within `timeout_ms`.
std::string read_line(int fd, int timeout_ms) {
  std::string line;
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  while (line.empty() || line.back() != '\n') {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    pollfd p{fd, POLLIN, 0};
    if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) break;
    char c = 0;
    if (::read(fd, &c, 1) != 1) break;
    line += c;
  }
  return line;
}

// The next line `client` reported ("" at its end or after `timeout_ms`).
std::string next_line(ClientAs& client, int timeout_ms = 10000) {
  return read_line(client.report_fd(), timeout_ms);
}

// Body: `n` connections each asking `trace --for 3600`; those with an odd index then shut
// down their writing side, as the CLI does. Reports "ready" and waits to be killed.
ClientAs::Body hold_traces(std::string socket, int n) {
  return [socket = std::move(socket), n](int report) {
    for (int i = 0; i < n; ++i) {
      const int fd = connect_to(socket);
      if (fd < 0 || !send_all(fd, "trace --for 3600\n")) return 1;
      if (i % 2 == 1) ::shutdown(fd, SHUT_WR);
    }
    if (!send_all(report, "ready\n")) return 1;
    while (true) ::pause();
  };
}

// Body: one command on its own connection; reports the reply's first line.
ClientAs::Body one_command(std::string socket, std::string line) {
  return [socket = std::move(socket), line = std::move(line)](int report) {
    const int fd = connect_to(socket);
    if (fd < 0) return send_all(report, "connect failed\n") ? 0 : 1;
    if (!send_all(fd, line + "\n")) return 1;
    ::shutdown(fd, SHUT_WR);
    const std::string reply = read_line(fd, 10000);
    return send_all(report, reply.empty() ? std::string("(closed)\n") : reply) ? 0 : 1;
  };
}

class HostileDeferredTest : public ::testing::Test {
 protected:
  void SetUp() override {
    make_two_users("stdefer", greedy_, other_);
    if (IsSkipped() || HasFatalFailure()) return;
    // The users must reach the socket: the directory searchable, the socket for everyone.
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
  }

  void start_daemon(const json& limits) {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << json{{"socket_mode", "0666"}, {"limits", limits}}.dump();
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  // Root's `stats --json`; its own connection is one of connections.now.
  json stats() const { return json::parse(command(socket(), "stats --json").value_or("{}")); }
  std::uint64_t connections_now() const {
    return stats()["connections"].value("now", std::uint64_t{0});
  }
  std::uint64_t captures_active() const {
    return stats()["flight_recorder"].value("captures_active", std::uint64_t{0});
  }
  // Polls until `pred` holds, for at most `timeout_ms`; whether it held.
  static bool eventually(const std::function<bool()>& pred, int timeout_ms) {
    const auto deadline = Clock::now() + milliseconds(timeout_ms);
    while (!pred()) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(milliseconds(20));
    }
    return true;
  }

  TempDir dir_;
  std::unique_ptr<TemporaryUser> greedy_;
  std::unique_ptr<TemporaryUser> other_;
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(HostileDeferredTest, TracesWhoseClientDiedFreeTheirConnectionsAtOnce) {
  constexpr int kTraces = 6;
  ASSERT_NO_FATAL_FAILURE(start_daemon(
      {{"max_connections_per_uid", kTraces}, {"max_pending_traces_per_uid", kTraces}}));
  const std::uint64_t base = connections_now();  // root's stats connection

  auto holder = std::make_unique<ClientAs>(*greedy_, hold_traces(socket(), kTraces));
  ASSERT_EQ(next_line(*holder), "ready\n");
  ASSERT_TRUE(eventually([&] { return captures_active() == kTraces; }, 5000)) << stats().dump();
  EXPECT_EQ(connections_now(), base + kTraces);
  // The uid's slots are all taken: its next client (a trainer, a command) is refused.
  {
    ClientAs locked_out(*greedy_, one_command(socket(), "ping"));
    EXPECT_EQ(next_line(locked_out),
              "error: too many connections from uid " + std::to_string(greedy_->uid()) +
                  " (max_connections_per_uid=" + std::to_string(kTraces) + ")\n");
  }
  // Half of them shut down their writing side, the CLI's way of asking: they still wait.
  std::this_thread::sleep_for(milliseconds(200));
  EXPECT_EQ(captures_active(), static_cast<std::uint64_t>(kTraces));

  const auto killed = Clock::now();
  holder->kill();  // the kernel closes every socket of the dead client
  ASSERT_TRUE(eventually([&] { return connections_now() == base && captures_active() == 0; }, 3000))
      << stats().dump();
  const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - killed).count();
  EXPECT_LT(took, 3000);
  EXPECT_EQ(stats()["connections"].value("closed_waiting", std::uint64_t{0}),
            static_cast<std::uint64_t>(kTraces));
  // The uid is served again at once, not in an hour.
  ClientAs after(*greedy_, one_command(socket(), "ping"));
  EXPECT_EQ(next_line(after), "pong\n");
  EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
}

TEST_F(HostileDeferredTest, PastItsPendingTraceCapAUidIsRefusedWhileAnotherIsServed) {
  constexpr int kCap = 2;
  ASSERT_NO_FATAL_FAILURE(
      start_daemon({{"max_connections_per_uid", 16}, {"max_pending_traces_per_uid", kCap}}));
  auto holder = std::make_unique<ClientAs>(*greedy_, hold_traces(socket(), kCap));
  ASSERT_EQ(next_line(*holder), "ready\n");
  ASSERT_TRUE(eventually([&] { return captures_active() == kCap; }, 5000)) << stats().dump();

  // One more of that uid: refused at once with a line that says why; its connection
  // stays usable.
  const std::string sock = socket();
  ClientAs refused(*greedy_, [sock](int report) {
    const int fd = connect_to(sock);
    if (fd < 0 || !send_all(fd, "trace --for 3600\n")) return 1;
    if (!send_all(report, read_line(fd, 5000))) return 1;
    if (!send_all(fd, "ping\n")) return 1;
    return send_all(report, read_line(fd, 5000)) ? 0 : 1;
  });
  EXPECT_EQ(next_line(refused),
            "error: busy: uid " + std::to_string(greedy_->uid()) + " has " + std::to_string(kCap) +
                " trace --for replies waiting "
                "(limits.max_pending_traces_per_uid=" +
                std::to_string(kCap) + "); close one, or retry when one is done\n");
  EXPECT_EQ(next_line(refused), "pong\n");
  EXPECT_EQ(refused.wait(), 0);
  EXPECT_EQ(stats()["limits_hit"].value("max_pending_traces_per_uid", std::uint64_t{0}), 1u);

  // Another uid is unaffected: its `trace --for` waits its 0.3 s and is answered.
  ClientAs innocent(*other_, one_command(socket(), "trace --for 0.3"));
  EXPECT_EQ(next_line(innocent).rfind("{\"traceEvents\":[", 0), 0u);
  EXPECT_EQ(innocent.wait(), 0);
  EXPECT_EQ(captures_active(), static_cast<std::uint64_t>(kCap));

  // The greedy uid's traces end with their client; then it may trace again.
  holder->kill();
  ASSERT_TRUE(eventually([&] { return captures_active() == 0; }, 3000)) << stats().dump();
  ClientAs again(*greedy_, one_command(socket(), "trace --for 0.1"));
  EXPECT_EQ(next_line(again).rfind("{\"traceEvents\":[", 0), 0u);
  EXPECT_EQ(daemon_->stop(), 0) << daemon_->log();
}

}  // namespace
}  // namespace steptrace::testing
