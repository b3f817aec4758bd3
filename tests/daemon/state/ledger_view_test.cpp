// Unit tests of the daemon's VRAM ledger view (daemon/state/ledger_view.h): per-GPU sums and
// holders, leaks, anomalies, over-commitment, limits and ledger-step attribution. Its
// report forms are tested in tests/daemon/report/ledger_report_test.cpp, its snapshot form
// with the codec (tests/daemon/persist/snapshot_codec_test.cpp).
#include "daemon/state/ledger_view.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <iterator>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/state/ledger_state.h"
#include "proto/codec.h"
#include "tests/daemon/state/ledger_test_util.h"

namespace steptrace::daemon {
namespace {

using namespace ledger_test;

// What a test compares before and after a refused record: every GPU with its sums,
// reservations, rows and step time, and the per-uid charges (the anomaly counts apart).
std::string dump(const ledger::State& state) {
  std::ostringstream out;
  for (const auto& [uuid, g] : state.gpus) {
    out << uuid << " reserved " << g.reserved_bytes << " hw " << g.high_water_bytes << " over "
        << g.overcommitted << " events " << g.overcommit_events << " creator " << g.creator_uid;
    if (g.sample) {
      out << " sample " << g.sample->free_bytes << '/' << g.sample->total_bytes << " at "
          << g.sample->at_ns;
    }
    for (std::uint64_t n : g.operations) out << " op " << n;
    for (const auto& [id, r] : g.reservations) {
      out << "\n r " << id << ' ' << r.holder.pid << ' ' << r.holder.start_time << ' ' << r.uid
          << ' ' << r.comm << ' ' << r.bytes << ' ' << r.task << ' ' << r.reserved_ns << ' '
          << r.holder_alive << ' ' << r.lease_ms << ' ' << r.lease_deadline_ns << ' ' << r.expired;
    }
    for (const auto& [key, row] : g.processes) {
      out << "\n p " << key.pid << ' ' << row.comm << ' ' << row.reserves << ' ' << row.releases
          << ' ' << row.cleanups << ' ' << row.renews << ' ' << row.refused;
      for (const auto& [step, t] : row.steps) {
        out << " s" << step << ' ' << t.count << ' ' << t.total_ns;
      }
    }
    for (const auto& [step, t] : g.steps) {
      out << "\n s" << step << ' ' << t.count << ' ' << t.total_ns;
    }
    out << '\n';
  }
  for (const auto& [uid, u] : state.uids) {
    out << "uid " << uid << ' ' << u.gpus << ' ' << u.reservations << '\n';
  }
  return out.str();
}

class LedgerViewTest : public ::testing::Test {
 protected:
  Limits limits_;
  DaemonCounters counters_;
  LedgerView view_{limits_, counters_};
  const LedgerActor a_{{1001, 5001}, "trainer-a"};
  const LedgerActor b_{{1002, 5002}, "trainer-b"};
  const LedgerActor c_{{1003, 5003}, "janitor"};

  const ledger::State& state() const { return view_.state(); }
  std::string ledger() const { return dump(view_.state()); }
  const ledger::Gpu* gpu(std::string_view uuid) const {
    const auto it = state().gpus.find(uuid);
    return it == state().gpus.end() ? nullptr : &it->second;
  }
  const ledger::Reservation* reservation(std::string_view uuid, std::uint64_t id) const {
    const ledger::Gpu* g = gpu(uuid);
    if (g == nullptr) return nullptr;
    const auto it = g->reservations.find(id);
    return it == g->reservations.end() ? nullptr : &it->second;
  }
  const ledger::ProcessRow* row(std::string_view uuid, const LedgerActor& actor) const {
    const ledger::Gpu* g = gpu(uuid);
    if (g == nullptr) return nullptr;
    const auto it = g->processes.find(actor.key);
    return it == g->processes.end() ? nullptr : &it->second;
  }
  std::uint64_t anomaly(std::string_view kind) const {
    const auto it = std::find(ledger::kAnomalyNames.begin(), ledger::kAnomalyNames.end(), kind);
    EXPECT_NE(it, ledger::kAnomalyNames.end()) << kind;
    if (it == ledger::kAnomalyNames.end()) return 0;
    return state().anomalies[static_cast<std::size_t>(it - ledger::kAnomalyNames.begin())];
  }
};

TEST_F(LedgerViewTest, SumsPerGpuAreExactAcrossActorsAndGpus) {
  view_.apply(a_, reserve("GPU-B", 1, 3 * kGiB, "qlora-7b", 1 * kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, 512 * kMiB, "lora-1b", 2 * kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 1, 7, "tiny", 3 * kSecond), kNow);
  // The pid field of a reserve is not the holder: the actor is.
  auto claimed = reserve("GPU-B", 9, kGiB, "other", 4 * kSecond);
  claimed.holder_pid = 4242;
  view_.apply(c_, claimed, kNow);

  ASSERT_EQ(state().gpus.size(), 2u);
  EXPECT_EQ(state().gpus.begin()->first, "GPU-A");  // sorted by UUID
  EXPECT_EQ(std::next(state().gpus.begin())->first, "GPU-B");

  const ledger::Gpu& gpu_a = *gpu("GPU-A");
  EXPECT_EQ(gpu_a.reserved_bytes, 512 * kMiB + 7);
  ASSERT_EQ(gpu_a.reservations.size(), 2u);
  const ledger::Reservation& tiny = gpu_a.reservations.begin()->second;
  EXPECT_EQ(gpu_a.reservations.begin()->first, 1u);  // sorted by id
  EXPECT_EQ(tiny.holder.pid, a_.key.pid);
  EXPECT_EQ(tiny.holder.start_time, a_.key.start_time);
  EXPECT_EQ(tiny.bytes, 7u);
  EXPECT_EQ(tiny.task, "tiny");
  EXPECT_EQ(tiny.comm, "trainer-a");
  EXPECT_EQ(tiny.holder_alive, true);
  EXPECT_EQ(tiny.reserved_ns, 3 * kSecond);  // 97 s old at kNow
  const ledger::Reservation& lora = std::next(gpu_a.reservations.begin())->second;
  EXPECT_EQ(std::next(gpu_a.reservations.begin())->first, 2u);
  EXPECT_EQ(lora.holder.pid, b_.key.pid);
  EXPECT_EQ(lora.bytes, 512 * kMiB);

  const ledger::Gpu& gpu_b = *gpu("GPU-B");
  EXPECT_EQ(gpu_b.reserved_bytes, 4 * kGiB);
  EXPECT_EQ(gpu_b.high_water_bytes, 4 * kGiB);
  const ledger::Reservation* held = reservation("GPU-B", 9);
  ASSERT_NE(held, nullptr);
  EXPECT_EQ(held->holder.pid, c_.key.pid);
  EXPECT_EQ(held->comm, "janitor");

  // Operations are per actor per GPU.
  const ledger::ProcessRow* a_on_b = row("GPU-B", a_);
  ASSERT_NE(a_on_b, nullptr);
  EXPECT_EQ(a_on_b->reserves, 1u);
  const ledger::ProcessRow* a_on_a = row("GPU-A", a_);
  ASSERT_NE(a_on_a, nullptr);
  EXPECT_EQ(a_on_a->reserves, 1u);
  EXPECT_EQ(gpu_a.operations[ledger::kOpReserve], 2u);
  // No sample yet: the sizes are not known.
  EXPECT_FALSE(gpu_a.sample.has_value());
  EXPECT_FALSE(gpu_a.device_total.has_value());
  EXPECT_FALSE(state().devices.contains("GPU-A"));
  EXPECT_EQ(gpu_a.overcommitted, false);
}

TEST_F(LedgerViewTest, ReleaseClearsTheReservationAndKeepsHighWater) {
  view_.apply(a_, reserve("GPU-A", 1, 2 * kGiB, "t", kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 2, 1 * kGiB, "t", kSecond), kNow);
  view_.apply(a_, release("GPU-A", 1, 2 * kSecond), kNow);
  const ledger::Gpu* g = gpu("GPU-A");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->reserved_bytes, kGiB);
  EXPECT_EQ(g->high_water_bytes, 3 * kGiB);
  EXPECT_EQ(reservation("GPU-A", 1), nullptr);
  EXPECT_NE(reservation("GPU-A", 2), nullptr);
  EXPECT_EQ(row("GPU-A", a_)->releases, 1u);
  EXPECT_EQ(g->operations[ledger::kOpRelease], 1u);
}

TEST_F(LedgerViewTest, CleanupByAnotherProcessRemovesEntryAndCreditsTheCleaner) {
  view_.apply(a_, reserve("GPU-A", 5, kGiB, "t", kSecond), kNow);
  view_.apply(c_, cleanup("GPU-A", 5, static_cast<std::uint32_t>(a_.key.pid), 2 * kSecond), kNow);
  const ledger::Gpu* g = gpu("GPU-A");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(g->reservations.size(), 0u);
  EXPECT_EQ(g->reserved_bytes, 0u);
  const ledger::ProcessRow* cleaner = row("GPU-A", c_);
  ASSERT_NE(cleaner, nullptr);
  EXPECT_EQ(cleaner->cleanups, 1u);
  EXPECT_EQ(cleaner->comm, "janitor");
  EXPECT_EQ(row("GPU-A", a_)->cleanups, 0u);
  EXPECT_EQ(anomaly("cleanup_holder_mismatch"), 0u);
}

TEST_F(LedgerViewTest, DeadHolderIsFlaggedLeakedUntilACleanup) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "dies", kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, kGiB, "lives", kSecond), kNow);
  view_.check_holders([&](const ProcessKey& key) { return key != a_.key; });

  EXPECT_EQ(reservation("GPU-A", 1)->holder_alive, false);
  EXPECT_EQ(reservation("GPU-A", 2)->holder_alive, true);
  EXPECT_EQ(gpu("GPU-A")->leaked(), 1u);

  // A later check does not resurrect it on its own, and the entry stays until cleaned.
  view_.check_holders([&](const ProcessKey& key) { return key != a_.key; });
  EXPECT_EQ(reservation("GPU-A", 1)->holder_alive, false);

  view_.apply(c_, cleanup("GPU-A", 1, static_cast<std::uint32_t>(a_.key.pid), 2 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(gpu("GPU-A")->leaked(), 0u);
  EXPECT_EQ(gpu("GPU-A")->reserved_bytes, kGiB);
}

// A record that breaks a rule is counted under its kind and changes nothing else.
struct RejectedCase {
  const char* kind;
  std::function<proto::LedgerRecord()> record;
};

TEST_F(LedgerViewTest, EveryRejectedAnomalyIsCountedAndChangesNothingElse) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(a_, sample("GPU-A", 20 * kGiB, 24 * kGiB, kSecond), kNow);
  view_.apply(a_, reserve("GPU-B", 1, kGiB, "t", kSecond), kNow);  // no total known
  const std::vector<RejectedCase> cases = {
      {"unknown_release", [] { return release("GPU-A", 99, 2 * kSecond); }},
      {"unknown_release", [] { return release("GPU-NEW", 1, 2 * kSecond); }},
      {"unknown_cleanup", [] { return cleanup("GPU-A", 99, 1001, 2 * kSecond); }},
      {"duplicate_reservation", [] { return reserve("GPU-A", 1, 5 * kGiB, "dup", 2 * kSecond); }},
      {"zero_byte_reserve", [] { return reserve("GPU-A", 2, 0, "zero", 2 * kSecond); }},
      {"zero_byte_reserve", [] { return reserve("GPU-NEW", 2, 0, "zero", 2 * kSecond); }},
      {"reservation_over_total",
       [] { return reserve("GPU-A", 3, ~std::uint64_t{0}, "huge", 2 * kSecond); }},
      {"reservation_over_total", [] { return reserve("GPU-A", 3, 27 * kGiB, "big", 2 * kSecond); }},
      {"reserved_bytes_overflow",
       [] { return reserve("GPU-B", 3, ~std::uint64_t{0}, "huge", 2 * kSecond); }},
      {"bad_vram_sample", [] { return sample("GPU-A", 30 * kGiB, 24 * kGiB, 2 * kSecond); }},
      {"bad_vram_sample", [] { return sample("GPU-A", 0, 0, 2 * kSecond); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.kind);
    const std::string before = ledger();
    auto expected = state().anomalies;
    const auto kind = std::find(ledger::kAnomalyNames.begin(), ledger::kAnomalyNames.end(),
                                std::string_view(c.kind));
    ASSERT_NE(kind, ledger::kAnomalyNames.end());
    ++expected[static_cast<std::size_t>(kind - ledger::kAnomalyNames.begin())];
    view_.apply(b_, c.record(), kNow);
    EXPECT_EQ(ledger(), before);
    EXPECT_EQ(state().anomalies, expected);
  }
  // The existing entry of a duplicate id stays as it was.
  const ledger::Reservation* kept = reservation("GPU-A", 1);
  ASSERT_NE(kept, nullptr);
  EXPECT_EQ(kept->holder.pid, a_.key.pid);
  EXPECT_EQ(kept->bytes, kGiB);
  EXPECT_TRUE(counters_.limits_hit.empty());
}

TEST_F(LedgerViewTest, TruncatedStringsAreCountedAndRefused) {
  view_.apply(a_, reserve("GPU-cut", 1, kGiB, "whole", kSecond), kNow);
  const std::string before = ledger();

  auto r = reserve("GPU-cut", 2, kGiB, "task-cut", kSecond);
  r.flags = proto::kLedgerTaskTruncated;
  view_.apply(a_, r, kNow);
  auto u = reserve("GPU-other-cut", 3, kGiB, "t", kSecond);
  u.flags = proto::kLedgerGpuUuidTruncated;
  view_.apply(a_, u, kNow);
  auto s = sample("GPU-cut", kGiB, 2 * kGiB, kSecond);
  s.flags = proto::kLedgerGpuUuidTruncated | proto::kLedgerTaskTruncated;
  view_.apply(a_, s, kNow);
  auto rel = release("GPU-cut", 1, kSecond);
  rel.flags = proto::kLedgerGpuUuidTruncated;
  view_.apply(a_, rel, kNow);

  EXPECT_EQ(anomaly("gpu_uuid_truncated"), 3u);
  EXPECT_EQ(anomaly("task_truncated"), 2u);
  EXPECT_EQ(ledger(), before);  // no reservation, GPU, sample or release applied
}

TEST_F(LedgerViewTest, CleanupNamingAnotherHolderIsCountedAndStillRemoves) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(c_, cleanup("GPU-A", 1, 7777, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("cleanup_holder_mismatch"), 1u);
  EXPECT_EQ(gpu("GPU-A")->reservations.size(), 0u);
  EXPECT_EQ(gpu("GPU-A")->reserved_bytes, 0u);
  EXPECT_EQ(row("GPU-A", c_)->cleanups, 1u);
}

TEST_F(LedgerViewTest, OvercommitmentIsFlaggedAndCountedOncePerTransition) {
  view_.apply(a_, sample("GPU-A", 10 * kGiB, 10 * kGiB, kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 1, 6 * kGiB, "t", kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->overcommitted, false);
  view_.apply(b_, reserve("GPU-A", 2, 6 * kGiB, "t", kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->overcommitted, true);
  // 2 GiB more reserved than the sample's total.
  EXPECT_EQ(gpu("GPU-A")->reserved_bytes, 12 * kGiB);
  EXPECT_EQ(gpu("GPU-A")->sample->total_bytes, 10 * kGiB);
  EXPECT_EQ(anomaly("overcommitted"), 1u);

  // Staying over-committed is not a new transition.
  view_.apply(b_, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  view_.apply(a_, sample("GPU-A", 9 * kGiB, 10 * kGiB, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("overcommitted"), 1u);

  view_.apply(b_, release("GPU-A", 2, 3 * kSecond), kNow);
  view_.apply(b_, release("GPU-A", 3, 3 * kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->overcommitted, false);

  view_.apply(b_, reserve("GPU-A", 4, 5 * kGiB, "t", 4 * kSecond), kNow);
  EXPECT_EQ(anomaly("overcommitted"), 2u);
  EXPECT_EQ(gpu("GPU-A")->overcommit_events, 2u);
  // A sample showing a bigger total ends it.
  view_.apply(a_, sample("GPU-A", 40 * kGiB, 80 * kGiB, 5 * kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->overcommitted, false);
}

TEST_F(LedgerViewTest, LimitsDropTheRecordAndAreCountedTwice) {
  limits_.max_gpus = 1;
  limits_.max_reservations_per_gpu = 2;
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  const std::string before = ledger();

  view_.apply(a_, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  EXPECT_EQ(anomaly("max_reservations_per_gpu"), 1u);
  EXPECT_EQ(counters_.limits_hit["max_reservations_per_gpu"], 1u);
  view_.apply(a_, reserve("GPU-B", 1, kGiB, "t", kSecond), kNow);
  view_.apply(a_, sample("GPU-C", kGiB, kGiB, kSecond), kNow);
  EXPECT_EQ(anomaly("max_gpus"), 2u);
  EXPECT_EQ(counters_.limits_hit["max_gpus"], 2u);
  EXPECT_EQ(ledger(), before);

  // Room again after a release.
  view_.apply(a_, release("GPU-A", 1, 2 * kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 3, kGiB, "t", 2 * kSecond), kNow);
  EXPECT_NE(reservation("GPU-A", 3), nullptr);
}

TEST_F(LedgerViewTest, LedgerStepTimeGoesToTheGpuAnnotatedInsideTheSpan) {
  constexpr std::uint32_t kThread = 77;
  // Reserve on GPU-A inside [100, 300].
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", 150, kThread), kNow);
  view_.attribute_span(a_.key, kThread, kLedgerReserve, 100, 300);
  // Poll on GPU-B inside [550, 700].
  view_.apply(a_, sample("GPU-B", kGiB, 2 * kGiB, 600, kThread), kNow);
  view_.attribute_span(a_.key, kThread, kWaitPoll, 550, 700);
  view_.attribute_span(a_.key, kThread, kWaitPoll, 590, 1000);

  // Not credited: annotation outside the span, another thread, another process, a
  // non-ledger step.
  view_.attribute_span(a_.key, kThread, kLedgerReserve, 601, 900);
  view_.attribute_span(a_.key, kThread, kLedgerReserve, 10, 599);
  view_.attribute_span(a_.key, kThread + 1, kLedgerReserve, 100, 900);
  view_.attribute_span(b_.key, kThread, kLedgerReserve, 100, 900);
  view_.attribute_span(a_.key, kThread, 0 /* Forward */, 100, 900);

  const ledger::ProcessRow* on_a = row("GPU-A", a_);
  ASSERT_NE(on_a, nullptr);
  ASSERT_EQ(on_a->steps.size(), 1u);
  EXPECT_EQ(on_a->steps.begin()->first, kLedgerReserve);
  EXPECT_EQ(on_a->steps.begin()->second.count, 1u);
  EXPECT_EQ(on_a->steps.begin()->second.total_ns, 200u);

  const ledger::ProcessRow* on_b = row("GPU-B", a_);
  ASSERT_NE(on_b, nullptr);
  ASSERT_EQ(on_b->steps.size(), 1u);
  EXPECT_EQ(on_b->steps.begin()->first, kWaitPoll);
  EXPECT_EQ(on_b->steps.begin()->second.count, 2u);
  EXPECT_EQ(on_b->steps.begin()->second.total_ns, 150u + 410);
  EXPECT_EQ(row("GPU-A", b_), nullptr);
  EXPECT_EQ(row("GPU-B", b_), nullptr);

  // Once the process is forgotten nothing more is attributed, and its rows go; the
  // reservation it holds stays.
  view_.forget_process(a_.key);
  view_.attribute_span(a_.key, kThread, kWaitPoll, 550, 700);
  EXPECT_EQ(row("GPU-B", a_), nullptr);
  EXPECT_NE(reservation("GPU-A", 1), nullptr);
  // The GPU's own step totals keep what was attributed (a counter never goes down).
  const auto& gpu_b_steps = gpu("GPU-B")->steps;
  ASSERT_EQ(gpu_b_steps.size(), 1u);
  EXPECT_EQ(gpu_b_steps.begin()->first, kWaitPoll);
  EXPECT_EQ(gpu_b_steps.begin()->second.count, 2u);
  EXPECT_EQ(gpu_b_steps.begin()->second.total_ns, 150u + 410);
}

TEST_F(LedgerViewTest, AnnotationDroppedByALimitIsNotUsedForAttribution) {
  limits_.max_gpus = 1;
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", 100), kNow);
  view_.apply(a_, reserve("GPU-B", 1, kGiB, "t", 200), kNow);  // dropped: max_gpus
  view_.attribute_span(a_.key, 1, kLedgerReserve, 150, 250);
  EXPECT_EQ(state().gpus.size(), 1u);
  EXPECT_EQ(row("GPU-A", a_)->steps.size(), 0u);
}

// ---- permissions and per-uid quotas (issue 15, item 7 and part of 3) -------------------

// Actors of three uids: two processes of uid 1000, one of 1001, one of root.
class LedgerPermissionTest : public LedgerViewTest {
 protected:
  const LedgerActor alice_{{2001, 7001}, "alice-train", 1000};
  const LedgerActor alice2_{{2002, 7002}, "alice-tool", 1000};
  const LedgerActor bob_{{3001, 8001}, "bob", 1001};
  const LedgerActor root_{{1, 1}, "systemd", 0};

  std::uint64_t refused(std::string_view gpu, const LedgerActor& actor) const {
    const ledger::ProcessRow* r = row(gpu, actor);
    return r == nullptr ? 0 : r->refused;
  }
};

TEST_F(LedgerPermissionTest, ReservationsKeepTheHolderUid) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  ASSERT_NE(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(reservation("GPU-A", 1)->uid, 1000u);
  EXPECT_EQ(gpu("GPU-A")->creator_uid, 1000u);
  EXPECT_EQ(view_.state().gpus.at("GPU-A").reservations.at(1).uid, 1000u);
}

TEST_F(LedgerPermissionTest, ReleaseByTheHolderItsUidOrRootIsApplied) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, release("GPU-A", 1, 2 * kSecond), kNow);   // the holder
  view_.apply(alice2_, release("GPU-A", 2, 2 * kSecond), kNow);  // another process, same uid
  view_.apply(root_, release("GPU-A", 3, 2 * kSecond), kNow);    // root
  EXPECT_EQ(gpu("GPU-A")->reservations.size(), 0u);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpRelease], 3u);
  EXPECT_EQ(anomaly("release_refused"), 0u);
  EXPECT_EQ(row("GPU-A", alice2_)->releases, 1u);
  EXPECT_EQ(row("GPU-A", root_)->releases, 1u);
}

TEST_F(LedgerPermissionTest, ReleaseByAnotherUidIsRefusedCountedAndMakesNoRow) {
  view_.apply(alice_, reserve("GPU-A", 1, 2 * kGiB, "alice-job", kSecond), kNow);
  const std::string before = ledger();
  view_.apply(bob_, release("GPU-A", 1, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("release_refused"), 1u);
  // Nothing else changed: the same reservation, sums and operation counts, and no row
  // for bob (issue 26, item 5: refused callers must not fill the GPU's rows).
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  EXPECT_EQ(ledger(), before);
  EXPECT_TRUE(counters_.limits_hit.empty());

  // Not even once the holder is dead: a release is the holder side's; others clean up.
  view_.check_holders([&](const ProcessKey& key) { return key != alice_.key; });
  view_.apply(bob_, release("GPU-A", 1, 3 * kSecond), kNow);
  EXPECT_EQ(anomaly("release_refused"), 2u);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  EXPECT_NE(reservation("GPU-A", 1), nullptr);

  // An actor with a row there already (an applied record) has the refusal on it.
  view_.apply(bob_, reserve("GPU-A", 2, kGiB, "bob-job", 4 * kSecond), kNow);
  view_.apply(bob_, release("GPU-A", 1, 5 * kSecond), kNow);
  EXPECT_EQ(anomaly("release_refused"), 3u);
  ASSERT_NE(row("GPU-A", bob_), nullptr);
  EXPECT_EQ(refused("GPU-A", bob_), 1u);
  EXPECT_EQ(row("GPU-A", bob_)->reserves, 1u);
  EXPECT_EQ(row("GPU-A", bob_)->releases, 0u);
}

TEST_F(LedgerPermissionTest, CleanupOfALiveHolderOnlyByItsUidOrRoot) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  const auto holder = static_cast<std::uint32_t>(alice_.key.pid);

  view_.apply(bob_, cleanup("GPU-A", 1, holder, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);
  EXPECT_EQ(anomaly("cleanup_holder_mismatch"), 0u);  // refused before it is looked at
  EXPECT_EQ(row("GPU-A", bob_), nullptr);             // a refused caller leaves no row
  EXPECT_NE(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpCleanup], 0u);

  view_.apply(alice2_, cleanup("GPU-A", 1, holder, 2 * kSecond), kNow);  // same uid
  view_.apply(root_, cleanup("GPU-A", 2, holder, 2 * kSecond), kNow);    // root
  EXPECT_EQ(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(reservation("GPU-A", 2), nullptr);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);

  // Once the holder is known dead, anyone may clean up.
  view_.check_holders([&](const ProcessKey& key) { return key != alice_.key; });
  view_.apply(bob_, cleanup("GPU-A", 3, holder, 3 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 3), nullptr);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);
  EXPECT_EQ(row("GPU-A", bob_)->cleanups, 1u);
  EXPECT_EQ(row("GPU-A", bob_)->refused, 0u);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpCleanup], 3u);
  EXPECT_EQ(gpu("GPU-A")->reserved_bytes, 0u);
}

TEST_F(LedgerPermissionTest, ARefusedRecordIsNotUsedForAttribution) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", 100), kNow);
  view_.apply(bob_, release("GPU-A", 1, 200), kNow);
  view_.attribute_span(bob_.key, 1, kLedgerReserve, 150, 250);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  EXPECT_TRUE(gpu("GPU-A")->steps.empty());
}

// A reservation restored from a snapshot that did not keep uids: its holder process and
// root may release it, no one else (and anyone may clean it up once the holder is dead).
TEST_F(LedgerPermissionTest, AnUnknownUidIsReleasedOnlyByTheHolderProcessOrRoot) {
  ledger::State restored;
  ledger::Gpu old;
  for (std::uint64_t id : {1, 2, 3}) {
    old.reservations.emplace(
        id, ledger::Reservation{alice_.key, kUnknownUid, "old", kGiB, "t", kSecond, true});
    old.reserved_bytes += kGiB;
  }
  old.high_water_bytes = old.reserved_bytes;
  restored.gpus.emplace("GPU-A", std::move(old));
  view_.adopt(std::move(restored), kNow);
  EXPECT_EQ(reservation("GPU-A", 1)->uid, kUnknownUid);
  EXPECT_EQ(gpu("GPU-A")->creator_uid, kUnknownUid);
  // Charged to no uid: the restored entries do not use up anyone's quota.
  EXPECT_TRUE(view_.state().uids.empty());

  view_.apply(alice2_, release("GPU-A", 1, 2 * kSecond), kNow);
  LedgerActor nobody{{5001, 9001}, "n"};  // the default uid: 65534
  view_.apply(nobody, release("GPU-A", 1, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("release_refused"), 2u);
  view_.apply(alice_, release("GPU-A", 1, 2 * kSecond), kNow);
  view_.apply(root_, release("GPU-A", 2, 2 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(reservation("GPU-A", 2), nullptr);
  view_.check_holders([](const ProcessKey&) { return false; });
  view_.apply(bob_, cleanup("GPU-A", 3, 2001, 3 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 3), nullptr);
  EXPECT_EQ(anomaly("release_refused"), 2u);
  EXPECT_EQ(anomaly("cleanup_refused"), 0u);
}

TEST_F(LedgerPermissionTest, ReservationsPerUidAreCappedAcrossGpus) {
  limits_.max_reservations_per_uid = 2;
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice2_, reserve("GPU-B", 1, kGiB, "t", kSecond), kNow);
  const std::string before = ledger();
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);   // refused
  view_.apply(alice2_, reserve("GPU-B", 2, kGiB, "t", kSecond), kNow);  // same uid: refused
  EXPECT_EQ(ledger(), before);
  EXPECT_EQ(anomaly("max_reservations_per_uid"), 2u);
  EXPECT_EQ(counters_.limits_hit["max_reservations_per_uid"], 2u);
  // Another uid is not affected.
  view_.apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(bob_, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  EXPECT_NE(reservation("GPU-A", 3), nullptr);
  EXPECT_EQ(view_.state().usage(1000).reservations, 2u);
  EXPECT_EQ(view_.state().usage(1001).reservations, 2u);
  // A release (or a cleanup by anyone) makes room again.
  view_.apply(alice_, release("GPU-A", 1, 2 * kSecond), kNow);
  view_.apply(alice2_, reserve("GPU-B", 2, kGiB, "t", 2 * kSecond), kNow);
  EXPECT_NE(reservation("GPU-B", 2), nullptr);
  EXPECT_EQ(anomaly("max_reservations_per_uid"), 2u);
}

TEST_F(LedgerPermissionTest, GpusAUidCreatedAreCappedOthersStillCreate) {
  limits_.max_gpus_per_uid = 2;
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice2_, sample("GPU-B", kGiB, 2 * kGiB, kSecond), kNow);  // a sample creates too
  const std::string before = ledger();
  view_.apply(alice_, reserve("GPU-junk-1", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice2_, sample("GPU-junk-2", kGiB, 2 * kGiB, kSecond), kNow);
  EXPECT_EQ(ledger(), before);
  EXPECT_EQ(anomaly("max_gpus_per_uid"), 2u);
  EXPECT_EQ(counters_.limits_hit["max_gpus_per_uid"], 2u);
  EXPECT_EQ(anomaly("max_gpus"), 0u);

  // Bob creates GPUs of his own, and alice may still use them: the quota is on creating.
  view_.apply(bob_, reserve("GPU-C", 1, kGiB, "t", kSecond), kNow);
  view_.apply(alice_, reserve("GPU-C", 2, kGiB, "t", kSecond), kNow);
  EXPECT_NE(reservation("GPU-C", 2), nullptr);
  EXPECT_EQ(gpu("GPU-C")->creator_uid, 1001u);
  EXPECT_EQ(view_.state().usage(1000).gpus, 2u);
  EXPECT_EQ(view_.state().usage(1001).gpus, 1u);

  // Root's reset of one of alice's GPUs gives her room for another.
  EXPECT_EQ(view_.reset("GPU-B"), 1u);
  view_.apply(alice_, reserve("GPU-D", 1, kGiB, "t", 2 * kSecond), kNow);
  EXPECT_NE(reservation("GPU-D", 1), nullptr);
  EXPECT_EQ(anomaly("max_gpus_per_uid"), 2u);
}

TEST_F(LedgerPermissionTest, ResetDropsGpusTheirChargesAndMarks) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", 100, 9), kNow);
  view_.apply(bob_, reserve("GPU-B", 1, kGiB, "t", 100), kNow);
  view_.apply(bob_, reserve("GPU-C", 1, kGiB, "t", 100), kNow);
  const auto anomalies_before = state().anomalies;

  EXPECT_EQ(view_.reset("GPU-nope"), 0u);
  EXPECT_EQ(state().gpus.size(), 3u);
  EXPECT_EQ(view_.reset("GPU-A"), 1u);
  EXPECT_EQ(gpu("GPU-A"), nullptr);
  EXPECT_EQ(view_.state().usage(1000).gpus, 0u);
  EXPECT_EQ(view_.state().usage(1000).reservations, 0u);
  EXPECT_FALSE(view_.state().marks.contains(alice_.key));
  // A GPU of the same UUID created afresh gets no step time from the old mark.
  view_.apply(bob_, sample("GPU-A", kGiB, 2 * kGiB, 300), kNow);
  view_.attribute_span(alice_.key, 9, kLedgerReserve, 50, 150);
  EXPECT_EQ(gpu("GPU-A")->steps.size(), 0u);

  EXPECT_EQ(view_.reset(std::nullopt), 3u);
  EXPECT_EQ(state().gpus.size(), 0u);
  EXPECT_TRUE(view_.state().uids.empty());
  EXPECT_TRUE(view_.state().marks.empty());
  EXPECT_EQ(state().anomalies, anomalies_before);  // counts stay
  EXPECT_EQ(view_.reset(std::nullopt), 0u);
}

// Item 8: a GPU UUID or task that would need sanitising is refused (bad_record), never
// merged into a sanitised one.
TEST_F(LedgerViewTest, GpuUuidsAndTasksThatNeedSanitisingAreRefused) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  const std::string before = ledger();
  auto raw = [](std::string_view gpu, std::string_view task) {
    auto r = reserve("GPU-placeholder", 9, kGiB, "t", kSecond);
    std::memset(r.gpu_uuid, 0, sizeof r.gpu_uuid);
    std::memcpy(r.gpu_uuid, gpu.data(), gpu.size());
    std::memset(r.task, 0, sizeof r.task);
    std::memcpy(r.task, task.data(), task.size());
    return r;
  };
  view_.apply(a_, raw("GPU-\x1b[2J", "t"), kNow);
  view_.apply(a_, raw("GPU-A\n", "t"), kNow);       // would look like GPU-A
  view_.apply(a_, raw("GPU-\xc3\xa9", "t"), kNow);  // UTF-8 is not printable ASCII either
  view_.apply(a_, raw("GPU-A", "task\x1b]0;x\x07"), kNow);
  auto s = sample("GPU-placeholder", kGiB, 2 * kGiB, kSecond);
  std::memcpy(s.gpu_uuid, "GPU-\x7f", 6);
  view_.apply(a_, s, kNow);
  EXPECT_EQ(anomaly("bad_record"), 5u);
  EXPECT_EQ(ledger(), before);
}

}  // namespace
// NVML's view joined with the declarations (issue 13): each finding kind, the device's
// total/free replacing a client's sample, and a device-only GPU.
TEST_F(LedgerViewTest, DeviceSamplesAreJoinedWithReservationsByUuidAndPid) {
  view_.apply(a_, reserve("GPU-A", 1, 4 * kGiB, "a", 1 * kSecond), kNow);          // OVER
  view_.apply(b_, reserve("GPU-A", 2, 2 * kGiB, "b", kNow - 10 * kSecond), kNow);  // IDLE later
  view_.apply(c_, reserve("GPU-A", 3, 1 * kGiB, "c", 1 * kSecond), kNow);          // fine
  view_.apply(a_, sample("GPU-A", 1 * kGiB, 8 * kGiB, 1 * kSecond), kNow);         // the client's
  ledger::DeviceRules rules;
  rules.over_tolerance_pct = 10;
  rules.idle_ns = 60 * kSecond;
  view_.set_device_rules(rules);

  ledger::Device device;
  device.name = "Fake";
  device.total_bytes = 80 * kGiB;
  device.used_bytes = 10 * kGiB;
  device.free_bytes = 70 * kGiB;
  device.at_ns = kNow;
  device.processes_known = true;
  device.processes = {
      {static_cast<std::uint32_t>(a_.key.pid), 4 * kGiB + 500 * kMiB, true},  // > 4 GiB + 10%
      {static_cast<std::uint32_t>(c_.key.pid), 1 * kGiB + 100 * kMiB, true},  // within 10%
      {4242, 3 * kGiB, true},                                                 // no reservation
      {999999, 1 * kGiB, false},                                              // not in /proc
  };
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  ledger::Device other = device;
  other.processes.clear();
  devices["GPU-Z"] = other;  // a GPU no one annotated
  view_.apply_devices(devices, "", kNow);

  ASSERT_NE(gpu("GPU-A"), nullptr);
  // The device's total is the one over-commitment is judged against.
  EXPECT_EQ(gpu("GPU-A")->device_total, 80 * kGiB);
  const ledger::Device& on_a = state().devices.at("GPU-A");
  EXPECT_EQ(on_a.total_bytes, 80 * kGiB);
  EXPECT_EQ(on_a.free_bytes, 70 * kGiB);
  EXPECT_EQ(on_a.name, "Fake");
  EXPECT_EQ(on_a.processes.size(), 4u);
  std::map<std::string_view, std::vector<std::uint32_t>> kinds;
  for (const ledger::Finding& f : ledger::device_findings(state(), "GPU-A", kNow)) {
    kinds[ledger::kFindingNames[f.kind]].push_back(f.pid);
  }
  EXPECT_EQ(kinds["OVER"], std::vector<std::uint32_t>{static_cast<std::uint32_t>(a_.key.pid)});
  EXPECT_EQ(kinds["UNDECLARED"], std::vector<std::uint32_t>{4242});
  EXPECT_EQ(kinds["GHOST"], std::vector<std::uint32_t>{999999});
  EXPECT_TRUE(kinds["IDLE"].empty());  // b's reservation is younger than 60 s
  EXPECT_EQ(kinds.size(), 4u);
  EXPECT_TRUE(state().devices.contains("GPU-Z"));

  // 60 s later with b still using nothing: IDLE, naming the reservation.
  const auto idle = ledger::device_findings(view_.state(), "GPU-A", kNow + 61 * kSecond);
  const auto it = std::find_if(idle.begin(), idle.end(), [](const ledger::Finding& f) {
    return f.kind == ledger::Finding::kIdle;
  });
  ASSERT_NE(it, idle.end());
  EXPECT_EQ(it->pid, static_cast<std::uint32_t>(b_.key.pid));
  EXPECT_EQ(it->reservation_id, 2u);
  EXPECT_EQ(it->reserved_bytes, 2 * kGiB);

  // Without the device, the client's sample is back.
  view_.apply_devices({}, "nvmlDeviceGetCount_v2 failed: Unknown Error (999)", kNow);
  EXPECT_FALSE(state().devices.contains("GPU-A"));
  EXPECT_EQ(gpu("GPU-A")->sample->total_bytes, 8 * kGiB);
  EXPECT_TRUE(ledger::device_findings(state(), "GPU-A", kNow).empty());
  EXPECT_FALSE(state().devices.contains("GPU-Z"));
  EXPECT_EQ(gpu("GPU-Z"), nullptr);
  EXPECT_EQ(state().device_error, "nvmlDeviceGetCount_v2 failed: Unknown Error (999)");
}

// A holder NVML lists with its memory hidden is on the device (never IDLE); a reservation
// near 2^64 does not wrap the OVER bound to a small number.
TEST_F(LedgerViewTest, HiddenMemoryIsNotIdleAndHugeReservationsDoNotWrapTheOverBound) {
  constexpr std::uint64_t kHuge = 0xF000'0000'0000'0000ULL;
  view_.apply(a_, reserve("GPU-A", 1, 2 * kGiB, "a", kNow - 10 * kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, kHuge, "b", kNow - 10 * kSecond), kNow);
  ledger::DeviceRules rules;
  rules.idle_ns = 1 * kSecond;
  view_.set_device_rules(rules);
  ledger::Device device;
  device.total_bytes = 80 * kGiB;
  device.at_ns = kNow;
  device.processes_known = true;
  device.processes = {{static_cast<std::uint32_t>(a_.key.pid), std::nullopt, true},
                      {static_cast<std::uint32_t>(b_.key.pid), kHuge + 1, true}};
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  view_.apply_devices(devices, "", kNow);
  EXPECT_TRUE(ledger::device_findings(view_.state(), "GPU-A", kNow + 3600 * kSecond).empty());
}

}  // namespace steptrace::daemon

namespace steptrace::daemon {
namespace {

// ---- leases (issue 13): EXPIRED within one tick, renewals, credited cleanups ----------

using LedgerLeaseTest = LedgerPermissionTest;

TEST_F(LedgerLeaseTest, ALeasePassedUnrenewedIsExpiredCountedAndShownEverywhere) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "plain", 10 * kSecond), kNow);
  // Before the deadline (10 s + 2 s): nothing expires.
  EXPECT_EQ(view_.expire_leases(12 * kSecond - 1), 0u);
  EXPECT_FALSE(reservation("GPU-A", 1)->expired);
  EXPECT_TRUE(reservation("GPU-A", 1)->holder_alive);
  EXPECT_EQ(reservation("GPU-A", 1)->lease_ms, 2000u);
  EXPECT_EQ(reservation("GPU-A", 2)->lease_ms, 0u);  // none
  // At it: expired, once, counted once; the reservation without a lease never is.
  EXPECT_EQ(view_.expire_leases(12 * kSecond), 1u);
  EXPECT_EQ(view_.expire_leases(50 * kSecond), 0u);
  EXPECT_EQ(anomaly("lease_expired"), 1u);
  const ledger::Reservation* r = reservation("GPU-A", 1);
  EXPECT_EQ(r->expired, true);
  EXPECT_EQ(r->holder_alive, true);
  EXPECT_EQ(r->lease_deadline_ns, 12 * kSecond);  // passed at kNow
  EXPECT_FALSE(reservation("GPU-A", 2)->expired);
  EXPECT_EQ(gpu("GPU-A")->expired(), 1u);
  EXPECT_EQ(gpu("GPU-A")->leaked(), 0u);
}

TEST_F(LedgerLeaseTest, ARenewalPushesTheDeadlineAndRevivesAnExpiredLease) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, renew("GPU-A", 1, 5000, 11 * kSecond), kNow);  // now until 16 s
  EXPECT_EQ(view_.expire_leases(15 * kSecond), 0u);
  EXPECT_EQ(view_.expire_leases(16 * kSecond), 1u);
  // The holder was only slow: its renewal revives the reservation (the count stays).
  view_.apply(alice_, renew("GPU-A", 1, 5000, 17 * kSecond), kNow);
  EXPECT_FALSE(reservation("GPU-A", 1)->expired);
  EXPECT_EQ(view_.expire_leases(22 * kSecond - 1), 0u);
  EXPECT_EQ(view_.expire_leases(22 * kSecond), 1u);
  EXPECT_EQ(anomaly("lease_expired"), 2u);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpRenew], 2u);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpReserve], 1u);
  EXPECT_EQ(row("GPU-A", alice_)->renews, 2u);
  // A process of the holder's uid and root may renew too; it gives a plain one a lease.
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "plain", 10 * kSecond), kNow);
  view_.apply(alice2_, renew("GPU-A", 2, 1000, 30 * kSecond), kNow);
  view_.apply(root_, renew("GPU-A", 1, 1000, 30 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 2)->lease_ms, 1000u);
  EXPECT_FALSE(reservation("GPU-A", 1)->expired);
}

TEST_F(LedgerLeaseTest, BadRenewalsAreCountedAndChangeNothing) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  const std::uint64_t deadline =
      view_.state().gpus.at("GPU-A").reservations.at(1).lease_deadline_ns;
  view_.apply(bob_, renew("GPU-A", 1, 60000, 11 * kSecond), kNow);  // another uid
  EXPECT_EQ(anomaly("renew_refused"), 1u);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  view_.apply(alice_, renew("GPU-A", 9, 60000, 11 * kSecond), kNow);  // no such reservation
  view_.apply(alice_, renew("GPU-B", 1, 60000, 11 * kSecond), kNow);  // no such GPU
  EXPECT_EQ(anomaly("unknown_renew"), 2u);
  view_.apply(alice_, renew("GPU-A", 1, 0, 11 * kSecond), kNow);
  view_.apply(alice_, renew("GPU-A", 1, proto::kMaxLeaseMs + 1, 11 * kSecond), kNow);
  view_.apply(alice_, reserve_lease("GPU-A", 3, kGiB, 0, 11 * kSecond), kNow);
  EXPECT_EQ(anomaly("bad_lease"), 3u);
  const ledger::Gpu& gpu = view_.state().gpus.at("GPU-A");
  EXPECT_EQ(gpu.reservations.at(1).lease_deadline_ns, deadline);
  EXPECT_FALSE(gpu.reservations.contains(3));  // a reserve with a bad lease is refused whole
  EXPECT_EQ(gpu.operations[ledger::kOpRenew], 0u);
  // The longest lease is accepted.
  view_.apply(alice_, renew("GPU-A", 1, proto::kMaxLeaseMs, 11 * kSecond), kNow);
  EXPECT_EQ(view_.state().gpus.at("GPU-A").reservations.at(1).lease_ms, proto::kMaxLeaseMs);
}

TEST_F(LedgerLeaseTest, AnyoneMayCleanUpAnExpiredLeaseAndIsCreditedForIt) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  const auto holder = static_cast<std::uint32_t>(alice_.key.pid);
  // Live and not expired: another uid's cleanup is refused.
  view_.apply(bob_, cleanup("GPU-A", 1, holder, 11 * kSecond), kNow);
  EXPECT_EQ(anomaly("cleanup_refused"), 1u);
  ASSERT_NE(reservation("GPU-A", 1), nullptr);
  view_.expire_leases(13 * kSecond);
  view_.apply(bob_, cleanup("GPU-A", 1, holder, 14 * kSecond), kNow);
  EXPECT_EQ(reservation("GPU-A", 1), nullptr);
  EXPECT_EQ(row("GPU-A", bob_)->cleanups, 1u);
  EXPECT_EQ(gpu("GPU-A")->reserved_bytes, 0u);
  EXPECT_EQ(view_.state().usage(1000).reservations, 0u);  // alice's quota is freed
}

TEST_F(LedgerLeaseTest, ADeadHoldersLeaseIsALeakNotAnExpiry) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.check_holders([](const ProcessKey&) { return false; });
  EXPECT_EQ(view_.expire_leases(60 * kSecond), 0u);
  EXPECT_FALSE(reservation("GPU-A", 1)->holder_alive);  // LEAKED
  EXPECT_EQ(gpu("GPU-A")->leaked(), 1u);
  EXPECT_EQ(gpu("GPU-A")->expired(), 0u);
  EXPECT_EQ(anomaly("lease_expired"), 0u);
}

TEST_F(LedgerLeaseTest, AFutureTimestampCannotStretchALease) {
  // The deadline runs from the daemon's clock when the record claims a later time.
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 1000 * kSecond), kNow);
  EXPECT_EQ(view_.expire_leases(kNow + 2 * kSecond), 1u);
}

TEST_F(LedgerLeaseTest, ARestoreGivesUnexpiredLeasesOneMoreLeaseAndKeepsExpiredOnes) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, reserve_lease("GPU-A", 2, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, reserve_lease("GPU-A", 3, kGiB, 60000, 10 * kSecond), kNow);
  view_.expire_leases(12 * kSecond);  // 1 and 2 expire; 3 runs until 70 s
  view_.apply(alice_, renew("GPU-A", 2, 2000, 11 * kSecond), kNow);  // 2 renewed until 13 s
  ledger::State saved = view_.state();
  // The daemon comes back at 40 s: lease 2 passed while it was away (its renewals may be
  // queued in the holder's library), so it runs one more lease from now, and so does 3
  // (60 s from now is later than its 70 s); 1 stays expired.
  view_.adopt(std::move(saved), 40 * kSecond);
  const auto& rs = view_.state().gpus.at("GPU-A").reservations;
  EXPECT_TRUE(rs.at(1).expired);
  EXPECT_FALSE(rs.at(2).expired);
  EXPECT_EQ(rs.at(2).lease_deadline_ns, 42 * kSecond);
  EXPECT_EQ(rs.at(3).lease_deadline_ns, 100 * kSecond);
  EXPECT_EQ(view_.expire_leases(41 * kSecond), 0u);
  EXPECT_EQ(view_.expire_leases(42 * kSecond), 1u);
}

}  // namespace
}  // namespace steptrace::daemon

namespace steptrace::daemon {
namespace {

// ---- per-GPU rows and the view's sanity (issue 26, items 5 and 9) ---------------------

class LedgerRowsTest : public LedgerPermissionTest {
 protected:
  // A process of `uid` numbered `n` (pid 10000 + n).
  static LedgerActor actor(std::uint32_t uid, int n) {
    return {{10000 + n, static_cast<std::uint64_t>(90000 + n)}, "proc", uid};
  }
  std::size_t rows(std::string_view uuid) const { return gpu(uuid)->processes.size(); }
  // One liveness tick at `now` with `dead` gone.
  std::size_t tick(const std::vector<ProcessKey>& dead, std::uint64_t now) {
    return view_.age_rows(
        [&](const ProcessKey& key) {
          return std::find(dead.begin(), dead.end(), key) == dead.end();
        },
        now);
  }
};

TEST_F(LedgerRowsTest, ThousandsOfRefusedCallersLeaveNoRowAndAnotherUidGetsItsRow) {
  limits_.max_processes = 16;  // the GPU's rows
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  const auto holder = static_cast<std::uint32_t>(alice_.key.pid);
  for (int i = 0; i < 4096; ++i) {
    const LedgerActor cli = actor(1001, i);
    view_.apply(cli, cleanup("GPU-A", 1, holder, 2 * kSecond), kNow);
    view_.apply(cli, release("GPU-A", 1, 2 * kSecond), kNow);
    view_.apply(cli, renew("GPU-A", 1, 1000, 2 * kSecond), kNow);
  }
  EXPECT_EQ(anomaly("cleanup_refused"), 4096u);
  EXPECT_EQ(anomaly("release_refused"), 4096u);
  EXPECT_EQ(anomaly("renew_refused"), 4096u);
  EXPECT_EQ(rows("GPU-A"), 1u);  // alice's
  EXPECT_EQ(anomaly("process_rows_full"), 0u);

  const LedgerActor carol{{4001, 9001}, "carol", 1002};
  view_.apply(carol, reserve("GPU-A", 2, kGiB, "t", 3 * kSecond), kNow);
  view_.apply(carol, release("GPU-A", 2, 4 * kSecond), kNow);
  ASSERT_NE(row("GPU-A", carol), nullptr);
  EXPECT_EQ(row("GPU-A", carol)->reserves, 1u);
  EXPECT_EQ(row("GPU-A", carol)->releases, 1u);
  EXPECT_EQ(row("GPU-A", carol)->uid, 1002u);
}

TEST_F(LedgerRowsTest, RowsOfExitedProcessesAgeOutRowsOfLiveOnesNever) {
  limits_.max_ledger_row_age_s = 60;
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(bob_, reserve("GPU-B", 3, kGiB, "t", kSecond), kNow);
  // Nothing gone: nothing changes, not even a clone of a shared state.
  const std::uint64_t changes = view_.changes();
  EXPECT_EQ(tick({}, kNow), 0u);
  EXPECT_EQ(view_.changes(), changes);

  // Bob's process exits: its rows stay, marked, for the age; then go, on every GPU.
  EXPECT_EQ(tick({bob_.key}, kNow + kSecond), 0u);
  EXPECT_EQ(row("GPU-A", bob_)->exited_ns, kNow + kSecond);
  EXPECT_EQ(row("GPU-A", alice_)->exited_ns, 0u);
  EXPECT_EQ(tick({bob_.key}, kNow + 60 * kSecond), 0u);
  EXPECT_EQ(tick({bob_.key}, kNow + 61 * kSecond), 2u);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  EXPECT_EQ(row("GPU-B", bob_), nullptr);
  // Its reservations stay (they hold VRAM until a release or cleanup), and so do the
  // GPUs' totals.
  EXPECT_NE(reservation("GPU-A", 2), nullptr);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpReserve], 2u);
  // Alice's, alive, stays whatever the time.
  EXPECT_EQ(tick({bob_.key}, kNow + 100'000 * kSecond), 0u);
  EXPECT_NE(row("GPU-A", alice_), nullptr);
}

TEST_F(LedgerRowsTest, RowsOfExitedProcessesNeverCrowdOutLiveOnes) {
  limits_.max_processes = 3;
  limits_.max_ledger_rows_per_uid = 3;
  const LedgerActor p0 = actor(1000, 0), p1 = actor(1001, 1), p2 = actor(1002, 2);
  view_.apply(p0, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(p1, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(p2, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  tick({p1.key}, kNow + 1);
  tick({p1.key, p0.key}, kNow + 2);  // p1 exited first, then p0

  // A new live process takes the row whose process exited first, then the next.
  const LedgerActor n1 = actor(2000, 3), n2 = actor(2001, 4), n3 = actor(2002, 5);
  view_.apply(n1, reserve("GPU-A", 4, kGiB, "t", kSecond), kNow);
  EXPECT_EQ(row("GPU-A", p1), nullptr);
  EXPECT_NE(row("GPU-A", p0), nullptr);
  view_.apply(n2, reserve("GPU-A", 5, kGiB, "t", kSecond), kNow);
  EXPECT_EQ(row("GPU-A", p0), nullptr);
  EXPECT_NE(row("GPU-A", n1), nullptr);
  EXPECT_NE(row("GPU-A", n2), nullptr);
  EXPECT_EQ(anomaly("process_rows_full"), 0u);

  // Every row live: the record is applied without a row, counted.
  view_.apply(n3, reserve("GPU-A", 6, kGiB, "t", kSecond), kNow);
  EXPECT_EQ(row("GPU-A", n3), nullptr);
  EXPECT_NE(reservation("GPU-A", 6), nullptr);
  EXPECT_EQ(gpu("GPU-A")->operations[ledger::kOpReserve], 6u);
  EXPECT_EQ(anomaly("process_rows_full"), 1u);
  EXPECT_EQ(rows("GPU-A"), 3u);
}

TEST_F(LedgerRowsTest, AUidsRowsPerGpuAreCappedAndCountedOthersStillGetRows) {
  limits_.max_ledger_rows_per_uid = 2;
  const LedgerActor g0 = actor(1001, 0), g1 = actor(1001, 1), g2 = actor(1001, 2);
  view_.apply(g0, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(g1, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_.apply(g2, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);  // applied, no row
  EXPECT_EQ(row("GPU-A", g2), nullptr);
  EXPECT_NE(reservation("GPU-A", 3), nullptr);
  EXPECT_EQ(anomaly("max_ledger_rows_per_uid"), 1u);
  EXPECT_EQ(counters_.limits_hit["max_ledger_rows_per_uid"], 1u);
  // Per GPU: the same uid has room on another; another uid has room on this one.
  view_.apply(g2, reserve("GPU-B", 4, kGiB, "t", kSecond), kNow);
  EXPECT_NE(row("GPU-B", g2), nullptr);
  view_.apply(alice_, reserve("GPU-A", 5, kGiB, "t", kSecond), kNow);
  EXPECT_NE(row("GPU-A", alice_), nullptr);
  EXPECT_EQ(anomaly("max_ledger_rows_per_uid"), 1u);

  // Within the uid, its row whose process exited makes room (FIFO), still counted.
  tick({g0.key}, kNow + 1);
  view_.apply(g2, release("GPU-A", 3, 2 * kSecond), kNow);
  EXPECT_EQ(row("GPU-A", g0), nullptr);
  ASSERT_NE(row("GPU-A", g2), nullptr);
  EXPECT_EQ(row("GPU-A", g2)->releases, 1u);
  EXPECT_NE(row("GPU-A", alice_), nullptr);
  EXPECT_EQ(anomaly("max_ledger_rows_per_uid"), 2u);
  EXPECT_EQ(counters_.limits_hit["max_ledger_rows_per_uid"], 2u);
}

TEST_F(LedgerRowsTest, AReservationLargerThanTheGpusKnownTotalIsRefused) {
  // No total known yet: nothing to judge by.
  view_.apply(alice_, reserve("GPU-A", 1, 100 * kGiB, "t", kSecond), kNow);
  EXPECT_NE(reservation("GPU-A", 1), nullptr);
  view_.apply(alice_, release("GPU-A", 1, kSecond), kNow);
  // The client-established total (80 GiB) and its 10% slack.
  view_.apply(alice_, sample("GPU-A", 70 * kGiB, 80 * kGiB, kSecond), kNow);
  const std::string before = ledger();
  view_.apply(bob_, reserve("GPU-A", 2, ~std::uint64_t{0}, "greedy", 2 * kSecond), kNow);
  view_.apply(bob_, reserve("GPU-A", 3, 89 * kGiB, "greedy", 2 * kSecond), kNow);
  view_.apply(root_, reserve("GPU-A", 4, 89 * kGiB, "root", 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("reservation_over_total"), 3u);
  EXPECT_EQ(ledger(), before);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  view_.apply(bob_, reserve("GPU-A", 5, 80 * kGiB, "whole", 2 * kSecond), kNow);
  EXPECT_NE(reservation("GPU-A", 5), nullptr);

  // NVML's total, when the device reports the GPU, exactly; also for a GPU not yet in
  // the view.
  ledger::Device device;
  device.total_bytes = 40 * kGiB;
  device.at_ns = kNow;
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  devices["GPU-N"] = device;
  view_.apply_devices(devices, "", kNow);
  view_.apply(alice_, reserve("GPU-A", 6, 40 * kGiB + 1, "t", 3 * kSecond), kNow);
  view_.apply(alice_, reserve("GPU-N", 7, 41 * kGiB, "t", 3 * kSecond), kNow);
  EXPECT_EQ(anomaly("reservation_over_total"), 5u);
  EXPECT_EQ(gpu("GPU-N"), nullptr);
  view_.apply(alice_, reserve("GPU-A", 8, 40 * kGiB, "t", 3 * kSecond), kNow);
  EXPECT_NE(reservation("GPU-A", 8), nullptr);
  EXPECT_TRUE(counters_.limits_hit.empty());
}

TEST_F(LedgerRowsTest, ASampleContradictingAnotherUidsTotalOrNvmlIsRefused) {
  view_.apply(alice_, sample("GPU-A", 70 * kGiB, 80 * kGiB, kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->client_total, 80 * kGiB);
  EXPECT_EQ(gpu("GPU-A")->client_total_uid, 1000u);
  const std::string before = ledger();
  view_.apply(bob_, sample("GPU-A", 0, 1, 2 * kSecond), kNow);                  // "total 1"
  view_.apply(bob_, sample("GPU-A", 0, 89 * kGiB, 2 * kSecond), kNow);          // > 10% over
  view_.apply(bob_, sample("GPU-A", 0, 71 * kGiB, 2 * kSecond), kNow);          // > 10% under
  view_.apply(bob_, sample("GPU-A", 0, ~std::uint64_t{0}, 2 * kSecond), kNow);  // no wrap
  EXPECT_EQ(anomaly("vram_total_mismatch"), 4u);
  EXPECT_EQ(ledger(), before);
  EXPECT_EQ(row("GPU-A", bob_), nullptr);
  // Within 10% it is a sample like any other, and does not take the total over.
  view_.apply(bob_, sample("GPU-A", 10 * kGiB, 79 * kGiB, 3 * kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->sample->total_bytes, 79 * kGiB);
  EXPECT_EQ(gpu("GPU-A")->client_total_uid, 1000u);
  // The uid that established it may change it (its own word), and root may.
  view_.apply(alice2_, sample("GPU-A", 10 * kGiB, 40 * kGiB, 4 * kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->client_total, 40 * kGiB);
  view_.apply(root_, sample("GPU-A", 10 * kGiB, 80 * kGiB, 5 * kSecond), kNow);
  EXPECT_EQ(gpu("GPU-A")->client_total, 80 * kGiB);
  EXPECT_EQ(gpu("GPU-A")->client_total_uid, 0u);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 4u);

  // With NVML reporting the GPU, its total judges every sample, root's and the
  // establishing uid's too; one it confirms establishes the total.
  ledger::Device device;
  device.total_bytes = 48 * kGiB;
  device.at_ns = kNow;
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  view_.apply_devices(devices, "", kNow);
  view_.apply(root_, sample("GPU-A", 10 * kGiB, 80 * kGiB, 6 * kSecond), kNow);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 5u);
  view_.apply(bob_, sample("GPU-A", 10 * kGiB, 47 * kGiB, 6 * kSecond), kNow);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 5u);
  EXPECT_EQ(gpu("GPU-A")->client_total, 47 * kGiB);
  EXPECT_EQ(gpu("GPU-A")->client_total_uid, 1001u);
}

TEST_F(LedgerRowsTest, ARestoredGpuKeepsItsTotalAndItsRowsAgeOut) {
  ledger::State saved;
  ledger::Gpu g;
  g.sample = ledger::VramSample{10 * kGiB, 80 * kGiB, kSecond};
  g.processes[actor(1000, 1).key] = ledger::ProcessRow{};  // from a former daemon
  saved.gpus.emplace("GPU-A", g);
  view_.adopt(std::move(saved), kNow);
  EXPECT_EQ(gpu("GPU-A")->client_total, 80 * kGiB);
  view_.apply(alice_, sample("GPU-A", 0, 1, 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 1u);
  view_.apply(alice_, reserve("GPU-A", 1, 100 * kGiB, "t", 2 * kSecond), kNow);
  EXPECT_EQ(anomaly("reservation_over_total"), 1u);

  limits_.max_ledger_row_age_s = 1;
  tick({actor(1000, 1).key}, kNow);
  EXPECT_EQ(tick({actor(1000, 1).key}, kNow + kSecond), 1u);
  EXPECT_TRUE(gpu("GPU-A")->processes.empty());
}

}  // namespace
}  // namespace steptrace::daemon
