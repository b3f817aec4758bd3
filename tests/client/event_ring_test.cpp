// The per-thread ring: order, wrap-around, full behaviour, the drop counters, the
// run-time capacity and the high-water wake.
#include "client/src/event_ring.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

namespace steptrace::client {
namespace {

// A small ring: 64 KiB, the smallest the library makes (4096 records, high water 512).
constexpr std::size_t kCapacity = kMinRingRecords;

std::vector<std::uint64_t> drain(EventRing& ring) {
  std::vector<std::uint64_t> out;
  const std::uint64_t head = ring.published();
  const auto [a, b] = ring.readable(head);
  for (const auto& s : a) out.push_back(s.ticks);
  for (const auto& s : b) out.push_back(s.ticks);
  ring.release(head);
  return out;
}

TEST(EventRing, MetaMatchesEventRecordLayout) {
  proto::EventRecord r{};
  const std::uint64_t meta = event_meta(4242, 257, proto::EventKind::kEnd);
  std::memcpy(reinterpret_cast<char*>(&r) + 8, &meta, sizeof meta);
  EXPECT_EQ(r.thread_id, 4242u);
  EXPECT_EQ(r.step, 257u);
  EXPECT_EQ(r.kind, static_cast<std::uint8_t>(proto::EventKind::kEnd));
  EXPECT_EQ(r.reserved, 0u);
}

bool pushed(EventRing::Push p) { return p != EventRing::Push::kFull; }

TEST(EventRing, CapacityIsChosenAtRunTime) {
  for (const std::size_t capacity : {kMinRingRecords, std::size_t{1} << 14, std::size_t{1} << 18}) {
    auto ring = std::make_unique<EventRing>(1, capacity);
    EXPECT_EQ(ring->capacity(), capacity);
    EXPECT_EQ(ring->bytes(), capacity * 16);
    EXPECT_EQ(ring->high_water(), std::min<std::size_t>(capacity / 8, 32768));
    std::size_t n = 0;
    while (pushed(ring->try_push(n, 0))) ++n;
    EXPECT_EQ(n, capacity);
    EXPECT_EQ(drain(*ring).size(), capacity);
  }
  // The default per-thread size: 4 MiB = 262,144 records, so a burst of 64k spans (128k
  // events) fits twice; its high-water mark is 32,768 records (512 KiB).
  EXPECT_EQ(ring_high_water(262144), 32768u);
  EXPECT_EQ(ring_high_water(kMaxRingRecords), kMaxHighWater);
  EXPECT_EQ(ring_high_water(kMinRingRecords), 512u);
}

TEST(EventRing, ZeroCapacityRingIsAlwaysFull) {
  EventRing ring(9, 0);
  EXPECT_EQ(ring.capacity(), 0u);
  EXPECT_EQ(ring.bytes(), 0u);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(ring.try_push(1, 2), EventRing::Push::kFull);
  EXPECT_EQ(ring.fill(), 0u);
}

TEST(EventRing, FullRingRejectsAndCountsNothingByItself) {
  auto ring = std::make_unique<EventRing>(1, kCapacity);
  for (std::size_t i = 0; i < kCapacity; ++i) ASSERT_TRUE(pushed(ring->try_push(i, 0)));
  EXPECT_EQ(ring->try_push(99, 0), EventRing::Push::kFull);
  EXPECT_EQ(ring->fill(), kCapacity);
  EXPECT_EQ(ring->dropped(), 0u);
  ring->count_buffer_full();
  ring->count_buffer_full();
  ring->count_not_connected();
  EXPECT_EQ(ring->dropped_buffer_full(), 2u);
  EXPECT_EQ(ring->dropped_not_connected(), 1u);
  EXPECT_EQ(ring->dropped(), 3u);
  const auto got = drain(*ring);
  ASSERT_EQ(got.size(), kCapacity);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], i);
  EXPECT_TRUE(pushed(ring->try_push(7, 0)));  // space again after release
}

// The push that finds high_water() records unconsumed asks for a wake, once; no other
// push does until the consumer's tail has moved.
TEST(EventRing, HighWaterAsksForOneWakeUntilTheConsumerMoves) {
  EventRing ring(1, kCapacity);
  const std::size_t high = ring.high_water();
  ASSERT_EQ(high, kCapacity / 8);
  std::uint64_t n = 0;
  auto push = [&] { return ring.try_push(n++, 0); };
  for (std::size_t i = 0; i < high; ++i) ASSERT_EQ(push(), EventRing::Push::kPushed) << i;
  EXPECT_EQ(push(), EventRing::Push::kPushedWake);  // found `high` records waiting
  // Up to full, no second wake: the flusher has not run yet.
  std::size_t wakes = 0;
  while (ring.fill() < kCapacity) wakes += push() == EventRing::Push::kPushedWake;
  EXPECT_EQ(wakes, 0u);
  EXPECT_EQ(push(), EventRing::Push::kFull);
  EXPECT_EQ(push(), EventRing::Push::kFull);

  // The consumer takes a few records: still above the mark, and the tail moved, so the
  // next push wakes again (the flusher may have gone back to sleep), once.
  ring.release(ring.consumed() + 10);
  EXPECT_EQ(push(), EventRing::Push::kPushedWake);
  for (int i = 0; i < 9; ++i) EXPECT_EQ(push(), EventRing::Push::kPushed);
  EXPECT_EQ(push(), EventRing::Push::kFull);

  // Drained below the mark: quiet pushes until the mark is reached again, then one wake.
  drain(ring);
  for (std::size_t i = 0; i < high; ++i) ASSERT_EQ(push(), EventRing::Push::kPushed) << i;
  EXPECT_EQ(push(), EventRing::Push::kPushedWake);
  EXPECT_EQ(push(), EventRing::Push::kPushed);
}

// A consumer that drains as it goes keeps the producer under the mark: no wake at all.
TEST(EventRing, NoWakeWhileTheConsumerKeepsUp) {
  EventRing ring(1, kCapacity);
  std::size_t wakes = 0;
  for (std::uint64_t i = 0; i < 10 * kCapacity; ++i) {
    wakes += ring.try_push(i, 0) == EventRing::Push::kPushedWake;
    if (i % 100 == 99) drain(ring);
  }
  EXPECT_EQ(wakes, 0u);
}

// Resident set size in KiB (VmRSS), -1 when unknown.
long long rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

TEST(EventRing, SlotsAreCommittedOnlyAsWritten) {
  // A 1 GiB ring reserves address space only: writing a few records commits a page or
  // two, not the capacity (MAP_NORESERVE, pages committed on first write).
  const long long before = rss_kib();
  EventRing ring(1, kMaxRingRecords);
  EXPECT_EQ(ring.bytes(), std::size_t{1} << 30);
  for (std::uint64_t i = 0; i < 1000; ++i) ASSERT_TRUE(pushed(ring.try_push(i, i)));
  const auto got = drain(ring);
  ASSERT_EQ(got.size(), 1000u);
  EXPECT_EQ(got.back(), 999u);
  if (before >= 0) {
    EXPECT_LT(rss_kib() - before, 16 * 1024);
  }
}

TEST(EventRing, WrapsAroundInTwoRunsKeepingOrder) {
  auto ring = std::make_unique<EventRing>(1, kCapacity);
  const std::size_t first = kCapacity - 100;
  for (std::size_t i = 0; i < first; ++i) ASSERT_TRUE(pushed(ring->try_push(i, 0)));
  ASSERT_EQ(drain(*ring).size(), first);
  for (std::size_t i = 0; i < 300; ++i) ASSERT_TRUE(pushed(ring->try_push(1000 + i, 0)));
  const auto runs = ring->readable(ring->published());
  EXPECT_EQ(runs.first.size(), 100u);
  EXPECT_EQ(runs.second.size(), 200u);
  const auto got = drain(*ring);
  ASSERT_EQ(got.size(), 300u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 1000 + i);
}

TEST(EventRing, ConsumerThreadSeesEveryRecordInOrder) {
  auto ring = std::make_unique<EventRing>(1, kCapacity);
  constexpr std::uint64_t kTotal = 200'000;
  std::uint64_t pushed = 0;
  std::uint64_t rejected = 0;
  std::atomic<bool> finished{false};
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < kTotal; ++i) {
      if (ring->try_push(i, i * 3) != EventRing::Push::kFull) {
        ++pushed;
      } else {
        ring->count_buffer_full();
        ++rejected;
      }
    }
    finished.store(true);
  });
  std::vector<std::uint64_t> seen;
  std::size_t meta_ok = 0;
  auto consume = [&] {
    const std::uint64_t head = ring->published();
    const auto [a, b] = ring->readable(head);
    for (const auto run : {a, b}) {
      for (const auto& s : run) {
        seen.push_back(s.ticks);
        meta_ok += s.meta == s.ticks * 3;
      }
    }
    ring->release(head);
  };
  while (!finished.load()) {
    consume();
    std::this_thread::yield();
  }
  producer.join();
  consume();
  EXPECT_EQ(seen.size(), pushed);
  EXPECT_EQ(meta_ok, seen.size());
  EXPECT_EQ(ring->dropped(), rejected);
  EXPECT_EQ(pushed + rejected, kTotal);
  for (std::size_t i = 1; i < seen.size(); ++i) ASSERT_LT(seen[i - 1], seen[i]);
}

// The single-producer rule, asserted in debug builds: the first thread that pushes is
// the producer (not the one that made the ring), and another thread's push aborts.
TEST(EventRingDeathTest, ASecondProducerThreadFailsTheDebugAssert) {
#ifdef NDEBUG
  GTEST_SKIP() << "NDEBUG: the single-producer assert is compiled out";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto ring = std::make_unique<EventRing>(1, kCapacity);
  std::thread([&] { ASSERT_TRUE(pushed(ring->try_push(1, 0))); }).join();
  EXPECT_DEATH(ring->try_push(2, 0), "is_producer");
  EXPECT_DEATH(ring->count_buffer_full(), "is_producer");
#endif
}

// The capacity-0 stand-in is shared by every thread without a ring: no producer rule.
TEST(EventRing, ZeroCapacityRingTakesPushesFromAnyThread) {
  EventRing ring(0, 0);
  EXPECT_EQ(ring.try_push(1, 2), EventRing::Push::kFull);
  std::thread([&] { EXPECT_EQ(ring.try_push(3, 4), EventRing::Push::kFull); }).join();
}

TEST(EventRing, OrphanFlagIsVisible) {
  auto ring = std::make_unique<EventRing>(5, kCapacity);
  EXPECT_FALSE(ring->orphaned());
  ring->orphan();
  EXPECT_TRUE(ring->orphaned());
  EXPECT_EQ(ring->thread_id(), 5u);
}

}  // namespace
}  // namespace steptrace::client
