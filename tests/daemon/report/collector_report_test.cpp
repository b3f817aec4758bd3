// Reports of a Collector fed through its own ingest API (tests/daemon/state/
// collector_driver.h's DirectClient): the text, JSON and Prometheus forms of self time,
// drops by cause and jobs, the per-job series that outlive their processes (read from
// the retired jobs, which the read model does not answer yet), and a frozen view that
// renders the same while ingest goes on. The figures themselves are tested through the
// read model in tests/daemon/state/collector_test.cpp.
#include <gtest/gtest.h>

#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "daemon/report/report.h"
#include "daemon/state/collector.h"
#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using test::DirectClient;
using test::end;
using test::FakeWorld;
using test::start;

constexpr std::uint32_t kForward = 0, kBackward = 1, kMatmul = 2, kAttention = 3, kTranspose = 4,
                        kAlloc = 5;

json process_of(const json& report, std::int32_t pid) {
  for (const auto& p : report["processes"]) {
    if (p["pid"] == pid) return p;
  }
  return nullptr;
}
json step_of(const json& report, std::int32_t pid, std::string_view name) {
  const json process = process_of(report, pid);
  if (process.is_null()) return nullptr;
  for (const auto& s : process["steps"]) {
    if (s["step"] == name) return s;
  }
  return nullptr;
}

using CollectorReportTest = test::CollectorFixture;

TEST_F(CollectorReportTest, TextShowsSelfTimeAndSaysWhatDurationIncludes) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a", 7));
  ASSERT_FALSE(a.events({start(1, kForward, 0), start(1, kMatmul, 10), start(1, kTranspose, 20),
                         end(1, kTranspose, 30), end(1, kMatmul, 40), start(1, kMatmul, 50),
                         end(1, kMatmul, 60), end(1, kForward, 100)}));
  ASSERT_FALSE(a.events({start(2, kBackward, 5), end(2, kBackward, 95)}));
  ASSERT_FALSE(a.events(
      {start(3, kAlloc, 0), start(3, kAttention, 10), end(3, kAlloc, 20), end(3, kAttention, 50)}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(step_of(r, 1, "Forward")["self_ns"], 60);
  const std::string text = report::report_text(*collector_->freeze(), std::nullopt);
  EXPECT_NE(text.find("| Self            | % Self"), std::string::npos) << text;
  EXPECT_NE(text.find("Duration and % Time include nested spans"), std::string::npos) << text;
}

TEST_F(CollectorReportTest, DropsByCauseShowInJsonTextAndMetrics) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  DirectClient b(*collector_, world_.spawn(2, 1, "b"));
  a.dropped_by_cause({{5, 0, 1, 0}});
  a.dropped_by_cause({{3, 7, 1, 2}});
  b.dropped_by_cause({{0, 4, 0, 0}});
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 1)["dropped_by_cause"], (json{{"buffer_full", 5},
                                                        {"not_connected", 7},
                                                        {"in_flight", 1},
                                                        {"invalid", 2},
                                                        {"daemon_crash", 0},
                                                        {"refused", 0}}));
  EXPECT_EQ(process_of(r, 1)["dropped"], 15);
  EXPECT_EQ(r["daemon"]["events_dropped_by_clients"], 19);
  EXPECT_EQ(r["daemon"]["events_dropped_by_cause"]["not_connected"], 11);
  EXPECT_EQ(report::stats_json(*collector_->freeze())["events_dropped_by_cause"]["buffer_full"], 5);
  EXPECT_NE(report::report_text(*collector_->freeze(), 1)
                .find("dropped 15 (buffer full 5, not connected 7, in flight 1, invalid 2)"),
            std::string::npos)
      << report::report_text(*collector_->freeze(), 1);
  const std::string metrics = report::metrics_text(*collector_->freeze());
  EXPECT_NE(metrics.find("steptrace_process_dropped_events_by_cause_total{pid=\"1\",comm=\"a\","
                         "uid=\"1000\",cause=\"not_connected\"} 7"),
            std::string::npos);
  EXPECT_NE(
      metrics.find("steptrace_events_dropped_by_clients_by_cause_total{cause=\"buffer_full\"} 5"),
      std::string::npos);
}

// A span past max_span_ns: its two records as the process's `refused` drops, the span as
// a max_span_ns limit hit, in the report, stats, text and metrics.
TEST_F(CollectorReportTest, RefusedSpansShowInJsonTextAndMetrics) {
  limits_.max_span_ns = 1000;
  make();
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 5000), start(1, kForward, 6000),
                         end(1, kForward, 6500)}));
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 1)["dropped_by_cause"]["refused"], 2);
  EXPECT_EQ(process_of(r, 1)["dropped"], 2);
  EXPECT_EQ(process_of(r, 1)["events"], 2);
  EXPECT_EQ(step_of(r, 1, "Forward")["total_ns"], 500);
  EXPECT_EQ(r["daemon"]["events_dropped_by_cause"]["refused"], 2);
  const json stats = report::stats_json(*collector_->freeze());
  EXPECT_EQ(stats["limits_hit"]["max_span_ns"], 1);
  EXPECT_EQ(stats["events_dropped_by_cause"]["refused"], 2);
  const std::string text = report::report_text(*collector_->freeze(), 1);
  EXPECT_NE(text.find("dropped 2 (refused 2)"), std::string::npos) << text;
  const std::string metrics = report::metrics_text(*collector_->freeze());
  EXPECT_NE(metrics.find("steptrace_events_dropped_by_clients_by_cause_total{cause=\"refused\"} 2"),
            std::string::npos);
  EXPECT_NE(metrics.find("steptrace_limit_hits_total{limit=\"max_span_ns\"} 1"), std::string::npos);
}

// A Ledger record the shared view did not apply is counted for its process, in the JSON
// report and on the process's line of the text (nothing when there is none).
TEST_F(CollectorReportTest, RefusedLedgerRecordsShowInJsonAndText) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "t", 1, 150));
  EXPECT_EQ(
      process_of(report::report_json(*collector_->freeze(), std::nullopt), 1)["ledger_refused"], 0);
  EXPECT_EQ(report::report_text(*collector_->freeze(), 1).find("ledger records refused"),
            std::string::npos);
  a.ledger(test::reserve_record("GPU-x", 2, 0, "zero", 1, 160));  // 0 bytes: refused
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 1)["ledger_refused"], 1);
  const std::string text = report::report_text(*collector_->freeze(), 1);
  EXPECT_NE(text.find("ledger records refused 1"), std::string::npos) << text;
}

// PROTOCOL.md 4.7b: the Identity's job and ranks in the JSON report and the text.
TEST_F(CollectorReportTest, JobsAndRanksShowInJsonAndText) {
  DirectClient r0(*collector_, world_.spawn(10, 1, "train", 7));
  DirectClient r1(*collector_, world_.spawn(11, 1, "train", 7));
  DirectClient other(*collector_, world_.spawn(12, 1, "eval", 8));
  DirectClient lone(*collector_, world_.spawn(13, 1, "notebook", 7));
  r0.identity("llama-7", 0, 0, 2);
  r1.identity("llama-7", 1, 1, 2);
  other.identity("llama-7");
  DirectClient worker(*collector_, world_.spawn(14, 1, "train", 7));
  worker.identity("llama-7", 1, 1, 2);
  for (DirectClient* c : {&r0, &r1, &other, &lone, &worker}) {
    ASSERT_FALSE(c->events({start(1, kForward, 0), end(1, kForward, 100)}));
  }
  const json r = report::report_json(*collector_->freeze(), std::nullopt);
  EXPECT_EQ(process_of(r, 11)["job"], "llama-7");
  EXPECT_EQ(process_of(r, 11)["rank"], 1);
  EXPECT_EQ(process_of(r, 11)["local_rank"], 1);
  EXPECT_EQ(process_of(r, 11)["world_size"], 2);
  EXPECT_TRUE(process_of(r, 13)["job"].is_null());
  EXPECT_TRUE(process_of(r, 13)["rank"].is_null());
  ASSERT_EQ(r["jobs"].size(), 3u);  // (7, ""), (7, llama-7), (8, llama-7)
  const json& llama = r["jobs"][1];
  EXPECT_EQ(llama["job"], "llama-7");
  EXPECT_EQ(llama["uid"], 7);
  EXPECT_EQ(llama["processes"], 3);
  EXPECT_EQ(llama["live"], 3);
  EXPECT_EQ(llama["ranks"], json::array({0, 1}));
  EXPECT_EQ(llama["world_size"], 2);
  EXPECT_EQ(llama["totals"][0]["count"], 3);
  EXPECT_EQ(r["jobs"][2]["uid"], 8);

  // A job is (uid, job id): uid 8's process that sent the same id is not in uid 7's job.
  const auto by_job =
      report::report_json(*collector_->freeze(), report::ReportFilter{{}, JobRef{7, "llama-7"}});
  EXPECT_EQ(by_job["processes"].size(), 3u);
  ASSERT_EQ(by_job["jobs"].size(), 1u);
  EXPECT_EQ(by_job["jobs"][0]["uid"], 7);
  EXPECT_EQ(by_job["totals"][0]["count"], 3);
  const std::string text =
      report::report_text(*collector_->freeze(), report::ReportFilter{std::nullopt, std::nullopt});
  EXPECT_NE(text.find("══ Job llama-7 (uid 7) · 3 processes (3 live) · ranks 0-1 of 2\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("══ Processes without a job id (uid 7) · 1 process (1 live)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("── Process 11 (train) · rank 1/2 (local 1) · alive"), std::string::npos)
      << text;
  // One process: its table once.
  const std::string one = report::report_text(*collector_->freeze(), 11);
  EXPECT_EQ(one.find("| % Self"), one.rfind("| % Self")) << one;
  EXPECT_NE(one.find("── Process 11 (train) · job llama-7 · rank 1/2"), std::string::npos) << one;
  const std::string none =
      report::report_text(*collector_->freeze(), report::ReportFilter{{}, JobRef{9, "llama-7"}});
  EXPECT_NE(none.find("No process of job llama-7 (uid 9) is tracked."), std::string::npos) << none;
}

// config/README.md "The 50% rule": a `--pid` report's whole table uses the job's rule,
// also when the pid was reused and names two processes: of one job, that job's; of two
// jobs, the live one's, else (both exited) the one that started last.
TEST_F(CollectorReportTest, APidReportOfAReusedPidUsesItsJobsRule) {
  report::ReportOptions options;
  options.rules.by_job_id["bert"] = {{"Forward"}, {"Attention"}};
  options.rules.by_job_id["gpt"] = {{"Backward"}, {"Forward"}};
  const auto run = [&](std::int32_t pid, std::uint64_t start_time, const std::string& job,
                       std::uint32_t step) {
    auto c = std::make_unique<DirectClient>(*collector_, world_.spawn(pid, start_time, "t", 7));
    c->identity(job);
    EXPECT_FALSE(c->events({start(1, step, 0), end(1, step, 1000)}));
    return c;
  };
  const auto exited = [&](std::unique_ptr<DirectClient>& c, std::int32_t pid) {
    world_.kill(pid);
    c->close();
  };
  const auto table_rule = [&](std::int32_t pid) {
    const report::ReportFilter filter{pid, std::nullopt};
    const json doc = report::report_json(*collector_->freeze(), filter, options);
    EXPECT_EQ(doc["processes"].size(), 2u) << doc.dump();
    const std::string text = report::report_text(*collector_->freeze(), filter, options);
    const std::string table = text.substr(0, text.find("══ Job"));
    const std::string steps =
        doc["rule"]["source"].get<std::string>() + " " + doc["rule"]["compute_steps"].dump();
    // The text's whole table says the same.
    const std::string line =
        "Rule (the job's config): compute " +
        std::string(steps.find("Backward") != std::string::npos ? "Backward, overhead Forward"
                                                                : "Forward, overhead Attention");
    EXPECT_NE(table.find(line), std::string::npos) << text;
    return steps;
  };
  // Pid 20: a bert process exited, then a gpt process took its pid.
  auto old_bert = run(20, 1, "bert", kForward);
  exited(old_bert, 20);
  auto new_gpt = run(20, 2, "gpt", kBackward);
  EXPECT_EQ(table_rule(20), R"(job ["Backward"])");
  exited(new_gpt, 20);
  EXPECT_EQ(table_rule(20), R"(job ["Backward"])");  // none live: the one started last
  // Pid 30: the other way round.
  auto old_gpt = run(30, 1, "gpt", kBackward);
  exited(old_gpt, 30);
  auto new_bert = run(30, 2, "bert", kForward);
  EXPECT_EQ(table_rule(30), R"(job ["Forward"])");
  // Pid 40: two bert processes, one job.
  auto first = run(40, 1, "bert", kForward);
  exited(first, 40);
  auto second = run(40, 2, "bert", kForward);
  EXPECT_EQ(table_rule(40), R"(job ["Forward"])");
  // All processes, of both jobs: the default, as before.
  const json all = report::report_json(*collector_->freeze(), {}, options);
  EXPECT_EQ(all["rule"]["source"], "default");
}

// A view renders the same whatever ingest does after it was taken; the read model's
// side of this is collector_test's AViewStaysAsFrozenWhileIngestGoesOn, this one also
// covers what metrics_text reads beside it (the retired jobs and histograms).
TEST_F(CollectorReportTest, AViewRendersTheSameWhileIngestGoesOn) {
  DirectClient a(*collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.events({start(1, kMatmul, 0), end(1, kMatmul, 100), start(1, kForward, 100)}));
  a.ledger(test::reserve_record("GPU-x", 1, 4096, "t", 1, 150));
  const auto view = collector_->freeze();
  const json before = report::report_json(*view, std::nullopt);
  // The daemon's own process_* lines (RSS, CPU, fds) are read when rendered, not frozen.
  const auto without_process_lines = [](const std::string& text) {
    std::string out;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (!line.starts_with("process_")) out += line + "\n";
    }
    return out;
  };
  const std::string metrics_before = without_process_lines(report::metrics_text(*view));
  EXPECT_EQ(step_of(before, 1, "Matmul")["count"], 1);

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

  EXPECT_EQ(report::report_json(*view, std::nullopt), before);
  EXPECT_EQ(without_process_lines(report::metrics_text(*view)), metrics_before);
  EXPECT_EQ(report::ledger_json(*collector_->freeze())["gpus"][0]["reserved_bytes"], 4096 + 1024);
  EXPECT_EQ(report::ledger_json(*view)["gpus"][0]["reserved_bytes"], 4096);
}

// Per-job counters keep what exited and evicted processes had, and are bounded.
TEST_F(CollectorReportTest, JobCountersOutliveTheirProcesses) {
  limits_.max_exited_processes = 0;  // evicted at once
  limits_.max_jobs = 3;
  limits_.max_jobs_per_uid = 2;
  make();
  const auto spans = [&](std::int32_t pid, std::uint32_t uid, const std::string& job) {
    DirectClient c(*collector_, world_.spawn(pid, 1, "t", uid));
    c.identity(job, 0, 0, 1);
    EXPECT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 2'000'000'000)}));
    world_.kill(pid);
    c.close();
  };
  spans(1, 7, "a");
  spans(2, 7, "a");
  std::string text = report::metrics_text(*collector_->freeze());
  EXPECT_NE(
      text.find("steptrace_job_step_seconds_total{job_id=\"a\",uid=\"7\",step=\"Forward\"} 4\n"),
      std::string::npos)
      << text;
  EXPECT_NE(
      text.find("steptrace_job_step_spans_total{job_id=\"a\",uid=\"7\",step=\"Forward\"} 2\n"),
      std::string::npos);
  EXPECT_NE(text.find("steptrace_job_processes{job_id=\"a\",uid=\"7\",state=\"exited\"} 2\n"),
            std::string::npos);
  EXPECT_EQ(report::report_json(*collector_->freeze(), std::nullopt)["processes"].size(), 0u);
  // uid 7's third job pushes out its least recent; uid 8's then push out the oldest.
  spans(3, 7, "b");
  spans(4, 7, "c");
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"a\""), std::string::npos) << text;
  EXPECT_NE(text.find("job_id=\"b\""), std::string::npos);
  EXPECT_NE(text.find("steptrace_limit_hits_total{limit=\"max_jobs_per_uid\"} 1\n"),
            std::string::npos);
  spans(5, 8, "x");
  spans(6, 8, "y");
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"b\""), std::string::npos) << text;
  EXPECT_NE(text.find("steptrace_limit_hits_total{limit=\"max_jobs\"} 1\n"), std::string::npos);
  // A live process adds to its job's series, with job_id, uid and rank on its own series.
  DirectClient live(*collector_, world_.spawn(9, 1, "t", 8));
  live.identity("y", 0, 0, 1);
  ASSERT_FALSE(live.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
  text = report::metrics_text(*collector_->freeze());
  EXPECT_NE(
      text.find("steptrace_job_step_seconds_total{job_id=\"y\",uid=\"8\",step=\"Forward\"} 3\n"),
      std::string::npos)
      << text;
  EXPECT_NE(text.find("steptrace_process_step_seconds_total{pid=\"9\",comm=\"t\",job_id=\"y\","
                      "uid=\"8\",rank=\"0\",step=\"Forward\"} 1\n"),
            std::string::npos)
      << text;
  // reset clears them with the rest.
  collector_->reset(std::nullopt);
  text = report::metrics_text(*collector_->freeze());
  EXPECT_EQ(text.find("job_id=\"x\""), std::string::npos) << text;
}

// A job whose processes are still in the table is never the one forgotten: its
// counters would go backwards. Nor does it count against the limits, so its first
// process leaving forgets nobody. The least recent job with none left goes instead.
TEST_F(CollectorReportTest, AJobWithProcessesInTheTableKeepsItsRetiredTotals) {
  limits_.max_exited_processes = 0;  // evicted at once
  limits_.max_jobs = 2;
  limits_.max_jobs_per_uid = 2;
  make();
  const auto spans = [&](DirectClient& c, std::int32_t pid, const std::string& job) {
    c.identity(job, 0, 0, 2);
    EXPECT_FALSE(c.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
    world_.kill(pid);
    c.close();
  };
  const auto short_job = [&](std::int32_t pid, const std::string& job) {
    DirectClient c(*collector_, world_.spawn(pid, 1, "t", 7));
    spans(c, pid, job);
  };
  const auto metrics = [&] { return report::metrics_text(*collector_->freeze()); };
  const auto seconds = [&](const std::string& job) {
    const std::string text = metrics();
    const std::string key =
        "steptrace_job_step_seconds_total{job_id=\"" + job + "\",uid=\"7\",step=\"Forward\"} ";
    const auto at = text.find(key);
    return at == std::string::npos
               ? std::string("absent")
               : text.substr(at + key.size(), text.find('\n', at) - at - key.size());
  };
  const auto hits = [&](const std::string& limit) {
    const std::string text = metrics();
    const std::string key = "steptrace_limit_hits_total{limit=\"" + limit + "\"} ";
    const auto at = text.find(key);
    return at == std::string::npos ? -1 : std::stoi(text.substr(at + key.size()));
  };
  short_job(1, "p");
  short_job(2, "q");  // two finished jobs: the uid's limit
  // Job "a": rank 1 is still running while rank 0 has exited and left the table.
  DirectClient a1(*collector_, world_.spawn(11, 1, "t", 7));
  a1.identity("a", 1, 1, 2);
  ASSERT_FALSE(a1.events({start(1, kForward, 0), end(1, kForward, 1'000'000'000)}));
  {
    DirectClient a0(*collector_, world_.spawn(10, 1, "t", 7));
    spans(a0, 10, "a");
  }
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("p"), "1");  // "a" does not count yet: nobody was forgotten for it
  EXPECT_EQ(seconds("q"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 0);
  // Two more short jobs: past the limit, the least recent finished ones go, "a" stays.
  short_job(3, "job3");
  short_job(4, "job4");
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("p"), "absent");
  EXPECT_EQ(seconds("q"), "absent");
  EXPECT_EQ(seconds("job3"), "1");
  EXPECT_EQ(seconds("job4"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 2);
  // Once rank 1 leaves too, "a" holds both ranks' totals and counts like any other job:
  // the uid is back within its limit at once, least recent first.
  world_.kill(11);
  a1.close();
  EXPECT_EQ(seconds("a"), "2");
  EXPECT_EQ(seconds("job3"), "absent");
  EXPECT_EQ(seconds("job4"), "1");
  EXPECT_EQ(hits("max_jobs_per_uid"), 3);
  EXPECT_EQ(hits("max_jobs"), 0);  // the uid's limit kept the total within max_jobs
}

}  // namespace
}  // namespace steptrace::daemon
