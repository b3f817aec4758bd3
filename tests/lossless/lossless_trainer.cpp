// Client processes for lossless_integration_test, their behaviour chosen by argv:
//
//   lossless_trainer burst SOCKET OUTFILE THREADS BURSTS BURST_SPANS INTERVAL_US
//       Default mode (never blocking). Each of THREADS threads records BURSTS bursts of
//       BURST_SPANS Transpose spans back to back, burst k starting at k x INTERVAL_US
//       after a common start; then steptrace_flush. Writes "key value" lines to OUTFILE:
//       pid, recorded_events, connect_rc, flush_rc, dropped (steptrace_dropped()) and,
//       from steptrace_dropped_by_cause, dropped_buffer_full,
//       dropped_not_connected, dropped_in_flight, dropped_invalid. Exit 0 once OUTFILE is
//       written (drops and flush results are the test's to judge).
//   lossless_trainer fill SOCKET OUTFILE STEPS
//       Registers STEPS custom steps, records one span of each, flushes, disconnects
//       (steptrace_shutdown) and writes "rc N" (0: all acknowledged, nothing dropped) to
//       OUTFILE, then sleeps until SIGTERM, its parent's exit or 10 minutes: a process
//       that still runs stays "alive" in the daemon, and only live processes have
//       per-process series in `metrics`, so both renders cover its steps.
//   lossless_trainer reader SOCKET OUTFILE STOPFILE
//       `report --json`, then `metrics`, in a loop until STOPFILE exists. After each
//       render it rewrites OUTFILE: renders, reports, metrics, bad (replies that were not
//       whole), max_ms. Exit 0.
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/fill_steps.h"
#include "tests/support/flush_until.h"

namespace {

using steptrace::testing::flush_until;

using Clock = std::chrono::steady_clock;
using Values = std::map<std::string, long long>;

constexpr const char* kCauseNames[] = {"buffer_full", "not_connected", "in_flight", "invalid"};

void write_values(const std::string& path, const Values& values) {
  {
    std::ofstream out(path + ".tmp");
    for (const auto& [key, value] : values) out << key << ' ' << value << '\n';
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// steptrace_dropped_by_cause for each cause (kCauseNames is in the C enum's order).
void add_drops_by_cause(Values& out) {
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) {
    out[std::string("dropped_") + kCauseNames[c]] =
        static_cast<long long>(steptrace_dropped_by_cause(c));
  }
}

int burst(const std::string& socket, const std::string& outfile, int threads, int bursts,
          int burst_spans, long long interval_us) {
  Values out;
  out["pid"] = ::getpid();
  steptrace_set_block_when_full(0);  // the default mode, whatever the environment says
  out["connect_rc"] = steptrace_connect(socket.c_str());
  const auto t0 = Clock::now() + std::chrono::milliseconds(5);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (int b = 0; b < bursts; ++b) {
        std::this_thread::sleep_until(t0 + std::chrono::microseconds(interval_us * b));
        for (int i = 0; i < burst_spans; ++i) {
          steptrace_start(STEPTRACE_TRANSPOSE);
          steptrace_end(STEPTRACE_TRANSPOSE);
        }
      }
    });
  }
  for (auto& t : pool) t.join();
  out["record_ms"] =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
  out["flush_rc"] = flush_until(60000);
  out["recorded_events"] = 2LL * threads * bursts * burst_spans;
  out["dropped"] = static_cast<long long>(steptrace_dropped());
  add_drops_by_cause(out);
  write_values(outfile, out);
  return 0;
}

int fill(const std::string& socket, const std::string& outfile, int steps) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 7;  // the test is gone already
  int rc = steptrace_connect(socket.c_str()) == 0 ? 0 : 3;
  if (rc == 0) rc = steptrace::testing::record_fill_steps(steps);
  if (rc == 0 && flush_until(60000) != 0) rc = 5;
  if (rc == 0 && steptrace_dropped() != 0) rc = 6;
  steptrace_shutdown();
  write_values(outfile, {{"rc", rc}, {"pid", ::getpid()}});
  if (rc == 0) ::sleep(600);
  return rc;
}

int reader(const std::string& socket, const std::string& outfile, const std::string& stopfile) {
  Values out{{"renders", 0}, {"reports", 0}, {"metrics", 0}, {"bad", 0}, {"max_ms", 0}};
  for (long long i = 0; !file_exists(stopfile); ++i) {
    const bool json = i % 2 == 0;
    const auto t0 = Clock::now();
    const auto reply =
        steptrace::testing::command(socket, json ? "report --json" : "metrics", 120000);
    const long long ms =
        std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
    const bool ok = reply && !reply->empty() && reply->back() == '\n' &&
                    (json ? reply->front() == '{' : reply->find("# TYPE") != std::string::npos);
    ++out["renders"];
    ++out[json ? "reports" : "metrics"];
    if (!ok) ++out["bad"];
    out["max_ms"] = std::max(out["max_ms"], ms);
    write_values(outfile, out);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  auto num = [&](int i) { return std::atoll(argv[i]); };
  if (mode == "burst" && argc == 8) {
    return burst(argv[2], argv[3], static_cast<int>(num(4)), static_cast<int>(num(5)),
                 static_cast<int>(num(6)), num(7));
  }
  if (mode == "fill" && argc == 5) return fill(argv[2], argv[3], static_cast<int>(num(4)));
  if (mode == "reader" && argc == 5) return reader(argv[2], argv[3], argv[4]);
  std::fprintf(stderr,
               "usage: %s burst SOCKET OUTFILE THREADS BURSTS BURST_SPANS INTERVAL_US\n"
               "       %s fill SOCKET OUTFILE STEPS\n"
               "       %s reader SOCKET OUTFILE STOPFILE\n",
               argv[0], argv[0], argv[0]);
  return 64;
}
