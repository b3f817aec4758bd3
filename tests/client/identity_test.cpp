// identity_from_env (client/src/identity.h): which job and ranks a process says it has,
// from a map standing in for its environment. Precedence of the variables, empty values
// skipped, bad numbers and ranks outside the world refused with a line naming them.
#include "client/src/identity.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <ostream>
#include <string>
#include <vector>

namespace steptrace::client {
namespace {

using ::testing::HasSubstr;
using Env = std::map<std::string, std::string>;

struct Result {
  ProcessIdentity id;
  std::vector<std::string> problems;
};

Result from(const Env& env) {
  Result r;
  r.id = identity_from_env(
      [&env](const char* name) -> const char* {
        const auto it = env.find(name);
        return it == env.end() ? nullptr : it->second.c_str();
      },
      r.problems);
  return r;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

TEST(IdentityFromEnv, NothingSetIsNothingToSend) {
  const Result r = from({});
  EXPECT_EQ(r.id.job, "");
  EXPECT_EQ(r.id.rank, proto::kNoRank);
  EXPECT_EQ(r.id.local_rank, proto::kNoRank);
  EXPECT_EQ(r.id.world_size, 0u);
  EXPECT_FALSE(r.id.any());
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, UnrelatedVariablesAreIgnored) {
  const Result r = from({{"JOB", "x"}, {"JOB_ID", "y"}, {"PMI_RANK", "3"}, {"NODE_RANK", "1"}});
  EXPECT_FALSE(r.id.any());
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, EachPieceAloneIsSomethingToSend) {
  EXPECT_TRUE(from({{"STEPTRACE_JOB", "j"}}).id.any());
  EXPECT_TRUE(from({{"RANK", "0"}}).id.any());
  EXPECT_TRUE(from({{"LOCAL_RANK", "0"}}).id.any());
  EXPECT_TRUE(from({{"WORLD_SIZE", "1"}}).id.any());
}

TEST(IdentityFromEnv, JobIdPrecedence) {
  EXPECT_EQ(from({{"SLURM_JOB_ID", "4242"}}).id.job, "4242");
  EXPECT_EQ(from({{"TORCHELASTIC_RUN_ID", "te"}}).id.job, "te");
  EXPECT_EQ(from({{"TORCHELASTIC_RUN_ID", "te"}, {"SLURM_JOB_ID", "4242"}}).id.job, "te");
  EXPECT_EQ(from({{"STEPTRACE_JOB", "mine"}, {"SLURM_JOB_ID", "4242"}}).id.job, "mine");
  EXPECT_EQ(
      from({{"STEPTRACE_JOB", "mine"}, {"TORCHELASTIC_RUN_ID", "te"}, {"SLURM_JOB_ID", "4242"}})
          .id.job,
      "mine");
}

TEST(IdentityFromEnv, EmptyJobVariablesAreSkipped) {
  EXPECT_EQ(from({{"STEPTRACE_JOB", ""}, {"TORCHELASTIC_RUN_ID", "te"}}).id.job, "te");
  EXPECT_EQ(
      from({{"STEPTRACE_JOB", ""}, {"TORCHELASTIC_RUN_ID", ""}, {"SLURM_JOB_ID", "7"}}).id.job,
      "7");
  const Result none = from({{"STEPTRACE_JOB", ""}, {"TORCHELASTIC_RUN_ID", ""}});
  EXPECT_EQ(none.id.job, "");
  EXPECT_FALSE(none.id.any());
  EXPECT_TRUE(none.problems.empty()) << joined(none.problems);
}

TEST(IdentityFromEnv, JobIdIsKeptAsGiven) {
  // Cutting to 63 characters and replacing unprintable bytes is the wire encoder's job.
  const std::string long_id(100, 'j');
  EXPECT_EQ(from({{"STEPTRACE_JOB", long_id}}).id.job, long_id);
  EXPECT_EQ(from({{"STEPTRACE_JOB", " a b/c:d=e "}}).id.job, " a b/c:d=e ");
  EXPECT_EQ(from({{"STEPTRACE_JOB", "tab\there\x01"}}).id.job, "tab\there\x01");
  EXPECT_EQ(from({{"STEPTRACE_JOB", "-1"}}).id.job, "-1");
  EXPECT_TRUE(from({{"STEPTRACE_JOB", long_id}}).problems.empty());
}

TEST(IdentityFromEnv, TorchrunVariables) {
  const Result r = from(
      {{"TORCHELASTIC_RUN_ID", "run-1"}, {"RANK", "5"}, {"LOCAL_RANK", "1"}, {"WORLD_SIZE", "8"}});
  EXPECT_EQ(r.id.job, "run-1");
  EXPECT_EQ(r.id.rank, 5u);
  EXPECT_EQ(r.id.local_rank, 1u);
  EXPECT_EQ(r.id.world_size, 8u);
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, SlurmVariables) {
  const Result r = from({{"SLURM_JOB_ID", "123456"},
                         {"SLURM_PROCID", "3"},
                         {"SLURM_LOCALID", "0"},
                         {"SLURM_NTASKS", "4"}});
  EXPECT_EQ(r.id.job, "123456");
  EXPECT_EQ(r.id.rank, 3u);
  EXPECT_EQ(r.id.local_rank, 0u);
  EXPECT_EQ(r.id.world_size, 4u);
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, TorchVariablesWinOverSlurmOnes) {
  const Result r = from({{"RANK", "1"},
                         {"SLURM_PROCID", "2"},
                         {"LOCAL_RANK", "1"},
                         {"SLURM_LOCALID", "3"},
                         {"WORLD_SIZE", "2"},
                         {"SLURM_NTASKS", "16"}});
  EXPECT_EQ(r.id.rank, 1u);
  EXPECT_EQ(r.id.local_rank, 1u);
  EXPECT_EQ(r.id.world_size, 2u);
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, EmptyNumberVariablesAreSkipped) {
  const Result r = from({{"RANK", ""},
                         {"SLURM_PROCID", "2"},
                         {"LOCAL_RANK", ""},
                         {"SLURM_LOCALID", "3"},
                         {"WORLD_SIZE", ""},
                         {"SLURM_NTASKS", "16"}});
  EXPECT_EQ(r.id.rank, 2u);
  EXPECT_EQ(r.id.local_rank, 3u);
  EXPECT_EQ(r.id.world_size, 16u);
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);

  const Result all_empty = from({{"RANK", ""}, {"LOCAL_RANK", ""}, {"WORLD_SIZE", ""}});
  EXPECT_FALSE(all_empty.id.any());
  EXPECT_TRUE(all_empty.problems.empty()) << joined(all_empty.problems);
}

TEST(IdentityFromEnv, RankZeroAndTheLargestRankAreNumbers) {
  EXPECT_EQ(from({{"RANK", "0"}}).id.rank, 0u);
  EXPECT_EQ(from({{"RANK", "007"}}).id.rank, 7u);
  // Without a world size, any rank below kNoRank is kept.
  const Result max = from({{"RANK", "4294967294"}});
  EXPECT_EQ(max.id.rank, 4294967294u);
  EXPECT_TRUE(max.problems.empty()) << joined(max.problems);
  EXPECT_EQ(from({{"WORLD_SIZE", "4294967294"}}).id.world_size, 4294967294u);
}

// A value that is not a decimal number in range is not sent, and one line says which
// variable and what it held.
struct BadValue {
  const char* variable;
  const char* value;
};
// gtest looks the name up. NOLINTNEXTLINE(readability-identifier-naming)
void PrintTo(const BadValue& v, std::ostream* os) { *os << v.variable << "='" << v.value << "'"; }

class IdentityBadNumber : public ::testing::TestWithParam<BadValue> {};

TEST_P(IdentityBadNumber, IsRefusedWithALineNamingTheVariable) {
  const auto [variable, value] = GetParam();
  const Result r = from({{"STEPTRACE_JOB", "j"}, {variable, value}});
  const std::string name = variable;
  if (name == "RANK" || name == "SLURM_PROCID") {
    EXPECT_EQ(r.id.rank, proto::kNoRank);
  } else if (name == "LOCAL_RANK" || name == "SLURM_LOCALID") {
    EXPECT_EQ(r.id.local_rank, proto::kNoRank);
  } else {
    EXPECT_EQ(r.id.world_size, 0u);
  }
  EXPECT_EQ(r.id.job, "j");  // the rest is still sent
  ASSERT_EQ(r.problems.size(), 1u) << joined(r.problems);
  EXPECT_EQ(r.problems[0].rfind(name + "=", 0), 0u) << r.problems[0];
  EXPECT_THAT(r.problems[0], HasSubstr("not sent"));
}

INSTANTIATE_TEST_SUITE_P(
    Bad, IdentityBadNumber,
    ::testing::Values(BadValue{"RANK", "abc"}, BadValue{"RANK", "-1"}, BadValue{"RANK", "+1"},
                      BadValue{"RANK", " 1"}, BadValue{"RANK", "1 "}, BadValue{"RANK", "1x"},
                      BadValue{"RANK", "1\n"}, BadValue{"RANK", "0x10"}, BadValue{"RANK", "1.0"},
                      BadValue{"RANK", "1e3"}, BadValue{"RANK", "4294967295"},  // kNoRank itself
                      BadValue{"RANK", "4294967296"},                           // past 32 bits
                      BadValue{"RANK", "99999999999999999999"},                 // past 64 bits
                      BadValue{"RANK", "-"}, BadValue{"LOCAL_RANK", "one"},
                      BadValue{"LOCAL_RANK", "-3"}, BadValue{"WORLD_SIZE", "two"},
                      BadValue{"WORLD_SIZE", "-2"}, BadValue{"WORLD_SIZE", "18446744073709551616"},
                      BadValue{"SLURM_PROCID", "x"}, BadValue{"SLURM_LOCALID", "1,2"},
                      BadValue{"WORLD_SIZE", "0"},  // a world has at least one rank
                      BadValue{"SLURM_NTASKS", "0"}, BadValue{"SLURM_NTASKS", "4(x2)"}),
    [](const ::testing::TestParamInfo<BadValue>& info) {
      return std::string(info.param.variable) + "_" + std::to_string(info.index);
    });

TEST(IdentityFromEnv, ProblemLineShowsTheValue) {
  const Result r = from({{"RANK", "abc"}});
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_THAT(r.problems[0], HasSubstr("RANK='abc'"));
  EXPECT_FALSE(r.id.any());
}

TEST(IdentityFromEnv, ProblemLineIsPrintableAndShort) {
  const Result r = from({{"RANK", std::string("1\x1b[2J") + std::string(200, '9')}});
  ASSERT_EQ(r.problems.size(), 1u);
  const std::string& line = r.problems[0];
  EXPECT_EQ(line.find('\x1b'), std::string::npos) << line;
  for (const char c : line) EXPECT_TRUE(c >= 0x20 && c <= 0x7e) << line;
  EXPECT_LT(line.size(), 120u) << line;
  EXPECT_THAT(line, HasSubstr("RANK='1?[2J"));
}

TEST(IdentityFromEnv, ABadValueDoesNotFallBackToTheNextVariable) {
  // The first variable that is set is the one meant; a bad one is said, not replaced.
  const Result r = from({{"RANK", "x"}, {"SLURM_PROCID", "2"}});
  EXPECT_EQ(r.id.rank, proto::kNoRank);
  ASSERT_EQ(r.problems.size(), 1u) << joined(r.problems);
  EXPECT_EQ(r.problems[0].rfind("RANK=", 0), 0u) << r.problems[0];
}

TEST(IdentityFromEnv, EachBadVariableHasItsOwnLine) {
  const Result r = from({{"RANK", "a"}, {"LOCAL_RANK", "b"}, {"WORLD_SIZE", "c"}});
  EXPECT_FALSE(r.id.any());
  ASSERT_EQ(r.problems.size(), 3u) << joined(r.problems);
  const std::string all = joined(r.problems);
  EXPECT_THAT(all, HasSubstr("RANK='a'"));
  EXPECT_THAT(all, HasSubstr("LOCAL_RANK='b'"));
  EXPECT_THAT(all, HasSubstr("WORLD_SIZE='c'"));
}

TEST(IdentityFromEnv, RankAtOrPastTheWorldSizeIsDropped) {
  const Result r = from({{"RANK", "4"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "1"}});
  EXPECT_EQ(r.id.rank, proto::kNoRank);
  EXPECT_EQ(r.id.world_size, 4u);  // the world size itself is still sent
  EXPECT_EQ(r.id.local_rank, 1u);
  ASSERT_EQ(r.problems.size(), 1u) << joined(r.problems);
  EXPECT_THAT(r.problems[0], HasSubstr("rank 4"));
  EXPECT_THAT(r.problems[0], HasSubstr("world size 4"));

  const Result far = from({{"SLURM_PROCID", "100"}, {"SLURM_NTASKS", "2"}});
  EXPECT_EQ(far.id.rank, proto::kNoRank);
  EXPECT_EQ(far.id.world_size, 2u);
  ASSERT_EQ(far.problems.size(), 1u) << joined(far.problems);
  EXPECT_THAT(far.problems[0], HasSubstr("rank 100"));
}

TEST(IdentityFromEnv, LocalRankAtOrPastTheWorldSizeIsDropped) {
  const Result r = from({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "2"}});
  EXPECT_EQ(r.id.rank, 1u);
  EXPECT_EQ(r.id.local_rank, proto::kNoRank);
  EXPECT_EQ(r.id.world_size, 2u);
  ASSERT_EQ(r.problems.size(), 1u) << joined(r.problems);
  EXPECT_THAT(r.problems[0], HasSubstr("local rank 2"));
}

TEST(IdentityFromEnv, RanksBelowTheWorldSizeAreKept) {
  const Result r = from({{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "3"}});
  EXPECT_EQ(r.id.rank, 3u);
  EXPECT_EQ(r.id.local_rank, 3u);
  EXPECT_EQ(r.id.world_size, 4u);
  EXPECT_TRUE(r.problems.empty()) << joined(r.problems);
}

TEST(IdentityFromEnv, WithoutAUsableWorldSizeAnyRankIsKept) {
  const Result none = from({{"RANK", "1000"}});
  EXPECT_EQ(none.id.rank, 1000u);
  EXPECT_TRUE(none.problems.empty()) << joined(none.problems);
  // A bad world size is said once; the rank is not held against it.
  const Result bad = from({{"RANK", "1000"}, {"WORLD_SIZE", "many"}});
  EXPECT_EQ(bad.id.rank, 1000u);
  EXPECT_EQ(bad.id.world_size, 0u);
  ASSERT_EQ(bad.problems.size(), 1u) << joined(bad.problems);
  EXPECT_EQ(bad.problems[0].rfind("WORLD_SIZE=", 0), 0u) << bad.problems[0];
}

TEST(IdentityFromEnv, ReadsOnlyItsOwnVariables) {
  std::vector<std::string> asked;
  std::vector<std::string> problems;
  identity_from_env(
      [&asked](const char* name) -> const char* {
        asked.emplace_back(name);
        return nullptr;
      },
      problems);
  const std::vector<std::string> known = {"STEPTRACE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
                                          "RANK",          "SLURM_PROCID",        "LOCAL_RANK",
                                          "SLURM_LOCALID", "WORLD_SIZE",          "SLURM_NTASKS"};
  for (const std::string& name : asked) {
    EXPECT_NE(std::find(known.begin(), known.end(), name), known.end()) << name;
  }
  for (const std::string& name : known) {
    EXPECT_NE(std::find(asked.begin(), asked.end(), name), asked.end()) << name;
  }
}

}  // namespace
}  // namespace steptrace::client
