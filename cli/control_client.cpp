#include "cli/control_client.h"

#include <sys/stat.h>
#include <sys/un.h>

#include <algorithm>
#include <array>
#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>
#include <cerrno>
#include <cstdlib>
#include <optional>

#include "proto/commands.h"
#include "proto/errc.h"

namespace steptrace::cli {
namespace {

namespace asio = boost::asio;
using Protocol = asio::local::stream_protocol;

// sun_path must hold the path and its terminating NUL.
constexpr std::size_t kMaxSocketPath = sizeof(sockaddr_un::sun_path) - 1;

// The connect -> send -> shut down -> receive chain of one command, on an io_context the
// caller runs until the exchange is done. One timer bounds it: armed once for the whole
// exchange (Deadlines::rearm false), or re-armed at every stage and after every piece
// of the reply read (true).
struct Deadlines {
  std::chrono::milliseconds step;        // the whole exchange, or each wait when rearm
  std::chrono::milliseconds first_byte;  // rearm: from the send to the first byte
  bool rearm = false;
};

class Exchange {
 public:
  Exchange(asio::io_context& io, std::string request, const ReplySink& sink, Deadlines deadlines)
      : socket_(io), timer_(io), request_(std::move(request)), sink_(sink), deadlines_(deadlines) {}

  void start(const std::string& path) {
    arm(deadlines_.step);
    socket_.async_connect(Protocol::endpoint(path), [this](const boost::system::error_code& ec) {
      if (done_) return;
      if (ec) return fail(ec);
      stage_ = Stage::kSend;
      if (deadlines_.rearm) arm(deadlines_.step);
      asio::async_write(socket_, asio::buffer(request_),
                        [this](const boost::system::error_code& wec, std::size_t) {
                          if (done_) return;
                          if (wec) return fail(wec);
                          boost::system::error_code sec;
                          socket_.shutdown(Protocol::socket::shutdown_send, sec);
                          if (sec) return fail(sec);
                          stage_ = Stage::kReceive;
                          if (deadlines_.rearm) arm(deadlines_.first_byte);
                          receive();
                        });
    });
  }

  Stage stage() const { return stage_; }
  bool done() const { return done_; }
  const std::optional<std::error_code>& error() const { return error_; }
  std::chrono::milliseconds waited() const { return waited_; }
  std::uint64_t received() const { return received_; }

 private:
  void receive() {
    socket_.async_read_some(asio::buffer(buffer_),
                            [this](const boost::system::error_code& ec, std::size_t n) {
                              if (done_) return;  // timed out or stopped meanwhile
                              if (n > 0) {
                                received_ += n;
                                if (!sink_(std::string_view(buffer_.data(), n))) {
                                  return fail(std::make_error_code(std::errc::operation_canceled));
                                }
                                if (deadlines_.rearm) arm(deadlines_.step);
                              }
                              if (ec == asio::error::eof) return finish();
                              if (ec) return fail(ec);
                              receive();
                            });
  }

  void arm(std::chrono::milliseconds wait) {
    waited_ = wait;
    timer_.expires_after(wait);
    timer_.async_wait([this](const boost::system::error_code& ec) {
      // A re-arm cancels the previous wait; one that had already fired checks the clock.
      if (ec || done_ || timer_.expiry() > asio::steady_timer::clock_type::now()) return;
      fail(make_error_code(errc::timed_out));
    });
  }

  void finish() {
    done_ = true;
    timer_.cancel();
  }

  void fail(const boost::system::error_code& ec) {
    // Asio reports socket errors in the system category with errno values.
    fail(std::error_code(ec.value(), std::system_category()));
  }
  void fail(std::error_code ec) {
    error_ = ec;
    finish();
    boost::system::error_code ignored;
    socket_.close(ignored);
  }

  Protocol::socket socket_;
  asio::steady_timer timer_;
  std::string request_;
  const ReplySink& sink_;
  Deadlines deadlines_;
  std::array<char, 64 * 1024> buffer_{};
  Stage stage_ = Stage::kConnect;
  bool done_ = false;
  std::optional<std::error_code> error_;
  std::chrono::milliseconds waited_{0};
  std::uint64_t received_ = 0;
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

// Runs one exchange to its end; the failure, if any.
std::optional<CommandFailure> run_exchange(const std::string& socket_path, const std::string& line,
                                           const ReplySink& sink, Deadlines deadlines) {
  if (socket_path.empty() || socket_path.size() > kMaxSocketPath) {
    return CommandFailure{Stage::kConnect, std::make_error_code(std::errc::filename_too_long)};
  }
  try {
    asio::io_context io;
    Exchange exchange(io, line + "\n", sink, deadlines);
    exchange.start(socket_path);
    io.run();  // until the exchange is done: the timer bounds every wait
    if (!exchange.error()) return std::nullopt;
    CommandFailure failure{exchange.stage(), *exchange.error()};
    if (failure.error == errc::timed_out && deadlines.rearm) failure.waited = exchange.waited();
    failure.received = exchange.received();
    return failure;
  } catch (const std::exception&) {
    // Asio throws only when it cannot set up its own resources (e.g. out of descriptors).
    return CommandFailure{Stage::kConnect,
                          std::make_error_code(std::errc::resource_unavailable_try_again)};
  }
}

}  // namespace

std::optional<std::string> socket_path_problem(const std::string& path) {
  // lstat's answer says what the user gave; connect()'s errno does not (a regular file
  // or a directory both give "Connection refused").
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT) return "no such file (" + path + " does not exist)";
    if (error == ENOTDIR) return "no such file (a part of " + path + " is not a directory)";
    return std::nullopt;  // EACCES and the like: connect() says it as well
  }
  if (S_ISSOCK(st.st_mode)) return std::nullopt;
  const char* kind = S_ISDIR(st.st_mode)    ? "a directory"
                     : S_ISREG(st.st_mode)  ? "a regular file"
                     : S_ISFIFO(st.st_mode) ? "a FIFO"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                                            : "some other kind of file";
  return std::string("not a socket (") + path + " is " + kind + ")";
}

SocketPath resolve_socket_path(const std::string& flag) {
  if (!flag.empty()) return {flag, SocketSource::kFlag};
  const char* env = std::getenv("STEPTRACE_SOCKET");
  if (env != nullptr && *env != '\0') return {env, SocketSource::kEnvironment};
  return {proto::kDefaultSocketPath, SocketSource::kDefault};
}

CommandResult run_command(const std::string& socket_path, const std::string& line,
                          std::chrono::milliseconds timeout) {
  std::string reply;
  const ReplySink sink = [&reply](std::string_view piece) {
    if (reply.size() + piece.size() > kMaxReplyBytes) return false;
    reply.append(piece);
    return true;
  };
  auto failure = run_exchange(socket_path, line, sink, Deadlines{timeout, timeout, false});
  if (!failure) return reply;
  if (failure->error == std::errc::operation_canceled) {
    failure->error = make_error_code(errc::limit_reached);
  }
  return *failure;
}

StreamResult run_command_to(const std::string& socket_path, const std::string& line,
                            std::chrono::milliseconds timeout, const ReplySink& sink,
                            std::chrono::milliseconds first_byte_timeout) {
  std::uint64_t bytes = 0;
  const ReplySink counting = [&](std::string_view piece) {
    bytes += piece.size();
    return sink(piece);
  };
  const Deadlines deadlines{timeout, std::max(timeout, first_byte_timeout), true};
  auto failure = run_exchange(socket_path, line, counting, deadlines);
  if (failure) return *failure;
  return bytes;
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
    const auto waited = failure.waited.count() > 0 ? failure.waited : timeout;
    if (failure.waited.count() > 0 && failure.stage == Stage::kReceive && failure.received > 0) {
      return "steptrace: steptraced at " + where + " stopped sending its reply to `" + line +
             "` after " + std::to_string(failure.received) + " bytes: nothing more within " +
             seconds_text(waited) +
             "; it may be overloaded (check `systemctl status steptraced`, or retry with a "
             "longer --timeout)";
    }
    return "steptrace: steptraced at " + where + " did not " + what + " within " +
           seconds_text(waited) +
           "; it may be stopped or overloaded (check `systemctl status steptraced`, or retry "
           "with a longer --timeout)";
  }
  if (failure.error == std::errc::operation_canceled) {
    return "steptrace: stopped reading the reply of steptraced at " + where + " to `" + line +
           "` after " + std::to_string(failure.received) + " bytes";
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
    if (auto wrong = socket_path_problem(socket.path)) {
      return "steptrace: cannot reach steptraced at " + where + ": " + *wrong +
             "; point --socket / STEPTRACE_SOCKET at the socket of a running steptraced (or "
             "start the daemon: systemctl start steptraced.socket)";
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
