// Facts of the text commands (PROTOCOL.md section 10) that the daemon and its clients
// must agree on, defined once: the default socket path, the bounds of command options
// and the grammar of their values.
//
// Used by, or checked against this header:
//   daemon/serve/commands.cpp   parses the commands with parse_pid(), parse_seconds(),
//                               parse_job_option() and the bounds below (TraceRequest's
//                               constants by static_assert)
//   daemon/serve/config.h       kDefaultSocketPath (the config's default socket)
//   cli/                        the steptrace CLI's option checks and socket default
//   client/src/client.cpp       STEPTRACE_DEFAULT_SOCKET of steptrace.h, by static_assert
//                               (the public C spelling; proto/ includes nothing of client/)
//   bindings/rust               DEFAULT_SOCKET, by bindings/rust/tests/default_socket.rs
//   proto/PROTOCOL.md 10        by hand
// Standard library (and proto/wire_format.h's name bound) only; nothing here allocates, throws or
// does I/O.
#pragma once

#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string_view>
#include <system_error>

#include "proto/wire_format.h"

namespace steptrace::proto {

// Where steptraced listens unless told otherwise (--socket, $STEPTRACE_SOCKET, config).
inline constexpr char kDefaultSocketPath[] = "/run/steptrace/steptraced.sock";

// `--pid N` of report, reset and trace: a decimal pid in [kMinPid, kMaxPid] (pid_t's
// positive range; the wire carries pids as int32).
inline constexpr std::int32_t kMinPid = 1;
inline constexpr std::int32_t kMaxPid = std::numeric_limits<std::int32_t>::max();

// `trace`: at most kMaxTracePids distinct --pid options; `--last S` with
// 0 < S <= kMaxTraceLastSeconds, `--for S` with 0 < S <= kMaxTraceForSeconds.
inline constexpr std::size_t kMaxTracePids = 64;
inline constexpr double kMaxTraceLastSeconds = 86400;
inline constexpr double kMaxTraceForSeconds = 3600;

// The longest SECONDS word parse_seconds() takes.
inline constexpr std::size_t kMaxSecondsText = 20;

// A decimal pid in [kMinPid, kMaxPid]: digits only (no sign, no blanks); else nullopt.
inline std::optional<std::int32_t> parse_pid(std::string_view text) {
  if (text.empty() || text.front() < '0' || text.front() > '9') return std::nullopt;
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (ec != std::errc{} || ptr != end) return std::nullopt;
  if (value < kMinPid || value > kMaxPid) return std::nullopt;
  return static_cast<std::int32_t>(value);
}

// A SECONDS word: decimal digits, optionally a '.' and more digits ("30", "2.5"), at
// most kMaxSecondsText characters; no sign, exponent, blank, or bare '.' at either end.
// Its value (0 included), or nullopt.
inline std::optional<double> parse_seconds(std::string_view text) {
  if (text.empty() || text.size() > kMaxSecondsText) return std::nullopt;
  const auto digits = [](std::string_view s) {
    if (s.empty()) return false;
    for (const char c : s) {
      if (c < '0' || c > '9') return false;
    }
    return true;
  };
  const std::size_t dot = text.find('.');
  if (!digits(text.substr(0, dot))) return std::nullopt;
  if (dot != std::string_view::npos && !digits(text.substr(dot + 1))) return std::nullopt;
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value, std::chars_format::fixed);
  if (ec != std::errc{} || ptr != end) return std::nullopt;
  return value;
}

// `--job` of report: `ID`, the asking uid's job, or `UID:ID`, that uid's job (a job is
// the pair (uid, job id), section 4.7b). ID is 1..kMaxNameLength printable characters
// without blanks (a word of a command line); UID is decimal digits only, in uint32's
// range, and ends at the first ':'. So a value with no ':', or whose text before the
// first ':' is not all digits ("run:7", ":x"), is an ID as it stands; an ID that itself
// starts with digits and a ':' ("12:30") is written with its uid ("1001:12:30").
struct JobOption {
  std::optional<std::uint32_t> uid;  // none: the asking uid's job
  std::string_view id;
};

inline constexpr std::size_t kMaxUidDigits = 10;  // 4294967295

// Is `id` a job id `--job` can name: 1..kMaxNameLength printable ASCII characters
// without blanks (0x21..0x7E)?
inline bool is_job_id_word(std::string_view id) {
  if (id.empty() || id.size() > kMaxNameLength) return false;
  for (const char c : id) {
    if (c <= 0x20 || c > 0x7e) return false;
  }
  return true;
}

// The value of `--job` (a view into `text`), or nullopt when it is not one.
inline std::optional<JobOption> parse_job_option(std::string_view text) {
  const std::size_t colon = text.find(':');
  const std::string_view head = text.substr(0, colon);
  const bool digits =
      !head.empty() && head.find_first_not_of("0123456789") == std::string_view::npos;
  if (colon == std::string_view::npos || !digits) {
    if (!is_job_id_word(text)) return std::nullopt;
    return JobOption{std::nullopt, text};
  }
  const std::string_view id = text.substr(colon + 1);
  std::uint64_t uid = 0;
  const auto [ptr, ec] = std::from_chars(head.data(), head.data() + head.size(), uid);
  if (head.size() > kMaxUidDigits || ec != std::errc{} || ptr != head.data() + head.size() ||
      uid > std::numeric_limits<std::uint32_t>::max() || !is_job_id_word(id)) {
    return std::nullopt;
  }
  return JobOption{static_cast<std::uint32_t>(uid), id};
}

// A SECONDS word whose value is in (0, max]; else nullopt.
inline std::optional<double> parse_seconds(std::string_view text, double max) {
  const auto value = parse_seconds(text);
  if (!value || !(*value > 0) || *value > max) return std::nullopt;
  return value;
}

}  // namespace steptrace::proto
