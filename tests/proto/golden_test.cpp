// Golden vectors: tests/proto/golden/*.hex hold the exact bytes PROTOCOL.md specifies for
// fixed inputs (written from the spec's tables, not by this code). Each test encodes the
// same inputs with the Encoder and compares byte for byte, then decodes the file and
// checks every field, so any change of the wire format fails here.
#include <gtest/gtest.h>

#include <cctype>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "proto/codec.h"
#include "tests/proto/proto_test_util.h"

#ifndef STEPTRACE_PROTO_GOLDEN_DIR
#error "STEPTRACE_PROTO_GOLDEN_DIR must point at tests/proto/golden"
#endif

namespace steptrace::proto {
namespace {

using testing::Bytes;
using testing::decode_all;
using testing::DecodeAll;

// Hex bytes separated by whitespace; '#' starts a comment to the end of the line.
Bytes read_hex(const std::string& name) {
  const std::string path = std::string(STEPTRACE_PROTO_GOLDEN_DIR) + "/" + name;
  std::ifstream in(path);
  EXPECT_TRUE(in) << "cannot open " << path;
  Bytes out;
  std::string line;
  while (std::getline(in, line)) {
    line = line.substr(0, line.find('#'));
    std::istringstream words(line);
    std::string word;
    while (words >> word) {
      EXPECT_EQ(word.size(), 2u) << name << ": bad byte '" << word << "'";
      EXPECT_TRUE(std::isxdigit(static_cast<unsigned char>(word[0])) &&
                  std::isxdigit(static_cast<unsigned char>(word[1])))
          << name << ": bad byte '" << word << "'";
      out.push_back(static_cast<std::byte>(std::stoul(word, nullptr, 16)));
    }
  }
  return out;
}

template <typename F>
Bytes encode(F&& f) {
  std::vector<std::byte> buffer(4096);
  Encoder encoder(buffer);
  f(encoder);
  return {encoder.bytes().begin(), encoder.bytes().end()};
}

std::string hex(const Bytes& b) {
  std::string out;
  char cell[4];
  for (std::size_t i = 0; i < b.size(); ++i) {
    std::snprintf(cell, sizeof cell, "%02x", static_cast<unsigned>(b[i]));
    out += cell;
    out += (i % 16 == 15) ? '\n' : ' ';
  }
  return out;
}

// The file must equal the Encoder's output byte for byte.
void expect_golden(const std::string& name, const Bytes& encoded, std::size_t expected_size) {
  const Bytes golden = read_hex(name);
  EXPECT_EQ(golden.size(), expected_size) << name;
  EXPECT_EQ(encoded.size(), expected_size) << name;
  EXPECT_TRUE(golden == encoded) << name << "\nfile:\n"
                                 << hex(golden) << "\nencoder:\n"
                                 << hex(encoded);
}

// Decodes one frame of `golden` on `side` (after the hello of file `hello` for the
// daemon side).
testing::Owned decode_one(Side side, const Bytes& frame, const char* hello = "hello.hex") {
  const Bytes stream = side == Side::kDaemon ? testing::concat({read_hex(hello), frame}) : frame;
  const DecodeAll d = decode_all(side, stream);
  EXPECT_FALSE(d.error) << d.error.message();
  EXPECT_FALSE(d.finish) << d.finish.message();
  const std::size_t want = side == Side::kDaemon ? 2 : 1;
  if (d.messages.size() != want) {
    ADD_FAILURE() << "decoded " << d.messages.size() << " messages, want " << want;
    return DroppedReport{~0ull};
  }
  return d.messages.back();
}

const std::string kGpu = "GPU-0a1b2c3d-4e5f-6789-abcd-ef0123456789";

TEST(ProtoGolden, Hello) {
  expect_golden("hello.hex",
                encode([](Encoder& e) { ASSERT_TRUE(e.hello("0.1.0", "trainer", 1)); }), 48);
  const DecodeAll d = decode_all(Side::kDaemon, read_hex("hello.hex"));
  ASSERT_FALSE(d.error);
  ASSERT_EQ(d.messages.size(), 1u);
  const auto& h = std::get<Hello>(d.messages[0]);
  EXPECT_EQ(h.magic[0], 0xF7);
  EXPECT_EQ(h.magic[1], 'S');
  EXPECT_EQ(h.magic[2], 'T');
  EXPECT_EQ(h.magic[3], 'P');
  EXPECT_EQ(h.version, 1);
  EXPECT_EQ(h.flags, 0);
  EXPECT_EQ(field_view(h.library_version), "0.1.0");
  EXPECT_EQ(field_view(h.process_name), "trainer");
}

TEST(ProtoGolden, Events) {
  const EventRecord events[] = {
      {1000000000, 4242, 0, static_cast<std::uint8_t>(EventKind::kStart), 0},
      {1000000500, 4242, 0, static_cast<std::uint8_t>(EventKind::kEnd), 0},
      {0x0102030405060708, 7, 256, static_cast<std::uint8_t>(EventKind::kStart), 0},
  };
  expect_golden("events.hex", encode([&](Encoder& e) { ASSERT_EQ(e.events(events), 3u); }), 8 + 48);
  const auto got =
      std::get<std::vector<EventRecord>>(decode_one(Side::kDaemon, read_hex("events.hex")));
  ASSERT_EQ(got.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].timestamp_ns, events[i].timestamp_ns);
    EXPECT_EQ(got[i].thread_id, events[i].thread_id);
    EXPECT_EQ(got[i].step, events[i].step);
    EXPECT_EQ(got[i].kind, events[i].kind);
    EXPECT_EQ(got[i].reserved, 0);
  }
}

TEST(ProtoGolden, RegisterStep) {
  expect_golden("register_step.hex",
                encode([](Encoder& e) { ASSERT_TRUE(e.register_step(256, "data_loader")); }),
                8 + 72);
  const auto r = std::get<RegisterStep>(decode_one(Side::kDaemon, read_hex("register_step.hex")));
  EXPECT_EQ(r.step, 256u);
  EXPECT_EQ(r.reserved, 0u);
  EXPECT_EQ(field_view(r.name), "data_loader");
}

struct LedgerCase {
  const char* file;
  std::uint64_t timestamp_ns, reservation_id, bytes, total_bytes;
  std::uint32_t thread_id, holder_pid;
  LedgerOp op;
  std::uint8_t flags;
  std::string gpu_uuid, task;
  const char* hello = "hello.hex";  // the stream's hello: the lease ops need version 3
};

void check_ledger(const LedgerCase& c) {
  SCOPED_TRACE(c.file);
  LedgerRecord in{};
  in.timestamp_ns = c.timestamp_ns;
  in.reservation_id = c.reservation_id;
  in.bytes = c.bytes;
  in.total_bytes = c.total_bytes;
  in.thread_id = c.thread_id;
  in.holder_pid = c.holder_pid;
  in.op = static_cast<std::uint8_t>(c.op);
  in.flags = c.flags;
  ASSERT_TRUE(set_field(in.gpu_uuid, c.gpu_uuid));
  ASSERT_TRUE(set_field(in.task, c.task));
  expect_golden(c.file, encode([&](Encoder& e) { ASSERT_TRUE(e.ledger(in)); }), 8 + 176);

  const auto r = std::get<LedgerRecord>(decode_one(Side::kDaemon, read_hex(c.file), c.hello));
  EXPECT_EQ(r.timestamp_ns, c.timestamp_ns);
  EXPECT_EQ(r.reservation_id, c.reservation_id);
  EXPECT_EQ(r.bytes, c.bytes);
  EXPECT_EQ(r.total_bytes, c.total_bytes);
  EXPECT_EQ(r.thread_id, c.thread_id);
  EXPECT_EQ(r.holder_pid, c.holder_pid);
  EXPECT_EQ(r.op, static_cast<std::uint8_t>(c.op));
  EXPECT_EQ(r.flags, c.flags);
  for (auto b : r.reserved) EXPECT_EQ(b, 0);
  EXPECT_EQ(field_view(r.gpu_uuid), c.gpu_uuid);
  EXPECT_EQ(field_view(r.task), c.task);
}

TEST(ProtoGolden, LedgerReserve) {
  check_ledger({"ledger_reserve.hex", 123456789, 42, 8ull << 30, 0, 4242, 0, LedgerOp::kReserve, 0,
                kGpu, "qlora-7b"});
}

TEST(ProtoGolden, LedgerRelease) {
  check_ledger(
      {"ledger_release.hex", 223456789, 42, 0, 0, 4242, 0, LedgerOp::kRelease, 0, kGpu, ""});
}

TEST(ProtoGolden, LedgerCleanupWithTruncationFlags) {
  check_ledger({"ledger_cleanup.hex", 323456789, 41, 0, 0, 4243, 31337, LedgerOp::kCleanup,
                kLedgerGpuUuidTruncated | kLedgerTaskTruncated, std::string(63, 'G'),
                std::string(63, 't')});
}

TEST(ProtoGolden, VramSample) {
  check_ledger({"vram_sample.hex", 423456789, 0, 20ull << 30, 24ull << 30, 4244, 0,
                LedgerOp::kVramSample, 0, kGpu, ""});
}

TEST(ProtoGolden, LedgerReserveLease) {
  check_ledger({"ledger_reserve_lease.hex", 523456789, 43, 8ull << 30, 30000, 4242, 0,
                LedgerOp::kReserveLease, 0, kGpu, "qlora-7b", "hello_v3.hex"});
}

TEST(ProtoGolden, LedgerRenew) {
  check_ledger({"ledger_renew.hex", 623456789, 43, 0, 45000, 4242, 0, LedgerOp::kRenew, 0, kGpu, "",
                "hello_v3.hex"});
  // A version-2 stream does not carry it.
  const DecodeAll v2 = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v2.hex"), read_hex("ledger_renew.hex")}));
  EXPECT_EQ(v2.error, make_error_code(errc::bad_ledger_op));
}

// A later version's hello: encoded as the golden file holds it, decoded with its version.
void expect_hello_golden(const std::string& file, std::uint16_t version) {
  expect_golden(file, encode([&](Encoder& e) {
                  ASSERT_TRUE(e.hello("0." + std::to_string(version) + ".0", "trainer", version));
                }),
                48);
  const DecodeAll d = decode_all(Side::kDaemon, read_hex(file));
  ASSERT_FALSE(d.error);
  ASSERT_EQ(d.messages.size(), 1u);
  EXPECT_EQ(std::get<Hello>(d.messages[0]).version, version);
}

TEST(ProtoGolden, HelloVersion3) { expect_hello_golden("hello_v3.hex", 3); }

TEST(ProtoGolden, HelloVersion4) { expect_hello_golden("hello_v4.hex", 4); }

TEST(ProtoGolden, HelloVersion5) { expect_hello_golden("hello_v5.hex", 5); }

TEST(ProtoGolden, HelloVersion6) { expect_hello_golden("hello_v6.hex", 6); }

TEST(ProtoGolden, HelloVersion7) { expect_hello_golden("hello_v7.hex", 7); }

TEST(ProtoGolden, HelloVersion8) {
  expect_hello_golden("hello_v8.hex", 8);
  // The encoder's default is kProtocolVersion.
  EXPECT_EQ(encode([](Encoder& e) { ASSERT_TRUE(e.hello("0.8.0", "trainer")); }),
            read_hex("hello_v8.hex"));
}

TEST(ProtoGolden, Batch) {
  expect_golden("batch.hex", encode([](Encoder& e) { ASSERT_TRUE(e.batch(9, 2)); }), 24);
  const auto got =
      std::get<Batch>(decode_one(Side::kDaemon, read_hex("batch.hex"), "hello_v7.hex"));
  EXPECT_EQ(got.sequence, 9u);
  EXPECT_EQ(got.frames, 2u);
  // A version-6 stream does not carry it.
  const DecodeAll v6 =
      decode_all(Side::kDaemon, testing::concat({read_hex("hello_v6.hex"), read_hex("batch.hex")}));
  EXPECT_EQ(v6.error, make_error_code(errc::unknown_frame_type));
}

// The frames after a Batch carry their place in it; the batch ends after its count.
TEST(ProtoGolden, BatchNumbersItsFrames) {
  Decoder d(Side::kDaemon);
  d.feed(testing::concat({read_hex("hello_v7.hex"), read_hex("batch.hex"), read_hex("events.hex"),
                          read_hex("flush.hex"), read_hex("flush.hex")}));
  std::vector<BatchPosition> at;
  for (;;) {
    const DecodeResult r = d.next();
    ASSERT_FALSE(r.error) << r.error.message();
    if (!r.message) break;
    at.push_back(r.batch);
  }
  ASSERT_EQ(at.size(), 5u);       // hello, Batch, Events, Flush, Flush
  EXPECT_EQ(at[1].sequence, 0u);  // the Batch itself is in none
  EXPECT_EQ(at[2].sequence, 9u);
  EXPECT_EQ(at[2].index, 0u);
  EXPECT_EQ(at[3].sequence, 9u);
  EXPECT_EQ(at[3].index, 1u);
  EXPECT_EQ(at[4].sequence, 0u);  // past the batch's two frames
}

TEST(ProtoGolden, BatchRules) {
  const Bytes v7 = read_hex("hello_v7.hex");
  auto error_of = [&](std::initializer_list<Bytes> frames) {
    Bytes stream = v7;
    for (const Bytes& f : frames) stream.insert(stream.end(), f.begin(), f.end());
    return decode_all(Side::kDaemon, stream).error;
  };
  const auto bad_batch = make_error_code(errc::bad_batch);
  // Nested, or holding a frame a batch may not (an Identity, a Delivered).
  EXPECT_EQ(error_of({read_hex("batch.hex"), read_hex("batch.hex")}), bad_batch);
  EXPECT_EQ(error_of({read_hex("batch.hex"), read_hex("identity.hex")}), bad_batch);
  EXPECT_EQ(error_of({read_hex("batch.hex"), read_hex("flush.hex"), read_hex("delivered.hex")}),
            make_error_code(errc::bad_batch));
  // Numbered from 1, at least one frame, reserved zero.
  auto batch = [](std::uint64_t seq, std::uint32_t frames, std::uint32_t reserved) {
    Bytes b = encode([&](Encoder& e) { ASSERT_TRUE(e.batch(seq, frames)); });
    b[20] = static_cast<std::byte>(reserved);  // header 8, sequence 8, frames 4
    return b;
  };
  EXPECT_EQ(error_of({batch(0, 1, 0)}), bad_batch);
  EXPECT_EQ(error_of({batch(1, 0, 0)}), bad_batch);
  EXPECT_EQ(error_of({batch(1, 1, 1)}), make_error_code(errc::bad_reserved));
  // After its count, the next Batch is fine.
  EXPECT_FALSE(error_of({read_hex("batch.hex"), read_hex("flush.hex"), read_hex("flush.hex"),
                         read_hex("batch.hex")}));
}

TEST(ProtoGolden, Delivered) {
  expect_golden("delivered.hex", encode([](Encoder& e) { ASSERT_TRUE(e.delivered(1234567)); }), 16);
  const auto got =
      std::get<Delivered>(decode_one(Side::kDaemon, read_hex("delivered.hex"), "hello_v6.hex"));
  EXPECT_EQ(got.events, 1234567u);
  // A version-5 stream does not carry it.
  const DecodeAll v5 = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v5.hex"), read_hex("delivered.hex")}));
  EXPECT_EQ(v5.error, make_error_code(errc::unknown_frame_type));
  // At most once, and before any event or ring: it is compared with what the daemon
  // counted before the connection sent anything.
  const DecodeAll twice = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v6.hex"), read_hex("delivered.hex"),
                                      read_hex("delivered.hex")}));
  EXPECT_EQ(twice.error, make_error_code(errc::bad_delivered));
  EXPECT_EQ(twice.messages.size(), 2u);
  const DecodeAll late =
      decode_all(Side::kDaemon, testing::concat({read_hex("hello_v6.hex"), read_hex("events.hex"),
                                                 read_hex("delivered.hex")}));
  EXPECT_EQ(late.error, make_error_code(errc::bad_delivered));
  EXPECT_EQ(late.messages.size(), 2u);
}

TEST(ProtoGolden, RingAttach) {
  expect_golden("ring_attach.hex",
                encode([](Encoder& e) { ASSERT_TRUE(e.ring_attach(2, 4242, 262144)); }), 24);
  const auto got =
      std::get<RingAttach>(decode_one(Side::kDaemon, read_hex("ring_attach.hex"), "hello_v5.hex"));
  EXPECT_EQ(got.ring_id, 2u);
  EXPECT_EQ(got.thread_id, 4242u);
  EXPECT_EQ(got.capacity, 262144u);
  // A version-4 stream does not carry it.
  const DecodeAll v4 = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v4.hex"), read_hex("ring_attach.hex")}));
  EXPECT_EQ(v4.error, make_error_code(errc::unknown_frame_type));
}

TEST(ProtoGolden, ClockSync) {
  expect_golden("clock_sync.hex", encode([](Encoder& e) {
                  ASSERT_TRUE(e.clock_sync(ClockSync{1000000, 5000000000, 1ull << 31}));
                }),
                32);
  const auto got =
      std::get<ClockSync>(decode_one(Side::kDaemon, read_hex("clock_sync.hex"), "hello_v5.hex"));
  EXPECT_EQ(got.anchor_ticks, 1000000u);
  EXPECT_EQ(got.anchor_ns, 5000000000u);
  EXPECT_EQ(got.scale, 1ull << 31);
  // Half a nanosecond per tick: 2000 ticks after the anchor are 1000 ns after it.
  EXPECT_EQ(ticks_to_ns(got, 1002000), 5000001000u);
  EXPECT_EQ(ticks_to_ns(got, 998000), 4999999000u);
  EXPECT_EQ(ticks_to_ns(ClockSync{}, 123), 123u);  // scale 0: ticks are ns
}

TEST(ProtoGolden, RingAck) {
  expect_golden("ring_ack.hex",
                encode([](Encoder& e) { ASSERT_TRUE(e.ring_ack(2, RingStatus::kRefusedLimit)); }),
                16);
  const auto got = std::get<RingAck>(decode_one(Side::kClient, read_hex("ring_ack.hex")));
  EXPECT_EQ(got.ring_id, 2u);
  EXPECT_EQ(got.status, static_cast<std::uint32_t>(RingStatus::kRefusedLimit));
}

TEST(ProtoGolden, Identity) {
  expect_golden("identity.hex",
                encode([](Encoder& e) { ASSERT_TRUE(e.identity("torchrun-42", 3, 1, 8)); }), 88);
  const DecodeAll d = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v4.hex"), read_hex("identity.hex")}));
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_EQ(d.messages.size(), 2u);
  const auto& got = std::get<Identity>(d.messages[1]);
  EXPECT_EQ(field_view(got.job), "torchrun-42");
  EXPECT_EQ(got.rank, 3u);
  EXPECT_EQ(got.local_rank, 1u);
  EXPECT_EQ(got.world_size, 8u);
  // A version-3 stream does not carry it.
  const DecodeAll v3 = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v3.hex"), read_hex("identity.hex")}));
  EXPECT_EQ(v3.error, make_error_code(errc::unknown_frame_type));
}

TEST(ProtoGolden, Dropped) {
  expect_golden("dropped.hex", encode([](Encoder& e) { ASSERT_TRUE(e.dropped(1234567)); }), 16);
  EXPECT_EQ(
      std::get<DroppedReport>(decode_one(Side::kDaemon, read_hex("dropped.hex"))).total_dropped,
      1234567u);
}

TEST(ProtoGolden, HelloVersion2) { expect_hello_golden("hello_v2.hex", 2); }

TEST(ProtoGolden, DroppedByCause) {
  const DroppedByCause causes{{11, 2222, 333333, 4}};
  expect_golden("dropped_by_cause.hex",
                encode([&](Encoder& e) { ASSERT_TRUE(e.dropped_by_cause(causes)); }), 40);
  const DecodeAll d = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello_v2.hex"), read_hex("dropped_by_cause.hex")}));
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_EQ(d.messages.size(), 2u);
  const auto& got = std::get<DroppedByCause>(d.messages[1]);
  for (std::size_t i = 0; i < kDropCauseCount; ++i) EXPECT_EQ(got.count[i], causes.count[i]);
  // A version-1 stream does not carry it.
  const DecodeAll v1 = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello.hex"), read_hex("dropped_by_cause.hex")}));
  EXPECT_EQ(v1.error, make_error_code(errc::unknown_frame_type));
}

TEST(ProtoGolden, Flush) {
  expect_golden("flush.hex", encode([](Encoder& e) { ASSERT_TRUE(e.flush(7)); }), 16);
  EXPECT_EQ(std::get<FlushRequest>(decode_one(Side::kDaemon, read_hex("flush.hex"))).sequence, 7u);
}

TEST(ProtoGolden, FlushAck) {
  expect_golden("flush_ack.hex", encode([](Encoder& e) { ASSERT_TRUE(e.flush_ack(7)); }), 16);
  EXPECT_EQ(std::get<FlushAck>(decode_one(Side::kClient, read_hex("flush_ack.hex"))).sequence, 7u);
  // The daemon does not accept its own frame type.
  const DecodeAll d = decode_all(
      Side::kDaemon, testing::concat({read_hex("hello.hex"), read_hex("flush_ack.hex")}));
  EXPECT_EQ(d.error, make_error_code(errc::unknown_frame_type));
}

TEST(ProtoGolden, Error) {
  expect_golden(
      "error.hex", encode([](Encoder& e) {
        ASSERT_TRUE(e.error(ErrorCode::kUnsupportedVersion, "unsupported protocol version"));
      }),
      8 + 128);
  const auto r = std::get<ErrorReport>(decode_one(Side::kClient, read_hex("error.hex")));
  EXPECT_EQ(r.code, 2u);
  EXPECT_EQ(r.reserved, 0u);
  EXPECT_EQ(field_view(r.message), "unsupported protocol version");
}

// Every golden frame, concatenated after the hello, is one valid daemon-side stream, and
// also decodes when cut into single bytes.
TEST(ProtoGolden, AllClientFramesFormOneStream) {
  Bytes stream = read_hex("hello_v2.hex");
  for (const char* f : {"register_step.hex", "events.hex", "ledger_reserve.hex",
                        "ledger_release.hex", "ledger_cleanup.hex", "vram_sample.hex",
                        "dropped.hex", "dropped_by_cause.hex", "flush.hex"}) {
    stream = testing::concat({stream, read_hex(f)});
  }
  const DecodeAll d = decode_all(Side::kDaemon, stream, 1);
  EXPECT_FALSE(d.error);
  EXPECT_FALSE(d.finish);
  EXPECT_EQ(d.messages.size(), 10u);
}

}  // namespace
}  // namespace steptrace::proto
