#include "daemon/serve/config.h"

#include <sys/un.h>

#include <CLI/CLI.hpp>
#include <boost/asio/ip/address.hpp>
#include <charconv>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using Error = std::optional<ConfigError>;

Error fail(const std::string& key, const std::string& what) {
  return ConfigError{"config: " + key + ": " + what};
}

template <typename T>
Error read_uint(const json& value, const std::string& key, std::uint64_t min, std::uint64_t max,
                T& out) {
  const std::string range =
      "must be an integer in " + std::to_string(min) + ".." + std::to_string(max);
  if (!value.is_number_integer()) return fail(key, range);
  if (value.is_number_unsigned()) {
    const auto v = value.get<std::uint64_t>();
    if (v < min || v > max) return fail(key, range);
    out = static_cast<T>(v);
    return std::nullopt;
  }
  const auto v = value.get<std::int64_t>();
  if (v < 0 || static_cast<std::uint64_t>(v) < min || static_cast<std::uint64_t>(v) > max) {
    return fail(key, range);
  }
  out = static_cast<T>(v);
  return std::nullopt;
}

Error read_string(const json& value, const std::string& key, std::string& out) {
  if (!value.is_string()) return fail(key, "must be a string");
  out = value.get<std::string>();
  return std::nullopt;
}

Error check_socket_path(const std::string& path, const std::string& key) {
  if (path.empty() || path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return fail(key, "must be a non-empty path shorter than " +
                         std::to_string(sizeof(sockaddr_un{}.sun_path)) + " bytes");
  }
  return std::nullopt;
}

Error set_metrics_listen(const std::string& text, const std::string& key, Config& config) {
  if (text.empty()) {
    config.metrics_listen.clear();
    config.metrics_address.reset();
    return std::nullopt;
  }
  auto address = parse_listen_address(text);
  if (!address) {
    return fail(key,
                "must be \"\" or ADDR:PORT with a numeric address and a port in 1..65535 "
                "(IPv6 as [::1]:9464), got \"" +
                    text + "\"");
  }
  config.metrics_listen = text;
  config.metrics_address = std::move(address);
  return std::nullopt;
}

Error set_log_level(const std::string& level, const std::string& key, Config& config) {
  if (!valid_log_level(level)) {
    return fail(key, "must be one of trace, debug, info, warn, error, critical, off; got \"" +
                         level + "\"");
  }
  config.log_level = level;
  return std::nullopt;
}

// One handler per key of an object; unknown keys are errors.
using KeyHandler = std::function<Error(const json& value, const std::string& key, Config&)>;
using KeyTable = std::map<std::string, KeyHandler, std::less<>>;

Error apply_object(const json& obj, const std::string& prefix, const KeyTable& table,
                   Config& config) {
  if (!obj.is_object()) {
    return prefix.empty() ? ConfigError{"config: the document must be a JSON object"}
                          : fail(prefix, "must be an object");
  }
  for (const auto& [name, value] : obj.items()) {
    const std::string key = prefix.empty() ? name : prefix + "." + name;
    auto it = table.find(name);
    if (it == table.end()) return fail(key, "unknown key");
    if (auto err = it->second(value, key, config)) return err;
  }
  return std::nullopt;
}

template <typename T>
KeyHandler uint_key(T Config::*member, std::uint64_t min, std::uint64_t max) {
  return [member, min, max](const json& v, const std::string& key, Config& c) {
    return read_uint(v, key, min, max, c.*member);
  };
}
template <typename T>
KeyHandler limit_key(T Limits::*member, std::uint64_t min, std::uint64_t max) {
  return [member, min, max](const json& v, const std::string& key, Config& c) {
    return read_uint(v, key, min, max, c.limits.*member);
  };
}
template <typename T>
KeyHandler server_limit_key(T ServerLimits::*member, std::uint64_t min, std::uint64_t max) {
  return [member, min, max](const json& v, const std::string& key, Config& c) {
    return read_uint(v, key, min, max, c.server_limits.*member);
  };
}
template <typename T>
KeyHandler timeout_key(T Timeouts::*member, std::uint64_t min, std::uint64_t max) {
  return [member, min, max](const json& v, const std::string& key, Config& c) {
    return read_uint(v, key, min, max, c.timeouts.*member);
  };
}

const KeyTable& limits_table() {
  static const KeyTable kTable{
      {"max_connections", server_limit_key(&ServerLimits::max_connections, 1, 65536)},
      // A frame must at least hold the largest fixed record (a LedgerRecord).
      {"max_frame_bytes",
       server_limit_key(&ServerLimits::max_frame_bytes, 256, proto::kMaxFramePayload)},
      {"max_line_bytes", server_limit_key(&ServerLimits::max_line_bytes, 64, 1 << 20)},
      {"max_processes", limit_key(&Limits::max_processes, 1, 1'000'000)},
      {"max_exited_processes", limit_key(&Limits::max_exited_processes, 0, 1'000'000)},
      {"max_custom_steps", limit_key(&Limits::max_custom_steps, 0, proto::kMaxCustomSteps)},
      {"max_open_depth", limit_key(&Limits::max_open_depth, 1, 4096)},
      {"max_threads_per_process", limit_key(&Limits::max_threads_per_process, 1, 65536)},
      {"max_gpus", limit_key(&Limits::max_gpus, 1, 4096)},
      {"max_reservations_per_gpu", limit_key(&Limits::max_reservations_per_gpu, 1, 1'000'000)},
  };
  return kTable;
}

const KeyTable& timeouts_table() {
  static const KeyTable kTable{
      {"handshake_s", timeout_key(&Timeouts::handshake_s, 1, 3600)},
      {"frame_s", timeout_key(&Timeouts::frame_s, 1, 3600)},
  };
  return kTable;
}

const KeyTable& top_table() {
  static const KeyTable kTable{
      {"socket",
       [](const json& v, const std::string& key, Config& c) -> Error {
         std::string path;
         if (auto err = read_string(v, key, path)) return err;
         if (auto err = check_socket_path(path, key)) return err;
         c.socket = path;
         return std::nullopt;
       }},
      {"socket_mode",
       [](const json& v, const std::string& key, Config& c) -> Error {
         const char* what = "must be a string of octal digits such as \"0660\"";
         if (!v.is_string()) return fail(key, what);
         auto mode = parse_socket_mode(v.get<std::string>());
         if (!mode) return fail(key, what);
         c.socket_mode = *mode;
         return std::nullopt;
       }},
      {"state_dir", [](const json& v, const std::string& key,
                       Config& c) { return read_string(v, key, c.state_dir); }},
      {"snapshot_interval_s", uint_key(&Config::snapshot_interval_s, 1, 86400)},
      {"metrics_listen",
       [](const json& v, const std::string& key, Config& c) -> Error {
         std::string text;
         if (auto err = read_string(v, key, text)) return err;
         return set_metrics_listen(text, key, c);
       }},
      {"log_level",
       [](const json& v, const std::string& key, Config& c) -> Error {
         std::string level;
         if (auto err = read_string(v, key, level)) return err;
         return set_log_level(level, key, c);
       }},
      {"liveness_interval_ms", uint_key(&Config::liveness_interval_ms, 10, 60000)},
      {"limits", [](const json& v, const std::string& key,
                    Config& c) { return apply_object(v, key, limits_table(), c); }},
      {"timeouts", [](const json& v, const std::string& key,
                      Config& c) { return apply_object(v, key, timeouts_table(), c); }},
  };
  return kTable;
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
  return apply_object(doc, "", top_table(), config);
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
    if (auto err = check_socket_path(*flags.socket, "--socket")) return err;
    config.socket = *flags.socket;
    config.socket_from_flag = true;
  }
  if (flags.state_dir) config.state_dir = *flags.state_dir;
  if (flags.metrics_listen) {
    if (auto err = set_metrics_listen(*flags.metrics_listen, "--metrics-listen", config)) {
      return err;
    }
  }
  if (flags.log_level) {
    if (auto err = set_log_level(*flags.log_level, "--log-level", config)) return err;
  }
  return std::nullopt;
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
      {"limits",
       {{"max_connections", c.server_limits.max_connections},
        {"max_frame_bytes", c.server_limits.max_frame_bytes},
        {"max_line_bytes", c.server_limits.max_line_bytes},
        {"max_processes", c.limits.max_processes},
        {"max_exited_processes", c.limits.max_exited_processes},
        {"max_custom_steps", c.limits.max_custom_steps},
        {"max_open_depth", c.limits.max_open_depth},
        {"max_threads_per_process", c.limits.max_threads_per_process},
        {"max_gpus", c.limits.max_gpus},
        {"max_reservations_per_gpu", c.limits.max_reservations_per_gpu}}},
      {"timeouts", {{"handshake_s", c.timeouts.handshake_s}, {"frame_s", c.timeouts.frame_s}}},
  };
}

CommandLine parse_command_line(const std::vector<std::string>& args) {
  CLI::App app{
      "steptraced - the steptrace daemon. Collects span events and VRAM-ledger annotations "
      "from training processes (libsteptrace) over a Unix socket, aggregates them per process "
      "and step, and answers text commands (ping, report, ledger, stats, metrics, reset, "
      "version, help) on the same socket.",
      "steptraced"};
  std::string socket, config_file, state_dir, metrics_listen, log_level;
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
  app.set_version_flag("--version", std::string("steptraced ") + STEPTRACE_VERSION + " (protocol " +
                                        std::to_string(proto::kProtocolVersion) + ")");
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
