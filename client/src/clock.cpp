#include "client/src/clock.h"

#include <fstream>

#if STEPTRACE_HAVE_TSC
#include <cpuid.h>
#endif

namespace steptrace::client {

bool cpu_has_invariant_tsc() noexcept {
#if STEPTRACE_HAVE_TSC
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (static_cast<unsigned>(__get_cpuid_max(0x80000000u, nullptr)) < 0x80000007u) return false;
  if (!__get_cpuid(0x80000007u, &eax, &ebx, &ecx, &edx)) return false;
  return (edx & (1u << 8)) != 0;
#else
  return false;
#endif
}

std::optional<std::string> current_clocksource() {
  std::ifstream in("/sys/devices/system/clocksource/clocksource0/current_clocksource");
  std::string name;
  if (!in || !(in >> name)) return std::nullopt;
  return name;
}

ClockSource choose_clock_source(const char* env, bool invariant_tsc,
                                const std::optional<std::string>& clocksource) {
  const std::string_view forced = env ? env : "";
  if (forced == "monotonic" || !invariant_tsc || !STEPTRACE_HAVE_TSC) {
    return ClockSource::kMonotonic;
  }
  if (forced == "tsc") return ClockSource::kTsc;
  if (!clocksource) return ClockSource::kTsc;
  // The kernel's own TSC-based clocksources: bare metal ("tsc") and the paravirtual
  // clocks of KVM and Hyper-V guests, which scale the host's invariant TSC. Any other
  // (hpet, acpi_pm, ...) means the kernel distrusted the TSC, and so do we.
  for (std::string_view ok : {"tsc", "kvm-clock", "hyperv_clocksource_tsc_page"}) {
    if (*clocksource == ok) return ClockSource::kTsc;
  }
  return ClockSource::kMonotonic;
}

ClockSample take_clock_sample() noexcept {
  ClockSample best;
  std::uint64_t best_window = UINT64_MAX;
  for (int i = 0; i < 5; ++i) {
    const std::uint64_t t0 = tsc_ticks();
    const std::uint64_t ns = monotonic_ns();
    const std::uint64_t t1 = tsc_ticks();
    if (t1 - t0 < best_window) {
      best_window = t1 - t0;
      best = {t0 + (t1 - t0) / 2, ns};
    }
  }
  return best;
}

bool TickConverter::anchor(const ClockSample& now) noexcept {
  if (now.ns <= base_.ns || now.ticks <= base_.ticks) return ready();
  const std::uint64_t baseline_ns = now.ns - base_.ns;
  if (baseline_ns < kMinBaselineNs) return ready();
  const UInt128 scaled = static_cast<UInt128>(baseline_ns) << kShift;
  scale_ = static_cast<std::uint64_t>(scaled / (now.ticks - base_.ticks));
  anchor_ = now;
  return true;
}

}  // namespace steptrace::client
