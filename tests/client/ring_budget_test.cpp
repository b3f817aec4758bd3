// Ring sizes: the budget arithmetic and the parsing of STEPTRACE_BUFFER_BYTES /
// STEPTRACE_BUFFER_TOTAL_BYTES values.
#include "client/src/ring_budget.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>

namespace steptrace::client {
namespace {

constexpr std::uint64_t kKiB = 1024;
constexpr std::uint64_t kMiB = 1024 * kKiB;
constexpr std::uint64_t kGiB = 1024 * kMiB;

TEST(RingBudget, Defaults) {
  EXPECT_EQ(kDefaultRingBytes, 4 * kMiB);
  EXPECT_EQ(kDefaultRingBytes / kRingRecordBytes, 262144u);  // 2 x a burst of 64k spans
  EXPECT_EQ(kDefaultTotalRingBytes, 256 * kMiB);
  EXPECT_EQ(kMinRingBytes, 64 * kKiB);
  EXPECT_EQ(kMaxRingBytes, 1 * kGiB);
}

TEST(RingBudget, NextRingIsThePerThreadSizeOrTheLargestPowerOfTwoLeft) {
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 256 * kMiB), 4 * kMiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 4 * kMiB), 4 * kMiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 4 * kMiB - 1), 2 * kMiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 3 * kMiB), 2 * kMiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 100 * kKiB), 64 * kKiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 64 * kKiB), 64 * kKiB);
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 64 * kKiB - 1), 0u);  // not even the minimum: no ring
  EXPECT_EQ(next_ring_bytes(4 * kMiB, 0), 0u);
  EXPECT_EQ(next_ring_bytes(64 * kKiB, 1 * kGiB), 64 * kKiB);
}

TEST(RingBudget, ParsesBytesAndBinarySuffixes) {
  EXPECT_EQ(parse_byte_size("65536"), 65536u);
  EXPECT_EQ(parse_byte_size("64K"), 64 * kKiB);
  EXPECT_EQ(parse_byte_size("64k"), 64 * kKiB);
  EXPECT_EQ(parse_byte_size("4M"), 4 * kMiB);
  EXPECT_EQ(parse_byte_size("4MiB"), 4 * kMiB);
  EXPECT_EQ(parse_byte_size("4MB"), 4 * kMiB);
  EXPECT_EQ(parse_byte_size("1G"), 1 * kGiB);
  EXPECT_EQ(parse_byte_size("1024B"), 1024u);
  EXPECT_EQ(parse_byte_size("0"), 0u);
  for (const char* bad : {"", "M", "-1", "4 M", " 4M", "4M ", "4T", "4Mi", "4MiBs", "0x100", "1.5M",
                          "99999999999999999999", "17179869184G"}) {
    EXPECT_FALSE(parse_byte_size(bad).has_value()) << bad;
  }
}

TEST(RingBudget, EnvironmentValuesAreCheckedAndRoundedDown) {
  auto sizes = buffer_sizes_from_env(nullptr, nullptr);
  EXPECT_EQ(sizes.per_thread, kDefaultRingBytes);
  EXPECT_EQ(sizes.total, kDefaultTotalRingBytes);
  sizes = buffer_sizes_from_env("1M", "8M");
  EXPECT_EQ(sizes.per_thread, 1 * kMiB);
  EXPECT_EQ(sizes.total, 8 * kMiB);
  sizes = buffer_sizes_from_env("3M", "3M");  // per thread: a power of two; total: as is
  EXPECT_EQ(sizes.per_thread, 2 * kMiB);
  EXPECT_EQ(sizes.total, 3 * kMiB);
  sizes = buffer_sizes_from_env("", "");  // empty is unset
  EXPECT_EQ(sizes.per_thread, kDefaultRingBytes);
  EXPECT_EQ(sizes.total, kDefaultTotalRingBytes);
}

TEST(RingBudget, BadEnvironmentValuesKeepTheDefaultAndSaySo) {
  ::testing::internal::CaptureStderr();
  const auto sizes = buffer_sizes_from_env("32K", "lots");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(sizes.per_thread, kDefaultRingBytes);  // below the 64 KiB minimum
  EXPECT_EQ(sizes.total, kDefaultTotalRingBytes);
  EXPECT_NE(err.find("STEPTRACE_BUFFER_BYTES=32K"), std::string::npos) << err;
  EXPECT_NE(err.find("STEPTRACE_BUFFER_TOTAL_BYTES=lots"), std::string::npos) << err;
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(buffer_sizes_from_env("2G", nullptr).per_thread, kDefaultRingBytes);  // > 1 GiB
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("STEPTRACE_BUFFER_BYTES"),
            std::string::npos);
}

}  // namespace
}  // namespace steptrace::client
