// The flight recorder (daemon/state/flight_recorder.h): its window, budget, horizon,
// marks and captures, directly and as the Collector feeds it.
#include "daemon/state/flight_recorder.h"

#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "daemon/state/collector.h"
#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon {
namespace {

using test::DirectClient;
using test::end;
using test::FakeWorld;
using test::span_of;
using test::start;

constexpr std::uint64_t kSecond = 1'000'000'000;
constexpr std::size_t kChunk = sizeof(TraceChunk);
constexpr std::size_t kMark = sizeof(TraceMark);

PeerIdentity peer(std::int32_t pid, std::uint64_t start_time, std::string comm) {
  PeerIdentity p;
  p.key = {pid, start_time};
  p.uid = 1000;
  p.gid = 1000;
  p.comm = std::move(comm);
  return p;
}

// `n` events whose timestamps are first, first + 1, ...: the timestamp names the event.
std::vector<proto::EventRecord> numbered(std::uint64_t first, std::size_t n,
                                         std::uint32_t tid = 1) {
  std::vector<proto::EventRecord> out;
  out.reserve(n);
  for (std::size_t i = 0; i < n; ++i) {
    out.push_back(i % 2 == 0 ? start(tid, 0, first + i) : end(tid, 0, first + i));
  }
  return out;
}

void put(FlightRecorder& r, std::uint32_t handle, const std::vector<proto::EventRecord>& events,
         std::uint64_t now_ns) {
  r.record(handle, span_of(events), now_ns);
}

// The timestamps of a captured process's events, oldest first, as the capture sees them.
std::vector<std::uint64_t> timestamps(const TraceCapture::Process& p) {
  std::vector<std::uint64_t> out;
  for (const auto& ref : p.chunks) {
    for (std::uint32_t i = 0; i < ref.count; ++i) out.push_back(ref.chunk->events[i].timestamp_ns);
  }
  return out;
}

std::vector<std::uint64_t> range(std::uint64_t first, std::size_t n) {
  std::vector<std::uint64_t> out;
  for (std::size_t i = 0; i < n; ++i) out.push_back(first + i);
  return out;
}

const TraceCapture::Process* process_of(const TraceCapture& c, std::int32_t pid) {
  for (const auto& p : c.processes) {
    if (p.key.pid == pid) return &p;
  }
  return nullptr;
}

// What one window costs beyond its chunks (measured, not assumed).
std::size_t window_charge() {
  FlightRecorder probe;
  probe.begin_process(0, peer(1, 1, "probe"));
  return probe.counters().bytes;
}

TraceMark ledger_mark(std::int32_t pid, std::uint64_t ts, std::uint64_t arrived) {
  TraceMark m;
  m.kind = TraceMark::Kind::kLedger;
  m.ts_ns = ts;
  m.arrived_ns = arrived;
  m.sender = {pid, 5};
  m.record.timestamp_ns = ts;
  m.record.reservation_id = ts;  // names the mark
  return m;
}

std::vector<std::uint64_t> mark_ids(const TraceCapture& c) {
  std::vector<std::uint64_t> out;
  for (const auto& m : c.marks) out.push_back(m.record.reservation_id);
  return out;
}

// ---- FlightRecorder directly -----------------------------------------------------------

TEST(FlightRecorderTest, KeepsEventsInOrderAndACaptureSeesTheCountsOfItsInstant) {
  FlightRecorder r;
  r.begin_process(0, peer(100, 5, "trainer"));
  r.begin_process(1, peer(200, 6, "eval"));
  put(r, 0, numbered(1000, 100), 10);
  put(r, 1, numbered(5000, 3, 2), 11);
  put(r, 0, numbered(1100, 200), 12);  // crosses into a second chunk (255 per chunk)

  const auto c = r.capture({}, 0, 13);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_EQ(c->processes[0].key, (ProcessKey{100, 5}));  // by key
  EXPECT_EQ(c->processes[0].comm, "trainer");
  EXPECT_EQ(c->processes[1].key, (ProcessKey{200, 6}));
  EXPECT_EQ(timestamps(c->processes[0]), range(1000, 300));
  EXPECT_EQ(timestamps(c->processes[1]), range(5000, 3));
  ASSERT_EQ(c->processes[0].chunks.size(), 2u);
  EXPECT_EQ(c->processes[0].chunks[0].count, TraceChunk::kEvents);
  EXPECT_EQ(c->processes[0].chunks[1].count, 300 - TraceChunk::kEvents);
  EXPECT_EQ(c->processes[1].chunks[0].count, 3u);
  EXPECT_EQ(c->now_ns, 13u);
  EXPECT_EQ(c->counters.events_recorded, 303u);
  EXPECT_EQ(c->counters.events_evicted, 0u);
  EXPECT_EQ(r.counters().events_recorded, 303u);

  // Appending after the capture: the capture's view does not move.
  const auto tail = c->processes[0].chunks[1];
  put(r, 0, numbered(1300, 10), 14);
  put(r, 1, numbered(5003, 4, 2), 14);
  EXPECT_EQ(c->processes[0].chunks[1].count, 300 - TraceChunk::kEvents);
  EXPECT_EQ(c->processes[1].chunks[0].count, 3u);
  EXPECT_EQ(timestamps(c->processes[0]), range(1000, 300));
  EXPECT_EQ(timestamps(c->processes[1]), range(5000, 3));
  EXPECT_EQ(c->counters.events_recorded, 303u);

  const auto later = r.capture({}, 0, 15);
  ASSERT_EQ(later->processes.size(), 2u);
  ASSERT_EQ(later->processes[0].chunks.size(), 2u);
  EXPECT_EQ(later->processes[0].chunks[1].chunk.get(), tail.chunk.get());  // the same chunk
  EXPECT_EQ(later->processes[0].chunks[1].count, 300 - TraceChunk::kEvents + 10);
  EXPECT_EQ(timestamps(later->processes[0]), range(1000, 310));
  EXPECT_EQ(timestamps(later->processes[1]), range(5000, 7));
  EXPECT_EQ(later->counters.events_recorded, 317u);
}

TEST(FlightRecorderTest, CaptureFiltersProcessesByPid) {
  FlightRecorder r;
  r.begin_process(0, peer(100, 5, "a"));
  r.begin_process(1, peer(200, 6, "b"));
  r.begin_process(2, peer(300, 7, "c"));
  put(r, 0, numbered(0, 2), 1);
  put(r, 1, numbered(10, 2), 1);
  put(r, 2, numbered(20, 2), 1);
  const auto c = r.capture({100, 300}, 0, 2);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_EQ(c->processes[0].key.pid, 100);
  EXPECT_EQ(c->processes[1].key.pid, 300);
  EXPECT_TRUE(r.capture({999}, 0, 2)->processes.empty());
}

// Keeps the newest events within the budget, whatever the batch size.
void expect_budget_keeps_newest(std::size_t batch) {
  SCOPED_TRACE("batch " + std::to_string(batch));
  const std::size_t budget = 8 * kChunk + 4096;
  ASSERT_LT(window_charge(), 4096u);
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "trainer"));
  constexpr std::size_t kTotal = 20 * TraceChunk::kEvents + 100;
  for (std::size_t sent = 0; sent < kTotal; sent += batch) {
    const std::size_t n = std::min(batch, kTotal - sent);
    put(r, 0, numbered(sent, n), 1000 + sent);
    ASSERT_LE(r.counters().bytes, budget) << "after " << sent + n << " events";
  }
  // 8 chunks fit beside the window: the last (100 events) and the 7 full ones before it.
  constexpr std::size_t kRetained = 7 * TraceChunk::kEvents + 100;
  const auto c = r.capture({}, 0, 1'000'000);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].chunks.size(), 8u);
  const auto ts = timestamps(c->processes[0]);
  ASSERT_FALSE(ts.empty());
  EXPECT_EQ(ts.front(), kTotal - kRetained);  // the newest kept: the first is this one
  EXPECT_EQ(ts, range(kTotal - kRetained, kRetained));
  const FlightRecorderCounters k = r.counters();
  EXPECT_EQ(k.events_recorded, kTotal);
  EXPECT_EQ(k.events_evicted, kTotal - kRetained);
  EXPECT_EQ(k.events_recorded - k.events_evicted, ts.size());
  EXPECT_EQ(k.bytes, window_charge() + 8 * kChunk);
  EXPECT_EQ(k.budget_bytes, budget);
}

TEST(FlightRecorderTest, BudgetKeepsTheNewestEventsAndCountsTheEvicted) {
  expect_budget_keeps_newest(1);
  expect_budget_keeps_newest(1000);  // one record() spanning several chunks, evicting midway
  expect_budget_keeps_newest(20 * TraceChunk::kEvents + 100);  // all in one batch
}

TEST(FlightRecorderTest, BudgetIsSharedByAllProcessesOldestChunkFirst) {
  const std::size_t w = window_charge();
  const std::size_t budget = 2 * w + 3 * kChunk;
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  r.begin_process(1, peer(200, 6, "b"));
  put(r, 0, numbered(0, TraceChunk::kEvents), 1);     // A1
  put(r, 1, numbered(1000, TraceChunk::kEvents), 2);  // B1
  put(r, 0, numbered(2000, TraceChunk::kEvents), 3);  // A2
  EXPECT_EQ(r.counters().events_evicted, 0u);
  put(r, 1, numbered(3000, 1), 4);  // B2: A1 is the oldest
  EXPECT_LE(r.counters().bytes, budget);
  EXPECT_EQ(r.counters().events_evicted, TraceChunk::kEvents);
  const auto c = r.capture({}, 0, 5);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_EQ(timestamps(c->processes[0]), range(2000, TraceChunk::kEvents));
  std::vector<std::uint64_t> b = range(1000, TraceChunk::kEvents);
  b.push_back(3000);
  EXPECT_EQ(timestamps(c->processes[1]), b);
}

TEST(FlightRecorderTest, TickEvictsChunksPastTheHorizon) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  r.begin_process(1, peer(200, 6, "b"));
  put(r, 0, numbered(0, 10), 1 * kSecond);
  put(r, 1, numbered(100, 5), 5 * kSecond);
  const std::size_t bytes = r.counters().bytes;

  r.tick(10 * kSecond);  // nothing is 10 s old yet
  EXPECT_EQ(r.counters().events_evicted, 0u);
  EXPECT_EQ(r.capture({}, 0, 10 * kSecond)->processes.size(), 2u);

  r.tick(12 * kSecond);  // A's (1 s) is past 12 - 10; B's (5 s) is not
  EXPECT_EQ(r.counters().events_evicted, 10u);
  EXPECT_EQ(r.counters().bytes, bytes - kChunk);
  auto c = r.capture({}, 0, 12 * kSecond);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].key.pid, 200);
  EXPECT_EQ(timestamps(c->processes[0]), range(100, 5));

  r.tick(16 * kSecond);
  EXPECT_EQ(r.counters().events_evicted, 15u);
  EXPECT_TRUE(r.capture({}, 0, 16 * kSecond)->processes.empty());
  EXPECT_EQ(r.counters().bytes, bytes - 2 * kChunk);
}

TEST(FlightRecorderTest, TickUsesTheLastArrivalOfAChunk) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  put(r, 0, numbered(0, 10), 1 * kSecond);
  put(r, 0, numbered(10, 10), 8 * kSecond);  // the same chunk, arrived again
  r.tick(15 * kSecond);                      // started 14 s ago, last arrival 7 s ago
  EXPECT_EQ(r.counters().events_evicted, 0u);
  EXPECT_EQ(timestamps(r.capture({}, 0, 15 * kSecond)->processes.at(0)), range(0, 20));
  r.tick(19 * kSecond);
  EXPECT_EQ(r.counters().events_evicted, 20u);
}

// A chunk idle past the horizon goes even when a chunk started before it (another
// process's, still being appended to) does not.
TEST(FlightRecorderTest, TickEvictsAnIdleChunkBehindAnActiveOlderOne) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "busy"));
  r.begin_process(1, peer(200, 6, "idle"));
  put(r, 0, numbered(0, 1), 1 * kSecond);    // A's chunk starts first
  put(r, 1, numbered(100, 5), 2 * kSecond);  // B's starts after, and never grows
  put(r, 0, numbered(1, 1), 20 * kSecond);   // A's chunk is appended to: last arrival 20 s
  r.tick(25 * kSecond);  // B's last arrival (2 s) is 23 s old, past the 10 s horizon
  const auto c = r.capture({}, 0, 25 * kSecond);
  EXPECT_EQ(process_of(*c, 200), nullptr) << "B's events are 23 s old, horizon 10 s";
  EXPECT_NE(process_of(*c, 100), nullptr);
  EXPECT_EQ(r.counters().events_evicted, 5u);
}

TEST(FlightRecorderTest, TickEvictsMarksPastTheHorizon) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.mark(ledger_mark(100, 1, 1 * kSecond));
  r.mark(ledger_mark(100, 2, 5 * kSecond));
  r.tick(12 * kSecond);
  EXPECT_EQ(r.counters().marks_evicted, 1u);
  EXPECT_EQ(mark_ids(*r.capture({}, 0, 12 * kSecond)), (std::vector<std::uint64_t>{2}));
  r.tick(16 * kSecond);
  EXPECT_EQ(r.counters().marks_evicted, 2u);
  EXPECT_TRUE(r.capture({}, 0, 16 * kSecond)->marks.empty());
  EXPECT_EQ(r.counters().bytes, 0u);
}

TEST(FlightRecorderTest, MarksShareTheBudgetOldestFirst) {
  const std::size_t budget = 10 * kMark;
  FlightRecorder r({budget, 1000 * kSecond});
  for (std::uint64_t i = 0; i < 25; ++i) {
    r.mark(ledger_mark(100, i, i));
    ASSERT_LE(r.counters().bytes, budget);
  }
  EXPECT_EQ(r.counters().marks_recorded, 25u);
  EXPECT_EQ(r.counters().marks_evicted, 15u);
  EXPECT_EQ(r.counters().bytes, 10 * kMark);
  EXPECT_EQ(mark_ids(*r.capture({}, 0, 100)), range(15, 10));
}

TEST(FlightRecorderTest, ChunksAndMarksAreEvictedTogetherOldestFirst) {
  const std::size_t w = window_charge();
  const std::size_t budget = w + kChunk + 2 * kMark;
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  r.mark(ledger_mark(100, 1, 1));                  // M1
  put(r, 0, numbered(0, TraceChunk::kEvents), 2);  // C1 started at 2
  r.mark(ledger_mark(100, 3, 3));                  // M2: exactly full
  EXPECT_EQ(r.counters().bytes, budget);
  EXPECT_EQ(r.counters().marks_evicted + r.counters().events_evicted, 0u);

  r.mark(ledger_mark(100, 5, 5));  // M3: M1 (1) is older than C1 (2)
  EXPECT_EQ(r.counters().marks_evicted, 1u);
  EXPECT_EQ(r.counters().events_evicted, 0u);
  EXPECT_EQ(mark_ids(*r.capture({}, 0, 6)), (std::vector<std::uint64_t>{3, 5}));

  put(r, 0, numbered(1000, 1), 6);  // C2: C1 (2) is older than M2 (3)
  EXPECT_EQ(r.counters().marks_evicted, 1u);
  EXPECT_EQ(r.counters().events_evicted, TraceChunk::kEvents);
  auto c = r.capture({}, 0, 7);
  EXPECT_EQ(mark_ids(*c), (std::vector<std::uint64_t>{3, 5}));
  EXPECT_EQ(timestamps(c->processes.at(0)), (std::vector<std::uint64_t>{1000}));

  r.mark(ledger_mark(100, 7, 7));  // M4: M2 (3) is older than C2 (6)
  EXPECT_EQ(r.counters().marks_evicted, 2u);
  EXPECT_EQ(r.counters().events_evicted, TraceChunk::kEvents);
  c = r.capture({}, 0, 8);
  EXPECT_EQ(mark_ids(*c), (std::vector<std::uint64_t>{5, 7}));
  EXPECT_EQ(timestamps(c->processes.at(0)), (std::vector<std::uint64_t>{1000}));
  EXPECT_LE(r.counters().bytes, budget);
}

TEST(FlightRecorderTest, CaptureFiltersMarksByPidAndSince) {
  FlightRecorder r;
  r.mark(ledger_mark(100, 10, 1));
  r.mark(ledger_mark(200, 20, 2));
  r.mark(ledger_mark(100, 30, 3));
  TraceMark drop;
  drop.kind = TraceMark::Kind::kDropped;
  drop.ts_ns = drop.arrived_ns = 40;
  drop.sender = {200, 6};
  drop.record.reservation_id = 40;
  drop.dropped = 3;
  r.mark(drop);
  r.mark(ledger_mark(100, 15, 5));  // stamped earlier than it arrived: arrival order kept

  EXPECT_EQ(mark_ids(*r.capture({}, 0, 50)), (std::vector<std::uint64_t>{10, 20, 30, 40, 15}));
  EXPECT_EQ(mark_ids(*r.capture({100}, 0, 50)), (std::vector<std::uint64_t>{10, 30, 15}));
  EXPECT_EQ(mark_ids(*r.capture({200}, 0, 50)), (std::vector<std::uint64_t>{20, 40}));
  EXPECT_EQ(mark_ids(*r.capture({}, 20, 50)), (std::vector<std::uint64_t>{20, 30, 40}));
  EXPECT_EQ(mark_ids(*r.capture({100}, 15, 50)), (std::vector<std::uint64_t>{30, 15}));
  EXPECT_TRUE(r.capture({300}, 0, 50)->marks.empty());
  const auto c = r.capture({200}, 0, 50);
  ASSERT_EQ(c->marks.size(), 2u);
  EXPECT_EQ(c->marks[1].kind, TraceMark::Kind::kDropped);
  EXPECT_EQ(c->marks[1].dropped, 3u);
}

TEST(FlightRecorderTest, ACapturedChunkIsNeverRecycled) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  put(r, 0, numbered(0, TraceChunk::kEvents + 45), 1 * kSecond);  // a full chunk and one more
  const auto c = r.capture({}, 0, 1 * kSecond);
  ASSERT_EQ(c->processes.size(), 1u);
  ASSERT_EQ(c->processes[0].chunks.size(), 2u);

  r.tick(100 * kSecond);  // everything goes
  EXPECT_EQ(r.counters().events_evicted, TraceChunk::kEvents + 45);
  EXPECT_TRUE(r.capture({}, 0, 100 * kSecond)->processes.empty());

  // New events, more than the two evicted chunks hold: any spare chunk is taken.
  put(r, 0, numbered(50'000, 3 * TraceChunk::kEvents), 100 * kSecond);
  EXPECT_EQ(timestamps(c->processes[0]), range(0, TraceChunk::kEvents + 45));
  EXPECT_EQ(c->processes[0].chunks[0].chunk->events[0].timestamp_ns, 0u);
  EXPECT_EQ(c->processes[0].chunks[1].chunk->events[0].timestamp_ns, TraceChunk::kEvents);
  const auto now = r.capture({}, 0, 100 * kSecond);
  ASSERT_EQ(now->processes.size(), 1u);
  EXPECT_EQ(timestamps(now->processes[0]), range(50'000, 3 * TraceChunk::kEvents));
  for (const auto& fresh : now->processes[0].chunks) {
    for (const auto& old : c->processes[0].chunks) EXPECT_NE(fresh.chunk.get(), old.chunk.get());
  }
}

TEST(FlightRecorderTest, AnEvictedChunkNoCaptureHoldsIsReusedEmpty) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  put(r, 0, numbered(0, 200), 1 * kSecond);
  r.tick(100 * kSecond);
  put(r, 0, numbered(7000, 3), 100 * kSecond);  // a recycled chunk must start empty
  const auto c = r.capture({}, 0, 100 * kSecond);
  ASSERT_EQ(c->processes.size(), 1u);
  ASSERT_EQ(c->processes[0].chunks.size(), 1u);
  EXPECT_EQ(c->processes[0].chunks[0].count, 3u);
  EXPECT_EQ(timestamps(c->processes[0]), range(7000, 3));
}

// A chunk a capture held is reused once the capture has let go of it (the render thread
// releasing it is paired with an acquire fence before ingest writes it again); one a
// capture still holds when it is evicted is left to the capture.
TEST(FlightRecorderTest, AChunkIsReusedOnlyOnceNoCaptureHoldsIt) {
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  r.begin_process(1, peer(200, 6, "b"));
  put(r, 0, numbered(0, TraceChunk::kEvents), 1 * kSecond);  // A
  auto first = r.capture({}, 0, 1 * kSecond);
  ASSERT_EQ(first->processes.at(0).chunks.size(), 1u);
  const TraceChunk* a = first->processes[0].chunks[0].chunk.get();
  first.reset();  // let go before A is evicted

  put(r, 1, numbered(1000, TraceChunk::kEvents), 2 * kSecond);  // B
  const auto second = r.capture({200}, 0, 2 * kSecond);         // holds B only
  ASSERT_EQ(second->processes.at(0).chunks.size(), 1u);
  const TraceChunk* b = second->processes[0].chunks[0].chunk.get();

  r.tick(11'500'000'000);  // A goes: no capture holds it, it is kept for reuse
  r.tick(12'500'000'000);  // B goes: the second capture holds it
  EXPECT_EQ(r.counters().events_evicted, 2 * TraceChunk::kEvents);
  put(r, 0, numbered(5000, 2 * TraceChunk::kEvents), 13 * kSecond);
  const auto third = r.capture({}, 0, 13 * kSecond);
  ASSERT_EQ(third->processes.size(), 1u);
  ASSERT_EQ(third->processes[0].chunks.size(), 2u);
  EXPECT_EQ(third->processes[0].chunks[0].chunk.get(), a) << "A is reused";
  EXPECT_NE(third->processes[0].chunks[1].chunk.get(), b) << "B is not";
  EXPECT_EQ(timestamps(third->processes[0]), range(5000, 2 * TraceChunk::kEvents));
  EXPECT_EQ(timestamps(second->processes[0]), range(1000, TraceChunk::kEvents));
}

// Chunks started after a capture are reused without looking at their owners, so a
// capture made after them must still keep them: evicting everything, while captures
// made before and after each batch live, never changes what any capture reads.
TEST(FlightRecorderTest, EveryCaptureKeepsItsChunksWhateverCameBeforeOrAfterIt) {
  const std::size_t budget = window_charge() + 3 * kChunk;
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  std::vector<std::shared_ptr<TraceCapture>> held;
  std::vector<std::vector<std::uint64_t>> seen;
  std::uint64_t next = 0;
  for (int round = 0; round < 40; ++round) {
    const std::size_t n = TraceChunk::kEvents / 2 + static_cast<std::size_t>(round) * 11;
    put(r, 0, numbered(next, n), static_cast<std::uint64_t>(round));
    next += n;
    if (round % 4 == 1) {
      held.push_back(r.capture({}, 0, static_cast<std::uint64_t>(round)));
      seen.push_back(timestamps(held.back()->processes.at(0)));
    }
    if (round % 8 == 7) {  // let go of the oldest capture now and then
      held.erase(held.begin());
      seen.erase(seen.begin());
    }
    for (std::size_t i = 0; i < held.size(); ++i) {
      ASSERT_EQ(timestamps(held[i]->processes.at(0)), seen[i]) << "round " << round;
    }
  }
  const FlightRecorderCounters k = r.counters();
  EXPECT_EQ(k.events_recorded, next);
  EXPECT_LE(k.bytes, budget);
}

// Batches of every size, at every offset in a chunk: what a capture reads is what came
// in, whichever way each batch was copied (whole cache lines are streamed).
TEST(FlightRecorderTest, EventsAreCopiedExactlyWhateverTheBatchSizeAndOffset) {
  FlightRecorder r({32u << 20, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  std::vector<proto::EventRecord> sent;
  for (std::size_t n = 1; n <= 2 * TraceChunk::kEvents + 3; n += (n < 40 ? 1 : 7)) {
    // Every byte of each record set (the recorder copies what it is given as it is).
    std::vector<proto::EventRecord> batch(n);
    for (std::size_t i = 0; i < n; ++i) {
      const std::size_t k = sent.size() + i;
      batch[i] = {k, static_cast<std::uint32_t>(0xA5A5A5A5u ^ k),
                  static_cast<std::uint16_t>(0x8000u | (k * 7)),
                  static_cast<std::uint8_t>(1 + k % 250),
                  static_cast<std::uint8_t>(0xFFu - k % 200)};
    }
    put(r, 0, batch, 1);
    sent.insert(sent.end(), batch.begin(), batch.end());
  }
  const auto c = r.capture({}, 0, 2);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(timestamps(c->processes[0]), range(0, sent.size()));
  // Every byte, not only the timestamps.
  std::size_t i = 0;
  for (const auto& ref : c->processes[0].chunks) {
    for (std::uint32_t k = 0; k < ref.count; ++k, ++i) {
      ASSERT_LT(i, sent.size());
      ASSERT_EQ(std::memcmp(&ref.chunk->events[k], &sent[i], sizeof sent[i]), 0) << "event " << i;
    }
  }
  EXPECT_EQ(i, sent.size());
  EXPECT_EQ(r.counters().events_recorded, sent.size());
}

// Captures read on another thread and let go there while ingest goes on and evicts (the
// render thread's part): what a capture reads never changes under it. (Run under the
// sanitizers, a chunk reused or freed too early shows.)
TEST(FlightRecorderTest, CapturesReadOnAnotherThreadWhileIngestReusesChunks) {
  const std::size_t budget = window_charge() + 8 * kChunk;
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<TraceCapture>> handed;
  bool done = false;
  std::atomic<std::uint64_t> bad{0};
  std::atomic<std::uint64_t> read{0};
  std::thread render([&] {
    for (;;) {
      std::shared_ptr<TraceCapture> c;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return done || !handed.empty(); });
        if (handed.empty()) return;
        c = std::move(handed.front());
        handed.pop_front();
      }
      // Each capture's events are consecutive: the first names the rest.
      for (int pass = 0; pass < 2 && !c->processes.empty(); ++pass) {
        const auto ts = timestamps(c->processes[0]);
        for (std::size_t i = 1; i < ts.size(); ++i) {
          if (ts[i] != ts[0] + i) bad.fetch_add(1, std::memory_order_relaxed);
        }
        read.fetch_add(ts.size(), std::memory_order_relaxed);
      }
    }  // the capture is let go here, on this thread
  });
  std::uint64_t next = 0;
  for (int round = 0; round < 400; ++round) {
    const std::size_t n = 1 + static_cast<std::size_t>(round * 37) % 700;
    put(r, 0, numbered(next, n), static_cast<std::uint64_t>(round));
    next += n;
    if (round % 3 == 0) {
      auto c = r.capture({}, 0, static_cast<std::uint64_t>(round));
      std::lock_guard lock(mu);
      handed.push_back(std::move(c));
      cv.notify_one();
    }
  }
  {
    std::lock_guard lock(mu);
    done = true;
  }
  cv.notify_one();
  render.join();
  EXPECT_EQ(bad.load(), 0u);
  EXPECT_GT(read.load(), 0u);
  const FlightRecorderCounters k = r.counters();
  EXPECT_EQ(k.events_recorded, next);
  EXPECT_LE(k.bytes, budget);
}

// Custom step names stay while their window does: together they are held to half the
// budget, so that processes with many custom steps cannot take all of it. A window that
// goes gives its share back.
TEST(FlightRecorderTest, CustomStepNamesAreHeldToAShareOfTheBudget) {
  const std::size_t w = window_charge();
  std::size_t name = 0;  // what one name is charged (measured)
  {
    FlightRecorder probe;
    probe.begin_process(0, peer(1, 1, "probe"));
    probe.register_step(0, 256, "x");
    name = probe.counters().bytes - w;
  }
  ASSERT_GT(name, 0u);
  const std::size_t budget = 4 * (w + kChunk);
  const std::size_t kept = budget / FlightRecorderConfig::kNameShare / name;  // names at most
  ASSERT_GT(kept, 10u);
  FlightRecorder r({budget, 1000 * kSecond});
  r.begin_process(0, peer(100, 5, "a"));
  r.begin_process(1, peer(200, 6, "b"));
  const auto id = [](std::size_t i) { return static_cast<std::uint32_t>(256 + i); };
  for (std::size_t i = 0; i < kept - 5; ++i) r.register_step(0, id(i), "a" + std::to_string(i));
  for (std::size_t i = 0; i < 15; ++i) r.register_step(1, id(i), "b" + std::to_string(i));
  EXPECT_EQ(r.counters().bytes, 2 * w + kept * name);
  put(r, 1, numbered(0, 1), 1);
  EXPECT_EQ(r.counters().bytes, 2 * w + kept * name + kChunk);
  auto c = r.capture({}, 0, 2);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].names->size(), 5u);  // b's first 5 only
  EXPECT_EQ(c->processes[0].names->at(id(0)), "b0");
  EXPECT_FALSE(c->processes[0].names->contains(id(5)));

  // Process a goes (its slot is taken by another, and it has no chunk): its names' share
  // is free again.
  r.begin_process(0, peer(300, 7, "c"));
  EXPECT_EQ(r.counters().bytes, 2 * w + 5 * name + kChunk);
  for (std::size_t i = 5; i < 15; ++i) r.register_step(1, id(i), "b" + std::to_string(i));
  c = r.capture({}, 0, 3);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].names->size(), 15u);
  EXPECT_EQ(c->processes[0].names->at(id(14)), "b14");
  EXPECT_LE(r.counters().bytes, budget);

  // With the standing window off, names are held to a share of a capture's budget.
  FlightRecorder off({0, 1000 * kSecond});
  off.begin_process(0, peer(100, 5, "a"));
  for (std::size_t i = 0; i < 100; ++i) off.register_step(0, id(i), "s" + std::to_string(i));
  EXPECT_EQ(off.counters().bytes, w + 100 * name);
}

TEST(FlightRecorderTest, AReusedSlotOrphansTheOldWindowUntilItsChunksGo) {
  const std::size_t w = window_charge();
  FlightRecorder r({32u << 20, 10 * kSecond});
  r.begin_process(0, peer(100, 5, "old"));
  r.register_step(0, 256, "fetch");
  put(r, 0, numbered(0, 4), 1 * kSecond);
  r.begin_process(0, peer(200, 6, "new"));  // the slot goes to another process
  put(r, 0, numbered(900, 2), 5 * kSecond);

  auto c = r.capture({}, 0, 6 * kSecond);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_EQ(c->processes[0].key, (ProcessKey{100, 5}));
  EXPECT_EQ(c->processes[0].comm, "old");
  EXPECT_EQ(timestamps(c->processes[0]), range(0, 4));
  ASSERT_TRUE(c->processes[0].names);
  EXPECT_EQ(c->processes[0].names->at(256), "fetch");
  EXPECT_EQ(c->processes[1].key, (ProcessKey{200, 6}));
  EXPECT_EQ(c->processes[1].comm, "new");
  EXPECT_EQ(timestamps(c->processes[1]), range(900, 2));
  EXPECT_TRUE(c->processes[1].names->empty());
  EXPECT_EQ(process_of(*r.capture({100}, 0, 6 * kSecond), 100)->key.start_time, 5u);

  r.tick(12 * kSecond);  // the orphan's only chunk goes, and with it the orphan
  c = r.capture({}, 0, 12 * kSecond);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].key.pid, 200);
  EXPECT_EQ(r.counters().bytes, w + kChunk);  // the live window and its chunk

  r.begin_process(0, peer(200, 6, "new"));  // the same process again: its window stays
  put(r, 0, numbered(902, 1), 13 * kSecond);
  c = r.capture({}, 0, 13 * kSecond);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(timestamps(c->processes[0]), range(900, 3));
  EXPECT_EQ(r.counters().bytes, w + kChunk);
}

TEST(FlightRecorderTest, AReusedSlotWithoutChunksIsReplacedAndUncharged) {
  const std::size_t w = window_charge();
  FlightRecorder r;
  r.begin_process(0, peer(100, 5, "old"));
  r.begin_process(0, peer(200, 6, "new"));
  EXPECT_EQ(r.counters().bytes, w);
  put(r, 0, numbered(0, 1), 1);
  const auto c = r.capture({}, 0, 2);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].key.pid, 200);
}

TEST(FlightRecorderTest, StepNamesAreCopiedOnWrite) {
  FlightRecorder r;
  r.begin_process(0, peer(100, 5, "a"));
  put(r, 0, numbered(0, 1), 1);
  r.register_step(0, 256, "fetch");
  const auto first = r.capture({}, 0, 2);
  r.register_step(0, 300, "optimizer");
  r.register_step(0, 256, "renamed");  // an id keeps its first name
  const auto second = r.capture({}, 0, 3);

  ASSERT_EQ(first->processes.size(), 1u);
  ASSERT_EQ(second->processes.size(), 1u);
  const StepNames& before = *first->processes[0].names;
  const StepNames& after = *second->processes[0].names;
  EXPECT_EQ(before, (StepNames{{256, "fetch"}}));
  EXPECT_EQ(after, (StepNames{{256, "fetch"}, {300, "optimizer"}}));
  EXPECT_NE(first->processes[0].names.get(), second->processes[0].names.get());
  // Registration on an unknown slot is ignored.
  r.register_step(7, 256, "nobody");
  EXPECT_EQ(r.capture({}, 0, 4)->processes.size(), 1u);
}

TEST(FlightRecorderTest, BudgetZeroRecordsOnlyDuringACapture) {
  const std::size_t w = window_charge();
  FlightRecorder r({0, 1000 * kSecond});
  EXPECT_FALSE(r.on());
  r.begin_process(0, peer(100, 5, "a"));
  put(r, 0, numbered(0, 10), 1);
  r.mark(ledger_mark(100, 1, 1));
  EXPECT_EQ(r.counters().events_recorded, 0u);
  EXPECT_EQ(r.counters().marks_recorded, 0u);
  EXPECT_EQ(r.counters().budget_bytes, 0u);
  auto c = r.capture({}, 0, 2);
  EXPECT_TRUE(c->processes.empty());
  EXPECT_TRUE(c->marks.empty());

  r.begin_capture();
  EXPECT_TRUE(r.on());
  EXPECT_EQ(r.counters().budget_bytes, FlightRecorderConfig::kCaptureBudget);
  EXPECT_EQ(r.counters().captures_active, 1u);
  put(r, 0, numbered(100, 1000), 3);
  r.mark(ledger_mark(100, 4, 4));
  r.mark(ledger_mark(100, 5, 5));
  EXPECT_EQ(r.counters().events_recorded, 1000u);
  EXPECT_EQ(r.counters().marks_recorded, 2u);
  c = r.capture({}, 0, 6);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(timestamps(c->processes[0]), range(100, 1000));
  EXPECT_EQ(c->marks.size(), 2u);
  EXPECT_EQ(c->counters.captures_active, 1u);

  r.begin_capture();  // a second capture at once: the first end keeps recording on
  r.end_capture();
  EXPECT_TRUE(r.on());
  EXPECT_EQ(r.counters().events_evicted, 0u);
  r.end_capture();
  EXPECT_FALSE(r.on());
  const FlightRecorderCounters k = r.counters();
  EXPECT_EQ(k.budget_bytes, 0u);
  EXPECT_EQ(k.captures_active, 0u);
  EXPECT_EQ(k.events_evicted, 1000u);
  EXPECT_EQ(k.marks_evicted, 2u);
  EXPECT_EQ(k.bytes, w);  // no chunk and no mark is charged: only the live window
  EXPECT_TRUE(r.capture({}, 0, 7)->processes.empty());
  EXPECT_TRUE(r.capture({}, 0, 7)->marks.empty());
  // The capture made during it still reads its events.
  EXPECT_EQ(timestamps(c->processes[0]), range(100, 1000));

  put(r, 0, numbered(5000, 10), 8);  // off again
  EXPECT_EQ(r.counters().events_recorded, 1000u);
  r.end_capture();  // unmatched: nothing happens
  EXPECT_FALSE(r.on());
  EXPECT_EQ(r.counters().captures_active, 0u);
}

TEST(FlightRecorderTest, ACaptureKeepsALargerStandingBudget) {
  const std::size_t big = FlightRecorderConfig::kCaptureBudget * 2;
  FlightRecorder r({big, 1000 * kSecond});
  r.begin_capture();
  EXPECT_EQ(r.counters().budget_bytes, big);
  r.end_capture();
  EXPECT_EQ(r.counters().budget_bytes, big);
  EXPECT_TRUE(r.on());
}

// ---- through the Collector ------------------------------------------------------------

constexpr std::uint32_t kForward = 0;
constexpr std::uint32_t kBackward = 1;
constexpr std::uint32_t kCustom = proto::kFirstCustomStep;

proto::LedgerRecord release_record(std::string_view gpu, std::uint64_t id, std::uint64_t ts) {
  proto::LedgerRecord r = test::reserve_record(gpu, id, 0, "", 1, ts);
  r.op = static_cast<std::uint8_t>(proto::LedgerOp::kRelease);
  return r;
}

std::vector<std::uint64_t> event_timestamps(const TraceCapture& c, std::int32_t pid) {
  const TraceCapture::Process* p = process_of(c, pid);
  return p ? timestamps(*p) : std::vector<std::uint64_t>{};
}

class FlightRecorderCollectorTest : public ::testing::Test {
 protected:
  FakeWorld world_;
  Limits limits_;
};

TEST_F(FlightRecorderCollectorTest, RecordsEventsStepsLedgerAndDrops) {
  Collector collector(limits_, world_.env());
  const PeerIdentity a_peer = world_.spawn(100, 5, "trainer");
  const PeerIdentity b_peer = world_.spawn(200, 6, "eval");
  DirectClient a(collector, a_peer);
  auto b = std::make_unique<DirectClient>(collector, b_peer);
  ASSERT_FALSE(a.attach_error());
  ASSERT_FALSE(b->attach_error());

  ASSERT_FALSE(a.register_step(kCustom, "fetch"));
  ASSERT_FALSE(a.events({start(1, kForward, 1000), start(1, kCustom, 1100), end(1, kCustom, 1200),
                         end(1, kForward, 1500)}));
  ASSERT_FALSE(b->events({start(2, kBackward, 2000), end(2, kBackward, 2500)}));

  world_.now_ns += kSecond;
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "qlora", 1, 3000));
  a.ledger(release_record("GPU-x", 1, 3100));
  a.ledger(release_record("GPU-x", 99, 3200));  // unknown: refused

  world_.now_ns += kSecond;
  const std::uint64_t drop_at = world_.now_ns;
  b->dropped_by_cause({{5, 0, 0, 0}});
  b->dropped_by_cause({{5, 0, 0, 0}});  // the same cumulative report again

  auto c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_EQ(c->processes[0].key, a_peer.key);
  EXPECT_EQ(c->processes[0].comm, "trainer");
  EXPECT_TRUE(c->processes[0].alive);
  ASSERT_TRUE(c->processes[0].names);
  EXPECT_EQ(*c->processes[0].names, (StepNames{{kCustom, "fetch"}}));
  EXPECT_EQ(c->processes[1].key, b_peer.key);
  EXPECT_TRUE(c->processes[1].alive);
  EXPECT_EQ(event_timestamps(*c, 100), (std::vector<std::uint64_t>{1000, 1100, 1200, 1500}));
  EXPECT_EQ(event_timestamps(*c, 200), (std::vector<std::uint64_t>{2000, 2500}));
  {
    const auto& ev = c->processes[0].chunks.at(0).chunk->events;
    EXPECT_EQ(ev[1].step, kCustom);
    EXPECT_EQ(ev[1].kind, static_cast<std::uint8_t>(proto::EventKind::kStart));
    EXPECT_EQ(ev[3].kind, static_cast<std::uint8_t>(proto::EventKind::kEnd));
    EXPECT_EQ(ev[0].thread_id, 1u);
  }

  ASSERT_EQ(c->marks.size(), 4u);
  const TraceMark& reserve = c->marks[0];
  EXPECT_EQ(reserve.kind, TraceMark::Kind::kLedger);
  EXPECT_EQ(reserve.sender, a_peer.key);
  EXPECT_EQ(reserve.ts_ns, 3000u);
  EXPECT_EQ(reserve.arrived_ns, world_.now_ns - kSecond);
  EXPECT_EQ(reserve.record.op, static_cast<std::uint8_t>(proto::LedgerOp::kReserve));
  EXPECT_EQ(reserve.record.reservation_id, 1u);
  EXPECT_TRUE(reserve.applied);
  EXPECT_EQ(reserve.gpu_reserved_bytes, 4096u);
  const TraceMark& release = c->marks[1];
  EXPECT_EQ(release.record.op, static_cast<std::uint8_t>(proto::LedgerOp::kRelease));
  EXPECT_TRUE(release.applied);
  EXPECT_EQ(release.gpu_reserved_bytes, 0u);
  const TraceMark& refused = c->marks[2];
  EXPECT_EQ(refused.record.reservation_id, 99u);
  EXPECT_FALSE(refused.applied);
  EXPECT_EQ(refused.gpu_reserved_bytes, 0u);
  const TraceMark& drop = c->marks[3];
  EXPECT_EQ(drop.kind, TraceMark::Kind::kDropped);
  EXPECT_EQ(drop.sender, b_peer.key);
  EXPECT_EQ(drop.cause, static_cast<std::uint8_t>(proto::DropCause::kBufferFull));
  EXPECT_EQ(drop.dropped, 5u);
  EXPECT_EQ(drop.ts_ns, drop_at);
  EXPECT_EQ(c->counters.marks_recorded, 4u);
  EXPECT_EQ(c->counters.events_recorded, 6u);

  // Raised again: only the difference.
  b->dropped_by_cause({{7, 1, 0, 0}});
  c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->marks.size(), 6u);
  EXPECT_EQ(c->marks[4].cause, 0u);
  EXPECT_EQ(c->marks[4].dropped, 2u);
  EXPECT_EQ(c->marks[5].cause, 1u);
  EXPECT_EQ(c->marks[5].dropped, 1u);

  // By pid, and by since.
  c = collector.capture_trace({200}, 0);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].key, b_peer.key);
  ASSERT_EQ(c->marks.size(), 3u);
  for (const auto& m : c->marks) EXPECT_EQ(m.sender, b_peer.key);
  c = collector.capture_trace({100}, 3100);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].key, a_peer.key);
  ASSERT_EQ(c->marks.size(), 2u);
  EXPECT_EQ(c->marks[0].record.reservation_id, 1u);
  EXPECT_EQ(c->marks[1].record.reservation_id, 99u);

  // b exits: its window stays, not alive.
  b.reset();
  world_.kill(200);
  collector.refresh_liveness();
  c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->processes.size(), 2u);
  EXPECT_TRUE(c->processes[0].alive);
  EXPECT_EQ(c->processes[1].key, b_peer.key);
  EXPECT_FALSE(c->processes[1].alive);
  EXPECT_EQ(event_timestamps(*c, 200), (std::vector<std::uint64_t>{2000, 2500}));
  EXPECT_EQ(collector.freeze()->counters().flight_recorder.events_recorded, 6u);
}

TEST_F(FlightRecorderCollectorTest, AVersionOneDropReportIsAMarkWithoutCause) {
  Collector collector(limits_, world_.env());
  DirectClient a(collector, world_.spawn(100, 5, "trainer"));
  a.dropped(4);
  a.dropped(4);
  const auto c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->marks.size(), 1u);
  EXPECT_EQ(c->marks[0].kind, TraceMark::Kind::kDropped);
  EXPECT_EQ(c->marks[0].cause, kDropNoCause);
  EXPECT_EQ(c->marks[0].dropped, 4u);
}

// Events the daemon could not fold are marked where they happened: starts past
// max_open_depth, and a thread past max_threads_per_process, one mark per batch and cause
// stamped with the first lost event, while the events stay in the window.
TEST_F(FlightRecorderCollectorTest, TheDaemonsOwnDropsAreMarkedAtTheFirstLostEvent) {
  Limits limits = limits_;
  limits.max_open_depth = 2;
  limits.max_threads_per_process = 1;
  Collector collector(limits, world_.env());
  DirectClient a(collector, world_.spawn(100, 5, "trainer"));
  const auto start = [](std::uint64_t ts, std::uint32_t tid) {
    return proto::EventRecord{ts, tid, 0, static_cast<std::uint8_t>(proto::EventKind::kStart), 0};
  };
  ASSERT_FALSE(a.events({start(1000, 7), start(2000, 7), start(3000, 7), start(4000, 7),
                         start(5000, 8), start(6000, 8)}));
  const auto c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->marks.size(), 2u);
  EXPECT_EQ(c->marks[0].cause, kDaemonDropOpenDepth);
  EXPECT_EQ(c->marks[0].dropped, 2u);
  EXPECT_EQ(c->marks[0].ts_ns, 3000u);
  EXPECT_EQ(c->marks[1].cause, kDaemonDropStateLimit);
  EXPECT_EQ(c->marks[1].dropped, 2u);
  EXPECT_EQ(c->marks[1].ts_ns, 5000u);
  ASSERT_EQ(c->processes.size(), 1u);
  EXPECT_EQ(c->processes[0].chunks.at(0).count, 6u);
  EXPECT_EQ(trace_drop_cause(kDaemonDropOpenDepth), "max_open_depth");
  EXPECT_EQ(trace_drop_cause(kDaemonDropStateLimit), "state_limits");
}

// The ledger mark says what the view did even while a frozen view shares its state.
TEST_F(FlightRecorderCollectorTest, LedgerMarksAreRightWhileAViewIsHeld) {
  Collector collector(limits_, world_.env());
  DirectClient a(collector, world_.spawn(100, 5, "trainer"));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "qlora", 1, 3000));
  const auto view = collector.freeze();  // shares the ledger's state (copy on write)
  a.ledger(test::reserve_record("GPU-x", 2, 1024, "qlora", 1, 3100));
  const auto view2 = collector.freeze();
  a.ledger(release_record("GPU-x", 1, 3200));
  const auto c = collector.capture_trace({}, 0);
  ASSERT_EQ(c->marks.size(), 3u);
  EXPECT_TRUE(c->marks[0].applied);
  EXPECT_EQ(c->marks[0].gpu_reserved_bytes, 4096u);
  EXPECT_TRUE(c->marks[1].applied);
  EXPECT_EQ(c->marks[1].gpu_reserved_bytes, 4096u + 1024u);
  EXPECT_TRUE(c->marks[2].applied);
  EXPECT_EQ(c->marks[2].gpu_reserved_bytes, 1024u);
}

TEST_F(FlightRecorderCollectorTest, EventsAfterABadOneAreNotRecorded) {
  Collector collector(limits_, world_.env());
  DirectClient a(collector, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(a.events({start(1, kForward, 10)}));
  const std::error_code ec = a.events({end(1, kForward, 20), start(1, kForward, 30),
                                       start(1, kCustom + 5, 40),  // never registered
                                       end(1, kForward, 50), start(1, kBackward, 60)});
  EXPECT_EQ(ec, make_error_code(errc::unregistered_step));
  const auto c = collector.capture_trace({}, 0);
  EXPECT_EQ(event_timestamps(*c, 100), (std::vector<std::uint64_t>{10, 20, 30}));
  EXPECT_EQ(c->counters.events_recorded, 3u);
}

TEST_F(FlightRecorderCollectorTest, EventsAfterABadOneAreNotRecordedDirectCall) {
  Collector collector(limits_, world_.env());
  ProcessHandle h = 0;
  ASSERT_FALSE(collector.attach(world_.spawn(100, 5, "trainer"), h));
  const std::vector<proto::EventRecord> batch = {start(1, kForward, 10), end(1, kForward, 20),
                                                 start(1, kCustom, 30), start(1, kForward, 40)};
  EXPECT_EQ(collector.events(h, span_of(batch)), make_error_code(errc::unregistered_step));
  const auto c = collector.capture_trace({}, 0);
  EXPECT_EQ(event_timestamps(*c, 100), (std::vector<std::uint64_t>{10, 20}));
}

TEST_F(FlightRecorderCollectorTest, BudgetZeroRecordsNothing) {
  Collector collector(limits_, world_.env(), FlightRecorderConfig{0, 300 * kSecond});
  EXPECT_FALSE(collector.recorder().on());
  DirectClient a(collector, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(a.register_step(kCustom, "fetch"));
  ASSERT_FALSE(a.events({start(1, kForward, 1000), end(1, kForward, 1500)}));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "qlora", 1, 3000));
  a.dropped_by_cause({{5, 0, 0, 0}});
  collector.refresh_liveness();
  const auto c = collector.capture_trace({}, 0);
  EXPECT_TRUE(c->processes.empty());
  EXPECT_TRUE(c->marks.empty());
  const FlightRecorderCounters k = collector.freeze()->counters().flight_recorder;
  EXPECT_EQ(k.events_recorded, 0u);
  EXPECT_EQ(k.marks_recorded, 0u);
  EXPECT_EQ(k.budget_bytes, 0u);
  // The ingest itself went on.
  EXPECT_EQ(collector.counters().events_received, 2u);

  // `trace --for` turns it on for a while.
  collector.recorder().begin_capture();
  ASSERT_FALSE(a.events({start(1, kForward, 2000)}));
  EXPECT_EQ(event_timestamps(*collector.capture_trace({}, 0), 100),
            (std::vector<std::uint64_t>{2000}));
  collector.recorder().end_capture();
  EXPECT_TRUE(collector.capture_trace({}, 0)->processes.empty());
}

}  // namespace
}  // namespace steptrace::daemon
