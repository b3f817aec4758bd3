// Helpers for the tests of the daemon's state: a fake Environment (clock and /proc),
// builders of events and ledger records, and a DirectClient that feeds a Collector
// through its own ingest API (attach, hello, events, register_step, ...), one call per
// message, as serve/ClientStream does once it has decoded a frame. No bytes, no stream:
// a state test fails only for what the Collector does. What the stream itself does
// (framing, validation, replies, acks) is tested in tests/daemon/serve/, through
// tests/daemon/daemon_test_util.h's Connection, which builds on this header.
#pragma once

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "daemon/state/collector.h"
#include "proto/codec.h"

namespace steptrace::daemon::test {

// A controllable clock and process table. Outlives the Collector that uses env().
struct FakeWorld {
  std::uint64_t now_ns = 1'000'000'000'000;
  std::map<std::int32_t, ProcessProbe> procs;  // pid -> what /proc says; absent: gone
  std::uint64_t probes = 0;                    // how many times /proc was asked
  int probe_error = 0;                         // non-zero: every probe fails with it

  Environment env() {
    Environment e;
    e.monotonic_now_ns = [this] { return now_ns; };
    e.probe = [this](std::int32_t pid) -> std::optional<ProcessProbe> {
      ++probes;
      if (probe_error != 0) {
        ProcessProbe failed;
        failed.error = probe_error;
        return failed;
      }
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

// A batch as the decoder hands it over: the records of one Events frame, in place.
inline proto::EventSpan span_of(const std::vector<proto::EventRecord>& events) {
  return {reinterpret_cast<const std::byte*>(events.data()), events.size()};
}

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

// A test's Collector over a FakeWorld, with the default limits; a test changes limits_
// and calls make() for a new Collector under them.
class CollectorFixture : public ::testing::Test {
 protected:
  FakeWorld world_;
  Limits limits_;
  std::unique_ptr<Collector> collector_;
  void SetUp() override { make(); }
  void make() { collector_ = std::make_unique<Collector>(limits_, world_.env()); }
};

// One client connection as the Collector sees it: attach and hello when made, detach
// when closed (or destroyed). Each call is the Collector's for one decoded message and
// returns what the Collector returns. Unlike a connection in steptraced, nothing ends
// it at an error: a test that wants that closes it.
class DirectClient {
 public:
  DirectClient(Collector& collector, const PeerIdentity& peer) : collector_(collector) {
    ProcessHandle handle = 0;
    attach_error_ = collector_.attach(peer, handle);
    if (attach_error_) return;
    handle_ = handle;
    proto::Hello hello{};
    std::memcpy(hello.magic, proto::kMagic, sizeof proto::kMagic);
    hello.version = proto::kProtocolVersion;
    proto::set_field_lossy(hello.library_version, "0.1.0");
    proto::set_field_lossy(hello.process_name, peer.comm);
    collector_.hello(handle, hello);
  }
  ~DirectClient() { close(); }
  DirectClient(const DirectClient&) = delete;
  DirectClient& operator=(const DirectClient&) = delete;

  std::error_code attach_error() const { return attach_error_; }
  ProcessHandle handle() const { return handle_.value_or(0); }
  void close() {
    if (handle_) collector_.detach(*handle_);
    handle_.reset();
  }

  std::error_code events(const std::vector<proto::EventRecord>& records) {
    return collector_.events(attached(), span_of(records));
  }
  std::error_code register_step(std::uint32_t id, std::string_view name) {
    proto::RegisterStep step{};
    step.step = id;
    EXPECT_TRUE(proto::set_field(step.name, name)) << name;
    return collector_.register_step(attached(), step);
  }
  void identity(std::string_view job, std::uint32_t rank = proto::kNoRank,
                std::uint32_t local_rank = proto::kNoRank, std::uint32_t world_size = 0) {
    proto::Identity identity{};
    proto::set_field_lossy(identity.job, job);
    identity.rank = rank;
    identity.local_rank = local_rank;
    identity.world_size = world_size;
    collector_.identity(attached(), identity);
  }
  void ledger(const proto::LedgerRecord& record) { collector_.ledger(attached(), record); }
  void dropped(std::uint64_t total) { collector_.dropped(attached(), total); }
  void dropped_by_cause(const proto::DroppedByCause& causes) {
    collector_.dropped_by_cause(attached(), causes);
  }

 private:
  // The handle for a call; a call after a refused attach or a close is the test's bug.
  ProcessHandle attached() const {
    EXPECT_TRUE(handle_.has_value()) << "a call on a client that is not attached";
    return handle();
  }

  Collector& collector_;
  std::optional<ProcessHandle> handle_;
  std::error_code attach_error_;
};

}  // namespace steptrace::daemon::test
