// The CLI's side of the daemon's text-command protocol.
//
// One command per connection: connect to the daemon's Unix socket, send the command line
// plus '\n', shut down the writing side (so the daemon closes the connection once it has
// answered), and read the reply until end of stream. Every stage is bounded by one
// deadline, so a stopped or wedged daemon costs at most the timeout. Failures come back
// as a CommandFailure that says which stage failed and why, and a one-line message for
// the user that names the socket path and what to do about it.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <system_error>
#include <variant>

namespace steptrace::cli {

// Where the socket path came from, so error messages can say it.
enum class SocketSource { kFlag, kEnvironment, kDefault };

struct SocketPath {
  std::string path;
  SocketSource source = SocketSource::kDefault;
};

// `flag` (from --socket) when set, else $STEPTRACE_SOCKET when set and non-empty, else
// STEPTRACE_DEFAULT_SOCKET.
SocketPath resolve_socket_path(const std::string& flag);

// Replies larger than this are refused rather than buffered without bound.
inline constexpr std::size_t kMaxReplyBytes = 64 * 1024 * 1024;

enum class Stage { kConnect, kSend, kReceive };

struct CommandFailure {
  Stage stage = Stage::kConnect;
  std::error_code error;  // errno-style system error, or steptrace::errc::timed_out etc.
};

using CommandResult = std::variant<std::string, CommandFailure>;

// Sends `line` (one text command, no newline) to the daemon at `socket_path` and returns
// its whole reply. Never throws.
CommandResult run_command(const std::string& socket_path, const std::string& line,
                          std::chrono::milliseconds timeout);

// One line (no trailing newline) telling the user what failed, with the socket path, the
// reason and what to do.
std::string describe_failure(const CommandFailure& failure, const SocketPath& socket,
                             const std::string& line, std::chrono::milliseconds timeout);

}  // namespace steptrace::cli
