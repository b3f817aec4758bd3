// ClientStream's shared-memory rings (PROTOCOL.md section 11): the descriptors passed
// with the bytes, RingAttach, drains and the drop counts they add. The rest of the
// stream (sniffing, binary, text, timeouts) is client_stream.cpp.
#include "daemon/serve/client_stream.h"

#include <unistd.h>

#include "daemon/state/saturating.h"

namespace steptrace::daemon {

std::uint64_t drain_all_rings(SessionShared& shared) {
  if (shared.ring_streams.empty()) return 0;
  const std::vector<ClientStream*> streams(shared.ring_streams.begin(), shared.ring_streams.end());
  std::uint64_t events = 0;
  for (ClientStream* stream : streams) events += stream->drain_rings();
  return events;
}

void ClientStream::received_fds(std::span<const int> fds, bool truncated) {
  // A RingAttach takes one each. The library sends each with its own frames, and a read
  // ends after the first send that carries descriptors, so at most one waits from a read
  // whose frame was cut (a partial send) when the next arrives: a third is abuse.
  constexpr std::size_t kMaxPendingFds = 2;
  if (state_ == State::kFinishing || state_ == State::kClosed || dialect_ == Dialect::kText) {
    for (const int fd : fds) ::close(fd);
    return;
  }
  std::size_t& of_uid = shared_.pending_fds_by_uid[peer_.uid];
  for (const int fd : fds) {
    if (shared_.pending_fds >= kMaxPendingRingFds || of_uid >= kMaxPendingRingFdsPerUid) {
      // The daemon's reserve for passed descriptors (or this uid's share of it) is in
      // use: this one is closed now and its RingAttach refused (the ring goes on the
      // socket), in order.
      ::close(fd);
      pending_fds_.push_back(-1);
      continue;
    }
    pending_fds_.push_back(fd);
    ++shared_.pending_fds;
    ++of_uid;
  }
  if (of_uid == 0) shared_.pending_fds_by_uid.erase(peer_.uid);
  if (truncated || pending_fds_.size() > kMaxPendingFds) {
    close_pending_fds();
    fail(make_error_code(errc::bad_ring),
         truncated ? "descriptors cut off (MSG_CTRUNC)"
                   : "descriptors without RingAttach frames to take them");
  }
}

void ClientStream::close_pending_fds() {
  for (const int fd : pending_fds_) {
    if (fd >= 0) fd_taken(fd, true);
  }
  pending_fds_.clear();
}

void ClientStream::fd_taken(int fd, bool close) {
  if (close) ::close(fd);
  --shared_.pending_fds;
  auto it = shared_.pending_fds_by_uid.find(peer_.uid);
  if (it != shared_.pending_fds_by_uid.end() && --it->second == 0) {
    shared_.pending_fds_by_uid.erase(it);
  }
}

SharedRings& ClientStream::rings() {
  if (!rings_) {
    rings_ =
        std::make_unique<SharedRings>(shared_.config.server_limits, shared_.ring_budget, peer_.uid);
  }
  return *rings_;
}

std::error_code ClientStream::attach_ring(const proto::RingAttach& attach) {
  int fd = -1;
  if (!pending_fds_.empty()) {
    fd = pending_fds_.front();
    pending_fds_.pop_front();
    if (fd >= 0) fd_taken(fd, false);
  }
  std::optional<LimitKind> limit;
  const proto::RingStatus status = rings().attach(attach, fd, limit);
  RingCounters& counters = shared_.counters.rings;
  if (status == proto::RingStatus::kMapped) {
    ++counters.attached;
    shared_.ring_streams.insert(this);
    if (shared_.rings_active) shared_.rings_active();  // read it soon
  } else {
    ++counters.refused;
    if (limit) shared_.collector.count_limit(*limit);
    shared_.log.warn("ring_refused",
                     "client " + describe_peer() + ": ring " + std::to_string(attach.ring_id) +
                         " refused (" +
                         (limit ? std::string(limit_name(*limit))
                                : std::string(fd < 0 ? "no descriptor"
                                                     : "not a sealed memfd of the stated size")) +
                         "); its events come on the socket");
  }
  counters.mapped = shared_.ring_budget.rings;
  counters.bytes_mapped = shared_.ring_budget.bytes;
  std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::RingAck)> buf{};
  proto::Encoder encoder(buf);
  encoder.ring_ack(attach.ring_id, status);
  transport_.send({reinterpret_cast<const char*>(buf.data()), encoder.size()});
  return {};
}

std::uint64_t ClientStream::drain_rings() {
  if (!rings_ || !handle_ || state_ == State::kClosed) return 0;
  return drain_rings(SharedRings::Pass::kLive);
}

std::uint64_t ClientStream::drain_rings(SharedRings::Pass pass, std::optional<std::uint32_t> thread,
                                        std::uint64_t until_ns) {
  if (!rings_ || !handle_) return 0;
  const SharedRings::Drained d = rings_->drain(shared_.collector, *handle_, pass, thread, until_ns);
  RingCounters& counters = shared_.counters.rings;
  counters.events += d.events;
  counters.records_refused += d.refused;
  counters.bad_rings += d.bad_rings;
  shared_.collector.refused_records(*handle_, d.refused);
  counters.mapped = shared_.ring_budget.rings;
  counters.bytes_mapped = shared_.ring_budget.bytes;
  if (d.bad_rings > 0) {
    shared_.counters.protocol_errors[errc_name(errc::bad_ring)] += d.bad_rings;
    shared_.log.warn(errc_name(errc::bad_ring),
                     "client " + describe_peer() +
                         ": ring head out of range; the ring is dropped, the connection stays");
  }
  if (d.refused > 0 || d.bad_rings > 0 || d.events > 0) update_drops();
  return d.events;
}

void ClientStream::update_drops() {
  if (!handle_) return;
  proto::DroppedByCause total = frame_drops_;
  if (rings_) {
    const proto::DroppedByCause in_rings = rings_->drops();
    for (std::size_t i = 0; i < proto::kDropCauseCount; ++i) {
      total.count[i] = saturating_add(total.count[i], in_rings.count[i]);
    }
  }
  shared_.collector.dropped_by_cause(*handle_, total);
}

}  // namespace steptrace::daemon
