// The render worker's fairness (daemon/serve/render_queue.h, render_worker.h): per-owner
// queues served round-robin, at most one job of an owner in progress, FIFO within an
// owner; a fast lane (stats, metrics, scrapes) that never waits behind a report. And the
// views it freezes: shared between the lanes when one is newer than a lane's jobs, and
// no second one while the records views made ingest copy are over their bound.
#include "daemon/serve/render_worker.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "daemon/serve/render_queue.h"
#include "daemon/state/charge.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using Round = std::vector<std::pair<RenderOwner, int>>;

std::vector<int> items(const Round& round) {
  std::vector<int> out;
  for (const auto& [owner, item] : round) out.push_back(item);
  return out;
}

TEST(RenderQueue, OneOwnersBurstWaitsForItselfWhileOthersTakeTheirTurns) {
  RenderQueue<int> queue;
  const auto greedy = RenderOwner::of_uid(1001);
  const auto innocent = RenderOwner::of_uid(1002);
  for (int i = 0; i < 5; ++i) queue.push(greedy, 100 + i);
  EXPECT_EQ(items(queue.take_round(64)), std::vector<int>{100});
  // The greedy uid's next job waits for its first one, however many it queued.
  EXPECT_FALSE(queue.ready());
  EXPECT_TRUE(queue.take_round(64).empty());
  queue.push(innocent, 200);
  queue.push(RenderOwner::http(), 300);
  queue.push(RenderOwner::daemon(), 400);
  EXPECT_EQ(items(queue.take_round(64)), (std::vector<int>{200, 300, 400}));
  EXPECT_EQ(queue.in_progress(), 4u);
  queue.done(greedy);
  queue.done(innocent);
  queue.done(RenderOwner::http());
  queue.done(RenderOwner::daemon());
  // FIFO within the owner.
  EXPECT_EQ(items(queue.take_round(64)), std::vector<int>{101});
  EXPECT_EQ(queue.waiting(greedy), 3u);
  EXPECT_EQ(queue.waiting(), 3u);
}

TEST(RenderQueue, RoundsTurnAfterTheOwnerServedLast) {
  RenderQueue<int> queue;
  const auto a = RenderOwner::of_uid(1);
  const auto b = RenderOwner::of_uid(2);
  const auto c = RenderOwner::of_uid(3);
  for (int i = 0; i < 3; ++i) {
    queue.push(a, 10 + i);
    queue.push(b, 20 + i);
    queue.push(c, 30 + i);
  }
  // Two per round: the third owner goes first in the next one.
  EXPECT_EQ(items(queue.take_round(2)), (std::vector<int>{10, 20}));
  queue.done(a);
  queue.done(b);
  EXPECT_EQ(items(queue.take_round(2)), (std::vector<int>{30, 11}));
  queue.done(c);
  queue.done(a);
  EXPECT_EQ(items(queue.take_round(2)), (std::vector<int>{21, 31}));
  queue.done(b);
  queue.done(c);
  EXPECT_EQ(items(queue.take_round(64)), (std::vector<int>{12, 22, 32}));
  queue.done(a);
  queue.done(b);
  queue.done(c);
  EXPECT_EQ(queue.waiting(), 0u);
  EXPECT_EQ(queue.in_progress(), 0u);
  EXPECT_FALSE(queue.ready());
}

class RenderWorkerTest : public ::testing::Test {
 protected:
  // Runs the io thread (this one) until `done` holds, at most 10 s.
  template <typename Pred>
  bool run_until(Pred done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io_.run_for(std::chrono::milliseconds(5));
    }
    return done();
  }

  // Room for one process of more than view_copy_bound()'s floor (BigRecord).
  static Limits limits() {
    Limits limits;
    limits.max_process_state_bytes = std::size_t{64} << 20;
    return limits;
  }
  // One process whose record holds `threads` threads, each with a span open in the last
  // of 1,024 custom steps (a stack slot vector of 1,036 entries each).
  void big_record(std::uint32_t threads) {
    threads_ = threads;
    client_ = std::make_unique<test::DirectClient>(collector_, world_.spawn(7, 7, "big", 1000));
    for (std::uint32_t i = 0; i < proto::kMaxCustomSteps; ++i) {
      ASSERT_FALSE(client_->register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
    }
    std::vector<proto::EventRecord> events;
    for (std::uint32_t tid = 1; tid <= threads; ++tid) {
      events.push_back(test::start(tid, proto::kFirstCustomStep + proto::kMaxCustomSteps - 1, 1));
    }
    ASSERT_FALSE(client_->events(events));
  }
  // A span of built-in step 0 on every thread: a write to the record and all its threads,
  // each cloned when a view holds it.
  void write_to_record() {
    std::vector<proto::EventRecord> events;
    for (std::uint32_t tid = 1; tid <= threads_; ++tid) {
      events.push_back(test::start(tid, 0, 10));
      events.push_back(test::end(tid, 0, 20));
    }
    ASSERT_FALSE(client_->events(events));
  }
  std::uint64_t charged() { return collector_.freeze()->table().state_bytes_charged; }
  std::uint64_t view_copies() { return collector_.freeze()->table().view_copy_bytes; }

  test::FakeWorld world_;
  Collector collector_{limits(), world_.env()};
  std::unique_ptr<test::DirectClient> client_;
  std::uint32_t threads_ = 0;
  boost::asio::io_context io_;
  boost::asio::executor_work_guard<boost::asio::io_context::executor_type> work_ =
      boost::asio::make_work_guard(io_);
  RenderWorker renderer_{io_, collector_};
};

// A report that takes long holds the bulk lane; stats and metrics (the fast lane) are
// answered meanwhile.
TEST_F(RenderWorkerTest, TheFastLaneDoesNotWaitBehindAReport) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  bool report_done = false;
  bool stats_done = false;
  renderer_.submit(
      [released](const CollectorView&) {
        released.wait();
        return std::string("report\n");
      },
      [&](std::string) { report_done = true; }, RenderOwner::of_uid(1001));
  renderer_.submit(
      RenderJob([](const CollectorView&) { return std::string("stats\n"); }, RenderLane::kFast),
      [&](std::string text) {
        EXPECT_EQ(text, "stats\n");
        stats_done = true;
      },
      RenderOwner::of_uid(1002));
  EXPECT_TRUE(run_until([&] { return stats_done; }));
  EXPECT_FALSE(report_done);
  EXPECT_EQ(renderer_.pending(RenderLane::kBulk), 1u);
  release.set_value();
  EXPECT_TRUE(run_until([&] { return report_done; }));
  EXPECT_EQ(renderer_.pending(), 0u);
  renderer_.stop();
}

// A greedy uid's burst of reports: another uid's report goes in the next round, after
// one of the greedy uid's, not after all of them.
TEST_F(RenderWorkerTest, AnotherUidsReportGoesAfterOneOfTheGreedyUids) {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::vector<std::string> order;
  const auto job = [released](std::string name) {
    return [released, name](const CollectorView&) {
      released.wait();
      return name;
    };
  };
  for (int i = 0; i < 6; ++i) {
    renderer_.submit(
        job("greedy" + std::to_string(i)), [&](std::string text) { order.push_back(text); },
        RenderOwner::of_uid(1001));
  }
  renderer_.submit(
      job("innocent"), [&](std::string text) { order.push_back(text); }, RenderOwner::of_uid(1002));
  EXPECT_EQ(renderer_.waiting(RenderLane::kBulk, RenderOwner::of_uid(1001)), 5u);
  release.set_value();
  EXPECT_TRUE(run_until([&] { return order.size() == 7; }));
  ASSERT_EQ(order.size(), 7u);
  EXPECT_EQ(order[0], "greedy0");
  EXPECT_EQ(order[1], "innocent");
  for (int i = 1; i < 6; ++i) EXPECT_EQ(order[i + 1], "greedy" + std::to_string(i));
  renderer_.stop();
}

// Tasks (pieces of a streamed reply) take their owner's turn on the bulk lane too.
TEST_F(RenderWorkerTest, TasksTakeTheirOwnersTurn) {
  std::vector<std::string> order;
  for (int i = 0; i < 3; ++i) {
    renderer_.submit_task([i] { return "piece" + std::to_string(i); },
                          [&](std::string text) { order.push_back(text); },
                          RenderOwner::of_uid(1001));
  }
  EXPECT_TRUE(run_until([&] { return order.size() == 3; }));
  EXPECT_EQ(order, (std::vector<std::string>{"piece0", "piece1", "piece2"}));
  renderer_.stop();
}

// Spans of step 0 ended, as a view shows them.
std::uint64_t ended(const CollectorView& view) {
  std::uint64_t n = 0;
  for (const ProcessFigures& p : view.processes()) {
    for (const StepFigures& s : p.steps) {
      if (s.name == proto::kBuiltinStepNames[0]) n += s.hist().count();
    }
  }
  return n;
}

// A job that says when it started, which view it got and what that view shows, then
// waits for `release`.
struct HeldJob {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::atomic<bool> started{false};
  std::atomic<const CollectorView*> view{nullptr};
  std::atomic<std::uint64_t> ended_seen{0};
  std::chrono::steady_clock::time_point start_time{};  // read after `started`
  bool done = false;

  RenderJob job(RenderLane lane, bool hold = true) {
    return RenderJob(
        [this, hold](const CollectorView& v) {
          view = &v;
          ended_seen = ended(v);
          start_time = std::chrono::steady_clock::now();
          started = true;
          if (hold) released.wait();
          return std::string("ok\n");
        },
        lane);
  }
  RenderWorker::Done on_done() {
    return [this](std::string) { done = true; };
  }
};

// A lane whose jobs all came before the view the other lane renders from renders from
// that view too: no second freeze (and no second copy of each record written while both
// render), and each reply still shows what was applied before its command.
TEST_F(RenderWorkerTest, ALaneRendersFromTheOtherLanesViewWhenThatIsNewerThanItsJobs) {
  big_record(4);
  HeldJob first, second, fast;
  renderer_.submit(first.job(RenderLane::kBulk), first.on_done(), RenderOwner::of_uid(1001));
  ASSERT_TRUE(run_until([&] { return first.started.load(); }));
  write_to_record();  // before the second report's command: it must show it
  renderer_.submit(second.job(RenderLane::kBulk, false), second.on_done(),
                   RenderOwner::of_uid(1001));
  renderer_.submit(fast.job(RenderLane::kFast), fast.on_done(), RenderOwner::of_uid(1002));
  ASSERT_TRUE(run_until([&] { return fast.started.load(); }));
  EXPECT_EQ(first.ended_seen, 0u);
  EXPECT_EQ(fast.ended_seen, 4u);
  first.release.set_value();
  ASSERT_TRUE(run_until([&] { return second.done; }));
  EXPECT_EQ(second.view.load(), fast.view.load());  // the fast lane's view, still held
  EXPECT_EQ(second.ended_seen, 4u);
  fast.release.set_value();
  EXPECT_TRUE(run_until([&] { return first.done && fast.done; }));
  renderer_.stop();
}

// While the copies views made ingest keep are over their bound, the bulk lane does not
// freeze a second view beside the fast lane's: its report waits for that view's release
// (then renders from a view frozen after it, with every write before its command), so a
// record written meanwhile is copied once, not once per view.
TEST_F(RenderWorkerTest, OverTheCopyBoundTheBulkLaneWaitsForTheFastLanesView) {
  big_record(1000);
  const std::uint64_t record = charged();
  ASSERT_GT(record, kViewCopyFloorBytes);  // one copy of it is over the bound
  HeldJob fast, report;
  renderer_.submit(fast.job(RenderLane::kFast), fast.on_done(), RenderOwner::http());
  ASSERT_TRUE(run_until([&] { return fast.started.load(); }));
  write_to_record();  // cloned: the fast lane's view holds the old record and threads
  EXPECT_TRUE(collector_.view_copies_over_bound());
  renderer_.submit(report.job(RenderLane::kBulk), report.on_done(), RenderOwner::of_uid(1001));
  io_.run_for(std::chrono::milliseconds(100));
  write_to_record();  // no view holds the clones: written in place
  EXPECT_LT(view_copies(), record + record / 2) << "a second view holds a second copy";
  EXPECT_FALSE(report.started);
  fast.release.set_value();
  ASSERT_TRUE(run_until([&] { return report.started.load(); }));
  EXPECT_EQ(report.ended_seen, 2000u);  // frozen after the release: both writes
  report.release.set_value();
  EXPECT_TRUE(run_until([&] { return fast.done && report.done; }));
  EXPECT_EQ(view_copies(), 0u);
  renderer_.stop();
}

// Over the bound, a bulk view that waited for the fast lane's release is still paced (at
// most one per kMinViewInterval), however soon short fast rounds end: a tenant's stats
// loop must not make every report freeze a view of its own at once, each one more copy of
// every record written. (A lower bound the pacing timer guarantees; without the pacing
// the second report starts as soon as the fast round ends, a few ms after the first.)
TEST_F(RenderWorkerTest, OverTheCopyBoundABulkViewThatWaitedIsStillPaced) {
  big_record(1000);
  // Runs ready handlers until `done`, without run_until's 5 ms steps: the test measures
  // the worker's pause, not its own.
  const auto spin_until = [this](auto done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      io_.poll();
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    return done();
  };
  const auto held = collector_.freeze();  // keeps the copies over the bound throughout
  write_to_record();
  ASSERT_TRUE(collector_.view_copies_over_bound());
  HeldJob fast1, first, fast2, second;
  renderer_.submit(fast1.job(RenderLane::kFast), fast1.on_done(), RenderOwner::http());
  ASSERT_TRUE(spin_until([&] { return fast1.started.load(); }));
  renderer_.submit(first.job(RenderLane::kBulk, false), first.on_done(), RenderOwner::of_uid(1001));
  // The first report freezes its view after this (its wait ends with fast1's release),
  // the second no sooner than kMinViewInterval after that freeze.
  const auto before_first_freeze = std::chrono::steady_clock::now();
  fast1.release.set_value();
  ASSERT_TRUE(spin_until([&] { return first.done; }));
  renderer_.submit(fast2.job(RenderLane::kFast), fast2.on_done(), RenderOwner::http());
  ASSERT_TRUE(spin_until([&] { return fast2.started.load(); }));
  renderer_.submit(second.job(RenderLane::kBulk, false), second.on_done(),
                   RenderOwner::of_uid(1001));
  fast2.release.set_value();  // the second report's wait ends, right after the first's
  ASSERT_TRUE(spin_until([&] { return second.done && fast2.done; }));
  EXPECT_GE(second.start_time - before_first_freeze, RenderWorker::kMinViewInterval);
  renderer_.stop();
}

// Over the bound too, stats and metrics do not wait behind a report: the fast lane
// freezes a view of its own when the bulk lane's is older than its jobs.
TEST_F(RenderWorkerTest, OverTheCopyBoundTheFastLaneStillDoesNotWaitBehindAReport) {
  big_record(1000);
  HeldJob report, stats;
  renderer_.submit(report.job(RenderLane::kBulk), report.on_done(), RenderOwner::of_uid(1001));
  ASSERT_TRUE(run_until([&] { return report.started.load(); }));
  write_to_record();
  EXPECT_TRUE(collector_.view_copies_over_bound());
  renderer_.submit(stats.job(RenderLane::kFast, false), stats.on_done(), RenderOwner::of_uid(1002));
  EXPECT_TRUE(run_until([&] { return stats.done; }));
  EXPECT_EQ(stats.ended_seen, 1000u);
  EXPECT_FALSE(report.done);
  report.release.set_value();
  EXPECT_TRUE(run_until([&] { return report.done; }));
  renderer_.stop();
}

TEST(ReplyBytes, CountsPerUidAndForgetsAUidAtZero) {
  ReplyBytes bytes;
  bytes.add(1001, 300);
  bytes.add(1002, 5);
  bytes.remove(1001, 100);
  EXPECT_EQ(bytes.of(1001), 200u);
  EXPECT_EQ(bytes.of(1002), 5u);
  bytes.remove(1001, 1000);  // never below zero
  EXPECT_EQ(bytes.of(1001), 0u);
  EXPECT_EQ(bytes.of(7), 0u);
}

}  // namespace
}  // namespace steptrace::daemon
