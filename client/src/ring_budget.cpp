#include "client/src/ring_budget.h"

#include <bit>
#include <cstdio>

namespace steptrace::client {

std::optional<std::uint64_t> parse_byte_size(std::string_view text) {
  std::size_t i = 0;
  std::uint64_t value = 0;
  for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
    const std::uint64_t digit = static_cast<std::uint64_t>(text[i] - '0');
    if (value > (UINT64_MAX - digit) / 10) return std::nullopt;
    value = value * 10 + digit;
  }
  if (i == 0) return std::nullopt;
  std::string_view suffix = text.substr(i);
  int shift = 0;
  if (!suffix.empty()) {
    switch (suffix.front()) {
      case 'k':
      case 'K':
        shift = 10;
        break;
      case 'm':
      case 'M':
        shift = 20;
        break;
      case 'g':
      case 'G':
        shift = 30;
        break;
      default:
        break;
    }
    if (shift != 0) suffix.remove_prefix(1);
    if (!(suffix.empty() || (shift != 0 && (suffix == "iB" || suffix == "B")) ||
          (shift == 0 && suffix == "B"))) {
      return std::nullopt;
    }
  }
  if (shift != 0 && value > (UINT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

namespace {

std::uint64_t size_from_env(const char* name, const char* value, std::uint64_t fallback,
                            bool (*valid)(std::uint64_t), const char* range) {
  if (value == nullptr || value[0] == '\0') return fallback;  // unset or empty
  const auto parsed = parse_byte_size(value);
  if (parsed && valid(*parsed)) return *parsed;
  std::fprintf(stderr,
               "steptrace: ignoring %s=%s (expected bytes in %s, optionally with a K, M or G "
               "suffix); using %llu\n",
               name, value, range, static_cast<unsigned long long>(fallback));
  return fallback;
}

bool valid_ring(std::uint64_t bytes) { return valid_ring_bytes(bytes); }
bool valid_total(std::uint64_t bytes) { return valid_total_ring_bytes(bytes); }

}  // namespace

BufferSizes buffer_sizes_from_env(const char* per_thread_env, const char* total_env) {
  BufferSizes sizes;
  sizes.per_thread = std::bit_floor(size_from_env("STEPTRACE_BUFFER_BYTES", per_thread_env,
                                                  kDefaultRingBytes, valid_ring, "64K..1G"));
  sizes.total = size_from_env("STEPTRACE_BUFFER_TOTAL_BYTES", total_env, kDefaultTotalRingBytes,
                              valid_total, "64K..1024G");
  return sizes;
}

}  // namespace steptrace::client
