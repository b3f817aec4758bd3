// Item 4 of issue 25, storage faults: the real steptraced with its state directory on a
// tiny tmpfs. When a snapshot no longer fits (ENOSPC) or the directory turns read-only
// (EROFS), the daemon keeps answering and ingesting, says so in stats, metrics and the
// report, logs the failure once (not once a second), and once the directory works again
// writes the next snapshot and logs that it recovered. Needs root (mount); skipped
// without it.
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <thread>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

json command_json(const std::string& socket, const std::string& line) {
  const auto reply = command(socket, line);
  EXPECT_TRUE(reply.has_value()) << line;
  return reply ? json::parse(*reply) : json();
}

bool wait_until(const std::function<bool()>& done, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (!done()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}

std::size_t count(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (auto at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class StorageFaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0) GTEST_SKIP() << "needs root to mount a tmpfs";
    ASSERT_EQ(::mkdir(state_.c_str(), 0700), 0) << std::strerror(errno);
    // 64 KiB: a small table's snapshot fits, one with a few hundred custom steps does not.
    // Mode 0700: the daemon refuses a state directory others may write (tmpfs: 1777).
    if (::mount("tmpfs", state_.c_str(), "tmpfs", 0, "size=64k,mode=0700") != 0) {
      GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(errno);
    }
    mounted_ = true;
  }
  void TearDown() override {
    // Runs after a failed assertion too; the daemon (the test's local) is gone by now.
    if (mounted_) ::umount2(state_.c_str(), MNT_DETACH);
  }
  // Remounts the tmpfs with `options` (e.g. "size=16m"), read-only with `flags` MS_RDONLY.
  void remount(const char* options, unsigned long flags = 0) {
    ASSERT_EQ(::mount("tmpfs", state_.c_str(), "tmpfs", MS_REMOUNT | flags, options), 0)
        << std::strerror(errno);
  }
  std::string socket() const { return dir_.file("d.sock"); }
  json snapshots() { return command_json(socket(), "stats --json")["snapshots"]; }

  TempDir dir_;
  std::string state_ = dir_.file("state");
  bool mounted_ = false;
};

TEST_F(StorageFaultTest, AFullOrReadOnlyStateDirIsShownLoggedOnceAndRecoveredFrom) {
  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  // A small table: its snapshot fits.
  ASSERT_EQ(run_process({RAW_CLIENT_BIN, socket(), "good", "--pairs", "5"}), 0);
  ASSERT_TRUE(wait_until([&] { return snapshots()["written"] >= 1; }, std::chrono::seconds(5)))
      << daemon.log();
  EXPECT_TRUE(snapshots()["last_written_unix"].is_number());
  EXPECT_EQ(snapshots()["failing_since"], nullptr);

  // 400 custom steps with a span each (about 100 KB of snapshot): the next one does not fit.
  const std::string fill_out = dir_.file("fill.out");
  const pid_t fill = spawn_process({LOSSLESS_TRAINER_BIN, "fill", socket(), fill_out, "400"});
  ASSERT_TRUE(wait_until([&] { return read_file(fill_out).find("rc 0") != std::string::npos; },
                         std::chrono::seconds(10)));
  ASSERT_TRUE(
      wait_until([&] { return !snapshots()["failing_since"].is_null(); }, std::chrono::seconds(5)))
      << daemon.log();
  json s = snapshots();
  EXPECT_NE(s["last_error"].get<std::string>().find("No space left on device"), std::string::npos)
      << s.dump();

  // It keeps answering and ingesting.
  ASSERT_EQ(run_process({RAW_CLIENT_BIN, socket(), "good", "--pairs", "7", "--custom", "late"}), 0);
  const json report = command_json(socket(), "report --json");
  EXPECT_EQ(report["daemon"]["durable"]["snapshots"], "failing");
  EXPECT_EQ(report["daemon"]["durable"]["failing_since"], s["failing_since"]);
  bool late = false;
  for (const auto& t : report["totals"]) late = late || t["step"] == "late";
  EXPECT_TRUE(late) << report["totals"].dump();
  const std::string text = command(socket(), "report").value_or("");
  EXPECT_NE(text.find("warning: snapshots failing since "), std::string::npos) << text;
  EXPECT_NE(text.find("No space left on device): a daemon crash now loses what came since"),
            std::string::npos)
      << text;
  EXPECT_NE(command(socket(), "metrics").value_or("").find("\nsteptrace_snapshot_failing 1\n"),
            std::string::npos);

  // A retry every second, one log line for them all.
  ASSERT_TRUE(wait_until([&] { return snapshots()["errors"] >= 3; }, std::chrono::seconds(5)));
  EXPECT_EQ(count(daemon.log(), "No space left on device"), 1u) << daemon.log();

  // Room again: the next snapshot is written and the recovery logged once.
  remount("size=16m");
  ASSERT_TRUE(
      wait_until([&] { return snapshots()["failing_since"].is_null(); }, std::chrono::seconds(5)))
      << daemon.log();
  s = snapshots();
  EXPECT_GE(s["last_written_unix"].get<std::int64_t>(),
            report["daemon"]["durable"]["failing_since"].get<std::int64_t>());
  EXPECT_EQ(count(daemon.log(), "snapshots written again after "), 1u) << daemon.log();
  EXPECT_EQ(command(socket(), "report").value_or("").find("warning:"), std::string::npos);

  // Read-only: a change to write, then EROFS, shown and logged the same way.
  remount("", MS_RDONLY);
  ASSERT_EQ(run_process({RAW_CLIENT_BIN, socket(), "good", "--pairs", "3"}), 0);
  ASSERT_TRUE(
      wait_until([&] { return !snapshots()["failing_since"].is_null(); }, std::chrono::seconds(5)))
      << daemon.log();
  EXPECT_NE(snapshots()["last_error"].get<std::string>().find("Read-only file system"),
            std::string::npos);
  remount("");  // read-write again
  ASSERT_TRUE(
      wait_until([&] { return snapshots()["failing_since"].is_null(); }, std::chrono::seconds(5)))
      << daemon.log();
  EXPECT_EQ(count(daemon.log(), "Read-only file system"), 1u) << daemon.log();
  EXPECT_EQ(count(daemon.log(), "snapshots written again after "), 2u) << daemon.log();

  ::kill(fill, SIGTERM);
  wait_or_kill(fill, 10000);
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

// A snapshot the daemon cannot use at start is moved aside; the report says from when
// its totals are missing.
TEST_F(StorageFaultTest, ASnapshotUnusableAtStartIsInTheReport) {
  std::ofstream(state_ + "/steptraced.snapshot.json") << "{ not json";
  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const json durable = command_json(socket(), "report --json")["daemon"]["durable"];
  EXPECT_EQ(durable["snapshots"], "ok");
  EXPECT_TRUE(durable["started_empty_after"].is_number()) << durable.dump();
  EXPECT_NE(durable["last_error"].get<std::string>().find("snapshot unusable"), std::string::npos);
  const std::string text = command(socket(), "report").value_or("");
  EXPECT_NE(text.find("warning: started empty at "), std::string::npos) << text;
  EXPECT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
}

}  // namespace
}  // namespace steptrace::testing
