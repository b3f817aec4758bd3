// The Collector's totals against a tenant's durations (issue 26, item 6): every sum
// saturates at 2^64-1 (state/saturating.h) rather than wrapping, from a step's self time
// to its job's retired totals, and a span longer than Limits::max_span_ns is refused when
// its end arrives, in no total, and counted: a max_span_ns limit hit per span and its two
// records as the process's `refused` drops. How reports show these: tests/daemon/report/.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "daemon/state/collector.h"
#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon {
namespace {

using test::DirectClient;
using test::end;
using test::start;

constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
constexpr std::uint32_t kForward = 0;
constexpr std::uint32_t kBackward = 1;

const StepFigures* step_of(const std::vector<StepFigures>& steps, std::string_view name) {
  for (const StepFigures& s : steps) {
    if (s.name == name) return &s;
  }
  ADD_FAILURE() << "no step " << name;
  return nullptr;
}

// A frozen view and its processes (whose figures point into the view).
struct Frozen {
  explicit Frozen(const Collector& collector)
      : view(collector.freeze()), processes(view->processes()) {}
  const ProcessFigures& only() const {
    static const ProcessFigures kNone{};
    EXPECT_EQ(processes.size(), 1u);
    return processes.empty() ? kNone : processes.front();
  }
  std::shared_ptr<const CollectorView> view;
  std::vector<ProcessFigures> processes;
};

using CollectorTotalsTest = test::CollectorFixture;

// A Backward span holding three Forward spans of 2^64-1 ns each, on one thread.
std::vector<proto::EventRecord> three_longest_spans() {
  std::vector<proto::EventRecord> events = {start(1, kBackward, 0)};
  for (int i = 0; i < 3; ++i) {
    events.push_back(start(1, kForward, 0));
    events.push_back(end(1, kForward, kMax));
  }
  events.push_back(end(1, kBackward, kMax));
  return events;
}

TEST_F(CollectorTotalsTest, ThreeSpansOfTheLongestDurationSaturateEveryTotal) {
  limits_.max_span_ns = kMax;  // no bound: the sums alone must hold
  limits_.max_exited_processes = 0;
  make();
  {
    DirectClient a(*collector_, world_.spawn(1, 1, "a", 7));
    DirectClient b(*collector_, world_.spawn(2, 1, "b", 7));
    for (DirectClient* c : {&a, &b}) {
      c->identity("team");
      ASSERT_FALSE(c->events(three_longest_spans()));
      c->dropped(kMax - 1);
    }
    const Frozen frozen(*collector_);
    const std::vector<ProcessFigures>& processes = frozen.processes;
    const CollectorView* view = frozen.view.get();
    ASSERT_EQ(processes.size(), 2u);
    for (const ProcessFigures& p : processes) {
      const StepFigures* forward = step_of(p.steps, "Forward");
      ASSERT_NE(forward, nullptr);
      EXPECT_EQ(forward->hist().count(), 3u);
      EXPECT_EQ(forward->hist().sum(), kMax);
      EXPECT_EQ(forward->self_ns, kMax);  // not 2^64-3
      // Its children's time saturates too: nothing of Backward is its own.
      EXPECT_EQ(step_of(p.steps, "Backward")->self_ns, 0u);
    }
    // Merged over the table and over the job: at the ceiling, never below a part.
    for (const std::vector<StepFigures>& totals :
         {view->totals(processes), view->totals(view->jobs(processes).at(0).processes)}) {
      const StepFigures* forward = step_of(totals, "Forward");
      ASSERT_NE(forward, nullptr);
      EXPECT_EQ(forward->hist().count(), 6u);
      EXPECT_EQ(forward->hist().sum(), kMax);
      EXPECT_EQ(forward->self_ns, kMax);
    }
    world_.kill(1);
    world_.kill(2);
  }
  // Both evicted as they exit (max_exited_processes 0): what they leave their job.
  const Frozen frozen(*collector_);
  ASSERT_TRUE(frozen.processes.empty());
  const std::vector<JobFigures> jobs = frozen.view->jobs_and_retired(frozen.processes);
  ASSERT_EQ(jobs.size(), 1u);
  ASSERT_TRUE(jobs[0].retired.has_value());
  EXPECT_EQ(jobs[0].retired->processes, 2u);
  EXPECT_EQ(jobs[0].retired->dropped, kMax);
  bool found = false;
  for (const RetiredStepTotals& t : jobs[0].retired->steps) {
    if (t.name != "Forward") continue;
    found = true;
    EXPECT_EQ(t.count, 6u);
    EXPECT_EQ(t.total_ns, kMax);
    EXPECT_EQ(t.self_ns, kMax);
  }
  EXPECT_TRUE(found);
  for (const StepHistogram& h : frozen.view->step_histograms()) {
    if (h.name == "Forward") {
      EXPECT_EQ(h.hist.sum(), kMax);
    }
  }
}

TEST_F(CollectorTotalsTest, ASpanPastMaxSpanNsIsRefusedAndCountedAndOneAtItIsKept) {
  limits_.max_span_ns = 1000;
  make();
  DirectClient c(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(c.events({
      start(1, kForward, 0), end(1, kForward, 1000),          // at the bound: kept
      start(1, kForward, 2000), end(1, kForward, 3001),       // 1 ns past: refused
      start(1, kForward, 4000), end(1, kForward, 4999),       // just under: kept
      start(1, kBackward, 10000), start(1, kForward, 10000),  // a refused one inside
      end(1, kForward, 20000), end(1, kBackward, 10500),      // is not its parent's child
  }));
  {
    const Frozen frozen(*collector_);
    const ProcessFigures& p = frozen.only();
    const StepFigures* forward = step_of(p.steps, "Forward");
    ASSERT_NE(forward, nullptr);
    EXPECT_EQ(forward->hist().count(), 2u);
    EXPECT_EQ(forward->hist().sum(), 1999u);
    EXPECT_EQ(forward->hist().max(), 1000u);
    EXPECT_EQ(forward->self_ns, 1999u);
    EXPECT_EQ(forward->open, 0u);  // a refused span is closed all the same
    EXPECT_EQ(step_of(p.steps, "Backward")->self_ns, 500u);
    EXPECT_EQ(p.dropped_by_cause[proto::kRefusedCause], 4u);  // two records per span
    EXPECT_EQ(p.dropped, 4u);
    EXPECT_EQ(p.events, 6u);  // with dropped, the 10 records sent
  }
  EXPECT_EQ(collector_->counters().limits_hit.at("max_span_ns"), 2u);
  EXPECT_EQ(collector_->counters().events_dropped_by_cause[proto::kRefusedCause], 4u);
  EXPECT_EQ(collector_->counters().events_dropped_by_clients, 4u);

  // The client's own report does not know them: they come on top of it.
  c.dropped_by_cause({{1, 0, 0, 0}});
  EXPECT_EQ(Frozen(*collector_).only().dropped, 5u);
  // Nor are they a crash's loss when the process says what daemons took.
  collector_->delivered(c.handle(), 10);
  EXPECT_EQ(Frozen(*collector_).only().dropped_by_cause[proto::kDaemonCrashCause], 0u);
  collector_->delivered(c.handle(), 12);
  const Frozen frozen(*collector_);
  const ProcessFigures& p = frozen.only();
  EXPECT_EQ(p.dropped_by_cause[proto::kDaemonCrashCause], 2u);
  EXPECT_EQ(p.dropped, 7u);
}

TEST_F(CollectorTotalsTest, TheDefaultBoundIsAWeek) {
  constexpr std::uint64_t kWeek = 7ull * 24 * 3600 * 1'000'000'000;
  EXPECT_EQ(Limits{}.max_span_ns, kWeek);
  DirectClient c(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(
      c.events({start(1, kForward, 5), end(1, kForward, 5 + kWeek), start(1, kForward, 5),
                end(1, kForward, 6 + kWeek), start(1, kForward, 0), end(1, kForward, kMax)}));
  const Frozen frozen(*collector_);
  const ProcessFigures& p = frozen.only();
  const StepFigures* forward = step_of(p.steps, "Forward");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ(forward->hist().count(), 1u);
  EXPECT_EQ(forward->hist().sum(), kWeek);
  EXPECT_EQ(p.dropped_by_cause[proto::kRefusedCause], 4u);
  EXPECT_EQ(collector_->counters().limits_hit.at("max_span_ns"), 2u);
}

}  // namespace
}  // namespace steptrace::daemon
