// The render worker's fairness (daemon/serve/render_queue.h, render_worker.h): per-owner
// queues served round-robin, at most one job of an owner in progress, FIFO within an
// owner; a fast lane (stats, metrics, scrapes) that never waits behind a report.
#include "daemon/serve/render_worker.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <string>
#include <vector>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>

#include "daemon/serve/render_queue.h"
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

  test::FakeWorld world_;
  Collector collector_{Limits{}, world_.env()};
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
