#include "daemon/state/histogram.h"

#include <algorithm>
#include <cmath>

namespace steptrace::daemon {

unsigned Histogram::bucket_index(std::uint64_t v) {
  const unsigned log2 = 63u - static_cast<unsigned>(std::countl_zero(v | kSubBuckets));
  const unsigned shift = log2 - kSubBits;
  const std::uint64_t top = v >> shift;
  const unsigned chunk = shift + static_cast<unsigned>(top >> kSubBits);
  return chunk * kSubBuckets + static_cast<unsigned>(top & (kSubBuckets - 1));
}

std::uint64_t Histogram::bucket_midpoint(unsigned index) {
  const unsigned chunk = index / kSubBuckets;
  const std::uint64_t sub = index % kSubBuckets;
  if (chunk <= 1) return chunk * kSubBuckets + sub;  // width 1: exact
  const unsigned shift = chunk - 1;
  const std::uint64_t low = (kSubBuckets + sub) << shift;
  const std::uint64_t width = std::uint64_t{1} << shift;
  return low + (width - 1) / 2;
}

std::uint8_t Histogram::add_chunk(unsigned chunk) {
  // Exact-size growth: a histogram holds few chunks, and memory per key is what counts.
  chunks_.reserve(chunks_.size() + 1);
  chunks_.push_back(Chunk{});
  const auto slot = static_cast<std::uint8_t>(chunks_.size());
  chunk_slot_[chunk] = slot;
  return slot;
}

void Histogram::carry(unsigned index, std::uint64_t wraps) {
  for (auto& [i, high] : overflow_) {
    if (i == index) {
      high += wraps;
      return;
    }
  }
  overflow_.emplace_back(index, wraps);
}

std::uint64_t Histogram::bucket_count(unsigned index) const {
  const std::uint8_t slot = chunk_slot_[index / kSubBuckets];
  if (slot == 0) return 0;
  std::uint64_t n = chunks_[slot - 1u][index % kSubBuckets];
  for (const auto& [i, high] : overflow_) {
    if (i == index) n += high << 32;
  }
  return n;
}

void Histogram::add_to_bucket(unsigned index, std::uint64_t n) {
  const unsigned chunk = index / kSubBuckets;
  std::uint8_t slot = chunk_slot_[chunk];
  if (slot == 0) slot = add_chunk(chunk);
  std::uint32_t& low = chunks_[slot - 1u][index % kSubBuckets];
  const std::uint64_t sum = std::uint64_t{low} + (n & 0xFFFFFFFFu);
  low = static_cast<std::uint32_t>(sum);
  const std::uint64_t wraps = (sum >> 32) + (n >> 32);
  if (wraps != 0) carry(index, wraps);
}

void Histogram::merge(const Histogram& other) {
  if (other.count_ == 0) return;
  count_ = saturating_add(count_, other.count_);
  sum_ = saturating_add(sum_, other.sum_);
  min_ = std::min(min_, other.min_);
  max_ = std::max(max_, other.max_);
  for (std::size_t i = 0; i < kPromBuckets; ++i)
    prom_[i] = saturating_add(prom_[i], other.prom_[i]);
  for (unsigned c = 0; c < kChunks; ++c) {
    const std::uint8_t from = other.chunk_slot_[c];
    if (from == 0) continue;
    const Chunk& src = other.chunks_[from - 1u];
    for (unsigned s = 0; s < kSubBuckets; ++s) {
      if (src[s] != 0) add_to_bucket(c * kSubBuckets + s, src[s]);
    }
  }
  for (const auto& [index, high] : other.overflow_) carry(index, high);
}

void Histogram::clear() { *this = Histogram{}; }

std::uint64_t Histogram::percentile(double q) const {
  if (count_ == 0) return 0;
  q = std::clamp(q, 0.0, 1.0);
  auto rank = static_cast<std::uint64_t>(std::ceil(q * static_cast<double>(count_)));
  rank = std::clamp<std::uint64_t>(rank, 1, count_);
  std::uint64_t seen = 0;
  for (unsigned c = 0; c < kChunks; ++c) {
    const std::uint8_t slot = chunk_slot_[c];
    if (slot == 0) continue;
    for (unsigned s = 0; s < kSubBuckets; ++s) {
      seen += overflow_.empty() ? chunks_[slot - 1u][s] : bucket_count(c * kSubBuckets + s);
      if (seen >= rank) {
        return std::clamp(bucket_midpoint(c * kSubBuckets + s), min_, max_);
      }
    }
  }
  return max_;
}

std::size_t Histogram::memory_bytes() const {
  return sizeof(*this) + chunks_.capacity() * sizeof(Chunk) +
         overflow_.capacity() * sizeof(overflow_[0]);
}

Histogram::Parts Histogram::parts() const {
  Parts p;
  p.count = count_;
  p.sum = sum_;
  p.min = min();
  p.max = max_;
  for (unsigned c = 0; c < kChunks; ++c) {
    const std::uint8_t slot = chunk_slot_[c];
    if (slot == 0) continue;
    for (unsigned s = 0; s < kSubBuckets; ++s) {
      const std::uint64_t n = bucket_count(c * kSubBuckets + s);
      if (n != 0) p.buckets.emplace_back(c * kSubBuckets + s, n);
    }
  }
  p.prom = prom_;
  return p;
}

std::optional<Histogram> Histogram::from_parts(const Parts& parts, std::string& reason) {
  Histogram h;
  std::uint64_t bucket_total = 0;
  for (std::size_t i = 0; i < parts.buckets.size(); ++i) {
    const auto [index, n] = parts.buckets[i];
    if (index >= kBuckets || n == 0 || (i > 0 && index <= parts.buckets[i - 1].first)) {
      reason = "bucket indices must be increasing, below " + std::to_string(kBuckets) +
               ", with nonzero counts";
      return std::nullopt;
    }
    if (bucket_total + n < bucket_total) {
      reason = "bucket counts overflow";
      return std::nullopt;
    }
    bucket_total += n;
    h.add_to_bucket(index, n);
  }
  std::uint64_t prom_total = 0;
  for (const std::uint64_t n : parts.prom) {
    if (prom_total + n < prom_total) {
      reason = "prom counts overflow";
      return std::nullopt;
    }
    prom_total += n;
  }
  if (bucket_total != parts.count || prom_total != parts.count) {
    reason = "bucket counts do not add up to count";
    return std::nullopt;
  }
  if (parts.count > 0 &&
      (parts.min > parts.max || bucket_index(parts.min) > bucket_index(parts.max))) {
    reason = "min_ns > max_ns";
    return std::nullopt;
  }
  if (parts.count == 0 && (parts.sum != 0 || parts.min != 0 || parts.max != 0)) {
    reason = "an empty histogram has nonzero sum/min/max";
    return std::nullopt;
  }
  h.prom_ = parts.prom;
  h.count_ = parts.count;
  h.sum_ = parts.sum;
  h.min_ = parts.count ? parts.min : std::numeric_limits<std::uint64_t>::max();
  h.max_ = parts.max;
  return h;
}

}  // namespace steptrace::daemon
