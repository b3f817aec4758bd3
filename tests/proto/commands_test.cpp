// The grammars of proto/commands.h, which the daemon's command parser and the steptrace
// CLI both use: tested here once. (That the two sides agree at every bound is
// tests/cli/cli_trace_test.cpp's CliAndDaemonAgree.)
#include "proto/commands.h"

#include <gtest/gtest.h>

#include <steptrace/steptrace.h>

#include <string>
#include <string_view>

namespace steptrace::proto {
namespace {

TEST(CommandsSeconds, DigitsWithAnOptionalFraction) {
  EXPECT_EQ(parse_seconds("30"), 30.0);
  EXPECT_EQ(parse_seconds("2.5"), 2.5);
  EXPECT_EQ(parse_seconds("0"), 0.0);
  EXPECT_EQ(parse_seconds("007.250"), 7.25);
  EXPECT_EQ(parse_seconds("0.001"), 0.001);
  EXPECT_EQ(parse_seconds("12345678901234567890"), 12345678901234567890.0);  // 20 characters
  for (const char* bad : {"", "-1", "+1", ".5", "5.", ".", "1e3", "1E3", "1.2.3", "abc", " 1", "1 ",
                          "0x10", "inf", "nan", "1,5", "123456789012345678901"}) {
    EXPECT_FALSE(parse_seconds(bad).has_value()) << bad;
  }
  // Not NUL-terminated: only the view's characters count.
  EXPECT_EQ(parse_seconds(std::string_view("2.5x", 3)), 2.5);
}

TEST(CommandsSeconds, BoundedAreMoreThanZeroAndAtMostMax) {
  EXPECT_FALSE(parse_seconds("0", 10).has_value());
  EXPECT_FALSE(parse_seconds("0.000", 10).has_value());
  EXPECT_EQ(parse_seconds("0.001", 10), 0.001);
  EXPECT_EQ(parse_seconds("10", 10), 10.0);
  EXPECT_EQ(parse_seconds("10.000", 10), 10.0);
  EXPECT_FALSE(parse_seconds("10.001", 10).has_value());
  EXPECT_FALSE(parse_seconds("1e1", 10).has_value());  // the grammar first
}

TEST(CommandsPid, DecimalInOneToInt32Max) {
  EXPECT_EQ(parse_pid("1"), 1);
  EXPECT_EQ(parse_pid("4242"), 4242);
  EXPECT_EQ(parse_pid("010"), 10);  // decimal, not octal
  EXPECT_EQ(parse_pid("2147483647"), kMaxPid);
  EXPECT_EQ(kMaxPid, 2147483647);
  for (const char* bad : {"", "0", "-1", "+1", " 1", "1 ", "0x10", "1.0", "abc", "2147483648",
                          "99999999999999999999999"}) {
    EXPECT_FALSE(parse_pid(bad).has_value()) << bad;
  }
}

// The public C header spells the default socket too (client.cpp checks it at build time
// as well; this names the two in a test).
TEST(CommandsSocket, DefaultSocketIsTheCHeaders) {
  EXPECT_EQ(std::string_view(kDefaultSocketPath), std::string_view(STEPTRACE_DEFAULT_SOCKET));
}

}  // namespace
}  // namespace steptrace::proto
