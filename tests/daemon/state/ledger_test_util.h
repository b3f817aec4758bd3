// Ledger records and a populated ledger for the tests of the ledger view
// (ledger_view_test.cpp) and of its snapshot form (tests/daemon/persist/).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string_view>

#include "daemon/state/ledger_view.h"
#include "proto/codec.h"

namespace steptrace::daemon::ledger_test {

constexpr std::uint64_t kGiB = 1024ull * 1024 * 1024;
constexpr std::uint64_t kMiB = 1024ull * 1024;
constexpr std::uint64_t kSecond = 1'000'000'000;
constexpr std::uint64_t kNow = 100 * kSecond;

constexpr std::uint32_t kLedgerReserve = 7;
constexpr std::uint32_t kWaitPoll = 10;

// What a record holds besides its op, GPU, time and thread; what is not named is zero or empty.
struct RecordFields {
  std::uint64_t id = 0;           // reservation_id
  std::uint64_t bytes = 0;        // reserved bytes; a sample's free bytes
  std::uint64_t total_bytes = 0;  // a sample's total; ReserveLease and Renew: the lease in ms
  std::uint32_t holder_pid = 0;   // Cleanup
  std::string_view task = "";     // Reserve and ReserveLease
};

// The one record builder; those below name the fields of each op.
inline proto::LedgerRecord make_record(proto::LedgerOp op, std::string_view gpu, std::uint64_t ts,
                                       std::uint32_t thread, const RecordFields& f) {
  proto::LedgerRecord r{};
  r.op = static_cast<std::uint8_t>(op);
  r.timestamp_ns = ts;
  r.thread_id = thread;
  r.reservation_id = f.id;
  r.bytes = f.bytes;
  r.total_bytes = f.total_bytes;
  r.holder_pid = f.holder_pid;
  EXPECT_TRUE(proto::set_field(r.gpu_uuid, gpu));
  EXPECT_TRUE(proto::set_field(r.task, f.task));
  return r;
}

inline proto::LedgerRecord reserve(std::string_view gpu, std::uint64_t id, std::uint64_t bytes,
                                   std::string_view task, std::uint64_t ts,
                                   std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kReserve, gpu, ts, thread,
                     {.id = id, .bytes = bytes, .task = task});
}

inline proto::LedgerRecord release(std::string_view gpu, std::uint64_t id, std::uint64_t ts,
                                   std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kRelease, gpu, ts, thread, {.id = id});
}

inline proto::LedgerRecord cleanup(std::string_view gpu, std::uint64_t id, std::uint32_t holder_pid,
                                   std::uint64_t ts, std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kCleanup, gpu, ts, thread,
                     {.id = id, .holder_pid = holder_pid});
}

inline proto::LedgerRecord sample(std::string_view gpu, std::uint64_t free, std::uint64_t total,
                                  std::uint64_t ts, std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kVramSample, gpu, ts, thread,
                     {.bytes = free, .total_bytes = total});
}

// Protocol version 3: a reservation with a lease, and its renewal (lease in total_bytes).
inline proto::LedgerRecord reserve_lease(std::string_view gpu, std::uint64_t id,
                                         std::uint64_t bytes, std::uint64_t lease_ms,
                                         std::uint64_t ts, std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kReserveLease, gpu, ts, thread,
                     {.id = id, .bytes = bytes, .total_bytes = lease_ms, .task = "leased"});
}

inline proto::LedgerRecord renew(std::string_view gpu, std::uint64_t id, std::uint64_t lease_ms,
                                 std::uint64_t ts, std::uint32_t thread = 1) {
  return make_record(proto::LedgerOp::kRenew, gpu, ts, thread, {.id = id, .total_bytes = lease_ms});
}

// A ledger with something in every field: two GPUs, a sample, a leak, step time,
// anomalies and an over-commitment.
inline void populate(LedgerView& view, const LedgerActor& a, const LedgerActor& b) {
  view.apply(a, reserve("GPU-A", 1, 3 * kGiB, "qlora-7b", 10 * kSecond, 5), kNow);
  view.attribute_span(a.key, 5, kLedgerReserve, 9 * kSecond, 11 * kSecond);
  view.apply(b, reserve("GPU-A", 2, 2 * kGiB, "", 12 * kSecond, 6), kNow);
  view.apply(b, sample("GPU-A", kGiB, 4 * kGiB, 13 * kSecond, 6), kNow);
  view.attribute_span(b.key, 6, kWaitPoll, 12 * kSecond, 14 * kSecond);
  view.apply(b, reserve("GPU-B", 7, 100 * kMiB, "eval", 20 * kSecond), kNow);
  view.apply(a, release("GPU-B", 7, 21 * kSecond), kNow);
  view.apply(a, release("GPU-B", 8, 21 * kSecond), kNow);  // unknown_release
  view.apply(b, reserve("GPU-B", 9, 1, "x", 22 * kSecond), kNow);
  view.check_holders([&](const ProcessKey& key) { return key != b.key; });
}

}  // namespace steptrace::daemon::ledger_test
