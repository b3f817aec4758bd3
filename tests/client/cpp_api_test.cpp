// The header-only C++ wrapper (steptrace.hpp), compiled as C++17 as users may, without
// a daemon: spans record (and count drops) through the C ABI.
#include <steptrace/steptrace.hpp>

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <thread>

namespace {

static_assert(__cplusplus == 201703L, "this test checks that the public headers are C++17");

// The first event auto-connects to $STEPTRACE_SOCKET (read then): an absent path, so a
// daemon running on this machine never gets these events and "no daemon" holds.
[[maybe_unused]] const int kAbsentSocketEnv =
    ::setenv("STEPTRACE_SOCKET", "/nonexistent-steptrace-dir/steptraced.sock", 1);

// steptrace_dropped() counts for the whole process, and each thread's ring keeps what it
// recorded (no daemon drains it): each test records on a fresh thread, with an empty
// ring of its own, and measures the counter's change. So the tests hold in any order,
// repeated, or with the binary run directly rather than one test per process.
template <class F>
void on_fresh_thread(F f) {
  std::thread(f).join();
}

TEST(CppApi, SpanAndInSpanRecordThroughTheCAbi) {
  std::uint64_t after_fill = 0, after_in_span = 0, unconnected = 0;
  int value = 0;
  // Fresh threads get 64 KiB rings: 4096 events fit before any connection; count what
  // overflows.
  ASSERT_EQ(steptrace_set_buffer_size(64 * 1024, 0), 0);
  on_fresh_thread([&] {
    const std::uint64_t before = steptrace_dropped();
    const std::uint64_t unconnected_before =
        steptrace_dropped_by_cause(STEPTRACE_DROP_NOT_CONNECTED);
    for (int i = 0; i < 2048; ++i) steptrace::Span span(steptrace::Step::kForward);
    after_fill = steptrace_dropped() - before;
    value = steptrace::in_span(steptrace::Step::kBackward, [] { return 42; });
    after_in_span = steptrace_dropped() - before;
    unconnected = steptrace_dropped_by_cause(STEPTRACE_DROP_NOT_CONNECTED) - unconnected_before;
  });
  EXPECT_EQ(after_fill, 0u);
  EXPECT_EQ(value, 42);
  EXPECT_EQ(after_in_span, 2u);  // ring full: that span's start and end
  EXPECT_EQ(unconnected, 2u);    // no daemon: counted as not_connected
}

TEST(CppApi, RegisterStepIsStableAndRefusesBadNames) {
  const std::uint32_t id = steptrace::register_step("CppStep");
  EXPECT_NE(id, UINT32_MAX);
  EXPECT_EQ(steptrace::register_step("CppStep"), id);
  EXPECT_EQ(steptrace::register_step(std::string(100, 'x')), UINT32_MAX);
  EXPECT_EQ(steptrace::step_id(steptrace::Step::kLedgerRelease), 11u);
  std::uint64_t registered = 0, unregistered = 0;
  on_fresh_thread([&] {
    const std::uint64_t before = steptrace_dropped();
    { steptrace::Span span(id); }
    registered = steptrace_dropped() - before;
    { steptrace::Span span(id + 1); }  // never registered: both events dropped and counted
    unregistered = steptrace_dropped() - before;
  });
  EXPECT_EQ(registered, 0u);
  EXPECT_EQ(unregistered, 2u);
  EXPECT_GE(steptrace_dropped_by_cause(STEPTRACE_DROP_INVALID), 2u);
}

// Bad arguments have a count of their own, beside the drops: a refused registration
// (which records nothing) too.
TEST(CppApi, RejectedCallsAreCountedApart) {
  const std::uint64_t before = steptrace_rejected();
  const std::uint64_t invalid_before = steptrace_dropped_by_cause(STEPTRACE_DROP_INVALID);
  EXPECT_EQ(steptrace_register_step(nullptr), UINT32_MAX);
  EXPECT_EQ(steptrace_register_step(""), UINT32_MAX);
  EXPECT_EQ(steptrace_register_step("tab\there"), UINT32_MAX);
  EXPECT_EQ(steptrace_rejected() - before, 3u);
  // Registrations record no event: nothing dropped for them.
  EXPECT_EQ(steptrace_dropped_by_cause(STEPTRACE_DROP_INVALID), invalid_before);
  on_fresh_thread([] {
    steptrace_start(9999);  // neither built-in nor registered
    steptrace_end(9999);
  });
  steptrace_ledger_release(nullptr, 1);
  EXPECT_EQ(steptrace_rejected() - before, 6u);
  EXPECT_EQ(steptrace_dropped_by_cause(STEPTRACE_DROP_INVALID) - invalid_before, 3u);
  // Good calls are not counted.
  EXPECT_NE(steptrace_register_step("GoodName"), UINT32_MAX);
  EXPECT_EQ(steptrace_rejected() - before, 6u);
}

}  // namespace
