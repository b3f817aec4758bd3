// The ledger's report forms (daemon/report/ledger_report.h): the text, the anomaly counts
// of stats and the Prometheus families, of a ledger view (daemon/state/ledger_view.h)
// driven into each situation. The situations themselves (leaks, over-commitment,
// refusals, expiry, device findings) are asserted on the view's state in
// tests/daemon/state/ledger_view_test.cpp.
#include "daemon/report/ledger_report.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <string>

#include <nlohmann/json.hpp>

#include "daemon/state/ledger_state.h"
#include "daemon/state/ledger_view.h"
#include "tests/daemon/state/ledger_test_util.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;
using namespace ledger_test;

class LedgerReportTest : public ::testing::Test {
 protected:
  Limits limits_;
  DaemonCounters counters_;
  LedgerView view_{limits_, counters_};
  const LedgerActor a_{{1001, 5001}, "trainer-a"};
  const LedgerActor b_{{1002, 5002}, "trainer-b"};
  const LedgerActor c_{{1003, 5003}, "janitor"};
  // Of uids 1000 and 1001, for the refusals and leases.
  const LedgerActor alice_{{2001, 7001}, "alice-train", 1000};
  const LedgerActor bob_{{3001, 8001}, "bob", 1001};
};

TEST_F(LedgerReportTest, AnomaliesJsonListsEveryKindStartingAtZero) {
  const json a = report::ledger_anomalies_json(view_.state());
  for (const char* kind :
       {"unknown_release", "unknown_cleanup", "duplicate_reservation", "zero_byte_reserve",
        "gpu_uuid_truncated", "task_truncated", "cleanup_holder_mismatch", "max_gpus",
        "max_reservations_per_gpu", "overcommitted", "release_refused", "cleanup_refused",
        "max_gpus_per_uid", "max_reservations_per_uid", "unknown_renew", "renew_refused",
        "bad_lease", "lease_expired"}) {
    ASSERT_TRUE(a.contains(kind)) << kind;
    EXPECT_EQ(a[kind], 0) << kind;
  }
  for (const auto& [kind, value] : a.items()) EXPECT_EQ(value, 0) << kind;
}

TEST_F(LedgerReportTest, TextReportShowsTotalsReservationsAndStepTime) {
  EXPECT_THAT(report::ledger_text(view_.state(), kNow), HasSubstr("empty"));

  view_.apply(a_, sample("GPU-A", 10 * kGiB, 24 * kGiB, 95 * kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 42, 8 * kGiB, "qlora-7b", 40 * kSecond, 3), kNow);
  view_.attribute_span(a_.key, 3, kLedgerReserve, 40 * kSecond - 1'500'000, 40 * kSecond);
  view_.apply(b_, reserve("GPU-B", 7, 512 * kMiB, "", 90 * kSecond), kNow);
  const std::string text = report::ledger_text(view_.state(), kNow);

  EXPECT_THAT(text, HasSubstr("GPU GPU-A\n"));
  EXPECT_THAT(text, HasSubstr("total 24.00 GiB"));
  EXPECT_THAT(text, HasSubstr("free 10.00 GiB (sampled 5.00s ago)"));
  EXPECT_THAT(text, HasSubstr("reserved 8.00 GiB (high-water 8.00 GiB)"));
  EXPECT_THAT(text, HasSubstr("available 16.00 GiB"));
  // The reservation line: id, pid, process, task, size, age, state.
  std::istringstream lines(text);
  std::string line;
  bool found = false;
  while (std::getline(lines, line)) {
    if (line.find("qlora-7b") == std::string::npos) continue;
    found = true;
    EXPECT_THAT(line, HasSubstr("42"));
    EXPECT_THAT(line, HasSubstr("1001"));
    EXPECT_THAT(line, HasSubstr("trainer-a"));
    EXPECT_THAT(line, HasSubstr("8.00 GiB"));
    EXPECT_THAT(line, HasSubstr("1m 00s"));
    EXPECT_THAT(line, HasSubstr("alive"));
  }
  EXPECT_TRUE(found) << text;
  EXPECT_THAT(text, HasSubstr("LedgerReserve"));
  EXPECT_THAT(text, HasSubstr("1.50ms"));

  // GPU-B has no sample: sizes it cannot know say so.
  const std::string gpu_b = text.substr(text.find("GPU GPU-B"));
  EXPECT_THAT(gpu_b, HasSubstr("total unknown"));
  EXPECT_THAT(gpu_b, HasSubstr("available unknown"));
  EXPECT_THAT(gpu_b, HasSubstr("512.00 MiB"));
}

TEST_F(LedgerReportTest, MetricsHaveHelpAndTypeForEveryFamilyAndEscapeLabels) {
  populate(view_, a_, b_);
  view_.apply(a_, reserve("GPU-\"q\\", 1, 5, "t", kSecond), kNow);
  std::string metrics;
  report::append_ledger_metrics(view_.state(), metrics);

  std::set<std::string> helped, typed;
  std::istringstream lines(metrics);
  std::string line;
  std::size_t samples = 0;
  while (std::getline(lines, line)) {
    ASSERT_FALSE(line.empty());
    if (line.rfind("# HELP ", 0) == 0) {
      helped.insert(line.substr(7, line.find(' ', 7) - 7));
    } else if (line.rfind("# TYPE ", 0) == 0) {
      const std::string family = line.substr(7, line.find(' ', 7) - 7);
      const std::string type = line.substr(line.rfind(' ') + 1);
      EXPECT_TRUE(type == "gauge" || type == "counter") << line;
      EXPECT_TRUE(helped.contains(family)) << "TYPE before HELP: " << line;
      typed.insert(family);
    } else {
      const std::string family = line.substr(0, line.find('{'));
      EXPECT_TRUE(helped.contains(family)) << line;
      EXPECT_TRUE(typed.contains(family)) << line;
      ++samples;
    }
  }
  EXPECT_GT(samples, 0u);
  for (const char* family :
       {"steptrace_gpu_reserved_bytes", "steptrace_gpu_free_bytes", "steptrace_gpu_total_bytes",
        "steptrace_gpu_reservations", "steptrace_gpu_leaked_reservations",
        "steptrace_gpu_overcommitted", "steptrace_ledger_operations_total",
        "steptrace_ledger_anomalies_total"}) {
    EXPECT_TRUE(typed.contains(family)) << family;
  }
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_reserved_bytes{gpu=\"GPU-A\"} " +
                                 std::to_string(5 * kGiB) + "\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_total_bytes{gpu=\"GPU-A\"} " +
                                 std::to_string(4 * kGiB) + "\n"));
  // GPU-B has no sample: no free/total sample for it.
  EXPECT_THAT(metrics, Not(HasSubstr("steptrace_gpu_free_bytes{gpu=\"GPU-B\"}")));
  EXPECT_THAT(metrics, Not(HasSubstr("steptrace_gpu_total_bytes{gpu=\"GPU-B\"}")));
  EXPECT_THAT(metrics,
              HasSubstr("steptrace_ledger_operations_total{gpu=\"GPU-B\",op=\"release\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_ledger_anomalies_total{kind=\"unknown_release\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_ledger_anomalies_total{kind=\"max_gpus\"} 0\n"));
  for (const char* kind :
       {"release_refused", "cleanup_refused", "max_gpus_per_uid", "max_reservations_per_uid"}) {
    EXPECT_THAT(metrics, HasSubstr(std::string("steptrace_ledger_anomalies_total{kind=\"") + kind +
                                   "\"} 0\n"));
  }
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_reserved_bytes{gpu=\"GPU-\\\"q\\\\\"} 5\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_ledger_step_seconds_total{gpu=\"GPU-A\","
                                 "step=\"LedgerReserve\"} 2\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_ledger_step_spans_total{gpu=\"GPU-A\","
                                 "step=\"WaitPoll\"} 1\n"));
}

TEST_F(LedgerReportTest, ALeakedReservationIsMarkedInTextAndMetricsUntilACleanup) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "dies", kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, kGiB, "lives", kSecond), kNow);
  view_.check_holders([&](const ProcessKey& key) { return key != a_.key; });
  const std::string text = report::ledger_text(view_.state(), kNow);
  EXPECT_THAT(text, HasSubstr("LEAKED"));
  EXPECT_THAT(text, HasSubstr("1 leaked"));
  std::string metrics;
  report::append_ledger_metrics(view_.state(), metrics);
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_leaked_reservations{gpu=\"GPU-A\"} 1\n"));

  view_.apply(c_, cleanup("GPU-A", 1, static_cast<std::uint32_t>(a_.key.pid), 2 * kSecond), kNow);
  EXPECT_THAT(report::ledger_text(view_.state(), kNow), Not(HasSubstr("LEAKED")));
}

TEST_F(LedgerReportTest, AnOvercommittedGpuIsMarkedInTextAndMetricsWhileItLasts) {
  view_.apply(a_, sample("GPU-A", 10 * kGiB, 10 * kGiB, kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 1, 6 * kGiB, "t", kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, 6 * kGiB, "t", kSecond), kNow);
  EXPECT_THAT(report::ledger_text(view_.state(), kNow), HasSubstr("OVERCOMMITTED"));
  std::string metrics;
  report::append_ledger_metrics(view_.state(), metrics);
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_overcommitted{gpu=\"GPU-A\"} 1\n"));

  view_.apply(b_, release("GPU-A", 2, 3 * kSecond), kNow);
  EXPECT_THAT(report::ledger_text(view_.state(), kNow), Not(HasSubstr("OVERCOMMITTED")));
}

TEST_F(LedgerReportTest, TextShowsARefusedRelease) {
  view_.apply(alice_, reserve("GPU-A", 1, 2 * kGiB, "alice-job", kSecond), kNow);
  view_.apply(bob_, release("GPU-A", 1, 2 * kSecond), kNow);
  // The text view shows the refusal with the actor.
  const std::string text = report::ledger_text(view_.state(), kNow);
  EXPECT_THAT(text, HasSubstr("Refused"));
}

TEST_F(LedgerReportTest, TextShowsTheDeviceAndItsFindings) {
  view_.apply(a_, reserve("GPU-A", 1, 4 * kGiB, "a", 1 * kSecond), kNow);
  ledger::Device device;
  device.name = "Fake";
  device.total_bytes = 80 * kGiB;
  device.used_bytes = 10 * kGiB;
  device.free_bytes = 70 * kGiB;
  device.at_ns = kNow;
  device.processes_known = true;
  device.processes = {{4242, 3 * kGiB, true}};  // no reservation
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  view_.apply_devices(devices, "", kNow);
  const std::string text = report::ledger_text(view_.state(), kNow);
  EXPECT_THAT(text, HasSubstr("device Fake: used 10.00 GiB of 80.00 GiB"));
  EXPECT_THAT(text, HasSubstr("UNDECLARED: pid 4242 uses 3.00 GiB with no reservation"));
  EXPECT_THAT(text, HasSubstr("(NVML, sampled"));
}

TEST_F(LedgerReportTest, AnExpiredLeaseIsShownInTextAndMetrics) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "plain", 10 * kSecond), kNow);
  ASSERT_EQ(view_.expire_leases(12 * kSecond), 1u);
  const std::string text = report::ledger_text(view_.state(), kNow);
  EXPECT_THAT(text, HasSubstr("Reservations: 2 (1 expired)"));
  EXPECT_THAT(text, HasSubstr("EXPIRED"));
  EXPECT_THAT(text, HasSubstr("passed (2.00s)"));
  std::string metrics;
  report::append_ledger_metrics(view_.state(), metrics);
  EXPECT_THAT(metrics, HasSubstr("steptrace_gpu_expired_reservations{gpu=\"GPU-A\"} 1\n"));
  EXPECT_THAT(metrics, HasSubstr("steptrace_ledger_anomalies_total{kind=\"lease_expired\"} 1\n"));
}

// The view never stores such strings, but its text renders sanitise what they print
// anyway (a state restored or built otherwise).
TEST_F(LedgerReportTest, TextSanitisesEveryClientString) {
  ledger::State state;
  ledger::Gpu gpu;
  gpu.reservations.emplace(
      1, ledger::Reservation{a_.key, 1000, "\x1b[31mred\n", kGiB, "ta\x1bsk", kSecond, true});
  gpu.reserved_bytes = gpu.high_water_bytes = kGiB;
  gpu.processes.emplace(a_.key, ledger::ProcessRow{"row\r\x1b[2K", 1, 0, 0, 0, 0, {}});
  state.gpus.emplace("GPU-\x1b[2J\n", std::move(gpu));
  view_.adopt(std::move(state), kNow);
  const std::string text = report::ledger_text(view_.state(), kNow);
  EXPECT_EQ(text.find('\x1b'), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << text;
  EXPECT_THAT(text, HasSubstr("GPU GPU-?[2J?\n"));
  EXPECT_THAT(text, HasSubstr("?[31mred?"));
  EXPECT_THAT(text, HasSubstr("ta?sk"));
  EXPECT_THAT(text, HasSubstr("row??[2K"));
}

}  // namespace
}  // namespace steptrace::daemon
