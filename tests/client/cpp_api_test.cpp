// The header-only C++ wrapper (steptrace.hpp), compiled as C++17 as users may, without
// a daemon: spans record (and count drops) through the C ABI.
#include <steptrace/steptrace.hpp>

#include <gtest/gtest.h>

#include <string>

namespace {

static_assert(__cplusplus == 201703L, "this test checks that the public headers are C++17");

TEST(CppApi, SpanAndInSpanRecordThroughTheCAbi) {
  // 8192 events fit in the thread's ring before any connection; count what overflows.
  for (int i = 0; i < 4096; ++i) steptrace::Span span(steptrace::Step::kForward);
  EXPECT_EQ(steptrace_dropped(), 0u);
  const int value = steptrace::in_span(steptrace::Step::kBackward, [] { return 42; });
  EXPECT_EQ(value, 42);
  EXPECT_EQ(steptrace_dropped(), 2u);  // ring full: that span's start and end
}

TEST(CppApi, RegisterStepIsStableAndRefusesBadNames) {
  const std::uint32_t id = steptrace::register_step("CppStep");
  EXPECT_NE(id, UINT32_MAX);
  EXPECT_EQ(steptrace::register_step("CppStep"), id);
  EXPECT_EQ(steptrace::register_step(std::string(100, 'x')), UINT32_MAX);
  EXPECT_EQ(steptrace::step_id(steptrace::Step::kLedgerRelease), 11u);
  { steptrace::Span span(id); }
  EXPECT_EQ(steptrace_dropped(), 0u);
  { steptrace::Span span(id + 1); }  // never registered: both events dropped and counted
  EXPECT_EQ(steptrace_dropped(), 2u);
}

}  // namespace
