// Helpers for the daemon's unit tests: a fake Environment (clock and /proc) and a tiny
// session that encodes messages with proto::Encoder, decodes them with proto::Decoder
// and hands them to a real Collector, the way daemon/serve/session.cpp does. No mocks.
#pragma once

#include <array>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <system_error>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "daemon/state/collector.h"
#include "proto/codec.h"

namespace steptrace::daemon::test {

// A controllable clock and process table. Outlives the Collector that uses env().
struct FakeWorld {
  std::uint64_t now_ns = 1'000'000'000'000;
  std::map<std::int32_t, ProcessProbe> procs;  // pid -> what /proc says; absent: gone

  Environment env() {
    Environment e;
    e.monotonic_now_ns = [this] { return now_ns; };
    e.probe = [this](std::int32_t pid) -> std::optional<ProcessProbe> {
      const auto it = procs.find(pid);
      if (it == procs.end()) return std::nullopt;
      return it->second;
    };
    return e;
  }
  // Registers a running process and returns its identity.
  PeerIdentity spawn(std::int32_t pid, std::uint64_t start_time, std::string comm,
                     std::uint32_t uid = 1000) {
    procs[pid] = ProcessProbe{start_time, false, comm};
    PeerIdentity peer;
    peer.key = {pid, start_time};
    peer.uid = uid;
    peer.gid = uid;
    peer.comm = std::move(comm);
    return peer;
  }
  void kill(std::int32_t pid) { procs.erase(pid); }
  void zombify(std::int32_t pid) { procs.at(pid).zombie = true; }
};

inline proto::EventRecord start(std::uint32_t tid, std::uint32_t step, std::uint64_t ts) {
  return {ts, tid, static_cast<std::uint16_t>(step),
          static_cast<std::uint8_t>(proto::EventKind::kStart), 0};
}
inline proto::EventRecord end(std::uint32_t tid, std::uint32_t step, std::uint64_t ts) {
  return {ts, tid, static_cast<std::uint16_t>(step),
          static_cast<std::uint8_t>(proto::EventKind::kEnd), 0};
}

// One client connection: attach, a hello, then frames through the real codec.
class Connection {
 public:
  Connection(Collector& collector, const PeerIdentity& peer) : collector_(collector) {
    attach_error_ = collector_.attach(peer, handle_);
    if (attach_error_) return;
    std::array<std::byte, sizeof(proto::Hello)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.hello("0.1.0", peer.comm));
    deliver(enc.bytes());
  }
  ~Connection() { close(); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::error_code attach_error() const { return attach_error_; }
  ProcessHandle handle() const { return handle_; }
  void close() {
    if (!closed_ && !attach_error_) collector_.detach(handle_);
    closed_ = true;
  }

  std::error_code events(const std::vector<proto::EventRecord>& records) {
    std::vector<std::byte> buf(sizeof(proto::FrameHeader) +
                               records.size() * sizeof(proto::EventRecord));
    proto::Encoder enc(buf);
    EXPECT_EQ(enc.events(records), records.size());
    return deliver(enc.bytes());
  }
  std::error_code register_step(std::uint32_t id, std::string_view name) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::RegisterStep)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.register_step(id, name));
    return deliver(enc.bytes());
  }
  std::error_code dropped(std::uint64_t total) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::DroppedReport)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.dropped(total));
    return deliver(enc.bytes());
  }
  std::error_code dropped_by_cause(const proto::DroppedByCause& causes) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::DroppedByCause)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.dropped_by_cause(causes));
    return deliver(enc.bytes());
  }
  std::error_code ledger(const proto::LedgerRecord& record) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::LedgerRecord)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.ledger(record));
    return deliver(enc.bytes());
  }

 private:
  // Decodes everything in `bytes` and dispatches it; the first collector error wins.
  std::error_code deliver(std::span<const std::byte> bytes) {
    decoder_.feed(bytes);
    std::error_code first;
    for (;;) {
      proto::DecodeResult r = decoder_.next();
      EXPECT_FALSE(r.error) << r.error.message();
      if (r.error || !r.message) break;
      std::error_code ec;
      if (auto* h = std::get_if<proto::Hello>(&*r.message)) collector_.hello(handle_, *h);
      if (auto* e = std::get_if<proto::EventSpan>(&*r.message)) ec = collector_.events(handle_, *e);
      if (auto* s = std::get_if<proto::RegisterStep>(&*r.message))
        ec = collector_.register_step(handle_, *s);
      if (auto* l = std::get_if<proto::LedgerRecord>(&*r.message)) collector_.ledger(handle_, *l);
      if (auto* d = std::get_if<proto::DroppedReport>(&*r.message))
        collector_.dropped(handle_, d->total_dropped);
      if (auto* d = std::get_if<proto::DroppedByCause>(&*r.message))
        collector_.dropped_by_cause(handle_, *d);
      if (ec && !first) first = ec;
    }
    return first;
  }

  Collector& collector_;
  ProcessHandle handle_ = 0;
  std::error_code attach_error_;
  bool closed_ = false;
  proto::Decoder decoder_{proto::Side::kDaemon};
};

inline proto::LedgerRecord reserve_record(std::string_view gpu, std::uint64_t id,
                                          std::uint64_t bytes, std::string_view task,
                                          std::uint32_t tid, std::uint64_t ts) {
  proto::LedgerRecord r{};
  r.timestamp_ns = ts;
  r.reservation_id = id;
  r.bytes = bytes;
  r.thread_id = tid;
  r.op = static_cast<std::uint8_t>(proto::LedgerOp::kReserve);
  proto::set_field(r.gpu_uuid, gpu);
  proto::set_field(r.task, task);
  return r;
}

}  // namespace steptrace::daemon::test
