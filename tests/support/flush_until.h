// A trainer's flush, retried: steptrace_flush(each_ms) until it returns 0 or `total_ms`
// have passed (on a loaded machine, or while the daemon is between two lives, one flush
// may time out or fail at once). The last flush's result.
#pragma once

#include <chrono>
#include <thread>

#include <steptrace/steptrace.h>

namespace steptrace::testing {

inline int flush_until(int total_ms, int each_ms = 10000) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(total_ms);
  int rc = steptrace_flush(each_ms);
  while (rc != 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    rc = steptrace_flush(each_ms);
  }
  return rc;
}

}  // namespace steptrace::testing
