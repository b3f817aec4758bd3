// The one codec of the steptrace wire format (proto/PROTOCOL.md), shared by the client
// library and the daemon.
//
// Encoder: appends a hello or frames into a caller-owned byte span; never allocates.
//   Each call either writes a whole record and returns true (or a count), or writes
//   nothing and returns false / 0 when the span has no room.
// Decoder: owns framing over a byte stream. Bytes go in through prepare()/commit()
//   (read straight into its buffer) or feed(); next() returns one validated message at
//   a time, "need more" or an error. It handles partial reads and many frames per
//   read, checks every field the spec constrains, never reads past what it was given,
//   never throws, and after the first error stays failed. Its buffer is bounded by
//   the frame-size cap plus one read.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <span>
#include <string_view>
#include <system_error>
#include <variant>
#include <vector>

#include "proto/errc.h"
#include "proto/shm_ring.h"
#include "proto/wire_format.h"

namespace steptrace::proto {

// ---- strings --------------------------------------------------------------------

constexpr bool is_printable(char c) { return c >= 0x20 && c <= 0x7e; }

// The text of a NUL-padded field (up to the first NUL, or the whole field).
template <std::size_t N>
std::string_view field_view(const char (&field)[N]) {
  const void* nul = std::memchr(field, 0, N);
  return {field, nul ? static_cast<std::size_t>(static_cast<const char*>(nul) - field) : N};
}

// A field is valid when it holds a NUL, every byte before it is printable ASCII, every
// byte after it is zero, and (unless allow_empty) it is not empty.
template <std::size_t N>
bool valid_field(const char (&field)[N], bool allow_empty) {
  std::size_t i = 0;
  for (; i < N && field[i] != 0; ++i) {
    if (!is_printable(field[i])) return false;
  }
  if (i == N) return false;  // unterminated
  if (i == 0 && !allow_empty) return false;
  for (std::size_t j = i; j < N; ++j) {
    if (field[j] != 0) return false;
  }
  return true;
}

// Fills a NUL-padded field. False (field zeroed) when the text does not fit or holds a
// byte that is not printable ASCII.
template <std::size_t N>
bool set_field(char (&field)[N], std::string_view text) {
  std::memset(field, 0, N);
  if (text.size() > N - 1) return false;
  if (!std::all_of(text.begin(), text.end(), is_printable)) return false;
  std::memcpy(field, text.data(), text.size());
  return true;
}

// Like set_field, but cuts overlong text and replaces unprintable bytes with '?'.
template <std::size_t N>
void set_field_lossy(char (&field)[N], std::string_view text) {
  std::memset(field, 0, N);
  const std::size_t n = std::min(text.size(), N - 1);
  for (std::size_t i = 0; i < n; ++i) field[i] = is_printable(text[i]) ? text[i] : '?';
}

// ---- encoder --------------------------------------------------------------------

class Encoder {
 public:
  explicit Encoder(std::span<std::byte> out) : out_(out) {}

  std::size_t size() const { return used_; }
  std::size_t remaining() const { return out_.size() - used_; }
  std::span<const std::byte> bytes() const { return out_.first(used_); }
  void clear() { used_ = 0; }

  bool hello(std::string_view library_version, std::string_view process_name,
             std::uint16_t version = kProtocolVersion) {
    Hello h{};
    std::memcpy(h.magic, kMagic, sizeof kMagic);
    h.version = version;
    set_field_lossy(h.library_version, library_version);
    set_field_lossy(h.process_name, process_name);
    return put(&h, sizeof h);
  }

  // One kEvents frame holding as many leading records of `events` as fit (in the span
  // and under the frame cap). Returns how many were written; 0 writes nothing.
  std::size_t events(std::span<const EventRecord> events) {
    if (remaining() < sizeof(FrameHeader) + sizeof(EventRecord)) return 0;
    const std::size_t fit = (remaining() - sizeof(FrameHeader)) / sizeof(EventRecord);
    const std::size_t n = std::min({events.size(), fit, std::size_t{kMaxEventsPerFrame}});
    if (n == 0) return 0;
    const FrameHeader header{static_cast<std::uint32_t>(n * sizeof(EventRecord)),
                             static_cast<std::uint16_t>(FrameType::kEvents), 0};
    put(&header, sizeof header);
    put(events.data(), n * sizeof(EventRecord));
    return n;
  }

  bool register_step(std::uint32_t step, std::string_view name) {
    RegisterStep r{};
    r.step = step;
    if (!set_field(r.name, name) || name.empty()) return false;
    return frame(FrameType::kRegisterStep, r);
  }
  bool ledger(const LedgerRecord& record) { return frame(FrameType::kLedger, record); }
  bool dropped(std::uint64_t total) { return frame(FrameType::kDropped, DroppedReport{total}); }
  bool dropped_by_cause(const DroppedByCause& causes) {
    return frame(FrameType::kDroppedByCause, causes);
  }
  // An Identity frame; the job id is cut to 63 chars, unprintable bytes become '?'.
  bool identity(std::string_view job, std::uint32_t rank, std::uint32_t local_rank,
                std::uint32_t world_size) {
    Identity r{};
    set_field_lossy(r.job, job);
    r.rank = rank;
    r.local_rank = local_rank;
    r.world_size = world_size;
    return frame(FrameType::kIdentity, r);
  }
  bool flush(std::uint64_t sequence) { return frame(FrameType::kFlush, FlushRequest{sequence}); }
  // Version 5: the frame whose first byte carries the ring's memfd (the caller sends it
  // with sendmsg and SCM_RIGHTS), the clock conversion, and the daemon's answer.
  bool ring_attach(std::uint32_t ring_id, std::uint32_t thread_id, std::uint64_t capacity) {
    return frame(FrameType::kRingAttach, RingAttach{ring_id, thread_id, capacity});
  }
  bool clock_sync(const ClockSync& clock) { return frame(FrameType::kClockSync, clock); }
  // Version 6: what earlier daemons took of this process's events (before any event).
  bool delivered(std::uint64_t events) { return frame(FrameType::kDelivered, Delivered{events}); }
  // Version 7: the next `frames` frames are batch `sequence` of the process.
  bool batch(std::uint64_t sequence, std::uint32_t frames) {
    return frame(FrameType::kBatch, Batch{sequence, frames, 0});
  }
  bool ring_ack(std::uint32_t ring_id, RingStatus status) {
    return frame(FrameType::kRingAck, RingAck{ring_id, static_cast<std::uint32_t>(status)});
  }
  bool flush_ack(std::uint64_t sequence) { return frame(FrameType::kFlushAck, FlushAck{sequence}); }
  bool error(ErrorCode code, std::string_view message) {
    ErrorReport r{};
    r.code = static_cast<std::uint32_t>(code);
    set_field_lossy(r.message, message);
    return frame(FrameType::kError, r);
  }

 private:
  template <typename Record>
  bool frame(FrameType type, const Record& record) {
    static_assert(sizeof(Record) % 8 == 0, "payloads keep frames 8-byte aligned");
    if (remaining() < sizeof(FrameHeader) + sizeof(Record)) return false;
    const FrameHeader header{sizeof(Record), static_cast<std::uint16_t>(type), 0};
    put(&header, sizeof header);
    put(&record, sizeof record);
    return true;
  }
  bool put(const void* data, std::size_t n) {
    if (remaining() < n) return false;
    std::memcpy(out_.data() + used_, data, n);
    used_ += n;
    return true;
  }

  std::span<std::byte> out_;
  std::size_t used_ = 0;
};

// ---- decoder --------------------------------------------------------------------

// A validated run of event records inside the decoder's buffer. Records are copied out
// one at a time (no alignment or aliasing assumptions). Valid until the next
// prepare()/feed() on the decoder that produced it.
class EventSpan {
 public:
  EventSpan() = default;
  EventSpan(const std::byte* data, std::size_t count) : data_(data), count_(count) {}
  std::size_t size() const { return count_; }
  bool empty() const { return count_ == 0; }
  // The records as received (maybe unaligned: copy them, never cast).
  const std::byte* data() const { return data_; }
  EventSpan first(std::size_t n) const { return {data_, n < count_ ? n : count_}; }
  EventRecord operator[](std::size_t i) const {
    EventRecord r;
    std::memcpy(&r, data_ + i * sizeof(EventRecord), sizeof r);
    return r;
  }
  template <typename F>
  void for_each(F&& f) const {
    for (std::size_t i = 0; i < count_; ++i) f((*this)[i]);
  }

 private:
  const std::byte* data_ = nullptr;
  std::size_t count_ = 0;
};

using Message = std::variant<Hello, EventSpan, RegisterStep, LedgerRecord, DroppedReport,
                             FlushRequest, FlushAck, ErrorReport, DroppedByCause, Identity,
                             RingAttach, ClockSync, RingAck, Delivered, Batch>;

// Which end of the connection decodes: the daemon expects a hello and client frames;
// the client expects daemon frames (kFlushAck, kError) and no hello.
enum class Side { kDaemon, kClient };

// Where a frame stands in its Batch (protocol version 7); sequence 0: in none.
struct BatchPosition {
  std::uint64_t sequence = 0;
  std::uint32_t index = 0;  // 0 for the batch's first frame
};

struct DecodeResult {
  std::error_code error;           // set: the stream is bad; the decoder stays failed
  std::optional<Message> message;  // empty and no error: more bytes are needed
  BatchPosition batch{};           // the message's place in a Batch, if any
};

class Decoder {
 public:
  static constexpr std::size_t kDefaultRead = 64 * 1024;

  explicit Decoder(Side side, std::uint32_t max_frame_payload = kMaxFramePayload)
      : side_(side),
        max_payload_(std::min(max_frame_payload, kMaxFramePayload)),
        expect_hello_(side == Side::kDaemon) {}

  // Writable space of at least `min_bytes` at the end of the buffer; read into it and
  // then commit() what was read. Invalidates EventSpans returned earlier.
  std::span<std::byte> prepare(std::size_t min_bytes = kDefaultRead) {
    if (begin_ == end_) begin_ = end_ = 0;
    if (buffer_.size() - end_ < min_bytes && begin_ > 0) {
      std::memmove(buffer_.data(), buffer_.data() + begin_, end_ - begin_);
      end_ -= begin_;
      begin_ = 0;
    }
    if (buffer_.size() - end_ < min_bytes) buffer_.resize(end_ + min_bytes);
    return {buffer_.data() + end_, buffer_.size() - end_};
  }
  void commit(std::size_t n) { end_ += std::min(n, buffer_.size() - end_); }
  void feed(std::span<const std::byte> data) {
    // memcpy with a null pointer is undefined even for 0 bytes, and an empty buffer or
    // span has one.
    if (data.empty()) return;
    auto dst = prepare(data.size());
    std::memcpy(dst.data(), data.data(), data.size());
    commit(data.size());
  }

  DecodeResult next() {
    if (failed_) return {failed_, std::nullopt};
    const std::size_t avail = end_ - begin_;
    const std::byte* p = buffer_.data() + begin_;
    if (expect_hello_) {
      if (avail >= 1 && p[0] != std::byte{kMagic[0]}) return fail(errc::bad_magic);
      if (avail < sizeof(Hello)) return {};
      Hello h;
      std::memcpy(&h, p, sizeof h);
      if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) return fail(errc::bad_magic);
      if (h.version < kMinProtocolVersion || h.version > kProtocolVersion) {
        return fail(errc::unsupported_version);
      }
      if (h.flags != 0 || !valid_field(h.library_version, false) ||
          !valid_field(h.process_name, true)) {
        return fail(errc::bad_hello);
      }
      begin_ += sizeof h;
      expect_hello_ = false;
      version_ = h.version;
      return {{}, Message{h}};
    }
    if (avail < sizeof(FrameHeader)) return {};
    FrameHeader header;
    std::memcpy(&header, p, sizeof header);
    if (header.reserved != 0) return fail(errc::bad_reserved);
    const auto type = static_cast<FrameType>(header.type);
    if (!accepts(type)) return fail(errc::unknown_frame_type);
    if (header.size > max_payload_) return fail(errc::frame_too_large);
    if (type == FrameType::kEvents) {
      if (header.size == 0 || header.size % sizeof(EventRecord) != 0) {
        return fail(errc::bad_frame_size);
      }
    } else if (header.size != fixed_payload_size(type)) {
      return fail(errc::bad_frame_size);
    }
    if (avail < sizeof header + header.size) return {};
    if (batch_left_ > 0 && !batchable(type)) return fail(errc::bad_batch);
    const std::byte* payload = p + sizeof header;
    DecodeResult result = decode_payload(type, payload, header.size);
    if (result.error) return result;
    begin_ += sizeof header + header.size;
    if (batch_left_ > 0 && type != FrameType::kBatch) {
      result.batch = {batch_sequence_, batch_index_++};
      --batch_left_;
    }
    return result;
  }

  // At end of stream: an error when a partial hello or frame is left over.
  std::error_code finish() const {
    if (failed_) return failed_;
    return end_ == begin_ ? std::error_code{} : make_error_code(errc::truncated);
  }
  std::size_t buffered() const { return end_ - begin_; }
  bool failed() const { return static_cast<bool>(failed_); }
  bool hello_seen() const { return side_ == Side::kDaemon && !expect_hello_; }
  // The protocol version of the hello (daemon side, once seen); frames of later versions
  // are unknown_frame_type on an earlier version's stream.
  std::uint16_t version() const { return version_; }

 private:
  bool accepts(FrameType type) const {
    switch (type) {
      case FrameType::kEvents:
      case FrameType::kRegisterStep:
      case FrameType::kLedger:
      case FrameType::kDropped:
      case FrameType::kFlush:
        return side_ == Side::kDaemon;
      case FrameType::kDroppedByCause:
        return side_ == Side::kDaemon && version_ >= 2;
      case FrameType::kIdentity:
        return side_ == Side::kDaemon && version_ >= kIdentityProtocolVersion;
      case FrameType::kRingAttach:
      case FrameType::kClockSync:
        return side_ == Side::kDaemon && version_ >= kShmProtocolVersion;
      case FrameType::kDelivered:
        return side_ == Side::kDaemon && version_ >= kDeliveredProtocolVersion;
      case FrameType::kBatch:
        return side_ == Side::kDaemon && version_ >= kBatchProtocolVersion;
      case FrameType::kFlushAck:
      case FrameType::kError:
      case FrameType::kRingAck:
        return side_ == Side::kClient;
    }
    return false;
  }

  // The frames a Batch may hold (Batch::frames counts them).
  static bool batchable(FrameType type) {
    switch (type) {
      case FrameType::kEvents:
      case FrameType::kRegisterStep:
      case FrameType::kLedger:
      case FrameType::kDropped:
      case FrameType::kDroppedByCause:
      case FrameType::kFlush:
        return true;
      default:
        return false;
    }
  }

  DecodeResult fail(errc e) {
    failed_ = make_error_code(e);
    return {failed_, std::nullopt};
  }

  template <typename Record>
  static Record load(const std::byte* p) {
    Record r;
    std::memcpy(&r, p, sizeof r);
    return r;
  }

  DecodeResult decode_payload(FrameType type, const std::byte* p, std::uint32_t size) {
    switch (type) {
      case FrameType::kEvents: {
        events_seen_ = true;
        const EventSpan events(p, size / sizeof(EventRecord));
        for (std::size_t i = 0; i < events.size(); ++i) {
          const EventRecord e = events[i];
          if (e.reserved != 0) return fail(errc::bad_reserved);
          if (!is_valid_step(e.step)) return fail(errc::bad_step_id);
          if (e.kind != static_cast<std::uint8_t>(EventKind::kStart) &&
              e.kind != static_cast<std::uint8_t>(EventKind::kEnd)) {
            return fail(errc::bad_event_kind);
          }
        }
        return {{}, Message{events}};
      }
      case FrameType::kRegisterStep: {
        const auto r = load<RegisterStep>(p);
        if (r.reserved != 0) return fail(errc::bad_reserved);
        if (!is_custom_step(r.step)) return fail(errc::bad_step_id);
        if (!valid_field(r.name, false)) return fail(errc::bad_string);
        return {{}, Message{r}};
      }
      case FrameType::kLedger: {
        const auto r = load<LedgerRecord>(p);
        for (auto b : r.reserved) {
          if (b != 0) return fail(errc::bad_reserved);
        }
        if ((r.flags & ~kLedgerKnownFlags) != 0) return fail(errc::bad_reserved);
        if (r.op < static_cast<std::uint8_t>(LedgerOp::kReserve) ||
            r.op > static_cast<std::uint8_t>(last_ledger_op(version_))) {
          return fail(errc::bad_ledger_op);
        }
        if (!valid_field(r.gpu_uuid, false) || !valid_field(r.task, true)) {
          return fail(errc::bad_string);
        }
        return {{}, Message{r}};
      }
      case FrameType::kDropped:
        return {{}, Message{load<DroppedReport>(p)}};
      case FrameType::kFlush:
        return {{}, Message{load<FlushRequest>(p)}};
      case FrameType::kDroppedByCause:
        return {{}, Message{load<DroppedByCause>(p)}};
      case FrameType::kIdentity: {
        const auto r = load<Identity>(p);
        if (r.reserved != 0) return fail(errc::bad_reserved);
        if (!valid_field(r.job, true)) return fail(errc::bad_string);
        auto in_world = [&](std::uint32_t rank) {
          return rank == kNoRank || r.world_size == 0 || rank < r.world_size;
        };
        if (identity_seen_ || !in_world(r.rank) || !in_world(r.local_rank)) {
          return fail(errc::bad_identity);
        }
        identity_seen_ = true;
        return {{}, Message{r}};
      }
      case FrameType::kRingAttach: {
        events_seen_ = true;
        const auto r = load<RingAttach>(p);
        if (!valid_shm_ring_capacity(r.capacity)) return fail(errc::bad_ring);
        return {{}, Message{r}};
      }
      case FrameType::kClockSync: {
        const auto r = load<ClockSync>(p);
        if (r.scale >= kMaxClockScale) return fail(errc::bad_ring);
        return {{}, Message{r}};
      }
      case FrameType::kDelivered: {
        // Compared with what the daemon counted before this connection sent anything.
        if (delivered_seen_ || events_seen_) return fail(errc::bad_delivered);
        delivered_seen_ = true;
        return {{}, Message{load<Delivered>(p)}};
      }
      case FrameType::kBatch: {
        const auto r = load<Batch>(p);
        if (r.reserved != 0) return fail(errc::bad_reserved);
        if (r.sequence == 0 || r.frames == 0) return fail(errc::bad_batch);
        batch_sequence_ = r.sequence;
        batch_left_ = r.frames;
        batch_index_ = 0;
        return {{}, Message{r}};
      }
      case FrameType::kRingAck: {
        const auto r = load<RingAck>(p);
        if (r.status > kLastRingStatus) return fail(errc::bad_ring);
        return {{}, Message{r}};
      }
      case FrameType::kFlushAck:
        return {{}, Message{load<FlushAck>(p)}};
      case FrameType::kError: {
        const auto r = load<ErrorReport>(p);
        if (r.reserved != 0) return fail(errc::bad_reserved);
        if (!valid_field(r.message, true)) return fail(errc::bad_string);
        return {{}, Message{r}};
      }
    }
    return fail(errc::unknown_frame_type);
  }

  Side side_;
  std::uint32_t max_payload_;
  bool expect_hello_;
  bool identity_seen_ = false;
  bool delivered_seen_ = false;
  bool events_seen_ = false;  // an Events or RingAttach frame (a Delivered must come first)
  // The Batch being read: frames of it still to come, its number, the next frame's index.
  std::uint32_t batch_left_ = 0;
  std::uint64_t batch_sequence_ = 0;
  std::uint32_t batch_index_ = 0;
  std::uint16_t version_ = kProtocolVersion;
  std::error_code failed_;
  std::vector<std::byte> buffer_;
  std::size_t begin_ = 0;
  std::size_t end_ = 0;
};

}  // namespace steptrace::proto
