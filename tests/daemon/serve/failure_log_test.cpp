// FailureLog (daemon/serve/failure_log.h): a failure that recurs every second is one
// error line, then at most one line a minute, then one info line when it ends.
#include "daemon/serve/failure_log.h"

#include <gtest/gtest.h>

namespace steptrace::daemon {
namespace {

using std::chrono::seconds;

constexpr std::int64_t kStart = 1'796'459'401;  // 2026-12-05 08:30:01 UTC

TEST(FailureLogTest, FirstFailureLogsItsReasonThenAtMostOneLineAMinute) {
  FailureLog log("snapshots");
  const FailureLog::Clock::time_point t0{};
  const auto first =
      log.failed("writing snapshot to /s failed: No space left on device", t0, kStart);
  ASSERT_TRUE(first);
  EXPECT_EQ(first->level, FailureLog::Level::kError);
  EXPECT_EQ(first->text, "writing snapshot to /s failed: No space left on device");
  EXPECT_TRUE(log.failing());
  // Every second for a minute: nothing.
  for (int s = 1; s < 60; ++s) {
    EXPECT_FALSE(log.failed("again", t0 + seconds(s), kStart + s)) << s;
  }
  const auto summary = log.failed("writing snapshot to /s failed: Read-only file system",
                                  t0 + seconds(60), kStart + 60);
  ASSERT_TRUE(summary);
  EXPECT_EQ(summary->level, FailureLog::Level::kError);
  EXPECT_EQ(summary->text,
            "snapshots still failing: 61 failures since 2026-12-05 08:30:01 UTC; latest: writing "
            "snapshot to /s failed: Read-only file system");
  // The next minute counts from that line.
  EXPECT_FALSE(log.failed("again", t0 + seconds(119), kStart + 119));
  EXPECT_TRUE(log.failed("again", t0 + seconds(120), kStart + 120));
}

TEST(FailureLogTest, TheFirstSuccessAfterFailuresLogsOnceAtInfo) {
  FailureLog log("snapshots");
  EXPECT_FALSE(log.succeeded());  // nothing failed: nothing to say
  const FailureLog::Clock::time_point t0{};
  ASSERT_TRUE(log.failed("e", t0, kStart));
  EXPECT_FALSE(log.failed("e", t0 + seconds(1), kStart + 1));
  EXPECT_FALSE(log.failed("e", t0 + seconds(2), kStart + 2));
  const auto back = log.succeeded();
  ASSERT_TRUE(back);
  EXPECT_EQ(back->level, FailureLog::Level::kInfo);
  EXPECT_EQ(back->text, "snapshots written again after 3 failures since 2026-12-05 08:30:01 UTC");
  EXPECT_FALSE(log.failing());
  EXPECT_FALSE(log.succeeded());
  // A new run starts over: its first failure is logged at once, with its own start.
  const auto again = log.failed("e2", t0 + seconds(5), kStart + 5);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->text, "e2");
  EXPECT_EQ(log.succeeded()->text,
            "snapshots written again after 1 failure since 2026-12-05 08:30:06 UTC");
}

}  // namespace
}  // namespace steptrace::daemon
