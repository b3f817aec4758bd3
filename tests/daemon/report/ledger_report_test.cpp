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
#include <string_view>
#include <vector>

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

const json* find_gpu(const json& ledger, std::string_view uuid) {
  for (const auto& g : ledger.at("gpus")) {
    if (g.at("gpu") == uuid) return &g;
  }
  return nullptr;
}

const json* find_reservation(const json& gpu, std::uint64_t id) {
  for (const auto& r : gpu.at("reservations")) {
    if (r.at("id") == id) return &r;
  }
  return nullptr;
}

const json* find_process(const json& gpu, std::int32_t pid) {
  for (const auto& p : gpu.at("processes")) {
    if (p.at("pid") == pid) return &p;
  }
  return nullptr;
}

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

  json ledger() const { return report::ledger_json(view_.state(), kNow); }
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

// ---- the `ledger --json` document (proto/PROTOCOL.md section 10.4) ---------------------

TEST_F(LedgerReportTest, JsonListsGpusByUuidAndReservationsByIdWithEveryField) {
  view_.apply(a_, reserve("GPU-B", 1, 3 * kGiB, "qlora-7b", 1 * kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, 512 * kMiB, "lora-1b", 2 * kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 1, 7, "tiny", 3 * kSecond), kNow);
  // The pid field of a reserve is not the holder: the actor is.
  auto claimed = reserve("GPU-B", 9, kGiB, "other", 4 * kSecond);
  claimed.holder_pid = 4242;
  view_.apply(c_, claimed, kNow);

  const json j = ledger();
  ASSERT_EQ(j.at("gpus").size(), 2u);
  EXPECT_EQ(j["gpus"][0]["gpu"], "GPU-A");  // sorted by UUID
  EXPECT_EQ(j["gpus"][1]["gpu"], "GPU-B");

  const json& gpu_a = j["gpus"][0];
  EXPECT_EQ(gpu_a["reserved_bytes"], 512 * kMiB + 7);
  ASSERT_EQ(gpu_a["reservations"].size(), 2u);
  EXPECT_EQ(gpu_a["reservations"][0]["id"], 1);  // sorted by id
  EXPECT_EQ(gpu_a["reservations"][0]["pid"], a_.key.pid);
  EXPECT_EQ(gpu_a["reservations"][0]["start_time"], a_.key.start_time);
  EXPECT_EQ(gpu_a["reservations"][0]["bytes"], 7);
  EXPECT_EQ(gpu_a["reservations"][0]["task"], "tiny");
  EXPECT_EQ(gpu_a["reservations"][0]["comm"], "trainer-a");
  EXPECT_EQ(gpu_a["reservations"][0]["holder_alive"], true);
  EXPECT_DOUBLE_EQ(gpu_a["reservations"][0]["age_s"].get<double>(), 97.0);
  EXPECT_EQ(gpu_a["reservations"][1]["id"], 2);
  EXPECT_EQ(gpu_a["reservations"][1]["pid"], b_.key.pid);
  EXPECT_EQ(gpu_a["reservations"][1]["bytes"], 512 * kMiB);

  const json& gpu_b = j["gpus"][1];
  EXPECT_EQ(gpu_b["reserved_bytes"], 4 * kGiB);
  EXPECT_EQ(gpu_b["high_water_bytes"], 4 * kGiB);
  const json* held = find_reservation(gpu_b, 9);
  ASSERT_NE(held, nullptr);
  EXPECT_EQ((*held)["pid"], c_.key.pid);
  EXPECT_EQ((*held)["comm"], "janitor");

  // Operations are per actor per GPU.
  const json* a_on_b = find_process(gpu_b, a_.key.pid);
  ASSERT_NE(a_on_b, nullptr);
  EXPECT_EQ((*a_on_b)["reserves"], 1);
  const json* a_on_a = find_process(gpu_a, a_.key.pid);
  ASSERT_NE(a_on_a, nullptr);
  EXPECT_EQ((*a_on_a)["reserves"], 1);
  EXPECT_EQ(gpu_a["operations"]["reserve"], 2);
  // No sample yet: sizes the view cannot know are null, not zero.
  EXPECT_TRUE(gpu_a["total_bytes"].is_null());
  EXPECT_TRUE(gpu_a["free_bytes"].is_null());
  EXPECT_TRUE(gpu_a["sample_age_s"].is_null());
  EXPECT_EQ(gpu_a["overcommitted"], false);
}

TEST_F(LedgerReportTest, JsonShowsAvailableBytesBelowZeroAndOvercommitEvents) {
  view_.apply(a_, sample("GPU-A", 10 * kGiB, 10 * kGiB, kSecond), kNow);
  view_.apply(a_, reserve("GPU-A", 1, 6 * kGiB, "t", kSecond), kNow);
  view_.apply(b_, reserve("GPU-A", 2, 6 * kGiB, "t", kSecond), kNow);
  json gpu = *find_gpu(ledger(), "GPU-A");
  EXPECT_EQ(gpu["overcommitted"], true);
  EXPECT_EQ(gpu["available_bytes"], -static_cast<std::int64_t>(2 * kGiB));
  view_.apply(b_, release("GPU-A", 2, 3 * kSecond), kNow);
  EXPECT_EQ((*find_gpu(ledger(), "GPU-A"))["overcommitted"], false);
  view_.apply(b_, reserve("GPU-A", 4, 5 * kGiB, "t", 4 * kSecond), kNow);
  EXPECT_EQ((*find_gpu(ledger(), "GPU-A"))["overcommit_events"], 2);
}

TEST_F(LedgerReportTest, JsonNamesLedgerStepsAndLeakedReservations) {
  populate(view_, a_, b_);  // b died holding two reservations, one on each GPU
  const json j = ledger();
  const json* a_on_a = find_process(*find_gpu(j, "GPU-A"), a_.key.pid);
  ASSERT_NE(a_on_a, nullptr);
  ASSERT_EQ((*a_on_a)["steps"].size(), 1u);
  EXPECT_EQ((*a_on_a)["steps"][0]["step"], "LedgerReserve");
  EXPECT_EQ((*a_on_a)["steps"][0]["count"], 1);
  EXPECT_EQ((*a_on_a)["steps"][0]["total_ns"], 2 * kSecond);
  const json& gpu_a_steps = (*find_gpu(j, "GPU-A"))["steps"];
  ASSERT_EQ(gpu_a_steps.size(), 2u);
  EXPECT_EQ(gpu_a_steps[1]["step"], "WaitPoll");
  EXPECT_EQ((*find_reservation(*find_gpu(j, "GPU-A"), 2))["holder_alive"], false);
  EXPECT_EQ((*find_gpu(j, "GPU-A"))["leaked_reservations"], 1);
}

TEST_F(LedgerReportTest, JsonUidsAreNullWhenUnknown) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  EXPECT_EQ((*find_reservation(*find_gpu(ledger(), "GPU-A"), 1))["uid"], 1000);
  EXPECT_EQ((*find_gpu(ledger(), "GPU-A"))["creator_uid"], 1000);

  ledger::State restored;
  ledger::Gpu old;
  old.reservations.emplace(
      1, ledger::Reservation{alice_.key, kUnknownUid, "old", kGiB, "t", kSecond, true});
  old.reserved_bytes = old.high_water_bytes = kGiB;
  restored.gpus.emplace("GPU-A", std::move(old));
  view_.adopt(std::move(restored), kNow);
  EXPECT_TRUE((*find_reservation(*find_gpu(ledger(), "GPU-A"), 1))["uid"].is_null());
  EXPECT_TRUE((*find_gpu(ledger(), "GPU-A"))["creator_uid"].is_null());
}

// Each row says whose it is and, once its process is seen gone, how long ago: what its
// uid's max_ledger_rows_per_uid counts and when max_ledger_row_age_s removes it.
TEST_F(LedgerReportTest, JsonRowsShowTheirUidAndHowLongAgoTheirProcessExited) {
  view_.apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_.apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  const auto bob_gone = [&](const ProcessKey& key) { return key != bob_.key; };
  ASSERT_EQ(view_.age_rows(bob_gone, kNow - 30 * kSecond), 0u);
  const json gpu = *find_gpu(ledger(), "GPU-A");
  const json* alice = find_process(gpu, alice_.key.pid);
  ASSERT_NE(alice, nullptr);
  EXPECT_EQ(alice->at("uid"), 1000);
  EXPECT_EQ(alice->at("exited"), false);
  EXPECT_TRUE(alice->at("exited_ago_s").is_null()) << alice->dump();
  const json* bob = find_process(gpu, bob_.key.pid);
  ASSERT_NE(bob, nullptr);
  EXPECT_EQ(bob->at("uid"), 1001);
  EXPECT_EQ(bob->at("exited"), true);
  EXPECT_DOUBLE_EQ(bob->at("exited_ago_s").get<double>(), 30.0) << bob->dump();

  // A row restored from a snapshot that kept no uid, whose process holds no reservation.
  ledger::State restored;
  ledger::Gpu old;
  old.processes[c_.key].comm = "old";
  restored.gpus.emplace("GPU-A", std::move(old));
  view_.adopt(std::move(restored), kNow);
  const json after = ledger();
  const json* row = find_process(*find_gpu(after, "GPU-A"), c_.key.pid);
  ASSERT_NE(row, nullptr);
  EXPECT_TRUE(row->at("uid").is_null()) << row->dump();
  EXPECT_TRUE(row->at("exited_ago_s").is_null()) << row->dump();
}

TEST_F(LedgerReportTest, JsonStatesLeasesAliveExpiredOrLeaked) {
  view_.apply(alice_, reserve_lease("GPU-A", 1, kGiB, 2000, 10 * kSecond), kNow);
  view_.apply(alice_, reserve("GPU-A", 2, kGiB, "plain", 10 * kSecond), kNow);
  view_.apply(bob_, reserve_lease("GPU-A", 3, kGiB, 2000, 10 * kSecond), kNow);
  json gpu = *find_gpu(ledger(), "GPU-A");
  EXPECT_EQ((*find_reservation(gpu, 1))["state"], "alive");
  EXPECT_EQ((*find_reservation(gpu, 1))["lease_ms"], 2000);
  EXPECT_TRUE((*find_reservation(gpu, 2))["lease_ms"].is_null());
  view_.check_holders([&](const ProcessKey& key) { return key != bob_.key; });
  ASSERT_EQ(view_.expire_leases(12 * kSecond), 1u);
  gpu = *find_gpu(ledger(), "GPU-A");
  const json* r = find_reservation(gpu, 1);
  EXPECT_EQ((*r)["state"], "EXPIRED");
  EXPECT_EQ((*r)["expired"], true);
  EXPECT_EQ((*r)["holder_alive"], true);
  EXPECT_EQ((*r)["lease_left_s"], 0.0);
  EXPECT_EQ((*find_reservation(gpu, 2))["state"], "alive");
  EXPECT_EQ((*find_reservation(gpu, 3))["state"], "LEAKED");
  EXPECT_EQ(gpu["expired_reservations"], 1);
  EXPECT_EQ(gpu["leaked_reservations"], 1);
}

TEST_F(LedgerReportTest, JsonSaysWhereTheCapacityComesFromAndListsFindings) {
  view_.apply(a_, reserve("GPU-A", 1, 4 * kGiB, "a", 1 * kSecond), kNow);   // OVER
  view_.apply(a_, sample("GPU-A", 1 * kGiB, 8 * kGiB, 1 * kSecond), kNow);  // the client's
  ledger::Device device;
  device.name = "Fake";
  device.total_bytes = 80 * kGiB;
  device.used_bytes = 10 * kGiB;
  device.free_bytes = 70 * kGiB;
  device.at_ns = kNow;
  device.processes_known = true;
  device.processes = {
      {static_cast<std::uint32_t>(a_.key.pid), 4 * kGiB + 500 * kMiB, true},  // > 4 GiB + 10%
      {4242, 3 * kGiB, true},                                                 // no reservation
      {999999, 1 * kGiB, false},                                              // not in /proc
  };
  std::map<std::string, ledger::Device, std::less<>> devices;
  devices["GPU-A"] = device;
  ledger::Device other = device;
  other.processes.clear();
  devices["GPU-Z"] = other;  // a GPU no one annotated
  view_.apply_devices(devices, "", kNow);

  const json j = ledger();
  const json* gpu = find_gpu(j, "GPU-A");
  ASSERT_NE(gpu, nullptr);
  EXPECT_EQ(gpu->at("capacity_source"), "device");
  EXPECT_EQ(gpu->at("total_bytes"), 80 * kGiB);
  EXPECT_EQ(gpu->at("free_bytes"), 70 * kGiB);
  EXPECT_EQ(gpu->at("device").at("name"), "Fake");
  EXPECT_EQ(gpu->at("device").at("processes").size(), 3u);
  std::map<std::string, std::vector<std::int64_t>> kinds;
  for (const json& f : gpu->at("findings")) kinds[f.at("kind")].push_back(f.at("pid"));
  EXPECT_EQ(kinds["OVER"], std::vector<std::int64_t>{a_.key.pid});
  EXPECT_EQ(kinds["UNDECLARED"], std::vector<std::int64_t>{4242});
  EXPECT_EQ(kinds["GHOST"], std::vector<std::int64_t>{999999});
  EXPECT_EQ(kinds.size(), 3u);
  EXPECT_NE(find_gpu(j, "GPU-Z"), nullptr);

  // Without the device, the client's sample is back.
  view_.apply_devices({}, "nvmlDeviceGetCount_v2 failed: Unknown Error (999)", kNow);
  const json after = ledger();
  EXPECT_EQ(find_gpu(after, "GPU-A")->at("capacity_source"), "client");
  EXPECT_EQ(find_gpu(after, "GPU-A")->at("total_bytes"), 8 * kGiB);
  EXPECT_TRUE(find_gpu(after, "GPU-A")->at("findings").empty());
  EXPECT_EQ(find_gpu(after, "GPU-Z"), nullptr);
  EXPECT_EQ(after.at("device_error"), "nvmlDeviceGetCount_v2 failed: Unknown Error (999)");
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
