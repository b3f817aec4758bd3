// The count file of step_limit_trainer (step_limit_trainer.cpp), read back by
// client_step_limit_test (step_limit_test.cpp) after the trainer was SIGKILLed: what it
// recorded, kept where a kill cannot take it.
//
// The trainer maps the file MAP_SHARED: its stores land in the page cache, which
// outlives the process, so the test reads them after the kill with an ordinary read.
// Around every steptrace_start / steptrace_end a thread adds 1 to its `begun` before the
// call and to its `done` after it, so what the thread recorded is at least `done` and at
// most `begun` (begun - done <= 1: a kill inside the call).
#pragma once

#include <cstdint>

namespace steptrace::testing {

inline constexpr std::uint64_t kStepLimitMagic = 0x7374'6570'6c69'6d31;  // "steplim1"
inline constexpr int kStepLimitMaxThreads = 16;

struct StepLimitThreadCounts {
  std::int64_t begun = 0;  // steptrace_start/end calls entered
  std::int64_t done = 0;   // ... and returned
};

struct StepLimitCounts {
  std::uint64_t magic = 0;      // kStepLimitMagic once the header is written
  std::int64_t pid = 0;         // the trainer's
  std::int64_t threads = 0;     // recording threads
  std::int64_t registered = 0;  // custom steps registered with the library so far
  std::int64_t flush_rc = 1;    // the last steptrace_flush's result (1: none yet)
  StepLimitThreadCounts thread[kStepLimitMaxThreads];
};

}  // namespace steptrace::testing
