// The snapshot codec (daemon/persist/snapshot_codec.h): the v1 format byte for byte (a
// file the previous build wrote), state -> encode -> decode -> encode round trips, and
// each section (histogram, ledger) on its own with errors named by path.
#include "daemon/persist/snapshot_codec.h"
#include "daemon/report/report.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "daemon/report/ledger_report.h"
#include "daemon/state/collector.h"
#include "daemon/state/counter_table.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/ledger_view.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/daemon/state/ledger_test_util.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;

// ---- the whole snapshot ------------------------------------------------------------------

proto::LedgerRecord ledger_record(proto::LedgerOp op, std::string_view gpu, std::uint64_t id,
                                  std::uint64_t bytes, std::uint64_t total, std::uint32_t tid,
                                  std::uint64_t ts) {
  proto::LedgerRecord r{};
  r.op = static_cast<std::uint8_t>(op);
  r.timestamp_ns = ts;
  r.reservation_id = id;
  r.bytes = bytes;
  r.total_bytes = total;
  r.thread_id = tid;
  proto::set_field(r.gpu_uuid, gpu);
  return r;
}

Limits golden_limits() {
  Limits l;
  l.max_exited_processes = 1;  // a second exit evicts the first: "retired" histograms
  l.max_open_depth = 2;        // a third nested start is dropped: depth_dropped, limits_hit
  return l;
}

// The state tests/daemon/persist/snapshot_v1.json was written from, by the build before
// the codec moved out of the state classes: custom steps (one without data), unmatched
// ends, abandoned and depth-dropped spans, drops by cause, an exited and an evicted
// process, two GPUs (a sample, step time, an empty task, no sample), an anomaly, counters.
void populate_golden(Collector& c, FakeWorld& world) {
  Connection a(c, world.spawn(4242, 100, "python3"));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.register_step(257, "Eval loop"));
  ASSERT_FALSE(a.events({start(1, 0, 0), end(1, 0, 1500), start(1, 0, 2000), end(1, 0, 9'000'000),
                         start(1, 256, 0), end(1, 256, 90'000), end(2, 2, 10), start(1, 7, 100)}));
  a.ledger(test::reserve_record("GPU-1", 9, 1 << 20, "qlora-7b", 1, 150));
  ASSERT_FALSE(a.events({end(1, 7, 400)}));
  a.ledger(ledger_record(proto::LedgerOp::kVramSample, "GPU-1", 0, 3ull << 30, 8ull << 30, 1, 500));
  a.ledger(test::reserve_record("GPU-2", 1, 4096, "", 2, 600));
  a.ledger(ledger_record(proto::LedgerOp::kRelease, "GPU-2", 77, 0, 0, 2, 700));  // unknown
  ASSERT_FALSE(a.events({start(3, 1, 0), start(3, 1, 1), start(3, 1, 2), end(3, 1, 5)}));
  a.dropped(11);
  a.dropped_by_cause({{3, 9, 1, 2}});
  {
    Connection b(c, world.spawn(5000, 200, "trainer"));
    ASSERT_FALSE(b.register_step(300, "Tokenize"));
    ASSERT_FALSE(b.events({start(3, 300, 0), end(3, 300, 7), start(3, 1, 0), end(3, 1, 70)}));
    world.kill(5000);
    world.now_ns += 10;
  }
  {
    Connection d(c, world.spawn(6000, 300, "eval"));
    ASSERT_FALSE(d.events({start(1, 3, 0), end(1, 3, 123'456), start(1, 4, 0)}));
    world.kill(6000);
    world.now_ns += 10;
  }
  a.close();
}

// The server's counters when the file was written: two connections closed for bad magic
// (bytes and frames were not counted by the harness that fed the frames).
ServerCounters golden_server() {
  ServerCounters server;
  server.protocol_errors["bad_magic"] = 2;
  return server;
}

std::string golden_text() {
  std::ifstream in(STEPTRACE_SNAPSHOT_V1);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// What save_snapshot writes for `doc`.
std::string file_text(const json& doc) { return doc.dump() + "\n"; }

// What this build writes that the build of snapshot_v1.json did not (all additive, read
// with a default): the ledger's uids and refusals (issue 15, item 7), the anomaly kinds
// of its permissions and per-uid quotas, and three counters of issue 15. The v1 file has none of
// them, so the tests of it compare everything else byte for byte, and these fields on their own.
// Leases (issue 13) added the reservations' lease fields, the rows' renews, the renew
// operation count and four anomaly kinds.
constexpr const char* kAnomaliesSinceV1[] = {"release_refused",
                                             "cleanup_refused",
                                             "max_gpus_per_uid",
                                             "max_reservations_per_uid",
                                             "unknown_renew",
                                             "renew_refused",
                                             "bad_lease",
                                             "lease_expired",
                                             "max_ledger_rows_per_uid",
                                             "reservation_over_total",
                                             "vram_total_mismatch"};
constexpr const char* kReservationFieldsSinceV1[] = {"uid", "lease_ms", "lease_deadline_ns",
                                                     "expired"};
// Issue 26: the rows' uid and exit time, the GPUs' established total and its uid.
constexpr const char* kRowFieldsSinceV1[] = {"refused", "renews", "uid", "exited_ns"};
constexpr const char* kGpuFieldsSinceV1[] = {"creator_uid", "client_total_bytes",
                                             "client_total_uid"};
constexpr const char* kCountersSinceV1[] = {"connections_undrained", "liveness_probe_errors",
                                            "replies_refused", "frames_resent_skipped"};

json without_fields_since_v1(json doc) {
  json& ledger = doc.at("ledger");
  for (json& gpu : ledger.at("gpus")) {
    for (const char* field : kGpuFieldsSinceV1) EXPECT_EQ(gpu.erase(field), 1u);
    EXPECT_EQ(gpu.at("operations").erase("renew"), 1u);
    for (json& r : gpu.at("reservations")) {
      for (const char* field : kReservationFieldsSinceV1) EXPECT_EQ(r.erase(field), 1u);
    }
    for (json& p : gpu.at("processes")) {
      for (const char* field : kRowFieldsSinceV1) EXPECT_EQ(p.erase(field), 1u);
    }
  }
  for (const char* kind : kAnomaliesSinceV1) EXPECT_EQ(ledger.at("anomalies").erase(kind), 1u);
  for (const char* name : kCountersSinceV1) EXPECT_EQ(doc.at("counters").erase(name), 1u);
  // Jobs and self time (issue 12): every step's self_ns, what evicted processes left to
  // their jobs. (Job ids and ranks are written only when a process sent them.)
  for (json& p : doc.at("processes")) {
    for (json& step : p.at("steps")) EXPECT_EQ(step.erase("self_ns"), 1u);
    // Durable totals (issue 25): the events counted (absent when restored from a file
    // without them) and the daemon_crash drops; spans past max_span_ns (issue 26).
    p.erase("events");
    EXPECT_EQ(p.at("dropped_by_cause").erase("daemon_crash"), 1u);
    EXPECT_EQ(p.at("dropped_by_cause").erase("refused"), 1u);
    // Ledger records the view did not apply (written only when not 0).
    p.erase("ledger_refused");
  }
  EXPECT_EQ(doc.at("counters").at("events_dropped_by_cause").erase("daemon_crash"), 1u);
  EXPECT_EQ(doc.at("counters").at("events_dropped_by_cause").erase("refused"), 1u);
  EXPECT_EQ(doc.erase("retired_jobs"), 1u);
  return doc;
}

// The fields since v1 of every GPU of `doc`'s ledger: the uids `uid`, nothing refused,
// no lease, nothing renewed.
void expect_fields_since_v1(const json& doc, std::uint64_t uid) {
  const json& ledger = doc.at("ledger");
  for (const json& gpu : ledger.at("gpus")) {
    EXPECT_EQ(gpu.at("creator_uid"), uid) << gpu.dump();
    EXPECT_EQ(gpu.at("operations").at("renew"), 0) << gpu.dump();
    // The established total is the sample's, of the uid that sent it (from a file that
    // did not keep it: of no uid).
    if (gpu.at("sample").is_null()) {
      EXPECT_EQ(gpu.at("client_total_bytes"), 0) << gpu.dump();
      EXPECT_EQ(gpu.at("client_total_uid"), kUnknownUid) << gpu.dump();
    } else {
      EXPECT_EQ(gpu.at("client_total_bytes"), gpu.at("sample").at("total_bytes")) << gpu.dump();
      EXPECT_EQ(gpu.at("client_total_uid"), uid) << gpu.dump();
    }
    for (const json& r : gpu.at("reservations")) {
      EXPECT_EQ(r.at("uid"), uid) << r.dump();
      EXPECT_EQ(r.at("lease_ms"), 0) << r.dump();
      EXPECT_EQ(r.at("lease_deadline_ns"), 0) << r.dump();
      EXPECT_EQ(r.at("expired"), false) << r.dump();
    }
    for (const json& p : gpu.at("processes")) {
      EXPECT_EQ(p.at("refused"), 0) << p.dump();
      EXPECT_EQ(p.at("renews"), 0) << p.dump();
      EXPECT_EQ(p.at("uid"), uid) << p.dump();
      EXPECT_EQ(p.at("exited_ns"), 0) << p.dump();
    }
  }
  for (const char* kind : kAnomaliesSinceV1) EXPECT_EQ(ledger.at("anomalies").at(kind), 0);
  for (const char* name : kCountersSinceV1) EXPECT_EQ(doc.at("counters").at(name), 0);
}

TEST(SnapshotCodecTest, EncodesTheV1FormatByteForByte) {
  const std::string golden = golden_text();
  ASSERT_FALSE(golden.empty());
  FakeWorld world;
  Collector c(golden_limits(), world.env());
  populate_golden(c, world);
  const ServerCounters server = golden_server();
  const json encoded = encode_snapshot(*c.freeze(&server));
  EXPECT_EQ(file_text(without_fields_since_v1(encoded)), golden);
  expect_fields_since_v1(encoded, 1000);  // FakeWorld's processes run as uid 1000
}

TEST(SnapshotCodecTest, AFileTheOldBuildWroteRestoresAndEncodesToTheSameBytes) {
  const std::string golden = golden_text();
  const json doc = json::parse(golden);
  FakeWorld world;
  world.spawn(4242, 100, "python3");  // still running, as when the file was written
  world.now_ns = doc["written_at_ns"].get<std::uint64_t>();
  Collector c(golden_limits(), world.env());
  ASSERT_FALSE(restore_from_snapshot(c, doc));
  const json encoded = encode_snapshot(*c.freeze());
  EXPECT_EQ(file_text(without_fields_since_v1(encoded)), golden);
  // The file kept no uids: its reservations and GPUs are of the unknown uid, which only
  // the holder process or root may release, and which counts against no uid's quota.
  expect_fields_since_v1(encoded, kUnknownUid);
  EXPECT_TRUE(report::ledger_json(*c.freeze())["gpus"][0]["reservations"][0]["uid"].is_null());
  EXPECT_TRUE(c.freeze()->ledger().uids.empty());
  EXPECT_EQ(c.counters().events_received, 20u);
  EXPECT_EQ(c.counters().protocol_errors.at("bad_magic"), 2u);
  // And what this build writes of it restores to the same bytes, new fields included.
  Collector again(golden_limits(), world.env());
  ASSERT_FALSE(restore_from_snapshot(again, json::parse(file_text(encoded))));
  EXPECT_EQ(file_text(encode_snapshot(*again.freeze())), file_text(encoded));
}

// ---- version 2: a record per line (issue 25) -------------------------------------------

std::string golden_v2_text() {
  std::ifstream in(STEPTRACE_SNAPSHOT_V2, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The first version-2 file, pinned (STEPTRACE_UPDATE_GOLDEN=1 writes it, once: a change to
// it is a change of format that files already written must survive).
TEST(SnapshotCodecTest, EncodesTheV2FormatByteForByte) {
  FakeWorld world;
  Collector c(golden_limits(), world.env());
  populate_golden(c, world);
  const ServerCounters server = golden_server();
  const std::string text = encode_snapshot_text(c.freeze(&server)->image());
  if (std::getenv("STEPTRACE_UPDATE_GOLDEN") != nullptr) {
    std::ofstream(STEPTRACE_SNAPSHOT_V2, std::ios::binary) << text;
    GTEST_SKIP() << "wrote " << STEPTRACE_SNAPSHOT_V2;
  }
  EXPECT_EQ(text, golden_v2_text());
}

TEST(SnapshotCodecTest, AV2FileDecodesAndEncodesToTheSameBytes) {
  const std::string golden = golden_v2_text();
  ASSERT_FALSE(golden.empty());
  std::string error;
  const auto image = decode_snapshot_text(golden, golden_limits(), error);
  ASSERT_TRUE(image) << error;
  EXPECT_TRUE(image->skipped.empty()) << image->skipped.front();
  EXPECT_EQ(encode_snapshot_text(*image), golden);
  // The same state as the version-1 document of it.
  FakeWorld world;
  Collector c(golden_limits(), world.env());
  populate_golden(c, world);
  const ServerCounters server = golden_server();
  EXPECT_EQ(encode_snapshot(*image), encode_snapshot(*c.freeze(&server)));
}

// Files written before issue 26 hold every retired job before the processes: the reader
// takes records in any order, so such a file restores the same state.
TEST(SnapshotCodecTest, AV2FileWithRetiredJobsBeforeTheProcessesRestoresTheSameState) {
  const std::string golden = golden_v2_text();
  std::vector<std::string> lines;
  std::istringstream in(golden);
  for (std::string line; std::getline(in, line);) lines.push_back(line + "\n");
  const auto is = [](const std::string& line, std::string_view kind) {
    return line.find("{\"" + std::string(kind) + "\":") == 9;
  };
  const auto first_process =
      std::find_if(lines.begin(), lines.end(), [&](const auto& l) { return is(l, "process"); });
  ASSERT_NE(first_process, lines.end());
  std::stable_partition(first_process, lines.end(),
                        [&](const auto& l) { return is(l, "retired_job"); });
  std::string former;
  for (const std::string& line : lines) former += line;
  ASSERT_NE(former, golden);  // the golden file has a retired job after a process
  std::string error;
  const auto image = decode_snapshot_text(former, golden_limits(), error);
  ASSERT_TRUE(image) << error;
  EXPECT_TRUE(image->skipped.empty()) << image->skipped.front();
  EXPECT_EQ(encode_snapshot_text(*image), golden);
}

TEST(SnapshotCodecTest, AV1FileRewrittenAsV2RestoresTheSameState) {
  std::string error;
  const auto v1 = decode_snapshot(json::parse(golden_text()), golden_limits(), error);
  ASSERT_TRUE(v1) << error;
  const auto v2 = decode_snapshot_text(encode_snapshot_text(*v1), golden_limits(), error);
  ASSERT_TRUE(v2) << error;
  EXPECT_TRUE(v2->skipped.empty());
  EXPECT_EQ(encode_snapshot(*v2), encode_snapshot(*v1));
}

// A collector holding `innocents` small processes of uid 3000, one of them with a
// reservation, and `greedy` processes of uid 2000 with 200 custom steps each: every
// greedy record is ~50 times an innocent one. The innocent uid sorts after the greedy
// one, and its pids too.
void populate_greedy(Collector& c, FakeWorld& world, int greedy, int innocents = 1,
                     std::uint32_t steps = 200) {
  for (int i = 0; i < innocents; ++i) {
    Connection innocent(c, world.spawn(90'000 + i, 1, "innocent", 3000));
    ASSERT_FALSE(innocent.events({start(1, 0, 0), end(1, 0, 4000 + i)}));
    if (i == 0) innocent.ledger(test::reserve_record("GPU-1", 7, 1 << 30, "innocent-job", 1, 150));
    innocent.close();
  }
  for (int i = 0; i < greedy; ++i) {
    Connection g(c, world.spawn(1000 + i, 1, "greedy", 2000));
    for (std::uint32_t s = 0; s < steps; ++s) {
      const std::uint32_t id = proto::kFirstCustomStep + s;
      ASSERT_FALSE(g.register_step(id, "step-" + std::to_string(s)));
      ASSERT_FALSE(g.events({start(1, id, 0), end(1, id, 1000 + s)}));
    }
    g.close();
  }
}

std::pair<std::size_t, std::size_t> innocent_and_greedy(const StateImage& image) {
  std::size_t innocent = 0;
  std::size_t greedy = 0;
  for (const ProcessImage& p : image.processes) ++(p.peer.uid == 3000 ? innocent : greedy);
  return {innocent, greedy};
}

// Fair by bytes, not by count: the greedy uid has fewer processes than the innocent one
// (10 against 30) but holds most of the bytes; the cap cuts the greedy one.
TEST(SnapshotCodecTest, MaxBytesCutsTheUidHoldingTheMostBytesNotAnInnocentOne) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, 10, 30);
  const StateImage image = c.freeze()->image();
  const std::size_t whole = encode_snapshot_text(image).size();
  const std::size_t cap = whole / 3;
  std::size_t written = 0;
  const EncodedSnapshot encoded = encode_snapshot_records(image, cap, [&](std::string_view line) {
    written += line.size();
    return true;
  });
  EXPECT_LE(written, cap);
  EXPECT_EQ(encoded.bytes, written);
  EXPECT_GT(encoded.left_out, 3u);
  EXPECT_NE(encoded.first_left_out.find("of uid 2000"), std::string::npos)
      << encoded.first_left_out;

  std::string error;
  const auto restored = decode_snapshot_text(encode_snapshot_text(image, cap), Limits{}, error);
  ASSERT_TRUE(restored) << error;
  EXPECT_TRUE(restored->skipped.empty());  // left out when written, not damaged
  const auto [innocent, greedy] = innocent_and_greedy(*restored);
  EXPECT_EQ(innocent, 30u);
  EXPECT_EQ(greedy + encoded.left_out, 10u);
  ASSERT_EQ(restored->ledger.gpus.size(), 1u);
  EXPECT_EQ(restored->ledger.gpus.begin()->second.reservations.size(), 1u);
}

// A retired job of `uid` as a large one is: 64 ranks of 8 steps each (~30 KB of record).
RetiredJobImage big_retired_job(std::uint32_t uid, std::string job, std::uint64_t order) {
  RetiredJobImage out;
  out.uid = uid;
  out.job = std::move(job);
  out.processes = 64;
  out.retired_order = order;
  for (std::uint32_t rank = 0; rank < 64; ++rank) {
    for (std::uint64_t s = 0; s < 8; ++s) {
      const std::string name = "step-" + std::to_string(s);
      out.ranks[rank][name] = {.count = 1, .total_ns = 1000 + s, .self_ns = 1000 + s};
      JobStepImage& sum = out.steps[name];
      ++sum.count;
      sum.total_ns += 1000 + s;
      sum.self_ns += 1000 + s;
    }
  }
  return out;
}

std::pair<std::size_t, std::size_t> innocent_and_greedy_jobs(const StateImage& image) {
  std::size_t innocent = 0;
  std::size_t greedy = 0;
  for (const RetiredJobImage& j : image.retired_jobs) ++(j.uid == 3000 ? innocent : greedy);
  return {innocent, greedy};
}

// Retired jobs take their uid's turns with its processes: a uid with many big retired
// jobs (sorting first, each the size of the innocent uid's one) is the one the cap cuts,
// not the innocent uid's process and job, which the writer reaches only after them.
TEST(SnapshotCodecTest, MaxBytesCutsTheUidWithTheMostRetiredJobBytesNotAnInnocentOne) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, /*greedy=*/1, /*innocents=*/1, /*steps=*/1);
  StateImage image = c.freeze()->image();
  ASSERT_TRUE(image.retired_jobs.empty());
  constexpr std::size_t kGreedyJobs = 40;
  for (std::size_t i = 0; i < kGreedyJobs; ++i) {
    const std::string job = "job-" + std::string(i < 10 ? "0" : "") + std::to_string(i);
    image.retired_jobs.push_back(big_retired_job(2000, job, i + 1));
  }
  image.retired_jobs.push_back(big_retired_job(3000, "job-00", kGreedyJobs + 1));
  const std::size_t whole = encode_snapshot_text(image).size();
  const std::size_t cap = whole / 3;
  std::size_t written = 0;
  const EncodedSnapshot encoded = encode_snapshot_records(image, cap, [&](std::string_view line) {
    written += line.size();
    return true;
  });
  EXPECT_LE(written, cap);
  EXPECT_GT(encoded.left_out, kGreedyJobs / 2);
  EXPECT_EQ(encoded.first_left_out.rfind("retired job job-", 0), 0u) << encoded.first_left_out;
  EXPECT_NE(encoded.first_left_out.find("of uid 2000"), std::string::npos)
      << encoded.first_left_out;

  std::string error;
  const auto restored = decode_snapshot_text(encode_snapshot_text(image, cap), Limits{}, error);
  ASSERT_TRUE(restored) << error;
  EXPECT_TRUE(restored->skipped.empty());  // left out when written, not damaged
  EXPECT_EQ(innocent_and_greedy(*restored), std::make_pair(std::size_t{1}, std::size_t{1}));
  const auto [innocent_jobs, greedy_jobs] = innocent_and_greedy_jobs(*restored);
  EXPECT_EQ(innocent_jobs, 1u);
  EXPECT_EQ(greedy_jobs + encoded.left_out, kGreedyJobs);
}

// The retired step histograms are no uid's, but one tenant can fill them with its own step
// names (a review found 4,096 full ones are about 48 MiB): they take turns of their own
// with the uids, so past a small cap they are what is cut, not everyone's processes.
TEST(SnapshotCodecTest, MaxBytesCutsTheRetiredHistogramsNotAnInnocentsProcesses) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, /*greedy=*/0, /*innocents=*/3, /*steps=*/1);
  StateImage image = c.freeze()->image();
  constexpr std::size_t kNames = 400;
  for (std::size_t i = 0; i < kNames; ++i) {
    Histogram& h = image.retired["greedy-step-" + std::to_string(i)];
    for (std::uint64_t v = 1; v < (std::uint64_t{1} << 40); v = v * 9 / 8 + 1) h.record(v);
  }
  const std::size_t whole = encode_snapshot_text(image).size();
  const std::size_t cap = whole / 4;
  const EncodedSnapshot encoded =
      encode_snapshot_records(image, cap, [](std::string_view) { return true; });
  EXPECT_GT(encoded.left_out, kNames / 2);
  EXPECT_EQ(encoded.first_left_out.rfind("retired step greedy-step-", 0), 0u)
      << encoded.first_left_out;

  std::string error;
  const auto restored = decode_snapshot_text(encode_snapshot_text(image, cap), Limits{}, error);
  ASSERT_TRUE(restored) << error;
  EXPECT_TRUE(restored->skipped.empty());
  EXPECT_EQ(innocent_and_greedy(*restored), std::make_pair(std::size_t{3}, std::size_t{0}));
  EXPECT_EQ(restored->retired.size() + encoded.left_out, kNames);
}

// The writer interleaves the uids' retired jobs; the reader gives them back in (uid, job)
// order, as the state keeps them, so what it restores encodes to the same bytes.
TEST(SnapshotCodecTest, RetiredJobsOfSeveralUidsRestoreInUidAndJobOrder) {
  StateImage image;
  image.retired_jobs = {big_retired_job(2000, "a", 1), big_retired_job(2000, "b", 2),
                        big_retired_job(3000, "a", 3), big_retired_job(3000, "b", 4)};
  const std::string text = encode_snapshot_text(image);
  std::vector<std::pair<std::uint32_t, std::string>> written;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const json record = json::parse(line.substr(9));
    if (!record.contains("retired_job")) continue;
    written.emplace_back(record["retired_job"]["uid"], record["retired_job"]["job"]);
  }
  using Job = std::pair<std::uint32_t, std::string>;
  EXPECT_EQ(written, (std::vector<Job>{{2000, "a"}, {3000, "a"}, {2000, "b"}, {3000, "b"}}));
  std::string error;
  const auto restored = decode_snapshot_text(text, Limits{}, error);
  ASSERT_TRUE(restored) << error;
  std::vector<Job> read;
  for (const RetiredJobImage& j : restored->retired_jobs) read.emplace_back(j.uid, j.job);
  EXPECT_EQ(read, (std::vector<Job>{{2000, "a"}, {2000, "b"}, {3000, "a"}, {3000, "b"}}));
  EXPECT_EQ(encode_snapshot_text(*restored), text);
}

// The daemon's own records are never cut: a cap smaller than they are still writes them
// (and the processes are left out).
TEST(SnapshotCodecTest, TheDaemonsOwnRecordsAreNeverLeftOut) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, 2, 2);
  std::string error;
  const auto restored =
      decode_snapshot_text(encode_snapshot_text(c.freeze()->image(), 10), Limits{}, error);
  ASSERT_TRUE(restored) << error;
  EXPECT_TRUE(restored->processes.empty());
  ASSERT_EQ(restored->ledger.gpus.size(), 1u);
  EXPECT_EQ(restored->counters.events_received, c.counters().events_received);
}

// Damage at random places, from a seed printed on failure (STEPTRACE_TEST_SEED=N repeats
// a run): never more lost than the records hit, never a crash (CI runs this under ASan and
// UBSan). Line 2 is the counters' record, line 3 the ledger's; processes follow the
// retired ones.
TEST(SnapshotCodecTest, RandomDamageCostsNoMoreThanTheRecordsItHits) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, 12, 3, /*steps=*/6);  // small records: 300 rounds stay quick
  const StateImage image = c.freeze()->image();
  const std::string text = encode_snapshot_text(image);
  std::vector<std::size_t> line_of(text.size());  // each byte's line (0-based)
  for (std::size_t i = 0, line = 0; i < text.size(); ++i) {
    line_of[i] = line;
    if (text[i] == '\n') ++line;
  }
  const std::size_t processes = image.processes.size();
  const char* env = std::getenv("STEPTRACE_TEST_SEED");
  const auto seed = env != nullptr && *env != '\0'
                        ? static_cast<std::uint32_t>(std::stoul(env))
                        : static_cast<std::uint32_t>(std::random_device{}());
  std::mt19937 random(seed);
  for (int round = 0; round < 300; ++round) {
    const std::string where = "seed " + std::to_string(seed) + " round " + std::to_string(round);
    std::string damaged = text;
    std::set<std::size_t> hit;  // lines a change reached
    const int changes = 1 + static_cast<int>(random() % 3);
    for (int k = 0; k < changes; ++k) {
      const std::size_t at = random() % damaged.size();
      damaged[at] = static_cast<char>(damaged[at] ^ (1 + random() % 255));
      hit.insert(line_of[at]);
      if (text[at] == '\n') hit.insert(line_of[at] + 1);  // two lines run together
    }
    // Sometimes a torn tail too: every line from the cut on is lost, none before it.
    const std::size_t cut = random() % 4 == 0 ? random() % damaged.size() : damaged.size();
    damaged.resize(cut);
    for (std::size_t at = cut; at < text.size(); ++at) hit.insert(line_of[at]);
    std::string error;
    const auto restored = decode_snapshot_text(damaged, Limits{}, error);
    ASSERT_TRUE(restored || hit.size() >= 4) << where << ": " << error;
    if (!restored) continue;
    const std::size_t process_lines_hit = static_cast<std::size_t>(
        std::count_if(hit.begin(), hit.end(), [&](std::size_t l) { return l >= 3; }));
    EXPECT_GE(restored->processes.size() + process_lines_hit, processes) << where;
    EXPECT_FALSE(restored->skipped.empty()) << where;
    if (!hit.contains(1)) {
      EXPECT_EQ(restored->counters.events_received, c.counters().events_received) << where;
    }
    if (!hit.contains(2)) {
      EXPECT_EQ(restored->ledger.gpus.size(), 1u) << where;
    }
  }
}

TEST(SnapshotCodecTest, TheUidThatHasWrittenTheFewestBytesWritesNext) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  for (const auto& [pid, uid] : std::vector<std::pair<int, std::uint32_t>>{
           {10, 3}, {11, 3}, {12, 3}, {20, 1}, {30, 2}, {31, 2}}) {
    Connection p(c, world.spawn(pid, 1, "p", uid));
    p.close();
  }
  const std::string text = encode_snapshot_text(c.freeze()->image());
  std::vector<int> order;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const json record = json::parse(line.substr(9));
    if (record.contains("process")) order.push_back(record["process"]["pid"].get<int>());
  }
  // Records of one size: uids 1, 2, 3 in turn (20, 30, 10), then 31, 11, then 12.
  EXPECT_EQ(order, (std::vector<int>{20, 30, 10, 31, 11, 12}));
}

TEST(SnapshotCodecTest, AUidPastMaxProcessesPerUidAtRestoreLosesItsOwnNotOthers) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate_greedy(c, world, 10);
  for (int i = 0; i < 3; ++i) {  // and three of its processes that exited
    Connection gone(c, world.spawn(5000 + i, 1, "gone", 2000));
    world.kill(5000 + i);
  }
  Limits limits;
  limits.max_processes_per_uid = 4;  // live ones: those exited make room by themselves
  std::string error;
  const auto restored =
      decode_snapshot_text(encode_snapshot_text(c.freeze()->image()), limits, error);
  ASSERT_TRUE(restored) << error;
  const auto [innocent, greedy] = innocent_and_greedy(*restored);
  EXPECT_EQ(innocent, 1u);
  EXPECT_EQ(greedy, 4u + 3u);
  ASSERT_EQ(restored->skipped.size(), 6u);
  EXPECT_NE(restored->skipped[0].find("of uid 2000: past limits.max_processes_per_uid (4 live)"),
            std::string::npos)
      << restored->skipped[0];
}

// The holder's uid, the GPU's creator and refusals survive a snapshot (decode_ledger then
// LedgerView::adopt, which also recounts what each uid holds for the quotas).
TEST(SnapshotCodecTest, LedgerUidsAndRefusalsRoundTrip) {
  Limits limits;
  DaemonCounters counters;
  LedgerView view(limits, counters);
  const LedgerActor alice{{10, 1}, "alice", 1000};
  const LedgerActor bob{{20, 2}, "bob", 1001};
  using namespace ledger_test;
  view.apply(alice, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view.apply(bob, reserve("GPU-B", 2, kGiB, "t", kSecond), kNow);
  view.apply(bob, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);  // a row (a refusal makes none)
  view.apply(bob, release("GPU-A", 1, kSecond), kNow);             // refused: another uid
  const json encoded = encode_ledger(view);
  EXPECT_EQ(encoded["gpus"][0]["reservations"][0]["uid"], 1000);
  EXPECT_EQ(encoded["gpus"][0]["creator_uid"], 1000);
  EXPECT_EQ(encoded["gpus"][1]["creator_uid"], 1001);
  EXPECT_EQ(encoded["anomalies"]["release_refused"], 1);

  std::string error;
  auto decoded = decode_ledger(json::parse(encoded.dump()), limits, error);
  ASSERT_TRUE(decoded) << error;
  LedgerView restored(limits, counters);
  restored.adopt(std::move(*decoded), kNow);
  EXPECT_EQ(encode_ledger(restored), encoded);
  EXPECT_EQ(restored.state().gpus.at("GPU-A").reservations.at(1).uid, 1000u);
  EXPECT_EQ(restored.state().usage(1000).gpus, 1u);
  EXPECT_EQ(restored.state().usage(1000).reservations, 1u);
  EXPECT_EQ(restored.state().usage(1001).gpus, 1u);
  bool found = false;
  for (const auto& [key, row] : restored.state().gpus.at("GPU-A").processes) {
    if (key == bob.key) found = row.refused == 1;
  }
  EXPECT_TRUE(found);
  // The rules hold after the restore: bob still may not release alice's.
  restored.apply(bob, release("GPU-A", 1, 2 * kSecond), kNow);
  EXPECT_EQ(restored.state().gpus.at("GPU-A").reservations.size(), 2u);
}

// A process may name itself with escape codes, line breaks or invalid UTF-8: the snapshot
// keeps its comm (as JSON escapes, invalid UTF-8 as U+FFFD) and restores, rather than one
// such name making the whole snapshot unreadable at the next start.
TEST(SnapshotCodecTest, AProcessNamedWithControlBytesRestores) {
  FakeWorld world;
  Collector c(golden_limits(), world.env());
  {
    Connection a(c, world.spawn(77, 7, "\x1b[31mev\nil\xff"));
    ASSERT_FALSE(a.events({start(1, 0, 0), end(1, 0, 10)}));
  }
  const std::string text =
      encode_snapshot(*c.freeze()).dump(-1, ' ', false, json::error_handler_t::replace);
  Collector restored(golden_limits(), world.env());
  ASSERT_FALSE(restore_from_snapshot(restored, json::parse(text)));
  const json r = report::report_json(*restored.freeze(), std::nullopt);
  ASSERT_EQ(r["processes"].size(), 1u);
  EXPECT_EQ(r["processes"][0]["comm"], "\x1b[31mev\nil\xef\xbf\xbd");
}

TEST(SnapshotCodecTest, StateEncodeDecodeEncodeIsTheSame) {
  FakeWorld world;
  Collector original(golden_limits(), world.env());
  populate_golden(original, world);
  ServerCounters server = golden_server();
  server.connections_undrained = 3;
  server.replies_refused = 4;
  const json first = encode_snapshot(*original.freeze(&server));

  std::string error;
  auto decoded = decode_snapshot(json::parse(first.dump()), golden_limits(), error);
  ASSERT_TRUE(decoded) << error;
  EXPECT_EQ(decoded->processes.size(), 2u);
  EXPECT_EQ(decoded->retired.size(), 2u);
  EXPECT_EQ(decoded->ledger.gpus.size(), 2u);
  EXPECT_EQ(decoded->counters.events_dropped_by_clients, 15u);
  EXPECT_EQ(decoded->counters.connections_undrained, 3u);
  EXPECT_EQ(decoded->counters.replies_refused, 4u);

  Collector restored(golden_limits(), world.env());
  ASSERT_FALSE(restored.adopt(std::move(*decoded)));
  EXPECT_EQ(encode_snapshot(*restored.freeze()), first);
  EXPECT_EQ(report::ledger_json(*restored.freeze()), report::ledger_json(*original.freeze()));
}

// Every counter the table marks kept comes back from a snapshot with its value (each a
// distinct one here); the others start again from zero.
TEST(SnapshotCodecTest, EveryKeptCounterOfTheTableRoundTrips) {
  FakeWorld world;
  Collector original(golden_limits(), world.env());
  populate_golden(original, world);
  ServerCounters server;
  std::uint64_t next = 100;
  for (const CounterRow& row : kCounterTable) {
    if (row.server != nullptr) server.*row.server = next++;
  }
  const auto view = original.freeze(&server);
  json doc = json::parse(encode_snapshot(*view).dump());
  // Written under its key with its value; then each given a distinct value to read back.
  next = 500;
  for (const CounterRow& row : kCounterTable) {
    if (row.kept == Kept::kNo) continue;
    SCOPED_TRACE(std::string(row.snapshot_key));
    json& value = doc.at("counters").at(std::string(row.snapshot_key));
    EXPECT_EQ(value, view->counters().*row.field);
    value = next++;
  }
  std::string error;
  auto decoded = decode_snapshot(doc, golden_limits(), error);
  ASSERT_TRUE(decoded) << error;
  Collector restored(golden_limits(), world.env());
  ASSERT_FALSE(restored.adopt(std::move(*decoded)));
  next = 500;
  for (const CounterRow& row : kCounterTable) {
    SCOPED_TRACE(std::string(row.stats_key));
    const std::uint64_t restored_value = restored.counters().*row.field;
    EXPECT_EQ(restored_value, row.kept == Kept::kNo ? 0u : next++);
  }
}

// decode_snapshot's error for `doc` ("" when it decodes).
// The document's first problem: why it is refused whole, else why the first record left
// out was (a bad process record costs that process only); "" when all is read.
std::string decode_error(const json& doc) {
  std::string error;
  const auto decoded = decode_snapshot(doc, golden_limits(), error);
  if (!decoded) return error;
  return decoded->skipped.empty() ? "" : decoded->skipped.front();
}

// A process's job and ranks, its steps' self time and what evicted processes left to
// their jobs survive a snapshot; values no daemon would have written are refused.
TEST(SnapshotCodecTest, JobsRanksAndSelfTimeRoundTrip) {
  FakeWorld world;
  Limits limits = golden_limits();  // max_exited_processes 1
  Collector original(limits, world.env());
  Connection live(original, world.spawn(10, 1, "train", 7));
  ASSERT_FALSE(live.identity("llama", 1, 1, 4));
  ASSERT_FALSE(live.events({start(1, 0, 0), start(1, 2, 10), end(1, 2, 30), end(1, 0, 100)}));
  for (std::int32_t pid : {11, 12}) {  // the first is evicted by the second's exit
    Connection c(original, world.spawn(pid, 1, "train", 7));
    ASSERT_FALSE(c.identity("llama", 0, 0, 4));
    ASSERT_FALSE(c.events({start(1, 0, 0), end(1, 0, 50)}));
    world.kill(pid);
    c.close();
  }
  const json first = encode_snapshot(*original.freeze());
  ASSERT_EQ(first.at("retired_jobs").size(), 1u) << first.dump();
  EXPECT_EQ(first["retired_jobs"][0]["job"], "llama");
  EXPECT_EQ(first["retired_jobs"][0]["steps"][0]["total_ns"], 50);
  // Its per-rank totals too (the evicted process was rank 0).
  ASSERT_EQ(first["retired_jobs"][0]["ranks"].size(), 1u) << first.dump();
  EXPECT_EQ(first["retired_jobs"][0]["ranks"][0]["rank"], 0);
  EXPECT_EQ(first["retired_jobs"][0]["ranks"][0]["steps"][0]["total_ns"], 50);

  std::string error;
  auto decoded = decode_snapshot(json::parse(first.dump()), limits, error);
  ASSERT_TRUE(decoded) << error;
  Collector restored(limits, world.env());
  ASSERT_FALSE(restored.adopt(std::move(*decoded)));
  EXPECT_EQ(encode_snapshot(*restored.freeze()), first);
  const json r = report::report_json(*restored.freeze(), std::nullopt);
  ASSERT_FALSE(r["processes"].empty());
  EXPECT_EQ(r["processes"][0]["job"], "llama");
  EXPECT_EQ(r["processes"][0]["rank"], 1);
  EXPECT_EQ(r["processes"][0]["world_size"], 4);
  EXPECT_EQ(r["processes"][0]["steps"][0]["self_ns"], 80);
  // Per-job counters carry on from the restored totals: 100 + 50 + 50 ns of Forward.
  EXPECT_NE(report::metrics_text(*restored.freeze())
                .find("steptrace_job_step_seconds_total{job_id=\"llama\",uid=\"7\","
                      "step=\"Forward\"} 2e-07\n"),
            std::string::npos)
      << report::metrics_text(*restored.freeze());
  // And per rank: rank 0's spans of its evicted process and of the one still there.
  EXPECT_NE(report::metrics_text(*restored.freeze())
                .find("steptrace_job_rank_step_spans_total{job_id=\"llama\",uid=\"7\","
                      "rank=\"0\",step=\"Forward\"} 2\n"),
            std::string::npos)
      << report::metrics_text(*restored.freeze());

  const auto refused = [&](auto&& mutate) {
    json d = first;
    mutate(d);
    return decode_error(d);
  };
  EXPECT_NE(refused([](json& d) { d["processes"][0]["rank"] = 4; }), "");  // world of 4
  EXPECT_NE(refused([](json& d) { d["processes"][0]["job"] = "a\nb"; }), "");
  EXPECT_NE(refused([](json& d) { d["processes"][0]["steps"][0]["self_ns"] = 101; }), "");
  EXPECT_NE(refused([](json& d) { d["retired_jobs"].push_back(d["retired_jobs"][0]); }), "");
  EXPECT_NE(refused([](json& d) { d["retired_jobs"][0]["steps"][0]["self_ns"] = 51; }), "");
  EXPECT_EQ(refused([](json& d) { d.erase("retired_jobs"); }), "");  // older snapshots
  EXPECT_EQ(refused([](json& d) { d["retired_jobs"][0].erase("ranks"); }), "");
  EXPECT_EQ(refused([](json& d) {
              d["retired_jobs"][0]["ranks"].push_back(d["retired_jobs"][0]["ranks"][0]);
            }),
            "retired_jobs[0].ranks[1].rank: rank 0 appears twice");
  EXPECT_NE(refused([](json& d) { d["retired_jobs"][0]["ranks"][0]["steps"][0]["self_ns"] = 51; }),
            "");
}

// A job that still has a process in the table keeps its retired totals past max_jobs
// (collector_liveness.cpp, enforce_job_limits): a snapshot holding more retired jobs than that
// limit is the daemon's own and restores.
TEST(SnapshotCodecTest, RetiredJobsOfLiveJobsBeyondMaxJobsRestore) {
  FakeWorld world;
  Limits limits = golden_limits();
  limits.max_exited_processes = 0;  // evicted at once
  limits.max_jobs = 1;
  limits.max_jobs_per_uid = 1;
  Collector original(limits, world.env());
  std::vector<std::unique_ptr<Connection>> live;
  for (std::int32_t job = 0; job < 3; ++job) {
    // Rank 1 of each job keeps running; rank 0 exits and leaves the table.
    const std::string name = "job" + std::to_string(job);
    live.push_back(std::make_unique<Connection>(original, world.spawn(100 + job, 1, "t", 7)));
    ASSERT_FALSE(live.back()->identity(name, 1, 1, 2));
    Connection c(original, world.spawn(200 + job, 1, "t", 7));
    ASSERT_FALSE(c.identity(name, 0, 0, 2));
    ASSERT_FALSE(c.events({start(1, 0, 0), end(1, 0, 50)}));
    world.kill(200 + job);
    c.close();
  }
  const json saved = encode_snapshot(*original.freeze());
  ASSERT_EQ(saved.at("retired_jobs").size(), 3u) << saved.dump();  // > max_jobs, all live
  std::string error;
  auto decoded = decode_snapshot(json::parse(saved.dump()), limits, error);
  ASSERT_TRUE(decoded) << error;
  Collector restored(limits, world.env());
  ASSERT_FALSE(restored.adopt(std::move(*decoded)));
  EXPECT_EQ(encode_snapshot(*restored.freeze()), saved);
}

TEST(SnapshotCodecTest, ABadHistogramIsNamedByItsPath) {
  const json good = json::parse(golden_text());
  ASSERT_EQ(decode_error(good), "");
  json d = good;
  d["processes"][0]["steps"][1]["histogram"]["prom"].erase(0);
  EXPECT_EQ(decode_error(d),
            "processes[0].steps[1].histogram.prom: must be an array of 23 elements");
  d = good;
  d["processes"][1]["steps"][0]["histogram"]["buckets"][0][0] = 5000;
  EXPECT_EQ(decode_error(d),
            "processes[1].steps[0].histogram.buckets[0][0]: must be an integer in 0..1919");
  d = good;
  d["retired"][1]["histogram"]["count"] = 2;
  EXPECT_EQ(decode_error(d), "retired[1].histogram: bucket counts do not add up to count");
  d = good;
  d["retired"][0]["histogram"]["mean_ns"] = 1;
  EXPECT_EQ(decode_error(d), "retired[0].histogram.mean_ns: unknown key");
}

TEST(SnapshotCodecTest, ABadLedgerFieldIsNamedByItsPath) {
  const json good = json::parse(golden_text());
  json d = good;
  d["ledger"]["gpus"][0]["reservations"][0]["bytes"] = 0;
  EXPECT_EQ(decode_error(d),
            "ledger.gpus[0].reservations[0].bytes: must be an integer in 1..18446744073709551615");
  d = good;
  d["ledger"]["gpus"][1]["processes"][0]["comm"] = "bad\ncomm";
  EXPECT_EQ(
      decode_error(d),
      "ledger.gpus[1].processes[0].comm: must be a string of at most 63 printable characters");
  d = good;
  d["ledger"]["gpus"][0]["reservations"][0]["uid"] = -1;
  EXPECT_EQ(decode_error(d),
            "ledger.gpus[0].reservations[0].uid: must be an integer in 0..4294967295");
  d = good;
  d["ledger"]["gpus"][0]["creator_uid"] = "root";
  EXPECT_EQ(decode_error(d), "ledger.gpus[0].creator_uid: must be an integer in 0..4294967295");
  d = good;
  d["ledger"]["gpus"][0]["processes"][0]["refused"] = 1.5;
  EXPECT_EQ(decode_error(d), "ledger.gpus[0].processes[0].refused: must be an unsigned integer");
  d = good;
  d["ledger"]["anomalies"]["made_up"] = 1;
  EXPECT_EQ(decode_error(d), "ledger.anomalies.made_up: unknown key");

  // And the collector refuses it whole, with the snapshot code.
  FakeWorld world;
  Collector c(golden_limits(), world.env());
  EXPECT_EQ(restore_from_snapshot(c, d), make_error_code(errc::bad_snapshot));
  EXPECT_EQ(report::report_json(*c.freeze(), std::nullopt)["processes"].size(), 0u);
}

// ---- the histogram section ---------------------------------------------------------------

TEST(SnapshotCodecHistogramTest, RoundTrip) {
  Histogram h;
  for (std::uint64_t v : {5u, 700u, 70'000u, 7'000'000u, 7'000'000u}) h.record(v);
  std::string error;
  auto back = decode_histogram(json::parse(encode_histogram(h).dump()), error);
  ASSERT_TRUE(back) << error;
  EXPECT_EQ(encode_histogram(*back), encode_histogram(h));
  EXPECT_EQ(back->percentile(0.5), h.percentile(0.5));
  EXPECT_EQ(back->prom_buckets(), h.prom_buckets());
  // The layout: totals, [index, count] pairs and the Prometheus buckets.
  const json j = encode_histogram(h);
  EXPECT_EQ(j["count"], 5);
  EXPECT_EQ(j["min_ns"], 5);
  EXPECT_EQ(j["buckets"][0], json({5, 1}));
  EXPECT_EQ(j["prom"].size(), Histogram::kPromBuckets);
}

TEST(SnapshotCodecHistogramTest, CountsPastTwoToTheThirtyTwoSurvive) {
  const std::uint64_t big = 5'000'000'000;  // > 2^32
  const unsigned index = Histogram::bucket_index(1000);
  std::vector<std::uint64_t> prom(Histogram::kPromBuckets, 0);
  prom[0] = big + 1;
  const json j = {{"count", big + 1}, {"sum_ns", big * 1000 + 7},          {"min_ns", 7},
                  {"max_ns", 1000},   {"buckets", {{7, 1}, {index, big}}}, {"prom", prom}};
  std::string error;
  auto h = decode_histogram(j, error);
  ASSERT_TRUE(h) << error;
  EXPECT_EQ(encode_histogram(*h), j);
  EXPECT_EQ(h->count(), big + 1);
}

TEST(SnapshotCodecHistogramTest, ErrorsNameTheField) {
  Histogram h;
  for (std::uint64_t v : {5u, 700u, 70'000u, 7'000'000u, 7'000'000u}) h.record(v);
  const json good = encode_histogram(h);
  using Mutation = std::function<void(json&)>;
  const std::vector<std::pair<std::string, Mutation>> cases = {
      {"must be an object", [](json& d) { d = json::array(); }},
      {"count: missing", [](json& d) { d.erase("count"); }},
      {"min_ns: must be an unsigned integer", [](json& d) { d["min_ns"] = -1; }},
      {"extra: unknown key", [](json& d) { d["extra"] = 0; }},
      {"prom: must be an array of 23 elements",
       [](json& d) {
         d["prom"] = {1, 2};
       }},
      {"prom[3]: must be an unsigned integer", [](json& d) { d["prom"][3] = "x"; }},
      {"buckets: must be an array of at most 1920 elements", [](json& d) { d["buckets"] = 1; }},
      {"buckets[4]: must be an array of 2 elements", [](json& d) { d["buckets"].push_back({1}); }},
      {"buckets[4][0]: must be an integer in 0..1919",
       [](json& d) {
         d["buckets"].push_back({Histogram::kBuckets, 1});
       }},
      {"buckets[0][1]: must be an integer in 1..18446744073709551615",
       [](json& d) { d["buckets"][0][1] = 0; }},
      {"bucket counts do not add up to count", [](json& d) { d["count"] = 6; }},
      {"bucket indices must be increasing, below 1920, with nonzero counts",
       [](json& d) { std::swap(d["buckets"][0], d["buckets"][1]); }},
      {"min_ns > max_ns", [](json& d) { d["min_ns"] = 8'000'000; }},
  };
  for (const auto& [expected, mutate] : cases) {
    json d = good;
    mutate(d);
    std::string error;
    EXPECT_FALSE(decode_histogram(d, error)) << expected;
    EXPECT_EQ(error, expected);
  }
}

// ---- the ledger section ------------------------------------------------------------------

using namespace ledger_test;

class SnapshotCodecLedgerTest : public ::testing::Test {
 protected:
  Limits limits_;
  DaemonCounters counters_;
  LedgerView view_{limits_, counters_};
  const LedgerActor a_{{1001, 5001}, "trainer-a"};
  const LedgerActor b_{{1002, 5002}, "trainer-b"};
};

TEST_F(SnapshotCodecLedgerTest, RestoresIntoAFreshViewIdentically) {
  populate(view_, a_, b_);
  // Through text, as the snapshot file goes.
  const json doc = json::parse(encode_ledger(view_).dump());
  std::string error;
  auto state = decode_ledger(doc, limits_, error);
  ASSERT_TRUE(state) << error;

  DaemonCounters counters;
  LedgerView fresh(limits_, counters);
  fresh.adopt(std::move(*state), kNow);
  EXPECT_EQ(report::ledger_json(fresh.state(), kNow), report::ledger_json(view_.state(), kNow));
  EXPECT_EQ(report::ledger_anomalies_json(fresh.state()),
            report::ledger_anomalies_json(view_.state()));
  EXPECT_EQ(report::ledger_text(fresh.state(), kNow), report::ledger_text(view_.state(), kNow));
  std::string m1, m2;
  report::append_ledger_metrics(view_.state(), m1);
  report::append_ledger_metrics(fresh.state(), m2);
  EXPECT_EQ(m2, m1);
  EXPECT_EQ(encode_ledger(fresh), encode_ledger(view_));
  // The restored view keeps working: a release of the restored entry applies.
  fresh.apply(a_, release("GPU-A", 2, 30 * kSecond), kNow);
  EXPECT_EQ(report::ledger_json(fresh.state(), kNow)["gpus"][0]["reserved_bytes"], 3 * kGiB);
  // And the overcommit state was rebuilt, not re-counted.
  EXPECT_EQ(report::ledger_anomalies_json(fresh.state())["overcommitted"],
            report::ledger_anomalies_json(view_.state())["overcommitted"]);
  EXPECT_EQ(report::ledger_json(view_.state(), kNow)["gpus"][0]["overcommitted"], true);
}

TEST_F(SnapshotCodecLedgerTest, AdoptDropsAttributionMarks) {
  view_.apply(a_, reserve("GPU-A", 1, kGiB, "t", 10 * kSecond, 5), kNow);
  std::string error;
  auto state = decode_ledger(encode_ledger(view_), limits_, error);
  ASSERT_TRUE(state) << error;
  LedgerView fresh(limits_, counters_);
  fresh.adopt(std::move(*state), kNow);
  // The mark of thread 5 inside this span would have credited GPU-A; after a restore
  // there is none, so nothing is attributed.
  fresh.attribute_span(a_.key, 5, kLedgerReserve, 9 * kSecond, 11 * kSecond);
  EXPECT_EQ(report::ledger_json(fresh.state(), kNow)["gpus"][0]["steps"].size(), 0u);
}

TEST_F(SnapshotCodecLedgerTest, RejectsMalformedSectionsNamingTheField) {
  populate(view_, a_, b_);
  const json good = encode_ledger(view_);
  ASSERT_EQ(good["gpus"][0]["reservations"].size(), 2u);

  using Mutation = std::function<void(json&)>;
  const std::vector<std::pair<std::string, Mutation>> mutations = {
      {"must be an object", [](json& d) { d = json::array(); }},
      {"version: ledger version 2 is not one this build reads", [](json& d) { d["version"] = 2; }},
      {"version: must be an unsigned integer", [](json& d) { d["version"] = "1"; }},
      {"gpus: missing", [](json& d) { d.erase("gpus"); }},
      {"extra: unknown key", [](json& d) { d["extra"] = 1; }},
      {"gpus: must be an array of at most 64 elements",
       [](json& d) { d["gpus"] = json::object(); }},
      {"gpus[0].gpu: must be a string of 1..63 printable characters",
       [](json& d) { d["gpus"][0]["gpu"] = ""; }},
      {"gpus[0].gpu: must be a string of 1..63 printable characters",
       [](json& d) { d["gpus"][0]["gpu"] = std::string(64, 'x'); }},
      {"gpus[0].gpu: must be a string of 1..63 printable characters",
       [](json& d) { d["gpus"][0]["gpu"] = "GPU-\n"; }},
      {"gpus[1].gpu: \"GPU-A\" appears twice",
       [](json& d) { d["gpus"][1]["gpu"] = d["gpus"][0]["gpu"]; }},
      {"gpus[0].x: unknown key", [](json& d) { d["gpus"][0]["x"] = 0; }},
      {"gpus[0].reservations[1].id: reservation 1 appears twice",
       [](json& d) {
         d["gpus"][0]["reservations"][1]["id"] = d["gpus"][0]["reservations"][0]["id"];
       }},
      {"gpus[0].reservations[0].bytes: must be an integer in 1..18446744073709551615",
       [](json& d) { d["gpus"][0]["reservations"][0]["bytes"] = 0; }},
      {"gpus[0].reservations[0].bytes: must be an integer in 1..18446744073709551615",
       [](json& d) { d["gpus"][0]["reservations"][0]["bytes"] = -1; }},
      {"gpus[0].reservations[0].bytes: must be an integer in 1..18446744073709551615",
       [](json& d) { d["gpus"][0]["reservations"][0]["bytes"] = 1.5; }},
      {"gpus[0].reservations[0].bytes: must be an integer in 1..18446744073709551615",
       [](json& d) { d["gpus"][0]["reservations"][0]["bytes"] = "1"; }},
      {"gpus[0].reservations[0].pid: must be an integer in 1..2147483647",
       [](json& d) { d["gpus"][0]["reservations"][0]["pid"] = 0; }},
      {"gpus[0].reservations[0].pid: must be an integer in 1..2147483647",
       [](json& d) { d["gpus"][0]["reservations"][0]["pid"] = 1ll << 40; }},
      {"gpus[0].reservations[0].holder_alive: must be a boolean",
       [](json& d) { d["gpus"][0]["reservations"][0]["holder_alive"] = 1; }},
      {"gpus[0].reservations[0].task: must be a string of at most 63 printable characters",
       [](json& d) { d["gpus"][0]["reservations"][0]["task"] = std::string(80, 't'); }},
      {"gpus[0].reservations[1].bytes: the GPU's reservations add up to more than 2^64-1 bytes",
       [](json& d) { d["gpus"][0]["reservations"][0]["bytes"] = ~std::uint64_t{0}; }},
      {"gpus[0].high_water_bytes: is below the bytes the reservations hold",
       [](json& d) { d["gpus"][0]["high_water_bytes"] = 1; }},
      {"gpus[0].sample.free_bytes: exceeds total_bytes",
       [](json& d) { d["gpus"][0]["sample"]["free_bytes"] = 100 * kGiB; }},
      {"gpus[0].sample.total_bytes: must be an integer in 1..18446744073709551615",
       [](json& d) { d["gpus"][0]["sample"]["total_bytes"] = 0; }},
      {"gpus[0].sample.at_ns: missing", [](json& d) { d["gpus"][0]["sample"].erase("at_ns"); }},
      {"gpus[0].operations.cleanup: missing",
       [](json& d) { d["gpus"][0]["operations"].erase("cleanup"); }},
      {"gpus[0].processes[0].steps[0].step: \"Nope\" is not a ledger step",
       [](json& d) { d["gpus"][0]["processes"][0]["steps"][0]["step"] = "Nope"; }},
      {"gpus[0].processes[0].steps[0].step: \"Forward\" is not a ledger step",
       [](json& d) { d["gpus"][0]["processes"][0]["steps"][0]["step"] = "Forward"; }},
      {"gpus[0].steps[0].step: \"Forward\" is not a ledger step",
       [](json& d) { d["gpus"][0]["steps"][0]["step"] = "Forward"; }},
      {"gpus[0].steps: must be an array of at most 12 elements",
       [](json& d) { d["gpus"][0]["steps"] = 1; }},
      {"gpus[0].steps[2].step: \"LedgerReserve\" appears twice",
       [](json& d) { d["gpus"][0]["steps"].push_back(d["gpus"][0]["steps"][0]); }},
      {"gpus[0].processes[1].pid: process 1001 appears twice",
       [](json& d) { d["gpus"][0]["processes"][1] = d["gpus"][0]["processes"][0]; }},
      {"anomalies.made_up: unknown key", [](json& d) { d["anomalies"]["made_up"] = 1; }},
      {"anomalies.unknown_release: must be an unsigned integer",
       [](json& d) { d["anomalies"]["unknown_release"] = -3; }},
  };
  for (const auto& [expected, mutate] : mutations) {
    SCOPED_TRACE(expected);
    json doc = good;
    mutate(doc);
    ASSERT_NE(doc, good);
    std::string error;
    EXPECT_FALSE(decode_ledger(doc, limits_, error));
    EXPECT_EQ(error, expected);
  }
  // The unmutated section decodes.
  std::string error;
  EXPECT_TRUE(decode_ledger(good, limits_, error)) << error;
}

TEST_F(SnapshotCodecLedgerTest, LimitsBoundWhatASectionMayHold) {
  populate(view_, a_, b_);
  const json good = encode_ledger(view_);
  Limits small = limits_;
  small.max_gpus = 1;
  std::string error;
  EXPECT_FALSE(decode_ledger(good, small, error));
  EXPECT_EQ(error, "gpus: must be an array of at most 1 elements");
  small = limits_;
  small.max_reservations_per_gpu = 1;
  EXPECT_FALSE(decode_ledger(good, small, error));
  EXPECT_EQ(error, "gpus[0].reservations: must be an array of at most 1 elements");
}

// What a restart must not forget of the shared view (issue 26): whose each row is, when
// its process was seen gone, and who established a GPU's total.
class SnapshotCodecLedgerRestartTest : public ::testing::Test {
 protected:
  // The view through a snapshot (as text, as the file goes) into a fresh one at `now`.
  void restart(std::uint64_t now_ns) {
    std::string error;
    auto state = decode_ledger(json::parse(encode_ledger(*view_).dump()), limits_, error);
    ASSERT_TRUE(state) << error;
    view_ = std::make_unique<LedgerView>(limits_, counters_);
    view_->adopt(std::move(*state), now_ns);
  }
  // The liveness tick: the processes in `gone` have exited.
  std::size_t tick(const std::set<ProcessKey>& gone, std::uint64_t now_ns) {
    return view_->age_rows([&](const ProcessKey& k) { return !gone.contains(k); }, now_ns);
  }
  const ledger::ProcessRow* row(const LedgerActor& a) const {
    const auto& rows = view_->state().gpus.at("GPU-A").processes;
    const auto it = rows.find(a.key);
    return it == rows.end() ? nullptr : &it->second;
  }
  std::uint64_t anomaly(ledger::Anomaly kind) const { return view_->state().anomalies[kind]; }

  Limits limits_;
  DaemonCounters counters_;
  std::unique_ptr<LedgerView> view_ = std::make_unique<LedgerView>(limits_, counters_);
  const LedgerActor alice_{{10, 1}, "alice", 1000};
  const LedgerActor bob_{{20, 2}, "bob", 1001};
};

TEST_F(SnapshotCodecLedgerRestartTest, TheOwnersOfRowsAndOfTheTotalSurviveARestart) {
  view_->apply(alice_, sample("GPU-A", 8 * kGiB, 16 * kGiB, kSecond), kNow);
  view_->apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_->apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_->apply(bob_, release("GPU-A", 2, kSecond), kNow);  // bob's row holds nothing now
  restart(kNow + kSecond);
  ASSERT_NE(row(bob_), nullptr);
  EXPECT_EQ(row(bob_)->uid, bob_.uid);  // not from a reservation: kept by the snapshot
  EXPECT_EQ(row(alice_)->uid, alice_.uid);
  const ledger::Gpu& gpu = view_->state().gpus.at("GPU-A");
  EXPECT_EQ(gpu.client_total, 16 * kGiB);
  EXPECT_EQ(gpu.client_total_uid, alice_.uid);

  // Another uid may neither release alice's reservation nor contradict her total.
  view_->apply(bob_, release("GPU-A", 1, 2 * kSecond), kNow + kSecond);
  EXPECT_EQ(anomaly(ledger::kReleaseRefused), 1u);
  EXPECT_EQ(row(bob_)->refused, 1u);
  EXPECT_TRUE(view_->state().gpus.at("GPU-A").reservations.contains(1));
  view_->apply(bob_, sample("GPU-A", 1, 2, 2 * kSecond), kNow + kSecond);
  EXPECT_EQ(anomaly(ledger::kVramTotalMismatch), 1u);
  EXPECT_EQ(view_->state().gpus.at("GPU-A").client_total, 16 * kGiB);
  // Alice, who established it, still may correct it (owned by no uid, she could not).
  view_->apply(alice_, sample("GPU-A", 8 * kGiB, 24 * kGiB, 3 * kSecond), kNow + kSecond);
  EXPECT_EQ(anomaly(ledger::kVramTotalMismatch), 1u);
  EXPECT_EQ(view_->state().gpus.at("GPU-A").client_total, 24 * kGiB);
}

TEST_F(SnapshotCodecLedgerRestartTest, AnExitedProcesssRowAgesOnAcrossARestart) {
  limits_.max_ledger_row_age_s = 100;
  view_->apply(alice_, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_->apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  tick({bob_.key}, kNow);  // bob's process seen gone at kNow
  restart(kNow + 60 * kSecond);
  ASSERT_NE(row(bob_), nullptr);
  EXPECT_EQ(row(bob_)->exited_ns, kNow);
  // Gone max_ledger_row_age_s after it was seen exited, not after the restart.
  EXPECT_EQ(tick({bob_.key}, kNow + 99 * kSecond), 0u);
  EXPECT_EQ(tick({bob_.key}, kNow + 100 * kSecond), 1u);
  EXPECT_EQ(row(bob_), nullptr);
  EXPECT_NE(row(alice_), nullptr);
}

TEST_F(SnapshotCodecLedgerRestartTest, AnExitTimeOfAFormerBootAgesFromTheRestore) {
  limits_.max_ledger_row_age_s = 100;
  view_->apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  tick({bob_.key}, 1000 * kSecond);
  // The machine rebooted: the monotonic clock is far below the exit time kept.
  restart(kSecond);
  ASSERT_NE(row(bob_), nullptr);
  EXPECT_EQ(row(bob_)->exited_ns, kSecond);
  EXPECT_EQ(tick({}, 100 * kSecond), 0u);
  EXPECT_EQ(tick({}, 101 * kSecond), 1u);
}

TEST_F(SnapshotCodecLedgerRestartTest, RestoredRowsCountAgainstTheirUidsCap) {
  limits_.max_ledger_rows_per_uid = 2;
  const LedgerActor c0{{30, 3}, "c0", 1002}, c1{{31, 3}, "c1", 1002}, c2{{32, 3}, "c2", 1002};
  view_->apply(c0, reserve("GPU-A", 1, kGiB, "t", kSecond), kNow);
  view_->apply(c0, release("GPU-A", 1, kSecond), kNow);  // a row without a reservation
  view_->apply(c1, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  restart(kNow);
  // c0's row is still the uid's: c2 finds the uid at its cap (both rows live) and gets none.
  view_->apply(c2, reserve("GPU-A", 3, kGiB, "t", kSecond), kNow);
  EXPECT_EQ(row(c2), nullptr);
  EXPECT_TRUE(view_->state().gpus.at("GPU-A").reservations.contains(3));
  EXPECT_EQ(anomaly(ledger::kMaxLedgerRowsPerUid), 1u);
  EXPECT_EQ(counters_.limits_hit["max_ledger_rows_per_uid"], 1u);
  // Another uid is not affected.
  view_->apply(alice_, reserve("GPU-A", 4, kGiB, "t", kSecond), kNow);
  EXPECT_NE(row(alice_), nullptr);
}

TEST_F(SnapshotCodecLedgerRestartTest, OlderSnapshotsRestoreAsBefore) {
  view_->apply(alice_, sample("GPU-A", 8 * kGiB, 16 * kGiB, kSecond), kNow);
  view_->apply(bob_, reserve("GPU-A", 2, kGiB, "t", kSecond), kNow);
  view_->apply(bob_, release("GPU-A", 2, kSecond), kNow);
  tick({bob_.key}, kNow);
  json doc = encode_ledger(*view_);
  json& gpu = doc["gpus"][0];
  gpu.erase("client_total_bytes");
  gpu.erase("client_total_uid");
  for (json& p : gpu["processes"]) {
    p.erase("uid");
    p.erase("exited_ns");
  }
  std::string error;
  auto state = decode_ledger(doc, limits_, error);
  ASSERT_TRUE(state) << error;
  view_ = std::make_unique<LedgerView>(limits_, counters_);
  view_->adopt(std::move(*state), kNow);
  // The sample's total, established by no uid; bob's row of no uid, alive until the
  // next liveness check.
  EXPECT_EQ(view_->state().gpus.at("GPU-A").client_total, 16 * kGiB);
  EXPECT_EQ(view_->state().gpus.at("GPU-A").client_total_uid, kUnknownUid);
  EXPECT_EQ(row(bob_)->uid, kUnknownUid);
  EXPECT_EQ(row(bob_)->exited_ns, 0u);

  // A uid without the bytes it is the uid of is refused.
  json bad = encode_ledger(*view_);
  bad["gpus"][0]["client_total_bytes"] = 0;
  bad["gpus"][0]["client_total_uid"] = 1000;
  EXPECT_FALSE(decode_ledger(bad, limits_, error));
  EXPECT_EQ(error, "gpus[0].client_total_uid: a uid without a client_total_bytes");
}

TEST_F(SnapshotCodecLedgerTest, AnomalyKindsMissingFromOlderSnapshotsAreZero) {
  populate(view_, a_, b_);
  json doc = encode_ledger(view_);
  ASSERT_GT(doc["anomalies"]["unknown_release"], 0);
  doc["anomalies"].erase("attribution_threads_full");
  doc["anomalies"].erase("unknown_release");
  std::string error;
  auto state = decode_ledger(doc, limits_, error);
  ASSERT_TRUE(state) << error;
  EXPECT_EQ(state->anomalies[ledger::kUnknownRelease], 0u);
  EXPECT_EQ(state->anomalies[ledger::kOvercommitted], 1u);
}

}  // namespace
}  // namespace steptrace::daemon
