// The grammars of proto/commands.h, which the daemon's command parser and the steptrace
// CLI both use: tested here once. (That the two sides agree at every bound is
// tests/cli/cli_trace_test.cpp's CliAndDaemonAgree.)
#include "proto/commands.h"

#include <gtest/gtest.h>

#include <steptrace/steptrace.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>

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

// `--job ID` or `--job UID:ID`: the uid is the digits before the first ':'; anything else
// is the caller's job id as it stands.
TEST(CommandsJob, IdOrUidColonId) {
  const auto parsed = [](std::string_view text) {
    const auto job = parse_job_option(text);
    return job ? std::optional<std::pair<std::optional<std::uint32_t>, std::string>>(
                     {job->uid, std::string(job->id)})
               : std::nullopt;
  };
  using Uid = std::optional<std::uint32_t>;
  EXPECT_EQ(parsed("team-llm"), std::make_pair(Uid{}, std::string("team-llm")));
  EXPECT_EQ(parsed("1001:team-llm"), std::make_pair(Uid{1001}, std::string("team-llm")));
  EXPECT_EQ(parsed("0:x"), std::make_pair(Uid{0}, std::string("x")));
  EXPECT_EQ(parsed("4294967295:x"), std::make_pair(Uid{4294967295u}, std::string("x")));
  EXPECT_EQ(parsed("0001001:x"), std::make_pair(Uid{1001}, std::string("x")));
  // The uid ends at the first ':'; the id may hold more.
  EXPECT_EQ(parsed("1001:12:30"), std::make_pair(Uid{1001}, std::string("12:30")));
  // A head that is not all digits: the whole value is an id.
  EXPECT_EQ(parsed("run:7"), std::make_pair(Uid{}, std::string("run:7")));
  EXPECT_EQ(parsed(":x"), std::make_pair(Uid{}, std::string(":x")));
  EXPECT_EQ(parsed("-1:x"), std::make_pair(Uid{}, std::string("-1:x")));
  EXPECT_EQ(parsed("4242"), std::make_pair(Uid{}, std::string("4242")));  // SLURM_JOB_ID
  EXPECT_EQ(parsed(std::string(63, 'j')), std::make_pair(Uid{}, std::string(63, 'j')));
  EXPECT_EQ(parsed("7:" + std::string(63, 'j')), std::make_pair(Uid{7}, std::string(63, 'j')));
  for (const std::string& bad :
       {std::string(), std::string(64, 'j'), "7:" + std::string(64, 'j'), std::string("1001:"),
        std::string("4294967296:x"), std::string("99999999999:x"), std::string("a b"),
        std::string("tab\there"), std::string("x\x7f"), std::string("\xE2\x80\xAE")}) {
    EXPECT_FALSE(parse_job_option(bad).has_value()) << bad;
  }
}

// The public C header spells the default socket too (client.cpp checks it at build time
// as well; this names the two in a test).
TEST(CommandsSocket, DefaultSocketIsTheCHeaders) {
  EXPECT_EQ(std::string_view(kDefaultSocketPath), std::string_view(STEPTRACE_DEFAULT_SOCKET));
}

}  // namespace
}  // namespace steptrace::proto
