// Durations from a hostile tenant (issue 26, item 6): a raw client speaking the wire
// protocol sends spans of about 2^64 ns to the real steptraced. Past limits.max_span_ns
// (a week by default) each is refused when its end arrives, counted (the process's
// `refused` drops, the max_span_ns limit hit, the metrics by cause) and moves no one's
// totals; a span of exactly a week is kept, and another client's figures stay exact.
#include <sys/types.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;

constexpr std::uint64_t kWeekNs = 604'800'000'000'000;

// raw_client's spans start at 1 ms: this one ends at 2^64-1 ns.
constexpr const char* kHugeDur = "18446744073708551615";

// Runs raw_client `good` with `args` to its FlushAck and exit; its pid (-1 on failure).
pid_t run_good(const std::string& socket, std::vector<std::string> args) {
  std::vector<std::string> argv = {RAW_CLIENT_BIN, socket, "good"};
  argv.insert(argv.end(), args.begin(), args.end());
  const pid_t pid = spawn_process(argv);
  return wait_process(pid, 60000) == 0 ? pid : -1;
}

const json* process_of(const json& report, pid_t pid) {
  for (const json& p : report.at("processes")) {
    if (p.at("pid") == pid) return &p;
  }
  return nullptr;
}

TEST(HostileSpans, SpansPastMaxSpanNsAreRefusedCountedAndMoveNoTotal) {
  TempDir dir;
  const std::string socket = dir.file("d.sock");
  DaemonProcess daemon(socket);
  ASSERT_TRUE(daemon.start()) << daemon.log();

  const pid_t innocent = run_good(socket, {"--pairs", "10", "--dur", "1000"});
  // Three processes of the same user, one span each of 2^64 - 1 ms - 1 ns (raw_client's
  // next span would start past 2^64).
  std::vector<pid_t> greedy;
  for (int n = 0; n < 3; ++n)
    greedy.push_back(run_good(socket, {"--pairs", "1", "--dur", kHugeDur}));
  const pid_t week = run_good(socket, {"--pairs", "1", "--dur", std::to_string(kWeekNs)});
  ASSERT_GT(innocent, 0) << daemon.log();
  for (const pid_t pid : greedy) ASSERT_GT(pid, 0) << daemon.log();
  ASSERT_GT(week, 0) << daemon.log();

  const json report = json::parse(command(socket, "report --json").value_or("{}"));
  ASSERT_TRUE(report.contains("processes")) << report.dump();
  for (const pid_t pid : greedy) {
    const json* g = process_of(report, pid);
    ASSERT_NE(g, nullptr) << report.dump();
    EXPECT_EQ(g->at("dropped_by_cause").at("refused"), 2) << g->dump();  // 2 records a span
    EXPECT_EQ(g->at("dropped"), 2);
    EXPECT_EQ(g->at("events"), 0);  // events + dropped: the 2 records it sent
    EXPECT_EQ(g->at("steps"), json::array());
  }

  const json* w = process_of(report, week);
  ASSERT_NE(w, nullptr) << report.dump();
  EXPECT_EQ(w->at("dropped"), 0);
  const json* i = process_of(report, innocent);
  ASSERT_NE(i, nullptr) << report.dump();
  EXPECT_EQ(i->at("dropped"), 0);

  // The shared table: the innocent's ten spans and the week, nothing of the greedy one.
  bool found = false;
  for (const json& t : report.at("totals")) {
    if (t.at("step") != "Forward") continue;
    found = true;
    EXPECT_EQ(t.at("count"), 11);
    EXPECT_EQ(t.at("total_ns"), 10 * 1000 + kWeekNs);
    EXPECT_EQ(t.at("self_ns"), 10 * 1000 + kWeekNs);
    EXPECT_EQ(t.at("processes"), 2);
  }
  EXPECT_TRUE(found) << report.dump();

  const json stats = json::parse(command(socket, "stats --json").value_or("{}"));
  EXPECT_EQ(stats.at("limits_hit").value("max_span_ns", 0), 3) << stats.dump();
  const std::string metrics = command(socket, "metrics").value_or("");
  EXPECT_NE(metrics.find("steptrace_events_dropped_by_clients_by_cause_total{cause=\"refused\"} 6"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("steptrace_limit_hits_total{limit=\"max_span_ns\"} 3"), std::string::npos)
      << metrics;
  EXPECT_EQ(daemon.stop(), 0) << daemon.log();
}

}  // namespace
}  // namespace steptrace::testing
