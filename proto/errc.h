// steptrace's error codes: one enum and one std::error_category shared by the codec,
// the client and the daemon, so failures travel as std::error_code (as Asio's do).
#pragma once

#include <array>
#include <cstddef>
#include <string>
#include <string_view>
#include <system_error>

namespace steptrace {

// The codes, defined once: STEPTRACE_ERRC_TABLE(X) calls X(code, value, name, message,
// protocol_error) per code, and the enum, errc_name(), the category's message() and
// kErrcTable are all made from it.
//   code            the enumerator (errc::code)
//   value           its int value: stable (error codes travel in logs, tests and
//                   snapshots), so a new code takes the next value, at the end
//   name            the short stable name errc_name() returns ("bad_step_id"), used as
//                   a metrics/stats label and in Error frames (PROTOCOL.md 9.1)
//   message         the category's message()
//   protocol_error  the daemon counts it under protocol_errors{kind="<name>"} when it
//                   closes a connection for it (PROTOCOL.md 9), so `metrics` exports
//                   that kind from the start, zero until seen (a limit counts elsewhere)
// Codes 1..12 are framing and validation (proto/codec.h), each naming the PROTOCOL.md
// rule it breaks; unregistered_step is an event for a custom step the process never
// registered; limit_reached a configured bound (connections, steps, processes, depth).
#define STEPTRACE_ERRC_TABLE(X)                                                                   \
  X(truncated, 1, "truncated", "stream ended inside a hello or frame", true)                      \
  X(bad_magic, 2, "bad_magic", "binary stream does not start with the steptrace magic", true)     \
  X(unsupported_version, 3, "unsupported_version", "unsupported protocol version", true)          \
  X(bad_hello, 4, "bad_hello", "malformed hello", true)                                           \
  X(frame_too_large, 5, "frame_too_large", "frame larger than the frame-size cap", true)          \
  X(unknown_frame_type, 6, "unknown_frame_type", "unknown frame type", true)                      \
  X(bad_frame_size, 7, "bad_frame_size", "frame size does not match its type", true)              \
  X(bad_reserved, 8, "bad_reserved", "reserved field is not zero", true)                          \
  X(bad_step_id, 9, "bad_step_id", "step id out of range", true)                                  \
  X(bad_event_kind, 10, "bad_event_kind", "event kind is neither start nor end", true)            \
  X(bad_string, 11, "bad_string", "malformed string field", true)                                 \
  X(bad_ledger_op, 12, "bad_ledger_op", "unknown ledger operation", true)                         \
  X(unregistered_step, 13, "unregistered_step",                                                   \
    "event for a custom step that was never registered", true)                                    \
  X(limit_reached, 14, "limit_reached", "configured limit reached", false)                        \
  X(permission_denied, 15, "permission_denied", "permission denied", false)                       \
  X(daemon_unreachable, 16, "daemon_unreachable", "steptraced cannot be reached", false)          \
  X(timed_out, 17, "timed_out", "timed out", true)                                                \
  X(bad_config, 18, "bad_config", "bad configuration", false)                                     \
  X(bad_command, 19, "bad_command", "bad command", false)                                         \
  X(bad_snapshot, 20, "bad_snapshot", "snapshot is not valid", false)                             \
  X(bad_identity, 21, "bad_identity", "identity frame repeated or rank out of range", true)       \
  X(bad_ring, 22, "bad_ring", "shared-memory ring frame, descriptor or contents not valid", true) \
  X(bad_delivered, 23, "bad_delivered", "delivered frame repeated or after events", true)         \
  X(bad_batch, 24, "bad_batch", "batch frame malformed, nested, or holding a frame it may not",   \
    true)

// Spelled like std::errc on purpose (it is used the same way), hence no kName constants.
// NOLINTBEGIN(readability-identifier-naming)
enum class errc {
#define STEPTRACE_ERRC_ENUMERATOR(code, value, name, message, protocol_error) code = value,
  STEPTRACE_ERRC_TABLE(STEPTRACE_ERRC_ENUMERATOR)
#undef STEPTRACE_ERRC_ENUMERATOR
};
// NOLINTEND(readability-identifier-naming)

// One row of STEPTRACE_ERRC_TABLE, for code that goes over all codes.
struct ErrcInfo {
  errc code;
  const char* name;
  const char* message;
  bool protocol_error;
};

inline constexpr std::array kErrcTable = {
#define STEPTRACE_ERRC_INFO(code, value, name, message, protocol_error) \
  ErrcInfo{errc::code, name, message, protocol_error},
    STEPTRACE_ERRC_TABLE(STEPTRACE_ERRC_INFO)
#undef STEPTRACE_ERRC_INFO
};

namespace detail {
// Values 1..n in table order: kErrcTable[value - 1] is the code's row.
constexpr bool errc_table_dense() {
  for (std::size_t i = 0; i < kErrcTable.size(); ++i) {
    if (static_cast<std::size_t>(kErrcTable[i].code) != i + 1) return false;
  }
  return true;
}
}  // namespace detail
static_assert(detail::errc_table_dense(), "errc values must be 1..n in table order");

// The other protocol_errors kinds, counted by a daemon session rather than named by a
// code: a command line over limits.max_line_bytes, and a client that did not read its
// replies in time. `metrics` exports them from the start too.
inline constexpr const char* kLineTooLongKind = "line_too_long";
inline constexpr const char* kWriteTimeoutKind = "write_timeout";
inline constexpr std::array<std::string_view, 2> kSessionErrorKinds = {kLineTooLongKind,
                                                                       kWriteTimeoutKind};

const std::error_category& steptrace_category() noexcept;

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), steptrace_category()};
}

// A short stable name per code ("bad_step_id"), used as a metrics/stats label.
inline const char* errc_name(errc e) noexcept {
  switch (e) {
#define STEPTRACE_ERRC_NAME_CASE(code, value, name, message, protocol_error) \
  case errc::code:                                                           \
    return name;
    STEPTRACE_ERRC_TABLE(STEPTRACE_ERRC_NAME_CASE)
#undef STEPTRACE_ERRC_NAME_CASE
  }
  return "unknown";
}

namespace detail {
class SteptraceCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "steptrace"; }
  std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
#define STEPTRACE_ERRC_MESSAGE_CASE(code, value, name, message, protocol_error) \
  case errc::code:                                                              \
    return message;
      STEPTRACE_ERRC_TABLE(STEPTRACE_ERRC_MESSAGE_CASE)
#undef STEPTRACE_ERRC_MESSAGE_CASE
    }
    return "unknown steptrace error";
  }
};
}  // namespace detail

inline const std::error_category& steptrace_category() noexcept {
  static const detail::SteptraceCategory kCategory;
  return kCategory;
}

}  // namespace steptrace

template <>
struct std::is_error_code_enum<steptrace::errc> : std::true_type {};
