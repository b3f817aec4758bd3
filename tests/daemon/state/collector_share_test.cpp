// A uid's fair share of the Collector's global budgets (issue 26, items 1 and 8): the
// state budget (Limits::max_state_bytes; the rule is in collector_state.h), exited
// processes (max_exited_processes) and retired jobs (max_jobs). A greedy uid that filled
// a budget alone gives back what another uid's share needs; what the daemon cannot keep
// is counted as the process's `refused` drops, so events + refused is what it sent.
// Through the Collector's own ingest API (collector_driver.h's DirectClient).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/state/collector.h"
#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon {
namespace {

using test::DirectClient;
using test::end;
using test::start;

constexpr std::uint32_t kForward = 0;
constexpr std::uint32_t kWaitPoll = 10;  // the highest built-in slot: eleven stack slots
constexpr std::uint32_t kGreedy = 1000;
constexpr std::uint32_t kInnocent = 2000;

using CollectorShareTest = test::CollectorFixture;

// A span of `step` on each of `threads` thread ids from `first_tid` (`open`: a start
// only, the span left open).
std::vector<proto::EventRecord> spans_on_threads(std::uint32_t first_tid, std::uint32_t threads,
                                                 std::uint32_t step, bool open = false) {
  std::vector<proto::EventRecord> events;
  for (std::uint32_t tid = first_tid; tid < first_tid + threads; ++tid) {
    events.push_back(start(tid, step, 1));
    if (!open) events.push_back(end(tid, step, 2));
  }
  return events;
}

struct Counted {
  std::uint64_t events = 0;
  std::uint64_t refused = 0;
  std::uint64_t forward = 0;  // Forward spans ended
  std::uint64_t abandoned = 0;
};

Counted counted(const Collector& collector, std::int32_t pid) {
  const auto view = collector.freeze();
  for (const ProcessFigures& p : view->processes(pid)) {
    Counted c{p.events.value_or(0), p.dropped_by_cause[proto::kRefusedCause], 0, p.abandoned};
    for (const StepFigures& s : p.steps) {
      if (s.name == "Forward") c.forward = s.hist().count();
    }
    return c;
  }
  ADD_FAILURE() << "no process " << pid;
  return {};
}

std::uint64_t hits(const Collector& collector, const std::string& limit) {
  const auto& hit = collector.counters().limits_hit;
  const auto it = hit.find(limit);
  return it == hit.end() ? 0 : it->second;
}

// Issue 26, item 1: one uid's processes fill max_state_bytes with thread state; another
// uid's trainer then still keeps every span (its share is taken back from the greedy
// one), and what the greedy one can no longer keep is counted, never lost silently.
TEST_F(CollectorShareTest, AGreedyUidGivesBackWhatAnotherUidsShareNeeds) {
  limits_.max_state_bytes = 1u << 20;
  make();
  std::vector<std::unique_ptr<DirectClient>> greedy;
  std::uint64_t greedy_sent = 0;
  for (std::int32_t pid = 1; pid <= 4; ++pid) {
    greedy.push_back(
        std::make_unique<DirectClient>(*collector_, world_.spawn(pid, 1, "greedy", kGreedy)));
    // Half the threads idle, half with a span open.
    const auto idle = spans_on_threads(1, 512, kWaitPoll);
    const auto open = spans_on_threads(1000, 512, kWaitPoll, true);
    ASSERT_FALSE(greedy.back()->events(idle));
    ASSERT_FALSE(greedy.back()->events(open));
    greedy_sent += idle.size() + open.size();
  }
  EXPECT_GT(hits(*collector_, "max_state_bytes"), 0u);  // it did fill the budget
  const auto charged = [&] { return collector_->freeze()->table().state_bytes_charged; };
  EXPECT_LE(charged(), limits_.max_state_bytes);
  std::uint64_t greedy_events = 0, greedy_refused = 0;
  for (std::int32_t pid = 1; pid <= 4; ++pid) {
    const Counted c = counted(*collector_, pid);
    greedy_events += c.events;
    greedy_refused += c.refused;
  }
  EXPECT_GT(greedy_refused, 0u);
  EXPECT_EQ(greedy_events + greedy_refused, greedy_sent);  // none lost uncounted

  // The innocent uid's trainer: 300 threads, far within its half of the budget.
  DirectClient trainer(*collector_, world_.spawn(10, 1, "trainer", kInnocent));
  const auto spans = spans_on_threads(1, 300, kForward);
  ASSERT_FALSE(trainer.events(spans));
  const Counted innocent = counted(*collector_, 10);
  EXPECT_EQ(innocent.events, spans.size());
  EXPECT_EQ(innocent.refused, 0u);
  EXPECT_EQ(innocent.forward, 300u);
  EXPECT_LE(charged(), limits_.max_state_bytes);

  // The greedy uid, now over its share with the budget full, is refused (and counted).
  const auto more = spans_on_threads(5000, 64, kWaitPoll);
  ASSERT_FALSE(greedy.front()->events(more));
  greedy_sent += more.size();
  greedy_events = greedy_refused = 0;
  std::uint64_t abandoned = 0;
  for (std::int32_t pid = 1; pid <= 4; ++pid) {
    const Counted c = counted(*collector_, pid);
    greedy_events += c.events;
    greedy_refused += c.refused;
    abandoned += c.abandoned;
  }
  EXPECT_EQ(greedy_events + greedy_refused, greedy_sent);
  // Its idle threads went first: no open span of its had to be abandoned for 300 threads.
  EXPECT_EQ(abandoned, 0u);
}

// A uid within its share is admitted only by taking from a uid over its share: two uids
// each at their half, the budget full, neither may take the other's half; a third that
// comes gets its third.
TEST_F(CollectorShareTest, NoUidIsPushedUnderItsShare) {
  limits_.max_state_bytes = 512u << 10;
  make();
  DirectClient a(*collector_, world_.spawn(1, 1, "a", 1001));
  DirectClient b(*collector_, world_.spawn(2, 1, "b", 1002));
  std::uint64_t sent_b = 0;
  // a fills the budget alone; b takes back its half; then both push for more.
  const auto fill = spans_on_threads(1, 1024, kWaitPoll);
  ASSERT_FALSE(a.events(fill));
  for (std::uint32_t round = 0; round < 4; ++round) {
    const auto batch = spans_on_threads(10'000 + round * 1024, 1024, kWaitPoll);
    ASSERT_FALSE(b.events(batch));
    sent_b += batch.size();
  }
  const auto view = collector_->freeze();
  const std::uint64_t total = view->table().state_bytes_charged;
  std::uint64_t charged_a = 0, charged_b = 0;
  {
    // A thread's charge is what one more thread costs: b's bytes are its threads.
    const Counted cb = counted(*collector_, 2);
    EXPECT_EQ(cb.events + cb.refused, sent_b);
    EXPECT_GT(cb.refused, 0u);  // it wanted more than its half
  }
  // Each holds about half (a thread's worth of rounding, and the 1/16 reserve).
  a.close();  // gives back a's threads: what is left is b's
  charged_b = collector_->freeze()->table().state_bytes_charged;
  charged_a = total - charged_b;
  const std::uint64_t half = limits_.max_state_bytes / 2;
  EXPECT_LE(charged_b, half);
  EXPECT_GT(charged_b, half - (half / 4)) << charged_b;
  EXPECT_GT(charged_a, half / 2) << charged_a;  // a kept a share too, not pushed to 0
}

// Root's (and the daemon's own uid's) reserve: the other uids may not charge the last
// 1/16 of the budget, so root's threads are kept without taking anyone's state.
TEST_F(CollectorShareTest, RootKeepsAReserveNoOtherUidMayCharge) {
  limits_.max_state_bytes = 512u << 10;
  make();
  DirectClient greedy(*collector_, world_.spawn(1, 1, "greedy", kGreedy));
  DirectClient greedy2(*collector_, world_.spawn(3, 1, "greedy", kGreedy));
  ASSERT_FALSE(greedy.events(spans_on_threads(1, 1024, kWaitPoll)));
  ASSERT_FALSE(greedy2.events(spans_on_threads(1, 1024, kWaitPoll)));
  const std::uint64_t full = collector_->freeze()->table().state_bytes_charged;
  EXPECT_LE(full, limits_.max_state_bytes - limits_.max_state_bytes / 16);
  const std::uint64_t greedy_hits = hits(*collector_, "max_state_bytes");
  EXPECT_GT(greedy_hits, 0u);

  DirectClient root(*collector_, world_.spawn(2, 1, "root-tool", 0));
  ASSERT_FALSE(root.events(spans_on_threads(1, 40, kForward)));
  const Counted r = counted(*collector_, 2);
  EXPECT_EQ(r.forward, 40u);
  EXPECT_EQ(r.refused, 0u);
  // Nothing was taken from the greedy uid (all of root's is on top), nothing refused.
  EXPECT_GT(collector_->freeze()->table().state_bytes_charged, full);
  EXPECT_EQ(hits(*collector_, "max_state_bytes"), greedy_hits);
  EXPECT_EQ(counted(*collector_, 1).abandoned, 0u);
}

// Issue 26, item 8: another uid's churn of short-lived processes used to evict a process
// that had just exited; now the uid holding the most exited processes gives its oldest.
TEST_F(CollectorShareTest, AnotherUidsChurnEvictsItsOwnExitedProcessesFirst) {
  limits_.max_exited_processes = 4;
  make();
  {
    DirectClient innocent(*collector_, world_.spawn(100, 1, "trainer", kInnocent));
    ASSERT_FALSE(innocent.events({start(1, kForward, 1), end(1, kForward, 2)}));
    world_.kill(100);
  }
  for (std::int32_t pid = 1; pid <= 20; ++pid) {
    DirectClient churn(*collector_, world_.spawn(pid, 1, "churn", kGreedy));
    ASSERT_FALSE(churn.events({start(1, kForward, 1), end(1, kForward, 2)}));
    world_.kill(pid);
  }
  const auto view = collector_->freeze();
  const auto processes = view->processes();
  ASSERT_EQ(processes.size(), 4u);
  std::size_t innocent = 0;
  for (const ProcessFigures& p : processes) {
    EXPECT_FALSE(p.alive);
    if (p.uid == kInnocent) ++innocent;
  }
  EXPECT_EQ(innocent, 1u);  // still there: it holds 1 of 4, within its share of 2
  EXPECT_EQ(counted(*collector_, 100).forward, 1u);
  // The churn's newest three stay (FIFO within a uid).
  EXPECT_EQ(view->processes(20).size(), 1u);
  EXPECT_EQ(view->processes(18).size(), 1u);
  EXPECT_EQ(view->processes(17).size(), 0u);
  EXPECT_EQ(hits(*collector_, "max_exited_processes"), 17u);
}

// Issue 26, item 8: four uids together used to evict a fifth's retired job through
// max_jobs; now the uid holding the most retired jobs gives its least recent.
TEST_F(CollectorShareTest, OtherUidsJobsCannotPushOutAUidsJobWithinItsShare) {
  limits_.max_exited_processes = 0;  // every exit evicts: its job retires at once
  limits_.max_jobs = 8;
  make();
  std::int32_t pid = 1;
  const auto run_job = [&](std::uint32_t uid, const std::string& job) {
    {
      DirectClient c(*collector_, world_.spawn(pid, 1, "job", uid));
      c.identity(job);
      ASSERT_FALSE(c.events({start(1, kForward, 1), end(1, kForward, 2)}));
      world_.kill(pid);
    }
    ++pid;
  };
  run_job(kInnocent, "innocent");
  for (std::uint32_t round = 0; round < 3; ++round) {
    for (std::uint32_t uid = 3000; uid < 3004; ++uid) {
      run_job(uid, "j" + std::to_string(round));
    }
  }
  const auto view = collector_->freeze();
  const auto processes = view->processes();
  EXPECT_TRUE(processes.empty());
  const auto jobs = view->jobs_and_retired(processes);
  EXPECT_EQ(jobs.size(), 8u);
  std::map<std::uint32_t, std::size_t> per_uid;
  bool innocent = false;
  for (const JobFigures& j : jobs) {
    ++per_uid[j.uid];
    if (j.uid == kInnocent && j.job == "innocent") innocent = j.retired.has_value();
  }
  EXPECT_TRUE(innocent);  // 1 of 8 with five uids holding jobs: within its share
  for (std::uint32_t uid = 3000; uid < 3004; ++uid) {
    EXPECT_LE(per_uid[uid], 2u) << uid;  // the four gave back their oldest, evenly
    EXPECT_GE(per_uid[uid], 1u) << uid;
  }
  EXPECT_EQ(hits(*collector_, "max_jobs"), 5u);
}

}  // namespace
}  // namespace steptrace::daemon
