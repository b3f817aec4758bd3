#include "daemon/serve/config.h"
#include "daemon/serve/limit_table.h"

#include <steptrace/version.h>
#include <sys/un.h>

#include <CLI/CLI.hpp>
#include <boost/asio/ip/address.hpp>
#include <charconv>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "daemon/persist/json_reader.h"
#include "proto/commands.h"
#include "proto/rule_steps.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using Error = std::optional<ConfigError>;

Error fail(const std::string& key, const std::string& what) {
  return ConfigError{"config: " + key + ": " + what};
}

// Why a value is not acceptable ("must be ..."), or nullopt when it is.
using Problem = std::optional<std::string>;

// Config strings are paths and short words; any bytes, as the OS takes them.
constexpr StringRule kConfigString{0, 4096, /*printable=*/false};

Problem socket_path_problem(const std::string& path) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return "must be a non-empty path shorter than " +
           std::to_string(sizeof(sockaddr_un{}.sun_path)) + " bytes";
  }
  return std::nullopt;
}

Problem set_metrics_listen(const std::string& text, Config& config) {
  if (text.empty()) {
    config.metrics_listen.clear();
    config.metrics_address.reset();
    return std::nullopt;
  }
  auto address = parse_listen_address(text);
  if (!address) {
    return "must be \"\" or ADDR:PORT with a numeric address and a port in 1..65535 "
           "(IPv6 as [::1]:9464), got \"" +
           text + "\"";
  }
  config.metrics_listen = text;
  config.metrics_address = std::move(address);
  return std::nullopt;
}

Problem set_nvml_mode(const std::string& mode, Config& config) {
  if (mode == "off") {
    config.nvml.mode = NvmlMode::kOff;
  } else if (mode == "auto") {
    config.nvml.mode = NvmlMode::kAuto;
  } else if (mode == "on") {
    config.nvml.mode = NvmlMode::kOn;
  } else {
    return "must be \"off\", \"auto\" or \"on\"";
  }
  return std::nullopt;
}

const char* nvml_mode_name(NvmlMode mode) {
  switch (mode) {
    case NvmlMode::kOff:
      return "off";
    case NvmlMode::kOn:
      return "on";
    case NvmlMode::kAuto:
      break;
  }
  return "auto";
}

Problem set_log_level(const std::string& level, Config& config) {
  if (!valid_log_level(level)) {
    return "must be one of trace, debug, info, warn, error, critical, off; got \"" + level + "\"";
  }
  config.log_level = level;
  return std::nullopt;
}

// The string at `key`, when present, handed to `apply`: a Problem it returns is an error
// at `key`.
template <typename Apply>
void read_string_key(JsonObject& obj, std::string_view key, Apply apply) {
  std::string text;
  if (!obj.has(key) || !obj.get_string(key, text, kConfigString)) return;
  if (Problem why = apply(text)) obj.fail_at(key, *why);
}

void read_limits(JsonObject limits, Config& c) {
  for (const LimitRow& row : kLimitTable) {
    std::uint64_t value = row.get(c);
    if (limits.optional_unsigned(row.key, value, row.min, row.max)) row.set(c, value);
  }
  limits.finish();
}

void read_timeouts(JsonObject timeouts, Config& c) {
  timeouts.optional_unsigned("handshake_s", c.timeouts.handshake_s, 1, 3600);
  timeouts.optional_unsigned("frame_s", c.timeouts.frame_s, 1, 3600);
  timeouts.optional_unsigned("text_idle_ms", c.timeouts.text_idle_ms, 100, 3'600'000);
  timeouts.finish();
}

// "rank_skew": when a rank is flagged a straggler (state/rank_skew.h). The JSON reader
// takes integers only: the ratio is in percent of the median, the spread in MADs.
void read_rank_skew(JsonObject o, Config& c) {
  RankSkewRules& r = c.limits.rank_skew;
  std::uint64_t ratio_pct = static_cast<std::uint64_t>(r.ratio * 100.0 + 0.5);
  if (o.optional_unsigned("straggler_ratio_pct", ratio_pct, 101, 10000)) {
    r.ratio = static_cast<double>(ratio_pct) / 100.0;
  }
  std::uint64_t mads = static_cast<std::uint64_t>(r.mad_factor + 0.5);
  if (o.optional_unsigned("straggler_mads", mads, 0, 100)) r.mad_factor = static_cast<double>(mads);
  o.optional_unsigned("straggler_min_spans", r.min_spans, 1, 1'000'000);
  o.optional_unsigned("sample_interval_ms", r.sample_interval_ms, 100, 3'600'000);
  o.optional_unsigned("window_samples", r.window_samples, 0, 1024);
  if (o.has("waiting_steps")) {
    JsonArray steps = o.array("waiting_steps", 64);
    std::vector<std::string> names(steps.size());
    for (std::size_t i = 0; i < steps.size(); ++i) {
      if (!steps.get_string(i, names[i], kConfigString)) return;
    }
    r.waiting_steps = std::move(names);
  }
  o.finish();
}

// A list of the 50% rule's steps at `key`, when present, into `steps`.
void read_rule_steps(JsonObject& o, std::string_view key, std::vector<std::string>& steps) {
  if (!o.has(key)) return;
  // One past the bound, so that too long a list gets rule_steps_problem's message.
  JsonArray array = o.array(key, proto::kMaxRuleSteps + 1);
  std::vector<std::string> names(array.size());
  constexpr StringRule kStepName{0, 4096, /*printable=*/false};
  for (std::size_t i = 0; i < array.size(); ++i) {
    if (!array.get_string(i, names[i], kStepName)) return;
  }
  if (auto why = proto::rule_steps_problem(names)) {
    o.fail_at(key, "must be a list of step names: " + *why);
    return;
  }
  steps = std::move(names);
}

// The two lists of one rule (the default's, or a job's over the default); a step in
// both is an error.
bool read_rule(JsonObject& o, report::OverheadRule& rule) {
  read_rule_steps(o, "compute_steps", rule.compute);
  read_rule_steps(o, "overhead_steps", rule.overhead);
  if (auto both = proto::rule_steps_overlap(rule.compute, rule.overhead)) {
    return o.fail_at(o.has("overhead_steps") ? "overhead_steps" : "compute_steps",
                     "step " + *both + " is in both compute_steps and overhead_steps");
  }
  return true;
}

// "overhead_rule": {"compute_steps": [...], "overhead_steps": [...], "jobs": {"ID" or
// "UID:ID": {either list}}}; a job's list left out is the default's.
void read_overhead_rule(JsonObject o, Config& c) {
  report::OverheadRules rules;
  if (!read_rule(o, rules.defaults)) return;
  if (auto jobs = o.optional_object("jobs")) {
    for (const std::string_view key : jobs->keys()) {
      const auto job = proto::parse_job_option(key);
      if (!job) {
        jobs->fail_at(key,
                      "a job is ID (any uid's job with that id) or UID:ID (that uid's), as "
                      "--job takes it");
        return;
      }
      report::OverheadRule rule = rules.defaults;
      JsonObject entry = jobs->object(key);
      if (!read_rule(entry, rule) || !entry.finish()) return;
      if (job->uid) {
        rules.by_uid_job[JobRef{*job->uid, std::string(job->id)}] = std::move(rule);
      } else {
        rules.by_job_id[std::string(job->id)] = std::move(rule);
      }
    }
    if (!jobs->finish()) return;
  }
  if (o.finish()) c.overhead_rules = std::move(rules);
}

// Every key is optional: one left out keeps the value `c` has.
void read_config(JsonObject top, Config& c) {
  read_string_key(top, "socket", [&c](const std::string& path) -> Problem {
    if (Problem why = socket_path_problem(path)) return why;
    c.socket = path;
    return std::nullopt;
  });
  read_string_key(top, "socket_mode", [&c](const std::string& text) -> Problem {
    const auto mode = parse_socket_mode(text);
    if (!mode) return "must be a string of octal digits such as \"0660\"";
    c.socket_mode = *mode;
    return std::nullopt;
  });
  top.optional_string("state_dir", c.state_dir, kConfigString);
  top.optional_unsigned("snapshot_interval_s", c.snapshot_interval_s, 1, 86400);
  read_string_key(top, "metrics_listen",
                  [&c](const std::string& text) { return set_metrics_listen(text, c); });
  read_string_key(top, "log_level",
                  [&c](const std::string& level) { return set_log_level(level, c); });
  top.optional_unsigned("liveness_interval_ms", c.liveness_interval_ms, 10, 60000);
  std::size_t recorder_bytes = c.flight_recorder.budget_bytes;
  if (top.optional_unsigned("flight_recorder_bytes", recorder_bytes, 0, std::uint64_t{1} << 40)) {
    if (recorder_bytes != 0 && recorder_bytes < (1u << 20)) {
      top.fail_at("flight_recorder_bytes", "must be 0 (off) or at least 1048576 (1 MiB)");
    }
    c.flight_recorder.budget_bytes = recorder_bytes;
  }
  std::uint64_t horizon_s = c.flight_recorder.horizon_ns / 1'000'000'000;
  if (top.optional_unsigned("flight_recorder_seconds", horizon_s, 1, 86400)) {
    c.flight_recorder.horizon_ns = horizon_s * 1'000'000'000;
  }
  read_string_key(top, "nvml", [&c](const std::string& mode) { return set_nvml_mode(mode, c); });
  top.optional_string("nvml_library", c.nvml.library, kConfigString);
  top.optional_unsigned("nvml_interval_ms", c.nvml.interval_ms, 100, 3'600'000);
  top.optional_unsigned("nvml_over_tolerance_pct", c.nvml.rules.over_tolerance_pct, 0, 1000);
  std::uint64_t idle_s = c.nvml.rules.idle_ns / 1'000'000'000;
  if (top.optional_unsigned("nvml_idle_s", idle_s, 1, 86400 * 7)) {
    c.nvml.rules.idle_ns = idle_s * 1'000'000'000;
  }
  if (auto limits = top.optional_object("limits")) read_limits(std::move(*limits), c);
  if (auto timeouts = top.optional_object("timeouts")) read_timeouts(std::move(*timeouts), c);
  if (auto skew = top.optional_object("rank_skew")) read_rank_skew(std::move(*skew), c);
  if (auto rule = top.optional_object("overhead_rule")) read_overhead_rule(std::move(*rule), c);
  top.finish();
}

std::string mode_string(unsigned mode) {
  char buf[8];
  std::snprintf(buf, sizeof buf, "%04o", mode);
  return buf;
}

}  // namespace

std::optional<ListenAddress> parse_listen_address(const std::string& text) {
  std::string host;
  std::string port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') {
      return std::nullopt;
    }
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
    boost::system::error_code ec;
    (void)boost::asio::ip::make_address_v6(host, ec);
    if (ec) return std::nullopt;
  } else {
    const auto colon = text.rfind(':');
    if (colon == std::string::npos) return std::nullopt;
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
    boost::system::error_code ec;
    (void)boost::asio::ip::make_address_v4(host, ec);
    if (ec) return std::nullopt;
  }
  unsigned port = 0;
  const auto* end = port_text.data() + port_text.size();
  const auto [ptr, ec] = std::from_chars(port_text.data(), end, port);
  if (port_text.empty() || ec != std::errc{} || ptr != end || port < 1 || port > 65535) {
    return std::nullopt;
  }
  return ListenAddress{host, static_cast<std::uint16_t>(port)};
}

std::optional<unsigned> parse_socket_mode(const std::string& text) {
  if (text.size() < 3 || text.size() > 4) return std::nullopt;
  unsigned mode = 0;
  for (char c : text) {
    if (c < '0' || c > '7') return std::nullopt;
    mode = mode * 8 + static_cast<unsigned>(c - '0');
  }
  if (mode > 0777) return std::nullopt;
  return mode;
}

bool valid_log_level(const std::string& level) {
  static const char* const kLevels[] = {"trace", "debug",    "info", "warn",
                                        "error", "critical", "off"};
  for (const char* l : kLevels) {
    if (level == l) return true;
  }
  return false;
}

std::optional<ConfigError> apply_config_json(const json& doc, Config& config) {
  if (!doc.is_object()) return ConfigError{"config: the document must be a JSON object"};
  JsonReader reader;
  read_config(reader.object(doc), config);
  if (const auto& error = reader.error()) return ConfigError{"config: " + error->message()};
  return std::nullopt;
}

std::optional<ConfigError> load_config_file(const std::string& path, Config& config) {
  std::ifstream in(path);
  if (!in) return ConfigError{"config: cannot read " + path};
  json doc = json::parse(in, nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/false);
  if (doc.is_discarded()) return ConfigError{"config: " + path + ": not valid JSON"};
  return apply_config_json(doc, config);
}

namespace {
// Flag errors read "steptraced: --flag: ..." rather than "config: ...".
std::optional<ConfigError> as_flag_error(std::optional<ConfigError> err) {
  if (err && err->message.rfind("config: ", 0) == 0) {
    err->message = "steptraced: " + err->message.substr(8);
  }
  return err;
}
std::optional<ConfigError> apply_flags_unprefixed(const Flags& flags, Config& config);
}  // namespace

std::optional<ConfigError> apply_flags(const Flags& flags, Config& config) {
  return as_flag_error(apply_flags_unprefixed(flags, config));
}

namespace {
std::optional<ConfigError> apply_flags_unprefixed(const Flags& flags, Config& config) {
  if (flags.socket) {
    if (Problem why = socket_path_problem(*flags.socket)) return fail("--socket", *why);
    config.socket = *flags.socket;
    config.socket_from_flag = true;
  }
  if (flags.state_dir) config.state_dir = *flags.state_dir;
  if (flags.metrics_listen) {
    if (Problem why = set_metrics_listen(*flags.metrics_listen, config)) {
      return fail("--metrics-listen", *why);
    }
  }
  if (flags.log_level) {
    if (Problem why = set_log_level(*flags.log_level, config)) return fail("--log-level", *why);
  }
  if (flags.nvml) {
    if (Problem why = set_nvml_mode(*flags.nvml, config)) return fail("--nvml", *why);
  }
  return std::nullopt;
}
}  // namespace

namespace {
json limits_json(const Config& c) {
  json out = json::object();
  for (const LimitRow& row : kLimitTable) out[std::string(row.key)] = row.get(c);
  return out;
}

json rule_json(const report::OverheadRule& rule) {
  return {{"compute_steps", rule.compute}, {"overhead_steps", rule.overhead}};
}

json overhead_rule_json(const report::OverheadRules& rules) {
  json jobs = json::object();
  for (const auto& [id, rule] : rules.by_job_id) jobs[id] = rule_json(rule);
  for (const auto& [job, rule] : rules.by_uid_job) {
    jobs[std::to_string(job.uid) + ":" + job.job] = rule_json(rule);
  }
  json out = rule_json(rules.defaults);
  out["jobs"] = std::move(jobs);
  return out;
}

}  // namespace

json config_to_json(const Config& c) {
  return json{
      {"socket", c.socket},
      {"socket_mode", mode_string(c.socket_mode)},
      {"state_dir", c.state_dir},
      {"snapshot_interval_s", c.snapshot_interval_s},
      {"metrics_listen", c.metrics_listen},
      {"log_level", c.log_level},
      {"liveness_interval_ms", c.liveness_interval_ms},
      {"flight_recorder_bytes", c.flight_recorder.budget_bytes},
      {"nvml", nvml_mode_name(c.nvml.mode)},
      {"nvml_library", c.nvml.library},
      {"nvml_interval_ms", c.nvml.interval_ms},
      {"nvml_over_tolerance_pct", c.nvml.rules.over_tolerance_pct},
      {"nvml_idle_s", c.nvml.rules.idle_ns / 1'000'000'000},
      {"flight_recorder_seconds", c.flight_recorder.horizon_ns / 1'000'000'000},
      {"limits", limits_json(c)},
      {"timeouts",
       {{"handshake_s", c.timeouts.handshake_s},
        {"frame_s", c.timeouts.frame_s},
        {"text_idle_ms", c.timeouts.text_idle_ms}}},
      {"rank_skew",
       {{"straggler_ratio_pct", static_cast<std::uint64_t>(c.limits.rank_skew.ratio * 100.0 + 0.5)},
        {"straggler_mads", static_cast<std::uint64_t>(c.limits.rank_skew.mad_factor + 0.5)},
        {"straggler_min_spans", c.limits.rank_skew.min_spans},
        {"waiting_steps", c.limits.rank_skew.waiting_steps},
        {"sample_interval_ms", c.limits.rank_skew.sample_interval_ms},
        {"window_samples", c.limits.rank_skew.window_samples}}},
      {"overhead_rule", overhead_rule_json(c.overhead_rules)},
  };
}

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CLI::App app{
      "steptraced - the steptrace daemon. Collects span events and VRAM-ledger annotations "
      "from training processes (libsteptrace) over a Unix socket, aggregates them per process "
      "and step, and answers text commands (ping, report, ledger, stats, metrics, reset, "
      "version, trace, help) on the same socket. Ask it with the steptrace CLI: steptrace "
      "ping | report | ledger [cleanup] | stats | metrics | reset | version | top | trace | "
      "help (`steptrace help COMMAND`, man steptrace).",
      "steptraced"};
  std::string socket, config_file, state_dir, metrics_listen, log_level, nvml;
  auto* socket_opt = app.add_option("--socket", socket,
                                    std::string("Unix socket to listen on (default: a socket "
                                                "passed by systemd, else the config's "
                                                "\"socket\", else ") +
                                        kDefaultSocketPath + ")")
                         ->type_name("PATH");
  auto* config_opt = app.add_option("--config", config_file,
                                    "JSON config file (example with every key at its default: "
                                    "config/steptraced.json; each key's meaning and range: "
                                    "config/README.md); flags below win over the file")
                         ->type_name("FILE");
  auto* state_opt = app.add_option("--state-dir", state_dir,
                                   "directory for snapshots of the aggregates (default: none)")
                        ->type_name("DIR");
  auto* metrics_opt =
      app.add_option("--metrics-listen", metrics_listen,
                     "serve GET /metrics (Prometheus) over HTTP on ADDR:PORT, IPv6 as [::1]:9464")
          ->type_name("ADDR:PORT");
  auto* level_opt =
      app.add_option("--log-level", log_level,
                     "trace|debug|info|warn|error|critical|off (default info; logs go to stderr)")
          ->type_name("LEVEL");
  auto* nvml_opt = app.add_option("--nvml", nvml,
                                  "off|auto|on: sample GPU memory through NVML "
                                  "(libnvidia-ml.so.1, loaded at run time); auto (default) "
                                  "runs without it when the library or a GPU is absent, on "
                                  "refuses to start then")
                       ->type_name("MODE");
  app.set_version_flag("--version", std::string("steptraced ") + STEPTRACE_VERSION_STRING +
                                        " (protocol " + std::to_string(proto::kProtocolVersion) +
                                        ")");
  app.footer(
      std::string("Flags override the config file. Environment: LISTEN_FDS/LISTEN_PID "
                  "(systemd socket activation, used when --socket is not given), NOTIFY_SOCKET "
                  "(systemd readiness). Clients and the steptrace CLI find the daemon through "
                  "STEPTRACE_SOCKET, default ") +
      kDefaultSocketPath + ".");

  std::vector<const char*> argv;
  for (const auto& a : args) argv.push_back(a.c_str());
  CommandLine result;
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    std::ostringstream out, err;
    const int code = app.exit(e, out, err);
    result.exit_code = code == 0 ? 0 : 2;
    result.output = out.str() + err.str();
    return result;
  }

  Flags flags;
  if (socket_opt->count() > 0) flags.socket = socket;
  if (config_opt->count() > 0) flags.config_file = config_file;
  if (state_opt->count() > 0) flags.state_dir = state_dir;
  if (metrics_opt->count() > 0) flags.metrics_listen = metrics_listen;
  if (level_opt->count() > 0) flags.log_level = log_level;
  if (nvml_opt->count() > 0) flags.nvml = nvml;

  Config config;
  std::optional<ConfigError> err;
  if (flags.config_file) err = load_config_file(*flags.config_file, config);
  if (!err) err = apply_flags(flags, config);
  if (err) {
    result.exit_code = 2;
    result.output = err->message + "\n";
    return result;
  }
  result.config = std::move(config);
  return result;
}

}  // namespace steptrace::daemon
