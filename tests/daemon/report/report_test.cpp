// Reports built from real Collector state: report --json (schema), report (text shape),
// metrics (Prometheus exposition), stats; and the shared formatting helpers.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "daemon/report/report.h"
#include "daemon/report/report_format.h"
#include "daemon/state/collector.h"
#include "daemon/state/counter_table.h"
#include "proto/errc.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;

constexpr std::uint32_t kForward = 0, kBackward = 1, kMatmul = 2, kTranspose = 4, kAlloc = 5,
                        kWaitPoll = 10;

TEST(ReportFormatTest, ARuleIsAsWideAsItsTableAndNoNarrowerThanTheReport) {
  const auto columns_of = [](std::string_view rule) {
    return report::display_width(rule.substr(0, rule.size() - 1));
  };
  EXPECT_EQ(columns_of(report::rule()), report::kReportWidth);
  // The reference's four columns (15 | 8 | 15 | 8 = 55) fit within the report's width.
  const std::array<report::Column, 4> narrow = {report::Column{15}, report::Column{8},
                                                report::Column{15}, report::Column{8}};
  EXPECT_EQ(report::rule(narrow), report::rule());
  const std::array<report::Column, 3> wide = {report::Column{40}, report::Column{30},
                                              report::Column{9, report::Align::kRight}};
  EXPECT_EQ(columns_of(report::rule(wide)), 40u + 30u + 9u + 2u * 3u);
  EXPECT_EQ(report::rule(wide).back(), '\n');
}

TEST(ReportFormatTest, DurationsPrintLikeRustDebugWithTwoDecimals) {
  EXPECT_EQ(report::format_duration(0), "0.00ns");
  EXPECT_EQ(report::format_duration(850), "850.00ns");
  EXPECT_EQ(report::format_duration(12'340), "12.34µs");
  EXPECT_EQ(report::format_duration(12'345), "12.35µs");  // rounds half up
  EXPECT_EQ(report::format_duration(1'500'000), "1.50ms");
  EXPECT_EQ(report::format_duration(3'000'000'000), "3.00s");
  EXPECT_EQ(report::format_duration(125'004'000'000), "125.00s");
  EXPECT_EQ(report::format_percent(83.333), "  83.33%");
  EXPECT_EQ(report::format_bytes(512), "512 B");
  EXPECT_EQ(report::format_bytes(3u << 29), "1.50 GiB");
  EXPECT_EQ(report::escape_label_value("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
  // The exposition is UTF-8: valid sequences stay, any other byte is U+FFFD.
  EXPECT_EQ(report::escape_label_value("caf\xc3\xa9 \xe2\x94\x80 \xf0\x9f\x94\xb4"),
            "caf\xc3\xa9 \xe2\x94\x80 \xf0\x9f\x94\xb4");
  EXPECT_EQ(report::escape_label_value("a\xff"
                                       "b\xc3"),
            "a\xef\xbf\xbd"
            "b\xef\xbf\xbd");
  EXPECT_EQ(report::escape_label_value("\xc0\xaf\xed\xa0\x80"),  // overlong, surrogate
            "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd");
  // Control characters are valid UTF-8 but would reach a terminal: replaced too.
  EXPECT_EQ(report::escape_label_value("\x1b[2J\r\x7f"), "\xef\xbf\xbd[2J\xef\xbf\xbd\xef\xbf\xbd");
  EXPECT_EQ(report::display_width("µs─"), 3u);
}

class ReportTest : public ::testing::Test {
 protected:
  FakeWorld world_;
  Collector collector_{Limits{}, world_.env()};
};

TEST_F(ReportTest, JsonReportHasEveryFieldOfTheSchemaWithRealValues) {
  Connection a(collector_, world_.spawn(4242, 123456, "python3", 1000));
  Connection b(collector_, world_.spawn(5000, 777, "trainer", 1001));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 1000), start(1, kForward, 2000),
                         end(1, kForward, 5000), start(1, kWaitPoll, 9000)}));
  ASSERT_FALSE(b.events({start(9, kForward, 0), end(9, kForward, 500)}));
  a.dropped(7);
  ServerCounters server;  // what the Server counts; views show it beside ingest's
  server.connections_now = 2;
  server.protocol_errors["bad_magic"] = 3;
  world_.now_ns = 9000 + 250;

  const json r = report::report_json(*collector_.freeze(&server), std::nullopt);
  EXPECT_EQ(r["schema"], "steptrace.report/v1");
  ASSERT_EQ(r["processes"].size(), 2u);
  const json& p = r["processes"][0];
  EXPECT_EQ(p["pid"], 4242);
  EXPECT_EQ(p["start_time"], 123456);
  EXPECT_EQ(p["uid"], 1000);
  EXPECT_EQ(p["comm"], "python3");
  EXPECT_EQ(p["alive"], true);
  EXPECT_EQ(p["dropped"], 7);
  ASSERT_EQ(p["steps"].size(), 2u);
  const json& f = p["steps"][0];
  EXPECT_EQ(f["step"], "Forward");
  EXPECT_EQ(f["count"], 2);
  EXPECT_EQ(f["total_ns"], 4000);
  EXPECT_EQ(f["min_ns"], 1000);
  EXPECT_EQ(f["max_ns"], 3000);
  EXPECT_NEAR(f["p50_ns"].get<double>(), 1000, 20);
  EXPECT_NEAR(f["p99_ns"].get<double>(), 3000, 60);
  EXPECT_EQ(f["open"], 0);
  EXPECT_EQ(f["unmatched_ends"], 0);
  EXPECT_EQ(f["abandoned"], 0);
  EXPECT_EQ(p["steps"][1]["step"], "WaitPoll");
  EXPECT_EQ(p["steps"][1]["open"], 1);
  EXPECT_EQ(p["steps"][1]["count"], 0);
  // What `steptrace top` shows: thread 1 stuck in WaitPoll for 250ns.
  ASSERT_EQ(p["current"].size(), 1u);
  EXPECT_EQ(p["current"][0]["thread"], 1);
  EXPECT_EQ(p["current"][0]["step"], "WaitPoll");
  EXPECT_EQ(p["current"][0]["open_for_ns"], 250);
  EXPECT_EQ(p["current"][0]["depth"], 1);

  ASSERT_EQ(r["totals"].size(), 2u);
  const json& t = r["totals"][0];
  EXPECT_EQ(t["step"], "Forward");
  EXPECT_EQ(t["count"], 3);
  EXPECT_EQ(t["total_ns"], 4500);
  EXPECT_EQ(t["min_ns"], 500);
  EXPECT_EQ(t["max_ns"], 3000);
  EXPECT_TRUE(t["p50_ns"].is_number_unsigned());
  EXPECT_TRUE(t["p99_ns"].is_number_unsigned());
  EXPECT_EQ(t["processes"], 2);
  EXPECT_EQ(r["totals"][1]["step"], "WaitPoll");
  EXPECT_EQ(r["totals"][1]["open"], 1);

  ASSERT_TRUE(r["ledger"].contains("gpus"));
  EXPECT_TRUE(r["ledger"]["gpus"].is_array());
  const json& d = r["daemon"];
  EXPECT_EQ(d["events_received"], 7);
  EXPECT_EQ(d["events_dropped_by_clients"], 7);
  EXPECT_EQ(d["protocol_errors"], 3);
  EXPECT_EQ(d["clients_connected"], 2);
  EXPECT_TRUE(d["uptime_s"].is_number_unsigned());

  // pid filter: only that pid's processes, totals over them.
  const json only = report::report_json(*collector_.freeze(), 5000);
  ASSERT_EQ(only["processes"].size(), 1u);
  EXPECT_EQ(only["processes"][0]["pid"], 5000);
  ASSERT_EQ(only["totals"].size(), 1u);
  EXPECT_EQ(only["totals"][0]["count"], 1);
  EXPECT_EQ(only["totals"][0]["processes"], 1);
  EXPECT_TRUE(report::report_json(*collector_.freeze(), 1)["processes"].empty());
}

TEST_F(ReportTest, TextReportKeepsTheReferenceShape) {
  Connection a(collector_, world_.spawn(4242, 1, "python3"));
  Connection b(collector_, world_.spawn(5000, 1, "trainer"));
  // Matmul 50ms, Transpose 10ms: overhead 16.67% -> corroborated.
  ASSERT_FALSE(a.events({start(1, kMatmul, 0), end(1, kMatmul, 50'000'000), start(1, kTranspose, 0),
                         end(1, kTranspose, 10'000'000), start(1, kForward, 0),
                         end(1, kForward, 1'500'000)}));
  // The other process: Alloc dominates -> falsification in its own section.
  ASSERT_FALSE(
      b.events({start(2, kMatmul, 0), end(2, kMatmul, 1'000'000), start(2, kAlloc, 0),
                end(2, kAlloc, 3'000'000), start(2, kBackward, 0), end(2, kBackward, 850)}));
  b.dropped(4);
  const std::string text = report::report_text(*collector_.freeze(), std::nullopt);

  EXPECT_NE(text.find("╔══════════════════════════════════════════════════════════════╗\n"
                      "║       STEPTRACE REPORT"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("╚══════════════════════════════════════════════════════════════╝\n"
                      "Processes: 2\nTotal Measured Time: 65.50ms\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("Step            | Count    | Duration        | % Time   | p50             | "
                      "p99             "
                      "| Self            | % Self\n"),
            std::string::npos)
      << text;
  // The rules above and below the table are as wide as its rows (120 columns here).
  const std::size_t header = text.find("Step            | Count");
  std::string rule_120;
  for (int i = 0; i < 120; ++i) rule_120 += "─";
  EXPECT_NE(text.find("ms\n" + rule_120 + "\nStep            | Count"), std::string::npos) << text;
  EXPECT_NE(text.find("% Self\n" + rule_120 + "\nMatmul"), std::string::npos) << text;
  EXPECT_NE(text.find("0.00%\n" + rule_120 + "\n", header), std::string::npos) << text;
  // All processes: Matmul 51ms > Transpose 10ms > Alloc 3ms > Forward 1.5ms > Backward.
  const auto pos = [&](const std::string& s, std::size_t from = 0) { return text.find(s, from); };
  const std::size_t matmul = pos("Matmul          | 2        | 51.00ms         |   77.86%");
  const std::size_t transpose = pos("Transpose       | 1        | 10.00ms         |   15.27%");
  const std::size_t alloc = pos("Alloc           | 1        | 3.00ms          |    4.58%");
  const std::size_t forward = pos("Forward         | 1        | 1.50ms          |    2.29%");
  const std::size_t backward = pos("Backward        | 1        | 850.00ns        |    0.00%");
  ASSERT_NE(matmul, std::string::npos) << text;
  ASSERT_NE(transpose, std::string::npos) << text;
  ASSERT_NE(alloc, std::string::npos) << text;
  ASSERT_NE(forward, std::string::npos) << text;
  ASSERT_NE(backward, std::string::npos) << text;
  EXPECT_LT(matmul, transpose);
  EXPECT_LT(transpose, alloc);
  EXPECT_LT(alloc, forward);
  EXPECT_LT(forward, backward);

  // Overall: compute 51ms, overhead 13ms -> 20.31%, corroborated.
  const std::size_t popper =
      pos("\n[Dr. Popper Analysis]\nCUDA Compute:   51.00ms\n"
          "CPU Overhead:   13.00ms (20.31%)\n\n"
          "🟢 CORROBORATED: Compute dominates. Current approach viable.\n");
  ASSERT_NE(popper, std::string::npos) << text;
  // Per process sections, in pid order, each with its own analysis.
  const std::size_t p1 =
      pos("── Process 4242 (python3) · alive · dropped 0 · unmatched ends 0 · abandoned 0");
  const std::size_t p2 =
      pos("── Process 5000 (trainer) · alive · dropped 4 · unmatched ends 0 · abandoned 0");
  ASSERT_NE(p1, std::string::npos) << text;
  ASSERT_NE(p2, std::string::npos) << text;
  EXPECT_LT(popper, p1);
  EXPECT_LT(p1, p2);
  EXPECT_NE(pos("CPU Overhead:   10.00ms (16.67%)\n\n🟢 CORROBORATED", p1), std::string::npos);
  EXPECT_NE(pos("CUDA Compute:   1.00ms\nCPU Overhead:   3.00ms (75.00%)\n\n"
                "🔴 FALSIFICATION: Overhead > 50%. Kernel fusion required.\n",
                p2),
            std::string::npos)
      << text;
  EXPECT_NE(pos("[VRAM Ledger]", p2), std::string::npos);
}

// The 50% rule of other steps (`report --compute/--overhead`, a job's config): the same
// verdicts over the steps named, text and JSON alike, and without compute one line and
// "no_compute" (never NaN).
TEST_F(ReportTest, RuleOfOtherStepsInTextAndJson) {
  Connection a(collector_, world_.spawn(4242, 1, "python3"));
  ASSERT_FALSE(
      a.events({start(1, kForward, 0), end(1, kForward, 3'000'000), start(1, kBackward, 0),
                end(1, kBackward, 1'000'000), start(1, kMatmul, 0), end(1, kMatmul, 6'000'000)}));
  report::ReportOptions options;
  options.rule = report::OverheadRule{{"Backward"}, {"Forward", "Matmul"}};
  std::string text = report::report_text(*collector_.freeze(), report::ReportFilter{}, options);
  EXPECT_NE(text.find("[Dr. Popper Analysis]\n"
                      "Rule (--compute/--overhead): compute Backward, overhead Forward + Matmul\n"
                      "CUDA Compute:   1.00ms\nCPU Overhead:   9.00ms (90.00%)\n\n"
                      "🔴 FALSIFICATION: Overhead > 50%. Kernel fusion required.\n"),
            std::string::npos)
      << text;
  json doc = report::report_json(*collector_.freeze(), report::ReportFilter{}, options);
  EXPECT_EQ(doc["rule"], json::parse(R"({"compute_steps": ["Backward"], "overhead_steps":
      ["Forward", "Matmul"], "source": "flags", "compute_ns": 1000000, "overhead_ns": 9000000,
      "overhead_pct": 90.0, "verdict": "falsified"})"));

  // The default: Matmul 6 ms against nothing, corroborated; as before, no "Rule" line.
  text = report::report_text(*collector_.freeze(), std::nullopt);
  EXPECT_NE(text.find("[Dr. Popper Analysis]\nCUDA Compute:   6.00ms\n"), std::string::npos)
      << text;
  doc = report::report_json(*collector_.freeze(), std::nullopt);
  EXPECT_EQ(doc["rule"]["verdict"], "corroborated");
  EXPECT_EQ(doc["rule"]["overhead_pct"], 0.0);
  EXPECT_EQ(doc["rule"]["source"], "default");

  // No compute among the steps named: one line naming them, no verdict, null ratio.
  options.rule = report::OverheadRule{{"Attention", "Linear"}, {"Forward"}};
  text = report::report_text(*collector_.freeze(), report::ReportFilter{}, options);
  EXPECT_NE(text.find("No Attention or Linear spans, so no 50% verdict: the rule sets compute "
                      "(Attention + Linear) against CPU overhead (Forward)."),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("FALSIFICATION"), std::string::npos) << text;
  EXPECT_EQ(text.find("CORROBORATED"), std::string::npos) << text;
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;
  doc = report::report_json(*collector_.freeze(), report::ReportFilter{}, options);
  EXPECT_EQ(doc["rule"]["verdict"], "no_compute");
  EXPECT_TRUE(doc["rule"]["overhead_pct"].is_null());
  EXPECT_EQ(doc["rule"]["overhead_ns"], 3'000'000);
}

TEST(OverheadRule, EvaluateSumsTheNamedStepsAndNeverDividesByZero) {
  const report::RuleFigures none = report::evaluate(report::default_overhead_rule(), {});
  EXPECT_EQ(none.compute_ns, 0u);
  EXPECT_EQ(none.overhead_ns, 0u);
  EXPECT_FALSE(none.overhead_pct);
  const report::OverheadRule rule = report::default_overhead_rule();
  EXPECT_EQ(rule.compute, (std::vector<std::string>{"Matmul"}));
  EXPECT_EQ(rule.overhead, (std::vector<std::string>{"Transpose", "Alloc"}));
}

TEST_F(ReportTest, TextReportWithoutComputeSaysWhyThereIsNoVerdictAndEmptySaysHowToRecord) {
  std::string text = report::report_text(*collector_.freeze(), std::nullopt);
  EXPECT_NE(text.find("STEPTRACE REPORT"), std::string::npos);
  EXPECT_NE(text.find("No process has connected yet"), std::string::npos) << text;
  Connection a(collector_, world_.spawn(1, 1, "a"));
  text = report::report_text(*collector_.freeze(), std::nullopt);
  EXPECT_NE(text.find("No measurements recorded."), std::string::npos) << text;
  EXPECT_NE(text.find("steptrace_start"), std::string::npos) << text;
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10)}));
  text = report::report_text(*collector_.freeze(), std::nullopt);
  EXPECT_EQ(text.find("No measurements recorded."), std::string::npos) << text;
  // No Matmul: one line says the rule has nothing to judge (issue 28), no verdict.
  EXPECT_NE(text.find("No Matmul spans, so no 50% verdict"), std::string::npos) << text;
  EXPECT_EQ(text.find("FALSIFICATION"), std::string::npos) << text;
  EXPECT_EQ(text.find("CORROBORATED"), std::string::npos) << text;
  EXPECT_NE(report::report_text(*collector_.freeze(), 77).find("No process with pid 77"),
            std::string::npos);
}

// ---- Prometheus ----------------------------------------------------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  std::string value;
};

// A strict reader of the exposition format: every line is a comment (# HELP/# TYPE) or
// a sample `name{labels} value`.
struct Exposition {
  std::map<std::string, std::string> help, type;
  std::vector<Sample> samples;
  std::vector<std::string> errors;

  explicit Exposition(const std::string& text) {
    static const std::regex kHelp(R"(# HELP ([a-zA-Z_:][a-zA-Z0-9_:]*) (.*))");
    static const std::regex kType(
        R"(# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (counter|gauge|histogram|summary|untyped))");
    static const std::regex kSample(R"(([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})? (\S+))");
    static const std::regex kLabel(R"(([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)\",?)");
    if (text.empty() || text.back() != '\n') errors.push_back("must end with a newline");
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) {
      std::smatch m;
      if (std::regex_match(line, m, kHelp)) {
        if (help.count(m[1])) errors.push_back("HELP twice: " + line);
        help[m[1]] = m[2];
      } else if (std::regex_match(line, m, kType)) {
        if (type.count(m[1])) errors.push_back("TYPE twice: " + line);
        type[m[1]] = m[2];
      } else if (std::regex_match(line, m, kSample)) {
        Sample s{m[1], {}, m[4]};
        std::string labels = m[3];
        for (std::sregex_iterator it(labels.begin(), labels.end(), kLabel), stop; it != stop;
             ++it) {
          s.labels[(*it)[1]] = (*it)[2];
        }
        samples.push_back(std::move(s));
      } else {
        errors.push_back("bad line: " + line);
      }
    }
  }
  // The family a sample belongs to (histogram samples carry a suffix).
  std::string family(const std::string& name) const {
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) {
        const std::string base = name.substr(0, name.size() - s.size());
        if (type.count(base) && type.at(base) == "histogram") return base;
      }
    }
    return name;
  }
  std::vector<Sample> of(const std::string& name) const {
    std::vector<Sample> out;
    for (const auto& s : samples) {
      if (s.name == name) out.push_back(s);
    }
    return out;
  }
};

TEST_F(ReportTest, MetricsAreWellFormedPrometheusText) {
  Connection a(collector_, world_.spawn(4242, 1, "py\"th\\on"));
  Connection b(collector_, world_.spawn(5000, 1, "trainer"));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 500),        // <= 1us
                         start(1, kForward, 0), end(1, kForward, 2'000'000),  // <= 10ms
                         start(1, 256, 0), end(1, 256, 1000),                 // == 1us
                         start(1, kMatmul, 0)}));
  ASSERT_FALSE(b.events({start(1, kForward, 0), end(1, kForward, 20'000'000'000)}));  // +Inf
  world_.kill(5000);
  b.close();  // exited: no per-process series, still in the per-step histogram
  ServerCounters server;
  server.protocol_errors["bad_magic"] = 2;

  const std::string text = report::metrics_text(*collector_.freeze(&server));
  const Exposition e(text);
  EXPECT_TRUE(e.errors.empty()) << e.errors.front() << "\n" << text;
  for (const auto& s : e.samples) {
    const std::string family = e.family(s.name);
    EXPECT_TRUE(e.help.count(family)) << "no HELP for " << s.name;
    EXPECT_TRUE(e.type.count(family)) << "no TYPE for " << s.name;
    // Ours, or the daemon's own in the names every Prometheus client library uses.
    EXPECT_TRUE(s.name.starts_with("steptrace_") || s.name.starts_with("process_")) << s.name;
    if (e.type.count(family) && e.type.at(family) == "counter") {
      EXPECT_TRUE(s.name.ends_with("_total")) << s.name;
    }
  }
  for (const auto& [name, t] : e.type) EXPECT_TRUE(e.help.count(name)) << name;

  // Per-step histogram: summed over processes (exited included), no pid label.
  std::map<std::string, std::string> forward;
  for (const auto& s : e.of("steptrace_step_duration_seconds_bucket")) {
    EXPECT_FALSE(s.labels.count("pid"));
    if (s.labels.at("step") == "Forward") forward[s.labels.at("le")] = s.value;
  }
  EXPECT_EQ(forward["1e-06"], "1");
  EXPECT_EQ(forward["0.001"], "1");
  EXPECT_EQ(forward["0.01"], "2");
  EXPECT_EQ(forward["10"], "2");
  EXPECT_EQ(forward["+Inf"], "3");
  for (const auto& s : e.of("steptrace_step_duration_seconds_count")) {
    EXPECT_FALSE(s.labels.count("pid"));
    if (s.labels.at("step") == "Forward") {
      EXPECT_EQ(s.value, "3");
    }
    if (s.labels.at("step") == "Tokenize") {
      EXPECT_EQ(s.value, "1");
    }
  }
  for (const auto& s : e.of("steptrace_step_duration_seconds_sum")) {
    if (s.labels.at("step") == "Forward") {
      EXPECT_DOUBLE_EQ(std::stod(s.value), 20.0020005);
    }
  }
  // Per process: live ones only, label values escaped.
  const auto spans = e.of("steptrace_process_step_spans_total");
  ASSERT_FALSE(spans.empty());
  std::set<std::string> pids;
  for (const auto& s : spans) pids.insert(s.labels.at("pid"));
  EXPECT_EQ(pids, std::set<std::string>{"4242"});
  EXPECT_NE(text.find("comm=\"py\\\"th\\\\on\""), std::string::npos) << text;
  bool open_matmul = false;
  for (const auto& s : e.of("steptrace_process_open_spans")) {
    if (s.labels.at("step") == "Matmul") open_matmul = s.value == "1";
  }
  EXPECT_TRUE(open_matmul);
  // Daemon counters.
  ASSERT_EQ(e.of("steptrace_events_received_total").size(), 1u);
  EXPECT_EQ(e.of("steptrace_events_received_total")[0].value, "9");
  bool bad_magic = false;
  for (const auto& s : e.of("steptrace_protocol_errors_total")) {
    if (s.labels.at("kind") == "bad_magic") bad_magic = s.value == "2";
  }
  EXPECT_TRUE(bad_magic);
  std::map<std::string, std::string> processes;
  for (const auto& s : e.of("steptrace_processes")) processes[s.labels.at("state")] = s.value;
  EXPECT_EQ(processes["live"], "1");
  EXPECT_EQ(processes["exited"], "1");
  EXPECT_EQ(e.type.at("steptrace_uptime_seconds"), "gauge");
}

TEST_F(ReportTest, EveryLimitAndErrorKindHasASeriesFromTheStart) {
  const Exposition fresh(report::metrics_text(*collector_.freeze()));
  std::map<std::string, std::string> limits;
  for (const auto& s : fresh.of("steptrace_limit_hits_total"))
    limits[s.labels.at("limit")] = s.value;
  ASSERT_EQ(limits.size(), kLimitNames.size());
  for (const std::string_view name : kLimitNames) EXPECT_EQ(limits[std::string(name)], "0") << name;
  EXPECT_TRUE(limits.contains("max_gpus"));
  EXPECT_TRUE(limits.contains("max_reservations_per_gpu"));
  std::map<std::string, std::string> errors;
  for (const auto& s : fresh.of("steptrace_protocol_errors_total"))
    errors[s.labels.at("kind")] = s.value;
  for (const ErrcInfo& e : kErrcTable) {
    if (e.protocol_error) {
      EXPECT_EQ(errors[e.name], "0") << e.name;
    }
  }
  for (const std::string_view kind : kSessionErrorKinds) EXPECT_EQ(errors[std::string(kind)], "0");

  // A hit shows on top of the zeros, under its own name.
  ServerCounters server;
  server.connections_rejected = 3;
  const Exposition hit(report::metrics_text(*collector_.freeze(&server)));
  for (const auto& s : hit.of("steptrace_limit_hits_total")) {
    EXPECT_EQ(s.value, s.labels.at("limit") == "max_connections" ? "3" : "0")
        << s.labels.at("limit");
  }
}

TEST_F(ReportTest, StepHistogramSeriesAreBoundedWhateverNamesClientsChoose) {
  // 5 processes x 1000 custom names + 12 built-in = 5012 names; 4096 get a series.
  std::vector<std::unique_ptr<Connection>> conns;
  std::uint64_t spans = 0;
  for (int p = 0; p < 5; ++p) {
    conns.push_back(std::make_unique<Connection>(collector_, world_.spawn(100 + p, 1, "t")));
    std::vector<proto::EventRecord> events;
    for (std::uint32_t i = 0; i < 1000; ++i) {
      ASSERT_FALSE(conns.back()->register_step(256 + i, "s" + std::to_string(p * 1000 + i)));
      events.push_back(start(1, 256 + i, 0));
      events.push_back(end(1, 256 + i, 1000));
      ++spans;
    }
    ASSERT_FALSE(conns.back()->events(events));
  }
  const Exposition e(report::metrics_text(*collector_.freeze()));
  ASSERT_TRUE(e.errors.empty()) << e.errors.front();
  std::set<std::string> steps;
  std::uint64_t counted = 0;
  std::string other_count;
  for (const auto& s : e.of("steptrace_step_duration_seconds_count")) {
    steps.insert(s.labels.at("step"));
    counted += std::stoull(s.value);
    if (s.labels.at("step") == "(other)") other_count = s.value;
  }
  EXPECT_EQ(steps.size(), 4097u);  // 4096 names and "(other)"
  EXPECT_TRUE(steps.count("Forward"));
  EXPECT_EQ(other_count, std::to_string(5000 + 12 - 4096));  // one span per merged name
  EXPECT_EQ(counted, spans);                                 // nothing lost in the merge
}

TEST_F(ReportTest, StatsCoverCountersProcessesLimitsAndMemory) {
  Connection a(collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10)}));
  ServerCounters server;
  server.protocol_errors["bad_step_id"] = 2;
  server.protocol_errors["truncated"] = 1;
  server.connections_total = 5;
  server.connections_rejected = 4;  // each a max_connections hit
  const json s = report::stats_json(*collector_.freeze(&server));
  EXPECT_EQ(s["events_received"], 2);
  EXPECT_EQ(s["protocol_errors"]["total"], 3);
  EXPECT_EQ(s["protocol_errors"]["by_kind"]["bad_step_id"], 2);
  EXPECT_EQ(s["connections"]["total"], 5);
  EXPECT_EQ(s["processes"]["tracked"], 1);
  EXPECT_EQ(s["processes"]["live"], 1);
  EXPECT_EQ(s["processes"]["exited"], 0);
  EXPECT_EQ(s["custom_steps"], 1);
  EXPECT_EQ(s["limits_hit"]["max_connections"], 4);
  EXPECT_GT(s["memory"]["rss_bytes"].get<std::uint64_t>(), 0u);
  EXPECT_GT(s["memory"]["state_bytes_estimate"].get<std::uint64_t>(), 0u);
  EXPECT_TRUE(s.contains("ledger_anomalies"));
  EXPECT_TRUE(s.contains("snapshots"));
  const std::string text = report::stats_text(*collector_.freeze(&server));
  EXPECT_NE(text.find("events_received: 2\n"), std::string::npos) << text;
  EXPECT_NE(text.find("protocol_errors.total: 3\n"), std::string::npos) << text;
}

// Issue 26: one figure of everything the daemon accounts for holding, to set beside the
// resident set: the state's charge, view copies, the flight recorder, replies pending to
// text and binary sessions, and the metrics texts the HTTP listener holds.
TEST_F(ReportTest, AccountedBytesIsTheSumOfWhatTheDaemonHolds) {
  Connection a(collector_, world_.spawn(1, 1, "a"));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 10)}));
  ServerCounters server;
  server.reply_bytes_pending = 1000;
  server.http.reply_bytes = 20000;
  const json s = report::stats_json(*collector_.freeze(&server));
  const json& memory = s["memory"];
  EXPECT_EQ(memory["http_reply_bytes"], 20000);
  EXPECT_EQ(memory["reply_bytes_pending"], 1000);
  const auto part = [&](const json& at, const char* key) { return at[key].get<std::uint64_t>(); };
  EXPECT_GT(part(memory, "state_bytes_charged"), 0u);
  EXPECT_EQ(part(memory, "accounted_bytes"), part(memory, "state_bytes_charged") +
                                                 part(memory, "view_copy_bytes") +
                                                 part(s["flight_recorder"], "bytes") + 1000 + 20000)
      << s.dump();
}

// Item 8 of issue 15: a process may name itself with escape codes and line breaks (its
// /proc comm); no text output prints them raw.
TEST_F(ReportTest, TextOutputsSanitiseClientChosenStrings) {
  const std::string evil = "\x1b[2Jev\nil\xff";
  Connection a(collector_, world_.spawn(4242, 1, evil));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(
      a.events({start(1, kForward, 0), end(1, kForward, 10), start(1, 256, 0), end(1, 256, 20)}));
  ServerCounters server;
  server.protocol_errors["kind\x1b]0;title\x07\nforged: 1"] = 1;
  const auto view = collector_.freeze(&server);

  const std::string text = report::report_text(*view, std::nullopt);
  EXPECT_NE(text.find("── Process 4242 (?[2Jev?il?) · alive"), std::string::npos) << text;
  EXPECT_NE(text.find("Tokenize"), std::string::npos) << text;
  const std::string stats = report::stats_text(*view);
  EXPECT_NE(stats.find("protocol_errors.by_kind.kind?]0;title??forged: 1: 1\n"), std::string::npos)
      << stats;
  for (const std::string& out : {text, stats, report::ledger_text(*view)}) {
    EXPECT_EQ(out.find('\x1b'), std::string::npos) << out;
    EXPECT_EQ(out.find('\x07'), std::string::npos) << out;
    EXPECT_EQ(out.find("ev\nil"), std::string::npos) << out;
    EXPECT_EQ(out.find('\xff'), std::string::npos) << out;
  }
  // JSON keeps the name as it is (escaped by construction); metrics escape the line break,
  // replace the ESC and keep the label valid UTF-8.
  EXPECT_EQ(report::report_json(*view, std::nullopt)["processes"][0]["comm"], evil);
  const std::string metrics = report::metrics_text(*view);
  EXPECT_NE(metrics.find("comm=\"\xef\xbf\xbd[2Jev\\nil\xef\xbf\xbd\""), std::string::npos)
      << metrics;
  EXPECT_EQ(metrics.find('\xff'), std::string::npos);
  EXPECT_EQ(metrics.find('\x1b'), std::string::npos);
}

// Issue 26, item 10: U+202E RLO (and other bidi controls, invisible characters) in a
// comm, a job id or a custom step name: the text report prints '?' for each byte, metrics
// labels U+FFFD for each code point (valid UTF-8, nothing that reorders a terminal), and
// the JSON keeps the string (serve/ writes it with its escapes, commands_test).
TEST_F(ReportTest, BidiControlsNeverReachTextOrMetricsRaw) {
  const std::string rlo = "\xE2\x80\xAE";
  const std::string comm = "ev" + rlo + "il";
  Connection a(collector_, world_.spawn(4242, 1, comm));
  // On the wire a job id is printable ASCII (the encoder makes each other byte '?', the
  // decoder refuses it); the comm comes from /proc and may hold any bytes.
  EXPECT_FALSE(a.identity("job" + rlo));
  ASSERT_FALSE(a.register_step(256, "Tokenize"));
  ASSERT_FALSE(a.events({start(1, 256, 0), end(1, 256, 20)}));
  const auto view = collector_.freeze();
  const std::string text = report::report_text(*view, std::nullopt);
  EXPECT_NE(text.find("── Process 4242 (ev???il) · job job??? · alive"), std::string::npos) << text;
  const std::string metrics = report::metrics_text(*view);
  EXPECT_NE(metrics.find("comm=\"ev\xEF\xBF\xBDil\""), std::string::npos) << metrics;
  for (const std::string& out : {text, metrics, report::stats_text(*view)}) {
    EXPECT_EQ(out.find(rlo), std::string::npos) << out;
  }
  EXPECT_EQ(report::report_json(*view, std::nullopt)["processes"][0]["comm"], comm);
  // Each of the listed characters, in a label of its own.
  for (const std::string ch : {"\xD8\x9C", "\xE2\x80\x8B", "\xE2\x80\x8F", "\xE2\x81\xA0",
                               "\xE2\x81\xA9", "\xEF\xBB\xBF", "\xEF\xBF\xBB", "\xC2\x85"}) {
    EXPECT_EQ(report::escape_label_value("a" + ch + "b"),
              "a\xEF\xBF\xBD"
              "b");
  }
  EXPECT_EQ(report::escape_label_value("日本語 Ünïcödé 🔥"), "日本語 Ünïcödé 🔥");
}

// Every plain counter of state/counter_table.h shows in `stats --json` at its group and
// key and in the metrics as its family, with its value; the server's own counts reach
// the row they belong to (each a distinct value here, so a crossed pointer shows).
TEST_F(ReportTest, EveryCounterOfTheTableShowsInStatsAndMetricsWithItsValue) {
  Connection a(collector_, world_.spawn(4242, 1, "trainer"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 500)}));
  ServerCounters server;
  std::uint64_t next = 1000;
  for (const CounterRow& row : kCounterTable) {
    if (row.server != nullptr) server.*row.server = next++;
  }
  const auto view = collector_.freeze(&server);
  const json stats = report::stats_json(*view);
  const Exposition e(report::metrics_text(*view));
  std::set<std::string> stats_paths, metrics, snapshot_keys;
  for (const CounterRow& row : kCounterTable) {
    SCOPED_TRACE(std::string(row.metric));
    const std::uint64_t value = view->counters().*row.field;
    if (row.server != nullptr) {
      EXPECT_EQ(value, server.*row.server);
    }
    const json& at = row.stats_group.empty() ? stats : stats.at(std::string(row.stats_group));
    EXPECT_EQ(at.at(std::string(row.stats_key)), value);
    const auto samples = e.of(std::string(row.metric));
    ASSERT_EQ(samples.size(), 1u);
    EXPECT_TRUE(samples[0].labels.empty());
    EXPECT_EQ(samples[0].value, std::to_string(value));
    EXPECT_EQ(e.type.at(std::string(row.metric)), row.metric_type);
    EXPECT_TRUE(
        stats_paths.insert(std::string(row.stats_group) + "." + std::string(row.stats_key)).second);
    EXPECT_TRUE(metrics.insert(std::string(row.metric)).second);
    EXPECT_EQ(row.kept == Kept::kNo, row.snapshot_key.empty());
    if (row.kept != Kept::kNo) {
      EXPECT_TRUE(snapshot_keys.insert(std::string(row.snapshot_key)).second);
    }
  }
  EXPECT_EQ(view->counters().events_received, 2u);
}

// ---- the whole metrics exposition and ledger text of one table, pinned ------------------

// What the metrics of a table with live, exited and evicted processes, jobs and a ledger
// with a device are, byte for byte. A refactor of the renderers or of what they read
// must leave this unchanged; a change on purpose regenerates the file
// (STEPTRACE_UPDATE_GOLDEN=1 ./report_test --gtest_filter='*Pinned*') and shows in review.
class PinnedOutputTest : public ::testing::Test {
 protected:
  static constexpr std::uint64_t kGiB = 1ULL << 30;
  static constexpr std::uint32_t kAttention = 3, kLedgerReserve = 7;

  PinnedOutputTest() {
    limits_.max_exited_processes = 1;  // the second exit evicts the first
    collector_ = std::make_unique<Collector>(limits_, world_.env());
  }

  // pid 4242 (job llama, rank 0) stays live: a custom step, an open span, an unmatched
  // end, drops by cause and a reservation whose LedgerReserve span the GPU is credited
  // with. pid 17 (llama, rank 2) and pid 99 (uid 1001, no job) exit and are evicted in
  // turn; pid 4243 (llama, rank 1) exits last and stays, its open span abandoned and its
  // reservation leaked.
  void fill() {
    Connection c(*collector_, world_.spawn(17, 5, "loader"));
    ASSERT_FALSE(c.identity("llama", 2, 0, 4));
    ASSERT_FALSE(c.register_step(256, "Load"));
    ASSERT_FALSE(c.events(
        {start(1, 256, 0), end(1, 256, 3000), start(2, kForward, 0), end(2, kForward, 1'000'000)}));
    ASSERT_FALSE(c.dropped(5));
    world_.kill(17);
    c.close();
    Connection d(*collector_, world_.spawn(99, 6, "eval", 1001));
    ASSERT_FALSE(d.register_step(300, "Score"));
    ASSERT_FALSE(d.events({start(1, kAttention, 0), end(1, kAttention, 5'000'000), start(1, 300, 0),
                           end(1, 300, 700'000)}));
    ASSERT_FALSE(d.dropped_by_cause({{1, 2, 0, 0}}));
    world_.kill(99);
    d.close();

    a_ = std::make_unique<Connection>(*collector_, world_.spawn(4242, 1, "trainer"));
    ASSERT_FALSE(a_->identity("llama", 0, 0, 2));
    ASSERT_FALSE(a_->register_step(256, "Tokenize"));
    ASSERT_FALSE(
        a_->events({start(1, kForward, 0), end(1, kForward, 500), start(1, kForward, 0),
                    end(1, kForward, 2'000'000), start(1, 256, 0), end(1, 256, 1000),
                    start(1, kMatmul, 0), end(2, kBackward, 10), start(3, kLedgerReserve, 100)}));
    ASSERT_FALSE(a_->ledger(test::reserve_record("GPU-A", 1, 2 * kGiB, "weights", 3, 150)));
    ASSERT_FALSE(a_->events({end(3, kLedgerReserve, 400)}));
    proto::LedgerRecord sample{};
    sample.timestamp_ns = 500;
    sample.bytes = 6 * kGiB;
    sample.total_bytes = 8 * kGiB;
    sample.thread_id = 3;
    sample.op = static_cast<std::uint8_t>(proto::LedgerOp::kVramSample);
    proto::set_field(sample.gpu_uuid, "GPU-B");
    ASSERT_FALSE(a_->ledger(sample));
    ASSERT_FALSE(a_->dropped_by_cause({{3, 0, 1, 0}}));

    Connection b(*collector_, world_.spawn(4243, 2, "trainer"));
    ASSERT_FALSE(b.identity("llama", 1, 1, 2));
    ASSERT_FALSE(b.events(
        {start(1, kForward, 0), end(1, kForward, 20'000'000'000), start(1, kTranspose, 0)}));
    ASSERT_FALSE(b.ledger(test::reserve_record("GPU-B", 2, 1 * kGiB, "kv", 1, 600)));
    world_.kill(4243);
    b.close();

    collector_->refresh_liveness();  // the tick that finds pid 4243's reservation leaked
    ledger::Device device;
    device.name = "Fake";
    device.total_bytes = 80 * kGiB;
    device.used_bytes = 10 * kGiB;
    device.free_bytes = 70 * kGiB;
    device.at_ns = world_.now_ns;
    device.processes_known = true;
    device.processes = {{4242, 3 * kGiB, true}, {555, 1 * kGiB, false}};
    std::map<std::string, ledger::Device, std::less<>> devices;
    devices["GPU-A"] = device;
    collector_->apply_devices(devices, "", world_.now_ns, 2);
    world_.now_ns += 1'500'000'000;
  }

  // The exposition less what differs from run to run: the daemon's own process_*
  // families, its uptime and its build (the version).
  static std::string deterministic(const std::string& text) {
    std::istringstream in(text);
    std::string line, out;
    while (std::getline(in, line)) {
      std::string name = line;
      if (name.starts_with("# HELP ") || name.starts_with("# TYPE ")) name = name.substr(7);
      if (name.starts_with("process_") || name.starts_with("steptrace_uptime_seconds") ||
          name.starts_with("steptrace_build_info"))
        continue;
      out += line + '\n';
    }
    return out;
  }

  FakeWorld world_;
  Limits limits_;
  std::unique_ptr<Collector> collector_;
  std::unique_ptr<Connection> a_;
};

TEST_F(PinnedOutputTest, MetricsOfLiveExitedAndEvictedProcessesAndJobsArePinned) {
  fill();
  ServerCounters server;
  server.protocol_errors["bad_magic"] = 2;
  server.connections_total = 6;
  server.http.accepted = 3;
  server.http.responses = 2;
  const auto view = collector_->freeze(&server);
  // The table is what the file describes: one live, one exited, two evicted.
  ASSERT_EQ(view->processes().size(), 2u);
  ASSERT_EQ(view->table().exited, 1u);
  const std::string text = deterministic(report::metrics_text(*view));
  if (std::getenv("STEPTRACE_UPDATE_GOLDEN") != nullptr) {
    std::ofstream(STEPTRACE_METRICS_GOLDEN, std::ios::binary) << text;
    GTEST_SKIP() << "wrote " << STEPTRACE_METRICS_GOLDEN;
  }
  std::ifstream in(STEPTRACE_METRICS_GOLDEN, std::ios::binary);
  ASSERT_TRUE(in) << STEPTRACE_METRICS_GOLDEN;
  std::stringstream golden;
  golden << in.rdbuf();
  EXPECT_EQ(text, golden.str());
}

TEST_F(PinnedOutputTest, LedgerTextWithADeviceAndAClientSampleIsPinned) {
  fill();
  EXPECT_EQ(report::ledger_text(*collector_->freeze()), R"(GPU GPU-A
  device Fake: used 10.00 GiB of 80.00 GiB   free 70.00 GiB (NVML, sampled 1.50s ago)
  OVER: pid 4242 uses 3.00 GiB, reserved 2.00 GiB
  GHOST: pid 555 uses 1.00 GiB but is not visible here (exited, or in another container)
  total 80.00 GiB   free 70.00 GiB (NVML, sampled 1.50s ago)   reserved 2.00 GiB (high-water 2.00 GiB)   available 78.00 GiB
  Reservations: 1
    ID | PID  | Process | Task    | Size     | Age     | Lease | Holder
    1  | 4242 | trainer | weights | 2.00 GiB | 16m 41s | -     | alive
  Ledger activity per process:
    PID  | Process | Reserves | Releases | Cleanups | Refused | Step          | Count | Time
    4242 | trainer | 1        | 0        | 0        | 0       | LedgerReserve | 1     | 300.00ns

GPU GPU-B
  total 8.00 GiB   free 6.00 GiB (sampled 16m 41s ago)   reserved 1.00 GiB (high-water 1.00 GiB)   available 7.00 GiB
  Reservations: 1 (1 leaked)
    ID | PID  | Process | Task | Size     | Age     | Lease | Holder
    2  | 4243 | trainer | kv   | 1.00 GiB | 16m 41s | -     | LEAKED
  Ledger activity per process:
    PID  | Process | Reserves | Releases | Cleanups | Refused | Step | Count | Time
    4243 | trainer | 1        | 0        | 0        | 0       | -
)");
}

// Item 4 of issue 25: when snapshots fail, stats, metrics and the report say since when,
// and why; when they work, the report says nothing more and the metrics say 0.
TEST_F(ReportTest, SnapshotsFailingShowInStatsMetricsAndTheReport) {
  Connection a(collector_, world_.spawn(4242, 1, "trainer"));
  ASSERT_FALSE(a.events({start(1, kForward, 0), end(1, kForward, 500)}));
  ServerCounters server;
  server.durability.enabled = true;
  server.durability.last_written = 1'796'459'300;
  {
    const auto view = collector_.freeze(&server);
    const json stats = report::stats_json(*view);
    EXPECT_EQ(stats["snapshots"]["failing_since"], nullptr);
    EXPECT_EQ(stats["snapshots"]["last_error"], nullptr);
    EXPECT_EQ(stats["snapshots"]["last_written_unix"], 1'796'459'300);
    const json durable = report::report_json(*view, std::nullopt)["daemon"]["durable"];
    EXPECT_EQ(durable, json::parse(R"({"snapshots": "ok", "failing_since": null,
        "last_error": null, "started_empty_after": null})"));
    EXPECT_EQ(report::report_text(*view, std::nullopt).find("warning:"), std::string::npos);
    const Exposition e(report::metrics_text(*view));
    ASSERT_EQ(e.of("steptrace_snapshot_failing").size(), 1u);
    EXPECT_EQ(e.of("steptrace_snapshot_failing")[0].value, "0");
    EXPECT_EQ(e.of("steptrace_snapshot_last_success_timestamp_seconds")[0].value, "1796459300");
  }
  const std::string enospc = "writing snapshot to /s failed: No space left on device";
  server.durability.failing_since = 1'796'459'401;
  server.durability.last_error = enospc;
  server.snapshot_errors = 3;
  const auto view = collector_.freeze(&server);
  const json stats = report::stats_json(*view);
  EXPECT_EQ(stats["snapshots"]["failing_since"], 1'796'459'401);
  EXPECT_EQ(stats["snapshots"]["last_error"], enospc);
  EXPECT_EQ(stats["snapshots"]["last_written_unix"], 1'796'459'300);
  EXPECT_EQ(stats["snapshots"]["errors"], 3);
  const json durable = report::report_json(*view, std::nullopt)["daemon"]["durable"];
  EXPECT_EQ(durable["snapshots"], "failing");
  EXPECT_EQ(durable["failing_since"], 1'796'459'401);
  EXPECT_EQ(durable["last_error"], enospc);
  const std::string text = report::report_text(*view, std::nullopt);
  EXPECT_NE(text.find("warning: snapshots failing since 2026-12-05 08:30:01 UTC (" + enospc +
                      "): a daemon crash now loses what came since (counted as daemon_crash)\n"),
            std::string::npos)
      << text;
  const std::string stats_text = report::stats_text(*view);
  EXPECT_NE(stats_text.find("snapshots.failing_since: 1796459401\n"), std::string::npos)
      << stats_text;
  EXPECT_NE(stats_text.find("snapshots.last_error: " + enospc + "\n"), std::string::npos);
  const Exposition e(report::metrics_text(*view));
  EXPECT_TRUE(e.errors.empty());
  EXPECT_EQ(e.type.at("steptrace_snapshot_failing"), "gauge");
  EXPECT_EQ(e.of("steptrace_snapshot_failing")[0].value, "1");
  EXPECT_EQ(e.of("steptrace_snapshot_last_success_timestamp_seconds")[0].value, "1796459300");
}

TEST_F(ReportTest, ADaemonThatStartedEmptyOrWithoutStateDirSaysSo) {
  ServerCounters server;  // no state directory: snapshots are off
  {
    const auto view = collector_.freeze(&server);
    const json durable = report::report_json(*view, std::nullopt)["daemon"]["durable"];
    EXPECT_EQ(durable["snapshots"], "off");
    EXPECT_EQ(report::stats_json(*view)["snapshots"]["last_written_unix"], nullptr);
    EXPECT_EQ(report::report_text(*view, std::nullopt).find("warning:"), std::string::npos);
    const Exposition e(report::metrics_text(*view));
    EXPECT_EQ(e.of("steptrace_snapshot_last_success_timestamp_seconds")[0].value, "0");
  }
  server.durability.enabled = true;
  server.durability.started_empty_after = 1'796'459'401;
  server.durability.last_error = "snapshot unusable: bad JSON; moved to /s/x.corrupt-1";
  const auto view = collector_.freeze(&server);
  const json durable = report::report_json(*view, std::nullopt)["daemon"]["durable"];
  EXPECT_EQ(durable["snapshots"], "ok");
  EXPECT_EQ(durable["started_empty_after"], 1'796'459'401);
  const std::string text = report::report_text(*view, std::nullopt);
  EXPECT_NE(text.find("warning: started empty at 2026-12-05 08:30:01 UTC (the snapshot was "
                      "unusable and moved aside): totals from before then are missing\n"),
            std::string::npos)
      << text;
}
// Sums the samples of one metric family in an exposition: how many series, and their total.
std::pair<std::size_t, double> family_totals(const std::string& text, const std::string& name) {
  std::size_t series = 0;
  double total = 0;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + "{", 0) != 0) continue;
    ++series;
    total += std::stod(line.substr(line.rfind(' ') + 1));
  }
  return {series, total};
}

// Issue 27's per-rank series keep what evicted processes left, per (job, rank, step): a
// tenant whose ranks bring ever new step names cannot grow them without bound. Past
// RetiredJob::kMaxJobRankSteps names a rank's new names go to its "(other)": every span
// still counted, the series bounded.
TEST(ReportRankSeries, EvictedRanksStepNamesAreBoundedAndNothingIsLost) {
  FakeWorld world;
  Limits limits;
  limits.max_exited_processes = 1;  // each exit evicts the one before
  Collector collector(limits, world.env());
  constexpr int kRanks = 40, kSteps = 200;  // 8,000 (rank, step) names: past the 4,096
  for (int r = 0; r < kRanks; ++r) {
    const auto pid = static_cast<std::int32_t>(1000 + r);
    Connection c(collector, world.spawn(pid, 1, "rank"));
    ASSERT_FALSE(c.identity("big", static_cast<std::uint32_t>(r), 0, kRanks));
    std::vector<proto::EventRecord> events;
    for (int s = 0; s < kSteps; ++s) {
      const auto id = static_cast<std::uint32_t>(256 + s);
      ASSERT_FALSE(c.register_step(id, "r" + std::to_string(r) + "-s" + std::to_string(s)));
      events.push_back(start(1, id, 10 * s));
      events.push_back(end(1, id, 10 * s + 5));
    }
    ASSERT_FALSE(c.events(events));
    world.kill(pid);
    c.close();
  }
  const std::string metrics = report::metrics_text(*collector.freeze());
  const auto [series, spans] = family_totals(metrics, "steptrace_job_rank_step_spans_total");
  // RetiredJob::kMaxJobRankSteps, an "(other)" a rank, and the last process's own steps
  // (it exited but is still in the table: max_exited_processes 1).
  EXPECT_LE(series, 4096u + kRanks + kSteps) << "series";
  EXPECT_GT(series, 4000u);
  EXPECT_EQ(spans, static_cast<double>(kRanks * kSteps));  // every span, somewhere
  EXPECT_NE(metrics.find("step=\"(other)\""), std::string::npos);
}

}  // namespace
}  // namespace steptrace::daemon
