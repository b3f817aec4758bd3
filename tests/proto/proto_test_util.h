// Helpers for the codec tests: build raw byte streams field by field (independently of
// the Encoder, so malformed input can be made), and drive a Decoder over a stream in
// chosen chunk sizes while copying every message out (EventSpans die on the next feed).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <string_view>
#include <system_error>
#include <variant>
#include <vector>

#include "proto/codec.h"

namespace steptrace::proto::testing {

using Bytes = std::vector<std::byte>;

// Appends little-endian integers and raw bytes.
class ByteWriter {
 public:
  ByteWriter& u8(std::uint8_t v) {
    bytes_.push_back(std::byte{v});
    return *this;
  }
  ByteWriter& u16(std::uint16_t v) { return u8(v & 0xff).u8(v >> 8); }
  ByteWriter& u32(std::uint32_t v) { return u16(v & 0xffff).u16(v >> 16); }
  ByteWriter& u64(std::uint64_t v) { return u32(v & 0xffffffffu).u32(v >> 32); }
  ByteWriter& zeros(std::size_t n) {
    bytes_.insert(bytes_.end(), n, std::byte{0});
    return *this;
  }
  // A string field of `size` bytes: the text, then zeros.
  ByteWriter& str(std::string_view text, std::size_t size) {
    for (char c : text) bytes_.push_back(static_cast<std::byte>(c));
    return zeros(size - text.size());
  }
  ByteWriter& raw(const Bytes& b) {
    bytes_.insert(bytes_.end(), b.begin(), b.end());
    return *this;
  }
  const Bytes& bytes() const { return bytes_; }
  Bytes take() { return std::move(bytes_); }

 private:
  Bytes bytes_;
};

inline Bytes hello_bytes(std::uint16_t version = kProtocolVersion, std::uint16_t flags = 0,
                         std::string_view library = "0.1.0", std::string_view process = "t") {
  ByteWriter w;
  w.u8(0xF7).u8('S').u8('T').u8('P').u16(version).u16(flags);
  w.str(library, kLibraryVersionField).str(process, kProcessNameField);
  return w.take();
}

inline Bytes frame_bytes(std::uint16_t type, const Bytes& payload, std::uint16_t reserved = 0) {
  ByteWriter w;
  w.u32(static_cast<std::uint32_t>(payload.size())).u16(type).u16(reserved).raw(payload);
  return w.take();
}

// A header only, announcing `size` payload bytes.
inline Bytes header_bytes(std::uint32_t size, std::uint16_t type, std::uint16_t reserved = 0) {
  ByteWriter w;
  w.u32(size).u16(type).u16(reserved);
  return w.take();
}

inline Bytes event_bytes(std::uint64_t ts, std::uint32_t tid, std::uint16_t step, std::uint8_t kind,
                         std::uint8_t reserved = 0) {
  ByteWriter w;
  w.u64(ts).u32(tid).u16(step).u8(kind).u8(reserved);
  return w.take();
}

inline Bytes register_payload(std::uint32_t step, std::string_view name,
                              std::uint32_t reserved = 0) {
  ByteWriter w;
  w.u32(step).u32(reserved).str(name, kNameField);
  return w.take();
}

struct LedgerFields {
  std::uint64_t timestamp_ns = 1;
  std::uint64_t reservation_id = 2;
  std::uint64_t bytes = 3;
  std::uint64_t total_bytes = 4;
  std::uint32_t thread_id = 5;
  std::uint32_t holder_pid = 6;
  std::uint8_t op = 1;
  std::uint8_t flags = 0;
  std::uint8_t reserved[6] = {};
  std::string_view gpu_uuid = "GPU-1";
  std::string_view task = "task";
};

inline Bytes ledger_payload(const LedgerFields& f) {
  ByteWriter w;
  w.u64(f.timestamp_ns).u64(f.reservation_id).u64(f.bytes).u64(f.total_bytes);
  w.u32(f.thread_id).u32(f.holder_pid).u8(f.op).u8(f.flags);
  for (auto b : f.reserved) w.u8(b);
  w.str(f.gpu_uuid, kNameField).str(f.task, kNameField);
  return w.take();
}

inline Bytes error_payload(std::uint32_t code, std::string_view message,
                           std::uint32_t reserved = 0) {
  ByteWriter w;
  w.u32(code).u32(reserved).str(message, kErrorMessageField);
  return w.take();
}

inline Bytes concat(std::initializer_list<Bytes> parts) {
  Bytes out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

// A decoded message with event batches copied out of the decoder's buffer.
using Owned = std::variant<Hello, std::vector<EventRecord>, RegisterStep, LedgerRecord,
                           DroppedReport, FlushRequest, FlushAck, ErrorReport, DroppedByCause,
                           Identity, RingAttach, ClockSync, RingAck, Delivered, Batch>;

inline Owned to_owned(const Message& m) {
  if (const auto* events = std::get_if<EventSpan>(&m)) {
    std::vector<EventRecord> out;
    events->for_each([&](const EventRecord& e) { out.push_back(e); });
    return out;
  }
  return std::visit(
      [](const auto& v) -> Owned {
        if constexpr (std::is_same_v<std::decay_t<decltype(v)>, EventSpan>) {
          return std::vector<EventRecord>{};  // handled above
        } else {
          return v;
        }
      },
      m);
}

struct DecodeAll {
  std::vector<Owned> messages;
  std::error_code error;   // the first error next() returned
  std::error_code finish;  // finish() at the end
};

enum class Feeding { kWhole, kByteAtATime, kPrepareCommit };

// Feeds `stream` in chunks of `chunk` bytes (0: all at once), through feed() or
// prepare()/commit(), draining next() after each chunk. Every chunk is handed over as an
// exact-size heap copy, so ASan sees any read past it.
inline DecodeAll decode_all(Side side, const Bytes& stream, std::size_t chunk = 0,
                            bool use_prepare = false,
                            std::uint32_t max_payload = kMaxFramePayload) {
  Decoder decoder(side, max_payload);
  DecodeAll out;
  std::size_t pos = 0;
  const std::size_t step = chunk == 0 ? std::max<std::size_t>(stream.size(), 1) : chunk;
  while (pos < stream.size() && !out.error) {
    const std::size_t n = std::min(step, stream.size() - pos);
    auto copy = std::make_unique<std::byte[]>(n);
    std::memcpy(copy.get(), stream.data() + pos, n);
    if (use_prepare) {
      auto dst = decoder.prepare(n);
      if (dst.size() < n) {
        out.error = make_error_code(errc::bad_config);  // prepare() broke its promise
        return out;
      }
      std::memcpy(dst.data(), copy.get(), n);
      decoder.commit(n);
    } else {
      decoder.feed({copy.get(), n});
    }
    pos += n;
    for (;;) {
      auto r = decoder.next();
      if (r.error) {
        out.error = r.error;
        break;
      }
      if (!r.message) break;
      out.messages.push_back(to_owned(*r.message));
    }
  }
  out.finish = decoder.finish();
  return out;
}

inline bool same_bytes(const void* a, const void* b, std::size_t n) {
  return std::memcmp(a, b, n) == 0;
}

}  // namespace steptrace::proto::testing
