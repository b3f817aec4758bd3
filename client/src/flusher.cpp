#include "client/src/flusher.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <sys/uio.h>

#include <algorithm>
#include <array>
#include <cassert>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <new>

#ifndef STEPTRACE_CLIENT_VERSION
#define STEPTRACE_CLIENT_VERSION "0.0.0"
#endif

namespace steptrace::client {
namespace {

constexpr std::chrono::milliseconds kMinBackoff{10};
constexpr std::chrono::milliseconds kMaxBackoff{1000};
constexpr std::chrono::milliseconds kAnchorInterval{50};
constexpr int kQuietPollMs = 20;
// Spare rings kept offered to the daemon (protocol version 8): new threads take one each
// without waiting for an offer; a burst of more new threads than this within one flusher
// round makes the rest their own rings, offered at once (the window before version 8).
constexpr std::size_t kSpareRings = 2;
// After a spare's memfd failed or the daemon refused one: none for this long, doubling
// up to the maximum while it keeps happening (back to the minimum once one is mapped, and
// on each new connection).
constexpr std::chrono::milliseconds kMinSparesBackoff{1000};
constexpr std::chrono::milliseconds kMaxSparesBackoff{60000};
// Room kept after the events for the DroppedByCause frame and two Flush frames (the
// flusher's own and a steptrace_flush caller's).
constexpr std::size_t kFrameBytes = sizeof(proto::FrameHeader);
constexpr std::size_t kTailReserve =
    kFrameBytes + sizeof(proto::DroppedByCause) + 2 * (kFrameBytes + sizeof(proto::FlushRequest));
static_assert(sizeof(proto::DroppedByCause) >= sizeof(proto::DroppedReport));
constexpr std::size_t kLedgerFrame = kFrameBytes + sizeof(proto::LedgerRecord);
constexpr std::size_t kBatchFrame = kFrameBytes + sizeof(proto::Batch);

bool same_counts(const proto::DroppedByCause& a, const proto::DroppedByCause& b) {
  return std::equal(std::begin(a.count), std::end(a.count), std::begin(b.count));
}

std::string process_name() {
  std::ifstream in("/proc/self/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

}  // namespace

std::string first_contact_notice(const std::string& path, int error) {
  char buf[256];
  const char* reason = ::strerror_r(error, buf, sizeof buf);  // GNU: returns the text
  std::string text = "steptrace: cannot connect to " + path + ": " + reason;
  if (error == ENOENT || error == ECONNREFUSED) {
    text +=
        " \u2014 no daemon listening there \u2014 is steptraced running? STEPTRACE_SOCKET "
        "sets another path";
  } else if (error == EACCES || error == EPERM) {
    text += " \u2014 is this user in the steptrace group?";
  }
  text +=
      " (events wait in this process's buffer meanwhile, counted as dropped only if it fills "
      "or the process exits first; STEPTRACE_QUIET=1 silences this)\n";
  return text;
}

int connect_unix_socket(const std::string& path, proto::UniqueFd& fd) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof addr.sun_path) return -ENAMETOOLONG;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  proto::UniqueFd s(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!s.valid()) return -errno;
  // A Unix stream connect completes at once or fails (EAGAIN: backlog full).
  if (::connect(s.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    return -errno;  // read before s closes
  }
  fd = std::move(s);
  return 0;
}

Flusher::Flusher(ClientState& state, std::string socket_path, proto::UniqueFd fd)
    : s_(state), path_(std::move(socket_path)) {
  buf_.resize(kBatchBytes);
  marks_.reserve(256);
  ledger_.reserve(2 * kLedgerQueueCapacity);
  taken_.reserve(kLedgerQueueCapacity);
  carried_.reserve(2 * kLedgerQueueCapacity);
  next_attempt_ = Clock::now();
  if (fd.valid()) on_connected(std::move(fd));
}

Flusher::~Flusher() {
  stop();
  if (fd_.valid()) close_connection(Close::kHere);
  drop_resend();  // no daemon will take them any more
}

void Flusher::start() {
  thread_ = std::thread([this] { run(); });
}

void Flusher::stop() {
  stop_.store(true);
  s_.wake();
  if (thread_.joinable()) thread_.join();
}

void Flusher::abandon_after_fork() noexcept { fd_.reset(); }

void Flusher::on_connected(proto::UniqueFd fd) {
  // Contact made: a later failed reconnection (a daemon restarting) is no first contact.
  s_.notice_printed.store(true, std::memory_order_relaxed);
  fd_ = std::move(fd);
  decoder_.emplace(proto::Side::kClient);
  version_ = s_.protocol_version.load(std::memory_order_relaxed);
  numbered_ = version_ >= proto::kBatchProtocolVersion;
  // A daemon of an earlier version cannot skip what it applied before: resending could
  // count twice.
  if (!numbered_) drop_resend();
  need_hello_ = true;
  accepted_ = false;
  steps_sent_ = 0;
  resend_dropped_ = true;
  len_ = off_ = 0;
  batch_records_ = batch_events_ = 0;
  marks_.clear();
  unacked_.clear();
  clock_dirty_ = true;
  quiet_ = false;
  nudge_flush_ = 0;
  connected_at_ = Clock::now();
  spares_resume_ = {};
  spares_backoff_ = kMinSparesBackoff;
  spares_due_ = true;
  unshare_rings();
  if (version_ < proto::kSpareRingProtocolVersion) {
    // A daemon before version 8 would take a spare's thread 0 at its word and refuse every
    // record of the thread that takes it: the spares no thread took go, like an exited
    // thread's empty ring.
    std::lock_guard lock(s_.registry.mu);
    for (auto& ring : s_.registry.rings) {
      if (ring->spare()) ring->orphan();
    }
  }
  {
    std::lock_guard lock(s_.registry.mu);
    s_.registry.retired_shared = {};  // this daemon never saw those rings
  }
  s_.connected.store(true, std::memory_order_release);
}

void Flusher::unshare_rings() {
  std::lock_guard lock(s_.registry.mu);
  for (auto& ring : s_.registry.rings) {
    ring->sharing = EventRing::Sharing::kLocal;
    ring->refused = false;
  }
}

void Flusher::close_connection(Close how) {
  const bool lost = how != Close::kHere;
  std::uint64_t dropped = 0;
  if (how == Close::kLost && numbered_) {
    // Numbered batches: what the daemon did not acknowledge goes again, oldest first, on
    // the next connection (it skips what it applied).
    // This connection's batches are older than those still waiting to be resent (it was
    // resending them oldest first): they go first, so the daemon never sees a batch after
    // a later one of the same process (it would skip it).
    std::deque<Unacked> again = std::move(unacked_);
    if (batch_records_ > 0) {
      current_.flush = batch_flush_;
      current_.records = batch_records_;
      current_.events = batch_events_;
      again.push_back(std::move(current_));
    }
    for (Unacked& batch : resend_) again.push_back(std::move(batch));
    resend_ = std::move(again);
    unacked_.clear();
  } else if (lost) {
    // What the daemon did not acknowledge is lost with the connection. Batches waiting to
    // be resent stay (a refusal such as max_connections_per_uid is no reason to give them
    // up): an earlier version's daemon drops them at the next connection (on_connected).
    dropped = batch_records_;
    for (const Unacked& batch : unacked_) dropped += batch.records;
    if (!numbered_) drop_resend();
  } else {
    for (const FrameMark& m : marks_) {
      if (m.end > off_) dropped += m.records;
    }
    drop_resend();
  }
  if (how != Close::kLost || !numbered_) {
    for (Unacked& batch : unacked_) retained_bytes_ -= batch.bytes.size();
    if (batch_records_ > 0) retained_bytes_ -= current_.bytes.size();
  }
  current_ = {};
  if (dropped > 0) s_.count_drops(proto::DropCause::kInFlight, dropped);
  // A daemon that ends the connection drains the rings it mapped before it closes (or it
  // died): the flusher consumes them again from their tails. When this side closes, the
  // daemon drains them after it reads the end, so they stay its own.
  if (lost) unshare_rings();
  unacked_.clear();
  marks_.clear();
  batch_records_ = batch_events_ = 0;
  len_ = off_ = 0;
  fd_.reset();
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
  assert(thread_owner_.is_caller());
  proto::UniqueFd fd;
  const int rc = connect_unix_socket(path_, fd);
  if (rc == 0) {
    on_connected(std::move(fd));
    return;
  }
  // First contact failed: say so once per process (not per reconnect), from here, the
  // flusher thread, never from a trainer's.
  if (!s_.quiet && !s_.notice_printed.exchange(true, std::memory_order_relaxed)) {
    const std::string text = first_contact_notice(path_, -rc);
    [[maybe_unused]] const ssize_t w = ::write(STDERR_FILENO, text.data(), text.size());
  }
  next_attempt_ = Clock::now() + backoff_;
  backoff_ = std::min(backoff_ * 2, kMaxBackoff);
}

void Flusher::read_socket() {
  assert(thread_owner_.is_caller());
  for (;;) {
    auto space = decoder_->prepare(4096);
    const ssize_t n = ::recv(fd_.get(), space.data(), space.size(), MSG_DONTWAIT);
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
        if ((ack->sequence & kOwnFlushBit) != 0) {
          if (ack->sequence >= hello_flush_) accepted_ = true;
          if (nudge_flush_ != 0 && ack->sequence >= nudge_flush_) nudge_flush_ = 0;
          std::uint64_t delivered = 0;
          while (!unacked_.empty() && unacked_.front().flush <= ack->sequence) {
            Unacked& batch = unacked_.front();
            delivered += batch.events;
            retained_bytes_ -= batch.bytes.size();
            if (spare_.size() < 4 && batch.bytes.capacity() != 0) {
              spare_.push_back(std::move(batch.bytes));
            }
            unacked_.pop_front();
          }
          if (delivered != 0) {
            std::lock_guard lock(s_.registry.mu);
            s_.registry.delivered += delivered;
          }
          continue;
        }
        std::lock_guard lock(s_.flush.mu);
        s_.flush.resolve_acked_locked(ack->sequence);
      } else if (const auto* ring_ack = std::get_if<proto::RingAck>(&*r.message)) {
        ring_answered(*ring_ack);
      } else if (const auto* error = std::get_if<proto::ErrorReport>(&*r.message)) {
        // A daemon of an earlier protocol version refused our hello: try the version
        // before ours from the next connection on (PROTOCOL.md section 6).
        if (error->code == static_cast<std::uint32_t>(proto::ErrorCode::kUnsupportedVersion) &&
            version_ > proto::kMinProtocolVersion) {
          s_.protocol_version.store(static_cast<std::uint16_t>(version_ - 1),
                                    std::memory_order_relaxed);
        }
        // The daemon closes after an error; reconnect (with backoff) like any loss, but
        // resend nothing: it refused this stream.
        close_connection(Close::kRefused);
        return;
      }
    }
  }
}

void Flusher::send_pending() {
  assert(thread_owner_.is_caller());
  while (off_ < len_) {
    const ssize_t n =
        ::send(fd_.get(), buf_.data() + off_, len_ - off_, MSG_NOSIGNAL | MSG_DONTWAIT);
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
  if (batch_records_ > 0) {
    current_.flush = batch_flush_;
    current_.records = batch_records_;
    current_.events = batch_events_;
    unacked_.push_back(std::move(current_));
    current_ = {};
  }
  batch_records_ = 0;
  batch_events_ = 0;
  marks_.clear();
}

// One build_batch round: the encoder over buf_ (short of kTailReserve) and what went
// into it so far.
struct Flusher::Round {
  proto::Encoder enc;
  bool tsc = false;                 // stamps are TSC ticks, converted to ns here
  bool ledger_waits = false;        // many carried over: the ledger queue waits
  std::size_t ledger_reserved = 0;  // room kept for ledger frames still to go among events
  std::size_t ledger_sent = 0;
  std::size_t events_sent = 0;
  bool leftovers = false;  // the batch is full: the rest waits for the next round
  bool nudge = false;      // a shared ring is past its high-water mark
  bool offered = false;    // a ring waits for its RingAck: a flush cannot be answered yet
};

bool Flusher::build_batch() {
  assert(thread_owner_.is_caller());
  len_ = off_ = 0;
  marks_.clear();
  const bool tsc = s_.clock_source == ClockSource::kTsc;
  if (tsc && !s_.converter.ready() && !s_.converter.anchor(take_clock_sample())) {
    return false;  // still calibrating (at most TickConverter::kMinBaselineNs after load)
  }
  Round round{proto::Encoder(std::span<std::byte>(buf_.data(), buf_.size() - kTailReserve)), tsc};
  if (need_hello_) {
    encode_hello(round.enc);
    return false;
  }
  if (!accepted_) return false;
  // A re-anchored conversion goes first: the ledger stamps below were converted with it.
  if (shm_connection() && clock_dirty_ && tsc && round.enc.clock_sync(s_.converter.sync())) {
    clock_dirty_ = false;
  }
  // Room for the Batch frame (version 7), filled in or removed by seal_batch().
  batch_begin_ = SIZE_MAX;
  if (numbered_) {
    batch_begin_ = round.enc.size();
    round.enc.batch(1, 1);
  }

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

  const std::uint32_t steps = s_.steps.count();
  for (; steps_sent_ < steps; ++steps_sent_) {
    round.enc.register_step(proto::kFirstCustomStep + steps_sent_, s_.steps.name(steps_sent_));
  }
  take_ledger(round, cutoff);
  place_ledger_locked(round);
  drain_rings_locked(round);

  bool busy = round.leftovers || round.ledger_waits;
  std::size_t shared = 0;
  for (const auto& ring : rings) {
    // An unclaimed spare holds nothing to send, read by the daemon or not.
    shared += ring->sharing == EventRing::Sharing::kShared || ring->spare() ? 1 : 0;
  }
  quiet_ = shared == rings.size() && carried_.empty() && !busy;
  free_orphans_locked();
  // A ring this side drains is at its high-water mark: the next round comes at once.
  for (const auto& ring : rings) {
    if (ring->sharing == EventRing::Sharing::kLocal && ring->fill() >= ring->high_water()) {
      busy = true;
    }
  }
  encode_tail_locked(round, flush_seq);
  seal_batch();
  last_round_sent_events_ = round.events_sent > 0;
  return busy;
}

void Flusher::seal_batch() {
  if (batch_begin_ == SIZE_MAX) return;
  std::byte* const at = buf_.data() + batch_begin_;
  if (batch_records_ == 0) {
    // Nothing to resend (steps, drop counts, a nudge): the frames after the reserved room
    // move up over it. No record, so no mark.
    std::memmove(at, at + kBatchFrame, len_ - batch_begin_ - kBatchFrame);
    len_ -= kBatchFrame;
    batch_begin_ = SIZE_MAX;
    return;
  }
  std::uint32_t frames = 0;
  for (std::size_t pos = batch_begin_ + kBatchFrame; pos < batch_end_; ++frames) {
    proto::FrameHeader header;
    std::memcpy(&header, buf_.data() + pos, sizeof header);
    pos += sizeof header + header.size;
  }
  proto::Encoder(std::span<std::byte>(at, kBatchFrame)).batch(s_.next_batch(), frames);
  if (!spare_.empty()) {
    current_.bytes = std::move(spare_.back());
    spare_.pop_back();
  }
  current_.bytes.assign(at, buf_.data() + batch_end_);
  current_.marks.clear();
  for (const FrameMark& m : marks_) current_.marks.push_back({m.end - batch_begin_, m.records});
  retained_bytes_ += current_.bytes.size();
}

void Flusher::build_resend() {
  assert(thread_owner_.is_caller());
  len_ = off_ = 0;
  marks_.clear();
  batch_records_ = batch_events_ = 0;
  const std::uint32_t steps = s_.steps.count();
  if (steps_sent_ < steps) {
    // First the custom steps: a restarted daemon may not know them (its snapshot did not
    // keep the process), and the resent events may name them.
    proto::Encoder enc(buf_);
    for (; steps_sent_ < steps; ++steps_sent_) {
      enc.register_step(proto::kFirstCustomStep + steps_sent_, s_.steps.name(steps_sent_));
    }
    len_ = enc.size();
    return;
  }
  current_ = std::move(resend_.front());
  resend_.pop_front();
  std::memcpy(buf_.data(), current_.bytes.data(), current_.bytes.size());
  len_ = current_.bytes.size();
  marks_ = current_.marks;
  batch_records_ = current_.records;
  batch_events_ = current_.events;
  batch_flush_ = current_.flush;
}

void Flusher::drop_resend() {
  std::uint64_t dropped = 0;
  for (const Unacked& batch : resend_) {
    dropped += batch.records;
    retained_bytes_ -= batch.bytes.size();
  }
  resend_.clear();
  if (dropped > 0) s_.count_drops(proto::DropCause::kInFlight, dropped);
}

void Flusher::encode_hello(proto::Encoder& enc) {
  enc.hello(STEPTRACE_CLIENT_VERSION, process_name(), version_);
  if (version_ >= proto::kIdentityProtocolVersion && s_.identity.any()) {
    const ProcessIdentity& id = s_.identity;
    enc.identity(id.job, id.rank, id.local_rank, id.world_size);
  }
  if (version_ >= proto::kDeliveredProtocolVersion) {
    // Before anything of this connection: the daemon compares it with what it counted
    // for the process, and counts what a daemon that died took and did not keep.
    std::lock_guard lock(s_.registry.mu);
    enc.delivered(s_.registry.delivered_locked());
  }
  hello_flush_ = next_own_flush();
  enc.flush(hello_flush_);
  need_hello_ = false;
  len_ = enc.size();
  last_round_sent_events_ = false;
}

void Flusher::take_ledger(Round& round, std::uint64_t cutoff) {
  ledger_.swap(carried_);
  carried_.clear();
  round.ledger_waits = ledger_.size() >= kLedgerQueueCapacity;
  if (!round.ledger_waits) {
    s_.ledger.take_until(cutoff, taken_);
    ledger_.insert(ledger_.end(), taken_.begin(), taken_.end());
  }
}

void Flusher::place_ledger_locked(Round& round) {
  const auto& rings = s_.registry.rings;
  ledger_ring_.assign(ledger_.size(), SIZE_MAX);
  for (std::size_t k = 0; k < ledger_.size(); ++k) {
    // The live thread's ring; else (the thread exited since) the newest exited one of
    // that thread id.
    std::size_t orphan = SIZE_MAX;
    for (std::size_t i = 0; i < rings.size(); ++i) {
      if (rings[i]->thread_id() != ledger_[k].thread_id) continue;
      // A ring the daemon maps (or was offered): it orders the annotation among the
      // ring's events itself (PROTOCOL.md 11.3), so the record goes now.
      if (rings[i]->sharing != EventRing::Sharing::kLocal) continue;
      if (rings[i]->orphaned()) {
        orphan = i;
      } else {
        ledger_ring_[k] = i;
      }
    }
    if (ledger_ring_[k] == SIZE_MAX) ledger_ring_[k] = orphan;
    if (ledger_ring_[k] == SIZE_MAX) {
      send_ledger(round, ledger_[k]);
    } else {
      round.ledger_reserved += kLedgerFrame;
    }
  }
}

void Flusher::send_ledger(Round& round, proto::LedgerRecord record) {
  if (round.tsc) record.timestamp_ns = s_.converter.to_ns(record.timestamp_ns);
  // A daemon too old for leases (PROTOCOL.md section 6): the reservation goes without
  // its lease; a renewal cannot go at all and is counted as refused by the library.
  if (record.op > static_cast<std::uint8_t>(proto::last_ledger_op(version_))) {
    if (record.op != static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease)) {
      s_.count_drops(proto::DropCause::kInvalid);
      return;
    }
    record.op = static_cast<std::uint8_t>(proto::LedgerOp::kReserve);
    record.total_bytes = 0;
  }
  if (round.enc.ledger(record)) {
    ++round.ledger_sent;
    marks_.push_back({round.enc.size(), 1});
  }
}

void Flusher::drain_rings_locked(Round& round) {
  auto& rings = s_.registry.rings;
  // Round robin: start with the ring after the one the last round could not finish.
  const std::size_t count = rings.size();
  const std::size_t first = count == 0 ? 0 : next_ring_ % count;
  std::size_t unfinished = SIZE_MAX;
  for (std::size_t step = 0; step < count; ++step) {
    const std::size_t i = (first + step) % count;
    EventRing& ring = *rings[i];
    if (ring.sharing != EventRing::Sharing::kLocal) {
      // The daemon reads it; a ring past its high-water mark asks it to now (a Flush of
      // the flusher's own, in the tail), rather than at its next poll.
      if (ring.sharing == EventRing::Sharing::kShared && ring.fill() >= ring.high_water()) {
        round.nudge = true;
      }
      if (ring.sharing == EventRing::Sharing::kOffered) round.offered = true;
      continue;
    }
    if (!ring.consumer_gone()) {
      // A daemon that mapped it on an earlier connection has not let it go yet: its
      // annotations wait with its events.
      round.offered = true;
      for (std::size_t k = 0; k < ledger_.size(); ++k) {
        if (ledger_ring_[k] != i) continue;
        round.ledger_reserved -= kLedgerFrame;
        carried_.push_back(ledger_[k]);
      }
      continue;
    }
    drain_ring_locked(round, i);
    if (round.leftovers && unfinished == SIZE_MAX) unfinished = i;
  }
  next_ring_ = unfinished == SIZE_MAX ? 0 : unfinished + 1;
}

void Flusher::drain_ring_locked(Round& round, std::size_t i) {
  EventRing& ring = *s_.registry.rings[i];
  std::uint64_t pos = ring.consumed();
  for (std::size_t k = 0; k < ledger_.size(); ++k) {
    if (ledger_ring_[k] != i) continue;
    const std::uint64_t stamp = ledger_[k].timestamp_ns;
    if (round.leftovers) {
      round.ledger_reserved -= kLedgerFrame;
      // The batch is full: the record goes now only if none of its thread's earlier
      // events is still waiting, else it waits with them.
      if (pos < heads_[i] && ring.at(pos).ticks <= stamp) {
        carried_.push_back(ledger_[k]);
      } else {
        send_ledger(round, ledger_[k]);  // fits: its room was reserved
      }
      continue;
    }
    std::uint64_t until = pos;
    while (until < heads_[i] && ring.at(until).ticks <= stamp) ++until;
    send_events(round, ring, pos, until);
    round.ledger_reserved -= kLedgerFrame;
    if (pos == until) {
      send_ledger(round, ledger_[k]);
    } else {
      carried_.push_back(ledger_[k]);
    }
  }
  if (!round.leftovers) send_events(round, ring, pos, heads_[i]);
  ring.release(pos);
}

void Flusher::send_events(Round& round, EventRing& ring, std::uint64_t& pos, std::uint64_t end) {
  proto::Encoder& enc = round.enc;
  const auto runs = ring.range(pos, end);
  for (const auto run : {runs.first, runs.second}) {
    std::size_t done = 0;
    while (done < run.size() && !round.leftovers) {
      const std::size_t reserved = round.ledger_reserved + kFrameBytes;
      const std::size_t room = enc.remaining() > reserved ? enc.remaining() - reserved : 0;
      const std::size_t fit = std::min(run.size() - done, room / sizeof(proto::EventRecord));
      const std::size_t start = enc.size() + kFrameBytes;
      const auto* records = reinterpret_cast<const proto::EventRecord*>(run.data() + done);
      const std::size_t n = fit == 0 ? 0 : enc.events({records, fit});
      if (n == 0) {
        round.leftovers = true;
        break;
      }
      if (round.tsc) {
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
      round.events_sent += n;
    }
  }
}

void Flusher::encode_tail_locked(Round& round, std::uint64_t flush_seq) {
  const std::size_t used = round.enc.size();
  proto::Encoder tail(std::span<std::byte>(buf_.data() + used, buf_.size() - used));
  const proto::DroppedByCause dropped =
      shm_connection() ? s_.dropped_for_daemon_locked() : s_.dropped_locked();
  std::uint64_t total = 0;
  for (const std::uint64_t n : dropped.count) total += n;
  if ((resend_dropped_ && total > 0) || !same_counts(dropped, dropped_sent_)) {
    const bool sent = version_ >= 2 ? tail.dropped_by_cause(dropped) : tail.dropped(total);
    if (sent) {
      dropped_sent_ = dropped;
      resend_dropped_ = false;
    }
  }
  batch_records_ = round.events_sent + round.ledger_sent;
  batch_events_ = round.events_sent;
  // One nudge at a time: a daemon busy draining must not get a Flush per wake-up, or one
  // connection's Flushes keep its io thread from every other ring.
  const bool nudge = round.nudge && nudge_flush_ == 0;
  if (batch_records_ > 0 || nudge) {
    batch_flush_ = next_own_flush();
    tail.flush(batch_flush_);  // fits: kTailReserve
    if (nudge) nudge_flush_ = batch_flush_;
  }
  batch_end_ = used + tail.size();  // a numbered batch ends with its own Flush
  // Everything recorded before the flush call was taken (the heads were read after it);
  // the daemon drains the rings it maps before it answers.
  if (!round.leftovers && !round.ledger_waits && !round.offered && flush_seq > flush_sent_ &&
      tail.flush(flush_seq)) {
    flush_sent_ = flush_seq;
  }
  len_ = used + tail.size();
}

void Flusher::free_orphans_locked() {
  auto& rings = s_.registry.rings;
  const bool connected = fd_.valid();
  std::size_t kept = 0;  // exited threads' rings keeping their events, newest first
  for (std::size_t i = rings.size(); i-- > 0;) {
    EventRing& ring = *rings[i];
    if (!ring.orphaned()) continue;
    if (connected) {
      // Drained first (by this side or the daemon); a ring offered on this connection
      // waits for its RingAck.
      if (ring.sharing == EventRing::Sharing::kOffered || ring.fill() != 0 ||
          !ring.consumer_gone()) {
        continue;
      }
    } else if (!ring.consumer_gone() || (ring.fill() != 0 && ++kept <= kMaxOrphanRings)) {
      continue;  // nobody drains it: the newest kMaxOrphanRings keep their events
    }
    s_.registry.free_ring_locked(i);
  }
}

void Flusher::offer_rings() {
  assert(thread_owner_.is_caller());
  const bool tsc = s_.clock_source == ClockSource::kTsc;
  if (tsc && !s_.converter.ready()) return;  // the daemon needs the conversion first
  std::lock_guard lock(s_.registry.mu);
  for (auto& owned : s_.registry.rings) {
    EventRing& ring = *owned;
    if (ring.sharing != EventRing::Sharing::kLocal || ring.refused || ring.memfd() < 0) continue;
    if (ring.spare() && version_ < proto::kSpareRingProtocolVersion) continue;  // see on_connected
    if (!ring.consumer_gone()) continue;  // the last daemon's final pass is not done yet
    if (ring.orphaned() && ring.fill() == 0) continue;  // about to be freed
    // [ClockSync] RingAttach, the memfd riding on the first byte (PROTOCOL.md 11.2).
    std::array<std::byte, 2 * kFrameBytes + sizeof(proto::ClockSync) + sizeof(proto::RingAttach)>
        frames{};
    proto::Encoder enc(frames);
    enc.clock_sync(tsc ? s_.converter.sync() : proto::ClockSync{});
    enc.ring_attach(ring.ring_id, ring.thread_id(), ring.capacity());
    iovec iov{frames.data(), enc.size()};
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int))] = {};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    cmsghdr* cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    const int fd = ring.memfd();
    std::memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
    // The tail before the offer: the daemon may map the ring and consume from it as soon
    // as the frame is out, before sendmsg returns; what it takes from there on is
    // counted in Delivered once it lets the ring go (a later tail would leave out what
    // it took meanwhile, and a crash would lose those events uncounted).
    const std::uint64_t tail = ring.consumed();
    ssize_t n;
    do {
      n = ::sendmsg(fd_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    if (n < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        // Not a descriptor the socket can pass (e.g. too many in flight): this ring stays
        // on the socket path for this connection.
        if (errno == ETOOMANYREFS || errno == EMFILE || errno == ENFILE) {
          ring.refused = true;
          continue;
        }
        close_connection();
      }
      return;
    }
    ring.sharing = EventRing::Sharing::kOffered;
    ring.offered(tail);
    clock_dirty_ = false;
    const std::size_t sent = static_cast<std::size_t>(n);
    if (sent < enc.size()) {
      // The rest of the frames go as plain bytes, before anything else.
      std::memcpy(buf_.data(), frames.data() + sent, enc.size() - sent);
      off_ = 0;
      len_ = enc.size() - sent;
      batch_records_ = 0;
      batch_events_ = 0;
      marks_.clear();
      return;
    }
  }
}

void Flusher::keep_spares() {
  assert(thread_owner_.is_caller());
  if (version_ < proto::kSpareRingProtocolVersion) return;
  RingRegistry& registry = s_.registry;
  // Nothing changed since the last pass: no lock, no walk over the rings. (A bump this
  // load misses is seen by the next round's: the thread that took a spare wakes us.)
  if (!spares_due_ && registry.spares_taken.load(std::memory_order_relaxed) == spares_taken_seen_ &&
      registry.budget_epoch.load(std::memory_order_relaxed) == budget_seen_) {
    return;
  }
  if (Clock::now() < spares_resume_) return;  // still due once the pause is over
  // Made under the registry's lock, like a thread's own ring: a fork (fork_prepare takes
  // the lock) never copies a memfd the child's registry does not know of, and the budget
  // is checked and taken at once. A thread starting meanwhile waits for one ring's system
  // calls, as it would for its own.
  std::lock_guard lock(registry.mu);
  // Both are bumped only under the lock: this pass sees everything up to these values.
  spares_due_ = false;
  spares_taken_seen_ = registry.spares_taken.load(std::memory_order_relaxed);
  budget_seen_ = registry.budget_epoch.load(std::memory_order_relaxed);
  // Spares of an earlier per-thread size (steptrace_set_buffer_size) go the way of an
  // exited thread's empty ring: whoever consumes them lets them go. (Orphaning one
  // already orphaned changes nothing.)
  for (auto& ring : registry.rings) {
    if (ring->spare() && !ring->takeable_spare(registry.per_thread_bytes)) ring->orphan();
  }
  // A spare never takes budget a thread's smaller ring could use: only a whole per-thread
  // ring, while one fits.
  const std::uint64_t bytes = registry.per_thread_bytes;
  while (registry.spares_locked() < kSpareRings &&
         registry.total_bytes - std::min(registry.used_bytes, registry.total_bytes) >= bytes) {
    std::unique_ptr<EventRing> ring;
    try {
      ring = std::make_unique<EventRing>(0, static_cast<std::size_t>(bytes / kRingRecordBytes),
                                         /*shared=*/true);
    } catch (const std::bad_alloc&) {
    }
    if (ring == nullptr || ring->memfd() < 0) {
      // No memfd (or no memory): a spare would be an ordinary ring made early. Threads
      // make their own rings for a while, as before version 8.
      pause_spares();
      return;
    }
    ring->ring_id = registry.next_ring_id++;
    ring->made_spare = true;
    try {
      registry.rings.push_back(std::move(ring));
    } catch (const std::bad_alloc&) {
      pause_spares();
      return;
    }
    registry.used_bytes += bytes;
  }
}

void Flusher::pause_spares() {
  spares_due_ = true;  // try again when it ends
  spares_resume_ = Clock::now() + spares_backoff_;
  spares_backoff_ = std::min(spares_backoff_ * 2, kMaxSparesBackoff);
}

void Flusher::ring_answered(const proto::RingAck& ack) {
  std::lock_guard lock(s_.registry.mu);
  for (auto& ring : s_.registry.rings) {
    if (ring->ring_id != ack.ring_id || ring->sharing != EventRing::Sharing::kOffered) continue;
    ring->sharing = ack.status == static_cast<std::uint32_t>(proto::RingStatus::kMapped)
                        ? EventRing::Sharing::kShared
                        : EventRing::Sharing::kLocal;
    if (ring->sharing == EventRing::Sharing::kLocal) {
      ring->refused_by_daemon();
      s_.rings_refused.fetch_add(1, std::memory_order_relaxed);
      // A daemon over its ring limits for us: no spares for a while (each would be one
      // more refusal); the refused one is still taken as a socket-path ring.
      if (ring->made_spare) pause_spares();
    } else if (ring->made_spare) {
      spares_backoff_ = kMinSparesBackoff;
    }
    return;
  }
}

int Flusher::poll_timeout_ms(bool busy) const {
  if (busy) return 0;
  if (!fd_.valid()) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(next_attempt_ - Clock::now());
    return static_cast<int>(std::clamp<std::int64_t>(left.count(), 0, 100));
  }
  if (off_ < len_) return 10;  // waiting for POLLOUT; flush requests wake us anyway
  if (quiet_) return kQuietPollMs;
  return last_round_sent_events_ ? 1 : 2;
}

void Flusher::run() {
  thread_owner_.claim();
  while (!stop_.load(std::memory_order_acquire)) {
    const auto now = Clock::now();
    if (s_.clock_source == ClockSource::kTsc && now - last_anchor_ >= kAnchorInterval) {
      s_.converter.anchor(take_clock_sample());
      last_anchor_ = now;
      clock_dirty_ = true;
    }
    if (!fd_.valid()) {
      std::uint64_t waiting = 0;  // the newest pending flush's sequence, 0: none
      {
        std::lock_guard lock(s_.flush.mu);
        if (!s_.flush.waiters.empty()) waiting = s_.flush.requested;
      }
      // A new flush is worth an immediate attempt; when that fails, its callers (and
      // earlier ones) get -ENOTCONN now rather than at their timeout.
      const bool new_flush = waiting > flush_attempted_;
      if (now >= next_attempt_ || new_flush) try_connect();
      if (new_flush) {
        flush_attempted_ = waiting;
        if (!fd_.valid()) {
          std::lock_guard lock(s_.flush.mu);
          s_.flush.fail_upto_locked(waiting, -ENOTCONN);
        }
      }
      if (!fd_.valid()) {
        // Keep the memory of exited threads bounded while nobody drains them.
        std::lock_guard lock(s_.registry.mu);
        free_orphans_locked();
      }
    }
    bool busy = false;
    if (fd_.valid()) read_socket();
    if (fd_.valid() && off_ < len_) send_pending();
    // Rings wait until the resent batches are out: the daemon would fold their newer
    // events before the older ones of the same threads.
    if (fd_.valid() && off_ == len_ && accepted_ && shm_connection() && resend_.empty()) {
      keep_spares();
      offer_rings();
    }
    if (fd_.valid() && off_ == len_) {
      if (accepted_ && !resend_.empty()) {
        build_resend();  // before anything new, oldest first
        busy = true;
      } else if (!numbered_ || need_hello_ || retained_bytes_ + kBatchBytes <= kMaxRetainedBytes) {
        busy = build_batch();
      }
      if (len_ > 0) send_pending();
    }

    pollfd fds[2];
    nfds_t count = 0;
    const int wake = s_.wake_fd.load(std::memory_order_relaxed);
    if (wake >= 0) fds[count++] = {wake, POLLIN, 0};
    if (fd_.valid()) {
      fds[count++] = {fd_.get(), static_cast<short>(POLLIN | (off_ < len_ ? POLLOUT : 0)), 0};
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
