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

inline proto::LedgerRecord make_record(proto::LedgerOp op, std::string_view gpu, std::uint64_t ts,
                                       std::uint32_t thread = 1) {
  proto::LedgerRecord r{};
  r.op = static_cast<std::uint8_t>(op);
  r.timestamp_ns = ts;
  r.thread_id = thread;
  EXPECT_TRUE(proto::set_field(r.gpu_uuid, gpu));
  return r;
}

inline proto::LedgerRecord reserve(std::string_view gpu, std::uint64_t id, std::uint64_t bytes,
                                   std::string_view task, std::uint64_t ts,
                                   std::uint32_t thread = 1) {
  auto r = make_record(proto::LedgerOp::kReserve, gpu, ts, thread);
  r.reservation_id = id;
  r.bytes = bytes;
  EXPECT_TRUE(proto::set_field(r.task, task));
  return r;
}

inline proto::LedgerRecord release(std::string_view gpu, std::uint64_t id, std::uint64_t ts,
                                   std::uint32_t thread = 1) {
  auto r = make_record(proto::LedgerOp::kRelease, gpu, ts, thread);
  r.reservation_id = id;
  return r;
}

inline proto::LedgerRecord cleanup(std::string_view gpu, std::uint64_t id, std::uint32_t holder_pid,
                                   std::uint64_t ts, std::uint32_t thread = 1) {
  auto r = make_record(proto::LedgerOp::kCleanup, gpu, ts, thread);
  r.reservation_id = id;
  r.holder_pid = holder_pid;
  return r;
}

inline proto::LedgerRecord sample(std::string_view gpu, std::uint64_t free, std::uint64_t total,
                                  std::uint64_t ts, std::uint32_t thread = 1) {
  auto r = make_record(proto::LedgerOp::kVramSample, gpu, ts, thread);
  r.bytes = free;
  r.total_bytes = total;
  return r;
}

// Protocol version 3: a reservation with a lease, and its renewal (lease in total_bytes).
inline proto::LedgerRecord reserve_lease(std::string_view gpu, std::uint64_t id,
                                         std::uint64_t bytes, std::uint64_t lease_ms,
                                         std::uint64_t ts, std::uint32_t thread = 1) {
  auto r = reserve(gpu, id, bytes, "leased", ts, thread);
  r.op = static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease);
  r.total_bytes = lease_ms;
  return r;
}

inline proto::LedgerRecord renew(std::string_view gpu, std::uint64_t id, std::uint64_t lease_ms,
                                 std::uint64_t ts, std::uint32_t thread = 1) {
  auto r = make_record(proto::LedgerOp::kRenew, gpu, ts, thread);
  r.reservation_id = id;
  r.total_bytes = lease_ms;
  return r;
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
