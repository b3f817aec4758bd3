// Helpers for the daemon's unit tests that need serve/: a recording transport, and a
// Connection that encodes messages with proto::Encoder and feeds them to the daemon's
// real ClientStream (daemon/serve/client_stream.h) over a real Collector: the bytes take
// the path they take in steptraced, minus the socket. The fake Environment (FakeWorld)
// and the event and record builders are state's (tests/daemon/state/collector_driver.h);
// a test of state alone feeds the Collector with that header's DirectClient instead.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <variant>
#include <vector>

#include <gtest/gtest.h>

#include "daemon/serve/client_stream.h"
#include "daemon/serve/commands.h"
#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"
#include "tests/daemon/state/collector_driver.h"

namespace steptrace::daemon::test {

// An Environment whose clock stands at 5 s and whose every pid looks alive and unchanged,
// so nothing is marked exited behind a test's back.
inline Environment alive_env() {
  Environment env;
  env.monotonic_now_ns = [] { return std::uint64_t{5'000'000'000}; };
  env.probe = [](std::int32_t) {
    return std::optional<ProcessProbe>(ProcessProbe{77, false, "t"});
  };
  return env;
}

// The transport side of a ClientStream, in memory: what the stream sends is kept in
// order, render jobs run at once on a fresh view of the collector (as Session does
// without a RenderWorker), and `unsent` stands for bytes the socket has not taken yet.
class RecordingTransport : public StreamTransport {
 public:
  explicit RecordingTransport(Collector& collector) : collector_(collector) {}
  void attach(ClientStream& stream) { stream_ = &stream; }

  void send(std::string bytes) override {
    unsent += bytes.size();
    sent += bytes;
  }
  std::size_t unsent_bytes() const override { return unsent; }
  void render(RenderJob job) override {
    ++renders;
    if (hold_renders) {
      held.push_back(std::move(job));
      return;
    }
    stream_->rendered(run_render_job(job, *collector_.freeze()));
  }
  // A piece of a streamed reply, rendered at once.
  void render_piece(std::shared_ptr<ReplyStream> stream) override {
    ++pieces;
    std::string out;
    const bool more = stream->next(out);
    stream_->piece_rendered(std::move(out), more);
  }
  // Kept until fire_deferred(), as if the delay had passed then.
  void defer(std::chrono::milliseconds delay, std::function<void()> fire) override {
    deferred_delays.push_back(delay);
    deferred.push_back(std::move(fire));
  }
  void fire_deferred() {
    auto fires = std::move(deferred);
    deferred.clear();
    for (auto& fire : fires) {
      fire();
      stream_->resume();
    }
  }
  // Renders the held jobs in order, as the RenderWorker hands them back.
  void release_renders() {
    for (auto& job : held) {
      stream_->rendered(run_render_job(job, *collector_.freeze()));
      stream_->resume();
    }
    held.clear();
  }

  std::string sent;        // everything the stream sent, in order
  std::size_t unsent = 0;  // what the socket has "not taken"; tests set and clear it
  int renders = 0;
  int pieces = 0;
  std::vector<std::function<void()>> deferred;
  std::vector<std::chrono::milliseconds> deferred_delays;
  bool hold_renders = false;  // keep render jobs until release_renders()
  std::vector<RenderJob> held;

 private:
  Collector& collector_;
  ClientStream* stream_ = nullptr;
};

// What a ClientStream needs beside the collector, with the daemon's defaults.
struct StreamWorld {
  explicit StreamWorld(Collector& c, Config cfg = {}) : collector(c), config(std::move(cfg)) {}
  Collector& collector;
  ServerCounters counters;  // what a Server would own
  Config config;
  CommandTable commands;
  RateLimitedLog log;
  SessionShared shared{collector, counters,      config, commands, log,
                       nullptr,   Environment{}, 0,      false};
};

// One binary client connection: a hello, then frames, through the real ClientStream.
// The stream ends at the first error (as in steptraced): later calls return it again.
class Connection {
 public:
  Connection(Collector& collector, const PeerIdentity& peer)
      : world_(collector),
        transport_(collector),
        stream_(world_.shared, transport_, peer, Refusal::kNone, ClientStream::Clock::now()) {
    transport_.attach(stream_);
    std::array<std::byte, sizeof(proto::Hello)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.hello("0.1.0", peer.comm));
    attach_error_ = deliver(enc.bytes());
  }
  ~Connection() { close(); }
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  std::error_code attach_error() const { return attach_error_; }
  ProcessHandle handle() const { return stream_.handle().value_or(0); }
  void close() { stream_.closed(); }
  ClientStream& stream() { return stream_; }
  const std::string& sent() const { return transport_.sent; }

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
  std::error_code identity(std::string_view job, std::uint32_t rank = proto::kNoRank,
                           std::uint32_t local_rank = proto::kNoRank,
                           std::uint32_t world_size = 0) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::Identity)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.identity(job, rank, local_rank, world_size));
    return deliver(enc.bytes());
  }
  // What earlier daemons took (protocol version 6): before any event of the connection.
  std::error_code delivered(std::uint64_t events) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::Delivered)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.delivered(events));
    return deliver(enc.bytes());
  }
  // Protocol version 7: the next `frames` frames are batch `sequence`.
  std::error_code batch(std::uint64_t sequence, std::uint32_t frames) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::Batch)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.batch(sequence, frames));
    return deliver(enc.bytes());
  }
  std::error_code flush(std::uint64_t sequence) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::FlushRequest)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.flush(sequence));
    return deliver(enc.bytes());
  }
  // The FlushAcks sent back so far, in order.
  std::vector<std::uint64_t> acks() const {
    proto::Decoder decoder(proto::Side::kClient);
    decoder.feed(std::as_bytes(std::span(transport_.sent.data(), transport_.sent.size())));
    std::vector<std::uint64_t> out;
    for (auto r = decoder.next(); r.message; r = decoder.next()) {
      if (const auto* ack = std::get_if<proto::FlushAck>(&*r.message)) out.push_back(ack->sequence);
    }
    return out;
  }
  std::error_code ledger(const proto::LedgerRecord& record) {
    std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::LedgerRecord)> buf{};
    proto::Encoder enc(buf);
    EXPECT_TRUE(enc.ledger(record));
    return deliver(enc.bytes());
  }
  // Any bytes, as a client would write them.
  std::error_code deliver(std::span<const std::byte> bytes) {
    while (!bytes.empty() && stream_.wants_input()) {
      const auto buffer = stream_.read_buffer();
      const std::size_t n = std::min(buffer.size(), bytes.size());
      std::memcpy(buffer.data(), bytes.data(), n);
      bytes = bytes.subspan(n);
      stream_.received(n);
    }
    return stream_.failure();
  }

 private:
  StreamWorld world_;
  RecordingTransport transport_;
  ClientStream stream_;
  std::error_code attach_error_;
};

}  // namespace steptrace::daemon::test
