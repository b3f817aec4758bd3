#include "daemon/state/histogram.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

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
  count_ += other.count_;
  sum_ += other.sum_;
  min_ = std::min(min_, other.min_);
  max_ = std::max(max_, other.max_);
  for (std::size_t i = 0; i < kPromBuckets; ++i) prom_[i] += other.prom_[i];
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

nlohmann::json Histogram::to_json() const {
  nlohmann::json buckets = nlohmann::json::array();
  for (unsigned c = 0; c < kChunks; ++c) {
    const std::uint8_t slot = chunk_slot_[c];
    if (slot == 0) continue;
    for (unsigned s = 0; s < kSubBuckets; ++s) {
      const std::uint64_t n = bucket_count(c * kSubBuckets + s);
      if (n != 0) buckets.push_back({c * kSubBuckets + s, n});
    }
  }
  return {{"count", count_}, {"sum_ns", sum_},     {"min_ns", min()},
          {"max_ns", max_},  {"buckets", buckets}, {"prom", prom_}};
}

namespace {
// A non-negative integer, whether nlohmann stored it signed (built in memory) or
// unsigned (parsed).
bool is_count(const nlohmann::json& j) {
  return j.is_number_unsigned() || (j.is_number_integer() && j.get<std::int64_t>() >= 0);
}

bool get_u64(const nlohmann::json& j, const char* key, std::uint64_t& out, std::string& error) {
  const auto it = j.find(key);
  if (it == j.end() || !is_count(*it)) {
    error = std::string("histogram: \"") + key + "\" must be an unsigned integer";
    return false;
  }
  out = it->get<std::uint64_t>();
  return true;
}
}  // namespace

std::optional<Histogram> Histogram::from_json(const nlohmann::json& j, std::string& error) {
  if (!j.is_object()) {
    error = "histogram: not an object";
    return std::nullopt;
  }
  Histogram h;
  std::uint64_t count = 0, sum = 0, min = 0, max = 0;
  if (!get_u64(j, "count", count, error) || !get_u64(j, "sum_ns", sum, error) ||
      !get_u64(j, "min_ns", min, error) || !get_u64(j, "max_ns", max, error)) {
    return std::nullopt;
  }
  const auto buckets = j.find("buckets");
  const auto prom = j.find("prom");
  if (buckets == j.end() || !buckets->is_array() || prom == j.end() || !prom->is_array() ||
      prom->size() != kPromBuckets) {
    error = "histogram: \"buckets\" and \"prom\" (" + std::to_string(kPromBuckets) +
            " counts) are required arrays";
    return std::nullopt;
  }
  std::uint64_t bucket_total = 0;
  unsigned last_index = 0;
  bool first = true;
  for (const auto& b : *buckets) {
    if (!b.is_array() || b.size() != 2 || !is_count(b[0]) || !is_count(b[1])) {
      error = "histogram: a bucket must be [index, count]";
      return std::nullopt;
    }
    const auto index = b[0].get<std::uint64_t>();
    const auto n = b[1].get<std::uint64_t>();
    if (index >= kBuckets || n == 0 || (!first && index <= last_index)) {
      error = "histogram: bucket indices must be increasing, below " + std::to_string(kBuckets) +
              ", with nonzero counts";
      return std::nullopt;
    }
    first = false;
    last_index = static_cast<unsigned>(index);
    h.add_to_bucket(last_index, n);
    if (bucket_total + n < bucket_total) {
      error = "histogram: bucket counts overflow";
      return std::nullopt;
    }
    bucket_total += n;
  }
  std::uint64_t prom_total = 0;
  for (std::size_t i = 0; i < kPromBuckets; ++i) {
    if (!is_count((*prom)[i])) {
      error = "histogram: prom counts must be unsigned integers";
      return std::nullopt;
    }
    h.prom_[i] = (*prom)[i].get<std::uint64_t>();
    prom_total += h.prom_[i];
  }
  if (bucket_total != count || prom_total != count) {
    error = "histogram: bucket counts do not add up to count";
    return std::nullopt;
  }
  if (count > 0 && (min > max || bucket_index(min) > bucket_index(max))) {
    error = "histogram: min_ns > max_ns";
    return std::nullopt;
  }
  if (count == 0 && (sum != 0 || min != 0 || max != 0)) {
    error = "histogram: an empty histogram has nonzero sum/min/max";
    return std::nullopt;
  }
  h.count_ = count;
  h.sum_ = sum;
  h.min_ = count ? min : std::numeric_limits<std::uint64_t>::max();
  h.max_ = max;
  return h;
}

}  // namespace steptrace::daemon
