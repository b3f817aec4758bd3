#include "daemon/serve/server.h"

#include <sys/resource.h>
#include <unistd.h>

#include <spdlog/spdlog.h>
#include <cassert>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <vector>

#include "daemon/persist/snapshot.h"
#include "daemon/persist/snapshot_codec.h"
#include "daemon/serve/io_thread.h"
#include "daemon/serve/systemd_integration.h"

namespace steptrace::daemon {
namespace {

namespace fs = std::filesystem;
using StreamProtocol = boost::asio::local::stream_protocol;

// How long shutdown spends applying what clients already sent.
constexpr std::chrono::seconds kDrainBudget{2};
constexpr std::size_t kMaxRejecting = ConnectionRegistry::kMaxRejecting;

// File descriptors kept beside the client connections (max_connections, plus the
// kMaxRejecting ones answering "too many connections"): the listening sockets, a /proc
// probe, a snapshot and its directory, the HTTP listener and its connections, and what
// Asio, spdlog and the render thread hold. Reserved at start, so that running out of
// fds never reaches a liveness probe or a snapshot.
constexpr rlim_t kReservedFds = 128;

std::int64_t unix_now() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

Server::Server(const Config& config, Collector& collector)
    : config_(config),
      collector_(collector),
      signals_(io_, SIGTERM, SIGINT),
      other_signals_(io_, SIGHUP, SIGUSR1, SIGUSR2),
      liveness_timer_(io_),
      ring_timer_(io_),
      snapshot_timer_(io_),
      listener_(io_, config, log_),
      renderer_(io_, collector, &counters_),
      shared_{collector,
              counters_,
              config,
              commands_,
              log_,
              &renderer_,
              Environment::system(),
              static_cast<std::uint32_t>(::geteuid())},
      connections_(io_, shared_, config.server_limits),
      gpu_sampler_(io_, collector, config.nvml) {
  // A ring just mapped is read within 1 ms, even while the timer idles at 10 ms for the
  // others: its thread may be recording fast already (a 4 MiB ring fills in ~10 ms at
  // 26 M events/s), and until this pass nobody reads it.
  shared_.rings_active = [this] {
    if (stopping_) return;
    constexpr auto kSoon = std::chrono::milliseconds(1);
    if (!ring_timer_armed_ || ring_timer_.expiry() > std::chrono::steady_clock::now() + kSoon) {
      schedule_ring_drain(kSoon);
    }
  };
}

Server::~Server() {
  connections_.close_all();
  listener_.remove_socket_file();
}

// The open-file limit must cover every connection max_connections allows plus the
// reserve. The soft limit is raised as far as the hard one allows; below that the
// daemon refuses to start, saying what to change, rather than fail later (clients hung
// without a reply, snapshots failing, live holders taken for dead).
std::optional<std::string> Server::check_fd_limit() {
  // Plus the descriptors clients passed whose RingAttach frames are not complete yet
  // (ClientStream::received_fds, at most kMaxPendingRingFds for all connections), and
  // one per mapped shared ring (SharedRings keeps it to read the slots).
  const ServerLimits& limits = config_.server_limits;
  const rlim_t base = kMaxRejecting + kMaxPendingRingFds + kReservedFds;
  const rlim_t needed = base + limits.max_connections + limits.max_rings;
  rlimit limit{};
  if (::getrlimit(RLIMIT_NOFILE, &limit) != 0) {
    return std::string("cannot read the open-file limit (RLIMIT_NOFILE): ") + std::strerror(errno);
  }
  if (limit.rlim_cur != RLIM_INFINITY && limit.rlim_cur < needed) {
    rlimit raised = limit;
    raised.rlim_cur = limit.rlim_max == RLIM_INFINITY ? needed : std::min(needed, limit.rlim_max);
    if (raised.rlim_cur > limit.rlim_cur && ::setrlimit(RLIMIT_NOFILE, &raised) == 0) {
      spdlog::info(
          "raised the open-file limit from {} to {} (limits.max_connections {}, max_rings {})",
          limit.rlim_cur, raised.rlim_cur, limits.max_connections, limits.max_rings);
      limit = raised;
    }
  }
  if (limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= needed) return std::nullopt;
  const rlim_t fits = limit.rlim_cur > base ? limit.rlim_cur - base : 0;
  return "limits.max_connections " + std::to_string(limits.max_connections) +
         " and limits.max_rings " + std::to_string(limits.max_rings) + " need " +
         std::to_string(needed) + " open files (" + std::to_string(base) +
         " more for refusals, passed ring descriptors, probes, snapshots and HTTP), but the "
         "open-file limit is " +
         std::to_string(limit.rlim_cur) + " (hard limit " +
         (limit.rlim_max == RLIM_INFINITY ? std::string("unlimited")
                                          : std::to_string(limit.rlim_max)) +
         "): raise LimitNOFILE= (or ulimit -n), or lower limits.max_connections and "
         "limits.max_rings so that they add up to " +
         std::to_string(fits) + " or less";
}

std::optional<std::string> Server::start() {
  if (auto err = check_fd_limit()) return err;
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
    // What a snapshot would hold now is on disk already, or is nothing at all.
    snapshot_generation_ = collector_.generation();
  }
  if (auto err = gpu_sampler_.start()) return err;
  if (auto err = listener_.open()) return err;
  if (config_.metrics_address) {
    http_ = std::make_unique<HttpMetricsServer>(io_, renderer_, &counters_.http);
    if (auto err = http_->listen(*config_.metrics_address)) {
      listener_.close();
      return err;
    }
    spdlog::info("serving Prometheus metrics on http://{}/metrics", config_.metrics_listen);
  }
  return std::nullopt;
}

void Server::restore_snapshot() {
  assert(on_io_thread(io_));  // restores into the Collector (and claims the io thread)
  counters_.durability.enabled = true;
  LoadedSnapshot loaded = load_snapshot(config_.state_dir, config_.limits);
  switch (loaded.status) {
    case LoadedSnapshot::Status::kNone:
      spdlog::info("no snapshot in {}; starting empty", config_.state_dir);
      return;
    case LoadedSnapshot::Status::kCorrupt:
      started_empty("snapshot unusable: " + loaded.error +
                    (loaded.moved_to.empty() ? "" : "; moved to " + loaded.moved_to.string()));
      return;
    case LoadedSnapshot::Status::kLoaded:
      break;
  }
  if (const auto ec = adopt_snapshot(collector_, std::move(loaded.image))) {
    std::error_code move_ec;
    const fs::path moved = move_snapshot_aside(config_.state_dir, move_ec);
    started_empty(
        "snapshot in " + config_.state_dir + " refused (" + ec.message() + "); " +
        (move_ec ? "moving it aside failed: " + move_ec.message() : "moved to " + moved.string()));
    return;
  }
  if (!loaded.partial_copy.empty()) {
    spdlog::warn("snapshot restored in part: the file as it was is kept as {}",
                 loaded.partial_copy.string());
  }
  // What the daemon holds now is what is on disk: durable as of now.
  counters_.durability.last_written = unix_now();
  spdlog::info("restored snapshot from {}", config_.state_dir);
}

void Server::started_empty(const std::string& error) {
  ++counters_.snapshot_errors;
  counters_.durability.last_error = error;
  counters_.durability.started_empty_after = unix_now();
  spdlog::error("{}; starting empty", error);
}

namespace {
// Builds and writes the snapshot of `view` (error "" when it was written).
WrittenSnapshot write_snapshot(const std::string& state_dir, const CollectorView& view,
                               std::size_t max_bytes) {
  WrittenSnapshot out;
  SavedSnapshot saved;
  try {
    saved = save_snapshot(state_dir, view.image(), max_bytes);
  } catch (const std::exception& e) {
    out.error = std::string("building the snapshot failed: ") + e.what();
    return out;
  }
  out.left_out = saved.encoded.left_out;
  out.first_left_out = std::move(saved.encoded.first_left_out);
  if (!saved.ec) return out;
  if (auto unsafe = check_state_dir(state_dir)) {
    out.error = "snapshot not written: state directory refused: " + *unsafe;
  } else {
    out.error = "writing snapshot to " + state_dir + " failed: " + saved.ec.message();
  }
  return out;
}
}  // namespace

bool Server::snapshot_written(const WrittenSnapshot& written) {
  Durability& durability = counters_.durability;
  const std::int64_t now = unix_now();
  const std::string& error = written.error;
  if (error.empty()) {
    ++counters_.snapshots_written;
    counters_.snapshot_records_left_out += written.left_out;
    // Said when it starts and when it stops, not at every snapshot while a tenant grows
    // (the counter says how many).
    if ((written.left_out > 0) != (last_left_out_ > 0)) {
      if (written.left_out > 0) {
        spdlog::warn(
            "snapshot: {} records left out, past limits.max_snapshot_bytes ({} bytes; "
            "first: {}); a restart would lose them (counted in "
            "snapshots.records_left_out)",
            written.left_out, config_.limits.max_snapshot_bytes, written.first_left_out);
      } else {
        spdlog::info("snapshot: every record fits in limits.max_snapshot_bytes again");
      }
    }
    last_left_out_ = written.left_out;
    durability.failing_since.reset();
    durability.last_written = now;
    if (const auto line = snapshot_log_.succeeded()) spdlog::info("{}", line->text);
    return true;
  }
  ++counters_.snapshot_errors;
  if (!durability.failing_since) durability.failing_since = now;
  durability.last_error = error;
  // At 1 s a full disk would otherwise log 3,600 lines an hour.
  const auto line = snapshot_log_.failed(error, std::chrono::steady_clock::now(), now);
  if (line) spdlog::error("{}", line->text);
  return line.has_value();
}

bool Server::save_snapshot_now() {
  if (config_.state_dir.empty()) return true;
  assert(on_io_thread(io_));  // makes a CollectorView
  const WrittenSnapshot written = write_snapshot(config_.state_dir, *collector_.freeze(&counters_),
                                                 config_.limits.max_snapshot_bytes);
  // The final one is always logged: the exit status says it failed, the log must say why.
  if (!snapshot_written(written) && !written.error.empty()) {
    spdlog::error("final snapshot: {}", written.error);
  }
  return written.error.empty();
}

void Server::save_snapshot_later() {
  if (config_.state_dir.empty() || snapshot_pending_) return;
  // Nothing changed since the last good one: an idle daemon writes nothing.
  const std::uint64_t generation = collector_.generation();
  if (snapshot_generation_ == generation) return;
  snapshot_pending_ = true;
  // Filled on the render thread, read on this one once the result is posted back.
  auto written = std::make_shared<WrittenSnapshot>();
  renderer_.submit(
      [dir = config_.state_dir, max_bytes = config_.limits.max_snapshot_bytes,
       written](const CollectorView& view) {
        *written = write_snapshot(dir, view, max_bytes);
        return written->error;
      },
      [this, generation, written](const std::string& error) {
        // The job threw past its own catch: the render worker's error is all there is.
        if (!error.empty() && written->error.empty()) written->error = error;
        snapshot_pending_ = false;
        if (error.empty()) snapshot_generation_ = generation;
        snapshot_written(*written);
      });
}

bool Server::run() {
  signals_.async_wait([this](const boost::system::error_code& ec, int signal_number) {
    if (!ec) shutdown(signal_number);
  });
  watch_other_signals();
  listener_.accept(
      [this](StreamProtocol::socket socket) { connections_.admit(std::move(socket)); },
      [this](StreamProtocol::socket socket) { connections_.take_for_drain(std::move(socket)); });
  schedule_liveness();
  schedule_snapshot();
  notify_ready("listening on " + listener_.path());
  io_.run();
  return final_snapshot_written_;
}

void Server::schedule_liveness() {
  liveness_timer_.expires_after(std::chrono::milliseconds(config_.liveness_interval_ms));
  liveness_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec || stopping_) return;
    assert(on_io_thread(io_));
    collector_.refresh_liveness();
    schedule_liveness();
  });
}

void Server::schedule_ring_drain(std::chrono::milliseconds delay) {
  ring_timer_armed_ = true;
  ring_timer_.expires_after(delay);
  ring_timer_.async_wait([this](const boost::system::error_code& ec) {
    if (ec == boost::asio::error::operation_aborted) return;  // re-armed sooner, or stopping
    ring_timer_armed_ = false;
    if (ec || stopping_) return;
    assert(on_io_thread(io_));
    const std::uint64_t events = drain_all_rings(shared_);
    if (!shared_.ring_streams.empty()) {
      schedule_ring_drain(std::chrono::milliseconds(events > 0 ? 1 : 10));
    }
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
  drain_backlog();
  if (http_) http_->close();
  liveness_timer_.cancel();
  ring_timer_.cancel();
  snapshot_timer_.cancel();
  // A read that completed before the signal may still have its handler queued: let
  // every queued handler run first (sessions arm no new reads now), then drain the rest
  // synchronously.
  shared_.stopping = true;
  boost::asio::post(io_, [this] { finish_shutdown(); });
}

// Connections still in the listen backlog sent their data before the signal too: each
// is taken and drained with the others, past max_connections as far as the fds kept for
// refusals allow (the limit is for serving, not for reading what was already sent).
// What is left is closed unread, counted and logged, never dropped silently.
void Server::drain_backlog() {
  listener_.take_backlog(config_.server_limits.max_connections + kMaxRejecting + 4096);
}

void Server::finish_shutdown() {
  // Cancel every read in flight; their handlers (queued now, after any read that had
  // already completed) apply what was read; then drain the rest. The sessions are held
  // here in between: for an idle binary client the cancelled read was all that kept its
  // Session alive.
  std::vector<std::shared_ptr<Session>> live = connections_.live();
  for (auto& s : live) s->begin_drain();
  boost::asio::post(io_, [this, live = std::move(live)]() mutable { drain_and_stop(live); });
}

void Server::drain_and_stop(std::vector<std::shared_ptr<Session>>& live) {
  if (connections_.taken_for_drain() != 0)
    spdlog::info("took {} queued connection(s) to drain", connections_.taken_for_drain());
  if (counters_.connections_undrained != 0) {
    spdlog::warn("{} queued connection(s) closed unread at shutdown: no room to drain them",
                 counters_.connections_undrained);
  }
  gpu_sampler_.stop();
  const auto deadline = std::chrono::steady_clock::now() + kDrainBudget;
  for (auto& s : live) s->drain(deadline);
  // Closing a session makes the last pass over its shared rings (ClientStream::closed):
  // before the snapshot, or what that pass consumes would be in no snapshot while the
  // rings' consumer positions say it was taken (a restart lost it, uncounted). The
  // processes did not end their connections: their open spans stay open, for the
  // snapshot, and end when they reconnect to the next daemon.
  collector_.stopping();
  for (auto& s : live) s->close();
  // No render job may still write a snapshot (or read the state) after this.
  renderer_.stop();
  // Snapshot with everything drained applied, open spans included.
  final_snapshot_written_ = save_snapshot_now();
  listener_.remove_socket_file();
  spdlog::info("stopped");
  io_.stop();
}

}  // namespace steptrace::daemon
