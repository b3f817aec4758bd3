// The Collector (daemon/state/collector.h) fed through its own ingest API
// (tests/daemon/state/collector_driver.h's DirectClient) and read through its read model
// (CollectorView::processes, totals, jobs, table, ledger, counters: plain values). How
// reports render these figures is tested in tests/daemon/report/, how serve's
// ClientStream hands decoded frames to the Collector in tests/daemon/serve/.
#include "daemon/state/collector.h"

#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon {
namespace {

using test::DirectClient;
using test::end;
using test::FakeWorld;
using test::start;

constexpr std::uint32_t kForward = 0;
constexpr std::uint32_t kBackward = 1;
constexpr std::uint32_t kMatmul = 2;
constexpr std::uint32_t kWaitPoll = 10;

constexpr std::size_t cause(proto::DropCause c) { return static_cast<std::size_t>(c); }

// A step's figures as plain numbers: its histogram read out beside its counts.
struct StepRow {
  std::uint64_t count = 0;
  std::uint64_t total_ns = 0;
  std::uint64_t min_ns = 0;
  std::uint64_t max_ns = 0;
  std::uint64_t p50_ns = 0;
  std::uint64_t open = 0;
  std::uint64_t unmatched_ends = 0;
  std::uint64_t abandoned = 0;
  std::uint64_t depth_dropped = 0;
  std::uint64_t self_ns = 0;
  std::uint64_t processes = 0;
};

StepRow row_of(const StepFigures& s) {
  const Histogram& h = s.hist();
  return {.count = h.count(),
          .total_ns = h.sum(),
          .min_ns = h.min(),
          .max_ns = h.max(),
          .p50_ns = h.percentile(0.50),
          .open = s.open,
          .unmatched_ends = s.unmatched_ends,
          .abandoned = s.abandoned,
          .depth_dropped = s.depth_dropped,
          .self_ns = s.self_ns,
          .processes = s.processes};
}

const StepFigures* find_step(const std::vector<StepFigures>& steps, std::string_view name) {
  for (const StepFigures& s : steps) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

// The read model at one instant: a view and its processes (all, or one pid's), with
// lookups that fail the test when what they look for is not there.
class Seen {
 public:
  explicit Seen(std::shared_ptr<const CollectorView> view,
                std::optional<std::int32_t> pid = std::nullopt)
      : view_(std::move(view)), processes_(view_->processes(pid)) {}
  explicit Seen(const Collector& collector, std::optional<std::int32_t> pid = std::nullopt)
      : Seen(collector.freeze(), pid) {}

  const CollectorView& view() const { return *view_; }
  const std::vector<ProcessFigures>& processes() const { return processes_; }
  std::vector<StepFigures> totals() const { return view_->totals(processes_); }
  std::vector<JobFigures> jobs() const { return view_->jobs(processes_); }

  bool has_process(std::int32_t pid) const { return find(pid) != nullptr; }
  const ProcessFigures& process(std::int32_t pid) const {
    static const ProcessFigures kNone{};
    const ProcessFigures* p = find(pid);
    if (p == nullptr) ADD_FAILURE() << "no process " << pid;
    return p ? *p : kNone;
  }
  bool has_step(std::int32_t pid, std::string_view name) const {
    const ProcessFigures* p = find(pid);
    return p != nullptr && find_step(p->steps, name) != nullptr;
  }
  StepRow step(std::int32_t pid, std::string_view name) const {
    const StepFigures* s = find_step(process(pid).steps, name);
    if (s == nullptr) ADD_FAILURE() << "process " << pid << " has no step " << name;
    return s ? row_of(*s) : StepRow{};
  }
  StepRow total(std::string_view name) const {
    const auto all = totals();
    const StepFigures* s = find_step(all, name);
    if (s == nullptr) ADD_FAILURE() << "no total of " << name;
    return s ? row_of(*s) : StepRow{};
  }

 private:
  const ProcessFigures* find(std::int32_t pid) const {
    for (const ProcessFigures& p : processes_) {
      if (p.key.pid == pid) return &p;
    }
    return nullptr;
  }

  std::shared_ptr<const CollectorView> view_;
  std::vector<ProcessFigures> processes_;
};

void describe(std::ostream& out, const StepFigures& s) {
  const StepRow r = row_of(s);
  out << "  step " << s.name << " count " << r.count << " sum " << r.total_ns << " min " << r.min_ns
      << " max " << r.max_ns << " p50 " << r.p50_ns << " p99 " << s.hist().percentile(0.99)
      << " open " << r.open << " unmatched " << r.unmatched_ends << " abandoned " << r.abandoned
      << " depth_dropped " << r.depth_dropped << " self " << r.self_ns << " processes "
      << r.processes << " buckets";
  for (const std::uint64_t b : s.hist().prom_buckets()) out << ' ' << b;
  out << '\n';
}

// Everything the read model answers about a view, one fact a line, so that two views
// compare as strings (and a difference shows where it is). Reads every process record,
// histogram and the ledger, as the renderers do.
std::string read_model_of(const CollectorView& view) {
  std::ostringstream out;
  out << "now " << view.now_ns() << '\n';
  const std::vector<ProcessFigures> processes = view.processes();
  for (const ProcessFigures& p : processes) {
    out << "process " << p.key.pid << '/' << p.key.start_time << " uid " << p.uid << " gid "
        << p.gid << " comm " << p.comm << " client " << p.client << " library " << p.library_version
        << " job " << p.job << " rank " << p.rank << " local " << p.local_rank << " world "
        << p.world_size << " alive " << p.alive << " connections " << p.connections << " exited_at "
        << p.exited_at_ns << " dropped " << p.dropped << " by_cause";
    for (const std::uint64_t n : p.dropped_by_cause) out << ' ' << n;
    out << " unmatched " << p.unmatched_ends << " abandoned " << p.abandoned << " open " << p.open
        << '\n';
    for (const StepFigures& s : p.steps) describe(out, s);
    for (const OpenSpanNow& c : p.current) {
      out << "  current " << c.thread << ' ' << c.step << ' ' << c.open_for_ns << ' ' << c.depth
          << '\n';
    }
  }
  out << "totals\n";
  for (const StepFigures& s : view.totals(processes)) describe(out, s);
  for (const JobFigures& j : view.jobs(processes)) {
    out << "job " << j.uid << ' ' << j.job << " processes " << j.processes.size() << " live "
        << j.live << " world " << j.world_size << " ranks";
    for (const std::uint32_t r : j.ranks) out << ' ' << r;
    out << '\n';
    for (const StepFigures& s : view.totals(j.processes)) describe(out, s);
  }
  const TableFigures t = view.table();
  out << "table " << t.tracked << ' ' << t.live << ' ' << t.exited << ' ' << t.connected << ' '
      << t.custom_steps << ' ' << t.state_bytes_estimate << ' ' << t.state_bytes_charged << '\n';
  for (const auto& [uuid, gpu] : view.ledger().gpus) {
    out << "gpu " << uuid << " reserved " << gpu.reserved_bytes << " high " << gpu.high_water_bytes
        << " leaked " << gpu.leaked() << '\n';
    for (const auto& [id, r] : gpu.reservations) {
      out << "  reservation " << id << " holder " << r.holder.pid << '/' << r.holder.start_time
          << " bytes " << r.bytes << " task " << r.task << " alive " << r.holder_alive << '\n';
    }
  }
  const DaemonCounters& k = view.counters();
  out << "counters " << k.events_received << ' ' << k.events_dropped_by_clients << ' '
      << k.liveness_probe_errors << " by_cause";
  for (const std::uint64_t n : k.events_dropped_by_cause) out << ' ' << n;
  for (const auto& [limit, hits] : k.limits_hit) out << ' ' << limit << '=' << hits;
  out << '\n';
  return out.str();
}

using CollectorTest = test::CollectorFixture;

TEST_F(CollectorTest, CountsTotalsMinMaxAreExact) {
  DirectClient c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.attach_error());
  ASSERT_FALSE(c.events({start(1, kForward, 1000), end(1, kForward, 1100), start(1, kForward, 2000),
                         end(1, kForward, 2300), start(1, kForward, 3000), end(1, kForward, 3200),
                         start(1, kMatmul, 4000), end(1, kMatmul, 9000)}));
  const Seen seen(*collector_);
  const StepRow f = seen.step(100, "Forward");
  EXPECT_EQ(f.count, 3u);
  EXPECT_EQ(f.total_ns, 600u);
  EXPECT_EQ(f.min_ns, 100u);
  EXPECT_EQ(f.max_ns, 300u);
  EXPECT_NEAR(static_cast<double>(f.p50_ns), 200.0, 4.0);
  EXPECT_EQ(f.open, 0u);
  EXPECT_EQ(seen.step(100, "Matmul").total_ns, 5000u);
  EXPECT_FALSE(seen.has_step(100, "Backward"));  // no data: not listed
  EXPECT_EQ(collector_->counters().events_received, 8u);
}

TEST_F(CollectorTest, NestedSpansOfOneStepMatchAsAStack) {
  DirectClient c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kForward, 10), end(1, kForward, 30),
                         end(1, kForward, 100)}));
  const StepRow f = Seen(*collector_).step(100, "Forward");
  EXPECT_EQ(f.count, 2u);
  EXPECT_EQ(f.min_ns, 20u);   // inner
  EXPECT_EQ(f.max_ns, 100u);  // outer
  EXPECT_EQ(f.total_ns, 120u);
}

TEST_F(CollectorTest, ThreadsHaveTheirOwnStacks) {
  DirectClient c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(2, kForward, 5), end(1, kForward, 10),
                         start(3, kForward, 20), end(2, kForward, 50), end(3, kForward, 21)}));
  const StepRow f = Seen(*collector_).step(100, "Forward");
  EXPECT_EQ(f.count, 3u);
  EXPECT_EQ(f.total_ns, 10u + 45u + 1u);
  EXPECT_EQ(f.min_ns, 1u);
  EXPECT_EQ(f.max_ns, 45u);
}

TEST_F(CollectorTest, EndWithoutStartIsUnmatched) {
  DirectClient c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({end(1, kForward, 10), start(2, kForward, 0), end(1, kForward, 20)}));
  const StepRow f = Seen(*collector_).step(100, "Forward");
  EXPECT_EQ(f.unmatched_ends, 2u);  // thread 1 never started one
  EXPECT_EQ(f.count, 0u);
  EXPECT_EQ(f.open, 1u);  // thread 2's start
}

TEST_F(CollectorTest, OpenSpansAreAbandonedWhenTheLastConnectionCloses) {
  const PeerIdentity peer = world_.spawn(100, 5, "trainer");
  DirectClient a(*collector_, peer);
  DirectClient b(*collector_, peer);
  ASSERT_EQ(a.handle(), b.handle());  // one process record for both
  ASSERT_FALSE(a.events({start(1, kForward, 0), start(1, kWaitPoll, 5)}));
  a.close();
  StepRow f = Seen(*collector_).step(100, "Forward");
  EXPECT_EQ(f.open, 1u);  // b still connected
  EXPECT_EQ(f.abandoned, 0u);
  b.close();
  const Seen seen(*collector_);
  f = seen.step(100, "Forward");
  EXPECT_EQ(f.open, 0u);
  EXPECT_EQ(f.abandoned, 1u);
  EXPECT_EQ(seen.step(100, "WaitPoll").abandoned, 1u);
  EXPECT_EQ(seen.process(100).abandoned, 2u);
  EXPECT_TRUE(seen.process(100).current.empty());
}

TEST_F(CollectorTest, CustomStepsMergeByNameAcrossProcesses) {
  DirectClient p1(*collector_, world_.spawn(100, 5, "a"));
  DirectClient p2(*collector_, world_.spawn(200, 6, "b"));
  ASSERT_FALSE(p1.register_step(256, "Tokenize"));
  ASSERT_FALSE(p2.register_step(300, "Tokenize"));
  ASSERT_FALSE(p2.register_step(301, "Shuffle"));
  ASSERT_FALSE(p1.events({start(1, 256, 0), end(1, 256, 100)}));
  ASSERT_FALSE(p2.events({start(7, 300, 0), end(7, 300, 300), start(7, 301, 0), end(7, 301, 1)}));
  const Seen seen(*collector_);
  EXPECT_EQ(seen.step(100, "Tokenize").count, 1u);
  EXPECT_EQ(seen.step(200, "Tokenize").count, 1u);
  const StepRow t = seen.total("Tokenize");
  EXPECT_EQ(t.count, 2u);
  EXPECT_EQ(t.total_ns, 400u);
  EXPECT_EQ(t.min_ns, 100u);
  EXPECT_EQ(t.max_ns, 300u);
  EXPECT_EQ(t.processes, 2u);
  EXPECT_EQ(seen.total("Shuffle").processes, 1u);
}

TEST_F(CollectorTest, RegisteringAgainWithAnotherNameFails) {
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(c.register_step(256, "Tokenize"));
  EXPECT_FALSE(c.register_step(256, "Tokenize"));  // same name again: fine
  EXPECT_EQ(c.register_step(256, "Other"), make_error_code(errc::bad_string));
}

TEST_F(CollectorTest, EventForUnregisteredCustomStepFailsAndKeepsEarlierEvents) {
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_EQ(
      c.events({start(1, kForward, 0), end(1, kForward, 50), start(1, 257, 60), end(1, 257, 70)}),
      make_error_code(errc::unregistered_step));
  const Seen seen(*collector_);
  EXPECT_EQ(seen.step(100, "Forward").count, 1u);
  EXPECT_EQ(seen.process(100).steps.size(), 1u);
}

// A registration past max_custom_steps is counted and its step's events refused (the
// process's `refused` drops), while the connection and its other steps go on: ending the
// connection only made the client reconnect and register the step again, in a loop.
TEST_F(CollectorTest, CustomStepLimitRefusesThatStepsEventsAndCountsThem) {
  limits_.max_custom_steps = 2;
  make();
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(c.register_step(256, "s1"));
  EXPECT_FALSE(c.register_step(257, "s2"));
  EXPECT_FALSE(c.register_step(258, "s3"));
  EXPECT_EQ(collector_->counters().limits_hit.at("max_custom_steps"), 1u);
  EXPECT_FALSE(c.events({start(1, 256, 0), start(1, 258, 10), end(1, 258, 20), end(1, 256, 30),
                         start(1, 258, 40), end(1, 258, 50)}));
  {
    const Seen seen(*collector_);
    EXPECT_EQ(seen.step(100, "s1").count, 1u);
    EXPECT_EQ(seen.process(100).steps.size(), 1u);  // nothing under s3
    EXPECT_EQ(seen.process(100).events, 2u);
    EXPECT_EQ(seen.process(100).dropped_by_cause[proto::kRefusedCause], 4u);
    EXPECT_EQ(seen.process(100).dropped, 4u);
  }
  // Registered again on another connection (as a client does after a reconnect): still
  // past the bound, still refused; the process's known ids are still fine.
  DirectClient again(*collector_, world_.spawn(100, 5, "a"));
  EXPECT_FALSE(again.register_step(257, "s2"));
  EXPECT_FALSE(again.register_step(258, "s3"));
  EXPECT_FALSE(again.events({start(1, 258, 60), end(1, 258, 70)}));
  EXPECT_EQ(collector_->counters().limits_hit.at("max_custom_steps"), 2u);
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(100).dropped_by_cause[proto::kRefusedCause], 6u);
  // An id never registered at all is still a protocol error.
  EXPECT_EQ(again.events({start(1, 259, 80)}), make_error_code(errc::unregistered_step));
}

TEST_F(CollectorTest, OpenDepthLimitDropsTheStartAndCountsIt) {
  limits_.max_open_depth = 2;
  make();
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kForward, 1), start(1, kForward, 2),
                         end(1, kForward, 10), end(1, kForward, 20), end(1, kForward, 30)}));
  const StepRow f = Seen(*collector_).step(100, "Forward");
  EXPECT_EQ(f.count, 2u);
  EXPECT_EQ(f.depth_dropped, 1u);
  EXPECT_EQ(f.unmatched_ends, 1u);  // the end of the dropped start
  EXPECT_EQ(collector_->counters().limits_hit.at("max_open_depth"), 1u);
}

TEST_F(CollectorTest, OpenDepthLimitCountsEveryStepOfTheThread) {
  limits_.max_open_depth = 2;
  make();
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  // Two open spans of different steps fill thread 1; a third step's start is dropped.
  // Thread 2 has its own budget.
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(1, kBackward, 1), start(1, kMatmul, 2),
                         start(2, kMatmul, 3), end(1, kMatmul, 10), end(1, kBackward, 20),
                         end(1, kForward, 30), end(2, kMatmul, 40)}));
  const Seen seen(*collector_);
  EXPECT_EQ(seen.step(100, "Forward").count, 1u);
  EXPECT_EQ(seen.step(100, "Backward").count, 1u);
  const StepRow m = seen.step(100, "Matmul");
  EXPECT_EQ(m.count, 1u);  // thread 2's
  EXPECT_EQ(m.depth_dropped, 1u);
  EXPECT_EQ(m.unmatched_ends, 1u);  // thread 1's end of the dropped start
  EXPECT_EQ(collector_->counters().limits_hit.at("max_open_depth"), 1u);
}

TEST_F(CollectorTest, ProcessLimitRefusesWhenFullOfLiveProcesses) {
  limits_.max_processes = 2;
  make();
  auto a = std::make_unique<DirectClient>(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a->attach_error());
  ASSERT_FALSE(b.attach_error());
  {
    DirectClient c(*collector_, world_.spawn(3, 1, "c"));
    EXPECT_EQ(c.attach_error(), make_error_code(errc::limit_reached));
  }
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes"), 1u);
  world_.kill(1);
  a.reset();  // detach: process 1 is gone, so it is exited and can make room
  DirectClient d(*collector_, world_.spawn(4, 1, "d"));
  EXPECT_FALSE(d.attach_error());
  const Seen seen(*collector_);
  EXPECT_FALSE(seen.has_process(1));
  EXPECT_TRUE(seen.has_process(4));
}

// Issue 15, item 3: one uid cannot fill the process table the others share.
TEST_F(CollectorTest, LiveProcessesPerUidAreBoundedAndOtherUidsStillGetIn) {
  limits_.max_processes_per_uid = 2;
  make();
  auto a = std::make_unique<DirectClient>(*collector_, world_.spawn(1, 1, "a", 1000));
  DirectClient b(*collector_, world_.spawn(2, 1, "b", 1000));
  ASSERT_FALSE(a->attach_error());
  ASSERT_FALSE(b.attach_error());
  {
    DirectClient c(*collector_, world_.spawn(3, 1, "c", 1000));
    EXPECT_EQ(c.attach_error(), make_error_code(errc::limit_reached));
  }
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes_per_uid"), 1u);
  DirectClient other(*collector_, world_.spawn(10, 1, "other", 2000));
  EXPECT_FALSE(other.attach_error());
  // A second connection of a process already tracked is no new process.
  DirectClient b_again(*collector_, world_.spawn(2, 1, "b", 1000));
  EXPECT_FALSE(b_again.attach_error());
  // Once one of its processes exited, the uid may start another.
  world_.kill(1);
  a.reset();
  DirectClient d(*collector_, world_.spawn(4, 1, "d", 1000));
  EXPECT_FALSE(d.attach_error());
  EXPECT_EQ(collector_->counters().limits_hit.at("max_processes_per_uid"), 1u);
}

// Issue 15, item 2: 1,024 custom steps x 1,024 thread ids used to cost ~25 MB per process
// with no limit hit. Now the state a process's input makes is charged and bounded.
TEST_F(CollectorTest, StateAProcessMakesIsBoundedPerProcessAndInAllAndCounted) {
  limits_.max_state_bytes = 40u << 20;  // room for two processes at the 16 MiB share
  make();
  const auto flood = [&](DirectClient& c) {
    for (std::uint32_t i = 0; i < proto::kMaxCustomSteps; ++i) {
      ASSERT_FALSE(c.register_step(proto::kFirstCustomStep + i, "s" + std::to_string(i)));
    }
    const std::uint32_t top = proto::kFirstCustomStep + proto::kMaxCustomSteps - 1;
    std::vector<proto::EventRecord> events;
    for (std::uint32_t tid = 1; tid <= 1024; ++tid) events.push_back(start(tid, top, tid));
    ASSERT_FALSE(c.events(events));
  };
  const auto charged = [&] { return collector_->freeze()->table().state_bytes_charged; };
  DirectClient a(*collector_, world_.spawn(1, 1, "a", 1000));
  flood(a);
  const Limits defaults;
  EXPECT_GT(collector_->counters().limits_hit.at("max_process_state_bytes"), 0u);
  EXPECT_LE(charged(), defaults.max_process_state_bytes);
  EXPECT_GT(charged(), defaults.max_process_state_bytes - (64u << 10));  // it did fill up
  // What the table really holds (the record, and a little for the table itself) stays
  // near the process's share (histograms are not charged, and these are empty: one start
  // per thread).
  const std::uint64_t real = collector_->freeze()->table().state_bytes_estimate;
  EXPECT_LT(real, defaults.max_process_state_bytes + (2u << 20)) << real;

  // Another process has its own share; a third finds the total used up.
  DirectClient b(*collector_, world_.spawn(2, 1, "b", 1001));
  flood(b);
  DirectClient c(*collector_, world_.spawn(3, 1, "c", 1002));
  ASSERT_FALSE(c.events({start(1, kForward, 1), end(1, kForward, 2)}));
  flood(c);
  EXPECT_GT(collector_->counters().limits_hit.at("max_state_bytes"), 0u);
  EXPECT_LE(charged(), limits_.max_state_bytes);

  // A process's threads are given back when its last connection closes.
  const std::uint64_t before = charged();
  a.close();
  EXPECT_LT(charged(), before - (8u << 20));
  // ...and room is there again for c's threads.
  ASSERT_FALSE(c.events({start(5000, kForward, 1)}));
  EXPECT_EQ(Seen(*collector_, 3).step(3, "Forward").open, 1u);
}

TEST_F(CollectorTest, ThreadLimitIsCounted) {
  limits_.max_threads_per_process = 2;
  make();
  DirectClient c(*collector_, world_.spawn(100, 5, "a"));
  ASSERT_FALSE(c.events({start(1, kForward, 0), start(2, kForward, 0), start(3, kForward, 0)}));
  EXPECT_EQ(collector_->counters().limits_hit.at("max_threads_per_process"), 1u);
  EXPECT_EQ(Seen(*collector_).step(100, "Forward").open, 2u);
  // Threads with nothing open make room.
  ASSERT_FALSE(c.events({end(1, kForward, 5), start(4, kForward, 6), end(4, kForward, 9)}));
  EXPECT_EQ(Seen(*collector_).step(100, "Forward").count, 2u);
}

TEST_F(CollectorTest, DroppedKeepsTheMaximumAndCountersSumProcesses) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  a.dropped(10);
  a.dropped(5);  // a late, smaller cumulative report
  a.dropped(12);
  b.dropped(3);
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(1).dropped, 12u);
  EXPECT_EQ(seen.process(2).dropped, 3u);
  EXPECT_EQ(collector_->counters().events_dropped_by_clients, 15u);
  EXPECT_EQ(seen.view().counters().events_dropped_by_clients, 15u);
}

TEST_F(CollectorTest, HugeClientNumbersSaturateAndNeverWrapACounterOrTotal) {
  constexpr std::uint64_t kMax = std::numeric_limits<std::uint64_t>::max();
  limits_.max_span_ns = kMax;  // no bound on spans: their sums alone must hold
  make();
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  a.dropped(kMax - 1);
  const std::uint64_t before = collector_->counters().events_dropped_by_clients;
  b.dropped(5);  // would wrap the daemon's total
  EXPECT_EQ(collector_->counters().events_dropped_by_clients, kMax);
  EXPECT_GE(collector_->counters().events_dropped_by_clients, before);
  // Three spans of 2^64-1 ns: the step's total stays at its ceiling, not below its max.
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, kMax), start(1, kForward, 0),
                         end(1, kForward, kMax), start(1, kForward, 0), end(1, kForward, kMax)}));
  const StepRow step = Seen(*collector_).step(1, "Forward");
  EXPECT_EQ(step.count, 3u);
  EXPECT_EQ(step.total_ns, kMax);
  EXPECT_GE(step.total_ns, step.max_ns);
}

TEST_F(CollectorTest, DroppedByCauseKeepsTheMaximumPerCauseAndTheirSumIsTheTotal) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  a.dropped_by_cause({{5, 0, 1, 0}});
  a.dropped_by_cause({{3, 7, 1, 2}});  // buffer_full went "back": kept at 5
  b.dropped_by_cause({{0, 4, 0, 0}});
  const Seen seen(*collector_);
  // buffer_full, not_connected, in_flight, invalid, daemon_crash, refused
  EXPECT_EQ(seen.process(1).dropped_by_cause, (std::array<std::uint64_t, 6>{5, 7, 1, 2, 0, 0}));
  EXPECT_EQ(seen.process(1).dropped, 15u);
  EXPECT_EQ(seen.process(2).dropped, 4u);
  EXPECT_EQ(seen.view().counters().events_dropped_by_clients, 19u);
  EXPECT_EQ(seen.view().counters().events_dropped_by_cause[cause(proto::DropCause::kNotConnected)],
            11u);
  EXPECT_EQ(collector_->freeze()
                ->counters()
                .events_dropped_by_cause[cause(proto::DropCause::kBufferFull)],
            5u);
  // How text and Prometheus say it: tests/daemon/report/collector_report_test.cpp.
  // Counts near 2^64 saturate instead of wrapping the total.
  a.dropped_by_cause({{~0ull, ~0ull, 1, 2}});
  EXPECT_EQ(Seen(*collector_, 1).process(1).dropped, ~0ull);
}

// A Ledger record the shared view does not apply is not answered (the frame has no
// reply), so the process's own figures say it.
TEST_F(CollectorTest, LedgerRecordsTheViewRefusesAreCountedForTheirProcess) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "t", 1, 150));
  EXPECT_EQ(Seen(*collector_).process(1).ledger_refused, 0u);
  a.ledger(test::reserve_record("GPU-x", 2, 0, "zero", 1, 160));    // 0 bytes: refused
  a.ledger(test::reserve_record("GPU-x", 1, 1024, "dup", 1, 170));  // duplicate id
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(1).ledger_refused, 2u);
  EXPECT_EQ(seen.view().ledger().gpus.at("GPU-x").reserved_bytes, 4096u);
  // How the reports say it: tests/daemon/report/collector_report_test.cpp.
}

TEST_F(CollectorTest, AViewStaysAsFrozenWhileIngestGoesOn) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.events({start(1, kMatmul, 0), end(1, kMatmul, 100), start(1, kForward, 100)}));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "t", 1, 150));
  const auto view = collector_->freeze();
  const std::string before = read_model_of(*view);
  EXPECT_EQ(Seen(view).step(1, "Matmul").count, 1u);

  // Everything a record or the ledger can go through after the view was taken.
  ASSERT_FALSE(a.events({end(1, kForward, 300), start(2, kMatmul, 0), end(2, kMatmul, 50)}));
  ASSERT_FALSE(a.register_step(300, "Tokenize"));
  a.dropped_by_cause({{1, 2, 3, 4}});
  a.ledger(test::reserve_record("GPU-x", 2, 1024, "t", 1, 400));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(b.events({start(1, kBackward, 0), end(1, kBackward, 10)}));
  collector_->reset(1);
  world_.kill(2);
  b.close();
  world_.now_ns += 5'000'000'000;

  EXPECT_EQ(read_model_of(*view), before);
  // The live state has all of it.
  const Seen now(*collector_);
  EXPECT_FALSE(now.has_step(1, "Matmul"));  // reset
  EXPECT_EQ(now.process(1).dropped, 10u);
  EXPECT_EQ(now.process(2).alive, false);
  EXPECT_EQ(now.step(2, "Backward").count, 1u);
  EXPECT_EQ(now.view().ledger().gpus.at("GPU-x").reserved_bytes, 4096u + 1024u);
  EXPECT_EQ(view->ledger().gpus.at("GPU-x").reserved_bytes, 4096u);
}

TEST_F(CollectorTest, ViewsRenderOnAnotherThreadWhileIngestMutates) {
  // What the daemon does: the ingest thread freezes and releases views, a render thread
  // reads them. Run under the sanitizers, a record shared without a clone shows here.
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
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
      EXPECT_FALSE(read_model_of(*v).empty());
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
  const Seen seen(*collector_, 1);
  EXPECT_EQ(seen.step(1, "Matmul").count, static_cast<std::uint64_t>(kBatches));
  EXPECT_EQ(seen.step(1, "custom300").count, static_cast<std::uint64_t>(kBatches / 100));
}

TEST_F(CollectorTest, ExitedProcessesAreKeptUpToTheLimitOldestFirstOut) {
  limits_.max_exited_processes = 2;
  make();
  for (std::int32_t pid = 1; pid <= 3; ++pid) {
    DirectClient c(*collector_, world_.spawn(pid, 7, "p" + std::to_string(pid)));
    ASSERT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 10)}));
    world_.kill(pid);
    world_.now_ns += 1000;
    c.close();
  }
  const Seen seen(*collector_);
  ASSERT_EQ(seen.processes().size(), 2u);
  EXPECT_FALSE(seen.has_process(1));  // exited first, evicted first
  EXPECT_EQ(seen.process(2).alive, false);
  EXPECT_EQ(seen.process(3).alive, false);
  EXPECT_EQ(collector_->counters().limits_hit.at("max_exited_processes"), 1u);
  EXPECT_EQ(seen.view().counters().limits_hit.at("max_exited_processes"), 1u);
}

TEST_F(CollectorTest, LivenessFollowsProcThroughTheInjectedProbe) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  DirectClient c(*collector_, world_.spawn(3, 1, "c"));
  a.close();
  b.close();
  c.close();
  {
    const Seen seen(*collector_);
    for (int pid = 1; pid <= 3; ++pid) EXPECT_EQ(seen.process(pid).alive, true) << pid;
  }

  world_.now_ns = 5'000'000'000'000;
  world_.zombify(1);                // zombie: dead
  world_.procs[2].start_time = 99;  // pid reused by another process: dead
  collector_->refresh_liveness();
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(1).alive, false);
  EXPECT_EQ(seen.process(1).exited_at_ns, 5'000'000'000'000u);
  EXPECT_EQ(seen.process(2).alive, false);
  EXPECT_EQ(seen.process(3).alive, true);  // still running, just disconnected
  world_.kill(3);
  collector_->refresh_liveness();
  EXPECT_EQ(Seen(*collector_).process(3).alive, false);
}

TEST_F(CollectorTest, ProcessWithAConnectionIsAliveWhateverProcSays) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  world_.kill(1);
  collector_->refresh_liveness();
  EXPECT_EQ(Seen(*collector_).process(1).alive, true);
  a.close();
  EXPECT_EQ(Seen(*collector_).process(1).alive, false);
}

TEST_F(CollectorTest, RecycledPidIsANewProcess) {
  {
    DirectClient a(*collector_, world_.spawn(100, 1, "old"));
    ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10)}));
  }
  DirectClient b(*collector_, world_.spawn(100, 2, "new"));
  ASSERT_FALSE(b.events({start(1, kForward, 0), end(1, kForward, 30)}));
  const Seen seen(*collector_, 100);
  const auto& processes = seen.processes();
  ASSERT_EQ(processes.size(), 2u);
  EXPECT_EQ(processes[0].key.start_time, 1u);
  EXPECT_EQ(processes[0].alive, false);
  EXPECT_EQ(processes[1].key.start_time, 2u);
  EXPECT_EQ(processes[1].alive, true);
  ASSERT_FALSE(processes[1].steps.empty());
  EXPECT_EQ(processes[1].steps[0].hist().sum(), 30u);
}

TEST_F(CollectorTest, ResetClearsAllOrOnePid) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10), start(1, kMatmul, 20)}));
  ASSERT_FALSE(b.events({start(1, kForward, 0), end(1, kForward, 10)}));
  collector_->reset(1);
  {
    const Seen seen(*collector_);
    EXPECT_FALSE(seen.has_step(1, "Forward"));
    EXPECT_EQ(seen.step(1, "Matmul").open, 1u);  // open spans are not aggregates
    EXPECT_EQ(seen.step(2, "Forward").count, 1u);
  }
  EXPECT_EQ(collector_->counters().events_received, 5u);  // counters stay
  ASSERT_FALSE(a.events({end(1, kMatmul, 70)}));
  EXPECT_EQ(Seen(*collector_).step(1, "Matmul").total_ns, 50u);
  collector_->reset(std::nullopt);
  const Seen seen(*collector_);
  EXPECT_TRUE(seen.totals().empty());
  EXPECT_EQ(seen.processes().size(), 2u);
}

TEST_F(CollectorTest, LedgerStepSpansAndAnnotationsReachTheLedgerView) {
  DirectClient c(*collector_, world_.spawn(100, 5, "trainer"));
  ASSERT_FALSE(c.events({start(1, 7 /*LedgerReserve*/, 100)}));
  c.ledger(test::reserve_record("GPU-abc", 1, 4096, "qlora", 1, 150));
  ASSERT_FALSE(c.events({end(1, 7, 200)}));
  {
    const auto view = collector_->freeze();
    const auto& gpus = view->ledger().gpus;
    ASSERT_EQ(gpus.size(), 1u);
    EXPECT_EQ(gpus.begin()->first, "GPU-abc");
    const ledger::Gpu& gpu = gpus.begin()->second;
    EXPECT_EQ(gpu.reserved_bytes, 4096u);
    ASSERT_EQ(gpu.reservations.size(), 1u);
    EXPECT_EQ(gpu.reservations.begin()->second.holder.pid, 100);
    EXPECT_EQ(gpu.reservations.begin()->second.holder_alive, true);
  }
  // The holder dies without releasing: flagged by the next liveness tick.
  world_.kill(100);
  c.close();
  collector_->refresh_liveness();
  const auto view = collector_->freeze();
  EXPECT_EQ(view->ledger().gpus.at("GPU-abc").reservations.at(1).holder_alive, false);
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
    DirectClient c(*collector_, world_.spawn(h, 1, "holder"));
    for (int g = 0; g < kGpus; ++g) {
      for (int r = 0; r < kPerGpu / kHolders; ++r) {
        c.ledger(test::reserve_record("GPU-" + std::to_string(g),
                                      static_cast<std::uint64_t>(h * 1000 + r), 4096, "t", 1, 1));
      }
    }
    world_.kill(h);
  }  // each client closed: one probe per detach, none per reservation
  EXPECT_EQ(world_.probes, static_cast<std::uint64_t>(kHolders));
  collector_->refresh_liveness();  // the tick that flags them all
  {
    const auto view = collector_->freeze();
    ASSERT_EQ(view->ledger().gpus.size(), static_cast<std::size_t>(kGpus));
    for (const auto& [uuid, gpu] : view->ledger().gpus) {
      EXPECT_EQ(gpu.leaked(), static_cast<std::size_t>(kPerGpu)) << uuid;
    }
  }

  // Steady state: every holder known dead, nothing to probe, whatever the ledger holds.
  world_.probes = 0;
  for (int tick = 0; tick < 10; ++tick) collector_->refresh_liveness();
  EXPECT_EQ(world_.probes, 0u);
  // Churn: each short-lived client costs one probe (its own), not one per reservation.
  for (int i = 0; i < 20; ++i) {
    DirectClient c(*collector_, world_.spawn(100 + i, 1, "churn"));
    world_.kill(100 + i);
  }
  EXPECT_EQ(world_.probes, 20u);
  // Reading a view (all a report reads: processes, totals, jobs, table, ledger) never
  // probes.
  world_.probes = 0;
  for (int i = 0; i < 5; ++i) (void)read_model_of(*collector_->freeze());
  EXPECT_EQ(world_.probes, 0u);
  // A disconnected process that still runs is probed once per tick, not per reservation.
  {
    DirectClient c(*collector_, world_.spawn(500, 1, "sleeper"));
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
    DirectClient c(*collector_, world_.spawn(7, 1, "holder"));
    c.ledger(test::reserve_record("GPU-0", 1, 4096, "t", 1, 1));
    world_.probe_error = EMFILE;
  }  // detach while /proc cannot be read
  collector_->refresh_liveness();
  collector_->refresh_liveness();
  EXPECT_EQ(collector_->counters().liveness_probe_errors, 3u);  // the detach and two ticks
  {
    const Seen seen(*collector_);
    EXPECT_EQ(seen.process(7).alive, true);
    const ledger::Gpu& gpu = seen.view().ledger().gpus.at("GPU-0");
    EXPECT_EQ(gpu.reservations.at(1).holder_alive, true);
    EXPECT_EQ(gpu.leaked(), 0u);
  }

  world_.probe_error = 0;
  collector_->refresh_liveness();
  EXPECT_EQ(Seen(*collector_).process(7).alive, true);
  world_.kill(7);
  collector_->refresh_liveness();
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(7).alive, false);
  EXPECT_EQ(seen.view().ledger().gpus.at("GPU-0").leaked(), 1u);
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

constexpr std::uint32_t kAttention = 3;
constexpr std::uint32_t kTranspose = 4;
constexpr std::uint32_t kAlloc = 5;

// Self time: a span's duration less the spans that ended one level inside it on the same
// thread, so nested work is not counted twice.
TEST_F(CollectorTest, SelfTimeLeavesOutNestedSpans) {
  make();
  DirectClient a(*collector_, world_.spawn(1, 1, "a", 7));
  // Forward 0..100 holds Matmul 10..40 (which holds Transpose 20..30) and Matmul 50..60.
  ASSERT_FALSE(a.events({start(1, kForward, 0), start(1, kMatmul, 10), start(1, kTranspose, 20),
                         end(1, kTranspose, 30), end(1, kMatmul, 40), start(1, kMatmul, 50),
                         end(1, kMatmul, 60), end(1, kForward, 100)}));
  // Another thread's spans are not nested in thread 1's.
  ASSERT_FALSE(a.events({start(2, kBackward, 5), end(2, kBackward, 95)}));
  const Seen r(*collector_);
  EXPECT_EQ(r.step(1, "Forward").total_ns, 100u);
  EXPECT_EQ(r.step(1, "Forward").self_ns, 60u);  // 100 - 30 - 10
  EXPECT_EQ(r.step(1, "Matmul").total_ns, 40u);
  EXPECT_EQ(r.step(1, "Matmul").self_ns, 30u);  // 30 - 10, then 10
  EXPECT_EQ(r.step(1, "Transpose").self_ns, 10u);
  EXPECT_EQ(r.step(1, "Backward").self_ns, 90u);
  // Spans that overlap without nesting still count within [0, duration].
  ASSERT_FALSE(a.events(
      {start(3, kAlloc, 0), start(3, kAttention, 10), end(3, kAlloc, 20), end(3, kAttention, 50)}));
  const Seen r2(*collector_);
  EXPECT_LE(r2.step(1, "Alloc").self_ns, r2.step(1, "Alloc").total_ns);
  EXPECT_LE(r2.step(1, "Attention").self_ns, r2.step(1, "Attention").total_ns);
  // How the text report shows both: tests/daemon/report/collector_report_test.cpp.
}

// PROTOCOL.md 4.7b: the Identity's job and ranks reach the read model, grouped by job.
TEST_F(CollectorTest, IdentityGroupsProcessesByJob) {
  make();
  DirectClient r0(*collector_, world_.spawn(10, 1, "train", 7));
  DirectClient r1(*collector_, world_.spawn(11, 1, "train", 7));
  DirectClient other(*collector_, world_.spawn(12, 1, "eval", 8));
  DirectClient lone(*collector_, world_.spawn(13, 1, "notebook", 7));
  r0.identity("llama-7", 0, 0, 2);
  r1.identity("llama-7", 1, 1, 2);
  other.identity("llama-7");  // another uid's "llama-7" is its own job
  // A data-loader worker forked by rank 1 sends rank 1 too: the job lists it once.
  DirectClient worker(*collector_, world_.spawn(14, 1, "train", 7));
  worker.identity("llama-7", 1, 1, 2);
  for (DirectClient* c : {&r0, &r1, &other, &lone, &worker}) {
    ASSERT_FALSE(c->events({start(1, kForward, 0), end(1, kForward, 100)}));
  }
  const Seen seen(*collector_);
  EXPECT_EQ(seen.process(11).job, "llama-7");
  EXPECT_EQ(seen.process(11).rank, 1u);
  EXPECT_EQ(seen.process(11).local_rank, 1u);
  EXPECT_EQ(seen.process(11).world_size, 2u);
  EXPECT_EQ(seen.process(13).job, "");  // sent none
  EXPECT_EQ(seen.process(13).rank, proto::kNoRank);
  const std::vector<JobFigures> jobs = seen.jobs();
  ASSERT_EQ(jobs.size(), 3u);  // (7, ""), (7, llama-7), (8, llama-7)
  const JobFigures& llama = jobs[1];
  EXPECT_EQ(llama.job, "llama-7");
  EXPECT_EQ(llama.uid, 7u);
  EXPECT_EQ(llama.processes.size(), 3u);
  EXPECT_EQ(llama.live, 3u);
  EXPECT_EQ(llama.ranks, (std::vector<std::uint32_t>{0, 1}));
  EXPECT_EQ(llama.world_size, 2u);
  const std::vector<StepFigures> llama_totals = seen.view().totals(llama.processes);
  ASSERT_FALSE(llama_totals.empty());
  EXPECT_EQ(llama_totals[0].hist().count(), 3u);
  EXPECT_EQ(jobs[2].uid, 8u);

  // By job, (uid, job id): uid 7's three, never uid 8's process that claims the same id.
  const auto uid7 = seen.view().processes(std::nullopt, JobRef{7, "llama-7"});
  ASSERT_EQ(uid7.size(), 3u);
  for (const ProcessFigures& p : uid7) EXPECT_EQ(p.uid, 7u);
  ASSERT_EQ(seen.view().processes(std::nullopt, JobRef{8, "llama-7"}).size(), 1u);
  EXPECT_EQ(seen.view().processes(std::nullopt, JobRef{8, "llama-7"})[0].key.pid, 12);
  EXPECT_TRUE(seen.view().processes(std::nullopt, JobRef{9, "llama-7"}).empty());
  EXPECT_EQ(seen.view().processes(12, JobRef{8, "llama-7"}).size(), 1u);
  EXPECT_TRUE(seen.view().processes(12, JobRef{7, "llama-7"}).empty());
  // Whom `--job llama-7` could mean: each uid once.
  EXPECT_EQ(seen.view().uids_with_job("llama-7"), (std::vector<std::uint32_t>{7, 8}));
  EXPECT_EQ(seen.view().uids_with_job(""), (std::vector<std::uint32_t>{7}));
  EXPECT_TRUE(seen.view().uids_with_job("llama-8").empty());
  // How the text report groups them: tests/daemon/report/collector_report_test.cpp.
}

}  // namespace
}  // namespace steptrace::daemon
