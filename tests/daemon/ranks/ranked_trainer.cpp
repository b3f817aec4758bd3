// A rank of a synthetic data-parallel job for rank_skew_integration_test: its identity
// (job, rank) comes from STEPTRACE_JOB / RANK / WORLD_SIZE, read by the library at load.
// Each iteration: Forward for FORWARD_MS, then WaitPoll for WAIT_MS (what a rank waits at
// the collective for the slowest), until the file RELEASE exists (exit 0) or 120 s passed
// (exit 3).
// Usage: ranked_trainer SOCKET FORWARD_MS WAIT_MS RELEASE
#include <steptrace/steptrace.h>
#include <unistd.h>

#include <steptrace/steptrace.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: %s SOCKET FORWARD_MS WAIT_MS RELEASE\n", argv[0]);
    return 2;
  }
  const std::chrono::milliseconds forward(std::atoi(argv[2]));
  const std::chrono::milliseconds wait(std::atoi(argv[3]));
  const std::string release = argv[4];
  if (steptrace_connect(argv[1]) != 0) return 1;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  for (int i = 0; ::access(release.c_str(), F_OK) != 0; ++i) {
    if (std::chrono::steady_clock::now() > deadline) return 3;
    {
      steptrace::Span span(steptrace::Step::kForward);
      std::this_thread::sleep_for(forward);
    }
    {
      steptrace::Span span(steptrace::Step::kWaitPoll);
      std::this_thread::sleep_for(wait);
    }
    if (i % 10 == 9) steptrace_flush(10000);
  }
  return steptrace_flush(10000) == 0 ? 0 : 1;
}
