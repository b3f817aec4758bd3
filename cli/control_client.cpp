#include "cli/control_client.h"

#include <steptrace/steptrace.h>
#include <sys/un.h>

#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/write.hpp>
#include <cstdlib>
#include <optional>

#include "proto/errc.h"

namespace steptrace::cli {
namespace {

namespace asio = boost::asio;
using Protocol = asio::local::stream_protocol;

// sun_path must hold the path and its terminating NUL.
constexpr std::size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 1;

// The connect -> send -> shut down -> receive chain of one command, driven by an
// io_context that the caller runs for at most the timeout.
class Exchange {
 public:
  Exchange(asio::io_context& io, std::string request) : socket_(io), request_(std::move(request)) {}

  void start(const std::string& path) {
    socket_.async_connect(Protocol::endpoint(path), [this](const boost::system::error_code& ec) {
      if (ec) return fail(ec);
      stage_ = Stage::kSend;
      asio::async_write(socket_, asio::buffer(request_),
                        [this](const boost::system::error_code& wec, std::size_t) {
                          if (wec) return fail(wec);
                          boost::system::error_code sec;
                          socket_.shutdown(Protocol::socket::shutdown_send, sec);
                          if (sec) return fail(sec);
                          stage_ = Stage::kReceive;
                          receive();
                        });
    });
  }

  Stage stage() const { return stage_; }
  bool done() const { return done_; }
  const std::optional<std::error_code>& error() const { return error_; }
  std::string take_reply() { return std::move(reply_); }

 private:
  void receive() {
    socket_.async_read_some(asio::buffer(buffer_),
                            [this](const boost::system::error_code& ec, std::size_t n) {
                              reply_.append(buffer_.data(), n);
                              if (reply_.size() > kMaxReplyBytes)
                                return fail(make_error_code(errc::limit_reached));
                              if (ec == asio::error::eof) {
                                done_ = true;
                                return;
                              }
                              if (ec) return fail(ec);
                              receive();
                            });
  }

  void fail(const boost::system::error_code& ec) {
    // Asio reports socket errors in the system category with errno values.
    fail(std::error_code(ec.value(), std::system_category()));
  }
  void fail(std::error_code ec) {
    error_ = ec;
    done_ = true;
    boost::system::error_code ignored;
    socket_.close(ignored);
  }

  Protocol::socket socket_;
  std::string request_;
  std::array<char, 64 * 1024> buffer_{};
  std::string reply_;
  Stage stage_ = Stage::kConnect;
  bool done_ = false;
  std::optional<std::error_code> error_;
};

const char* source_name(SocketSource source) {
  switch (source) {
    case SocketSource::kFlag:
      return "from --socket";
    case SocketSource::kEnvironment:
      return "from STEPTRACE_SOCKET";
    case SocketSource::kDefault:
      return "the default";
  }
  return "";
}

std::string seconds_text(std::chrono::milliseconds timeout) {
  const auto ms = timeout.count();
  if (ms % 1000 == 0) return std::to_string(ms / 1000) + " s";
  return std::to_string(ms) + " ms";
}

}  // namespace

SocketPath resolve_socket_path(const std::string& flag) {
  if (!flag.empty()) return {flag, SocketSource::kFlag};
  const char* env = std::getenv("STEPTRACE_SOCKET");
  if (env != nullptr && *env != '\0') return {env, SocketSource::kEnvironment};
  return {STEPTRACE_DEFAULT_SOCKET, SocketSource::kDefault};
}

CommandResult run_command(const std::string& socket_path, const std::string& line,
                          std::chrono::milliseconds timeout) {
  if (socket_path.empty() || socket_path.size() > kMaxSocketPath) {
    return CommandFailure{Stage::kConnect, std::make_error_code(std::errc::filename_too_long)};
  }
  try {
    asio::io_context io;
    Exchange exchange(io, line + "\n");
    exchange.start(socket_path);
    io.run_for(timeout);
    if (!exchange.done()) return CommandFailure{exchange.stage(), make_error_code(errc::timed_out)};
    if (exchange.error()) return CommandFailure{exchange.stage(), *exchange.error()};
    return exchange.take_reply();
  } catch (const std::exception&) {
    // Asio throws only when it cannot set up its own resources (e.g. out of descriptors).
    return CommandFailure{Stage::kConnect,
                          std::make_error_code(std::errc::resource_unavailable_try_again)};
  }
}

std::string describe_failure(const CommandFailure& failure, const SocketPath& socket,
                             const std::string& line, std::chrono::milliseconds timeout) {
  const std::string where = socket.path + " (" + source_name(socket.source) + ")";
  const std::string hint =
      "start the daemon (systemctl start steptraced.socket) or point --socket / "
      "STEPTRACE_SOCKET at the socket of a running steptraced";
  if (failure.error == errc::timed_out) {
    std::string what = failure.stage == Stage::kConnect ? "accept the connection"
                       : failure.stage == Stage::kSend  ? "read the command `" + line + "`"
                                                        : "answer `" + line + "`";
    return "steptrace: steptraced at " + where + " did not " + what + " within " +
           seconds_text(timeout) +
           "; it may be stopped or overloaded (check `systemctl status steptraced`, or retry "
           "with a longer --timeout)";
  }
  if (failure.error == errc::limit_reached) {
    return "steptrace: the reply of steptraced at " + where + " to `" + line + "` exceeds " +
           std::to_string(kMaxReplyBytes / (1024 * 1024)) + " MiB; refusing to buffer it";
  }
  if (failure.stage == Stage::kConnect) {
    if (failure.error == std::errc::filename_too_long) {
      return "steptrace: socket path " + where + " is empty or longer than " +
             std::to_string(kMaxSocketPath) + " bytes; pass a shorter path with --socket";
    }
    std::string extra;
    if (failure.error == std::errc::permission_denied) {
      extra = " (or ask for access to the socket, e.g. membership of its group)";
    }
    return "steptrace: cannot reach steptraced at " + where + ": " + failure.error.message() +
           "; " + hint + extra;
  }
  return "steptrace: connection to steptraced at " + where + " failed while " +
         (failure.stage == Stage::kSend ? "sending" : "reading the reply to") + " `" + line +
         "`: " + failure.error.message() + "; the daemon may have restarted, try again";
}

}  // namespace steptrace::cli
