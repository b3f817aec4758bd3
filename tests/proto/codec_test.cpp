// Unit tests of proto/codec.h: every frame type through Encoder -> Decoder on both sides,
// any chunking of the stream, and every rule of proto/PROTOCOL.md rejected with its errc.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <iterator>
#include <optional>
#include <string>
#include <vector>

#include "proto/codec.h"
#include "tests/proto/proto_test_util.h"

namespace steptrace::proto {
namespace {

using testing::Bytes;
using testing::ByteWriter;
using testing::concat;
using testing::decode_all;
using testing::DecodeAll;
using testing::event_bytes;
using testing::frame_bytes;
using testing::header_bytes;
using testing::hello_bytes;
using testing::ledger_payload;
using testing::LedgerFields;
using testing::Owned;
using testing::register_payload;

constexpr std::uint16_t kEventsType = 1;
constexpr std::uint16_t kRegisterType = 2;
constexpr std::uint16_t kLedgerType = 3;
constexpr std::uint16_t kDroppedType = 4;
constexpr std::uint16_t kFlushType = 5;
constexpr std::uint16_t kFlushAckType = 0x81;
constexpr std::uint16_t kErrorType = 0x82;

Bytes to_bytes(std::span<const std::byte> s) { return {s.begin(), s.end()}; }

// Encodes with a large enough buffer; fails the test when an encoder call fails.
template <typename F>
Bytes encode(F&& f, std::size_t capacity = 1 << 20) {
  std::vector<std::byte> buffer(capacity);
  Encoder encoder(buffer);
  f(encoder);
  return to_bytes(encoder.bytes());
}

LedgerRecord make_ledger(LedgerOp op, std::uint64_t id, std::uint64_t bytes, std::uint64_t total,
                         std::uint32_t holder, std::string_view gpu, std::string_view task,
                         std::uint8_t flags = 0) {
  LedgerRecord r{};
  r.timestamp_ns = 1000 + id;
  r.reservation_id = id;
  r.bytes = bytes;
  r.total_bytes = total;
  r.thread_id = 77;
  r.holder_pid = holder;
  r.op = static_cast<std::uint8_t>(op);
  r.flags = flags;
  EXPECT_TRUE(set_field(r.gpu_uuid, gpu));
  EXPECT_TRUE(set_field(r.task, task));
  return r;
}

std::vector<EventRecord> sample_events(std::size_t n) {
  std::vector<EventRecord> events;
  for (std::size_t i = 0; i < n; ++i) {
    EventRecord e{};
    e.timestamp_ns = 1'000'000'000ull + i * 37;
    e.thread_id = 100 + static_cast<std::uint32_t>(i % 5);
    e.step = static_cast<std::uint16_t>(i % 3 == 2 ? kFirstCustomStep + i % 1024 : i % 12);
    e.kind = static_cast<std::uint8_t>(i % 2 == 0 ? EventKind::kStart : EventKind::kEnd);
    events.push_back(e);
  }
  return events;
}

bool same_event(const EventRecord& a, const EventRecord& b) {
  return a.timestamp_ns == b.timestamp_ns && a.thread_id == b.thread_id && a.step == b.step &&
         a.kind == b.kind && a.reserved == b.reserved;
}

// The daemon-side stream with one frame of every client type.
Bytes daemon_stream(const std::vector<EventRecord>& events) {
  return encode([&](Encoder& e) {
    ASSERT_TRUE(e.hello("1.2.3", "trainer-7"));
    ASSERT_TRUE(e.register_step(300, "my_custom_step"));
    ASSERT_EQ(e.events(events), events.size());
    ASSERT_TRUE(
        e.ledger(make_ledger(LedgerOp::kReserve, 42, 8ull << 30, 0, 0, "GPU-aaaa", "qlora-7b")));
    ASSERT_TRUE(e.ledger(make_ledger(LedgerOp::kRelease, 42, 0, 0, 0, "GPU-aaaa", "")));
    ASSERT_TRUE(e.ledger(make_ledger(LedgerOp::kCleanup, 41, 0, 0, 31337, "GPU-bbbb", "",
                                     kLedgerGpuUuidTruncated | kLedgerTaskTruncated)));
    ASSERT_TRUE(e.ledger(
        make_ledger(LedgerOp::kVramSample, 0, 20ull << 30, 24ull << 30, 0, "GPU-aaaa", "")));
    ASSERT_TRUE(e.dropped(12345));
    ASSERT_TRUE(e.flush(99));
  });
}

// Checks every field of what daemon_stream() encodes.
void check_daemon_messages(const DecodeAll& d, const std::vector<EventRecord>& events) {
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_FALSE(d.finish) << d.finish.message();
  ASSERT_EQ(d.messages.size(), 9u);

  const auto& hello = std::get<Hello>(d.messages[0]);
  EXPECT_EQ(0, std::memcmp(hello.magic, kMagic, 4));
  EXPECT_EQ(hello.version, kProtocolVersion);
  EXPECT_EQ(hello.flags, 0);
  EXPECT_EQ(field_view(hello.library_version), "1.2.3");
  EXPECT_EQ(field_view(hello.process_name), "trainer-7");

  const auto& reg = std::get<RegisterStep>(d.messages[1]);
  EXPECT_EQ(reg.step, 300u);
  EXPECT_EQ(reg.reserved, 0u);
  EXPECT_EQ(field_view(reg.name), "my_custom_step");

  const auto& got = std::get<std::vector<EventRecord>>(d.messages[2]);
  ASSERT_EQ(got.size(), events.size());
  for (std::size_t i = 0; i < events.size(); ++i) {
    EXPECT_TRUE(same_event(got[i], events[i])) << "event " << i;
  }

  const auto& reserve = std::get<LedgerRecord>(d.messages[3]);
  EXPECT_EQ(reserve.timestamp_ns, 1042u);
  EXPECT_EQ(reserve.reservation_id, 42u);
  EXPECT_EQ(reserve.bytes, 8ull << 30);
  EXPECT_EQ(reserve.total_bytes, 0u);
  EXPECT_EQ(reserve.thread_id, 77u);
  EXPECT_EQ(reserve.holder_pid, 0u);
  EXPECT_EQ(reserve.op, static_cast<std::uint8_t>(LedgerOp::kReserve));
  EXPECT_EQ(reserve.flags, 0);
  EXPECT_EQ(field_view(reserve.gpu_uuid), "GPU-aaaa");
  EXPECT_EQ(field_view(reserve.task), "qlora-7b");

  const auto& release = std::get<LedgerRecord>(d.messages[4]);
  EXPECT_EQ(release.op, static_cast<std::uint8_t>(LedgerOp::kRelease));
  EXPECT_EQ(release.reservation_id, 42u);
  EXPECT_EQ(field_view(release.task), "");

  const auto& cleanup = std::get<LedgerRecord>(d.messages[5]);
  EXPECT_EQ(cleanup.op, static_cast<std::uint8_t>(LedgerOp::kCleanup));
  EXPECT_EQ(cleanup.reservation_id, 41u);
  EXPECT_EQ(cleanup.holder_pid, 31337u);
  EXPECT_EQ(cleanup.flags, kLedgerGpuUuidTruncated | kLedgerTaskTruncated);
  EXPECT_EQ(field_view(cleanup.gpu_uuid), "GPU-bbbb");

  const auto& sample = std::get<LedgerRecord>(d.messages[6]);
  EXPECT_EQ(sample.op, static_cast<std::uint8_t>(LedgerOp::kVramSample));
  EXPECT_EQ(sample.bytes, 20ull << 30);
  EXPECT_EQ(sample.total_bytes, 24ull << 30);

  EXPECT_EQ(std::get<DroppedReport>(d.messages[7]).total_dropped, 12345u);
  EXPECT_EQ(std::get<FlushRequest>(d.messages[8]).sequence, 99u);
}

Bytes client_stream() {
  return encode([](Encoder& e) {
    ASSERT_TRUE(e.flush_ack(99));
    ASSERT_TRUE(e.error(ErrorCode::kProtocol, "bad_step_id: step id out of range"));
    ASSERT_TRUE(e.flush_ack(100));
    ASSERT_TRUE(e.error(ErrorCode::kLimit, ""));
  });
}

void check_client_messages(const DecodeAll& d) {
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_FALSE(d.finish) << d.finish.message();
  ASSERT_EQ(d.messages.size(), 4u);
  EXPECT_EQ(std::get<FlushAck>(d.messages[0]).sequence, 99u);
  const auto& error = std::get<ErrorReport>(d.messages[1]);
  EXPECT_EQ(error.code, static_cast<std::uint32_t>(ErrorCode::kProtocol));
  EXPECT_EQ(error.reserved, 0u);
  EXPECT_EQ(field_view(error.message), "bad_step_id: step id out of range");
  EXPECT_EQ(std::get<FlushAck>(d.messages[2]).sequence, 100u);
  const auto& limit = std::get<ErrorReport>(d.messages[3]);
  EXPECT_EQ(limit.code, static_cast<std::uint32_t>(ErrorCode::kLimit));
  EXPECT_EQ(field_view(limit.message), "");
}

// ---- round trips ------------------------------------------------------------------

TEST(ProtoRoundTrip, DaemonSideWholeStream) {
  const auto events = sample_events(40);
  check_daemon_messages(decode_all(Side::kDaemon, daemon_stream(events)), events);
}

TEST(ProtoRoundTrip, DaemonSideByteAtATime) {
  const auto events = sample_events(40);
  check_daemon_messages(decode_all(Side::kDaemon, daemon_stream(events), 1), events);
}

TEST(ProtoRoundTrip, DaemonSideEveryChunkSizeThroughPrepareCommit) {
  const auto events = sample_events(7);
  const Bytes stream = daemon_stream(events);
  for (std::size_t chunk = 1; chunk <= 200; ++chunk) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    check_daemon_messages(decode_all(Side::kDaemon, stream, chunk, /*use_prepare=*/true), events);
  }
}

TEST(ProtoRoundTrip, ClientSideWholeAndByteAtATime) {
  const Bytes stream = client_stream();
  check_client_messages(decode_all(Side::kClient, stream));
  check_client_messages(decode_all(Side::kClient, stream, 1));
  check_client_messages(decode_all(Side::kClient, stream, 5, /*use_prepare=*/true));
}

TEST(ProtoRoundTrip, ManyFramesInOneFeed) {
  const Bytes stream = encode([](Encoder& e) {
    ASSERT_TRUE(e.hello("0.1.0", ""));
    for (std::uint64_t i = 0; i < 1000; ++i) {
      ASSERT_TRUE(e.flush(i));
      EventRecord ev{};
      ev.timestamp_ns = i;
      ev.thread_id = 1;
      ev.step = static_cast<std::uint16_t>(i % 12);
      ev.kind = 1;
      ASSERT_EQ(e.events(std::span<const EventRecord>(&ev, 1)), 1u);
    }
  });
  const DecodeAll d = decode_all(Side::kDaemon, stream);
  ASSERT_FALSE(d.error);
  ASSERT_FALSE(d.finish);
  ASSERT_EQ(d.messages.size(), 2001u);
  EXPECT_EQ(field_view(std::get<Hello>(d.messages[0]).process_name), "");
  for (std::uint64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(std::get<FlushRequest>(d.messages[1 + 2 * i]).sequence, i);
    const auto& ev = std::get<std::vector<EventRecord>>(d.messages[2 + 2 * i]);
    ASSERT_EQ(ev.size(), 1u);
    EXPECT_EQ(ev[0].timestamp_ns, i);
    EXPECT_EQ(ev[0].step, i % 12);
  }
}

TEST(ProtoRoundTrip, PrepareCommitReadsStraightIntoTheBuffer) {
  const auto events = sample_events(3);
  const Bytes stream = daemon_stream(events);
  Decoder decoder(Side::kDaemon);
  std::vector<Owned> got;
  std::size_t pos = 0;
  while (pos < stream.size()) {
    auto dst = decoder.prepare(64);
    ASSERT_GE(dst.size(), 64u);
    const std::size_t n =
        std::min<std::size_t>(std::min<std::size_t>(dst.size(), 61), stream.size() - pos);
    std::memcpy(dst.data(), stream.data() + pos, n);
    decoder.commit(n);
    pos += n;
    for (auto r = decoder.next(); r.message; r = decoder.next()) {
      ASSERT_FALSE(r.error);
      got.push_back(testing::to_owned(*r.message));
    }
    EXPECT_FALSE(decoder.failed());
  }
  EXPECT_TRUE(decoder.hello_seen());
  EXPECT_EQ(decoder.buffered(), 0u);
  EXPECT_FALSE(decoder.finish());
  ASSERT_EQ(got.size(), 9u);
  EXPECT_EQ(std::get<FlushRequest>(got[8]).sequence, 99u);
}

TEST(ProtoRoundTrip, CommitNeverExceedsPreparedSpace) {
  Decoder decoder(Side::kClient);
  auto dst = decoder.prepare(8);
  decoder.commit(dst.size() + 1000);  // a caller bug: clamped, not a buffer overrun
  EXPECT_EQ(decoder.buffered(), dst.size());
}

TEST(ProtoRoundTrip, FullSizeEventFrameAndEncoderSplitsLargerBatches) {
  const auto events = sample_events(kMaxEventsPerFrame + 100);
  std::vector<std::byte> buffer(2 * (kMaxFramePayload + sizeof(FrameHeader)));
  Encoder encoder(buffer);
  ASSERT_TRUE(encoder.hello("0.1.0", "big"));
  const std::size_t first = encoder.events(events);
  ASSERT_EQ(first, kMaxEventsPerFrame);
  const std::size_t second = encoder.events(std::span(events).subspan(first));
  ASSERT_EQ(second, 100u);
  const DecodeAll d = decode_all(Side::kDaemon, to_bytes(encoder.bytes()), 4096);
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_EQ(d.messages.size(), 3u);
  const auto& a = std::get<std::vector<EventRecord>>(d.messages[1]);
  const auto& b = std::get<std::vector<EventRecord>>(d.messages[2]);
  ASSERT_EQ(a.size(), kMaxEventsPerFrame);
  ASSERT_EQ(b.size(), 100u);
  EXPECT_TRUE(same_event(a.front(), events.front()));
  EXPECT_TRUE(same_event(a.back(), events[kMaxEventsPerFrame - 1]));
  EXPECT_TRUE(same_event(b.back(), events.back()));
}

TEST(ProtoRoundTrip, EventSpanCopiesRecordsFromTheDecoderBuffer) {
  const auto events = sample_events(4);
  Decoder decoder(Side::kDaemon);
  const Bytes stream = encode([&](Encoder& e) {
    ASSERT_TRUE(e.hello("0.1.0", "x"));
    ASSERT_EQ(e.events(events), 4u);
  });
  decoder.feed(stream);
  ASSERT_TRUE(std::holds_alternative<Hello>(*decoder.next().message));
  auto r = decoder.next();
  ASSERT_TRUE(r.message);
  const auto& span = std::get<EventSpan>(*r.message);
  ASSERT_EQ(span.size(), 4u);
  EXPECT_FALSE(span.empty());
  std::size_t i = 0;
  span.for_each([&](const EventRecord& e) { EXPECT_TRUE(same_event(e, events[i++])); });
  EXPECT_EQ(i, 4u);
  EXPECT_TRUE(EventSpan().empty());
}

TEST(ProtoRoundTrip, BoundaryStepIdsAndEmptyOptionalStringsAreAccepted) {
  const Bytes stream = concat({
      hello_bytes(kProtocolVersion, 0, "v", ""),
      frame_bytes(kEventsType, concat({event_bytes(1, 1, 0, 1), event_bytes(2, 1, 11, 2),
                                       event_bytes(3, 1, 256, 1), event_bytes(4, 1, 1279, 2)})),
      frame_bytes(kRegisterType, register_payload(256, "a")),
      frame_bytes(kRegisterType, register_payload(1279, std::string(63, '~'))),
      frame_bytes(kLedgerType, ledger_payload({.op = 4, .task = ""})),
      frame_bytes(kLedgerType, ledger_payload({.flags = 3, .gpu_uuid = std::string(63, ' ')})),
  });
  const DecodeAll d = decode_all(Side::kDaemon, stream);
  ASSERT_FALSE(d.error) << d.error.message();
  ASSERT_EQ(d.messages.size(), 6u);
  EXPECT_EQ(field_view(std::get<RegisterStep>(d.messages[3]).name), std::string(63, '~'));
  EXPECT_EQ(field_view(std::get<LedgerRecord>(d.messages[5]).gpu_uuid), std::string(63, ' '));
}

TEST(ProtoRoundTrip, EmptyFeedsAreHarmless) {
  // A zero-byte read must not touch memory (no memcpy from/to a null buffer: UBSan).
  Decoder decoder(Side::kDaemon);
  decoder.feed({});
  decoder.commit(0);
  EXPECT_EQ(decoder.buffered(), 0u);
  EXPECT_FALSE(decoder.next().message);
  const Bytes hello = hello_bytes();
  decoder.feed(hello);
  decoder.feed({});
  auto r = decoder.next();
  ASSERT_TRUE(r.message);
  EXPECT_TRUE(std::holds_alternative<Hello>(*r.message));
  decoder.feed({});
  EXPECT_FALSE(decoder.next().message);
  EXPECT_FALSE(decoder.finish());
}

TEST(ProtoRoundTrip, EmptyStreamIsNotTruncated) {
  Decoder decoder(Side::kDaemon);
  auto r = decoder.next();
  EXPECT_FALSE(r.error);
  EXPECT_FALSE(r.message);
  EXPECT_FALSE(decoder.finish());
  EXPECT_FALSE(decoder.hello_seen());
}

// ---- malformed input ----------------------------------------------------------------

// Feeds `stream` whole and byte at a time; the decoder must deliver `good` messages and
// then fail with `expected`, keep failing, and report the same error from finish().
void expect_rejected(Side side, const Bytes& stream, errc expected, std::size_t good) {
  for (std::size_t chunk : {std::size_t{0}, std::size_t{1}, std::size_t{7}}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const DecodeAll d = decode_all(side, stream, chunk);
    EXPECT_EQ(d.error, make_error_code(expected))
        << "got " << d.error.message() << ", want " << make_error_code(expected).message();
    EXPECT_EQ(d.messages.size(), good);
    EXPECT_EQ(d.finish, make_error_code(expected));
  }
  // Sticky: more (valid) bytes after the error change nothing.
  Decoder decoder(side);
  decoder.feed(stream);
  DecodeResult r;
  do {
    r = decoder.next();
  } while (!r.error && r.message);
  ASSERT_EQ(r.error, make_error_code(expected));
  EXPECT_TRUE(decoder.failed());
  decoder.feed(side == Side::kDaemon ? frame_bytes(kFlushType, Bytes(8))
                                     : frame_bytes(kFlushAckType, Bytes(8)));
  for (int i = 0; i < 3; ++i) {
    auto again = decoder.next();
    EXPECT_EQ(again.error, make_error_code(expected));
    EXPECT_FALSE(again.message);
  }
  EXPECT_EQ(decoder.finish(), make_error_code(expected));
}

void expect_daemon_frame_rejected(const Bytes& frame, errc expected) {
  expect_rejected(Side::kDaemon, concat({hello_bytes(), frame}), expected, 1);
}

TEST(ProtoMalformed, TruncatedAtEveryCutPoint) {
  const auto events = sample_events(3);
  const Bytes stream = daemon_stream(events);
  // Frame boundaries: where a cut leaves nothing partial.
  std::vector<std::size_t> boundaries = {0, sizeof(Hello)};
  {
    std::size_t pos = sizeof(Hello);
    while (pos < stream.size()) {
      FrameHeader h;
      std::memcpy(&h, stream.data() + pos, sizeof h);
      pos += sizeof h + h.size;
      boundaries.push_back(pos);
    }
    ASSERT_EQ(pos, stream.size());
  }
  for (std::size_t cut = 0; cut <= stream.size(); ++cut) {
    const Bytes prefix(stream.begin(), stream.begin() + static_cast<std::ptrdiff_t>(cut));
    const DecodeAll d = decode_all(Side::kDaemon, prefix);
    ASSERT_FALSE(d.error) << "cut " << cut;
    const bool at_boundary =
        std::find(boundaries.begin(), boundaries.end(), cut) != boundaries.end();
    if (at_boundary) {
      EXPECT_FALSE(d.finish) << "cut " << cut;
    } else {
      EXPECT_EQ(d.finish, make_error_code(errc::truncated)) << "cut " << cut;
    }
    const std::size_t complete = static_cast<std::size_t>(
        std::upper_bound(boundaries.begin(), boundaries.end(), cut) - boundaries.begin() - 1);
    EXPECT_EQ(d.messages.size(), complete) << "cut " << cut;
  }
}

TEST(ProtoMalformed, TruncatedClientStream) {
  const Bytes stream = client_stream();
  const Bytes prefix(stream.begin(), stream.begin() + 20);  // FlushAck + part of a header
  const DecodeAll d = decode_all(Side::kClient, prefix, 1);
  EXPECT_FALSE(d.error);
  EXPECT_EQ(d.messages.size(), 1u);
  EXPECT_EQ(d.finish, make_error_code(errc::truncated));
}

TEST(ProtoMalformed, BadMagic) {
  // A first byte other than 0xF7 is rejected as soon as it arrives.
  Decoder decoder(Side::kDaemon);
  decoder.feed(Bytes{std::byte{'p'}});
  EXPECT_EQ(decoder.next().error, make_error_code(errc::bad_magic));
  for (std::size_t i = 1; i < 4; ++i) {
    Bytes hello = hello_bytes();
    hello[i] = std::byte{'x'};
    expect_rejected(Side::kDaemon, hello, errc::bad_magic, 0);
  }
  Bytes text_command = hello_bytes();
  text_command[0] = std::byte{'r'};
  expect_rejected(Side::kDaemon, text_command, errc::bad_magic, 0);
}

TEST(ProtoMalformed, UnsupportedVersion) {
  for (std::uint16_t version : {0, 9, 0x100, 0xffff}) {
    expect_rejected(Side::kDaemon, hello_bytes(version), errc::unsupported_version, 0);
  }
  // The version is checked before the rest of the hello, so a future hello with other
  // flags still gets "unsupported version".
  expect_rejected(Side::kDaemon, hello_bytes(9, 0xffff, ""), errc::unsupported_version, 0);
}

TEST(ProtoMalformed, BadHello) {
  expect_rejected(Side::kDaemon, hello_bytes(1, 1), errc::bad_hello, 0);
  expect_rejected(Side::kDaemon, hello_bytes(1, 0x8000), errc::bad_hello, 0);
  expect_rejected(Side::kDaemon, hello_bytes(1, 0, ""), errc::bad_hello, 0);  // required
  expect_rejected(Side::kDaemon, hello_bytes(1, 0, std::string(16, 'v')), errc::bad_hello, 0);
  expect_rejected(Side::kDaemon, hello_bytes(1, 0, "0.1\t0"), errc::bad_hello, 0);
  expect_rejected(Side::kDaemon, hello_bytes(1, 0, "0.1.0", std::string(24, 'p')), errc::bad_hello,
                  0);
  expect_rejected(Side::kDaemon, hello_bytes(1, 0, "0.1.0", "caf\xc3\xa9"), errc::bad_hello, 0);
  Bytes after_nul = hello_bytes(1, 0, "0.1.0", "proc");
  after_nul[24 + 10] = std::byte{'z'};  // process_name byte after its NUL
  expect_rejected(Side::kDaemon, after_nul, errc::bad_hello, 0);
}

TEST(ProtoMalformed, FrameTooLargeIsRejectedFromTheHeaderAlone) {
  for (std::uint32_t size : {kMaxFramePayload + 16, 0x10000000u, 0xfffffff0u, 0xffffffffu}) {
    expect_daemon_frame_rejected(header_bytes(size, kEventsType), errc::frame_too_large);
  }
  expect_daemon_frame_rejected(header_bytes(kMaxFramePayload + 1, kLedgerType),
                               errc::frame_too_large);
  expect_rejected(Side::kClient, header_bytes(0xffffffffu, kErrorType), errc::frame_too_large, 0);
}

TEST(ProtoMalformed, ConfiguredSmallerCapIsEnforced) {
  const Bytes frame = frame_bytes(kEventsType, [] {
    Bytes b;
    for (int i = 0; i < 65; ++i) b = concat({b, event_bytes(1, 1, 0, 1)});
    return b;
  }());  // 1040 payload bytes
  const Bytes stream = concat({hello_bytes(), frame});
  EXPECT_EQ(decode_all(Side::kDaemon, stream, 0, false, 1024).error,
            make_error_code(errc::frame_too_large));
  EXPECT_FALSE(decode_all(Side::kDaemon, stream, 0, false, 1040).error);
  // A cap above the protocol's is clamped to it.
  Decoder decoder(Side::kDaemon, 0xffffffffu);
  decoder.feed(concat({hello_bytes(), header_bytes(kMaxFramePayload + 16, kEventsType)}));
  ASSERT_TRUE(decoder.next().message);
  EXPECT_EQ(decoder.next().error, make_error_code(errc::frame_too_large));
}

TEST(ProtoMalformed, UnknownFrameType) {
  for (std::uint16_t type : {0, 12, 0x80, 0x84, 0x100, 0xffff}) {
    SCOPED_TRACE(type);
    expect_daemon_frame_rejected(frame_bytes(type, Bytes(8)), errc::unknown_frame_type);
    expect_rejected(Side::kClient, frame_bytes(type, Bytes(8)), errc::unknown_frame_type, 0);
  }
  // DroppedByCause (6) exists from protocol version 2 on: unknown on a version-1 stream
  // and to the client; on version 2 only its size is wrong here.
  expect_rejected(Side::kDaemon, concat({hello_bytes(1), frame_bytes(6, Bytes(32))}),
                  errc::unknown_frame_type, 1);
  expect_rejected(Side::kClient, frame_bytes(6, Bytes(32)), errc::unknown_frame_type, 0);
  expect_daemon_frame_rejected(frame_bytes(6, Bytes(8)), errc::bad_frame_size);
  // Each direction's types are unknown to the other side.
  expect_daemon_frame_rejected(frame_bytes(kFlushAckType, Bytes(8)), errc::unknown_frame_type);
  expect_daemon_frame_rejected(frame_bytes(kErrorType, testing::error_payload(1, "x")),
                               errc::unknown_frame_type);
  for (std::uint16_t type : {kEventsType, kRegisterType, kLedgerType, kDroppedType, kFlushType}) {
    expect_rejected(Side::kClient, frame_bytes(type, Bytes(fixed_payload_size(FrameType{type}))),
                    errc::unknown_frame_type, 0);
  }
  // A hello sent to a client is not a frame it knows.
  expect_rejected(Side::kClient, hello_bytes(), errc::unknown_frame_type, 0);
}

// Version 5's frames: a ring capacity that is not a power of two in range, a clock
// scale past 1024 ns per tick, a RingAck status nobody defined.
TEST(ProtoMalformed, BadRingFrames) {
  auto attach = [](std::uint64_t capacity) {
    ByteWriter w;
    w.u32(1).u32(77).u64(capacity);
    return frame_bytes(8, w.take());
  };
  for (std::uint64_t capacity : {0ull, 4095ull, 4097ull, 6000ull, (1ull << 26) * 2, ~0ull}) {
    SCOPED_TRACE(capacity);
    expect_daemon_frame_rejected(attach(capacity), errc::bad_ring);
  }
  for (std::uint64_t capacity : {4096ull, 1ull << 18, 1ull << 26}) {
    const DecodeAll d = decode_all(Side::kDaemon, concat({hello_bytes(), attach(capacity)}));
    EXPECT_FALSE(d.error) << capacity;
  }
  ByteWriter clock;
  clock.u64(0).u64(0).u64(std::uint64_t{1} << 42);
  expect_daemon_frame_rejected(frame_bytes(9, clock.take()), errc::bad_ring);
  ByteWriter ack;
  ack.u32(1).u32(3);
  expect_rejected(Side::kClient, frame_bytes(0x83, ack.take()), errc::bad_ring, 0);
}

TEST(ProtoMalformed, BadFrameSize) {
  // Events: empty or ragged batches.
  for (std::uint32_t size : {0u, 1u, 8u, 15u, 17u, 31u, kMaxFramePayload - 1}) {
    SCOPED_TRACE(size);
    expect_daemon_frame_rejected(header_bytes(size, kEventsType), errc::bad_frame_size);
  }
  // Fixed-size records: any other size, even when the payload is all there.
  const std::pair<std::uint16_t, std::uint32_t> fixed[] = {
      {kRegisterType, 72}, {kLedgerType, 176}, {kDroppedType, 8}, {kFlushType, 8}};
  for (const auto& [type, size] : fixed) {
    for (std::uint32_t wrong : {0u, size - 1, size + 1, size + 8, size * 2}) {
      SCOPED_TRACE(std::to_string(type) + "/" + std::to_string(wrong));
      expect_daemon_frame_rejected(frame_bytes(type, Bytes(wrong)), errc::bad_frame_size);
    }
  }
  for (std::uint32_t wrong : {0u, 7u, 9u, 16u}) {
    expect_rejected(Side::kClient, frame_bytes(kFlushAckType, Bytes(wrong)), errc::bad_frame_size,
                    0);
  }
  for (std::uint32_t wrong : {0u, 127u, 129u, 136u}) {
    expect_rejected(Side::kClient, frame_bytes(kErrorType, Bytes(wrong)), errc::bad_frame_size, 0);
  }
}

TEST(ProtoMalformed, NonzeroReserved) {
  expect_daemon_frame_rejected(frame_bytes(kFlushType, Bytes(8), 1), errc::bad_reserved);
  expect_daemon_frame_rejected(frame_bytes(kFlushType, Bytes(8), 0x8000), errc::bad_reserved);
  expect_rejected(Side::kClient, frame_bytes(kFlushAckType, Bytes(8), 2), errc::bad_reserved, 0);
  // The second record of a batch is bad: the whole frame is rejected.
  expect_daemon_frame_rejected(
      frame_bytes(kEventsType, concat({event_bytes(1, 1, 0, 1), event_bytes(2, 1, 0, 2, 1)})),
      errc::bad_reserved);
  expect_daemon_frame_rejected(frame_bytes(kRegisterType, register_payload(256, "s", 1)),
                               errc::bad_reserved);
  expect_daemon_frame_rejected(frame_bytes(kRegisterType, register_payload(256, "s", 0x80000000u)),
                               errc::bad_reserved);
  for (std::size_t i = 0; i < 6; ++i) {
    LedgerFields f;
    f.reserved[i] = 0x40;
    expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload(f)), errc::bad_reserved);
  }
  expect_rejected(Side::kClient, frame_bytes(kErrorType, testing::error_payload(1, "m", 1)),
                  errc::bad_reserved, 0);
}

TEST(ProtoMalformed, UnknownLedgerFlags) {
  for (std::uint8_t flags : {4, 8, 0x80, 0xff, 0x07}) {
    SCOPED_TRACE(int{flags});
    expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload({.flags = flags})),
                                 errc::bad_reserved);
  }
}

TEST(ProtoMalformed, BadStepId) {
  for (std::uint16_t step : {12, 13, 100, 255, 1280, 1281, 4096, 65535}) {
    SCOPED_TRACE(step);
    expect_daemon_frame_rejected(frame_bytes(kEventsType, event_bytes(1, 1, step, 1)),
                                 errc::bad_step_id);
  }
  // Only custom ids can be registered.
  for (std::uint32_t step : {0u, 11u, 12u, 255u, 1280u, 65536u + 256u, 0xffffffffu}) {
    SCOPED_TRACE(step);
    expect_daemon_frame_rejected(frame_bytes(kRegisterType, register_payload(step, "s")),
                                 errc::bad_step_id);
  }
}

TEST(ProtoMalformed, BadEventKind) {
  for (std::uint8_t kind : {0, 3, 4, 0x81, 0xff}) {
    SCOPED_TRACE(int{kind});
    expect_daemon_frame_rejected(
        frame_bytes(kEventsType, concat({event_bytes(1, 1, 0, 1), event_bytes(1, 1, 0, kind)})),
        errc::bad_event_kind);
  }
}

TEST(ProtoMalformed, BadStrings) {
  const auto reg = [](const Bytes& name_field) {
    ByteWriter w;
    w.u32(256).u32(0).raw(name_field);
    return frame_bytes(kRegisterType, w.take());
  };
  const auto field = [](std::string_view text) {
    ByteWriter w;
    w.str(text, kNameField);
    return w.take();
  };
  // Unterminated: 64 printable bytes.
  expect_daemon_frame_rejected(reg(field(std::string(64, 'a'))), errc::bad_string);
  // Empty where required.
  expect_daemon_frame_rejected(reg(field("")), errc::bad_string);
  // Non-printable bytes, at the edges of the printable range and beyond.
  for (char bad : {'\x01', '\x1f', '\x7f', '\x80', '\xff', '\t', '\n'}) {
    SCOPED_TRACE(int{static_cast<unsigned char>(bad)});
    expect_daemon_frame_rejected(reg(field(std::string("ab") + bad + "cd")), errc::bad_string);
  }
  // Nonzero after the NUL, anywhere up to the last byte.
  for (std::size_t at : {std::size_t{5}, std::size_t{30}, kNameField - 1}) {
    Bytes f = field("abcd");
    f[at] = std::byte{'x'};
    expect_daemon_frame_rejected(reg(f), errc::bad_string);
  }
  // Ledger: gpu_uuid is required, task may be empty but must be well formed.
  expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload({.gpu_uuid = ""})),
                               errc::bad_string);
  expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload({.gpu_uuid = "GPU\x7f"})),
                               errc::bad_string);
  expect_daemon_frame_rejected(
      frame_bytes(kLedgerType, ledger_payload({.task = std::string(64, 't')})), errc::bad_string);
  {
    Bytes p = ledger_payload({.task = ""});
    p[112 + 63] = std::byte{1};  // last byte of the task
    expect_daemon_frame_rejected(frame_bytes(kLedgerType, p), errc::bad_string);
  }
  // Error message (client side): may be empty, must be printable and terminated.
  expect_rejected(Side::kClient, frame_bytes(kErrorType, testing::error_payload(1, "bad\n")),
                  errc::bad_string, 0);
  expect_rejected(Side::kClient,
                  frame_bytes(kErrorType, testing::error_payload(1, std::string(120, 'm'))),
                  errc::bad_string, 0);
}

TEST(ProtoMalformed, BadLedgerOp) {
  for (std::uint8_t op : {0, 7, 0x80, 0xff}) {
    SCOPED_TRACE(int{op});
    expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload({.op = op})),
                                 errc::bad_ledger_op);
  }
}

// The lease ops (5, 6) are protocol version 3: bad_ledger_op on a version 1 or 2 stream.
TEST(ProtoMalformed, LeaseOpsBeforeVersionThreeAreBadLedgerOps) {
  for (std::uint16_t version : {1, 2}) {
    for (std::uint8_t op : {5, 6}) {
      SCOPED_TRACE(::testing::Message() << "version " << version << " op " << int{op});
      expect_rejected(
          Side::kDaemon,
          concat({hello_bytes(version), frame_bytes(kLedgerType, ledger_payload({.op = op}))}),
          errc::bad_ledger_op, 1);
    }
  }
  for (std::uint8_t op : {5, 6}) {
    const DecodeAll d =
        decode_all(Side::kDaemon,
                   concat({hello_bytes(3), frame_bytes(kLedgerType, ledger_payload({.op = op}))}));
    EXPECT_FALSE(d.error) << d.error.message();
  }
}

Bytes identity_payload(std::string_view job, std::uint32_t rank, std::uint32_t local_rank,
                       std::uint32_t world_size, std::uint32_t reserved = 0) {
  testing::ByteWriter w;
  w.str(job, kNameField).u32(rank).u32(local_rank).u32(world_size).u32(reserved);
  return w.take();
}

// PROTOCOL.md 4.7b: an Identity frame needs version 4, comes at most once, has ranks
// inside the world (when it is known) and a printable job id.
TEST(ProtoMalformed, IdentityRules) {
  constexpr std::uint16_t kIdentityType = 7;
  const Bytes good = frame_bytes(kIdentityType, identity_payload("job-1", 0, 0, 2));
  for (std::uint16_t version : {1, 2, 3}) {
    SCOPED_TRACE(::testing::Message() << "version " << version);
    expect_rejected(Side::kDaemon, concat({hello_bytes(version), good}), errc::unknown_frame_type,
                    1);
  }
  const DecodeAll ok = decode_all(Side::kDaemon, concat({hello_bytes(4), good}));
  EXPECT_FALSE(ok.error) << ok.error.message();
  ASSERT_EQ(ok.messages.size(), 2u);
  EXPECT_EQ(std::get<Identity>(ok.messages[1]).world_size, 2u);
  // Unknown ranks and an unknown world are fine; so is an empty job id.
  for (const Bytes& payload :
       {identity_payload("", kNoRank, kNoRank, 0), identity_payload("j", 7, kNoRank, 0),
        identity_payload("", kNoRank, 3, 4)}) {
    const DecodeAll d =
        decode_all(Side::kDaemon, concat({hello_bytes(4), frame_bytes(kIdentityType, payload)}));
    EXPECT_FALSE(d.error) << d.error.message();
  }
  expect_rejected(Side::kDaemon, concat({hello_bytes(4), good, good}), errc::bad_identity, 2);
  expect_rejected(
      Side::kDaemon,
      concat({hello_bytes(4), frame_bytes(kIdentityType, identity_payload("j", 2, 0, 2))}),
      errc::bad_identity, 1);
  expect_rejected(
      Side::kDaemon,
      concat({hello_bytes(4), frame_bytes(kIdentityType, identity_payload("j", 0, 5, 4))}),
      errc::bad_identity, 1);
  expect_rejected(
      Side::kDaemon,
      concat({hello_bytes(4), frame_bytes(kIdentityType, identity_payload("j", 0, 0, 2, 1))}),
      errc::bad_reserved, 1);
  expect_rejected(
      Side::kDaemon,
      concat({hello_bytes(4), frame_bytes(kIdentityType, identity_payload("j\x1b[2J", 0, 0, 2))}),
      errc::bad_string, 1);
  expect_rejected(Side::kDaemon,
                  concat({hello_bytes(4), frame_bytes(kIdentityType, Bytes(72, std::byte{0}))}),
                  errc::bad_frame_size, 1);
  // The client never receives one.
  expect_rejected(Side::kClient, good, errc::unknown_frame_type, 0);
}

// PROTOCOL.md 9.1: a record breaking several rules gets the first failing check's errc.
TEST(ProtoMalformed, FirstFailingCheckWins) {
  expect_rejected(Side::kDaemon, hello_bytes(kProtocolVersion + 1, 1, ""),
                  errc::unsupported_version, 0);
  expect_daemon_frame_rejected(header_bytes(0xffffffffu, 0x77, 1), errc::bad_reserved);
  expect_daemon_frame_rejected(header_bytes(0xffffffffu, 0x77), errc::unknown_frame_type);
  expect_daemon_frame_rejected(header_bytes(0xffffffffu, kFlushType), errc::frame_too_large);
  expect_daemon_frame_rejected(frame_bytes(kEventsType, event_bytes(1, 1, 12, 9, 1)),
                               errc::bad_reserved);
  expect_daemon_frame_rejected(frame_bytes(kEventsType, event_bytes(1, 1, 12, 9)),
                               errc::bad_step_id);
  // The first bad record decides, whatever the later ones hold.
  expect_daemon_frame_rejected(
      frame_bytes(kEventsType, concat({event_bytes(1, 1, 0, 7), event_bytes(1, 1, 0, 1, 1)})),
      errc::bad_event_kind);
  expect_daemon_frame_rejected(frame_bytes(kRegisterType, register_payload(5, "", 1)),
                               errc::bad_reserved);
  expect_daemon_frame_rejected(frame_bytes(kRegisterType, register_payload(5, "")),
                               errc::bad_step_id);
  LedgerFields all_bad{.op = 9, .flags = 0x40, .gpu_uuid = ""};
  all_bad.reserved[0] = 1;
  expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload(all_bad)),
                               errc::bad_reserved);
  all_bad.reserved[0] = 0;
  expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload(all_bad)),
                               errc::bad_reserved);  // unknown flag bits
  all_bad.flags = 0;
  expect_daemon_frame_rejected(frame_bytes(kLedgerType, ledger_payload(all_bad)),
                               errc::bad_ledger_op);
  expect_rejected(Side::kClient, frame_bytes(kErrorType, testing::error_payload(1, "\x01", 1)),
                  errc::bad_reserved, 0);
}

TEST(ProtoMalformed, ErrorComesAfterTheGoodFramesBeforeIt) {
  const Bytes stream = concat(
      {hello_bytes(), frame_bytes(kFlushType, Bytes(8)), frame_bytes(kDroppedType, Bytes(8)),
       frame_bytes(kEventsType, event_bytes(1, 1, 12, 1)), frame_bytes(kFlushType, Bytes(8))});
  expect_rejected(Side::kDaemon, stream, errc::bad_step_id, 3);
}

TEST(ProtoMalformed, ErrorsHaveStableNamesAndMessages) {
  for (int e = static_cast<int>(errc::truncated); e <= static_cast<int>(errc::bad_ledger_op); ++e) {
    const auto code = make_error_code(static_cast<errc>(e));
    EXPECT_STRNE(errc_name(static_cast<errc>(e)), "unknown");
    EXPECT_NE(code.message(), "unknown steptrace error");
    EXPECT_STREQ(code.category().name(), "steptrace");
  }
  EXPECT_STREQ(errc_name(errc::bad_step_id), "bad_step_id");
  EXPECT_STREQ(errc_name(errc::truncated), "truncated");
}

// Values and names travel (Error frames, protocol_errors labels, logs, snapshots): they
// never change, and a new code comes at the end.
TEST(ProtoErrc, ValuesNamesAndMessagesAreStable) {
  struct Expected {
    int value;
    const char* name;
    const char* message;
  };
  const Expected expected[] = {
      {1, "truncated", "stream ended inside a hello or frame"},
      {2, "bad_magic", "binary stream does not start with the steptrace magic"},
      {3, "unsupported_version", "unsupported protocol version"},
      {4, "bad_hello", "malformed hello"},
      {5, "frame_too_large", "frame larger than the frame-size cap"},
      {6, "unknown_frame_type", "unknown frame type"},
      {7, "bad_frame_size", "frame size does not match its type"},
      {8, "bad_reserved", "reserved field is not zero"},
      {9, "bad_step_id", "step id out of range"},
      {10, "bad_event_kind", "event kind is neither start nor end"},
      {11, "bad_string", "malformed string field"},
      {12, "bad_ledger_op", "unknown ledger operation"},
      {13, "unregistered_step", "event for a custom step that was never registered"},
      {14, "limit_reached", "configured limit reached"},
      {15, "permission_denied", "permission denied"},
      {16, "daemon_unreachable", "steptraced cannot be reached"},
      {17, "timed_out", "timed out"},
      {18, "bad_config", "bad configuration"},
      {19, "bad_command", "bad command"},
      {20, "bad_snapshot", "snapshot is not valid"},
      {21, "bad_identity", "identity frame repeated or rank out of range"},
      {22, "bad_ring", "shared-memory ring frame, descriptor or contents not valid"},
      {23, "bad_delivered", "delivered frame repeated or after events"},
      {24, "bad_batch", "batch frame malformed, nested, or holding a frame it may not"},
  };
  ASSERT_EQ(kErrcTable.size(), std::size(expected));
  for (const Expected& e : expected) {
    const auto code = static_cast<errc>(e.value);
    EXPECT_STREQ(errc_name(code), e.name) << e.value;
    EXPECT_EQ(make_error_code(code).message(), e.message) << e.value;
    const ErrcInfo& row = kErrcTable[static_cast<std::size_t>(e.value - 1)];
    EXPECT_EQ(row.code, code);
    EXPECT_STREQ(row.name, e.name);
    EXPECT_STREQ(row.message, e.message);
  }
  EXPECT_EQ(static_cast<int>(errc::bad_batch), 24);
  EXPECT_STREQ(errc_name(static_cast<errc>(0)), "unknown");
  EXPECT_STREQ(errc_name(static_cast<errc>(25)), "unknown");
  EXPECT_EQ(make_error_code(static_cast<errc>(25)).message(), "unknown steptrace error");
}

// The kinds `metrics` always exports under steptrace_protocol_errors_total: the ones the
// daemon counts there (PROTOCOL.md 9.1-9.3), not limits, configuration or commands.
TEST(ProtoErrc, ProtocolErrorKinds) {
  std::vector<std::string> kinds;
  for (const ErrcInfo& e : kErrcTable) {
    if (e.protocol_error) kinds.emplace_back(e.name);
  }
  EXPECT_EQ(kinds,
            (std::vector<std::string>{"truncated", "bad_magic", "unsupported_version", "bad_hello",
                                      "frame_too_large", "unknown_frame_type", "bad_frame_size",
                                      "bad_reserved", "bad_step_id", "bad_event_kind", "bad_string",
                                      "bad_ledger_op", "unregistered_step", "timed_out",
                                      "bad_identity", "bad_ring", "bad_delivered", "bad_batch"}));
}

// ---- encoder ------------------------------------------------------------------------

// Runs `write` on an encoder over exactly `room` bytes of a poisoned buffer; returns
// whether it wrote and checks that a failed call left every byte untouched.
template <typename F>
bool write_with_room(std::size_t room, F&& write) {
  std::vector<std::byte> buffer(room + 16, std::byte{0xAA});
  Encoder encoder{std::span(buffer).first(room)};
  const bool ok = write(encoder);
  if (!ok) {
    EXPECT_EQ(encoder.size(), 0u);
    EXPECT_EQ(encoder.remaining(), room);
    for (auto b : buffer) EXPECT_EQ(b, std::byte{0xAA});
  } else {
    for (std::size_t i = room; i < buffer.size(); ++i) EXPECT_EQ(buffer[i], std::byte{0xAA});
  }
  return ok;
}

TEST(ProtoEncoder, EveryCallWritesNothingWhenOutOfRoom) {
  const LedgerRecord ledger = make_ledger(LedgerOp::kReserve, 1, 2, 3, 4, "GPU", "t");
  const EventRecord event{1, 2, 3, 1, 0};
  struct Case {
    const char* name;
    std::size_t size;
    std::function<bool(Encoder&)> write;
  };
  const Case cases[] = {
      {"hello", 48, [](Encoder& e) { return e.hello("0.1.0", "p"); }},
      {"events", 24,
       [&](Encoder& e) {
         return e.events({&event, 1}) == 1;
       }},
      {"register_step", 80, [](Encoder& e) { return e.register_step(256, "s"); }},
      {"ledger", 184, [&](Encoder& e) { return e.ledger(ledger); }},
      {"dropped", 16, [](Encoder& e) { return e.dropped(1); }},
      {"flush", 16, [](Encoder& e) { return e.flush(1); }},
      {"flush_ack", 16, [](Encoder& e) { return e.flush_ack(1); }},
      {"error", 136, [](Encoder& e) { return e.error(ErrorCode::kLimit, "m"); }},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    EXPECT_FALSE(write_with_room(0, c.write));
    EXPECT_FALSE(write_with_room(c.size - 1, c.write));
    EXPECT_TRUE(write_with_room(c.size, c.write));
    std::vector<std::byte> buffer(c.size);
    Encoder encoder(buffer);
    ASSERT_TRUE(c.write(encoder));
    EXPECT_EQ(encoder.size(), c.size);
    EXPECT_EQ(encoder.remaining(), 0u);
    EXPECT_FALSE(c.write(encoder));  // full now: nothing more, size unchanged
    EXPECT_EQ(encoder.size(), c.size);
    encoder.clear();
    EXPECT_EQ(encoder.size(), 0u);
    EXPECT_TRUE(c.write(encoder));
  }
}

TEST(ProtoEncoder, EventsWritesTheLeadingRecordsThatFit) {
  const auto events = sample_events(10);
  std::vector<std::byte> buffer(8 + 3 * 16 + 15);
  Encoder encoder(buffer);
  EXPECT_EQ(encoder.events(events), 3u);
  EXPECT_EQ(encoder.size(), 8u + 48u);
  EXPECT_EQ(encoder.events({}), 0u);  // an empty batch writes nothing
  EXPECT_EQ(encoder.size(), 8u + 48u);
  const DecodeAll d = decode_all(Side::kDaemon, concat({hello_bytes(), to_bytes(encoder.bytes())}));
  ASSERT_FALSE(d.error);
  ASSERT_EQ(d.messages.size(), 2u);
  const auto& got = std::get<std::vector<EventRecord>>(d.messages[1]);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(same_event(got[2], events[2]));
}

TEST(ProtoEncoder, RegisterStepRejectsBadNamesAndWritesNothing) {
  for (std::string name : {std::string(), std::string(64, 'n'), std::string("tab\there"),
                           std::string("nul\0x", 5), std::string("caf\xc3\xa9")}) {
    EXPECT_FALSE(write_with_room(1024, [&](Encoder& e) { return e.register_step(256, name); }))
        << name;
  }
  EXPECT_TRUE(
      write_with_room(1024, [](Encoder& e) { return e.register_step(256, std::string(63, 'n')); }));
}

TEST(ProtoEncoder, LossyStringsInHelloAndErrorAreCutAndCleaned) {
  const Bytes stream =
      encode([](Encoder& e) { ASSERT_TRUE(e.hello(std::string(40, 'v'), "proc\x01name")); });
  const DecodeAll d = decode_all(Side::kDaemon, stream);
  ASSERT_FALSE(d.error) << d.error.message();
  const auto& hello = std::get<Hello>(d.messages.at(0));
  EXPECT_EQ(field_view(hello.library_version), std::string(15, 'v'));
  EXPECT_EQ(field_view(hello.process_name), "proc?name");

  const Bytes error = encode(
      [](Encoder& e) { ASSERT_TRUE(e.error(ErrorCode::kProtocol, std::string(200, 'e') + "\n")); });
  const DecodeAll c = decode_all(Side::kClient, error);
  ASSERT_FALSE(c.error);
  EXPECT_EQ(field_view(std::get<ErrorReport>(c.messages.at(0)).message), std::string(119, 'e'));
}

TEST(ProtoStrings, SetFieldRejectsOverlongAndNonPrintable) {
  char field[8];
  std::memset(field, 'x', sizeof field);
  EXPECT_TRUE(set_field(field, "1234567"));
  EXPECT_EQ(field_view(field), "1234567");
  EXPECT_EQ(field[7], 0);
  EXPECT_TRUE(valid_field(field, false));

  std::memset(field, 'x', sizeof field);
  EXPECT_FALSE(set_field(field, "12345678"));  // no room for the NUL
  for (char c : field) EXPECT_EQ(c, 0);        // zeroed, not half written

  std::memset(field, 'x', sizeof field);
  EXPECT_FALSE(set_field(field, "a\x7f"));
  for (char c : field) EXPECT_EQ(c, 0);
  EXPECT_FALSE(set_field(field, std::string_view("a\0b", 3)));
  EXPECT_FALSE(set_field(field, "\xe2\x82\xac"));

  EXPECT_TRUE(set_field(field, ""));
  EXPECT_TRUE(valid_field(field, true));
  EXPECT_FALSE(valid_field(field, false));
  EXPECT_TRUE(set_field(field, " ~"));  // both ends of the printable range
  EXPECT_EQ(field_view(field), " ~");
}

TEST(ProtoStrings, SetFieldLossyCutsAndReplaces) {
  char field[6];
  set_field_lossy(field, "abc\ndefgh");
  EXPECT_EQ(field_view(field), "abc?d");
  EXPECT_EQ(field[5], 0);
  EXPECT_TRUE(valid_field(field, false));
  set_field_lossy(field, "");
  EXPECT_EQ(field_view(field), "");
}

TEST(ProtoStrings, ValidFieldRules) {
  char field[4] = {'a', 'b', 'c', 'd'};
  EXPECT_FALSE(valid_field(field, true));  // unterminated
  EXPECT_EQ(field_view(field), "abcd");    // the view stops at the field's end
  const char after_nul[4] = {'a', 0, 'b', 0};
  EXPECT_FALSE(valid_field(after_nul, true));
  const char control[4] = {'a', '\x1f', 0, 0};
  EXPECT_FALSE(valid_field(control, true));
  const char good[4] = {'a', 'b', 'c', 0};
  EXPECT_TRUE(valid_field(good, false));
}

TEST(ProtoWireFormat, StepIdRanges) {
  EXPECT_EQ(kBuiltinStepNames[0], "Forward");
  EXPECT_EQ(kBuiltinStepNames[7], "LedgerReserve");
  EXPECT_EQ(kBuiltinStepNames[11], "LedgerRelease");
  for (std::uint32_t s = 0; s < 70000; ++s) {
    const bool valid = s < 12 || (s >= 256 && s < 1280);
    ASSERT_EQ(is_valid_step(s), valid) << s;
    ASSERT_EQ(is_ledger_step(s), s >= 7 && s <= 11) << s;
  }
}

TEST(ProtoSteps, LookupsFollowTheTable) {
  ASSERT_EQ(kBuiltinStepCount, 12u);  // PROTOCOL.md 4.5
  for (const BuiltinStep& step : kBuiltinSteps) {
    EXPECT_EQ(builtin_step_name(step.id), step.name);
    EXPECT_EQ(kBuiltinStepNames[step.id], step.name);
    EXPECT_EQ(find_builtin_step(step.name), step.id);
    EXPECT_EQ(is_ledger_step(step.id), step.ledger) << step.name;
  }
  EXPECT_EQ(builtin_step_name(kBuiltinStepCount), "");
  EXPECT_EQ(builtin_step_name(kFirstCustomStep), "");
  EXPECT_EQ(find_builtin_step("Tokenize"), std::nullopt);
  EXPECT_EQ(find_builtin_step("matmul"), std::nullopt);  // names are case-sensitive
  static_assert(builtin_step_id("Matmul") == 2);
  static_assert(builtin_step_id("LedgerRelease") == 11);
}

}  // namespace
}  // namespace steptrace::proto
