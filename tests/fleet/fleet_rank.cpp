// One simulated rank of a distributed training job, for scripts/fleet.sh: a real process
// using libsteptrace the way a trainer does. Its job id and rank come from its
// environment (STEPTRACE_JOB, RANK, WORLD_SIZE: the library reads them at load and sends
// them in its Identity frame), its daemon from STEPTRACE_SOCKET.
//
//   steptrace_fleet_rank STEPS SPAN_MS SECONDS [slow]
//
// Each iteration runs STEPS spans one after the other, each SPAN_MS long (a sleep: the
// fleet runs hundreds of ranks on a few cores, so they must not burn CPU): Forward, then
// WaitPoll, then custom steps fleet_step_02 .. up to STEPS. With "slow" this rank is the
// straggler: its Forward takes 2.5 x as long, and at the collective it waits least
// (WaitPoll a tenth as long), the way the others wait for it. Runs SECONDS seconds (0:
// until killed), then flushes and exits 0.
#include <steptrace/steptrace.h>
#include <steptrace/steptrace.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr double kSlowCompute = 2.5;
constexpr double kSlowWait = 0.1;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5 || (argc == 5 && std::strcmp(argv[4], "slow") != 0)) {
    std::fprintf(stderr, "usage: %s STEPS SPAN_MS SECONDS [slow]\n", argv[0]);
    return 2;
  }
  const int steps = std::atoi(argv[1]);
  const double span_ms = std::atof(argv[2]);
  const int seconds = std::atoi(argv[3]);
  const bool slow = argc == 5;
  if (steps < 2 || steps > 200 || span_ms <= 0 || seconds < 0) {
    std::fprintf(stderr, "fleet_rank: STEPS 2..200, SPAN_MS > 0, SECONDS >= 0\n");
    return 2;
  }
  std::vector<std::uint32_t> ids = {steptrace::step_id(steptrace::Step::kForward),
                                    steptrace::step_id(steptrace::Step::kWaitPoll)};
  for (int s = 2; s < steps; ++s) {
    char name[32];
    std::snprintf(name, sizeof name, "fleet_step_%02d", s);
    const std::uint32_t id = steptrace_register_step(name);
    if (id == UINT32_MAX) {
      std::fprintf(stderr, "fleet_rank: cannot register %s\n", name);
      return 2;
    }
    ids.push_back(id);
  }
  const auto span_of = [&](std::size_t i) {
    double ms = span_ms;
    if (slow && i == 0) ms *= kSlowCompute;
    if (slow && i == 1) ms *= kSlowWait;
    return std::chrono::duration<double, std::milli>(ms);
  };
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (seconds == 0 || std::chrono::steady_clock::now() < end) {
    for (std::size_t i = 0; i < ids.size(); ++i) {
      steptrace::Span span(ids[i]);
      std::this_thread::sleep_for(span_of(i));
    }
  }
  return steptrace_flush(5000) == 0 ? 0 : 1;
}
