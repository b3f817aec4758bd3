// Snapshots: Collector::snapshot()/restore() round trips and validation, and the file
// persistence in daemon/persist/snapshot.h (atomic write, corrupt file moved aside).
#include "daemon/persist/snapshot.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "daemon/state/collector.h"
#include "tests/daemon/daemon_test_util.h"
#include "tests/support/daemon_process.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;

// report_json without the fields that depend on wall time or live connections.
json comparable(json report) {
  report["daemon"].erase("uptime_s");
  report["daemon"].erase("clients_connected");
  return report;
}

// A collector with a bit of everything: live and exited processes, custom steps,
// drops, unmatched ends, abandoned spans, a ledger reservation.
void populate(Collector& c, FakeWorld& world) {
  Connection a(c, world.spawn(4242, 100, "python3"));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.events({start(1, 0, 0), end(1, 0, 1500), start(1, 256, 0), end(1, 256, 90'000),
                         end(2, 2, 10), start(1, 7, 100)}));
  a.ledger(test::reserve_record("GPU-1", 9, 1 << 20, "qlora-7b", 1, 150));
  ASSERT_FALSE(a.events({end(1, 7, 400)}));
  a.dropped(11);
  a.dropped_by_cause({{3, 9, 1, 2}});  // 15 in all
  {
    Connection b(c, world.spawn(5000, 200, "trainer"));
    ASSERT_FALSE(b.register_step(300, "Tokenize"));
    ASSERT_FALSE(b.events({start(3, 300, 0), end(3, 300, 7), start(3, 1, 0)}));
    world.kill(5000);
    world.now_ns += 10;
  }           // exited, with an abandoned Backward span
  a.close();  // still running: alive without a connection
}

TEST(SnapshotTest, RestoreIntoANewCollectorGivesTheSameReport) {
  FakeWorld world;
  Collector original(Limits{}, world.env());
  populate(original, world);
  const json doc = original.snapshot();
  EXPECT_EQ(doc["schema"], kSnapshotSchema);

  Collector restored(Limits{}, world.env());
  ASSERT_FALSE(restored.restore(doc));
  EXPECT_EQ(comparable(restored.report_json(std::nullopt)),
            comparable(original.report_json(std::nullopt)));
  EXPECT_EQ(restored.ledger_json(), original.ledger_json());
  EXPECT_EQ(restored.counters().events_received, original.counters().events_received);
  // And through text, as a file would carry it.
  Collector again(Limits{}, world.env());
  ASSERT_FALSE(again.restore(json::parse(doc.dump())));
  EXPECT_EQ(again.report_text(std::nullopt), original.report_text(std::nullopt));
  // The restored collector keeps working: the process reconnects and records more.
  Connection a(restored, world.spawn(4242, 100, "python3"));
  ASSERT_FALSE(a.events({start(1, 256, 0), end(1, 256, 10)}));  // custom id still registered
  const json totals = restored.report_json(4242)["totals"];
  const auto tokenize = std::find_if(totals.begin(), totals.end(),
                                     [](const json& t) { return t["step"] == "Tokenize"; });
  ASSERT_NE(tokenize, totals.end());
  EXPECT_EQ((*tokenize)["count"], 2);
}

TEST(SnapshotTest, RestoreRechecksLiveness) {
  FakeWorld world;
  Collector original(Limits{}, world.env());
  populate(original, world);
  const json doc = original.snapshot();
  world.kill(4242);  // died while the daemon was down
  Collector restored(Limits{}, world.env());
  ASSERT_FALSE(restored.restore(doc));
  const json r = restored.report_json(4242);
  EXPECT_EQ(r["processes"][0]["alive"], false);
  // Its reservation is now flagged as held by a dead process.
  EXPECT_EQ(restored.ledger_json()["gpus"][0]["reservations"][0]["holder_alive"], false);
}

TEST(SnapshotTest, OpenSpansBecomeAbandonedInTheSnapshot) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  Connection a(c, world.spawn(1, 1, "a"));
  ASSERT_FALSE(a.events({start(1, 0, 0)}));
  const json doc = c.snapshot();
  Collector restored(Limits{}, world.env());
  ASSERT_FALSE(restored.restore(doc));
  const json step = restored.report_json(std::nullopt)["processes"][0]["steps"][0];
  EXPECT_EQ(step["open"], 0);
  EXPECT_EQ(step["abandoned"], 1);
}

TEST(SnapshotTest, RestoreRejectsBadDocumentsAndLeavesStateUnchanged) {
  FakeWorld world;
  Collector source(Limits{}, world.env());
  populate(source, world);
  const json good = source.snapshot();

  Collector target(Limits{}, world.env());
  {
    Connection c(target, world.spawn(77, 1, "keep"));
    ASSERT_FALSE(c.events({start(1, 0, 0), end(1, 0, 5)}));
  }
  const json before = comparable(target.report_json(std::nullopt));

  std::vector<std::pair<std::string, json>> bad;
  bad.emplace_back("not an object", json::array());
  json d = good;
  d["schema"] = "steptrace.report/v1";
  bad.emplace_back("wrong schema", d);
  d = good;
  d["version"] = 2;
  bad.emplace_back("unknown version", d);
  d = good;
  d.erase("processes");
  bad.emplace_back("no processes", d);
  d = good;
  d["processes"].push_back(d["processes"][0]);
  bad.emplace_back("duplicate process", d);
  d = good;
  d["processes"][0]["pid"] = -5;
  bad.emplace_back("negative pid", d);
  d = good;
  d["processes"][0]["comm"] = 12;
  bad.emplace_back("comm not a string", d);
  d = good;
  d["processes"][0]["steps"][0]["histogram"]["count"] = 999;
  bad.emplace_back("histogram does not add up", d);
  d = good;
  d["processes"][0]["steps"][0]["id"] = 900;
  bad.emplace_back("unregistered custom step", d);
  d = good;
  d["processes"][0]["custom_steps"][0]["name"] = "bad\nname";
  bad.emplace_back("unprintable step name", d);
  d = good;
  d["processes"][0]["custom_steps"].push_back(d["processes"][0]["custom_steps"][0]);
  bad.emplace_back("custom id twice", d);
  d = good;
  d.erase("ledger");
  bad.emplace_back("no ledger", d);
  d = good;
  d["ledger"] = "nope";
  bad.emplace_back("bad ledger", d);
  d = good;
  d["counters"]["events_received"] = "many";
  bad.emplace_back("bad counter", d);
  d = good;
  d["processes"][0]["dropped_by_cause"]["in_flight"] = -1;
  bad.emplace_back("negative drop cause", d);
  d = good;
  d["processes"][0]["dropped_by_cause"].erase("invalid");
  bad.emplace_back("a drop cause missing", d);
  d = good;
  d["counters"]["events_dropped_by_cause"] = json::array();
  bad.emplace_back("drop causes not an object", d);

  for (const auto& [what, doc] : bad) {
    EXPECT_EQ(target.restore(doc), make_error_code(errc::bad_config)) << what;
    EXPECT_EQ(comparable(target.report_json(std::nullopt)), before) << what;
  }
}

TEST(SnapshotTest, SnapshotsFromBeforeDropCausesRestoreWithZeros) {
  FakeWorld world;
  Collector source(Limits{}, world.env());
  populate(source, world);
  json doc = source.snapshot();
  EXPECT_EQ(doc["processes"][0]["dropped_by_cause"]["not_connected"], 9);
  for (auto& p : doc["processes"]) p.erase("dropped_by_cause");
  doc["counters"].erase("events_dropped_by_cause");
  Collector restored(Limits{}, world.env());
  ASSERT_FALSE(restored.restore(doc));
  const json p = restored.report_json(4242)["processes"][0];
  EXPECT_EQ(p["dropped"], 15);
  EXPECT_EQ(p["dropped_by_cause"]["not_connected"], 0);
}

TEST(SnapshotTest, RestoreRefusesWhileConnectionsAreAttached) {
  FakeWorld world;
  Collector c(Limits{}, world.env());
  const json doc = c.snapshot();
  Connection a(c, world.spawn(1, 1, "a"));
  EXPECT_TRUE(c.restore(doc));
  EXPECT_EQ(c.report_json(std::nullopt)["processes"].size(), 1u);
}

// ---- files ---------------------------------------------------------------------------

std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(SnapshotFileTest, SaveIsAtomicAndLoadReadsItBack) {
  steptrace::testing::TempDir dir;
  EXPECT_EQ(load_snapshot(dir.path()).status, LoadedSnapshot::Status::kNone);
  FakeWorld world;
  Collector c(Limits{}, world.env());
  populate(c, world);
  const json doc = c.snapshot();
  ASSERT_FALSE(save_snapshot(dir.path(), doc));
  EXPECT_TRUE(std::filesystem::exists(dir.file(kSnapshotFileName)));
  EXPECT_FALSE(std::filesystem::exists(dir.file(std::string(kSnapshotFileName) + ".tmp")));
  const LoadedSnapshot loaded = load_snapshot(dir.path());
  ASSERT_EQ(loaded.status, LoadedSnapshot::Status::kLoaded) << loaded.error;
  EXPECT_EQ(loaded.doc, doc);
  // A second save replaces the first; a leftover temp file from a crash is harmless.
  std::ofstream(dir.file(std::string(kSnapshotFileName) + ".tmp")) << "half a doc";
  json doc2 = doc;
  doc2["written_at_ns"] = 1;
  ASSERT_FALSE(save_snapshot(dir.path(), doc2));
  EXPECT_EQ(load_snapshot(dir.path()).doc, doc2);
  EXPECT_FALSE(std::filesystem::exists(dir.file(std::string(kSnapshotFileName) + ".tmp")));
}

TEST(SnapshotFileTest, SaveIntoAMissingDirectoryFailsAndKeepsNothing) {
  steptrace::testing::TempDir dir;
  const auto missing = std::filesystem::path(dir.path()) / "missing";
  EXPECT_TRUE(save_snapshot(missing, json{{"schema", kSnapshotSchema}}));
  EXPECT_FALSE(std::filesystem::exists(missing));
}

void expect_moved_aside(const std::string& content) {
  steptrace::testing::TempDir dir;
  std::ofstream(dir.file(kSnapshotFileName)) << content;
  const LoadedSnapshot loaded = load_snapshot(dir.path());
  EXPECT_EQ(loaded.status, LoadedSnapshot::Status::kCorrupt);
  EXPECT_FALSE(loaded.error.empty());
  ASSERT_FALSE(loaded.moved_to.empty()) << loaded.error;
  EXPECT_EQ(loaded.moved_to.parent_path(), std::filesystem::path(dir.path()));
  EXPECT_EQ(
      loaded.moved_to.filename().string().rfind(std::string(kSnapshotFileName) + ".corrupt-", 0),
      0u)
      << loaded.moved_to;
  EXPECT_FALSE(std::filesystem::exists(dir.file(kSnapshotFileName)));
  EXPECT_EQ(read(loaded.moved_to), content);  // kept for a human to look at
  // The next start is a fresh one.
  EXPECT_EQ(load_snapshot(dir.path()).status, LoadedSnapshot::Status::kNone);
}

TEST(SnapshotFileTest, CorruptFileIsMovedAside) {
  expect_moved_aside("{\"schema\": \"steptrace.snapshot/v1\", \"processes\": [");
  expect_moved_aside("");
  expect_moved_aside("{\"schema\": \"something.else/v1\"}");
  expect_moved_aside("[1, 2, 3]");
}

TEST(SnapshotFileTest, MoveAsideNeverOverwritesAnEarlierCorruptFile) {
  steptrace::testing::TempDir dir;
  std::ofstream(dir.file(kSnapshotFileName)) << "first";
  const auto first = load_snapshot(dir.path()).moved_to;
  std::ofstream(dir.file(kSnapshotFileName)) << "second";
  const auto second = load_snapshot(dir.path()).moved_to;
  ASSERT_FALSE(first.empty());
  ASSERT_FALSE(second.empty());
  EXPECT_NE(first, second);
  EXPECT_EQ(read(first), "first");
  EXPECT_EQ(read(second), "second");
}

}  // namespace
}  // namespace steptrace::daemon
