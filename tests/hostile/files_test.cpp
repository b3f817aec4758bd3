// Safe files: the daemon writes and reads its snapshot without following links, refuses a
// state directory another user could write to, and says so (exit status included) when
// its final snapshot could not be written.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

class HostileFilesTest : public ::testing::Test {
 protected:
  HostileFilesTest() : state_(dir_.file("state")) { ::mkdir(state_.c_str(), 0700); }
  std::string socket() const { return dir_.file("d.sock"); }
  std::string snapshot() const { return state_ + "/steptraced.snapshot.json"; }

  TempDir dir_;
  std::string state_;
};

TEST_F(HostileFilesTest, ALinkPlantedAtTheTemporarySnapshotIsNotFollowed) {
  const std::string victim = dir_.file("victim");
  write_file(victim, "precious\n");
  ASSERT_EQ(::symlink(victim.c_str(), (snapshot() + ".tmp").c_str()), 0);

  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  EXPECT_EQ(daemon.stop(), 0) << daemon.log();

  EXPECT_EQ(read_file(victim), "precious\n");  // not overwritten through the link
  struct stat st {};
  ASSERT_EQ(::lstat(snapshot().c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  EXPECT_NE(read_file(snapshot()).find("steptrace.snapshot/v2"), std::string::npos);
  EXPECT_NE(::lstat((snapshot() + ".tmp").c_str(), &st), 0);  // the link itself is gone
}

TEST_F(HostileFilesTest, ASnapshotThatIsALinkIsNotReadAndTheDaemonStartsEmpty) {
  const std::string elsewhere = dir_.file("elsewhere.json");
  write_file(elsewhere, "{\"schema\": \"steptrace.snapshot/v1\"}\n");
  ASSERT_EQ(::symlink(elsewhere.c_str(), snapshot().c_str()), 0);

  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  EXPECT_NE(daemon.log().find("cannot open"), std::string::npos) << daemon.log();
  const auto stats = command(socket(), "stats --json");
  ASSERT_TRUE(stats);
  EXPECT_NE(stats->find("\"errors\":1"), std::string::npos) << *stats;  // snapshots.errors
  EXPECT_EQ(daemon.stop(), 0) << daemon.log();
}

TEST_F(HostileFilesTest, AStateDirectoryOthersCanWriteIsRefusedAtStart) {
  ASSERT_EQ(::chmod(state_.c_str(), 0777), 0);
  DaemonProcess daemon(socket(), {"--state-dir", state_});
  EXPECT_FALSE(daemon.start());
  EXPECT_NE(daemon.log().find("state directory refused"), std::string::npos) << daemon.log();
  EXPECT_NE(daemon.log().find("writable by its group or others (mode 0777)"), std::string::npos)
      << daemon.log();
}

TEST_F(HostileFilesTest, AFinalSnapshotThatCannotBeWrittenMakesTheExitStatusNonZero) {
  DaemonProcess daemon(socket(), {"--state-dir", state_});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  // Another user gets write access to the directory while the daemon runs.
  ASSERT_EQ(::chmod(state_.c_str(), 0770), 0);
  EXPECT_EQ(daemon.stop(), 1) << daemon.log();
  EXPECT_NE(daemon.log().find("snapshot not written: state directory refused"), std::string::npos)
      << daemon.log();
  EXPECT_NE(daemon.log().find("the final snapshot could not be written"), std::string::npos)
      << daemon.log();
}

// Issue 15, item 5: the socket's directory too. One others may write to (without the
// sticky bit) would let them replace the socket under the daemon's clients.
TEST_F(HostileFilesTest, ASocketDirectoryOthersCanWriteIsRefusedUnlessSticky) {
  const std::string open_dir = dir_.file("open");
  ASSERT_EQ(::mkdir(open_dir.c_str(), 0700), 0);
  ASSERT_EQ(::chmod(open_dir.c_str(), 0777), 0);
  DaemonProcess refused(open_dir + "/d.sock");
  EXPECT_FALSE(refused.start());
  EXPECT_NE(refused.log().find("socket directory refused: " + open_dir +
                               " is writable by its group or others (mode 0777) without the "
                               "sticky bit"),
            std::string::npos)
      << refused.log();
  struct stat st {};
  EXPECT_NE(::lstat((open_dir + "/d.sock").c_str(), &st), 0);  // nothing was bound

  ASSERT_EQ(::chmod(open_dir.c_str(), 01777), 0);  // like /tmp
  DaemonProcess sticky(open_dir + "/d.sock");
  ASSERT_TRUE(sticky.start()) << sticky.log();
  EXPECT_EQ(sticky.stop(), 0) << sticky.log();
}

}  // namespace
}  // namespace steptrace::testing
