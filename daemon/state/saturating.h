// The one addition every total the daemon keeps goes through. Its inputs come from
// clients (durations, drop counts, counts restored from a snapshot), any of which a
// hostile or broken one can set near 2^64: a wrapping `+=` would make a total smaller
// than its parts (one tenant's spans setting everyone's % Time) and a Prometheus counter
// go down. Saturated, a total stays at 2^64-1 (584 years of ns) and never goes back.
#pragma once

#include <cstdint>
#include <limits>

namespace steptrace::daemon {

// a + b, or 2^64-1 when that does not fit.
constexpr std::uint64_t saturating_add(std::uint64_t a, std::uint64_t b) {
  std::uint64_t sum = 0;
  return __builtin_add_overflow(a, b, &sum) ? std::numeric_limits<std::uint64_t>::max() : sum;
}

}  // namespace steptrace::daemon
