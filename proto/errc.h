// steptrace's error codes: one enum and one std::error_category shared by the codec,
// the client and the daemon, so failures travel as std::error_code (as Asio's do).
#pragma once

#include <string>
#include <system_error>

namespace steptrace {

// Spelled like std::errc on purpose (it is used the same way), hence no kName constants.
// NOLINTBEGIN(readability-identifier-naming)
enum class errc {
  // Framing and validation (proto/codec.h); each names the PROTOCOL.md rule it breaks.
  truncated = 1,        // the stream ended inside a hello or a frame
  bad_magic,            // a binary stream that does not start with kMagic
  unsupported_version,  // hello.version is not one this side speaks
  bad_hello,            // nonzero flags, or a bad string in the hello
  frame_too_large,      // header.size > the frame-size cap
  unknown_frame_type,   // header.type is not one this side accepts
  bad_frame_size,       // size is not the record size, or an empty / ragged event batch
  bad_reserved,         // a reserved field or padding byte is not zero
  bad_step_id,          // a step id outside the built-in and custom ranges
  bad_event_kind,       // EventRecord.kind is neither start nor end
  bad_string,           // unterminated, non-printable, empty where required, or nonzero after NUL
  bad_ledger_op,        // LedgerRecord.op unknown
  // Beyond framing.
  unregistered_step,  // an event names a custom step the process never registered
  limit_reached,      // a configured bound (connections, steps, processes, depth)
  permission_denied,
  daemon_unreachable,
  timed_out,
  bad_config,
  bad_command,
};
// NOLINTEND(readability-identifier-naming)

const std::error_category& steptrace_category() noexcept;

inline std::error_code make_error_code(errc e) noexcept {
  return {static_cast<int>(e), steptrace_category()};
}

// A short stable name per code ("bad_step_id"), used as a metrics/stats label.
inline const char* errc_name(errc e) noexcept {
  switch (e) {
    case errc::truncated:
      return "truncated";
    case errc::bad_magic:
      return "bad_magic";
    case errc::unsupported_version:
      return "unsupported_version";
    case errc::bad_hello:
      return "bad_hello";
    case errc::frame_too_large:
      return "frame_too_large";
    case errc::unknown_frame_type:
      return "unknown_frame_type";
    case errc::bad_frame_size:
      return "bad_frame_size";
    case errc::bad_reserved:
      return "bad_reserved";
    case errc::bad_step_id:
      return "bad_step_id";
    case errc::bad_event_kind:
      return "bad_event_kind";
    case errc::bad_string:
      return "bad_string";
    case errc::bad_ledger_op:
      return "bad_ledger_op";
    case errc::unregistered_step:
      return "unregistered_step";
    case errc::limit_reached:
      return "limit_reached";
    case errc::permission_denied:
      return "permission_denied";
    case errc::daemon_unreachable:
      return "daemon_unreachable";
    case errc::timed_out:
      return "timed_out";
    case errc::bad_config:
      return "bad_config";
    case errc::bad_command:
      return "bad_command";
  }
  return "unknown";
}

namespace detail {
class SteptraceCategory final : public std::error_category {
 public:
  const char* name() const noexcept override { return "steptrace"; }
  std::string message(int value) const override {
    switch (static_cast<errc>(value)) {
      case errc::truncated:
        return "stream ended inside a hello or frame";
      case errc::bad_magic:
        return "binary stream does not start with the steptrace magic";
      case errc::unsupported_version:
        return "unsupported protocol version";
      case errc::bad_hello:
        return "malformed hello";
      case errc::frame_too_large:
        return "frame larger than the frame-size cap";
      case errc::unknown_frame_type:
        return "unknown frame type";
      case errc::bad_frame_size:
        return "frame size does not match its type";
      case errc::bad_reserved:
        return "reserved field is not zero";
      case errc::bad_step_id:
        return "step id out of range";
      case errc::bad_event_kind:
        return "event kind is neither start nor end";
      case errc::bad_string:
        return "malformed string field";
      case errc::bad_ledger_op:
        return "unknown ledger operation";
      case errc::unregistered_step:
        return "event for a custom step that was never registered";
      case errc::limit_reached:
        return "configured limit reached";
      case errc::permission_denied:
        return "permission denied";
      case errc::daemon_unreachable:
        return "steptraced cannot be reached";
      case errc::timed_out:
        return "timed out";
      case errc::bad_config:
        return "bad configuration";
      case errc::bad_command:
        return "bad command";
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
