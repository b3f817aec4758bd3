// The rank windows (daemon/state/rank_window.h): how a rank's ring takes one sample of
// cumulative per-step figures (add_rank_sample, what sample_rank_windows does to each
// ring on the liveness tick: at most kRankWindowMaxSteps steps, at most
// window_samples samples, a gone step dropped once it adds nothing), and how a window's
// figures come out of the ring (window_figures).
#include "daemon/state/rank_window.h"

#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>

#include <gtest/gtest.h>

namespace steptrace::daemon {
namespace {

constexpr std::uint64_t kSecond = 1'000'000'000;

// "Step000", "Step001", ...: in the ring's (sorted) order.
std::string step_name(std::size_t i) {
  char name[16];
  std::snprintf(name, sizeof name, "Step%03zu", i);
  return name;
}

TEST(RankWindowTest, AWindowIsTheNewestSampleLessTheOneItsLengthBefore) {
  RankWindow ring;
  // A sample every 5 s; the rank ends 10 spans of 1 ms per interval, then 10 of 3 ms.
  std::uint64_t spans = 0, total = 0;
  for (int i = 0; i < 10; ++i) {
    ring.times_ns.push_back(static_cast<std::uint64_t>(i) * 5'000'000'000);
    ring.steps["Forward"].push_back({spans, total});
    spans += 10;
    total += (i < 6 ? 1'000'000 : 3'000'000) * 10;
  }
  const RankWindowFigures last10 = window_figures(ring, 10'000'000'000);
  EXPECT_EQ(last10.covered_ns, 10'000'000'000u);
  const RankWindowStep& f = last10.steps.at("Forward");
  EXPECT_EQ(f.spans, 20u);
  EXPECT_EQ(f.total_ns, 60'000'000u);
  ASSERT_EQ(f.interval_means.size(), 2u);
  EXPECT_DOUBLE_EQ(f.interval_means[0], 3e6);
  // Longer than the ring: what it holds, and says so.
  const RankWindowFigures all = window_figures(ring, 3600'000'000'000);
  EXPECT_EQ(all.covered_ns, 45'000'000'000u);
  EXPECT_EQ(all.steps.at("Forward").spans, 90u);
  // Under two samples: nothing.
  RankWindow one;
  one.times_ns.push_back(1);
  one.steps["Forward"].push_back({1, 1});
  EXPECT_EQ(window_figures(one, 1'000'000'000).covered_ns, 0u);
}

TEST(RankWindowTest, ARingKeepsAtMostMaxJobStepsStepsAndLeavesTheRestOut) {
  constexpr std::size_t kMax = kRankWindowMaxSteps;
  constexpr std::size_t kOffered = kMax + 10;
  RankWindow ring;
  // Two samples of kOffered steps, each step one more 1 ms span in the second.
  for (std::uint64_t s = 1; s <= 2; ++s) {
    RankSample sample;
    for (std::size_t i = 0; i < kOffered; ++i) sample[step_name(i)] = {s, s * 1'000'000};
    ring = add_rank_sample(std::move(ring), sample, s * 5 * kSecond, 72);
  }
  ASSERT_EQ(ring.steps.size(), kMax);
  for (std::size_t i = 0; i < kMax; ++i) {
    const auto it = ring.steps.find(step_name(i));
    ASSERT_NE(it, ring.steps.end()) << step_name(i);
    EXPECT_EQ(it->second.size(), 2u) << step_name(i);
  }
  for (std::size_t i = kMax; i < kOffered; ++i) {
    EXPECT_FALSE(ring.steps.contains(step_name(i))) << step_name(i);
  }
  // The windows hold the kept steps and only them.
  const RankWindowFigures figures = window_figures(ring, 5 * kSecond);
  EXPECT_EQ(figures.covered_ns, 5 * kSecond);
  ASSERT_EQ(figures.steps.size(), kMax);
  EXPECT_EQ(figures.steps.at(step_name(kMax - 1)).spans, 1u);
  EXPECT_EQ(figures.steps.at(step_name(kMax - 1)).total_ns, 1'000'000u);
  EXPECT_FALSE(figures.steps.contains(step_name(kMax)));
}

TEST(RankWindowTest, ARingKeepsAtMostWindowSamplesTheNewest) {
  constexpr std::uint64_t kWindowSamples = 5;
  RankWindow ring;
  for (std::uint64_t s = 1; s <= 12; ++s) {
    ring = add_rank_sample(std::move(ring), RankSample{{"Forward", {s, s * 1'000'000}}},
                           s * 5 * kSecond, kWindowSamples);
    ASSERT_LE(ring.times_ns.size(), kWindowSamples);
    ASSERT_EQ(ring.steps.at("Forward").size(), ring.times_ns.size());
  }
  ASSERT_EQ(ring.times_ns.size(), kWindowSamples);
  EXPECT_EQ(ring.times_ns.front(), 8 * 5 * kSecond);
  EXPECT_EQ(ring.times_ns.back(), 12 * 5 * kSecond);
  EXPECT_EQ(ring.steps.at("Forward").front().spans, 8u);
  EXPECT_EQ(ring.steps.at("Forward").back().spans, 12u);
  // A window longer than the ring covers what it kept: four intervals of one 1 ms span.
  const RankWindowFigures figures = window_figures(ring, 3600 * kSecond);
  EXPECT_EQ(figures.covered_ns, 4 * 5 * kSecond);
  const RankWindowStep& forward = figures.steps.at("Forward");
  EXPECT_EQ(forward.spans, 4u);
  EXPECT_EQ(forward.total_ns, 4'000'000u);
  ASSERT_EQ(forward.interval_means.size(), 4u);
  for (const double mean : forward.interval_means) EXPECT_DOUBLE_EQ(mean, 1e6);
}

TEST(RankWindowTest, AGoneStepIsDroppedOnceItAddsNothingToAnyWindow) {
  constexpr std::uint64_t kWindowSamples = 3;
  RankWindow ring;
  const auto add = [&](std::uint64_t s, RankSample sample) {
    ring = add_rank_sample(std::move(ring), sample, s * 5 * kSecond, kWindowSamples);
  };
  // Forward goes on; Idle stays the same but is still sampled; Eval ends one span at
  // sample 2, then its process is forgotten (the samples lack it).
  add(1, {{"Forward", {1, 10}}, {"Idle", {7, 70}}, {"Eval", {1, 100}}});
  add(2, {{"Forward", {2, 20}}, {"Idle", {7, 70}}, {"Eval", {2, 200}}});
  add(3, {{"Forward", {3, 30}}, {"Idle", {7, 70}}});
  // Still in the window: Eval keeps its last figures, and the window holds its span.
  ASSERT_TRUE(ring.steps.contains("Eval"));
  EXPECT_EQ(ring.steps.at("Eval").back().spans, 2u);
  EXPECT_EQ(window_figures(ring, 3600 * kSecond).steps.at("Eval").spans, 1u);
  add(4, {{"Forward", {4, 40}}, {"Idle", {7, 70}}});
  EXPECT_FALSE(window_figures(ring, 3600 * kSecond).steps.contains("Eval"));
  add(5, {{"Forward", {5, 50}}, {"Idle", {7, 70}}});
  // Out of every window: gone. A step still sampled stays, however unchanged.
  EXPECT_FALSE(ring.steps.contains("Eval"));
  EXPECT_TRUE(ring.steps.contains("Forward"));
  ASSERT_TRUE(ring.steps.contains("Idle"));
  EXPECT_EQ(ring.steps.at("Idle").size(), kWindowSamples);
  // A step first seen later had nothing before it.
  add(6, {{"Forward", {6, 60}}, {"Idle", {7, 70}}, {"Eval", {1, 300}}});
  ASSERT_TRUE(ring.steps.contains("Eval"));
  EXPECT_EQ(ring.steps.at("Eval").front().spans, 0u);
  EXPECT_EQ(window_figures(ring, 5 * kSecond).steps.at("Eval").total_ns, 300u);
}

TEST(RankWindowTest, ADroppedStepMakesRoomUnderTheStepCap) {
  constexpr std::size_t kMax = kRankWindowMaxSteps;
  constexpr std::uint64_t kWindowSamples = 2;
  RankWindow ring;
  RankSample full;
  for (std::size_t i = 0; i < kMax; ++i) full[step_name(i)] = {1, 1};
  ring = add_rank_sample(std::move(ring), full, 5 * kSecond, kWindowSamples);
  // Step000 ended a span, then its process went; a new name comes while the ring is full.
  full[step_name(0)] = {2, 2};
  ring = add_rank_sample(std::move(ring), full, 10 * kSecond, kWindowSamples);
  full.erase(step_name(0));
  full["Late"] = {1, 1};
  ring = add_rank_sample(std::move(ring), full, 15 * kSecond, kWindowSamples);
  EXPECT_FALSE(ring.steps.contains("Late"));  // full: left out
  ring = add_rank_sample(std::move(ring), full, 20 * kSecond, kWindowSamples);
  // Step000 adds nothing any more and went; the late name is still left out this time
  // (the cap is checked before gone steps go), and is taken at the next sample.
  EXPECT_FALSE(ring.steps.contains(step_name(0)));
  EXPECT_EQ(ring.steps.size(), kMax - 1);
  ring = add_rank_sample(std::move(ring), full, 25 * kSecond, kWindowSamples);
  EXPECT_TRUE(ring.steps.contains("Late"));
  EXPECT_EQ(ring.steps.size(), kMax);
}

}  // namespace
}  // namespace steptrace::daemon
