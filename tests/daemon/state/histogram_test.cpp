#include "daemon/state/histogram.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

namespace steptrace::daemon {
namespace {

std::uint64_t exact_percentile(std::vector<std::uint64_t> values, double q) {
  std::sort(values.begin(), values.end());
  auto rank = static_cast<std::size_t>(std::ceil(q * static_cast<double>(values.size())));
  rank = std::clamp<std::size_t>(rank, 1, values.size());
  return values[rank - 1];
}

void expect_accurate(const std::vector<std::uint64_t>& values, const std::string& what) {
  Histogram h;
  for (auto v : values) h.record(v);
  for (const double q : {0.5, 0.9, 0.99, 0.999}) {
    const double exact = static_cast<double>(exact_percentile(values, q));
    const double estimate = static_cast<double>(h.percentile(q));
    EXPECT_LE(std::abs(estimate - exact), 0.02 * exact)
        << what << " q=" << q << " exact=" << exact << " estimate=" << estimate;
  }
  EXPECT_EQ(h.count(), values.size());
  EXPECT_EQ(h.min(), *std::min_element(values.begin(), values.end()));
  EXPECT_EQ(h.max(), *std::max_element(values.begin(), values.end()));
}

TEST(HistogramTest, PercentilesWithinTwoPercentOnRandomData) {
  std::mt19937_64 rng(12345);
  const std::size_t n = 50'000;
  std::vector<std::uint64_t> uniform, lognormal, exponential, bimodal, tiny;
  std::uniform_int_distribution<std::uint64_t> u(1'000, 5'000'000);
  std::lognormal_distribution<double> ln(12.0, 1.5);  // median ~160us, wide tail
  std::exponential_distribution<double> ex(1.0 / 250'000.0);
  std::normal_distribution<double> fast(20'000, 2'000), slow(40'000'000, 5'000'000);
  std::bernoulli_distribution pick_slow(0.3);
  std::uniform_int_distribution<std::uint64_t> small(0, 200);
  for (std::size_t i = 0; i < n; ++i) {
    uniform.push_back(u(rng));
    lognormal.push_back(static_cast<std::uint64_t>(ln(rng)) + 1);
    exponential.push_back(static_cast<std::uint64_t>(ex(rng)) + 1);
    bimodal.push_back(
        static_cast<std::uint64_t>(std::max(1.0, pick_slow(rng) ? slow(rng) : fast(rng))));
    tiny.push_back(small(rng));
  }
  expect_accurate(uniform, "uniform");
  expect_accurate(lognormal, "lognormal");
  expect_accurate(exponential, "exponential");
  expect_accurate(bimodal, "bimodal");
  expect_accurate(tiny, "tiny");
}

TEST(HistogramTest, SmallValuesAreExactAndBucketsAreTight) {
  for (std::uint64_t v = 0; v < 64; ++v) {
    EXPECT_EQ(Histogram::bucket_midpoint(Histogram::bucket_index(v)), v);
  }
  std::mt19937_64 rng(7);
  for (int i = 0; i < 100'000; ++i) {
    const std::uint64_t v = rng() >> (rng() % 64);
    const unsigned index = Histogram::bucket_index(v);
    ASSERT_LT(index, Histogram::kBuckets);
    const std::uint64_t mid = Histogram::bucket_midpoint(index);
    EXPECT_EQ(Histogram::bucket_index(mid), index) << v;
    const double err = std::abs(static_cast<double>(mid) - static_cast<double>(v));
    EXPECT_LE(err, static_cast<double>(v) / 64.0 + 0.5) << v;
  }
  EXPECT_EQ(Histogram::bucket_index(~std::uint64_t{0}), Histogram::kBuckets - 1);
}

TEST(HistogramTest, SumsSaturateInsteadOfWrapping) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  Histogram h;
  for (int i = 0; i < 3; ++i) h.record(kMax);
  EXPECT_EQ(h.count(), 3u);
  EXPECT_EQ(h.sum(), kMax);
  EXPECT_EQ(h.max(), kMax);
  Histogram merged;
  merged.record(kMax - 1);
  merged.merge(h);
  EXPECT_EQ(merged.sum(), kMax);
  EXPECT_EQ(merged.count(), 4u);
  EXPECT_EQ(saturating_add(kMax - 2, 1), kMax - 1);
}

TEST(HistogramTest, EmptyHistogramReportsZeros) {
  Histogram h;
  EXPECT_EQ(h.count(), 0u);
  EXPECT_EQ(h.min(), 0u);
  EXPECT_EQ(h.max(), 0u);
  EXPECT_EQ(h.percentile(0.5), 0u);
  EXPECT_EQ(h.percentile(0.99), 0u);
}

TEST(HistogramTest, PrometheusBucketsAreExact) {
  std::vector<std::uint64_t> values = {0,
                                       1,
                                       999,
                                       1'000,
                                       1'001,
                                       9'999,
                                       10'000,
                                       10'001,
                                       999'999,
                                       1'000'000,
                                       5'000'000,
                                       99'999'999,
                                       100'000'000,
                                       999'999'999,
                                       1'000'000'000,
                                       9'999'999'999,
                                       10'000'000'000,
                                       10'000'000'001,
                                       ~std::uint64_t{0}};
  std::mt19937_64 rng(99);
  for (int i = 0; i < 20'000; ++i) values.push_back(rng() >> (rng() % 64));
  Histogram h;
  for (auto v : values) h.record(v);
  std::array<std::uint64_t, Histogram::kPromBuckets> expected{};
  for (auto v : values) {
    std::size_t b = 0;
    while (b < Histogram::kPromBoundsNs.size() && v > Histogram::kPromBoundsNs[b]) ++b;
    ++expected[b];
  }
  EXPECT_EQ(h.prom_buckets(), expected);
}

TEST(HistogramTest, MergeEqualsRecordingEverythingInOne) {
  std::mt19937_64 rng(3);
  std::lognormal_distribution<double> ln(10.0, 2.0);
  Histogram a, b, all;
  for (int i = 0; i < 10'000; ++i) {
    const auto v = static_cast<std::uint64_t>(ln(rng));
    (i % 3 ? a : b).record(v);
    all.record(v);
  }
  a.merge(b);
  EXPECT_EQ(a.count(), all.count());
  EXPECT_EQ(a.sum(), all.sum());
  EXPECT_EQ(a.min(), all.min());
  EXPECT_EQ(a.max(), all.max());
  EXPECT_EQ(a.prom_buckets(), all.prom_buckets());
  EXPECT_EQ(a.parts(), all.parts());
  for (const double q : {0.1, 0.5, 0.99}) EXPECT_EQ(a.percentile(q), all.percentile(q));
}

TEST(HistogramTest, MemoryStaysWithinTheStatedBound) {
  // A typical step: spans between 40us and 1ms (a factor of 25): at most 6 chunks.
  Histogram typical;
  std::mt19937_64 rng(5);
  std::uniform_int_distribution<std::uint64_t> d(40'000, 1'000'000);
  for (int i = 0; i < 100'000; ++i) typical.record(d(rng));
  EXPECT_LE(typical.chunks_in_use(), 6u);
  EXPECT_LE(typical.memory_bytes(), 2048u);
  // Worst case: every power of two seen.
  Histogram worst;
  for (unsigned e = 0; e < 64; ++e) worst.record(std::uint64_t{1} << e);
  EXPECT_EQ(worst.chunks_in_use(), Histogram::kChunks);
  EXPECT_LE(worst.memory_bytes(), 8u * 1024u);
}

TEST(HistogramTest, BucketsCountPastTwoToTheThirtyTwo) {
  // Recording 2^32 spans takes too long for a unit test; a snapshot can carry such counts.
  const std::uint64_t big = 5'000'000'000;  // > 2^32
  const unsigned index = Histogram::bucket_index(1000);
  Histogram::Parts parts;
  parts.count = big + 1;
  parts.sum = big * 1000 + 7;
  parts.min = 7;
  parts.max = 1000;
  parts.buckets = {{7, 1}, {index, big}};
  parts.prom[0] = big + 1;  // every value is <= 1 us, the first Prometheus bound
  std::string reason;
  auto h = Histogram::from_parts(parts, reason);
  ASSERT_TRUE(h) << reason;
  EXPECT_EQ(h->parts(), parts);
  EXPECT_EQ(h->percentile(0.5), Histogram::bucket_midpoint(index));
  Histogram sum = *h;
  sum.merge(*h);
  EXPECT_EQ(sum.count(), 2 * (big + 1));
  EXPECT_EQ(sum.parts().buckets[1].second, 2 * big);
  sum.record(1000);
  EXPECT_EQ(sum.parts().buckets[1].second, 2 * big + 1);
  EXPECT_EQ(sum.percentile(0.0), 7u);
}

TEST(HistogramTest, FromPartsRebuildsWhatPartsGave) {
  Histogram h;
  for (std::uint64_t v : {5u, 700u, 70'000u, 7'000'000u, 7'000'000u}) h.record(v);
  std::string reason;
  auto back = Histogram::from_parts(h.parts(), reason);
  ASSERT_TRUE(back) << reason;
  EXPECT_EQ(back->parts(), h.parts());
  EXPECT_EQ(back->percentile(0.5), h.percentile(0.5));
  EXPECT_EQ(back->prom_buckets(), h.prom_buckets());
  EXPECT_EQ(back->min(), 5u);
  // An empty histogram too: min() stays 0 and a later record sets it.
  auto empty = Histogram::from_parts(Histogram{}.parts(), reason);
  ASSERT_TRUE(empty) << reason;
  empty->record(42);
  EXPECT_EQ(empty->min(), 42u);
}

TEST(HistogramTest, FromPartsRejectsPartsNoHistogramHas) {
  Histogram h;
  for (std::uint64_t v : {5u, 700u, 70'000u}) h.record(v);
  const Histogram::Parts good = h.parts();
  const std::vector<std::pair<std::string, std::function<void(Histogram::Parts&)>>> cases = {
      {"bucket counts do not add up to count", [](auto& p) { p.count = 4; }},
      {"bucket counts do not add up to count", [](auto& p) { p.prom[0] += 1; }},
      {"bucket indices must be increasing, below 1920, with nonzero counts",
       [](auto& p) {
         p.buckets.push_back({Histogram::kBuckets, 1});
       }},
      {"bucket indices must be increasing, below 1920, with nonzero counts",
       [](auto& p) { std::swap(p.buckets[0], p.buckets[1]); }},
      {"bucket indices must be increasing, below 1920, with nonzero counts",
       [](auto& p) { p.buckets[0].second = 0; }},
      {"bucket counts overflow",
       [](auto& p) { p.buckets[1].second = std::numeric_limits<std::uint64_t>::max(); }},
      {"min_ns > max_ns", [](auto& p) { std::swap(p.min, p.max); }},
      {"an empty histogram has nonzero sum/min/max",
       [](auto& p) {
         p = Histogram::Parts{};
         p.sum = 3;
       }},
  };
  for (const auto& [reason, mutate] : cases) {
    Histogram::Parts parts = good;
    mutate(parts);
    std::string got;
    EXPECT_FALSE(Histogram::from_parts(parts, got)) << reason;
    EXPECT_EQ(got, reason);
  }
}

}  // namespace
}  // namespace steptrace::daemon
