#include "daemon/serve/listener.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "daemon/serve/systemd_integration.h"

namespace steptrace::daemon {
namespace {

namespace fs = std::filesystem;
using StreamProtocol = boost::asio::local::stream_protocol;

enum class Probe { kLive, kStale, kGone, kError };

// Is something listening on `path`? A non-blocking connect, so a busy or stopped
// daemon (full backlog) still counts as live rather than blocking us.
Probe probe_socket(const std::string& path, int& error) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    error = errno;
    return Probe::kError;
  }
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int rc = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  error = rc == 0 ? 0 : errno;
  ::close(fd);
  if (rc == 0 || error == EAGAIN || error == EINPROGRESS) return Probe::kLive;
  if (error == ECONNREFUSED) return Probe::kStale;
  if (error == ENOENT) return Probe::kGone;
  return Probe::kError;
}

// A directory another user may write to lets them replace the socket under the daemon's
// clients (and its name on the daemon's own unlink). Refused unless it is sticky (like
// /tmp: only an entry's owner may remove or rename it); owned by the daemon's user or root.
std::optional<std::string> check_socket_dir(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) {
    return "cannot stat " + dir.string() + ": " + std::strerror(errno);
  }
  const uid_t euid = ::geteuid();
  if (st.st_uid != euid && st.st_uid != 0) {
    return dir.string() + " is owned by uid " + std::to_string(st.st_uid) +
           ", not by the daemon's user (uid " + std::to_string(euid) + ") or root";
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return dir.string() + " is writable by its group or others (mode " + mode +
           ") without the sticky bit: another user could replace the socket";
  }
  return std::nullopt;
}

}  // namespace

Listener::Listener(boost::asio::io_context& io, const Config& config, RateLimitedLog& log)
    : io_(io), config_(config), log_(log), acceptor_(io), retry_timer_(io) {}

Listener::~Listener() { remove_socket_file(); }

std::optional<std::string> Listener::open() {
  if (!config_.socket_from_flag) {
    if (auto err = adopt_activation_socket()) return err;
    if (adopted_) return std::nullopt;
  }
  path_ = config_.socket;
  if (auto err = clear_old_socket()) return err;
  return bind_and_listen();
}

// The socket systemd passed (socket activation), if any: adopted_ tells.
std::optional<std::string> Listener::adopt_activation_socket() {
  const ActivationSocket activation = systemd_activation_socket();
  if (!activation.error.empty()) return activation.error;
  if (activation.fd < 0) return std::nullopt;
  boost::system::error_code ec;
  acceptor_.assign(StreamProtocol(), activation.fd, ec);
  if (ec) return "cannot adopt the socket systemd passed: " + ec.message();
  adopted_ = true;
  path_ = acceptor_.local_endpoint(ec).path();
  spdlog::info("listening on {} (socket passed by systemd)", path_);
  return std::nullopt;
}

// Checks the socket's directory, and what is at the path: nothing, or a stale socket
// (removed); never a live daemon's socket or something that is not a socket.
std::optional<std::string> Listener::clear_old_socket() {
  const fs::path path(path_);
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code fec;
  if (!fs::is_directory(dir, fec)) {
    return "socket directory " + dir.string() +
           " does not exist (create it, or choose another path with --socket)";
  }
  if (auto unsafe = check_socket_dir(dir)) return "socket directory refused: " + *unsafe;
  struct stat st {};
  if (::lstat(path_.c_str(), &st) != 0) return std::nullopt;
  if (!S_ISSOCK(st.st_mode)) {
    return path_ + " exists and is not a socket; not replacing it";
  }
  int error = 0;
  switch (probe_socket(path_, error)) {
    case Probe::kLive:
      return "another steptraced is already listening on " + path_ +
             "; refusing to start a second one";
    case Probe::kStale:
      spdlog::info("replacing stale socket {}", path_);
      if (::unlink(path_.c_str()) != 0 && errno != ENOENT) {
        return "cannot remove stale socket " + path_ + ": " + std::strerror(errno);
      }
      break;
    case Probe::kGone:
      break;
    case Probe::kError:
      return "cannot check the existing socket " + path_ + ": " + std::strerror(error);
  }
  return std::nullopt;
}

// Binds path_, remembers which file that made, sets its mode and listens.
std::optional<std::string> Listener::bind_and_listen() {
  boost::system::error_code ec;
  const StreamProtocol::endpoint endpoint(path_);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec) {
    acceptor_.close(ec);
    return "cannot bind " + path_ + ": " + ec.message();
  }
  bound_ = true;
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0) {
    dev_ = st.st_dev;
    ino_ = st.st_ino;
  }
  if (::chmod(path_.c_str(), config_.socket_mode) != 0) {
    const std::string why = std::strerror(errno);
    acceptor_.close(ec);
    remove_socket_file();
    return "cannot set mode of " + path_ + ": " + why;
  }
  acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) {
    acceptor_.close(ec);
    remove_socket_file();
    return "cannot listen on " + path_ + ": " + ec.message();
  }
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", config_.socket_mode);
  spdlog::info("listening on {} (mode {})", path_, mode);
  return std::nullopt;
}

void Listener::close() {
  boost::system::error_code ec;
  acceptor_.close(ec);
  remove_socket_file();
}

void Listener::remove_socket_file() {
  if (!bound_ || adopted_) return;
  bound_ = false;
  // Only our own socket: never one another daemon bound after us.
  struct stat st {};
  if (::lstat(path_.c_str(), &st) == 0 && st.st_dev == dev_ && st.st_ino == ino_) {
    ::unlink(path_.c_str());
  }
}

void Listener::accept(Handler admit, Handler drain) {
  admit_ = std::move(admit);
  drain_ = std::move(drain);
  accept_next();
}

void Listener::accept_next() {
  acceptor_.async_accept([this](const boost::system::error_code& ec, Socket socket) {
    on_accept(ec, std::move(socket));
  });
}

void Listener::on_accept(const boost::system::error_code& ec, Socket socket) {
  if (stopping_) {
    // Accepted before the signal was seen, its handler queued behind it: drained too.
    if (!ec) drain_(std::move(socket));
    return;
  }
  if (ec == boost::asio::error::operation_aborted) return;
  if (ec) {
    // EMFILE and friends: back off briefly instead of spinning on the error.
    log_.warn("accept", "accept failed: " + ec.message());
    retry_timer_.expires_after(std::chrono::milliseconds(100));
    retry_timer_.async_wait([this](const boost::system::error_code& wait_ec) {
      if (!wait_ec && !stopping_) accept_next();
    });
    return;
  }
  admit_(std::move(socket));
  accept_next();
}

void Listener::take_backlog(std::size_t bound) {
  stopping_ = true;
  // No new client finds the socket from now on (a tenant connecting in a loop must not
  // keep the backlog from emptying); what is queued already is taken, boundedly.
  remove_socket_file();
  boost::system::error_code ec;
  acceptor_.cancel(ec);
  acceptor_.non_blocking(true, ec);
  for (std::size_t i = 0; !ec && i < bound; ++i) {
    Socket socket(io_);
    acceptor_.accept(socket, ec);
    if (!ec) drain_(std::move(socket));
  }
  acceptor_.close(ec);
  retry_timer_.cancel();
}

}  // namespace steptrace::daemon
