// Rank skew on synthetic ranks (daemon/state/rank_skew.h): one slow rank is named, one
// slow iteration is not, a waiting step reads the other way round. The rank windows that
// feed it over `--window`: rank_window_test.cpp.
#include <cmath>
#include <limits>
#include <vector>

#include <gtest/gtest.h>

#include "daemon/state/rank_skew.h"

namespace steptrace::daemon {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// `ranks` ranks of `spans` spans of `mean_ns` each, their median span the same.
std::vector<RankStepInput> alike(std::uint32_t ranks, std::uint64_t spans, double mean_ns) {
  std::vector<RankStepInput> out;
  for (std::uint32_t r = 0; r < ranks; ++r) {
    out.push_back({r, spans, static_cast<std::uint64_t>(mean_ns) * spans, {mean_ns}});
  }
  return out;
}

TEST(RankSkewTest, OneSlowRankIsNamedWithItsRatioToTheMedian) {
  auto ranks = alike(8, 100, 10e6);
  ranks[3].total_ns = 100 * 20'000'000;  // twice as slow, every iteration
  ranks[3].pieces = {20e6};
  ranks[5].total_ns = 100 * 10'300'000;  // a little slower: within the spread
  ranks[5].pieces = {10.3e6};
  const auto skew = step_skew("Forward", false, ranks, RankSkewRules{});
  ASSERT_TRUE(skew);
  EXPECT_DOUBLE_EQ(skew->median_ns, 10e6);
  EXPECT_EQ(skew->slowest.rank, 3u);
  EXPECT_DOUBLE_EQ(skew->slowest.ratio, 2.0);
  EXPECT_DOUBLE_EQ(skew->fastest.ratio, 1.0);
  ASSERT_TRUE(skew->straggler);
  EXPECT_EQ(skew->straggler->rank, 3u);
  EXPECT_EQ(skew->ranks.size(), 8u);
}

TEST(RankSkewTest, OneSlowIterationIsNotAStraggler) {
  // Rank 2 had one iteration of 1 s among 10 of 10 ms: its mean is 10x the others', its
  // median span is not.
  auto ranks = alike(4, 10, 10e6);
  ranks[2].total_ns = 9 * 10'000'000 + 1'000'000'000;
  const auto skew = step_skew("Forward", false, ranks, RankSkewRules{});
  ASSERT_TRUE(skew);
  EXPECT_EQ(skew->slowest.rank, 2u);
  EXPECT_GT(skew->slowest.ratio, 5.0);
  EXPECT_FALSE(skew->straggler);
  // Over a window: slow in one sample interval of six is not sustained either...
  for (auto& r : ranks) r.pieces = {10e6, 10e6, 10e6, 10e6, 10e6, 10e6};
  ranks[2].pieces[4] = 100e6;
  EXPECT_FALSE(step_skew("Forward", false, ranks, RankSkewRules{})->straggler);
  // ...slow in four of them is.
  ranks[2].pieces = {100e6, 10e6, 100e6, 100e6, kNaN, 100e6};
  EXPECT_TRUE(step_skew("Forward", false, ranks, RankSkewRules{})->straggler);
  // A window that covers one sample interval (early in a run, or --window shorter than
  // the sample interval): one slow interval is never enough, however slow.
  for (auto& r : ranks) {
    r.pieces = {10e6};
    r.min_pieces = 2;
  }
  ranks[2].pieces = {100e6};
  EXPECT_FALSE(step_skew("Forward", false, ranks, RankSkewRules{})->straggler);
}

TEST(RankSkewTest, AWaitingStepNamesTheRankThatWaitsLeast) {
  // Rank 1 is slow to compute, so the others wait for it at the collective: in WaitPoll
  // it is the one with the short waits.
  auto ranks = alike(6, 50, 30e6);
  ranks[1].total_ns = 50 * 1'000'000;
  ranks[1].pieces = {1e6};
  RankSkewRules rules;
  ASSERT_TRUE(is_waiting_step("WaitPoll", rules));
  const auto skew = step_skew("WaitPoll", true, ranks, rules);
  ASSERT_TRUE(skew);
  EXPECT_TRUE(skew->waiting);
  ASSERT_TRUE(skew->straggler);
  EXPECT_EQ(skew->straggler->rank, 1u);
  EXPECT_EQ(skew->fastest.rank, 1u);
  // Read as an ordinary step, the one waiting least is not slow at all.
  EXPECT_FALSE(step_skew("WaitPoll", false, ranks, rules)->straggler);
  // A configured collective step reads the same way.
  EXPECT_FALSE(is_waiting_step("AllReduce", rules));
  rules.waiting_steps = {"AllReduce"};
  EXPECT_TRUE(is_waiting_step("AllReduce", rules));
}

TEST(RankSkewTest, ThresholdsAndTooFewRanks) {
  auto ranks = alike(4, 100, 10e6);
  ranks[0].total_ns = 100 * 12'000'000;  // 1.2x: under the default 1.25x
  ranks[0].pieces = {12e6};
  EXPECT_FALSE(step_skew("Forward", false, ranks, RankSkewRules{})->straggler);
  RankSkewRules strict;
  strict.ratio = 1.1;
  EXPECT_TRUE(step_skew("Forward", false, ranks, strict)->straggler);
  strict.min_spans = 1000;  // too few spans to judge
  EXPECT_FALSE(step_skew("Forward", false, ranks, strict)->straggler);
  // One rank with spans: nothing to compare.
  auto one = alike(3, 100, 10e6);
  one[1].spans = one[2].spans = 0;
  EXPECT_FALSE(step_skew("Forward", false, one, RankSkewRules{}));
}

}  // namespace
}  // namespace steptrace::daemon
