#include "daemon/serve/server.h"

#include <fcntl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <vector>

#include "daemon/persist/snapshot.h"
#include "daemon/persist/snapshot_codec.h"
#include "daemon/serve/systemd_integration.h"

namespace steptrace::daemon {
namespace {

namespace fs = std::filesystem;
using StreamProtocol = boost::asio::local::stream_protocol;

// How long shutdown spends applying what clients already sent.
constexpr std::chrono::seconds kDrainBudget{2};
// At most this many connections at once are kept to answer "too many connections";
// beyond it they are closed without a word.
constexpr std::size_t kMaxRejecting = 64;

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

}  // namespace

Server::Server(const Config& config, Collector& collector)
    : config_(config),
      collector_(collector),
      signals_(io_, SIGTERM, SIGINT),
      other_signals_(io_, SIGHUP, SIGUSR1, SIGUSR2),
      acceptor_(io_),
      accept_retry_timer_(io_),
      liveness_timer_(io_),
      snapshot_timer_(io_),
      renderer_(io_, collector, &counters_),
      shared_{collector,
              counters_,
              config,
              commands_,
              log_,
              &renderer_,
              Environment::system(),
              static_cast<std::uint32_t>(::geteuid())} {}

Server::~Server() {
  // close() calls back into sessions_, so iterate over a copy.
  std::vector<std::shared_ptr<Session>> live;
  for (auto& [ptr, entry] : sessions_) {
    if (auto s = entry.session.lock()) live.push_back(std::move(s));
  }
  for (auto& s : live) s->close();
  remove_socket_file();
}

std::optional<std::string> Server::start() {
  if (!config_.state_dir.empty()) {
    std::error_code ec;
    fs::create_directories(config_.state_dir, ec);
    if (ec || !fs::is_directory(config_.state_dir)) {
      return "state directory " + config_.state_dir +
             " cannot be used: " + (ec ? ec.message() : "not a directory");
    }
    if (auto unsafe = check_state_dir(config_.state_dir)) {
      return "state directory refused: " + *unsafe;
    }
    restore_snapshot();
  }
  if (auto err = open_socket()) return err;
  if (config_.metrics_address) {
    http_ = std::make_unique<HttpMetricsServer>(io_, renderer_);
    if (auto err = http_->listen(*config_.metrics_address)) {
      boost::system::error_code ec;
      acceptor_.close(ec);
      remove_socket_file();
      return err;
    }
    spdlog::info("serving Prometheus metrics on http://{}/metrics", config_.metrics_listen);
  }
  return std::nullopt;
}

std::optional<std::string> Server::open_socket() {
  boost::system::error_code ec;
  if (!config_.socket_from_flag) {
    const ActivationSocket activation = systemd_activation_socket();
    if (!activation.error.empty()) return activation.error;
    if (activation.fd >= 0) {
      acceptor_.assign(StreamProtocol(), activation.fd, ec);
      if (ec) return "cannot adopt the socket systemd passed: " + ec.message();
      socket_adopted_ = true;
      socket_path_ = acceptor_.local_endpoint(ec).path();
      spdlog::info("listening on {} (socket passed by systemd)", socket_path_);
      return std::nullopt;
    }
  }

  socket_path_ = config_.socket;
  const fs::path path(socket_path_);
  const fs::path dir = path.has_parent_path() ? path.parent_path() : fs::path(".");
  std::error_code fec;
  if (!fs::is_directory(dir, fec)) {
    return "socket directory " + dir.string() +
           " does not exist (create it, or choose another path with --socket)";
  }
  struct stat st {};
  if (::lstat(socket_path_.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return socket_path_ + " exists and is not a socket; not replacing it";
    }
    int error = 0;
    switch (probe_socket(socket_path_, error)) {
      case Probe::kLive:
        return "another steptraced is already listening on " + socket_path_ +
               "; refusing to start a second one";
      case Probe::kStale:
        spdlog::info("replacing stale socket {}", socket_path_);
        if (::unlink(socket_path_.c_str()) != 0 && errno != ENOENT) {
          return "cannot remove stale socket " + socket_path_ + ": " + std::strerror(errno);
        }
        break;
      case Probe::kGone:
        break;
      case Probe::kError:
        return "cannot check the existing socket " + socket_path_ + ": " + std::strerror(error);
    }
  }

  const StreamProtocol::endpoint endpoint(socket_path_);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (ec) {
    acceptor_.close(ec);
    return "cannot bind " + socket_path_ + ": " + ec.message();
  }
  socket_bound_ = true;
  if (::lstat(socket_path_.c_str(), &st) == 0) {
    socket_dev_ = st.st_dev;
    socket_ino_ = st.st_ino;
  }
  if (::chmod(socket_path_.c_str(), config_.socket_mode) != 0) {
    const std::string why = std::strerror(errno);
    acceptor_.close(ec);
    remove_socket_file();
    return "cannot set mode of " + socket_path_ + ": " + why;
  }
  acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) {
    acceptor_.close(ec);
    remove_socket_file();
    return "cannot listen on " + socket_path_ + ": " + ec.message();
  }
  char mode[8];
  std::snprintf(mode, sizeof mode, "%04o", config_.socket_mode);
  spdlog::info("listening on {} (mode {})", socket_path_, mode);
  return std::nullopt;
}

void Server::remove_socket_file() {
  if (!socket_bound_ || socket_adopted_) return;
  socket_bound_ = false;
  // Only our own socket: never one another daemon bound after us.
  struct stat st {};
  if (::lstat(socket_path_.c_str(), &st) == 0 && st.st_dev == socket_dev_ &&
      st.st_ino == socket_ino_) {
    ::unlink(socket_path_.c_str());
  }
}

void Server::restore_snapshot() {
  LoadedSnapshot loaded = load_snapshot(config_.state_dir);
  switch (loaded.status) {
    case LoadedSnapshot::Status::kNone:
      spdlog::info("no snapshot in {}; starting empty", config_.state_dir);
      return;
    case LoadedSnapshot::Status::kCorrupt:
      ++counters_.snapshot_errors;
      spdlog::error("snapshot unusable: {}{}; starting empty", loaded.error,
                    loaded.moved_to.empty() ? "" : "; moved to " + loaded.moved_to.string());
      return;
    case LoadedSnapshot::Status::kLoaded:
      break;
  }
  if (const auto ec = restore_from_snapshot(collector_, loaded.doc)) {
    ++counters_.snapshot_errors;
    std::error_code move_ec;
    const fs::path moved = move_snapshot_aside(config_.state_dir, move_ec);
    spdlog::error(
        "snapshot in {} rejected ({}); {}; starting empty", config_.state_dir, ec.message(),
        move_ec ? "moving it aside failed: " + move_ec.message() : "moved to " + moved.string());
    return;
  }
  spdlog::info("restored snapshot from {}", config_.state_dir);
}

namespace {
// Builds and writes the snapshot of `view`; "" or what went wrong.
std::string write_snapshot(const std::string& state_dir, const CollectorView& view) {
  std::error_code ec;
  try {
    ec = save_snapshot(state_dir, encode_snapshot(view));
  } catch (const std::exception& e) {
    return std::string("building the snapshot failed: ") + e.what();
  }
  if (!ec) return {};
  if (auto unsafe = check_state_dir(state_dir)) {
    return "snapshot not written: state directory refused: " + *unsafe;
  }
  return "writing snapshot to " + state_dir + " failed: " + ec.message();
}
}  // namespace

void Server::snapshot_written(const std::string& error) {
  if (!error.empty()) {
    ++counters_.snapshot_errors;
    spdlog::error("{}", error);
  } else {
    ++counters_.snapshots_written;
  }
}

bool Server::save_snapshot_now() {
  if (config_.state_dir.empty()) return true;
  const std::string error = write_snapshot(config_.state_dir, *collector_.freeze(&counters_));
  snapshot_written(error);
  return error.empty();
}

void Server::save_snapshot_later() {
  if (config_.state_dir.empty() || snapshot_pending_) return;
  snapshot_pending_ = true;
  renderer_.submit(
      [dir = config_.state_dir](const CollectorView& view) { return write_snapshot(dir, view); },
      [this](std::string error) {
        snapshot_pending_ = false;
        snapshot_written(error);
      });
}

bool Server::run() {
  signals_.async_wait([this](const boost::system::error_code& ec, int signal_number) {
    if (!ec) shutdown(signal_number);
  });
  watch_other_signals();
  accept();
  schedule_liveness();
  schedule_snapshot();
  notify_ready("listening on " + socket_path_);
  io_.run();
  return final_snapshot_written_;
}

void Server::accept() {
  acceptor_.async_accept(
      [this](const boost::system::error_code& ec, StreamProtocol::socket socket) {
        on_accept(ec, std::move(socket));
      });
}

void Server::on_accept(const boost::system::error_code& ec, StreamProtocol::socket socket) {
  if (stopping_ || ec == boost::asio::error::operation_aborted) return;
  if (ec) {
    // EMFILE and friends: back off briefly instead of spinning on the error.
    log_.warn("accept", "accept failed: " + ec.message());
    accept_retry_timer_.expires_after(std::chrono::milliseconds(100));
    accept_retry_timer_.async_wait([this](const boost::system::error_code& wait_ec) {
      if (!wait_ec && !stopping_) accept();
    });
    return;
  }
  admit(std::move(socket));
  accept();
}

void Server::admit(StreamProtocol::socket socket) {
  ServerCounters& counters = counters_;
  ++counters.connections_total;
  const bool reject = counters.connections_now >= config_.server_limits.max_connections;
  if (reject) {
    ++counters.connections_rejected;  // a max_connections hit too (DaemonCounters::add)
    log_.warn("max_connections", "connection rejected: max_connections (" +
                                     std::to_string(config_.server_limits.max_connections) +
                                     ") reached");
    if (rejecting_ >= kMaxRejecting) {
      boost::system::error_code close_ec;
      socket.close(close_ec);
      return;
    }
    ++rejecting_;
  } else {
    ++counters.connections_now;
  }
  auto session = std::make_shared<Session>(
      std::move(socket), shared_,
      [this](Session* s) {
        auto it = sessions_.find(s);
        if (it == sessions_.end()) return;
        if (it->second.rejected) {
          --rejecting_;
        } else {
          --counters_.connections_now;
        }
        sessions_.erase(it);
      },
      reject);
  sessions_.emplace(session.get(), Entry{session, reject});
  session->start();
}

void Server::schedule_liveness() {
  liveness_timer_.expires_after(std::chrono::milliseconds(config_.liveness_interval_ms));
  liveness_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    collector_.refresh_liveness();
    schedule_liveness();
  });
}

void Server::schedule_snapshot() {
  if (config_.state_dir.empty()) return;
  snapshot_timer_.expires_after(std::chrono::seconds(config_.snapshot_interval_s));
  snapshot_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    save_snapshot_later();
    schedule_snapshot();
  });
}

// Signals whose default action would end the daemon without a snapshot and leave its
// socket behind: each is logged and the daemon goes on (config/README.md, "Signals").
void Server::watch_other_signals() {
  boost::system::error_code ec;
  other_signals_.add(SIGALRM, ec);
  other_signals_.async_wait([this](const boost::system::error_code& wait_ec, int signal_number) {
    if (wait_ec || stopping_) return;
    if (signal_number == SIGHUP) {
      spdlog::info(
          "SIGHUP received: nothing to reload (steptraced logs to stderr, so no log file to "
          "reopen, and reads its configuration only at start: restart it to apply a new one)");
    } else {
      spdlog::info("{} received and ignored", strsignal(signal_number));
    }
    watch_other_signals();
  });
}

void Server::shutdown(int signal_number) {
  stopping_ = true;
  boost::system::error_code signals_ec;
  other_signals_.cancel(signals_ec);
  notify_stopping();
  spdlog::info("{} received: draining clients and stopping", strsignal(signal_number));
  boost::system::error_code ec;
  // Connections still in the backlog sent their data before the signal too: take them.
  acceptor_.cancel(ec);
  acceptor_.non_blocking(true, ec);
  for (std::size_t i = 0; !ec && i < config_.server_limits.max_connections; ++i) {
    StreamProtocol::socket socket(io_);
    acceptor_.accept(socket, ec);
    if (!ec) admit(std::move(socket));
  }
  acceptor_.close(ec);
  if (http_) http_->close();
  accept_retry_timer_.cancel();
  liveness_timer_.cancel();
  snapshot_timer_.cancel();
  // A read that completed before the signal may still have its handler queued: let
  // every queued handler run first (sessions arm no new reads now), then drain the rest
  // synchronously.
  shared_.stopping = true;
  boost::asio::post(io_, [this] { finish_shutdown(); });
}

void Server::finish_shutdown() {
  std::vector<std::shared_ptr<Session>> live;
  for (auto& [ptr, entry] : sessions_) {
    if (auto s = entry.session.lock()) live.push_back(std::move(s));
  }
  const auto deadline = std::chrono::steady_clock::now() + kDrainBudget;
  for (auto& s : live) s->drain(deadline);
  // No render job may still write a snapshot (or read the state) after this.
  renderer_.stop();
  // Snapshot with everything drained applied. Spans still open are saved as abandoned
  // (encode_snapshot, persist/snapshot_codec.h): after a restart no connection could end them.
  final_snapshot_written_ = save_snapshot_now();
  for (auto& s : live) s->close();
  remove_socket_file();
  spdlog::info("stopped");
  io_.stop();
}

}  // namespace steptrace::daemon
