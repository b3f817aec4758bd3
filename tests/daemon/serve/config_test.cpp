// Config: defaults, the JSON file, flags over the file, and every bad value named.
#include "daemon/serve/config.h"

#include <gtest/gtest.h>

#include <steptrace/version.h>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <vector>

#include "daemon/serve/limit_table.h"
#include "tests/support/daemon_process.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

std::string write_file(const testing::TempDir& dir, const std::string& text) {
  const std::string path = dir.file("steptraced.json");
  std::ofstream(path) << text;
  return path;
}

std::string error_of(const json& doc) {
  Config config;
  auto err = apply_config_json(doc, config);
  return err ? err->message : "";
}

TEST(Config, DefaultsMatchTheDocumentedValues) {
  const Config c;
  EXPECT_EQ(c.socket, "/run/steptrace/steptraced.sock");
  EXPECT_FALSE(c.socket_from_flag);
  EXPECT_EQ(c.socket_mode, 0660u);
  EXPECT_EQ(c.state_dir, "");
  EXPECT_EQ(c.snapshot_interval_s, 1u);
  EXPECT_EQ(c.metrics_listen, "");
  EXPECT_FALSE(c.metrics_address.has_value());
  EXPECT_EQ(c.log_level, "info");
  EXPECT_EQ(c.liveness_interval_ms, 500u);
  EXPECT_EQ(c.server_limits.max_connections, 1024u);
  EXPECT_EQ(c.server_limits.max_frame_bytes, 262144u);
  EXPECT_EQ(c.server_limits.max_line_bytes, 4096u);
  EXPECT_EQ(c.timeouts.handshake_s, 10u);
  EXPECT_EQ(c.timeouts.frame_s, 30u);
  // Per-uid quotas (issue 15): generous for one user, a quarter of a shared table each.
  EXPECT_EQ(c.server_limits.max_connections_per_uid, 256u);
  EXPECT_EQ(c.limits.max_processes_per_uid, 1024u);
  EXPECT_EQ(c.limits.max_gpus_per_uid, 16u);
  EXPECT_EQ(c.limits.max_reservations_per_uid, 4096u);
  EXPECT_EQ(c.timeouts.text_idle_ms, 60000u);
}

TEST(Config, ShippedFileListsEveryKeyWithItsDefault) {
  std::ifstream in(STEPTRACE_DEFAULT_CONFIG);
  ASSERT_TRUE(in) << STEPTRACE_DEFAULT_CONFIG;
  const json shipped = json::parse(in);
  EXPECT_EQ(shipped, config_to_json(Config{}));
  Config c;
  EXPECT_FALSE(apply_config_json(shipped, c).has_value());
}

// The bound the README states, as written there: "1024", "1073741824 (1 GiB)", "2^40",
// "1 MiB", "protocol cap".
std::optional<std::uint64_t> documented_value(std::string text) {
  text.erase(0, text.find_first_not_of(' '));
  text.erase(text.find_last_not_of(' ') + 1);
  if (text == "protocol cap") return proto::kMaxFramePayload;
  if (text.rfind("2^", 0) == 0) return std::uint64_t{1} << std::stoul(text.substr(2));
  std::size_t used = 0;
  const std::uint64_t n = std::stoull(text, &used);
  if (text.substr(used) == " MiB") return n << 20;
  return n;
}

// config/README.md has a row `limits.KEY | default | min .. max` for every row of
// kLimitTable, stating what the code does, and no row for a limit the code lacks.
TEST(Config, TheReadmeDocumentsEveryLimitWithItsDefaultAndBounds) {
  const std::filesystem::path readme =
      std::filesystem::path(STEPTRACE_DEFAULT_CONFIG).parent_path() / "README.md";
  std::ifstream in(readme);
  ASSERT_TRUE(in) << readme;
  std::map<std::string, std::vector<std::string>> rows;  // key -> cells
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("| `limits.", 0) != 0) continue;
    std::vector<std::string> cells;
    std::stringstream ss(line.substr(1));
    for (std::string cell; std::getline(ss, cell, '|');) cells.push_back(cell);
    ASSERT_GE(cells.size(), 3u) << line;
    const std::string key = cells[0].substr(cells[0].find('.') + 1);
    rows[key.substr(0, key.find('`'))] = cells;
  }
  const Config defaults;
  for (const LimitRow& row : kLimitTable) {
    SCOPED_TRACE(std::string(row.key));
    const auto it = rows.find(std::string(row.key));
    ASSERT_NE(it, rows.end()) << "no row in config/README.md";
    const std::string& range = it->second[2];
    const auto dots = range.find("..");
    ASSERT_NE(dots, std::string::npos) << range;
    EXPECT_EQ(documented_value(it->second[1].substr(0, it->second[1].find('('))),
              row.get(defaults));
    EXPECT_EQ(documented_value(range.substr(0, dots)), row.min);
    EXPECT_EQ(documented_value(range.substr(dots + 2)), row.max);
    rows.erase(it);
  }
  EXPECT_TRUE(rows.empty()) << "documented but not in kLimitTable: " << rows.begin()->first;
}

// Each limit takes its bounds and refuses one past either, naming itself.
TEST(Config, EveryLimitTakesItsBoundsAndRefusesOnePastThem) {
  for (const LimitRow& row : kLimitTable) {
    SCOPED_TRACE(std::string(row.key));
    for (const std::uint64_t ok : {row.min, row.max}) {
      Config c;
      EXPECT_FALSE(apply_config_json({{"limits", {{std::string(row.key), ok}}}}, c).has_value());
      EXPECT_EQ(row.get(c), ok);
    }
    if (row.min > 0) {
      EXPECT_NE(error_of({{"limits", {{std::string(row.key), row.min - 1}}}}).find(row.key),
                std::string::npos);
    }
    EXPECT_NE(error_of({{"limits", {{std::string(row.key), row.max + 1}}}}).find(row.key),
              std::string::npos);
  }
}

TEST(Config, FileValuesAreApplied) {
  testing::TempDir dir;
  const auto path = write_file(dir, R"({
    "socket": "/tmp/x.sock", "socket_mode": "0600", "state_dir": "/var/lib/st",
    "snapshot_interval_s": 5, "metrics_listen": "[::1]:9464", "log_level": "debug",
    "liveness_interval_ms": 100,
    "limits": {"max_connections": 8, "max_open_depth": 3, "max_custom_steps": 1024,
               "max_line_bytes": 128, "max_frame_bytes": 4096, "max_connections_per_uid": 3,
               "max_processes_per_uid": 5, "max_gpus_per_uid": 2,
               "max_reservations_per_uid": 7, "max_process_state_bytes": 100000,
               "max_state_bytes": 2000000, "max_snapshot_bytes": 3000000},
    "timeouts": {"handshake_s": 1, "frame_s": 2, "text_idle_ms": 250}})");
  Config c;
  ASSERT_FALSE(load_config_file(path, c).has_value());
  EXPECT_EQ(c.socket, "/tmp/x.sock");
  EXPECT_EQ(c.socket_mode, 0600u);
  EXPECT_EQ(c.state_dir, "/var/lib/st");
  EXPECT_EQ(c.snapshot_interval_s, 5u);
  ASSERT_TRUE(c.metrics_address.has_value());
  EXPECT_EQ(c.metrics_address->host, "::1");
  EXPECT_EQ(c.metrics_address->port, 9464);
  EXPECT_EQ(c.log_level, "debug");
  EXPECT_EQ(c.liveness_interval_ms, 100u);
  EXPECT_EQ(c.server_limits.max_connections, 8u);
  EXPECT_EQ(c.limits.max_open_depth, 3u);
  EXPECT_EQ(c.limits.max_custom_steps, 1024u);
  EXPECT_EQ(c.server_limits.max_line_bytes, 128u);
  EXPECT_EQ(c.server_limits.max_frame_bytes, 4096u);
  EXPECT_EQ(c.timeouts.handshake_s, 1u);
  EXPECT_EQ(c.timeouts.frame_s, 2u);
  EXPECT_EQ(c.server_limits.max_connections_per_uid, 3u);
  EXPECT_EQ(c.limits.max_processes_per_uid, 5u);
  EXPECT_EQ(c.limits.max_gpus_per_uid, 2u);
  EXPECT_EQ(c.limits.max_reservations_per_uid, 7u);
  EXPECT_EQ(c.limits.max_process_state_bytes, 100000u);
  EXPECT_EQ(c.limits.max_state_bytes, 2000000u);
  EXPECT_EQ(c.limits.max_snapshot_bytes, 3000000u);
  EXPECT_EQ(c.timeouts.text_idle_ms, 250u);
  // Keys not in the file keep their defaults.
  EXPECT_EQ(c.limits.max_gpus, Limits{}.max_gpus);
}

TEST(Config, FlagsWinOverTheFile) {
  testing::TempDir dir;
  const auto path = write_file(
      dir, R"({"socket": "/tmp/file.sock", "log_level": "debug", "state_dir": "/from/file",
               "metrics_listen": "127.0.0.1:9000"})");
  const auto cl = parse_command_line({"steptraced", "--config", path, "--socket", "/tmp/flag.sock",
                                      "--log-level", "error", "--state-dir", "/from/flag",
                                      "--metrics-listen", "127.0.0.1:9100"});
  ASSERT_TRUE(cl.config.has_value()) << cl.output;
  EXPECT_EQ(cl.config->socket, "/tmp/flag.sock");
  EXPECT_TRUE(cl.config->socket_from_flag);
  EXPECT_EQ(cl.config->log_level, "error");
  EXPECT_EQ(cl.config->state_dir, "/from/flag");
  EXPECT_EQ(cl.config->metrics_address->port, 9100);
}

TEST(Config, FileOnlyKeepsFileValuesAndSocketIsNotFromFlag) {
  testing::TempDir dir;
  const auto path = write_file(dir, R"({"socket": "/tmp/file.sock"})");
  const auto cl = parse_command_line({"steptraced", "--config", path});
  ASSERT_TRUE(cl.config.has_value()) << cl.output;
  EXPECT_EQ(cl.config->socket, "/tmp/file.sock");
  EXPECT_FALSE(cl.config->socket_from_flag);
}

TEST(Config, UnknownKeysAreNamedAtEveryLevel) {
  EXPECT_EQ(error_of(json{{"sockett", "/x"}}), "config: sockett: unknown key");
  EXPECT_EQ(error_of(json{{"limits", {{"max_conections", 1}}}}),
            "config: limits.max_conections: unknown key");
  EXPECT_EQ(error_of(json{{"timeouts", {{"idle_s", 1}}}}), "config: timeouts.idle_s: unknown key");
}

struct BadValue {
  json doc;
  std::string key;  // the message must name it
};

TEST(Config, EachBadValueIsNamed) {
  const std::vector<BadValue> cases = {
      {{{"socket", 5}}, "socket"},
      {{{"socket", ""}}, "socket"},
      {{{"socket", std::string(200, 'a')}}, "socket"},
      {{{"socket_mode", 660}}, "socket_mode"},
      {{{"socket_mode", "0968"}}, "socket_mode"},
      {{{"socket_mode", "07777"}}, "socket_mode"},
      {{{"state_dir", false}}, "state_dir"},
      {{{"snapshot_interval_s", 0}}, "snapshot_interval_s"},
      {{{"snapshot_interval_s", "30"}}, "snapshot_interval_s"},
      {{{"metrics_listen", "localhost:9464"}}, "metrics_listen"},
      {{{"metrics_listen", "127.0.0.1:0"}}, "metrics_listen"},
      {{{"metrics_listen", "127.0.0.1:70000"}}, "metrics_listen"},
      {{{"metrics_listen", "::1:9464"}}, "metrics_listen"},
      {{{"log_level", "verbose"}}, "log_level"},
      {{{"liveness_interval_ms", -1}}, "liveness_interval_ms"},
      {{{"liveness_interval_ms", 1.5}}, "liveness_interval_ms"},
      {{{"limits", 3}}, "limits"},
      {{{"limits", {{"max_connections", 0}}}}, "limits.max_connections"},
      {{{"limits", {{"max_frame_bytes", 262145}}}}, "limits.max_frame_bytes"},
      {{{"limits", {{"max_line_bytes", true}}}}, "limits.max_line_bytes"},
      {{{"limits", {{"max_processes", 0}}}}, "limits.max_processes"},
      {{{"limits", {{"max_exited_processes", -3}}}}, "limits.max_exited_processes"},
      {{{"limits", {{"max_custom_steps", 1025}}}}, "limits.max_custom_steps"},
      {{{"limits", {{"max_open_depth", 0}}}}, "limits.max_open_depth"},
      {{{"limits", {{"max_threads_per_process", nullptr}}}}, "limits.max_threads_per_process"},
      {{{"limits", {{"max_gpus", 0}}}}, "limits.max_gpus"},
      {{{"limits", {{"max_reservations_per_gpu", 0}}}}, "limits.max_reservations_per_gpu"},
      {{{"timeouts", {{"handshake_s", 0}}}}, "timeouts.handshake_s"},
      {{{"timeouts", {{"frame_s", 99999}}}}, "timeouts.frame_s"},
      {{{"limits", {{"max_connections_per_uid", 0}}}}, "limits.max_connections_per_uid"},
      {{{"limits", {{"max_connections_per_uid", 65537}}}}, "limits.max_connections_per_uid"},
      {{{"limits", {{"max_processes_per_uid", 0}}}}, "limits.max_processes_per_uid"},
      {{{"limits", {{"max_process_state_bytes", 1000}}}}, "limits.max_process_state_bytes"},
      {{{"limits", {{"max_snapshot_bytes", 1000}}}}, "limits.max_snapshot_bytes"},
      {{{"limits", {{"max_state_bytes", 1000}}}}, "limits.max_state_bytes"},
      {{{"limits", {{"max_gpus_per_uid", 0}}}}, "limits.max_gpus_per_uid"},
      {{{"limits", {{"max_gpus_per_uid", 4097}}}}, "limits.max_gpus_per_uid"},
      {{{"limits", {{"max_reservations_per_uid", -1}}}}, "limits.max_reservations_per_uid"},
      {{{"timeouts", {{"text_idle_ms", 99}}}}, "timeouts.text_idle_ms"},
      {{{"timeouts", {{"text_idle_ms", 3600001}}}}, "timeouts.text_idle_ms"},
      {{{"timeouts", {{"text_idle_ms", "60s"}}}}, "timeouts.text_idle_ms"},
  };
  for (const auto& c : cases) {
    const std::string message = error_of(c.doc);
    EXPECT_EQ(message.rfind("config: " + c.key + ": ", 0), 0u)
        << c.doc.dump() << " gave '" << message << "'";
  }
  EXPECT_EQ(error_of(json{{"limits", {{"max_open_depth", 0}}}}),
            "config: limits.max_open_depth: must be an integer in 1..4096");
  EXPECT_EQ(error_of(json{{"limits", {{"max_gpus_per_uid", 0}}}}),
            "config: limits.max_gpus_per_uid: must be an integer in 1..4096");
  EXPECT_EQ(error_of(json{{"timeouts", {{"text_idle_ms", 50}}}}),
            "config: timeouts.text_idle_ms: must be an integer in 100..3600000");
}

// "overhead_rule": the 50% rule's steps, the default and per job ("ID" or "UID:ID").
TEST(Config, OverheadRuleDefaultsAndPerJobOverrides) {
  const Config defaults;
  EXPECT_EQ(defaults.overhead_rules.defaults.compute, (std::vector<std::string>{"Matmul"}));
  EXPECT_EQ(defaults.overhead_rules.defaults.overhead,
            (std::vector<std::string>{"Transpose", "Alloc"}));
  EXPECT_TRUE(defaults.overhead_rules.by_job_id.empty());

  Config c;
  ASSERT_FALSE(
      apply_config_json(json::parse(R"({"overhead_rule": {"overhead_steps": ["Alloc"], "jobs": {
        "bert": {"compute_steps": ["Forward", "Backward"], "overhead_steps": ["DataLoader"]},
        "1001:bert": {"compute_steps": ["Attention"]},
        "1002:12:30": {"overhead_steps": ["Sync"]}}}})"),
                        c));
  const report::OverheadRules& r = c.overhead_rules;
  EXPECT_EQ(r.defaults.compute, (std::vector<std::string>{"Matmul"}));
  EXPECT_EQ(r.defaults.overhead, (std::vector<std::string>{"Alloc"}));
  ASSERT_EQ(r.by_job_id.count("bert"), 1u);
  EXPECT_EQ(r.by_job_id.at("bert").compute, (std::vector<std::string>{"Forward", "Backward"}));
  // A job's list left out is the default's (as the file sets it).
  const report::OverheadRule& uid_rule = r.by_uid_job.at(JobRef{1001, "bert"});
  EXPECT_EQ(uid_rule.compute, (std::vector<std::string>{"Attention"}));
  EXPECT_EQ(uid_rule.overhead, (std::vector<std::string>{"Alloc"}));
  EXPECT_EQ(r.by_uid_job.at(JobRef{1002, "12:30"}).overhead, (std::vector<std::string>{"Sync"}));

  // "UID:ID" wins over "ID"; another uid's "bert" takes "ID"'s; no job, the default.
  EXPECT_EQ(report::rule_for(r, std::nullopt, JobRef{1001, "bert"}).rule, &uid_rule);
  EXPECT_EQ(report::rule_for(r, std::nullopt, JobRef{1003, "bert"}).rule, &r.by_job_id.at("bert"));
  EXPECT_EQ(report::rule_for(r, std::nullopt, JobRef{1003, ""}).rule, &r.defaults);
  EXPECT_EQ(report::rule_for(r, std::nullopt, std::nullopt).source, report::RuleSource::kDefault);

  // config_to_json writes what it read, and reading that gives the same rules.
  Config again;
  ASSERT_FALSE(apply_config_json(config_to_json(c), again));
  EXPECT_EQ(again.overhead_rules.by_uid_job, r.by_uid_job);
  EXPECT_EQ(again.overhead_rules.by_job_id, r.by_job_id);
  EXPECT_EQ(again.overhead_rules.defaults, r.defaults);
}

TEST(Config, BadOverheadRulesAreNamed) {
  const auto rule = [](const char* text) {
    return error_of(json{{"overhead_rule", json::parse(text)}});
  };
  EXPECT_EQ(rule(R"({"compute": ["Matmul"]})"), "config: overhead_rule.compute: unknown key");
  EXPECT_EQ(rule(R"({"compute_steps": []})"),
            "config: overhead_rule.compute_steps: must be a list of step names: needs at least "
            "one step");
  EXPECT_EQ(rule(R"({"overhead_steps": ["Matmul"]})"),
            "config: overhead_rule.overhead_steps: step Matmul is in both compute_steps and "
            "overhead_steps");
  EXPECT_EQ(rule(R"({"compute_steps": ["A", "A"]})"),
            "config: overhead_rule.compute_steps: must be a list of step names: names A twice");
  EXPECT_EQ(
      rule(R"({"compute_steps": ["a b"]})")
          .rfind("config: overhead_rule.compute_steps: must be a list of step names: a step name "
                 "has 1..63",
                 0),
      0u);
  EXPECT_EQ(rule(R"({"compute_steps": ["Matmul,Alloc"]})")
                .rfind("config: overhead_rule.compute_steps: must be a list of step names", 0),
            0u);
  EXPECT_EQ(
      rule(R"({"compute_steps": "Matmul"})").rfind("config: overhead_rule.compute_steps: ", 0), 0u);
  EXPECT_EQ(rule(R"({"compute_steps": [5]})").rfind("config: overhead_rule.compute_steps[0]: ", 0),
            0u);
  EXPECT_EQ(rule(R"({"jobs": {"bert": {"compute_steps": ["Alloc"]}}})"),
            "config: overhead_rule.jobs.bert.compute_steps: step Alloc is in both compute_steps "
            "and overhead_steps");
  EXPECT_EQ(rule(R"({"jobs": {"bert": {"compute_step": ["Alloc"]}}})"),
            "config: overhead_rule.jobs.bert.compute_step: unknown key");
  EXPECT_EQ(
      rule(R"({"jobs": {"a b": {}}})").rfind(R"(config: overhead_rule.jobs["a b"]: a job is)", 0),
      0u);
  std::vector<std::string> many;
  for (int i = 0; i <= 64; ++i) many.push_back("S" + std::to_string(i));
  EXPECT_EQ(error_of(json{{"overhead_rule", {{"compute_steps", many}}}}),
            "config: overhead_rule.compute_steps: must be a list of step names: takes at most 64 "
            "steps");
  // A bad rule leaves the config's as it was.
  Config c;
  EXPECT_TRUE(apply_config_json(json::parse(R"({"overhead_rule": {"compute_steps": ["X"],
      "overhead_steps": ["X"]}})"),
                                c));
  EXPECT_EQ(c.overhead_rules.defaults, report::default_overhead_rule());
}

TEST(Config, DocumentMustBeAnObjectAndValidJson) {
  EXPECT_FALSE(error_of(json::array()).empty());
  testing::TempDir dir;
  Config c;
  auto err = load_config_file(write_file(dir, "{ not json"), c);
  ASSERT_TRUE(err.has_value());
  EXPECT_NE(err->message.find("not valid JSON"), std::string::npos);
  err = load_config_file(dir.file("missing.json"), c);
  ASSERT_TRUE(err.has_value());
  EXPECT_NE(err->message.find("cannot read"), std::string::npos);
}

TEST(Config, BadFlagValuesAreUsageErrors) {
  auto cl = parse_command_line({"steptraced", "--log-level", "loud"});
  EXPECT_FALSE(cl.config.has_value());
  EXPECT_EQ(cl.exit_code, 2);
  EXPECT_EQ(cl.output.rfind("steptraced: --log-level: ", 0), 0u) << cl.output;

  cl = parse_command_line({"steptraced", "--metrics-listen", "nowhere"});
  EXPECT_EQ(cl.exit_code, 2);
  EXPECT_NE(cl.output.find("--metrics-listen"), std::string::npos) << cl.output;

  cl = parse_command_line({"steptraced", "--no-such-flag"});
  EXPECT_FALSE(cl.config.has_value());
  EXPECT_EQ(cl.exit_code, 2);
  EXPECT_NE(cl.output.find("no-such-flag"), std::string::npos) << cl.output;

  cl = parse_command_line({"steptraced", "--socket"});
  EXPECT_EQ(cl.exit_code, 2);
}

TEST(Config, HelpAndVersionExitZero) {
  auto cl = parse_command_line({"steptraced", "--help"});
  EXPECT_FALSE(cl.config.has_value());
  EXPECT_EQ(cl.exit_code, 0);
  for (const char* needle :
       {"--socket", "--config", "--state-dir", "--metrics-listen", "--log-level", "--version",
        "/run/steptrace/steptraced.sock", "STEPTRACE_SOCKET", "LISTEN_FDS", "steptraced.json",
        "config/README.md"}) {
    EXPECT_NE(cl.output.find(needle), std::string::npos) << needle;
  }
  cl = parse_command_line({"steptraced", "--version"});
  EXPECT_EQ(cl.exit_code, 0);
  EXPECT_NE(cl.output.find(STEPTRACE_VERSION_STRING), std::string::npos) << cl.output;
}

TEST(Config, ListenAddressAndModeParsers) {
  auto a = parse_listen_address("127.0.0.1:9464");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 9464);
  EXPECT_FALSE(parse_listen_address("127.0.0.1"));
  EXPECT_FALSE(parse_listen_address("[::1]9464"));
  EXPECT_FALSE(parse_listen_address("1.2.3.4:12ab"));
  EXPECT_EQ(parse_socket_mode("660"), 0660u);
  EXPECT_EQ(parse_socket_mode("0777"), 0777u);
  EXPECT_FALSE(parse_socket_mode("rw"));
  EXPECT_FALSE(parse_socket_mode("0"));
}

}  // namespace
}  // namespace steptrace::daemon
