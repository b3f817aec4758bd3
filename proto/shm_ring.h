// The layout of a thread's event ring in shared memory (protocol version 5,
// PROTOCOL.md section 11), shared by the library that writes it and the daemon that
// reads it.
//
// A ring is one memfd: a kRingHeaderBytes header, then `capacity` 16-byte slots (an
// EventRecord each, timestamp_ns holding raw clock ticks; ClockSync converts them). The
// library makes it, seals it against shrinking (F_SEAL_SHRINK) and hands it to the
// daemon with a RingAttach frame (SCM_RIGHTS). The header's fields are accessed as
// 8-byte atomics (std::atomic_ref) by both sides:
//   head     written by the producer thread (release) after the slot: records [tail, head)
//            are published;
//   tail     written by the one consumer (release) when records are folded: the daemon
//            once the ring is attached, else the library's flusher;
//   dropped  the producer's counts of records it could not write (ring full), by cause;
//   orphaned the producer thread exited: nothing more is written; the consumer unmaps
//            the ring once it is empty.
// Everything the daemon reads from a ring is untrusted: it keeps its own tail, reads head
// once per drain and checks 0 <= head - tail <= capacity, copies records out before it
// validates them, and never reads a length twice.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>

#include "proto/wire_format.h"

namespace steptrace::proto {

inline constexpr std::uint32_t kRingMagic = 0x47525453;  // "STRG" little-endian
inline constexpr std::uint16_t kRingLayoutVersion = 1;
inline constexpr std::size_t kRingHeaderBytes = 4096;
inline constexpr std::uint64_t kMinShmRingRecords = 4096;                    // 64 KiB of slots
inline constexpr std::uint64_t kMaxShmRingRecords = std::uint64_t{1} << 26;  // 1 GiB of slots

struct RingHeader {
  // Written once by the library before the ring is offered (thread_id: see there).
  std::uint32_t magic;           // kRingMagic
  std::uint16_t layout_version;  // kRingLayoutVersion
  std::uint16_t reserved0;
  // The producer thread. Version 8: 0 in a spare ring (offered before a thread took it);
  // the thread that claims it stores its id here (release, ring_thread_field) before its
  // first record, and the daemon loads it (acquire) after a head that shows a record.
  std::uint32_t thread_id;
  std::uint32_t reserved1;
  std::uint64_t capacity;
  std::uint8_t pad0[40];
  // The producer's line.
  alignas(64) std::uint64_t head;
  std::uint64_t dropped_buffer_full;
  std::uint64_t dropped_not_connected;
  std::uint64_t orphaned;  // 0, or 1 once the producer thread exited
  std::uint8_t pad1[32];
  // The consumer's line.
  alignas(64) std::uint64_t tail;
  // The pid of the daemon that maps the ring (0: none). Set when it maps the ring,
  // cleared when it unmaps it after its last pass. The library takes a ring back (reads it
  // itself, or offers it on another connection) only when this is 0 or names a process
  // that no longer exists (a daemon that crashed): never two consumers at once.
  std::uint64_t consumer_pid;
  std::uint8_t pad2[48];
};
static_assert(sizeof(RingHeader) == 192);
static_assert(sizeof(RingHeader) <= kRingHeaderBytes);
static_assert(offsetof(RingHeader, head) == 64 && offsetof(RingHeader, tail) == 128 &&
              offsetof(RingHeader, consumer_pid) == 136);

// The bytes of the slots, what the daemon's ring budgets count (the header page is bounded
// by the ring-count limits).
constexpr std::uint64_t shm_ring_slot_bytes(std::uint64_t capacity) {
  return capacity * sizeof(EventRecord);
}
constexpr std::uint64_t shm_ring_bytes(std::uint64_t capacity) {
  return kRingHeaderBytes + capacity * sizeof(EventRecord);
}
constexpr bool valid_shm_ring_capacity(std::uint64_t capacity) {
  return capacity >= kMinShmRingRecords && capacity <= kMaxShmRingRecords &&
         (capacity & (capacity - 1)) == 0;
}

// One 8-byte header field as an atomic (both sides map the same page).
inline std::atomic_ref<std::uint64_t> ring_field(std::uint64_t& field) {
  return std::atomic_ref<std::uint64_t>(field);
}

// The header's thread_id as an atomic (a spare ring's is written after the offer).
inline std::atomic_ref<std::uint32_t> ring_thread_field(RingHeader& header) {
  return std::atomic_ref<std::uint32_t>(header.thread_id);
}

// ClockSync's conversion (wire_format.h), the same arithmetic as the library's own.
inline std::uint64_t ticks_to_ns(const ClockSync& clock, std::uint64_t ticks) {
  if (clock.scale == 0) return ticks;
  __extension__ typedef __int128 Int128;
  const Int128 delta = static_cast<std::int64_t>(ticks - clock.anchor_ticks);
  const Int128 ns =
      static_cast<Int128>(clock.anchor_ns) + ((delta * static_cast<Int128>(clock.scale)) >> 32);
  if (ns < 0) return 0;
  if (ns > static_cast<Int128>(UINT64_MAX)) return UINT64_MAX;
  return static_cast<std::uint64_t>(ns);
}

}  // namespace steptrace::proto
