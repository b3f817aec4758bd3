// The state budget's estimate (daemon/state/charge.h) against the heap it stands for:
// what the Collector charges for histogram chunks, custom step names and threads grows as
// glibc's malloc reports the heap in use growing (mallinfo2: in-use chunks plus mmapped
// blocks), within a generous tolerance; and FreedMemory's trim policy.
#include "daemon/state/charge.h"

#include <malloc.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "tests/daemon/state/collector_driver.h"
#include "tests/support/sanitizer.h"

namespace steptrace::daemon::test {
namespace {

// The comparison needs glibc's malloc: ASan's allocator (or another) keeps its own books,
// which mallinfo2 does not see.
constexpr bool kGlibcMalloc = !steptrace::testing::kAddressSanitizer;

std::size_t heap_in_use() {
  const struct mallinfo2 info = ::mallinfo2();
  return info.uordblks + info.hblkhd;
}

class ChargeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    FlightRecorderConfig recorder;
    recorder.budget_bytes = 0;  // the recorder has a budget of its own
    collector_ = std::make_unique<Collector>(limits_, world_.env(), recorder);
    client_ = std::make_unique<DirectClient>(*collector_, world_.spawn(1, 1, "p", 1000));
  }
  std::uint64_t charged() const { return collector_->freeze()->table().state_bytes_charged; }

  // Runs `feed` and expects the charge to grow as the heap does, within 20%.
  template <typename Feed>
  void expect_charged_as_held(const char* what, Feed feed) {
    if (!kGlibcMalloc) GTEST_SKIP() << "mallinfo2 does not see this allocator's heap";
    const std::uint64_t charged_before = charged();
    events_.reserve(1 << 20);  // the test's own buffer is no part of the state
    const std::size_t heap_before = heap_in_use();
    feed();
    const std::size_t heap_after = heap_in_use();
    events_ = {};
    const double held = static_cast<double>(heap_after - heap_before);
    const double charge = static_cast<double>(charged() - charged_before);
    ASSERT_GT(held, 100'000.0) << what << ": too small to compare";
    EXPECT_GT(charge, 0.8 * held) << what << ": charged " << charge << ", heap grew " << held;
    EXPECT_LT(charge, 1.2 * held) << what << ": charged " << charge << ", heap grew " << held;
  }
  void send() {
    ASSERT_FALSE(client_->events(events_));
    events_.clear();
  }

  Limits limits_;
  FakeWorld world_;
  std::unique_ptr<Collector> collector_;
  std::unique_ptr<DirectClient> client_;
  std::vector<proto::EventRecord> events_;
};

TEST_F(ChargeTest, CustomStepsWithLongNamesAreChargedAsHeld) {
  expect_charged_as_held("1,024 custom steps, 40-character names", [&] {
    for (std::uint32_t i = 0; i < proto::kMaxCustomSteps; ++i) {
      const std::string name = "model/decoder/layer_" + std::to_string(1000000 + i) + "/attn_proj";
      ASSERT_FALSE(client_->register_step(proto::kFirstCustomStep + i, name));
    }
  });
}

TEST_F(ChargeTest, FullHistogramsAreChargedAsHeld) {
  constexpr std::uint32_t kSteps = 200;
  for (std::uint32_t i = 0; i < kSteps; ++i) {
    ASSERT_FALSE(client_->register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
  }
  expect_charged_as_held("200 histograms over 50 powers of two", [&] {
    std::uint64_t t = 1'000'000;
    for (unsigned power = 0; power < 50; ++power) {
      for (std::uint32_t i = 0; i < kSteps; ++i) {
        const std::uint32_t step = proto::kFirstCustomStep + i;
        events_.push_back(start(1, step, t));
        events_.push_back(end(1, step, t + (std::uint64_t{1} << power)));
        t += 10;
      }
      send();
    }
  });
}

TEST_F(ChargeTest, ThreadsAndTheirStacksAreChargedAsHeld) {
  constexpr std::uint32_t kSteps = 64;
  for (std::uint32_t i = 0; i < kSteps; ++i) {
    ASSERT_FALSE(client_->register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
  }
  expect_charged_as_held("500 thread ids x 64 steps, one span open on each", [&] {
    std::uint64_t t = 1'000'000;
    for (std::uint32_t tid = 1; tid <= 500; ++tid) {
      for (std::uint32_t i = 0; i < kSteps; ++i) {
        events_.push_back(start(tid, proto::kFirstCustomStep + i, t++));
      }
      // A few deeper on one step: its stack grows past one timestamp.
      for (int depth = 0; depth < 5; ++depth) {
        events_.push_back(start(tid, proto::kFirstCustomStep, t++));
      }
    }
    send();
  });
}

TEST_F(ChargeTest, AnEvictedProcessLeavesOnlyItsRetiredHistogramsCharged) {
  client_.reset();
  limits_.max_exited_processes = 0;  // evicted as soon as it is found dead
  SetUp();
  for (std::uint32_t i = 0; i < 100; ++i) {
    ASSERT_FALSE(client_->register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
    events_.push_back(start(1, proto::kFirstCustomStep + i, 10));
    events_.push_back(end(1, proto::kFirstCustomStep + i, 10 + (std::uint64_t{1} << (i % 40))));
  }
  send();
  const std::uint64_t with_process = charged();
  world_.kill(1);
  client_->close();
  EXPECT_EQ(collector_->freeze()->table().tracked, 0u);
  // What is left charged is the retired histograms and job: 100 names, a chunk each.
  const std::uint64_t retired = charged();
  EXPECT_GT(retired, 100 * heap::heap_block(Histogram::kChunkBytes));
  EXPECT_LT(retired, with_process / 2);
}

// A record a view still holds is cloned by the next write, sharing its threads, and a
// thread is cloned when it is first written: the old record without its threads, and
// each old thread written, are counted as a view's copies until the last view holding
// them goes, never against the state budget. A write to one of 200 threads copies that
// thread, not the 200.
TEST_F(ChargeTest, WritesUnderAViewCountTheRecordAndTheThreadsTheyCloneAsViewCopies) {
  for (std::uint32_t tid = 1; tid <= 200; ++tid) events_.push_back(start(tid, 0, tid));
  send();
  const std::uint64_t charged_before = charged();
  EXPECT_EQ(collector_->freeze()->table().view_copy_bytes, 0u);
  auto held = collector_->freeze();
  events_.push_back(end(1, 0, 1'000));
  send();
  const std::uint64_t one = collector_->freeze()->table().view_copy_bytes;
  EXPECT_GT(one, heap::new_thread_bytes());  // the record's own and thread 1
  EXPECT_LT(one, charged_before / 2) << "the threads not written were copied too";
  events_.push_back(end(2, 0, 1'000));
  send();
  const std::uint64_t two = collector_->freeze()->table().view_copy_bytes;
  EXPECT_GT(two, one);                             // thread 2 too
  EXPECT_LT(two - one, 2 * charged_before / 200);  // about one thread's share of the charge
  events_.push_back(start(1, 0, 2'000));           // thread 1's clone is the table's own now
  events_.push_back(end(1, 0, 3'000));
  send();
  EXPECT_EQ(collector_->freeze()->table().view_copy_bytes, two);
  EXPECT_LE(charged(), charged_before + heap::heap_block(Histogram::kChunkBytes));
  held.reset();
  EXPECT_EQ(collector_->freeze()->table().view_copy_bytes, 0u);
}

TEST(FreedMemoryTest, TrimsAfterABatchOrADelayAndAtMostOnceASecond) {
  FreedMemory freed;
  constexpr std::uint64_t kSecond = 1'000'000'000;
  std::uint64_t now = 100 * kSecond;
  EXPECT_FALSE(freed.release_if_due(now));  // nothing freed
  freed.freed(1000);
  EXPECT_FALSE(freed.release_if_due(now));  // a little, just now
  now += FreedMemory::kMaxDelayNs;
  EXPECT_TRUE(freed.release_if_due(now));  // a little, long enough ago
  freed.freed(FreedMemory::kBatchBytes);
  EXPECT_FALSE(freed.release_if_due(now + kSecond / 2));  // a batch, but trimmed just now
  EXPECT_TRUE(freed.release_if_due(now + kSecond));
  EXPECT_EQ(freed.trims(), 2u);
}

}  // namespace
}  // namespace steptrace::daemon::test
