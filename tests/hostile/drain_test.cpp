// SIGTERM under a connection storm (issue 15, item 6): connections still queued in the
// listen backlog when the daemon stops had already sent their data. The daemon takes
// them past max_connections (as far as its fd reserve allows) and applies what they
// sent before the final snapshot; what it cannot take is counted and logged.
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "proto/codec.h"
#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

class HostileDrainTest : public ::testing::Test {
 protected:
  HostileDrainTest() : state_(dir_.file("state")) { ::mkdir(state_.c_str(), 0700); }
  std::string socket() const { return dir_.file("d.sock"); }
  std::string config(int max_connections) const {
    const std::string path = dir_.file("steptraced.json");
    std::ofstream(path) << "{\"limits\": {\"max_connections\": " << max_connections << "}}\n";
    return path;
  }

  // Stops `daemon` with SIGSTOP, starts `clients` raw clients that each connect (into the
  // backlog) and send 100 Forward spans on one thread, waits until all have written
  // everything, then SIGTERMs the daemon. Returns the clients' pids.
  std::vector<pid_t> storm_then_stop(DaemonProcess& daemon, int clients) {
    daemon.signal(SIGSTOP);
    std::vector<pid_t> pids;
    std::vector<std::string> sent;
    for (int i = 0; i < clients; ++i) {
      sent.push_back(dir_.file("sent-" + std::to_string(i)));
      pids.push_back(spawn_process({RAW_CLIENT_BIN, socket(), "good", "--threads", "1", "--pairs",
                                    "100", "--sent-file", sent.back()}));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    for (const auto& file : sent) {
      while (!fs::exists(file) && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      EXPECT_TRUE(fs::exists(file)) << "a client never finished writing its frames";
    }
    EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
    for (const pid_t pid : pids) wait_or_kill(pid, 30000);
    return pids;
  }

  // What the restarted daemon says of the storm: how many of `pids` it shows with all
  // 100 spans, and how many connections were refused (the snapshot keeps the count).
  struct Outcome {
    int complete = 0;
    std::uint64_t rejected = 0;
  };
  Outcome restarted(const std::vector<pid_t>& pids) {
    DaemonProcess again(socket(), {"--state-dir", state_});
    EXPECT_TRUE(again.start()) << again.log();
    const auto text = command(socket(), "report --json");
    EXPECT_TRUE(text.has_value());
    const json report = json::parse(text.value_or("{}"));
    const json stats = json::parse(command(socket(), "stats --json").value_or("{}"));
    Outcome outcome;
    outcome.rejected = stats["connections"]["rejected"].get<std::uint64_t>();
    int& complete = outcome.complete;
    for (const auto& p : report.value("processes", json::array())) {
      if (std::find(pids.begin(), pids.end(), p.value("pid", 0)) == pids.end()) continue;
      for (const auto& step : p["steps"]) {
        if (step["step"] == "Forward" && step["count"] == 100) ++complete;
      }
    }
    return outcome;
  }

  // The N of the daemon's "N queued connection(s) closed unread" (0 when not logged).
  static int undrained(const std::string& log) {
    const auto at = log.find(" queued connection(s) closed unread");
    if (at == std::string::npos) return 0;
    const auto begin = log.find_last_not_of("0123456789", at - 1) + 1;
    return std::stoi(log.substr(begin, at - begin));
  }

  TempDir dir_;
  std::string state_;
};

// When the stopped daemon resumes, the signal and the queued connections arrive at
// once, in no fixed order: connections it admits before it sees the signal follow the
// normal rules (refused past max_connections, told so), the ones still queued when
// shutdown begins are all drained. Every client is accounted for: applied in full,
// refused, or counted as closed unread; none is lost silently.
TEST_F(HostileDrainTest, QueuedConnectionsBeyondMaxConnectionsAreDrainedAtSigterm) {
  DaemonProcess daemon(socket(), {"--config", config(8), "--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const std::vector<pid_t> pids = storm_then_stop(daemon, 40);  // 5x max_connections
  EXPECT_EQ(undrained(daemon.log()), 0) << daemon.log();
  const Outcome outcome = restarted(pids);
  EXPECT_GT(outcome.complete, 8) << daemon.log();  // more than max_connections drained
  EXPECT_EQ(outcome.complete + static_cast<int>(outcome.rejected), 40) << daemon.log();
}

TEST_F(HostileDrainTest, QueuedConnectionsBeyondTheFdReserveAreCountedAndLogged) {
  // max_connections 1: room to drain 1 + 64 (the refusal reserve); 100 queued.
  DaemonProcess daemon(socket(), {"--config", config(1), "--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const std::vector<pid_t> pids = storm_then_stop(daemon, 100);
  const int closed_unread = undrained(daemon.log());
  const Outcome outcome = restarted(pids);
  EXPECT_GT(outcome.complete, 1) << daemon.log();
  EXPECT_GT(closed_unread + static_cast<int>(outcome.rejected), 0) << daemon.log();
  EXPECT_EQ(outcome.complete + static_cast<int>(outcome.rejected) + closed_unread, 100)
      << daemon.log();
}

// A client connected long ago and idle between frames (its hello applied, no timer
// armed) sends more while the daemon is stopped, then the daemon gets SIGTERM: what it
// sent is applied before the final snapshot. (Whether the daemon reads it before or
// after it sees the signal is up to its event loop; the ordering where the drain cancels
// the idle session's read first was found by hand with gdb and is fixed in
// Server::finish_shutdown, which holds the sessions across the cancel.)
TEST_F(HostileDrainTest, AnIdleClientsLastFramesAreAppliedAtSigterm) {
  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket().c_str(), socket().size() + 1);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  std::vector<std::byte> buf(64 * 1024);
  proto::Encoder hello(buf);
  ASSERT_TRUE(hello.hello("test", "idle-client"));
  ASSERT_TRUE(hello.flush(1));
  ASSERT_EQ(::write(fd, hello.bytes().data(), hello.size()), static_cast<ssize_t>(hello.size()));
  // The FlushAck: the daemon applied the hello and waits for this client's next frame.
  std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::FlushAck)> ack{};
  ASSERT_EQ(::read(fd, ack.data(), ack.size()), static_cast<ssize_t>(ack.size()));

  daemon.signal(SIGSTOP);
  std::vector<proto::EventRecord> events;
  for (std::uint64_t i = 0; i < 100; ++i) {
    events.push_back({2 * i, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kStart), 0});
    events.push_back({2 * i + 1, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0});
  }
  proto::Encoder more(buf);
  ASSERT_EQ(more.events(events), events.size());
  ASSERT_TRUE(more.flush(2));
  ASSERT_EQ(::write(fd, more.bytes().data(), more.size()), static_cast<ssize_t>(more.size()));
  ASSERT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
  ::close(fd);

  DaemonProcess again(socket(), {"--state-dir", state_});
  ASSERT_TRUE(again.start()) << again.log();
  const json report = json::parse(command(socket(), "report --json").value_or("{}"));
  bool found = false;
  for (const auto& p : report["processes"]) {
    if (p["pid"] != ::getpid()) continue;
    for (const auto& step : p["steps"]) {
      if (step["step"] == "Forward") found = step["count"] == 100;
    }
  }
  EXPECT_TRUE(found) << report.dump() << daemon.log();
}

}  // namespace
}  // namespace steptrace::testing
