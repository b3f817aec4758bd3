#include "daemon/state/collector.h"
#include "daemon/report/report.h"

#include <sys/wait.h>
#include <time.h>

#include <unistd.h>
#include <limits>

#include <gtest/gtest.h>

#include <sstream>

#include <atomic>
#include <thread>

#include <nlohmann/json.hpp>

#include "daemon/state/collector_state.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;

constexpr std::uint32_t kForward = 0;
constexpr std::uint32_t kBackward = 1;
constexpr std::uint32_t kMatmul = 2;
constexpr std::uint32_t kWaitPoll = 10;

// The step object `name` of the process `pid` in report_json, or null.
json step_of(const json& report, std::int32_t pid, std::string_view name) {
  for (const auto& p : report["processes"]) {
    if (p["pid"] != pid) continue;
    for (const auto& s : p["steps"]) {
      if (s["step"] == name) return s;
    }
  }
  return nullptr;
}
json process_of(const json& report, std::int32_t pid) {
  for (const auto& p : report["processes"]) {
    if (p["pid"] == pid) return p;
  }
  return nullptr;
}
json total_of(const json& report, std::string_view name) {
  for (const auto& t : report["totals"]) {
    if (t["step"] == name) return t;
  }
  return nullptr;
}

class CollectorTest : public ::testing::Test {
 protected:
  FakeWorld world_;
  Limits limits_;
  std::unique_ptr<Collector> collector_;
  void SetUp() override { make(); }
  void make() { collector_ = std::make_unique<Collector>(limits_, world_.env()); }
};

TEST_F(CollectorTest, CountsTotalsMinMaxAreExact) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.attach_error());
  ASSERT_FALSE(c.events({start(1, kForward, 1000), end(1, kForward, 1100), start(1, kForward, 2000),
                         end(1, kForward, 2300), start(1, kForward, 3000), end(1, kForward, 3200),
                         start(1, kMatmul, 4000), end(1, kMatmul, 9000)}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  const json f = step_of(r, 100, "Forward");
  ASSERT_FALSE(f.is_null());
  EXPECT_EQ(f["count"], 3);
  EXPECT_EQ(f["total_ns"], 600);
  EXPECT_EQ(f["min_ns"], 100);
  EXPECT_EQ(f["max_ns"], 300);
  EXPECT_NEAR(f["p50_ns"].get<double>(), 200.0, 4.0);
  EXPECT_EQ(f["open"], 0);
  EXPECT_EQ(step_of(r, 100, "Matmul")["total_ns"], 5000);
  EXPECT_TRUE(step_of(r, 100, "Backward").is_null());  // no data: not listed
  EXPECT_EQ(collector_->counters().events_received, 8u);
}

TEST_F(CollectorTest, NestedSpansOfOneStepMatchAsAStack) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kForward, 10), end(1, kForward, 30),
                         end(1, kForward, 100)}));
  const json f = step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward");
  EXPECT_EQ(f["count"], 2);
  EXPECT_EQ(f["min_ns"], 20);   // inner
  EXPECT_EQ(f["max_ns"], 100);  // outer
  EXPECT_EQ(f["total_ns"], 120);
}

TEST_F(CollectorTest, ThreadsHaveTheirOwnStacks) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(2, kForward, 5), end(1, kForward, 10),
                         start(3, kForward, 20), end(2, kForward, 50), end(3, kForward, 21)}));
  const json f = step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward");
  EXPECT_EQ(f["count"], 3);
  EXPECT_EQ(f["total_ns"], 10 + 45 + 1);
  EXPECT_EQ(f["min_ns"], 1);
  EXPECT_EQ(f["max_ns"], 45);
}

TEST_F(CollectorTest, EndWithoutStartIsUnmatched) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({end(1, kForward, 10), start(2, kForward, 0), end(1, kForward, 20)}));
  const json f = step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward");
  EXPECT_EQ(f["unmatched_ends"], 2);  // thread 1 never started one
  EXPECT_EQ(f["count"], 0);
  EXPECT_EQ(f["open"], 1);  // thread 2's start
}

TEST_F(CollectorTest, OpenSpansAreAbandonedWhenTheLastConnectionCloses) {
  const PeerIdentity peer = world_.spawn(100, 5, "trainer");
  Connection a(*collector_, peer);
  Connection b(*collector_, peer);
  ASSERT_EQ(a.handle(), b.handle());  // one process record for both
  ASSERT_FALSE(a.events({start(1, kForward, 0), start(1, kWaitPoll, 5)}));
  a.close();
  json f = step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward");
  EXPECT_EQ(f["open"], 1);  // b still connected
  EXPECT_EQ(f["abandoned"], 0);
  b.close();
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  f = step_of(r, 100, "Forward");
  EXPECT_EQ(f["open"], 0);
  EXPECT_EQ(f["abandoned"], 1);
  EXPECT_EQ(step_of(r, 100, "WaitPoll")["abandoned"], 1);
  EXPECT_EQ(process_of(r, 100)["abandoned"], 2);
  EXPECT_TRUE(process_of(r, 100)["current"].empty());
}

TEST_F(CollectorTest, CustomStepsMergeByNameAcrossProcesses) {
  Connection p1(*collector_, world_.spawn(100, 5, "a"));
  Connection p2(*collector_, world_.spawn(200, 6, "b"));
  ASSERT_FALSE(p1.register_step(256, "Tokenize"));
  ASSERT_FALSE(p2.register_step(300, "Tokenize"));
  ASSERT_FALSE(p2.register_step(301, "Shuffle"));
  ASSERT_FALSE(p1.events({start(1, 256, 0), end(1, 256, 100)}));
  ASSERT_FALSE(p2.events({start(7, 300, 0), end(7, 300, 300), start(7, 301, 0), end(7, 301, 1)}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(r, 100, "Tokenize")["count"], 1);
  EXPECT_EQ(step_of(r, 200, "Tokenize")["count"], 1);
  const json t = total_of(r, "Tokenize");
  ASSERT_FALSE(t.is_null());
  EXPECT_EQ(t["count"], 2);
  EXPECT_EQ(t["total_ns"], 400);
  EXPECT_EQ(t["min_ns"], 100);
  EXPECT_EQ(t["max_ns"], 300);
  EXPECT_EQ(t["processes"], 2);
  EXPECT_EQ(total_of(r, "Shuffle")["processes"], 1);
}

TEST_F(CollectorTest, RegisteringAgainWithAnotherNameFails) {
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(c.register_step(256, "Tokenize"));
  EXPECT_FALSE(c.register_step(256, "Tokenize"));  // same name again: fine
  EXPECT_EQ(c.register_step(256, "Other"), make_error_code(errc::bad_string));
}

TEST_F(CollectorTest, EventForUnregisteredCustomStepFailsAndKeepsEarlierEvents) {
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_EQ(
      c.events({start(1, kForward, 0), end(1, kForward, 50), start(1, 257, 60), end(1, 257, 70)}),
      make_error_code(errc::unregistered_step));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(r, 100, "Forward")["count"], 1);
  EXPECT_EQ(process_of(r, 100)["steps"].size(), 1u);
}

TEST_F(CollectorTest, CustomStepLimitIsCounted) {
  limits_.max_custom_steps = 2;
  make();
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(c.register_step(256, "s1"));
  EXPECT_FALSE(c.register_step(257, "s2"));
  EXPECT_EQ(c.register_step(258, "s3"), make_error_code(errc::limit_reached));
  EXPECT_EQ(collector_->counters().limits_hit.at("max_custom_steps"), 1u);
  // The error closed that connection; the process's known ids are still fine.
  Connection again(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(again.register_step(257, "s2"));
}

TEST_F(CollectorTest, OpenDepthLimitDropsTheStartAndCountsIt) {
  limits_.max_open_depth = 2;
  make();
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kForward, 1), start(1, kForward, 2),
                         end(1, kForward, 10), end(1, kForward, 20), end(1, kForward, 30)}));
  const json f = step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward");
  EXPECT_EQ(f["count"], 2);
  EXPECT_EQ(f["depth_dropped"], 1);
  EXPECT_EQ(f["unmatched_ends"], 1);  // the end of the dropped start
  EXPECT_EQ(collector_->counters().limits_hit.at("max_open_depth"), 1u);
}

TEST_F(CollectorTest, OpenDepthLimitCountsEveryStepOfTheThread) {
  limits_.max_open_depth = 2;
  make();
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  // Two open spans of different steps fill thread 1; a third step's start is dropped.
  // Thread 2 has its own budget.
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kBackward, 1), start(1, kMatmul, 2),
                         start(2, kMatmul, 3), end(1, kMatmul, 10), end(1, kBackward, 20),
                         end(1, kForward, 30), end(2, kMatmul, 40)}));
  const json doc = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(doc, 100, "Forward")["count"], 1);
  EXPECT_EQ(step_of(doc, 100, "Backward")["count"], 1);
  const json m = step_of(doc, 100, "Matmul");
  EXPECT_EQ(m["count"], 1);  // thread 2's
  EXPECT_EQ(m["depth_dropped"], 1);
  EXPECT_EQ(m["unmatched_ends"], 1);  // thread 1's end of the dropped start
  EXPECT_EQ(collector_->counters().limits_hit.at("max_open_depth"), 1u);
}

TEST_F(CollectorTest, ProcessLimitRefusesWhenFullOfLiveProcesses) {
  limits_.max_processes = 2;
  make();
  auto a = std::make_unique<Connection>(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a->attach_error());
  ASSERT_FALSE(b.attach_error());
  {
    Connection c(*collector_, world_.spawn(3, 1, "c"));
    EXPECT_EQ(c.attach_error(), make_error_code(errc::limit_reached));
  }
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes"), 1u);
  world_.kill(1);
  a.reset();  // detach: process 1 is gone, so it is exited and can make room
  Connection d(*collector_, world_.spawn(4, 1, "d"));
  EXPECT_FALSE(d.attach_error());
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_TRUE(process_of(r, 1).is_null());
  EXPECT_FALSE(process_of(r, 4).is_null());
}

// Issue 15, item 3: one uid cannot fill the process table the others share.
TEST_F(CollectorTest, LiveProcessesPerUidAreBoundedAndOtherUidsStillGetIn) {
  limits_.max_processes_per_uid = 2;
  make();
  auto a = std::make_unique<Connection>(*collector_, world_.spawn(1, 1, "a", 1000));
  Connection b(*collector_, world_.spawn(2, 1, "b", 1000));
  ASSERT_FALSE(a->attach_error());
  ASSERT_FALSE(b.attach_error());
  {
    Connection c(*collector_, world_.spawn(3, 1, "c", 1000));
    EXPECT_EQ(c.attach_error(), make_error_code(errc::limit_reached));
  }
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes_per_uid"), 1u);
  Connection other(*collector_, world_.spawn(10, 1, "other", 2000));
  EXPECT_FALSE(other.attach_error());
  // A second connection of a process already tracked is no new process.
  Connection b_again(*collector_, world_.spawn(2, 1, "b", 1000));
  EXPECT_FALSE(b_again.attach_error());
  // Once one of its processes exited, the uid may start another.
  world_.kill(1);
  a.reset();
  Connection d(*collector_, world_.spawn(4, 1, "d", 1000));
  EXPECT_FALSE(d.attach_error());
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes_per_uid"), 1u);
}

// Issue 15, item 2: 1,024 custom steps x 1,024 thread ids used to cost ~25 MB per process
// with no limit hit. Now the state a process's input makes is charged and bounded.
TEST_F(CollectorTest, StateAProcessMakesIsBoundedPerProcessAndInAllAndCounted) {
  limits_.max_state_bytes = 40u << 20;  // room for two processes at the 16 MiB share
  make();
  const auto flood = [&](Connection& c) {
    for (std::uint32_t i = 0; i < proto::kMaxCustomSteps; ++i) {
      ASSERT_FALSE(c.register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
    }
    const std::uint32_t top = proto::kFirstCustomStep + proto::kMaxCustomSteps - 1;
    std::vector<proto::EventRecord> events;
    for (std::uint32_t tid = 1; tid <= 1024; ++tid) events.push_back(start(tid, top, tid));
    ASSERT_FALSE(c.events(events));
  };
  const auto charged = [&] {
    return report::stats_json(*collector_->freeze())["memory"]["state_bytes_charged"]
        .get<std::size_t>();
  };
  Connection a(*collector_, world_.spawn(1, 1, "a", 1000));
  flood(a);
  const Limits defaults;
  EXPECT_GT(collector_->counters().limits_hit.at("max_process_state_bytes"), 0u);
  EXPECT_LE(charged(), defaults.max_process_state_bytes);
  EXPECT_GT(charged(), defaults.max_process_state_bytes - (64u << 10));  // it did fill up
  // What the record really holds stays near its share (histograms are not charged, and
  // these are empty: one start per thread).
  const auto view = collector_->freeze();
  std::size_t real = 0;
  for (const auto& slot : view->state().slots) real += slot ? slot->memory_bytes() : 0;
  EXPECT_LT(real, defaults.max_process_state_bytes + (2u << 20)) << real;

  // Another process has its own share; a third finds the total used up.
  Connection b(*collector_, world_.spawn(2, 1, "b", 1001));
  flood(b);
  Connection c(*collector_, world_.spawn(3, 1, "c", 1002));
  ASSERT_FALSE(c.events({start(1, kForward, 1), end(1, kForward, 2)}));
  flood(c);
  EXPECT_GT(collector_->counters().limits_hit.at("max_state_bytes"), 0u);
  EXPECT_LE(charged(), limits_.max_state_bytes);

  // A process's threads are given back when its last connection closes.
  const std::size_t before = charged();
  a.close();
  EXPECT_LT(charged(), before - (8u << 20));
  // ...and room is there again for c's threads.
  ASSERT_FALSE(c.events({start(5000, kForward, 1)}));
  EXPECT_EQ(step_of(report::report_json(*collector_->freeze(), 3), 3, "Forward")["open"], 1);
}

TEST_F(CollectorTest, ThreadLimitIsCounted) {
  limits_.max_threads_per_process = 2;
  make();
  Connection c(*collector_, world_.spawn(100, 5, "a"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(2, kForward, 0), start(3, kForward, 0)}));
  EXPECT_EQ(collector_->counters().limits_hit.at("max_threads_per_process"), 1u);
  EXPECT_EQ(
      step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward")["open"], 2);
  // Threads with nothing open make room.
  ASSERT_FALSE(c.events({end(1, kForward, 5), start(4, kForward, 6), end(4, kForward, 9)}));
  EXPECT_EQ(
      step_of(report::report_json(*collector_->freeze(), std::nullopt), 100, "Forward")["count"],
      2);
}

TEST_F(CollectorTest, DroppedKeepsTheMaximumAndCountersSumProcesses) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  a.dropped(10);
  a.dropped(5);  // a late, smaller cumulative report
  a.dropped(12);
  b.dropped(3);
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 1)["dropped"], 12);
  EXPECT_EQ(process_of(r, 2)["dropped"], 3);
  EXPECT_EQ(collector_->counters().events_dropped_by_clients, 15u);
  EXPECT_EQ(r["daemon"]["events_dropped_by_clients"], 15);
}

TEST_F(CollectorTest, HugeClientNumbersSaturateAndNeverWrapACounterOrTotal) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a.dropped(kMax - 1));
  const std::uint64_t before = collector_->counters().events_dropped_by_clients;
  ASSERT_FALSE(b.dropped(5));  // would wrap the daemon's total
  EXPECT_EQ(collector_->counters().events_dropped_by_clients, kMax);
  EXPECT_GE(collector_->counters().events_dropped_by_clients, before);
  // Three spans of 2^64-1 ns: the step's total stays at its ceiling, not below its max.
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, kMax), start(1, kForward, 0),
                         end(1, kForward, kMax), start(1, kForward, 0), end(1, kForward, kMax)}));
  const json step = step_of(report::report_json(*collector_->freeze(), std::nullopt), 1, "Forward");
  EXPECT_EQ(step["count"], 3);
  EXPECT_EQ(step["total_ns"].get<std::uint64_t>(), kMax);
  EXPECT_GE(step["total_ns"].get<std::uint64_t>(), step["max_ns"].get<std::uint64_t>());
}

TEST_F(CollectorTest, DroppedByCauseKeepsTheMaximumPerCauseAndTheirSumIsTheTotal) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a.dropped_by_cause({{5, 0, 1, 0}}));
  ASSERT_FALSE(a.dropped_by_cause({{3, 7, 1, 2}}));  // buffer_full went "back": kept at 5
  ASSERT_FALSE(b.dropped_by_cause({{0, 4, 0, 0}}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  const json causes = process_of(r, 1)["dropped_by_cause"];
  EXPECT_EQ(causes,
            (json{{"buffer_full", 5}, {"not_connected", 7}, {"in_flight", 1}, {"invalid", 2}}));
  EXPECT_EQ(process_of(r, 1)["dropped"], 15);
  EXPECT_EQ(process_of(r, 2)["dropped"], 4);
  EXPECT_EQ(r["daemon"]["events_dropped_by_clients"], 19);
  EXPECT_EQ(r["daemon"]["events_dropped_by_cause"]["not_connected"], 11);
  EXPECT_EQ(report::stats_json(*collector_->freeze())["events_dropped_by_cause"]["buffer_full"], 5);
  // Text and Prometheus say it too.
  EXPECT_NE(report::report_text(*collector_->freeze(), 1)
                .find("dropped 15 (buffer full 5, not connected 7, in flight 1, invalid 2)"),
            std::string::npos)
      << report::report_text(*collector_->freeze(), 1);
  const std::string metrics = report::metrics_text(*collector_->freeze());
  EXPECT_NE(metrics.find("steptrace_process_dropped_events_by_cause_total{pid=\"1\",comm=\"a\","
                         "cause=\"not_connected\"} 7"),
            std::string::npos);
  EXPECT_NE(
      metrics.find("steptrace_events_dropped_by_clients_by_cause_total{cause=\"buffer_full\"} 5"),
      std::string::npos);
  // Counts near 2^64 saturate instead of wrapping the total.
  ASSERT_FALSE(a.dropped_by_cause({{~0ull, ~0ull, 1, 2}}));
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), 1), 1)["dropped"], ~0ull);
}

TEST_F(CollectorTest, AViewStaysAsFrozenWhileIngestGoesOn) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.events({start(1, kMatmul, 0), end(1, kMatmul, 100), start(1, kForward, 100)}));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "t", 1, 150));
  const auto view = collector_->freeze();
  const json before = report::report_json(*view, std::nullopt);
  // The daemon's own process_* lines (RSS, CPU, fds) are read when rendered, not frozen.
  const auto without_process_lines = [](const std::string& text) {
    std::string out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (!line.starts_with("process_")) out += line + "\n";
    }
    return out;
  };
  const std::string metrics_before = without_process_lines(report::metrics_text(*view));
  EXPECT_EQ(step_of(before, 1, "Matmul")["count"], 1);

  // Everything a record or the ledger can go through after the view was taken.
  ASSERT_FALSE(a.events({end(1, kForward, 300), start(2, kMatmul, 0), end(2, kMatmul, 50)}));
  ASSERT_FALSE(a.register_step(300, "Tokenize"));
  ASSERT_FALSE(a.dropped_by_cause({{1, 2, 3, 4}}));
  a.ledger(test::reserve_record("GPU-x", 2, 1024, "t", 1, 400));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(b.events({start(1, kBackward, 0), end(1, kBackward, 10)}));
  collector_->reset(1);
  world_.kill(2);
  b.close();
  world_.now_ns += 5'000'000'000;

  EXPECT_EQ(report::report_json(*view, std::nullopt), before);
  EXPECT_EQ(without_process_lines(report::metrics_text(*view)), metrics_before);
  // The live state has all of it.
  const json now = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(now, 1, "Matmul"), nullptr);  // reset
  EXPECT_EQ(process_of(now, 1)["dropped"], 10);
  EXPECT_EQ(process_of(now, 2)["alive"], false);
  EXPECT_EQ(step_of(now, 2, "Backward")["count"], 1);
  EXPECT_EQ(report::ledger_json(*collector_->freeze())["gpus"][0]["reserved_bytes"], 4096 + 1024);
  EXPECT_EQ(report::ledger_json(*view)["gpus"][0]["reserved_bytes"], 4096);
}

TEST_F(CollectorTest, ViewsRenderOnAnotherThreadWhileIngestMutates) {
  // What the daemon does: the ingest thread freezes and releases views, a render thread
  // reads them. Run under the sanitizers, a record shared without a clone shows here.
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  for (std::uint32_t id = 256; id < 356; ++id) {
    ASSERT_FALSE(a.register_step(id, "custom" + std::to_string(id)));
  }
  std::atomic<const CollectorView*> handed{nullptr};
  std::atomic<bool> done{false};
  std::atomic<int> renders{0};
  std::thread renderer([&] {
    while (!done.load()) {
      const CollectorView* v = handed.load();
      if (v == nullptr) {
        std::this_thread::yield();
        continue;
      }
      const std::string text =
          report::metrics_text(*v) + report::report_json(*v, std::nullopt).dump();
      EXPECT_FALSE(text.empty());
      renders.fetch_add(1);
      handed.store(nullptr);
    }
  });
  std::shared_ptr<const CollectorView> held;
  std::uint64_t ts = 0;
  constexpr int kBatches = 2000;
  for (int i = 0; i < kBatches; ++i) {
    if (handed.load() == nullptr) {
      held = collector_->freeze();  // the previous one is released here, on this thread
      handed.store(held.get());
    }
    const std::uint32_t step = 256 + static_cast<std::uint32_t>(i % 100);
    ASSERT_FALSE(a.events({start(1, step, ts), end(1, step, ts + 10), start(1, kMatmul, ts),
                           end(1, kMatmul, ts + 5)}));
    ts += 20;
  }
  while (handed.load() != nullptr) std::this_thread::yield();
  done.store(true);
  renderer.join();
  held.reset();
  EXPECT_GT(renders.load(), 0);
  EXPECT_EQ(step_of(report::report_json(*collector_->freeze(), 1), 1, "Matmul")["count"], kBatches);
  EXPECT_EQ(step_of(report::report_json(*collector_->freeze(), 1), 1, "custom300")["count"],
            kBatches / 100);
}

TEST_F(CollectorTest, ExitedProcessesAreKeptUpToTheLimitOldestFirstOut) {
  limits_.max_exited_processes = 2;
  make();
  for (std::int32_t pid = 1; pid <= 3; ++pid) {
    Connection c(*collector_, world_.spawn(pid, 7, "p" + std::to_string(pid)));
    ASSERT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 10)}));
    world_.kill(pid);
    world_.now_ns += 1000;
    c.close();
  }
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  ASSERT_EQ(r["processes"].size(), 2u);
  EXPECT_TRUE(process_of(r, 1).is_null());  // exited first, evicted first
  EXPECT_EQ(process_of(r, 2)["alive"], false);
  EXPECT_EQ(process_of(r, 3)["alive"], false);
  EXPECT_EQ(collector_->counters().limits_hit.at("max_exited_processes"), 1u);
  EXPECT_NE(report::metrics_text(*collector_->freeze())
                .find("steptrace_limit_hits_total{limit=\"max_exited_processes\"} 1\n"),
            std::string::npos);
}

TEST_F(CollectorTest, LivenessFollowsProcThroughTheInjectedProbe) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  Connection c(*collector_, world_.spawn(3, 1, "c"));
  a.close();
  b.close();
  c.close();
  json r = report::report_json(*collector_->freeze(), std::nullopt);
  for (int pid = 1; pid <= 3; ++pid) EXPECT_EQ(process_of(r, pid)["alive"], true) << pid;

  world_.now_ns = 5'000'000'000'000;
  world_.zombify(1);                // zombie: dead
  world_.procs[2].start_time = 99;  // pid reused by another process: dead
  collector_->refresh_liveness();
  r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 1)["alive"], false);
  EXPECT_EQ(process_of(r, 1)["exited_at_ns"], 5'000'000'000'000u);
  EXPECT_EQ(process_of(r, 2)["alive"], false);
  EXPECT_EQ(process_of(r, 3)["alive"], true);  // still running, just disconnected
  world_.kill(3);
  collector_->refresh_liveness();
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), std::nullopt), 3)["alive"],
            false);
}

TEST_F(CollectorTest, ProcessWithAConnectionIsAliveWhateverProcSays) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  world_.kill(1);
  collector_->refresh_liveness();
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), std::nullopt), 1)["alive"], true);
  a.close();
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), std::nullopt), 1)["alive"],
            false);
}

TEST_F(CollectorTest, RecycledPidIsANewProcess) {
  {
    Connection a(*collector_, world_.spawn(100, 1, "old"));
    ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10)}));
  }
  Connection b(*collector_, world_.spawn(100, 2, "new"));
  ASSERT_FALSE(b.events({start(1, kForward, 0), end(1, kForward, 30)}));
  const json r = report::report_json(*collector_->freeze(), 100);
  ASSERT_EQ(r["processes"].size(), 2u);
  EXPECT_EQ(r["processes"][0]["start_time"], 1);
  EXPECT_EQ(r["processes"][0]["alive"], false);
  EXPECT_EQ(r["processes"][1]["start_time"], 2);
  EXPECT_EQ(r["processes"][1]["alive"], true);
  EXPECT_EQ(r["processes"][1]["steps"][0]["total_ns"], 30);
}

TEST_F(CollectorTest, ResetClearsAllOrOnePid) {
  Connection a(*collector_, world_.spawn(1, 1, "a"));
  Connection b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10), start(1, kMatmul, 20)}));
  ASSERT_FALSE(b.events({start(1, kForward, 0), end(1, kForward, 10)}));
  collector_->reset(1);
  json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_TRUE(step_of(r, 1, "Forward").is_null());
  EXPECT_EQ(step_of(r, 1, "Matmul")["open"], 1);  // open spans are not aggregates
  EXPECT_EQ(step_of(r, 2, "Forward")["count"], 1);
  EXPECT_EQ(collector_->counters().events_received, 5u);  // counters stay
  ASSERT_FALSE(a.events({end(1, kMatmul, 70)}));
  EXPECT_EQ(
      step_of(report::report_json(*collector_->freeze(), std::nullopt), 1, "Matmul")["total_ns"],
      50);
  collector_->reset(std::nullopt);
  r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_TRUE(r["totals"].empty());
  EXPECT_EQ(r["processes"].size(), 2u);
}

TEST_F(CollectorTest, LedgerStepSpansAndAnnotationsReachTheLedgerView) {
  Connection c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, 7 /*LedgerReserve*/, 100)}));
  c.ledger(test::reserve_record("GPU-abc", 1, 4096, "qlora", 1, 150));
  ASSERT_FALSE(c.events({end(1, 7, 200)}));
  const json ledger = report::ledger_json(*collector_->freeze());
  ASSERT_EQ(ledger["gpus"].size(), 1u);
  EXPECT_EQ(ledger["gpus"][0]["gpu"], "GPU-abc");
  EXPECT_EQ(ledger["gpus"][0]["reserved_bytes"], 4096);
  ASSERT_EQ(ledger["gpus"][0]["reservations"].size(), 1u);
  EXPECT_EQ(ledger["gpus"][0]["reservations"][0]["pid"], 100);
  EXPECT_EQ(ledger["gpus"][0]["reservations"][0]["holder_alive"], true);
  // The holder dies without releasing: flagged by the next liveness tick.
  world_.kill(100);
  c.close();
  collector_->refresh_liveness();
  EXPECT_EQ(
      report::ledger_json(*collector_->freeze())["gpus"][0]["reservations"][0]["holder_alive"],
      false);
}

// Issue 15, item 1: 64 GPUs x 64 reservations of dead holders plus churn must not make
// every tick, disconnect or report probe /proc once per reservation.
TEST_F(CollectorTest, LivenessProbesOncePerProcessWhateverTheLedgerHolds) {
  constexpr int kHolders = 8;
  constexpr int kGpus = 64;
  constexpr int kPerGpu = 64;
  limits_.max_gpus_per_uid = kGpus;
  make();
  for (int h = 1; h <= kHolders; ++h) {
    Connection c(*collector_, world_.spawn(h, 1, "holder"));
    for (int g = 0; g < kGpus; ++g) {
      for (int r = 0; r < kPerGpu / kHolders; ++r) {
        c.ledger(test::reserve_record("GPU-" + std::to_string(g),
                                      static_cast<std::uint64_t>(h * 1000 + r), 4096, "t", 1, 1));
      }
    }
    world_.kill(h);
  }  // each Connection closed: one probe per detach, none per reservation
  EXPECT_EQ(world_.probes, static_cast<std::uint64_t>(kHolders));
  collector_->refresh_liveness();  // the tick that flags them all
  const json ledger = report::ledger_json(*collector_->freeze());
  ASSERT_EQ(ledger["gpus"].size(), static_cast<std::size_t>(kGpus));
  for (const auto& gpu : ledger["gpus"]) EXPECT_EQ(gpu["leaked_reservations"], kPerGpu);

  // Steady state: every holder known dead, nothing to probe, whatever the ledger holds.
  world_.probes = 0;
  for (int tick = 0; tick < 10; ++tick) collector_->refresh_liveness();
  EXPECT_EQ(world_.probes, 0u);
  // Churn: each short-lived client costs one probe (its own), not one per reservation.
  for (int i = 0; i < 20; ++i) {
    Connection c(*collector_, world_.spawn(100 + i, 1, "churn"));
    world_.kill(100 + i);
  }
  EXPECT_EQ(world_.probes, 20u);
  // Reports never probe.
  world_.probes = 0;
  for (int i = 0; i < 5; ++i) {
    (void)report::ledger_json(*collector_->freeze());
    (void)report::report_json(*collector_->freeze(), std::nullopt);
  }
  EXPECT_EQ(world_.probes, 0u);
  // A disconnected process that still runs is probed once per tick, not per reservation.
  {
    Connection c(*collector_, world_.spawn(500, 1, "sleeper"));
    for (std::uint64_t r = 0; r < 100; ++r)
      c.ledger(test::reserve_record("GPU-0", 9000 + r, 1, "t", 1, 1));
  }
  world_.probes = 0;
  for (int tick = 0; tick < 3; ++tick) collector_->refresh_liveness();
  EXPECT_EQ(world_.probes, 3u);
}

// Issue 15, item 4: a probe that fails (EMFILE under fd exhaustion) is no death: the live
// holder stays alive and its reservation is not flagged leaked; once probes work again
// the truth is found.
TEST_F(CollectorTest, AFailedProbeIsNeverTakenForADeath) {
  {
    Connection c(*collector_, world_.spawn(7, 1, "holder"));
    c.ledger(test::reserve_record("GPU-0", 1, 4096, "t", 1, 1));
    world_.probe_error = EMFILE;
  }  // detach while /proc cannot be read
  collector_->refresh_liveness();
  collector_->refresh_liveness();
  EXPECT_EQ(collector_->counters().liveness_probe_errors, 3u);  // the detach and two ticks
  json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 7)["alive"], true);
  json ledger = report::ledger_json(*collector_->freeze());
  EXPECT_EQ(ledger["gpus"][0]["reservations"][0]["holder_alive"], true);
  EXPECT_EQ(ledger["gpus"][0]["leaked_reservations"], 0);

  world_.probe_error = 0;
  collector_->refresh_liveness();
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), std::nullopt), 7)["alive"], true);
  world_.kill(7);
  collector_->refresh_liveness();
  EXPECT_EQ(process_of(report::report_json(*collector_->freeze(), std::nullopt), 7)["alive"],
            false);
  EXPECT_EQ(report::ledger_json(*collector_->freeze())["gpus"][0]["leaked_reservations"], 1);
}

TEST(ProcStatTest, ParsesAfterTheLastParenthesis) {
  std::string fields;
  for (int i = 4; i <= 21; ++i) fields += " " + std::to_string(i);
  const std::string stat = "4242 (a) b (c) d) S" + fields + " 987654 23 24\n";
  auto probe = parse_proc_stat(stat);
  ASSERT_TRUE(probe);
  EXPECT_EQ(probe->start_time, 987654u);
  EXPECT_FALSE(probe->zombie);
  EXPECT_EQ(probe->comm, "a) b (c) d");  // the comm may hold parentheses itself
  probe = parse_proc_stat("1 (x) Z" + fields + " 5 6");
  ASSERT_TRUE(probe);
  EXPECT_TRUE(probe->zombie);
  EXPECT_EQ(probe->start_time, 5u);
  EXPECT_TRUE(parse_proc_stat("1 (x) X" + fields + " 5")->zombie);
  EXPECT_FALSE(parse_proc_stat("1 (x) S 4 5"));            // too short
  EXPECT_FALSE(parse_proc_stat("1 x S" + fields + " 5"));  // no parenthesis
  EXPECT_FALSE(parse_proc_stat("1 (x) S" + fields + " 5x"));
}

TEST(ProcProbeTest, SystemProbeSeesThisProcessAndNotAReapedChild) {
  const Environment env = Environment::system();
  const auto self = env.probe(::getpid());
  ASSERT_TRUE(self);
  EXPECT_GT(self->start_time, 0u);
  EXPECT_FALSE(self->zombie);
  EXPECT_FALSE(self->comm.empty());
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ASSERT_GT(child, 0);
  // Unreaped, the child is a zombie.
  std::optional<ProcessProbe> z;
  for (int i = 0; i < 2000 && !(z = env.probe(child), z && z->zombie); ++i) ::usleep(1000);
  ASSERT_TRUE(z);
  EXPECT_TRUE(z->zombie);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_FALSE(env.probe(child));
  const std::uint64_t t1 = env.monotonic_now_ns();
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  const std::uint64_t t2 = env.monotonic_now_ns();
  const std::uint64_t mid = static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u + ts.tv_nsec;
  EXPECT_LE(t1, mid);
  EXPECT_LE(mid, t2);
}

}  // namespace
}  // namespace steptrace::daemon

namespace steptrace::daemon {
namespace {

constexpr std::uint32_t kAttention = 3;
constexpr std::uint32_t kTranspose = 4;
constexpr std::uint32_t kAlloc = 5;

// Self time: a span's duration less the spans that ended one level inside it on the same
// thread, so nested work is not counted twice.
TEST_F(CollectorTest, SelfTimeLeavesOutNestedSpans) {
  make();
  Connection a(*collector_, world_.spawn(1, 1, "a", 7));
  // Forward 0..100 holds Matmul 10..40 (which holds Transpose 20..30) and Matmul 50..60.
  ASSERT_FALSE(a.events({start(1, kForward, 0), start(1, kMatmul, 10), start(1, kTranspose, 20),
                         end(1, kTranspose, 30), end(1, kMatmul, 40), start(1, kMatmul, 50),
                         end(1, kMatmul, 60), end(1, kForward, 100)}));
  // Another thread's spans are not nested in thread 1's.
  ASSERT_FALSE(a.events({start(2, kBackward, 5), end(2, kBackward, 95)}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(r, 1, "Forward")["total_ns"], 100);
  EXPECT_EQ(step_of(r, 1, "Forward")["self_ns"], 60);  // 100 - 30 - 10
  EXPECT_EQ(step_of(r, 1, "Matmul")["total_ns"], 40);
  EXPECT_EQ(step_of(r, 1, "Matmul")["self_ns"], 30);  // 30 - 10, then 10
  EXPECT_EQ(step_of(r, 1, "Transpose")["self_ns"], 10);
  EXPECT_EQ(step_of(r, 1, "Backward")["self_ns"], 90);
  // Spans that overlap without nesting still count within [0, duration].
  ASSERT_FALSE(a.events(
      {start(3, kAlloc, 0), start(3, kAttention, 10), end(3, kAlloc, 20), end(3, kAttention, 50)}));
  const json r2 = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_LE(step_of(r2, 1, "Alloc")["self_ns"], step_of(r2, 1, "Alloc")["total_ns"]);
  EXPECT_LE(step_of(r2, 1, "Attention")["self_ns"], step_of(r2, 1, "Attention")["total_ns"]);
  // The text report shows both, and says what Duration includes.
  const std::string text = report::report_text(*collector_->freeze(), std::nullopt);
  EXPECT_NE(text.find("| Self            | % Self"), std::string::npos) << text;
  EXPECT_NE(text.find("Duration and % Time include nested spans"), std::string::npos) << text;
}

// PROTOCOL.md 4.7b: the Identity's job and ranks reach the report, grouped by job.
TEST_F(CollectorTest, IdentityGroupsProcessesByJob) {
  make();
  Connection r0(*collector_, world_.spawn(10, 1, "train", 7));
  Connection r1(*collector_, world_.spawn(11, 1, "train", 7));
  Connection other(*collector_, world_.spawn(12, 1, "eval", 8));
  Connection lone(*collector_, world_.spawn(13, 1, "notebook", 7));
  ASSERT_FALSE(r0.identity("llama-7", 0, 0, 2));
  ASSERT_FALSE(r1.identity("llama-7", 1, 1, 2));
  ASSERT_FALSE(other.identity("llama-7"));  // another uid's "llama-7" is its own job
  // A data-loader worker forked by rank 1 sends rank 1 too: the job lists it once.
  Connection worker(*collector_, world_.spawn(14, 1, "train", 7));
  ASSERT_FALSE(worker.identity("llama-7", 1, 1, 2));
  for (Connection* c : {&r0, &r1, &other, &lone, &worker}) {
    ASSERT_FALSE(c->events({start(1, kForward, 0), end(1, kForward, 100)}));
  }
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 11)["job"], "llama-7");
  EXPECT_EQ(process_of(r, 11)["rank"], 1);
  EXPECT_EQ(process_of(r, 11)["local_rank"], 1);
  EXPECT_EQ(process_of(r, 11)["world_size"], 2);
  EXPECT_TRUE(process_of(r, 13)["job"].is_null());
  EXPECT_TRUE(process_of(r, 13)["rank"].is_null());
  ASSERT_EQ(r["jobs"].size(), 3u);  // (7, ""), (7, llama-7), (8, llama-7)
  const json& llama = r["jobs"][1];
  EXPECT_EQ(llama["job"], "llama-7");
  EXPECT_EQ(llama["uid"], 7);
  EXPECT_EQ(llama["processes"], 3);
  EXPECT_EQ(llama["live"], 3);
  EXPECT_EQ(llama["ranks"], json::array({0, 1}));
  EXPECT_EQ(llama["world_size"], 2);
  EXPECT_EQ(llama["totals"][0]["count"], 3);
  EXPECT_EQ(r["jobs"][2]["uid"], 8);

  const auto by_job =
      report::report_json(*collector_->freeze(), report::ReportFilter{{}, "llama-7"});
  EXPECT_EQ(by_job["processes"].size(), 4u);  // both uids' processes named so
  const std::string text =
      report::report_text(*collector_->freeze(), report::ReportFilter{std::nullopt, std::nullopt});
  EXPECT_NE(text.find("══ Job llama-7 (uid 7) · 3 processes (3 live) · ranks 0-1 of 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("══ Processes without a job id (uid 7) · 1 process (1 live)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("── Process 11 (train) · rank 1/2 (local 1) · alive"), std::string::npos)
      << text;
  // One process: its table once.
  const std::string one = report::report_text(*collector_->freeze(), 11);
  EXPECT_EQ(one.find("| % Self"), one.rfind("| % Self")) << one;
  EXPECT_NE(one.find("── Process 11 (train) · job llama-7 · rank 1/2"), std::string::npos) << one;
  const std::string none =
      report::report_text(*collector_->freeze(), report::ReportFilter{{}, "nope"});
  EXPECT_NE(none.find("No process of job nope is tracked."), std::string::npos) << none;
}

// Per-job counters keep what exited and evicted processes had, and are bounded.
TEST_F(CollectorTest, JobCountersOutliveTheirProcesses) {
  limits_.max_exited_processes = 0;  // evicted at once
  limits_.max_jobs = 3;
  limits_.max_jobs_per_uid = 2;
  make();
  const auto spans = [&](std::int32_t pid, std::uint32_t uid, const std::string& job) {
    Connection c(*collector_, world_.spawn(pid, 1, "t", uid));
    EXPECT_FALSE(c.identity(job, 0, 0, 1));
    EXPECT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 2'000'000'000)}));
    world_.kill(pid);
    c.close();
  };
  spans(1, 7, "a");
  spans(2, 7, "a");
  std::string text = report::metrics_text(*collector_->freeze());
  EXPECT_NE(
      text.find("steptrace_job_step_seconds_total{job_id=\"a\",uid=\"7\",step=\"Forward\"} 4\n"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find("steptrace_job_step_spans_total{job_id=\"a\",uid=\"7\",step=\"Forward\"} 2\n"),
      std::string::npos);
  EXPECT_NE(text.find("steptrace_job_processes{job_id=\"a\",uid=\"7\",state=\"exited\"} 2\n"),
            std::string::npos);
  EXPECT_EQ(report::report_json(*collector_->freeze(), std::nullopt)["processes"].size(), 0u);
  // uid 7's third job pushes out its least recent; uid 8's then push out the oldest.
  spans(3, 7, "b");
  spans(4, 7, "c");
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("job_id=\"b\""), std::string::npos);
  EXPECT_NE(text.find("steptrace_limit_hits_total{limit=\"max_jobs_per_uid\"} 1\n"),
            std::string::npos);
  spans(5, 8, "x");
  spans(6, 8, "y");
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"b\""), std::string::npos) << text;
  EXPECT_NE(text.find("steptrace_limit_hits_total{limit=\"max_jobs\"} 1\n"), std::string::npos);
  // A live process adds to its job's series, with job_id and rank on its own series.
  Connection live(*collector_, world_.spawn(9, 1, "t", 8));
  ASSERT_FALSE(live.identity("y", 0, 0, 1));
  ASSERT_FALSE(live.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
  text = report::metrics_text(*collector_->freeze());
  EXPECT_NE(
      text.find("steptrace_job_step_seconds_total{job_id=\"y\",uid=\"8\",step=\"Forward\"} 3\n"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("steptrace_process_step_seconds_total{pid=\"9\",comm=\"t\",job_id=\"y\","
                      "rank=\"0\",step=\"Forward\"} 1\n"),
            std::string::npos)
      << text;
  // reset clears them with the rest.
  collector_->reset(std::nullopt);
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"x\""), std::string::npos) << text;
}

// A job whose processes are still in the table is never the one forgotten: its
// counters would go backwards. Nor does it count against the limits, so its first
// process leaving forgets nobody. The least recent job with none left goes instead.
TEST_F(CollectorTest, AJobWithProcessesInTheTableKeepsItsRetiredTotals) {
  limits_.max_exited_processes = 0;  // evicted at once
  limits_.max_jobs = 2;
  limits_.max_jobs_per_uid = 2;
  make();
  const auto spans = [&](Connection& c, std::int32_t pid, const std::string& job) {
    EXPECT_FALSE(c.identity(job, 0, 0, 2));
    EXPECT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
    world_.kill(pid);
    c.close();
  };
  const auto short_job = [&](std::int32_t pid, const std::string& job) {
    Connection c(*collector_, world_.spawn(pid, 1, "t", 7));
    spans(c, pid, job);
  };
  const auto metrics = [&] { return report::metrics_text(*collector_->freeze()); };
  const auto seconds = [&](const std::string& job) {
    const std::string text = metrics();
    const std::string key =
        "steptrace_job_step_seconds_total{job_id=\"" + job + "\",uid=\"7\",step=\"Forward\"} ";
    const auto at = text.find(key);
    return at == std::string::npos
               ? std::string("absent")
               : text.substr(at + key.size(), text.find('\n', at) - at - key.size());
  };
  const auto hits = [&](const std::string& limit) {
    const std::string text = metrics();
    const std::string key = "steptrace_limit_hits_total{limit=\"" + limit + "\"} ";
    const auto at = text.find(key);
    return at == std::string::npos ? -1 : std::stoi(text.substr(at + key.size()));
  };
  short_job(1, "p");
  short_job(2, "q");  // two finished jobs: the uid's limit
  // Job "a": rank 1 is still running while rank 0 has exited and left the table.
  Connection a1(*collector_, world_.spawn(11, 1, "t", 7));
  ASSERT_FALSE(a1.identity("a", 1, 1, 2));
  ASSERT_FALSE(a1.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
  {
    Connection a0(*collector_, world_.spawn(10, 1, "t", 7));
    spans(a0, 10, "a");
  }
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("p"), "1");  // "a" does not count yet: nobody was forgotten for it
  EXPECT_EQ(seconds("q"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 0);
  // Two more short jobs: past the limit, the least recent finished ones go, "a" stays.
  short_job(3, "job3");
  short_job(4, "job4");
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("p"), "absent");
  EXPECT_EQ(seconds("q"), "absent");
  EXPECT_EQ(seconds("job3"), "1");
  EXPECT_EQ(seconds("job4"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 2);
  // Once rank 1 leaves too, "a" holds both ranks' totals and counts like any other job:
  // the uid is back within its limit at once, least recent first.
  world_.kill(11);
  a1.close();
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("job3"), "absent");
  EXPECT_EQ(seconds("job4"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 3);
  EXPECT_EQ(hits("max_jobs"), 0);  // the uid's limit kept the total within max_jobs
}

}  // namespace
}  // namespace steptrace::daemon
