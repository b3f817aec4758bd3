// The per-thread ring: order, wrap-around, full behaviour and the drop counter.
#include "client/src/event_ring.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

namespace steptrace::client {
namespace {

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

TEST(EventRing, FullRingRejectsAndCountsNothingByItself) {
  auto ring = std::make_unique<EventRing>(1);
  for (std::size_t i = 0; i < kRingCapacity; ++i) ASSERT_TRUE(ring->try_push(i, 0));
  EXPECT_FALSE(ring->try_push(99, 0));
  EXPECT_EQ(ring->fill(), kRingCapacity);
  EXPECT_EQ(ring->dropped(), 0u);
  ring->count_drop();
  ring->count_drop();
  EXPECT_EQ(ring->dropped(), 2u);
  const auto got = drain(*ring);
  ASSERT_EQ(got.size(), kRingCapacity);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], i);
  EXPECT_TRUE(ring->try_push(7, 0));  // space again after release
}

TEST(EventRing, WrapsAroundInTwoRunsKeepingOrder) {
  auto ring = std::make_unique<EventRing>(1);
  const std::size_t first = kRingCapacity - 100;
  for (std::size_t i = 0; i < first; ++i) ASSERT_TRUE(ring->try_push(i, 0));
  ASSERT_EQ(drain(*ring).size(), first);
  for (std::size_t i = 0; i < 300; ++i) ASSERT_TRUE(ring->try_push(1000 + i, 0));
  const auto runs = ring->readable(ring->published());
  EXPECT_EQ(runs.first.size(), 100u);
  EXPECT_EQ(runs.second.size(), 200u);
  const auto got = drain(*ring);
  ASSERT_EQ(got.size(), 300u);
  for (std::size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], 1000 + i);
}

TEST(EventRing, ConsumerThreadSeesEveryRecordInOrder) {
  auto ring = std::make_unique<EventRing>(1);
  constexpr std::uint64_t kTotal = 200'000;
  std::uint64_t pushed = 0;
  std::uint64_t rejected = 0;
  std::atomic<bool> finished{false};
  std::thread producer([&] {
    for (std::uint64_t i = 0; i < kTotal; ++i) {
      if (ring->try_push(i, i * 3)) {
        ++pushed;
      } else {
        ring->count_drop();
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

TEST(EventRing, OrphanFlagIsVisible) {
  auto ring = std::make_unique<EventRing>(5);
  EXPECT_FALSE(ring->orphaned());
  ring->orphan();
  EXPECT_TRUE(ring->orphaned());
  EXPECT_EQ(ring->thread_id(), 5u);
}

}  // namespace
}  // namespace steptrace::client
