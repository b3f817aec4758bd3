// Ledger annotations: strings cut and cleaned, flags set, bad input refused.
#include "client/src/ledger_queue.h"

#include <gtest/gtest.h>

#include <string>

#include "proto/codec.h"

namespace steptrace::client {
namespace {

TEST(LedgerRecord, CopiesFieldsAndStaysValidOnTheWire) {
  auto r = make_ledger_record(proto::LedgerOp::kReserve, "GPU-1234", "qlora-7b", 42, 7);
  ASSERT_TRUE(r);
  EXPECT_EQ(r->op, static_cast<std::uint8_t>(proto::LedgerOp::kReserve));
  EXPECT_EQ(r->timestamp_ns, 42u);
  EXPECT_EQ(r->thread_id, 7u);
  EXPECT_EQ(r->flags, 0u);
  EXPECT_EQ(proto::field_view(r->gpu_uuid), "GPU-1234");
  EXPECT_EQ(proto::field_view(r->task), "qlora-7b");
  EXPECT_TRUE(proto::valid_field(r->gpu_uuid, false));
  EXPECT_TRUE(proto::valid_field(r->task, true));
}

TEST(LedgerRecord, CutsLongStringsAndSetsFlags) {
  const std::string uuid(80, 'g');
  const std::string task(64, 't');
  auto r = make_ledger_record(proto::LedgerOp::kReserve, uuid.c_str(), task.c_str(), 1, 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(proto::field_view(r->gpu_uuid), std::string(63, 'g'));
  EXPECT_EQ(proto::field_view(r->task), std::string(63, 't'));
  EXPECT_EQ(r->flags, proto::kLedgerGpuUuidTruncated | proto::kLedgerTaskTruncated);
  const std::string exact(63, 'x');
  auto e = make_ledger_record(proto::LedgerOp::kRelease, exact.c_str(), exact.c_str(), 1, 1);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->flags, 0u);
}

TEST(LedgerRecord, ReplacesUnprintableBytes) {
  auto r = make_ledger_record(proto::LedgerOp::kVramSample, "GPU\n\x01x", "t\xffz", 1, 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(proto::field_view(r->gpu_uuid), "GPU??x");
  EXPECT_EQ(proto::field_view(r->task), "t?z");
  EXPECT_TRUE(proto::valid_field(r->gpu_uuid, false));
}

TEST(LedgerRecord, NullOrEmptyGpuIsRefusedNullTaskIsEmpty) {
  EXPECT_FALSE(make_ledger_record(proto::LedgerOp::kRelease, nullptr, "t", 1, 1));
  EXPECT_FALSE(make_ledger_record(proto::LedgerOp::kRelease, "", "t", 1, 1));
  auto r = make_ledger_record(proto::LedgerOp::kCleanup, "GPU-0", nullptr, 1, 1);
  ASSERT_TRUE(r);
  EXPECT_EQ(proto::field_view(r->task), "");
}

TEST(LedgerQueue, BoundedAndTakenWhole) {
  LedgerQueue q(3);
  auto r = *make_ledger_record(proto::LedgerOp::kRelease, "GPU-0", nullptr, 1, 1);
  EXPECT_TRUE(q.push(r));
  EXPECT_TRUE(q.push(r));
  EXPECT_TRUE(q.push(r));
  EXPECT_FALSE(q.push(r));
  std::vector<proto::LedgerRecord> out;
  q.take(out);
  EXPECT_EQ(out.size(), 3u);
  EXPECT_TRUE(q.push(r));
  q.take(out);
  EXPECT_EQ(out.size(), 1u);
}

}  // namespace
}  // namespace steptrace::client
