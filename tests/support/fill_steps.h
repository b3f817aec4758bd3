// Test and bench support: makes a process add keys to the daemon's table, the way the
// large-table tests (tests/lossless) and bench/burst_bench build their 20,000- and
// 100,000-key tables. Needs libsteptrace.
#pragma once

#include <cstdint>
#include <cstdio>

#include <steptrace/steptrace.h>

namespace steptrace::testing {

// Registers `steps` custom steps named Fill0000, Fill0001, ... and records one span of
// each. 0, or 4 when a registration failed (the process's custom-step limit).
inline int record_fill_steps(int steps) {
  for (int s = 0; s < steps; ++s) {
    char name[32];
    std::snprintf(name, sizeof name, "Fill%04d", s);
    const std::uint32_t id = steptrace_register_step(name);
    if (id == UINT32_MAX) return 4;
    steptrace_start(id);
    steptrace_end(id);
  }
  return 0;
}

}  // namespace steptrace::testing
