// steptraced's configuration: every setting with its default, read from a JSON file
// (--config FILE) and then overridden by command-line flags (flags win).
//
// Data flow: main() -> parse_command_line(argv) -> defaults, then the file's keys
// (apply_config_json), then the flags (apply_flags) -> one validated Config that the
// Server, the Collector's Limits and logging are built from. Every key is checked by the
// strict JSON reader (daemon/persist/json_reader.h): an unknown key at any level or a bad
// value yields a ConfigError whose message names the key ("config:
// limits.max_open_depth: must be an integer in 1..4096"); start-up stops with exit
// status 2. config/steptraced.json lists every key with its default.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "daemon/report/overhead_rule.h"
#include "daemon/state/flight_recorder.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/types.h"
#include "proto/commands.h"

namespace steptrace::daemon {

inline constexpr const char* kDefaultSocketPath = proto::kDefaultSocketPath;

struct ServerLimits {
  std::size_t max_connections = 1024;
  std::size_t max_connections_per_uid = 256;                // of one peer uid (SO_PEERCRED) at once
  std::uint32_t max_frame_bytes = proto::kMaxFramePayload;  // payload cap, <= 262144
  std::size_t max_line_bytes = 4096;                        // one text command line
  // Shared-memory rings (protocol version 5) one process, or one uid, may have mapped.
  std::size_t max_rings_per_process = 1024;
  // Each mapped ring costs the ring timer a look every 1-10 ms, whatever its size.
  std::size_t max_rings_per_uid = 4096;
  std::uint64_t max_ring_bytes_per_process = std::uint64_t{1} << 30;
  std::uint64_t max_ring_bytes_per_uid = std::uint64_t{8} << 30;
  // Rings mapped over all connections: each keeps its descriptor open (the daemon reads
  // the slots with pread, so a hole the producer never wrote commits no memory), so
  // they count in the open-file limit (Server::check_fd_limit).
  std::size_t max_rings = 4096;
  // `trace --for` replies one uid may have waiting at once: each holds a connection (and
  // the recorder's capture open) for up to an hour, so a tenant's forgotten ones cannot
  // take its whole max_connections_per_uid, its own trainers locked out.
  std::size_t max_pending_traces_per_uid = 4;
  // Reply bytes one uid's connections may have queued and not yet read by their clients:
  // past it a rendered reply is replaced by `error: busy: ...`, so a tenant that asks for
  // big reports on many connections and reads none cannot pile up the daemon's memory
  // (the global bound, ClientStream::kMaxPendingOutputTotal, would refuse everyone).
  std::size_t max_pending_reply_bytes_per_uid = std::size_t{64} << 20;
};

struct Timeouts {
  std::uint32_t handshake_s = 10;  // a connection that sends nothing is closed
  std::uint32_t frame_s = 30;      // a started frame or line must finish within this
  // A text-command connection with no complete command line for this long is closed.
  std::uint32_t text_idle_ms = 60000;
};

// "ADDR:PORT" parsed; host is a numeric IPv4 or IPv6 address (without brackets).
struct ListenAddress {
  std::string host;
  std::uint16_t port = 0;
};

enum class NvmlMode : std::uint8_t { kOff, kAuto, kOn };

// `nvml`, `nvml_library`, `nvml_interval_ms`, `nvml_over_tolerance_pct`, `nvml_idle_s`.
struct NvmlConfig {
  NvmlMode mode = NvmlMode::kAuto;
  std::string library = "libnvidia-ml.so.1";
  std::uint32_t interval_ms = 1000;
  ledger::DeviceRules rules;
};

struct Config {
  std::string socket = kDefaultSocketPath;
  bool socket_from_flag = false;  // --socket given: never adopt a systemd socket
  unsigned socket_mode = 0660;
  std::string state_dir;  // "" = no snapshots
  std::uint32_t snapshot_interval_s = 1;
  std::string metrics_listen;                    // "" = no HTTP listener
  std::optional<ListenAddress> metrics_address;  // parsed metrics_listen
  std::string log_level = "info";
  std::uint32_t liveness_interval_ms = 500;
  ServerLimits server_limits;
  Limits limits;  // the collector's
  Timeouts timeouts;
  FlightRecorderConfig flight_recorder;  // flight_recorder_bytes, flight_recorder_seconds
  NvmlConfig nvml;
  // "overhead_rule": the 50% rule's compute and overhead steps, the default and per job
  // (report/overhead_rule.h; `report --compute/--overhead` overrides them per report).
  report::OverheadRules overhead_rules;
};

struct ConfigError {
  std::string message;  // one line, names the key or flag
};

// Command-line values; unset ones leave the config as it is.
struct Flags {
  std::optional<std::string> socket;
  std::optional<std::string> config_file;
  std::optional<std::string> state_dir;
  std::optional<std::string> metrics_listen;
  std::optional<std::string> log_level;
  std::optional<std::string> nvml;  // off | auto | on
};

// Applies a parsed config document on top of `config` (only the keys present).
std::optional<ConfigError> apply_config_json(const nlohmann::json& doc, Config& config);
// Reads and applies a config file.
std::optional<ConfigError> load_config_file(const std::string& path, Config& config);
// Applies flags on top of `config` (validated like the file's values).
std::optional<ConfigError> apply_flags(const Flags& flags, Config& config);
// The whole configuration as a JSON document with the file's keys (what
// config/steptraced.json holds for the defaults).
nlohmann::json config_to_json(const Config& config);

// "ADDR:PORT" / "[IPv6]:PORT"; nullopt when malformed.
std::optional<ListenAddress> parse_listen_address(const std::string& text);
// "0660" -> 0660; nullopt unless 3 or 4 octal digits <= 0777.
std::optional<unsigned> parse_socket_mode(const std::string& text);
bool valid_log_level(const std::string& level);

// Outcome of parsing argv: either a config to run with, or an exit (help/version text
// with status 0, or a usage/config error with status 2) and what to print.
struct CommandLine {
  std::optional<Config> config;
  int exit_code = 0;
  std::string output;  // printed to stdout when exit_code == 0, else to stderr
};
CommandLine parse_command_line(const std::vector<std::string>& args);  // args[0] = program

}  // namespace steptrace::daemon
