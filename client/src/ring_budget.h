// How big each thread's ring is (event_ring.h), and the process-wide bound on all of them.
//
// A thread's ring is made on its first event: min(per-thread size, the largest power of
// two that fits in what is left of the total), in bytes of 16-byte records. When not
// even kMinRingBytes fit, the thread gets no ring: its events are dropped and counted
// under buffer_full, never waited for (it tries again once a freed ring returned its
// bytes). Defaults: 4 MiB per thread (262,144 records: a burst of 64k spans fits twice),
// 256 MiB in total. Set with STEPTRACE_BUFFER_BYTES / STEPTRACE_BUFFER_TOTAL_BYTES (read
// at library load) or steptrace_set_buffer_size (for threads whose first event comes
// later). Sizes: a number of bytes, optionally followed by K, M or G (KiB, MiB, GiB);
// the per-thread size is rounded down to a power of two.
#pragma once

#include <bit>
#include <cstdint>
#include <optional>
#include <string_view>

#include "client/src/event_ring.h"

namespace steptrace::client {

inline constexpr std::uint64_t kMinRingBytes = kMinRingRecords * kRingRecordBytes;  // 64 KiB
inline constexpr std::uint64_t kMaxRingBytes = kMaxRingRecords * kRingRecordBytes;  // 1 GiB
inline constexpr std::uint64_t kDefaultRingBytes = std::uint64_t{4} << 20;
inline constexpr std::uint64_t kMinTotalRingBytes = kMinRingBytes;
inline constexpr std::uint64_t kMaxTotalRingBytes = std::uint64_t{1} << 40;  // 1 TiB
inline constexpr std::uint64_t kDefaultTotalRingBytes = std::uint64_t{256} << 20;

constexpr bool valid_ring_bytes(std::uint64_t bytes) {
  return bytes >= kMinRingBytes && bytes <= kMaxRingBytes;
}
constexpr bool valid_total_ring_bytes(std::uint64_t bytes) {
  return bytes >= kMinTotalRingBytes && bytes <= kMaxTotalRingBytes;
}

// The size of the next ring (bytes, a power of two) given the per-thread size and the
// bytes of the total still unused; 0 when not even kMinRingBytes fit.
constexpr std::uint64_t next_ring_bytes(std::uint64_t per_thread, std::uint64_t left) {
  const std::uint64_t size = std::bit_floor(per_thread < left ? per_thread : left);
  return size < kMinRingBytes ? 0 : size;
}

// "65536", "64K", "4M", "1G" (also "4MiB", "4MB"; suffixes are binary, case-insensitive).
// nullopt when malformed or overflowing.
std::optional<std::uint64_t> parse_byte_size(std::string_view text);

// The buffer sizes from the environment (unset: the defaults). A bad value prints one
// line on stderr naming the variable and keeps the default.
struct BufferSizes {
  std::uint64_t per_thread = kDefaultRingBytes;
  std::uint64_t total = kDefaultTotalRingBytes;
};
BufferSizes buffer_sizes_from_env(const char* per_thread_env, const char* total_env);

}  // namespace steptrace::client
