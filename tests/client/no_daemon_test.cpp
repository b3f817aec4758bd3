// The C ABI without a daemon: nothing blocks, and everything that could not be kept is
// counted by steptrace_dropped(). Each test runs in its own process (gtest discovery),
// so the library's per-process state starts fresh.
#include <steptrace/steptrace.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr std::uint64_t kRing = 8192;  // per-thread ring capacity (client/src/event_ring.h)
constexpr const char* kAbsent = "/nonexistent-steptrace-dir/steptraced.sock";

void spans(std::uint32_t step, int n) {
  for (int i = 0; i < n; ++i) {
    steptrace_start(step);
    steptrace_end(step);
  }
}

TEST(NoDaemon, HundredThousandSpansBeforeConnectKeepWhatFitsAndCountTheRest) {
  spans(STEPTRACE_FORWARD, 100'000);
  EXPECT_EQ(steptrace_dropped(), 200'000 - kRing);
  EXPECT_EQ(steptrace_flush(10), -ENOTCONN);
}

TEST(NoDaemon, AbsentDaemonConnectFailsAndNothingBlocks) {
  EXPECT_EQ(steptrace_connect(kAbsent), -ENOENT);
  steptrace_set_block_when_full(1);  // no connection: a full ring must still not wait
  spans(STEPTRACE_MATMUL, 100'000);
  EXPECT_EQ(steptrace_dropped(), 200'000 - kRing);
  const int rc = steptrace_flush(20);
  EXPECT_TRUE(rc == -ENOTCONN || rc == -ETIMEDOUT) << rc;
  steptrace_shutdown();
}

TEST(NoDaemon, EnvironmentSocketIsUsedWhenPathIsNull) {
  ASSERT_EQ(setenv("STEPTRACE_SOCKET", kAbsent, 1), 0);
  EXPECT_EQ(steptrace_connect(nullptr), -ENOENT);
  steptrace_shutdown();
}

TEST(NoDaemon, UnknownStepsAreDroppedAndCounted) {
  steptrace_start(12);
  steptrace_start(5000);
  steptrace_end(UINT32_MAX);
  steptrace_start(256);  // not registered yet
  EXPECT_EQ(steptrace_dropped(), 4u);
  const std::uint32_t id = steptrace_register_step("Tokenize");
  EXPECT_EQ(id, 256u);
  steptrace_start(id);
  steptrace_end(id);
  EXPECT_EQ(steptrace_dropped(), 4u);
}

TEST(NoDaemon, RegisterStepValidatesAndIsStable) {
  EXPECT_EQ(steptrace_register_step(nullptr), UINT32_MAX);
  EXPECT_EQ(steptrace_register_step(""), UINT32_MAX);
  EXPECT_EQ(steptrace_register_step(std::string(64, 'n').c_str()), UINT32_MAX);
  const std::uint32_t a = steptrace_register_step("Optimizer");
  std::uint32_t from_thread = 0;
  std::thread([&] { from_thread = steptrace_register_step("Optimizer"); }).join();
  EXPECT_EQ(a, from_thread);
  EXPECT_NE(steptrace_register_step("Other"), a);
}

TEST(NoDaemon, DisabledRecordsNothing) {
  steptrace_set_enabled(0);
  spans(STEPTRACE_FORWARD, 100'000);
  steptrace_ledger_reserve("GPU-0", 1, 1, "t");
  EXPECT_EQ(steptrace_dropped(), 0u);
  steptrace_set_enabled(1);
  // The ring is still empty: exactly kRing events fit now.
  spans(STEPTRACE_FORWARD, static_cast<int>(kRing / 2) + 1);
  EXPECT_EQ(steptrace_dropped(), 2u);
}

TEST(NoDaemon, AfterShutdownRecordingIsCountedUntilConnectAgain) {
  EXPECT_NE(steptrace_connect(kAbsent), 0);
  steptrace_shutdown();
  spans(STEPTRACE_ALLOC, 5);
  EXPECT_EQ(steptrace_dropped(), 10u);
  EXPECT_NE(steptrace_connect(kAbsent), 0);
  spans(STEPTRACE_ALLOC, 5);
  EXPECT_EQ(steptrace_dropped(), 10u);
  steptrace_shutdown();
}

TEST(NoDaemon, LedgerQueueIsBoundedAndBadAnnotationsCounted) {
  steptrace_ledger_reserve(nullptr, 1, 10, "task");
  steptrace_ledger_release("", 1);
  EXPECT_EQ(steptrace_dropped(), 2u);
  for (int i = 0; i < 2000; ++i) steptrace_vram_sample("GPU-0", 1, 2);
  EXPECT_EQ(steptrace_dropped(), 2u + (2000 - 1024));  // queue bound: 1024
}

TEST(NoDaemon, ExitedThreadsKeepABoundedNumberOfRings) {
  for (int t = 0; t < 100; ++t) std::thread([] { spans(STEPTRACE_BACKWARD, 5); }).join();
  // 64 exited threads' rings are kept for a later connection; older ones are counted.
  EXPECT_EQ(steptrace_dropped(), (100u - 64u) * 10u);
}

TEST(NoDaemon, ForkChildStartsWithZeroDropsAndEmptyBuffers) {
  spans(STEPTRACE_FORWARD, 100'000);
  ASSERT_EQ(steptrace_dropped(), 200'000 - kRing);
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    if (steptrace_dropped() != 0) _exit(1);
    spans(STEPTRACE_FORWARD, static_cast<int>(kRing / 2));  // fits only if the ring is empty
    if (steptrace_dropped() != 0) _exit(2);
    spans(STEPTRACE_FORWARD, 1);
    _exit(steptrace_dropped() == 2 ? 0 : 3);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(steptrace_dropped(), 200'000 - kRing);
}

}  // namespace
