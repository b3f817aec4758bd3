// A trainer that outlives its daemon, for durability_test (tests/durability): a real
// process using libsteptrace (shared, default mode: never blocking, per-thread rings in
// shared memory) that keeps recording while the test stops and restarts steptraced
// under it, and says exactly what it recorded.
//
//   steptrace_durable_trainer SOCKET OUTFILE STOPFILE [THREADS] [SPANS] [BURSTS_PER_S]
//                             [CUSTOM_STEPS]
//
// 1. steptrace_connect(SOCKET): its result is written, not judged (the daemon may be
//    between two lives; the library reconnects by itself).
// 2. CUSTOM_STEPS (default 0) custom steps registered and one span of each recorded
//    (tests/support/fill_steps.h): they make the daemon's snapshot larger, so that a
//    kill lands in the middle of writing it more often.
// 3. THREADS (default 2) threads record bursts of SPANS (default 500) spans, Forward and
//    Backward alternately, BURSTS_PER_S (default 100) bursts a second each, until the
//    file STOPFILE exists. 2 x 500 x 100 = 100,000 spans, 200,000 events a second; one
//    thread's 4 MiB ring (262,144 records) holds 2.6 s of its 100,000 events a second:
//    enough for one restart (the daemon away for tens of ms, the library's reconnection
//    backoff at most 1 s), not for a series of quick ones (see durability_test.cpp). A
//    thread that fell behind (a loaded machine) does not catch up in one giant burst: it
//    starts again from now.
// 4. steptrace_flush, retried for up to 30 s (it fails at once while no daemon answers).
// 5. Writes "key value" lines to OUTFILE (OUTFILE.tmp, then a rename): pid,
//    recorded_events (2 per span it recorded, custom ones included: exact), record_ms,
//    connect_rc, flush_rc, flush_ms, dropped (steptrace_dropped()), dropped_CAUSE for
//    each cause of steptrace_dropped_by_cause, rejected. Exit 0 (the test judges).
//
// Exit 4 when a custom step could not be registered, 7 when the test that started it is
// gone, 64 on bad arguments. The process dies with its parent (PR_SET_PDEATHSIG).
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/fill_steps.h"
#include "tests/support/flush_until.h"

namespace {

using steptrace::testing::flush_until;

using Clock = std::chrono::steady_clock;
using Values = std::map<std::string, long long>;

// steptrace_dropped_by_cause's causes, in the C enum's order.
constexpr const char* kCauseNames[] = {"buffer_full", "not_connected", "in_flight", "invalid"};
static_assert(std::size(kCauseNames) == STEPTRACE_DROP_CAUSE_COUNT,
              "a new drop cause needs its name here (and in durability_test.cpp)");

struct Options {
  std::string socket;
  std::string outfile;
  std::string stopfile;
  int threads = 2;
  int spans = 500;
  int bursts_per_s = 100;
  int custom_steps = 0;
};

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void write_values(const std::string& path, const Values& values) {
  {
    std::ofstream out(path + ".tmp");
    for (const auto& [key, value] : values) out << key << ' ' << value << '\n';
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

long long ms_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// One recording thread: bursts of `spans` spans on the schedule until `stop`; returns
// the spans it recorded.
long long record(const Options& o, const std::atomic<bool>& stop) {
  const auto interval = std::chrono::microseconds(1'000'000 / o.bursts_per_s);
  long long spans = 0;
  auto next = Clock::now();
  while (!stop.load(std::memory_order_relaxed)) {
    for (int i = 0; i < o.spans; ++i) {
      const std::uint32_t step = i % 2 == 0 ? STEPTRACE_FORWARD : STEPTRACE_BACKWARD;
      steptrace_start(step);
      steptrace_end(step);
    }
    spans += o.spans;
    next += interval;
    const auto now = Clock::now();
    if (next < now - interval) next = now;  // fell behind: no catching up in one burst
    std::this_thread::sleep_until(next);
  }
  return spans;
}

int run(const Options& o) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 7;    // the test is gone already
  steptrace_set_block_when_full(0);  // the default mode, whatever the environment says
  Values out{{"pid", ::getpid()}};
  out["connect_rc"] = steptrace_connect(o.socket.c_str());
  if (steptrace::testing::record_fill_steps(o.custom_steps) != 0) return 4;
  const auto t0 = Clock::now();
  std::atomic<bool> stop{false};
  std::vector<long long> spans(static_cast<std::size_t>(o.threads), 0);
  std::vector<std::thread> pool;
  for (std::size_t t = 0; t < spans.size(); ++t) {
    pool.emplace_back([&o, &stop, &spans, t] { spans[t] = record(o, stop); });
  }
  while (!file_exists(o.stopfile)) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  stop.store(true, std::memory_order_relaxed);
  for (auto& t : pool) t.join();
  out["record_ms"] = ms_since(t0);
  long long recorded = 2LL * o.custom_steps;
  for (const long long s : spans) recorded += 2 * s;
  out["recorded_events"] = recorded;
  const auto flush_t0 = Clock::now();
  out["flush_rc"] = flush_until(30000, 5000);
  out["flush_ms"] = ms_since(flush_t0);
  out["dropped"] = static_cast<long long>(steptrace_dropped());
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) {
    out[std::string("dropped_") + kCauseNames[c]] =
        static_cast<long long>(steptrace_dropped_by_cause(c));
  }
  out["rejected"] = static_cast<long long>(steptrace_rejected());
  write_values(o.outfile, out);
  return 0;
}

// A positive int in argv[i], or `fallback` when there is no such argument; -1 when bad.
int positive_arg(int argc, char** argv, int i, int fallback, int min) {
  if (i >= argc) return fallback;
  char* end = nullptr;
  const long v = std::strtol(argv[i], &end, 10);
  if (end == argv[i] || *end != '\0' || v < min || v > 1'000'000) return -1;
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (argc >= 4 && argc <= 8) {
    o.socket = argv[1];
    o.outfile = argv[2];
    o.stopfile = argv[3];
    o.threads = positive_arg(argc, argv, 4, o.threads, 1);
    o.spans = positive_arg(argc, argv, 5, o.spans, 1);
    o.bursts_per_s = positive_arg(argc, argv, 6, o.bursts_per_s, 1);
    o.custom_steps = positive_arg(argc, argv, 7, o.custom_steps, 0);
  }
  if (argc < 4 || argc > 8 || o.threads < 0 || o.spans < 0 || o.bursts_per_s < 0 ||
      o.custom_steps < 0) {
    std::fprintf(stderr,
                 "usage: %s SOCKET OUTFILE STOPFILE [THREADS] [SPANS] [BURSTS_PER_S] "
                 "[CUSTOM_STEPS]\n",
                 argv[0]);
    return 64;
  }
  return run(o);
}
