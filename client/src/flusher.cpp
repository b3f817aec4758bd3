#include "client/src/flusher.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#ifndef STEPTRACE_CLIENT_VERSION
#define STEPTRACE_CLIENT_VERSION "0.0.0"
#endif

namespace steptrace::client {
namespace {

constexpr std::chrono::milliseconds kMinBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};
constexpr std::chrono::milliseconds kAnchorInterval{50};
// Room kept after the events for the Dropped and Flush frames.
constexpr std::size_t kTailReserve = 64;

std::string process_name() {
  std::ifstream in("/proc/self/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

}  // namespace

int connect_unix_socket(const std::string& path, int& fd) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) return -ENAMETOOLONG;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int s = ::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (s < 0) return -errno;
  // A Unix stream connect completes at once or fails (EAGAIN: backlog full).
  if (::connect(s, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    const int err = errno;
    ::close(s);
    return -err;
  }
  fd = s;
  return 0;
}

Flusher::Flusher(ClientState& state, std::string socket_path, int fd)
    : s_(state), path_(std::move(socket_path)) {
  buf_.resize(kBatchBytes);
  marks_.reserve(256);
  ledger_.reserve(kLedgerQueueCapacity);
  next_attempt_ = Clock::now();
  if (fd >= 0) on_connected(fd);
}

Flusher::~Flusher() {
  stop();
  if (fd_ >= 0) close_connection();
}

void Flusher::start() {
  thread_ = std::thread([this] { run(); });
}

void Flusher::stop() {
  stop_.store(true);
  s_.wake();
  if (thread_.joinable()) thread_.join();
}

void Flusher::abandon_after_fork() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void Flusher::on_connected(int fd) {
  fd_ = fd;
  decoder_.emplace(proto::Side::kClient);
  need_hello_ = true;
  steps_sent_ = 0;
  dropped_ever_sent_ = false;
  len_ = off_ = 0;
  marks_.clear();
  connected_at_ = Clock::now();
  s_.connected.store(true, std::memory_order_release);
}

void Flusher::close_connection() {
  std::uint64_t lost = 0;
  for (const FrameMark& m : marks_) {
    if (m.end > off_) lost += m.events;
  }
  s_.other_dropped.fetch_add(lost, std::memory_order_relaxed);
  marks_.clear();
  len_ = off_ = 0;
  ::close(fd_);
  fd_ = -1;
  s_.connected.store(false, std::memory_order_release);
  {
    std::lock_guard lock(s_.flush.mu);
    s_.flush.fail_all_locked(-ENOTCONN);
  }
  // A connection that lived a while resets the backoff; one that fails at once grows it.
  if (Clock::now() - connected_at_ > std::chrono::seconds(1)) backoff_ = kMinBackoff;
  next_attempt_ = Clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
}

void Flusher::try_connect() {
  int fd = -1;
  if (connect_unix_socket(path_, fd) == 0) {
    on_connected(fd);
    return;
  }
  next_attempt_ = Clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
}

void Flusher::read_socket() {
  for (;;) {
    auto space = decoder_->prepare(4096);
    const ssize_t n = ::recv(fd_, space.data(), space.size(), MSG_DONTWAIT);
    if (n == 0) {
      close_connection();
      return;
    }
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) close_connection();
      return;
    }
    decoder_->commit(static_cast<std::size_t>(n));
    for (;;) {
      proto::DecodeResult r = decoder_->next();
      if (r.error) {
        close_connection();
        return;
      }
      if (!r.message) break;
      if (const auto* ack = std::get_if<proto::FlushAck>(&*r.message)) {
        std::lock_guard lock(s_.flush.mu);
        s_.flush.resolve_acked_locked(ack->sequence);
      } else if (std::holds_alternative<proto::ErrorReport>(*r.message)) {
        // The daemon closes after an error; reconnect (with backoff) like any loss.
        close_connection();
        return;
      }
    }
  }
}

void Flusher::send_pending() {
  while (off_ < len_) {
    const ssize_t n = ::send(fd_, buf_.data() + off_, len_ - off_, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      off_ += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    close_connection();
    return;
  }
  len_ = off_ = 0;
  marks_.clear();
}

bool Flusher::build_batch() {
  const bool tsc = s_.clock_source == ClockSource::kTsc;
  if (tsc && !s_.converter.ready() && !s_.converter.anchor(take_clock_sample())) {
    return false;  // still calibrating (at most TickConverter::kMinBaselineNs after load)
  }
  auto to_ns = [&](std::uint64_t ticks) { return tsc ? s_.converter.to_ns(ticks) : ticks; };
  std::uint64_t flush_seq = 0;
  {
    std::lock_guard lock(s_.flush.mu);
    flush_seq = s_.flush.requested;
  }
  // Annotations stamped after this cutoff may follow events not yet published: they wait
  // for the next round.
  const std::uint64_t cutoff = tsc ? tsc_ticks() : monotonic_ns();
  std::lock_guard lock(s_.registry.mu);
  auto& rings = s_.registry.rings;
  heads_.resize(rings.size());
  for (std::size_t i = 0; i < rings.size(); ++i) heads_[i] = rings[i]->published();

  proto::Encoder enc(std::span<std::byte>(buf_.data(), buf_.size() - kTailReserve));
  if (need_hello_) {
    enc.hello(STEPTRACE_CLIENT_VERSION, process_name());
    need_hello_ = false;
  }
  const std::uint32_t steps = s_.steps.count();
  for (; steps_sent_ < steps; ++steps_sent_) {
    enc.register_step(proto::kFirstCustomStep + steps_sent_, s_.steps.name(steps_sent_));
  }

  // Each annotation goes between its own thread's events, in recording order; those of
  // threads without a ring go first.
  s_.ledger.take_until(cutoff, ledger_);
  ledger_ring_.assign(ledger_.size(), SIZE_MAX);
  constexpr std::size_t kLedgerFrame = sizeof(proto::FrameHeader) + sizeof(proto::LedgerRecord);
  std::size_t ledger_reserved = 0;
  auto send_ledger = [&](proto::LedgerRecord record) {
    record.timestamp_ns = to_ns(record.timestamp_ns);
    enc.ledger(record);
  };
  for (std::size_t k = 0; k < ledger_.size(); ++k) {
    for (std::size_t i = 0; i < rings.size(); ++i) {
      if (rings[i]->thread_id() == ledger_[k].thread_id && !rings[i]->orphaned()) {
        ledger_ring_[k] = i;
      }
    }
    if (ledger_ring_[k] == SIZE_MAX) {
      send_ledger(ledger_[k]);
    } else {
      ledger_reserved += kLedgerFrame;
    }
  }

  bool leftovers = false;
  std::size_t events_sent = 0;
  // Encodes ring events [pos, end) while they fit beside the reserved ledger frames.
  auto send_events = [&](EventRing& ring, std::uint64_t& pos, std::uint64_t end) {
    const auto runs = ring.range(pos, end);
    for (const auto run : {runs.first, runs.second}) {
      std::size_t done = 0;
      while (done < run.size() && !leftovers) {
        const std::size_t room =
            enc.remaining() > ledger_reserved + sizeof(proto::FrameHeader)
                ? enc.remaining() - ledger_reserved - sizeof(proto::FrameHeader)
                : 0;
        const std::size_t fit = std::min(run.size() - done, room / sizeof(proto::EventRecord));
        const std::size_t start = enc.size() + sizeof(proto::FrameHeader);
        const auto* records = reinterpret_cast<const proto::EventRecord*>(run.data() + done);
        const std::size_t n = fit == 0 ? 0 : enc.events({records, fit});
        if (n == 0) {
          leftovers = true;
          break;
        }
        if (tsc) {
          for (std::size_t k = 0; k < n; ++k) {
            std::byte* at = buf_.data() + start + k * sizeof(proto::EventRecord);
            std::uint64_t ticks;
            std::memcpy(&ticks, at, sizeof ticks);
            const std::uint64_t ns = s_.converter.to_ns(ticks);
            std::memcpy(at, &ns, sizeof ns);
          }
        }
        marks_.push_back({enc.size(), static_cast<std::uint32_t>(n)});
        done += n;
        pos += n;
        events_sent += n;
      }
    }
  };
  for (std::size_t i = 0; i < rings.size(); ++i) {
    EventRing& ring = *rings[i];
    std::uint64_t pos = ring.consumed();
    for (std::size_t k = 0; k < ledger_.size(); ++k) {
      if (ledger_ring_[k] != i) continue;
      std::uint64_t until = pos;
      while (until < heads_[i] && ring.at(until).ticks <= ledger_[k].timestamp_ns) ++until;
      if (!leftovers) send_events(ring, pos, until);
      ledger_reserved -= kLedgerFrame;
      send_ledger(ledger_[k]);  // fits: its room was reserved
    }
    if (!leftovers) send_events(ring, pos, heads_[i]);
    ring.release(pos);
  }

  bool busy = leftovers;
  for (std::size_t i = rings.size(); i-- > 0;) {
    EventRing& ring = *rings[i];
    if (ring.orphaned() && ring.fill() == 0) {
      s_.registry.free_ring_locked(i);
    } else if (ring.fill() >= kRingHighWater) {
      busy = true;
    }
  }

  proto::Encoder tail(std::span<std::byte>(buf_.data() + enc.size(), buf_.size() - enc.size()));
  const std::uint64_t dropped = s_.total_dropped_locked();
  if (!dropped_ever_sent_ || dropped != dropped_sent_) {
    if (tail.dropped(dropped)) {
      dropped_sent_ = dropped;
      dropped_ever_sent_ = true;
    }
  }
  if (!leftovers && flush_seq > flush_sent_ && tail.flush(flush_seq)) flush_sent_ = flush_seq;
  len_ = enc.size() + tail.size();
  off_ = 0;
  last_round_sent_events_ = events_sent > 0;
  return busy;
}

int Flusher::poll_timeout_ms(bool busy) const {
  if (busy) return 0;
  if (fd_ < 0) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_attempt_ - Clock::now());
    return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 100));
  }
  if (off_ < len_) return 10;  // waiting for POLLOUT; flush requests wake us anyway
  return last_round_sent_events_ ? 1 : 2;
}

void Flusher::run() {
  while (!stop_.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    if (s_.clock_source == ClockSource::kTsc && now - last_anchor_ >= kAnchorInterval) {
      s_.converter.anchor(take_clock_sample());
      last_anchor_ = now;
    }
    if (fd_ < 0) {
      bool waiting = false;
      {
        std::lock_guard lock(s_.flush.mu);
        waiting = !s_.flush.waiters.empty();
      }
      // A pending flush is worth an immediate attempt, once per wait.
      if (now >= next_attempt_ || (waiting && !retry_now_)) try_connect();
      retry_now_ = waiting;
      if (fd_ < 0) {
        // Keep the memory of exited threads bounded while nobody drains them.
        std::lock_guard lock(s_.registry.mu);
        auto& rings = s_.registry.rings;
        std::size_t orphans = 0;
        for (std::size_t i = rings.size(); i-- > 0;) {
          if (!rings[i]->orphaned()) continue;
          if (rings[i]->fill() == 0 || ++orphans > kMaxOrphanRings) {
            s_.registry.free_ring_locked(i);
          }
        }
      }
    }
    bool busy = false;
    if (fd_ >= 0) read_socket();
    if (fd_ >= 0 && off_ < len_) send_pending();
    if (fd_ >= 0 && off_ == len_) {
      busy = build_batch();
      if (len_ > 0) send_pending();
    }

    pollfd fds[2];
    nfds_t count = 0;
    const int wake = s_.wake_fd.load(std::memory_order_relaxed);
    if (wake >= 0) fds[count++] = {wake, POLLIN, 0};
    if (fd_ >= 0) {
      fds[count++] = {fd_, static_cast<short>(POLLIN | (off_ < len_ ? POLLOUT : 0)), 0};
    }
    const int timeout = poll_timeout_ms(busy);
    if (timeout > 0 || count > 0) ::poll(fds, count, timeout);
    if (wake >= 0) {
      std::uint64_t value;
      [[maybe_unused]] const ssize_t r = ::read(wake, &value, sizeof value);
    }
  }
}

}  // namespace steptrace::client
