// The CLI's side of the daemon's text-command protocol.
//
// One command per connection: connect to the daemon's Unix socket, send the command line
// plus '\n', shut down the writing side (so the daemon closes the connection once it has
// answered), and read the reply until end of stream. run_command() buffers the reply and
// bounds the whole exchange by one deadline, so a stopped or wedged daemon costs at most
// the timeout; run_command_to() hands the reply to a sink piece by piece as it arrives
// (replies of any size, e.g. `trace`) and bounds each wait instead. Failures come back
// as a CommandFailure that says which stage failed and why, and a one-line message for
// the user that names the socket path and what to do about it.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
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
// proto::kDefaultSocketPath (proto/commands.h; STEPTRACE_DEFAULT_SOCKET of steptrace.h).
SocketPath resolve_socket_path(const std::string& flag);

// What is wrong with `path` as a socket to connect to, said for the user ("no such file
// (...)", "not a socket (PATH is a directory)"), or nullopt when it is a socket or
// cannot be looked at (connect() then says why).
std::optional<std::string> socket_path_problem(const std::string& path);

// Replies larger than this are refused rather than buffered without bound.
inline constexpr std::size_t kMaxReplyBytes = 64 * 1024 * 1024;

enum class Stage { kConnect, kSend, kReceive };

struct CommandFailure {
  Stage stage = Stage::kConnect;
  // errno-style system error, steptrace::errc::timed_out / limit_reached, or
  // std::errc::operation_canceled when a sink stopped the reading.
  std::error_code error;
  // With errc::timed_out: the wait that ran out (0: the command's whole timeout).
  std::chrono::milliseconds waited{0};
  std::uint64_t received = 0;  // bytes of the reply read before the failure
};

using CommandResult = std::variant<std::string, CommandFailure>;

// Sends `line` (one text command, no newline) to the daemon at `socket_path` and returns
// its whole reply. Never throws.
CommandResult run_command(const std::string& socket_path, const std::string& line,
                          std::chrono::milliseconds timeout);

// Receives the reply piece by piece, in order, as it is read; returns false to stop
// reading (run_command_to then fails with std::errc::operation_canceled).
using ReplySink = std::function<bool(std::string_view piece)>;

// Bytes of the reply, all handed to the sink.
using StreamResult = std::variant<std::uint64_t, CommandFailure>;

// Sends `line` like run_command but streams the reply to `sink` instead of buffering it,
// whatever its size. `timeout` bounds the connect, the send and every wait for more of
// the reply (an inactivity timeout, not a total: a long reply may take as long as it
// flows); the wait from sending to the reply's first byte is `first_byte_timeout`
// instead when it is longer (a command the daemon answers only after a while, such as
// `trace --for S`). Never throws (unless the sink does).
StreamResult run_command_to(const std::string& socket_path, const std::string& line,
                            std::chrono::milliseconds timeout, const ReplySink& sink,
                            std::chrono::milliseconds first_byte_timeout = {});

// One line (no trailing newline) telling the user what failed, with the socket path, the
// reason and what to do. `timeout` is the command's; a timed-out failure names the wait
// that ran out (CommandFailure::waited) when it says one.
std::string describe_failure(const CommandFailure& failure, const SocketPath& socket,
                             const std::string& line, std::chrono::milliseconds timeout);

// What goes before a daemon's "error: ..." reply on stderr, so every line the CLI writes
// says who wrote it.
inline constexpr const char* kDaemonAnswered = "steptrace: steptraced answered: ";

}  // namespace steptrace::cli
