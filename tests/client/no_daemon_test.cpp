// The C ABI without a daemon: nothing blocks, and everything that could not be kept is
// counted by steptrace_dropped() and, per cause, steptrace_dropped_by_cause(). Each test
// runs in its own process (gtest discovery), so the library's per-process state starts
// fresh.
#include <limits.h>
#include <steptrace/steptrace.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <barrier>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"

namespace {

using Clock = std::chrono::steady_clock;

// The default per-thread ring: 4 MiB of 16-byte records (client/src/ring_budget.h).
constexpr std::uint64_t kRing = 262'144;
constexpr std::uint64_t kKiB = 1024;
constexpr std::uint64_t kMiB = 1024 * kKiB;
constexpr const char* kAbsent = "/nonexistent-steptrace-dir/steptraced.sock";

// The library connects by itself at the first event (auto-connect) to $STEPTRACE_SOCKET,
// read then: point it at an absent path, so no daemon running on this machine at the
// default path ever gets these tests' events. Set before main, before any event.
[[maybe_unused]] const int kAbsentSocketEnv = ::setenv("STEPTRACE_SOCKET", kAbsent, 1);

void spans(std::uint32_t step, int n) {
  for (int i = 0; i < n; ++i) {
    steptrace_start(step);
    steptrace_end(step);
  }
}

std::uint64_t by_cause(int cause) { return steptrace_dropped_by_cause(cause); }

// steptrace_dropped() is the sum of the four causes.
void expect_sum_of_causes() {
  std::uint64_t sum = 0;
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) sum += by_cause(c);
  EXPECT_EQ(steptrace_dropped(), sum);
}

// How many events a fresh thread's ring holds: it records `tries` events with no daemon
// and counts what was not dropped.
std::uint64_t fresh_thread_capacity(std::uint64_t tries) {
  std::uint64_t kept = 0;
  std::thread([&] {
    const std::uint64_t before = steptrace_dropped();
    for (std::uint64_t i = 0; i < tries; ++i) steptrace_start(STEPTRACE_FORWARD);
    kept = tries - (steptrace_dropped() - before);
  }).join();
  return kept;
}

TEST(NoDaemon, SpansBeforeConnectKeepWhatFitsAndCountTheRestAsNotConnected) {
  spans(STEPTRACE_FORWARD, 200'000);
  EXPECT_EQ(steptrace_dropped(), 400'000 - kRing);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 400'000 - kRing);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_BUFFER_FULL), 0u);
  expect_sum_of_causes();
  // The first event auto-connected: the flush makes one attempt and fails at once.
  const auto t0 = Clock::now();
  EXPECT_EQ(steptrace_flush(10'000), -ENOTCONN);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
}

// A flush before anything started the flusher (no event, no connect) fails at once.
TEST(NoDaemon, FlushBeforeAnyEventFailsAtOnce) {
  const auto t0 = Clock::now();
  EXPECT_EQ(steptrace_flush(10'000), -ENOTCONN);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
}

TEST(NoDaemon, AbsentDaemonConnectFailsAndNothingBlocks) {
  EXPECT_EQ(steptrace_connect(kAbsent), -ENOENT);
  steptrace_set_block_when_full(1);  // no connection: a full ring must still not wait
  const auto t0 = Clock::now();
  spans(STEPTRACE_MATMUL, 200'000);
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(5));  // generous: only a wait fails it
  EXPECT_EQ(steptrace_dropped(), 400'000 - kRing);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 400'000 - kRing);
  EXPECT_EQ(steptrace_flush(20), -ENOTCONN);
  steptrace_shutdown();
}

// With the flusher running but no daemon, a flush fails after one immediate connection
// attempt, not at its timeout.
TEST(NoDaemon, FlushWithoutADaemonFailsPromptly) {
  EXPECT_EQ(steptrace_connect(kAbsent), -ENOENT);
  spans(STEPTRACE_FORWARD, 10);
  for (int i = 0; i < 3; ++i) {
    const auto t0 = Clock::now();
    EXPECT_EQ(steptrace_flush(10'000), -ENOTCONN);
    EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  }
  // Several threads at once.
  std::vector<std::thread> pool;
  std::array<int, 4> rc{};
  const auto t0 = Clock::now();
  for (int& r : rc) pool.emplace_back([&r] { r = steptrace_flush(10'000); });
  for (auto& t : pool) t.join();
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(1));
  for (const int r : rc) EXPECT_EQ(r, -ENOTCONN);
  steptrace_shutdown();
  EXPECT_EQ(steptrace_flush(10'000), -ENOTCONN);  // no flusher at all: at once
}

TEST(NoDaemon, RingCapacityFollowsSetBufferSize) {
  steptrace_start(STEPTRACE_FORWARD);  // this thread's ring: the default size
  // A new thread's: the default too, 4 MiB.
  EXPECT_EQ(fresh_thread_capacity(kRing + 1000), kRing);
  EXPECT_EQ(steptrace_set_buffer_size(64 * kKiB, 0), 0);
  EXPECT_EQ(fresh_thread_capacity(10'000), 4096u);
  EXPECT_EQ(steptrace_set_buffer_size(100 * kKiB, 0), 0);  // rounded down: 64 KiB
  EXPECT_EQ(fresh_thread_capacity(10'000), 4096u);
  EXPECT_EQ(steptrace_set_buffer_size(1 * kMiB, 0), 0);
  EXPECT_EQ(fresh_thread_capacity(100'000), 65536u);
  // Out of range: -EINVAL and nothing changes.
  EXPECT_EQ(steptrace_set_buffer_size(32 * kKiB, 0), -EINVAL);
  EXPECT_EQ(steptrace_set_buffer_size(2048 * kMiB, 0), -EINVAL);
  EXPECT_EQ(steptrace_set_buffer_size(1 * kMiB, 1 * kKiB), -EINVAL);
  EXPECT_EQ(steptrace_set_buffer_size(64 * kKiB, 1ull << 41), -EINVAL);
  EXPECT_EQ(fresh_thread_capacity(100'000), 65536u);
  EXPECT_EQ(steptrace_set_buffer_size(0, 0), 0);  // keeps both
  EXPECT_EQ(fresh_thread_capacity(100'000), 65536u);
  // The ring this thread got before the calls keeps its size.
  const std::uint64_t before = steptrace_dropped();
  for (std::uint64_t i = 1; i < kRing + 10; ++i) steptrace_start(STEPTRACE_FORWARD);
  EXPECT_EQ(steptrace_dropped() - before, 10u);
  expect_sum_of_causes();
}

// A thread past the total gets a smaller ring, or none: then its events count as
// buffer_full, and nothing waits.
TEST(NoDaemon, BudgetExhaustionGivesSmallerOrNoRingsAndNeverBlocks) {
  ASSERT_EQ(steptrace_set_buffer_size(1 * kMiB, 2 * kMiB + 512 * kKiB), 0);
  constexpr int kThreads = 4;
  constexpr std::uint64_t kTries = 100'000;
  std::barrier done(kThreads + 1);  // the threads keep their rings until all have run
  std::atomic<int> recorded{0};
  std::array<std::uint64_t, kThreads> kept{}, full{}, unconnected{};
  std::vector<std::thread> pool;
  const auto t0 = Clock::now();
  for (int t = 0; t < kThreads; ++t) {
    pool.emplace_back([&, t] {
      const std::uint64_t full0 = by_cause(STEPTRACE_DROP_BUFFER_FULL);
      const std::uint64_t unconnected0 = by_cause(STEPTRACE_DROP_NOT_CONNECTED);
      for (std::uint64_t i = 0; i < kTries; ++i) steptrace_start(STEPTRACE_FORWARD);
      full[t] = by_cause(STEPTRACE_DROP_BUFFER_FULL) - full0;
      unconnected[t] = by_cause(STEPTRACE_DROP_NOT_CONNECTED) - unconnected0;
      kept[t] = kTries - full[t] - unconnected[t];
      recorded.fetch_add(1);
      done.arrive_and_wait();
    });
    // One at a time, so the order of the rings is known.
    while (recorded.load() < t + 1) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  done.arrive_and_wait();
  for (auto& th : pool) th.join();
  // Generous: only a wait fails it.
  EXPECT_LT(Clock::now() - t0, std::chrono::seconds(10));
  EXPECT_EQ(kept[0], 65536u);  // 1 MiB
  EXPECT_EQ(kept[1], 65536u);  // 1 MiB
  EXPECT_EQ(kept[2], 32768u);  // the 512 KiB left
  EXPECT_EQ(kept[3], 0u);      // nothing left: no ring
  for (int t = 0; t < 3; ++t) {
    EXPECT_EQ(full[t], 0u) << t;  // their rings filled while not connected
    EXPECT_EQ(unconnected[t], kTries - kept[t]) << t;
  }
  EXPECT_EQ(full[3], kTries);  // no ring: buffer_full
  EXPECT_EQ(unconnected[3], 0u);
  expect_sum_of_causes();
}

// A thread refused a ring gets one once the budget allows (here: a larger total).
TEST(NoDaemon, ThreadWithoutRingGetsOneWhenRoomReturns) {
  ASSERT_EQ(steptrace_set_buffer_size(64 * kKiB, 64 * kKiB), 0);
  spans(STEPTRACE_FORWARD, 1);  // this thread takes the whole budget
  std::uint64_t refused = 0, later = 0;
  std::thread([&] {
    const std::uint64_t full0 = by_cause(STEPTRACE_DROP_BUFFER_FULL);
    spans(STEPTRACE_FORWARD, 10);
    refused = by_cause(STEPTRACE_DROP_BUFFER_FULL) - full0;
    ASSERT_EQ(steptrace_set_buffer_size(0, 128 * kKiB), 0);
    const std::uint64_t full1 = by_cause(STEPTRACE_DROP_BUFFER_FULL);
    spans(STEPTRACE_FORWARD, 10);
    later = by_cause(STEPTRACE_DROP_BUFFER_FULL) - full1;
  }).join();
  EXPECT_EQ(refused, 20u);
  EXPECT_EQ(later, 0u);
  expect_sum_of_causes();
}

// Without a daemon, the rings of exited threads give way to a live thread: the oldest
// is freed and its events counted under not_connected.
TEST(NoDaemon, ExitedThreadsRingsGiveWayToLiveThreadsWhenNotConnected) {
  ASSERT_EQ(steptrace_set_buffer_size(1 * kMiB, 1 * kMiB), 0);
  std::thread([] { spans(STEPTRACE_BACKWARD, 5); }).join();  // exits holding the budget
  EXPECT_EQ(steptrace_dropped(), 0u);
  // The new thread gets the full 1 MiB (65,536 events); its first event freed the exited
  // thread's ring, whose 10 events count as dropped during its run.
  EXPECT_EQ(fresh_thread_capacity(100'000), 65536u - 10u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 10u + (100'000 - 65'536));
  EXPECT_EQ(by_cause(STEPTRACE_DROP_BUFFER_FULL), 0u);
  expect_sum_of_causes();
}

// STEPTRACE_BUFFER_BYTES / STEPTRACE_BUFFER_TOTAL_BYTES are read at load: this test
// runs the binary again with them set. In that child, env_child_check() (below) runs
// before main: it checks the capacity $STEPTRACE_TEST_EXPECT_RECORDS gives, prints what
// differs and exits, so the child runs no test of its own.
std::string run_child(const std::string& env) {
  char self[PATH_MAX] = {};
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return "readlink failed";
  const std::string cmd =
      env + " '" + std::string(self, static_cast<std::size_t>(n)) + "' 2>&1; echo \"exit=$?\"";
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return "popen failed";
  char buf[4096];
  std::size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  ::pclose(p);
  return out;
}

int env_child_check() {
  const char* expect = std::getenv("STEPTRACE_TEST_EXPECT_RECORDS");
  if (expect == nullptr) return 0;  // the normal test binary
  bool ok = true;
  const std::uint64_t records = std::strtoull(expect, nullptr, 10);
  const std::uint64_t first = fresh_thread_capacity(records + 1000);
  if (first != records) {
    std::printf("first ring: %llu records, want %llu\n", static_cast<unsigned long long>(first),
                static_cast<unsigned long long>(records));
    ok = false;
  }
  if (const char* second = std::getenv("STEPTRACE_TEST_EXPECT_SECOND")) {
    // The total allows only part of a second ring while the first is in use.
    std::barrier hold(2);
    std::thread holder([&] {
      steptrace_start(STEPTRACE_FORWARD);
      hold.arrive_and_wait();
      hold.arrive_and_wait();
    });
    hold.arrive_and_wait();
    const std::uint64_t got = fresh_thread_capacity(records + 1000);
    hold.arrive_and_wait();
    holder.join();
    if (got != std::strtoull(second, nullptr, 10)) {
      std::printf("second ring: %llu records, want %s\n", static_cast<unsigned long long>(got),
                  second);
      ok = false;
    }
  }
  std::fflush(stdout);
  std::_Exit(ok ? 0 : 1);
}
[[maybe_unused]] const int kEnvChild = env_child_check();

// The first-contact notice: in a child run with $STEPTRACE_TEST_RECORD_MS set (stderr
// captured with stdout by run_child), record spans for that long, never calling
// steptrace_connect, across several reconnect attempts (10, 20, 40, 80 ms ...), then
// exit. $STEPTRACE_TEST_AS_NOBODY=1: first drop to uid/gid 65534 (the test runs as
// root, to whom socket permissions do not apply).
int record_child() {
  const char* ms = std::getenv("STEPTRACE_TEST_RECORD_MS");
  if (ms == nullptr) return 0;
  if (std::getenv("STEPTRACE_TEST_AS_NOBODY") != nullptr &&
      (::setresgid(65534, 65534, 65534) != 0 || ::setresuid(65534, 65534, 65534) != 0)) {
    std::printf("setresuid failed\n");
    std::_Exit(3);
  }
  if (const char* path = std::getenv("STEPTRACE_TEST_SOCKET")) {
    ::setenv("STEPTRACE_SOCKET", path, 1);
  }
  if (std::getenv("STEPTRACE_TEST_VANISH") != nullptr) {
    // A daemon that accepts the connection (into its backlog) and then vanishes: the
    // library's reconnections fail from then on, yet it did reach one once.
    const char* path = std::getenv("STEPTRACE_TEST_SOCKET");
    const int listener = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path);
    const bool listening = ::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                           ::listen(listener, 4) == 0;
    const bool connected = listening && steptrace_connect(path) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    ::close(listener);
    ::unlink(path);
    std::printf("connected first: %d\n", connected ? 1 : 0);
  }
  if (std::getenv("STEPTRACE_TEST_EXPLICIT") != nullptr) {
    // Two failing explicit connects, each starting a new flusher: one notice.
    const bool failed = steptrace_connect(nullptr) == -ENOENT;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const bool again = steptrace_connect(nullptr) == -ENOENT;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::printf("explicit connects failed: %d\n", failed && again ? 1 : 0);
  }
  const auto until = Clock::now() + std::chrono::milliseconds(std::atoi(ms));
  while (Clock::now() < until) {
    spans(STEPTRACE_FORWARD, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  std::fflush(stdout);
  std::_Exit(0);
}
[[maybe_unused]] const int kRecordChild = record_child();

std::size_t occurrences(const std::string& text, const std::string& what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) {
    ++n;
  }
  return n;
}

TEST(FirstContact, MissingSocketIsReportedOnceOnStderr) {
  const std::string out = run_child("STEPTRACE_TEST_RECORD_MS=300");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_EQ(occurrences(out, "steptrace: cannot connect to"), 1u) << out;
  EXPECT_EQ(occurrences(out, std::string("cannot connect to ") + kAbsent + ": "), 1u) << out;
  EXPECT_NE(out.find("is steptraced running?"), std::string::npos) << out;
  EXPECT_NE(out.find("STEPTRACE_QUIET=1"), std::string::npos) << out;
}

TEST(FirstContact, QuietSilencesTheNotice) {
  const std::string out = run_child("STEPTRACE_QUIET=1 STEPTRACE_TEST_RECORD_MS=300");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_EQ(out.find("steptrace:"), std::string::npos) << out;
}

// An explicit steptrace_connect that fails gets the same notice, once, and a later
// failing connect (or reconnect) does not repeat it.
TEST(FirstContact, ExplicitConnectFailureIsReportedOnce) {
  const std::string out = run_child("STEPTRACE_TEST_EXPLICIT=1 STEPTRACE_TEST_RECORD_MS=100");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_NE(out.find("explicit connects failed: 1"), std::string::npos) << out;
  EXPECT_EQ(occurrences(out, "steptrace: cannot connect to"), 1u) << out;
}

// The notice is about first contact: a process that reached a daemon once says nothing
// when its reconnections fail later (the daemon restarting, or gone).
TEST(FirstContact, ReconnectionsThatFailAfterAContactSayNothing) {
  steptrace::testing::TempDir dir;
  const std::string out = run_child("STEPTRACE_TEST_SOCKET='" + dir.file("v.sock") +
                                    "' STEPTRACE_TEST_VANISH=1 STEPTRACE_TEST_RECORD_MS=300");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_NE(out.find("connected first: 1"), std::string::npos) << out;
  EXPECT_EQ(occurrences(out, "steptrace: cannot connect to"), 0u) << out;
}

TEST(FirstContact, PermissionDeniedGivesTheGroupHint) {
  steptrace::testing::TempDir dir;
  const std::string path = dir.file("d.sock");
  // A socket file nobody listens on; connect() checks write permission on it first.
  const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof addr.sun_path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  std::string env = "STEPTRACE_TEST_SOCKET='" + path + "' STEPTRACE_TEST_RECORD_MS=100";
  if (::geteuid() == 0) {
    // Root passes permission checks: the child drops to nobody, who may enter the
    // directory but not write the socket.
    ASSERT_EQ(::chmod(dir.path().c_str(), 0755), 0);
    ASSERT_EQ(::chmod(path.c_str(), 0600), 0);
    env += " STEPTRACE_TEST_AS_NOBODY=1";
  } else {
    ASSERT_EQ(::chmod(path.c_str(), 0), 0);
  }
  const std::string out = run_child(env);
  ::close(fd);
  if (out.find("setresuid failed") != std::string::npos) {
    GTEST_SKIP() << "running as root and cannot switch to uid 65534: " << out;
  }
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_EQ(occurrences(out, "steptrace: cannot connect to " + path + ": "), 1u) << out;
  EXPECT_NE(out.find("is this user in the steptrace group?"), std::string::npos) << out;
}

TEST(NoDaemon, BufferSizeFromEnvironment) {
  // STEPTRACE_QUIET=1: without it the first-contact notice (no daemon) would be printed.
  std::string out =
      run_child("STEPTRACE_QUIET=1 STEPTRACE_BUFFER_BYTES=128K STEPTRACE_TEST_EXPECT_RECORDS=8192");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_EQ(out.find("steptrace:"), std::string::npos) << out;  // no complaint
  out = run_child("STEPTRACE_BUFFER_BYTES=2097152 STEPTRACE_TEST_EXPECT_RECORDS=131072");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  out = run_child(
      "STEPTRACE_BUFFER_BYTES=1M STEPTRACE_BUFFER_TOTAL_BYTES=1536K "
      "STEPTRACE_TEST_EXPECT_RECORDS=65536 STEPTRACE_TEST_EXPECT_SECOND=32768");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  // A bad value: one line on stderr naming the variable, and the default.
  out = run_child("STEPTRACE_BUFFER_BYTES=lots STEPTRACE_TEST_EXPECT_RECORDS=262144");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_NE(out.find("STEPTRACE_BUFFER_BYTES=lots"), std::string::npos) << out;
  out = run_child("STEPTRACE_BUFFER_TOTAL_BYTES=1K STEPTRACE_TEST_EXPECT_RECORDS=262144");
  EXPECT_NE(out.find("exit=0"), std::string::npos) << out;
  EXPECT_NE(out.find("STEPTRACE_BUFFER_TOTAL_BYTES=1K"), std::string::npos) << out;
}

TEST(NoDaemon, EnvironmentSocketIsUsedWhenPathIsNull) {
  ASSERT_EQ(setenv("STEPTRACE_SOCKET", kAbsent, 1), 0);
  EXPECT_EQ(steptrace_connect(nullptr), -ENOENT);
  steptrace_shutdown();
}

TEST(NoDaemon, UnknownStepsAreDroppedAndCountedAsInvalid) {
  steptrace_start(12);
  steptrace_start(5000);
  steptrace_end(UINT32_MAX);
  steptrace_start(256);  // not registered yet
  EXPECT_EQ(steptrace_dropped(), 4u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_INVALID), 4u);
  const std::uint32_t id = steptrace_register_step("Tokenize");
  EXPECT_EQ(id, 256u);
  steptrace_start(id);
  steptrace_end(id);
  EXPECT_EQ(steptrace_dropped(), 4u);
  expect_sum_of_causes();
  // Unknown causes read as 0.
  EXPECT_EQ(steptrace_dropped_by_cause(-1), 0u);
  EXPECT_EQ(steptrace_dropped_by_cause(STEPTRACE_DROP_CAUSE_COUNT), 0u);
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
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 2u);
}

TEST(NoDaemon, AfterShutdownRecordingIsCountedUntilConnectAgain) {
  EXPECT_NE(steptrace_connect(kAbsent), 0);
  steptrace_shutdown();
  spans(STEPTRACE_ALLOC, 5);
  steptrace_start(4000);  // after shutdown even an unknown step is just "not connected"
  steptrace_ledger_release("GPU-0", 1);
  EXPECT_EQ(steptrace_dropped(), 12u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 12u);
  EXPECT_NE(steptrace_connect(kAbsent), 0);
  spans(STEPTRACE_ALLOC, 5);
  EXPECT_EQ(steptrace_dropped(), 12u);
  steptrace_shutdown();
}

TEST(NoDaemon, LedgerQueueIsBoundedAndBadAnnotationsCounted) {
  steptrace_ledger_reserve(nullptr, 1, 10, "task");
  steptrace_ledger_release("", 1);
  EXPECT_EQ(steptrace_dropped(), 2u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_INVALID), 2u);
  for (int i = 0; i < 2000; ++i) steptrace_vram_sample("GPU-0", 1, 2);
  EXPECT_EQ(steptrace_dropped(), 2u + (2000 - 1024));  // queue bound: 1024
  // Full while no daemon is connected: not_connected.
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), 2000u - 1024u);
  expect_sum_of_causes();
}

TEST(NoDaemon, ExitedThreadsKeepABoundedNumberOfRings) {
  for (int t = 0; t < 100; ++t) std::thread([] { spans(STEPTRACE_BACKWARD, 5); }).join();
  // 64 exited threads' rings are kept for a later connection; older ones are counted.
  EXPECT_EQ(steptrace_dropped(), (100u - 64u) * 10u);
  EXPECT_EQ(by_cause(STEPTRACE_DROP_NOT_CONNECTED), (100u - 64u) * 10u);
}

TEST(NoDaemon, ForkChildStartsWithZeroDropsAndEmptyBuffers) {
  spans(STEPTRACE_FORWARD, 200'000);
  ASSERT_EQ(steptrace_dropped(), 400'000 - kRing);
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
  EXPECT_EQ(steptrace_dropped(), 400'000 - kRing);
}

}  // namespace
