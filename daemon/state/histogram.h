// A log-linear histogram of span durations in nanoseconds, one per (process, step).
//
// Layout: a value v lands in "chunk" c (one per power of two) and one of 32 linear
// sub-buckets inside it. Values below 64 are exact (width 1); above that a bucket spans
// 1/32 of its power of two, so the bucket midpoint is within 1/64 (1.6%) of any value in
// the bucket: p50/p99 are within 2% of the exact percentile. record() is O(1): a clz, two
// shifts, a table lookup and an increment; no loop, no floating point, no allocation
// except the first time a power of two is seen (a 128-byte chunk, allocated lazily).
//
// Memory bound: 328 bytes fixed + 128 bytes (32 x uint32) per power of two actually
// seen, in one heap block (16 bytes more: daemon/state/charge.h charges it). A typical step
// whose spans vary by a factor of 4..100 touches 3..8 chunks: 0.7..1.4 KiB. The worst
// case (values spread over all 60 powers of two) is 8 KiB.
//
// Beside the log-linear buckets it keeps exact counts for the fixed Prometheus bucket
// bounds kPromBoundsNs (1us .. 10s, +Inf), so exported buckets are exact and add up
// across processes and nodes. Data flow: Collector::events() -> record(); reports ->
// percentile() / merge(); snapshots -> parts() / from_parts(), which the snapshot codec
// (daemon/persist/snapshot_codec.h) writes as JSON and reads back.
#pragma once

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "daemon/state/saturating.h"

namespace steptrace::daemon {

namespace histogram_detail {
// Upper bounds (inclusive, "le") of the exact Prometheus buckets, 1-2.5-5 per decade
// from 1 us to 10 s (fine enough for histogram_quantile() across nodes to land within
// a bucket of a factor 2-2.5); a +Inf bucket follows.
constexpr std::array<std::uint64_t, 22> make_prom_bounds() {
  std::array<std::uint64_t, 22> bounds{};
  std::uint64_t decade = 1'000;
  for (std::size_t i = 0; i + 1 < bounds.size(); i += 3, decade *= 10) {
    bounds[i] = decade;
    bounds[i + 1] = decade * 5 / 2;
    bounds[i + 2] = decade * 5;
  }
  bounds.back() = decade;  // 10 s
  return bounds;
}
inline constexpr std::array<std::uint64_t, 22> kPromBoundsNs = make_prom_bounds();

// record() finds the bucket with one comparison because at most one bound lies in any
// power of two: consecutive bounds are at least a factor 2 apart.
constexpr bool bounds_at_least_doubling() {
  for (std::size_t i = 1; i < kPromBoundsNs.size(); ++i) {
    if (kPromBoundsNs[i] < 2 * kPromBoundsNs[i - 1]) return false;
  }
  return true;
}
static_assert(bounds_at_least_doubling());
static_assert(kPromBoundsNs.back() == 10'000'000'000);

// For a value whose highest set bit is e (values below 64 share e = 5): how many bounds
// lie strictly below 2^e, i.e. below every such value.
constexpr std::array<std::uint8_t, 64> make_prom_below() {
  std::array<std::uint8_t, 64> below{};
  for (unsigned e = 0; e < 64; ++e) {
    std::uint8_t n = 0;
    for (auto b : kPromBoundsNs) {
      if (e >= 6 && b < (std::uint64_t{1} << e)) ++n;
    }
    below[e] = n;
  }
  return below;
}
inline constexpr std::array<std::uint8_t, 64> kPromBelow = make_prom_below();
// kPromBoundsNs plus a sentinel no value exceeds.
constexpr std::array<std::uint64_t, kPromBoundsNs.size() + 1> make_prom_upper() {
  std::array<std::uint64_t, kPromBoundsNs.size() + 1> upper{};
  for (std::size_t i = 0; i < kPromBoundsNs.size(); ++i) upper[i] = kPromBoundsNs[i];
  upper.back() = std::numeric_limits<std::uint64_t>::max();
  return upper;
}
inline constexpr auto kPromUpper = make_prom_upper();
}  // namespace histogram_detail

class Histogram {
 public:
  static constexpr unsigned kSubBits = 5;
  static constexpr unsigned kSubBuckets = 1u << kSubBits;  // per power of two
  static constexpr unsigned kChunks = 64 - kSubBits + 1;   // chunk 0: [0,32), 1: [32,64), ...
  static constexpr unsigned kBuckets = kChunks * kSubBuckets;
  // The heap one chunk (a power of two's 32 counters) takes in chunks_.
  static constexpr std::size_t kChunkBytes = kSubBuckets * sizeof(std::uint32_t);

  static constexpr auto kPromBoundsNs = histogram_detail::kPromBoundsNs;
  static constexpr std::size_t kPromBuckets = kPromBoundsNs.size() + 1;

  // Sums saturate at 2^64-1 ns (584 years): a client's durations must not wrap a total
  // below its own maximum, nor make a Prometheus counter go down.
  void record(std::uint64_t v) {
    ++count_;
    sum_ = saturating_add(sum_, v);
    min_ = v < min_ ? v : min_;
    max_ = v > max_ ? v : max_;
    const unsigned log2 = 63u - static_cast<unsigned>(std::countl_zero(v | kSubBuckets));
    const unsigned shift = log2 - kSubBits;
    const std::uint64_t top = v >> shift;  // in [0, 64)
    const unsigned chunk = shift + static_cast<unsigned>(top >> kSubBits);
    std::uint8_t slot = chunk_slot_[chunk];
    if (slot == 0) [[unlikely]]
      slot = add_chunk(chunk);
    const unsigned sub = static_cast<unsigned>(top & (kSubBuckets - 1));
    if (++chunks_[slot - 1u][sub] == 0) [[unlikely]]
      carry(chunk * kSubBuckets + sub, 1);
    // At most one Prometheus bound lies inside one power of two, so one comparison
    // after the table lookup finds the bucket.
    const unsigned prom = histogram_detail::kPromBelow[log2];
    ++prom_[prom + (v > histogram_detail::kPromUpper[prom] ? 1u : 0u)];
  }

  // Whether record(v) would allocate a chunk (the first value in its power of two): the
  // state budget charges it before (daemon/state/charge.h).
  bool needs_chunk(std::uint64_t v) const {
    const unsigned log2 = 63u - static_cast<unsigned>(std::countl_zero(v | kSubBuckets));
    const unsigned shift = log2 - kSubBits;
    return chunk_slot_[shift + static_cast<unsigned>((v >> shift) >> kSubBits)] == 0;
  }

  void merge(const Histogram& other);
  void clear();

  std::uint64_t count() const { return count_; }
  std::uint64_t sum() const { return sum_; }
  std::uint64_t min() const { return count_ ? min_ : 0; }
  std::uint64_t max() const { return max_; }
  // Nearest-rank percentile estimate (q in [0, 1]): the midpoint of the bucket holding
  // the rank, clamped to [min, max]. 0 when empty.
  std::uint64_t percentile(double q) const;
  // Non-cumulative counts per Prometheus bucket (last one is +Inf).
  const std::array<std::uint64_t, kPromBuckets>& prom_buckets() const { return prom_; }
  // Bytes this histogram owns (object plus chunks).
  std::size_t memory_bytes() const;
  std::size_t chunks_in_use() const { return chunks_.size(); }

  // Everything a histogram holds, for the snapshot codec (daemon/persist/snapshot_codec.h)
  // to write and to read back.
  struct Parts {
    std::uint64_t count = 0;
    std::uint64_t sum = 0;
    std::uint64_t min = 0;  // 0 when empty
    std::uint64_t max = 0;
    std::vector<std::pair<unsigned, std::uint64_t>> buckets;  // (index, count), nonzero, by index
    std::array<std::uint64_t, kPromBuckets> prom{};
    friend bool operator==(const Parts&, const Parts&) = default;
  };
  Parts parts() const;
  // The histogram `parts` describe. Checks everything (indices below kBuckets and
  // increasing, counts nonzero and adding up to `count` in both bucket sets, min <= max,
  // an empty one all zeros): nullopt with `reason` set when they are not parts that
  // parts() could have returned.
  static std::optional<Histogram> from_parts(const Parts& parts, std::string& reason);

  // The bucket a value lands in and that bucket's midpoint (exposed for tests).
  static unsigned bucket_index(std::uint64_t v);
  static std::uint64_t bucket_midpoint(unsigned index);

 private:
  // 32-bit counters halve the memory (and the cache footprint of the hot path); the
  // rare bucket that passes 2^32 keeps its high part in overflow_.
  using Chunk = std::array<std::uint32_t, kSubBuckets>;
  static_assert(sizeof(Chunk) == kChunkBytes);

  std::uint8_t add_chunk(unsigned chunk);
  // Adds `wraps` * 2^32 to bucket `index`'s high part.
  void carry(unsigned index, std::uint64_t wraps);
  std::uint64_t bucket_count(unsigned index) const;
  void add_to_bucket(unsigned index, std::uint64_t n);

  // Hot fields first: record() touches the first two cache lines and the prom_ array.
  std::uint64_t count_ = 0;
  std::uint64_t sum_ = 0;
  std::uint64_t min_ = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t max_ = 0;
  std::vector<Chunk> chunks_;
  std::array<std::uint8_t, kChunks> chunk_slot_{};  // chunk -> 1 + index in chunks_, 0: none
  std::array<std::uint64_t, kPromBuckets> prom_{};
  std::vector<std::pair<std::uint32_t, std::uint64_t>> overflow_;  // bucket -> wraps of 2^32
};

}  // namespace steptrace::daemon
