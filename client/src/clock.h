// libsteptrace's clock: what the hot path reads, and how the flusher turns it into the
// CLOCK_MONOTONIC nanoseconds the wire carries (the daemon compares them with its own
// CLOCK_MONOTONIC, and ledger annotations are stamped with CLOCK_MONOTONIC directly).
//
// Source: the TSC (rdtsc, ~11 ns) when the CPU says it is invariant (cpuid 0x80000007
// EDX bit 8) and the kernel's clocksource is TSC-based ("tsc", or a VM's "kvm-clock" /
// "hyperv_clocksource_tsc_page", which scale the host's invariant TSC; when that file
// cannot be read, cpuid alone decides); otherwise clock_gettime(CLOCK_MONOTONIC) (vDSO,
// ~27 ns). Either way the flusher re-anchors against CLOCK_MONOTONIC, so rate drift
// (a VM migrated to another host) is corrected within one anchor period.
// STEPTRACE_CLOCK=monotonic forces the fallback, STEPTRACE_CLOCK=tsc forces the TSC
// when it is invariant. The choice is made once, at library load, before any event.
//
// Conversion (flusher thread only, TickConverter): ns = anchor_ns + (ticks -
// anchor_ticks) * ns_per_tick, with ns_per_tick measured against CLOCK_MONOTONIC over
// an ever longer baseline (from the first sample to the latest anchor) and the anchor
// moved forward periodically, so the error stays far below a microsecond.
#pragma once

#include <time.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "proto/wire_format.h"

#if defined(__x86_64__) || defined(__i386__)
#include <x86intrin.h>
#define STEPTRACE_HAVE_TSC 1
#else
#define STEPTRACE_HAVE_TSC 0
#endif

namespace steptrace::client {

enum class ClockSource { kTsc, kMonotonic };

// 128-bit arithmetic keeps tick-to-ns conversion exact over any realistic span.
__extension__ typedef __int128 Int128;
__extension__ typedef unsigned __int128 UInt128;

inline std::uint64_t monotonic_ns() noexcept {
  timespec ts;
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000u +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

inline std::uint64_t tsc_ticks() noexcept {
#if STEPTRACE_HAVE_TSC
  return __rdtsc();
#else
  return monotonic_ns();
#endif
}

// cpuid 0x80000007 EDX bit 8.
bool cpu_has_invariant_tsc() noexcept;
// The kernel's current clocksource, nullopt when the file cannot be read.
std::optional<std::string> current_clocksource();
// The decision itself, pure so tests can drive it. `env` is $STEPTRACE_CLOCK or null.
ClockSource choose_clock_source(const char* env, bool invariant_tsc,
                                const std::optional<std::string>& clocksource);

// A simultaneous reading of both clocks.
struct ClockSample {
  std::uint64_t ticks = 0;
  std::uint64_t ns = 0;
};
// The TSC read just before and after CLOCK_MONOTONIC, best (narrowest) of a few tries.
ClockSample take_clock_sample() noexcept;

class TickConverter {
 public:
  // Anchoring needs this much baseline before the rate is trusted.
  static constexpr std::uint64_t kMinBaselineNs = 10'000'000;

  // Starts calibration at `first`.
  void start(const ClockSample& first) noexcept {
    base_ = first;
    anchor_ = first;
    scale_ = 0;
  }
  // Refines the rate from the baseline base..now and re-anchors at `now`. Returns
  // whether the converter is ready (enough baseline).
  bool anchor(const ClockSample& now) noexcept;
  bool ready() const noexcept { return scale_ != 0; }
  // CLOCK_MONOTONIC ns of `ticks` (before or after the anchor). Requires ready().
  std::uint64_t to_ns(std::uint64_t ticks) const noexcept {
    const Int128 delta = static_cast<std::int64_t>(ticks - anchor_.ticks);
    const Int128 ns = static_cast<Int128>(anchor_.ns) + ((delta * scale_) >> kShift);
    return ns < 0 ? 0 : static_cast<std::uint64_t>(ns);
  }
  // The conversion as the daemon applies it to ring records (proto::ticks_to_ns gives
  // the same result as to_ns). Requires ready().
  proto::ClockSync sync() const noexcept { return {anchor_.ticks, anchor_.ns, scale_}; }
  // Nanoseconds per tick, for diagnostics and tests.
  double ns_per_tick() const noexcept {
    return static_cast<double>(scale_) / static_cast<double>(std::uint64_t{1} << kShift);
  }

 private:
  static constexpr int kShift = 32;
  ClockSample base_;
  ClockSample anchor_;
  std::uint64_t scale_ = 0;  // ns per tick, fixed point with kShift fraction bits
};

}  // namespace steptrace::client
