// libFuzzer target for proto::Decoder (proto/codec.h), built and run by scripts/fuzz.sh.
//
// Input layout: byte 0 seeds the chunking (how the stream is cut into reads), byte 1
// holds options (bit 0: read through prepare()/commit() instead of feed(); bit 1: a
// 256-byte frame cap instead of the protocol's), the rest is the byte stream. The same
// stream goes to a daemon-side and a client-side Decoder, each chunk as an exact-size
// heap copy so AddressSanitizer sees any read past what was fed. Every message is read
// field by field and checked against the rules of PROTOCOL.md; the decoder's byte
// accounting and its sticky failure are checked after every call. Any broken invariant
// aborts.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <span>
#include <variant>

#include "proto/codec.h"

namespace {

using namespace steptrace;
using namespace steptrace::proto;

#define FUZZ_CHECK(cond)                                                                \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      std::fprintf(stderr, "%s:%d: invariant failed: %s\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                     \
    }                                                                                   \
  } while (0)

volatile std::uint64_t g_sink;  // keeps field reads from being optimised away

template <std::size_t N>
void touch_field(const char (&field)[N], bool allow_empty) {
  FUZZ_CHECK(valid_field(field, allow_empty));
  const std::string_view text = field_view(field);
  FUZZ_CHECK(text.size() < N);
  for (char c : text) {
    FUZZ_CHECK(is_printable(c));
    g_sink = g_sink + static_cast<unsigned char>(c);
  }
}

// One decoder and what the harness knows about its stream.
class Harness {
 public:
  Harness(Side side, std::uint32_t cap) : side_(side), decoder_(side, cap), cap_(cap) {}

  void push(const std::byte* data, std::size_t n, bool use_prepare) {
    // An exact-size heap copy: ASan flags any read past it.
    std::unique_ptr<std::byte[]> copy(n ? new std::byte[n] : nullptr);
    if (n) std::memcpy(copy.get(), data, n);
    if (use_prepare) {
      const std::span<std::byte> dst = decoder_.prepare(n);
      FUZZ_CHECK(dst.size() >= n);
      if (n) std::memcpy(dst.data(), copy.get(), n);
      decoder_.commit(n);
    } else {
      decoder_.feed({copy.get(), n});
    }
    fed_ += n;
    if (!decoder_.failed()) FUZZ_CHECK(decoder_.buffered() == fed_ - consumed_);
  }

  void drain() {
    for (int guard = 0;; ++guard) {
      FUZZ_CHECK(guard <= 1 << 20);
      const DecodeResult r = decoder_.next();
      if (r.error) {
        on_error(r.error);
        return;
      }
      if (!r.message) {
        FUZZ_CHECK(decoder_.buffered() == fed_ - consumed_);
        return;
      }
      FUZZ_CHECK(!error_);  // no message after an error
      check_batch_position(*r.message, r.batch);
      consumed_ += check_message(*r.message);
      FUZZ_CHECK(consumed_ <= fed_);
      FUZZ_CHECK(decoder_.buffered() == fed_ - consumed_);
    }
  }

  void finish() {
    const std::error_code e = decoder_.finish();
    if (error_) {
      FUZZ_CHECK(e == error_);
      FUZZ_CHECK(decoder_.failed());
    } else {
      FUZZ_CHECK(!decoder_.failed());
      if (decoder_.buffered() == 0) {
        FUZZ_CHECK(!e);
      } else {
        FUZZ_CHECK(e == make_error_code(errc::truncated));
      }
    }
  }

 private:
  void on_error(std::error_code e) {
    FUZZ_CHECK(&e.category() == &steptrace_category());
    const int v = e.value();
    // Framing and validation (2..12), a repeated or out-of-world Identity (version 4), a
    // bad ring frame (version 5), a repeated or late Delivered (version 6), a bad or
    // nested Batch (version 7): nothing else comes out of a decoder.
    FUZZ_CHECK(
        (v >= static_cast<int>(errc::bad_magic) && v <= static_cast<int>(errc::bad_ledger_op)) ||
        v == static_cast<int>(errc::bad_identity) || v == static_cast<int>(errc::bad_ring) ||
        v == static_cast<int>(errc::bad_delivered) || v == static_cast<int>(errc::bad_batch));
    if (error_) FUZZ_CHECK(e == error_);
    error_ = e;
    FUZZ_CHECK(decoder_.failed());
    // Sticky: the same error again, never a message.
    for (int i = 0; i < 2; ++i) {
      const DecodeResult again = decoder_.next();
      FUZZ_CHECK(again.error == error_);
      FUZZ_CHECK(!again.message);
    }
    FUZZ_CHECK(decoder_.finish() == error_);
  }

  // A Batch's frames come numbered 0.. after it, exactly its count of them; no other
  // message has a position.
  void check_batch_position(const Message& m, const BatchPosition& at) {
    if (const auto* b = std::get_if<Batch>(&m)) {
      FUZZ_CHECK(batch_left_ == 0 && at.sequence == 0);
      batch_left_ = b->frames;
      batch_sequence_ = b->sequence;
      batch_index_ = 0;
      return;
    }
    if (batch_left_ == 0) {
      FUZZ_CHECK(at.sequence == 0);
      return;
    }
    FUZZ_CHECK(at.sequence == batch_sequence_ && at.index == batch_index_);
    ++batch_index_;
    --batch_left_;
  }

  // Reads every field, checks the spec's rules, returns the bytes the message took.
  std::size_t check_message(const Message& m) {
    if (const auto* h = std::get_if<Hello>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon && !hello_seen_ && consumed_ == 0);
      hello_seen_ = true;
      FUZZ_CHECK(decoder_.hello_seen());
      FUZZ_CHECK(std::memcmp(h->magic, kMagic, sizeof kMagic) == 0);
      FUZZ_CHECK(h->version >= kMinProtocolVersion && h->version <= kProtocolVersion &&
                 h->flags == 0);
      touch_field(h->library_version, false);
      FUZZ_CHECK(!field_view(h->library_version).empty());
      touch_field(h->process_name, true);
      return sizeof(Hello);
    }
    FUZZ_CHECK(side_ == Side::kClient || hello_seen_);  // frames only after the hello
    if (const auto* events = std::get_if<EventSpan>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon);
      FUZZ_CHECK(!events->empty() && events->size() <= kMaxEventsPerFrame);
      const std::size_t bytes = events->size() * sizeof(EventRecord);
      FUZZ_CHECK(bytes <= cap_);
      FUZZ_CHECK(consumed_ + sizeof(FrameHeader) + bytes <= fed_);  // within what was fed
      std::size_t seen = 0;
      events->for_each([&](const EventRecord& e) {
        FUZZ_CHECK(is_valid_step(e.step));
        FUZZ_CHECK(e.kind == static_cast<std::uint8_t>(EventKind::kStart) ||
                   e.kind == static_cast<std::uint8_t>(EventKind::kEnd));
        FUZZ_CHECK(e.reserved == 0);
        g_sink = g_sink + e.timestamp_ns + e.thread_id + e.step;
        ++seen;
      });
      FUZZ_CHECK(seen == events->size());
      data_seen_ = true;
      return sizeof(FrameHeader) + bytes;
    }
    if (const auto* r = std::get_if<RegisterStep>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon);
      FUZZ_CHECK(is_custom_step(r->step) && r->reserved == 0);
      touch_field(r->name, false);
      return sizeof(FrameHeader) + sizeof *r;
    }
    if (const auto* l = std::get_if<LedgerRecord>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon);
      FUZZ_CHECK(l->op >= static_cast<std::uint8_t>(LedgerOp::kReserve) &&
                 l->op <= static_cast<std::uint8_t>(last_ledger_op(decoder_.version())));
      FUZZ_CHECK((l->flags & ~kLedgerKnownFlags) == 0);
      for (auto b : l->reserved) FUZZ_CHECK(b == 0);
      touch_field(l->gpu_uuid, false);
      touch_field(l->task, true);
      g_sink = g_sink + l->timestamp_ns + l->reservation_id + l->bytes + l->total_bytes +
               l->thread_id + l->holder_pid;
      return sizeof(FrameHeader) + sizeof *l;
    }
    if (const auto* d = std::get_if<DroppedReport>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon);
      g_sink = g_sink + d->total_dropped;
      return sizeof(FrameHeader) + sizeof *d;
    }
    if (const auto* c = std::get_if<DroppedByCause>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= 2);
      for (auto n : c->count) g_sink = g_sink + n;
      return sizeof(FrameHeader) + sizeof *c;
    }
    if (const auto* f = std::get_if<FlushRequest>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon);
      g_sink = g_sink + f->sequence;
      return sizeof(FrameHeader) + sizeof *f;
    }
    if (const auto* a = std::get_if<FlushAck>(&m)) {
      FUZZ_CHECK(side_ == Side::kClient);
      g_sink = g_sink + a->sequence;
      return sizeof(FrameHeader) + sizeof *a;
    }
    if (const auto* id = std::get_if<Identity>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= kIdentityProtocolVersion);
      FUZZ_CHECK(!identity_seen_ && id->reserved == 0);
      identity_seen_ = true;
      touch_field(id->job, true);
      auto in_world = [&](std::uint32_t rank) {
        return rank == kNoRank || id->world_size == 0 || rank < id->world_size;
      };
      FUZZ_CHECK(in_world(id->rank) && in_world(id->local_rank));
      return sizeof(FrameHeader) + sizeof *id;
    }
    if (const auto* r = std::get_if<RingAttach>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= kShmProtocolVersion);
      FUZZ_CHECK(valid_shm_ring_capacity(r->capacity));
      data_seen_ = true;
      g_sink = g_sink + r->ring_id + r->thread_id;
      return sizeof(FrameHeader) + sizeof *r;
    }
    if (const auto* c = std::get_if<ClockSync>(&m)) {
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= kShmProtocolVersion);
      FUZZ_CHECK(c->scale < kMaxClockScale);
      // The conversion never traps, whatever the anchor and the ticks.
      g_sink = g_sink + ticks_to_ns(*c, c->anchor_ticks ^ g_sink) + ticks_to_ns(*c, 0) +
               ticks_to_ns(*c, ~std::uint64_t{0});
      return sizeof(FrameHeader) + sizeof *c;
    }
    if (const auto* a = std::get_if<RingAck>(&m)) {
      FUZZ_CHECK(side_ == Side::kClient && a->status <= kLastRingStatus);
      g_sink = g_sink + a->ring_id;
      return sizeof(FrameHeader) + sizeof *a;
    }
    if (const auto* d = std::get_if<Delivered>(&m)) {
      // Version 6: once per stream, before any Events or RingAttach.
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= kDeliveredProtocolVersion);
      FUZZ_CHECK(!delivered_seen_ && !data_seen_);
      delivered_seen_ = true;
      g_sink = g_sink + d->events;
      return sizeof(FrameHeader) + sizeof *d;
    }
    if (const auto* b = std::get_if<Batch>(&m)) {
      // Version 7: numbered from 1, at least one frame, never inside another batch.
      FUZZ_CHECK(side_ == Side::kDaemon && decoder_.version() >= kBatchProtocolVersion);
      FUZZ_CHECK(b->sequence != 0 && b->frames != 0 && b->reserved == 0);
      g_sink = g_sink + b->sequence + b->frames;
      return sizeof(FrameHeader) + sizeof *b;
    }
    if (const auto* e = std::get_if<ErrorReport>(&m)) {
      FUZZ_CHECK(side_ == Side::kClient);
      FUZZ_CHECK(e->reserved == 0);
      g_sink = g_sink + e->code;
      touch_field(e->message, true);
      return sizeof(FrameHeader) + sizeof *e;
    }
    FUZZ_CHECK(false && "unknown message alternative");
    return 0;
  }

  Side side_;
  Decoder decoder_;
  std::uint32_t cap_;
  std::size_t fed_ = 0;
  std::size_t consumed_ = 0;
  bool hello_seen_ = false;
  bool identity_seen_ = false;
  bool delivered_seen_ = false;
  std::uint32_t batch_left_ = 0;  // frames of the current Batch still to come
  std::uint64_t batch_sequence_ = 0;
  std::uint32_t batch_index_ = 0;
  bool data_seen_ = false;  // an Events or RingAttach frame was decoded
  std::error_code error_;
};

// Chunk sizes from a small PRNG: mostly short reads, sometimes empty, sometimes large.
class Chunker {
 public:
  explicit Chunker(std::uint8_t seed) : state_(0x9E3779B97F4A7C15ull ^ (seed * 0x100000001b3ull)) {}
  std::size_t next(std::size_t left) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    std::size_t n;
    switch (state_ % 8) {
      case 0:
        n = 0;
        break;
      case 1:
        n = 1;
        break;
      case 2:
        n = left;
        break;
      case 3:
        n = 1 + (state_ >> 8) % 4096;
        break;
      default:
        n = 1 + (state_ >> 8) % 64;
        break;
    }
    return n < left ? n : left;
  }

 private:
  std::uint64_t state_;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::uint8_t seed = 0;
  std::uint8_t options = 0;
  if (size >= 2) {
    seed = data[0];
    options = data[1];
    data += 2;
    size -= 2;
  }
  const bool use_prepare = options & 1;
  const std::uint32_t cap = (options & 2) ? 256 : kMaxFramePayload;
  const auto* stream = reinterpret_cast<const std::byte*>(data);

  Harness daemon(Side::kDaemon, cap);
  Harness client(Side::kClient, cap);
  Chunker chunker(seed);
  std::size_t pos = 0;
  do {  // at least one read, so an empty input still goes through push()/drain()
    const std::size_t n = chunker.next(size - pos);
    daemon.push(stream + pos, n, use_prepare);
    client.push(stream + pos, n, use_prepare);
    pos += n;
    daemon.drain();
    client.drain();
  } while (pos < size);
  daemon.finish();
  client.finish();
  return 0;
}
