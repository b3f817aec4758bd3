// The one style for durations, byte sizes, shares and ages in every text output: the
// daemon's `report`, `ledger` and `stats`, and the CLI's own screens (`top`). Shared by
// the daemon and the CLI (which may include proto/ only), so a number reads the same
// wherever it is printed.
//
//   duration  the reference tracer's `{:.2?}` on a Duration: "850.00ns", "12.34µs",
//             "1.50ms", "3.00s", "185.00s" (two decimals, rounded half up)
//   bytes     "512 B", "1.50 KiB", "7.25 GiB" (binary units, two decimals)
//   percent   the reference's `{:>7.2}%`: "  83.33%"
//   age       how long ago, or how long a lease lasts: "4.20s", "3m 07s", "2h 05m", "3d 04h"
#pragma once

#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <string>
#include <string_view>

namespace steptrace::units {

namespace detail {
// "<integer>.<2 digits><unit>" for value / divisor, rounded half up like Rust's Duration
// Debug formatting (no overflow for divisors up to 1e9).
inline std::string fixed2(std::uint64_t value, std::uint64_t divisor, std::string_view unit) {
  std::uint64_t whole = value / divisor;
  std::uint64_t hundredths = (value % divisor * 100 + divisor / 2) / divisor;
  if (hundredths >= 100) {
    ++whole;
    hundredths -= 100;
  }
  char buf[48];
  std::snprintf(buf, sizeof buf, "%" PRIu64 ".%02" PRIu64, whole, hundredths);
  return std::string(buf) + std::string(unit);
}
}  // namespace detail

inline std::string duration(std::uint64_t ns) {
  if (ns >= 1'000'000'000) return detail::fixed2(ns, 1'000'000'000, "s");
  if (ns >= 1'000'000) return detail::fixed2(ns, 1'000'000, "ms");
  if (ns >= 1'000) return detail::fixed2(ns, 1'000, "µs");
  return detail::fixed2(ns, 1, "ns");
}

inline std::string bytes(std::uint64_t n) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  if (n < 1024) return std::to_string(n) + " B";
  double value = static_cast<double>(n) / 1024.0;
  std::size_t unit = 0;
  // 1023.995 would print as "1024.00": the next unit's "1.00" instead.
  while (value >= 1023.995 && unit + 1 < std::size(kUnits)) {
    value /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", value, kUnits[unit]);
  return buf;
}

inline std::string percent(double share) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%7.2f%%", share);
  return buf;
}

inline std::string age(std::uint64_t ns) {
  // From 59.995 s "%.2f" would print "60.00s": "1m 00s" instead.
  constexpr std::uint64_t kMinute = 60'000'000'000, kRoundsToAMinute = 59'995'000'000;
  const std::uint64_t s = std::max(ns, kMinute) / 1'000'000'000;
  char buf[64];
  if (ns < kRoundsToAMinute) {
    std::snprintf(buf, sizeof buf, "%.2fs", static_cast<double>(ns) / 1e9);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "m %02" PRIu64 "s", s / 60, s % 60);
  } else if (s < 86400) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "h %02" PRIu64 "m", s / 3600, s % 3600 / 60);
  } else {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "d %02" PRIu64 "h", s / 86400, s % 86400 / 3600);
  }
  return buf;
}

}  // namespace steptrace::units
