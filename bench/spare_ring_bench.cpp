// Spare rings (protocol version 8): what they buy a new thread's first event, and the
// memory they cost.
//
// First event (Google Benchmark, manual time): each iteration starts one thread whose
// first call is steptrace_start(Forward); the iteration's time is that call, from the
// thread's entry to its return (the thread's ring is made or taken inside it). Between
// iterations (not timed) the previous thread is joined and, when connected, a 20 ms
// pause and a steptrace_flush let the flusher make the next spare and the daemon map it:
// threads that start one at a time, the case spares are for. Two variants, in this order
// in one process:
//   first_event/not_connected  no connection and no flusher (the benchmark runs itself
//                              again with STEPTRACE_AUTOCONNECT=0): the thread makes its
//                              own ring, as every new thread did before version 8 and as
//                              one does when a burst of new threads used up the spares (a
//                              memfd, or with STEPTRACE_SHM_RINGS=0 anonymous memory)
//   first_event/connected      connected to the real steptraced: the thread takes a
//                              spare the daemon maps already (with STEPTRACE_SHM_RINGS=0
//                              there are none: it makes its own anonymous ring)
// The ring budget's total is raised to 1 GiB so that no first event frees an exited
// thread's ring to make room. Not connected, only the newest 64 exited threads' rings
// keep their events: the older ones' are counted as dropped (not_connected), as designed.
// Counters per repetition: p50_us, p90_us, max_us of its iterations. A thread took a
// spare when a memfd ring mapped before it started has a page more resident after its
// first event (the spare's first slot page), read from /proc/self/smaps, not timed.
//
// Memory: a child forked before the library is used connects, flushes (the answer comes
// once every ring offered was mapped) and waits until the daemon maps 2 rings: the
// spares, no thread having recorded. Then the `memfd:steptrace-ring` mappings of its
// /proc/self/smaps and of the daemon's: Size (mapped), Rss and Pss (resident; a page both
// map counts half to each in Pss), in KiB.
//
//   spare_ring_bench [Google Benchmark flags]   (default --benchmark_repetitions=5)
//
// Exit status 1 when the daemon does not start or the library cannot connect.
#include <steptrace/steptrace.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench/bench_support.h"
#include "bench/median_reporter.h"
#include "tests/support/daemon_process.h"

namespace {

using steptrace::bench::Figure;
using steptrace::bench::MedianReporter;
using steptrace::bench::monotonic_ns;

constexpr int kIterations = 100;  // threads per repetition
constexpr auto kGap = std::chrono::milliseconds(20);
constexpr std::uint64_t kTotalRingBytes = std::uint64_t{1} << 30;

std::string g_socket;
bool g_connected = false;
int g_connect_failures = 0;

// ---- memory ----------------------------------------------------------------------------

struct Mappings {
  int count = 0;
  std::uint64_t size_kib = 0;
  std::uint64_t rss_kib = 0;
  std::uint64_t pss_kib = 0;
  std::map<std::string, std::uint64_t> rss_by_start;  // KiB, by the mapping's address
};

// Whether a ring mapped at `before` got a page more resident by `after`: a thread's first
// event took a spare (its first slot page) rather than making a ring of its own.
bool a_spare_was_taken(const Mappings& before, const Mappings& after) {
  return std::any_of(before.rss_by_start.begin(), before.rss_by_start.end(), [&](const auto& m) {
    const auto it = after.rss_by_start.find(m.first);
    return it != after.rss_by_start.end() && it->second > m.second;
  });
}

// The mappings of memfds named steptrace-ring in /proc/PID/smaps (pid 0: this process).
Mappings ring_mappings(pid_t pid) {
  const std::string path =
      pid == 0 ? std::string("/proc/self/smaps") : "/proc/" + std::to_string(pid) + "/smaps";
  std::ifstream in(path);
  Mappings m;
  bool ours = false;
  std::string start;
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    const bool field = colon != std::string::npos && colon > 0 &&
                       line.find(' ') > colon;  // "Rss:   4 kB"; a mapping's line has none
    if (!field) {
      ours = line.find("memfd:steptrace-ring") != std::string::npos;
      if (ours) ++m.count;
      start = line.substr(0, line.find('-'));
      continue;
    }
    if (!ours) continue;
    std::istringstream value(line.substr(colon + 1));
    std::uint64_t kib = 0;
    value >> kib;
    const std::string name = line.substr(0, colon);
    if (name == "Size") m.size_kib += kib;
    if (name == "Rss") {
      m.rss_kib += kib;
      m.rss_by_start[start] = kib;
    }
    if (name == "Pss") m.pss_kib += kib;
  }
  return m;
}

long long rings_mapped(const std::string& socket) {
  const auto stats = steptrace::bench::daemon_json(socket, "stats --json");
  if (!stats || !stats->contains("shared_rings")) return -1;
  return stats->at("shared_rings").value("mapped", -1LL);
}

// In a child forked before the library is used: "client COUNT SIZE RSS PSS" and the
// same for the daemon, or an empty string when the spares were never mapped.
std::string measure_spares(pid_t daemon_pid) {
  int fds[2];
  if (::pipe(fds) != 0) return "";
  const pid_t child = ::fork();
  if (child < 0) return "";
  if (child == 0) {
    ::close(fds[0]);
    std::string out;
    if (steptrace_connect(g_socket.c_str()) == 0 && steptrace_flush(10000) == 0) {
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (rings_mapped(g_socket) < 2 && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (rings_mapped(g_socket) == 2) {
        const Mappings c = ring_mappings(0);
        const Mappings d = ring_mappings(daemon_pid);
        std::ostringstream s;
        s << c.count << ' ' << c.size_kib << ' ' << c.rss_kib << ' ' << c.pss_kib << ' ' << d.count
          << ' ' << d.size_kib << ' ' << d.rss_kib << ' ' << d.pss_kib;
        out = s.str();
      }
    }
    [[maybe_unused]] const ssize_t n = ::write(fds[1], out.data(), out.size());
    ::_exit(0);  // the spares go with the process; nothing to deliver
  }
  ::close(fds[1]);
  std::string out;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fds[0], buf, sizeof buf)) > 0) out.append(buf, static_cast<std::size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  return out;
}

// ---- first event -----------------------------------------------------------------------

void connect_once(const benchmark::State&) {
  if (g_connected) return;
  g_connected = true;
  if (steptrace_connect(g_socket.c_str()) != 0 || steptrace_flush(10000) != 0) {
    ++g_connect_failures;
  }
}

struct Tally {
  std::uint64_t threads = 0;
  std::uint64_t spares_taken = 0;  // threads whose first event took a spare
  std::uint64_t dropped[STEPTRACE_DROP_CAUSE_COUNT] = {};
};
Tally g_tally[2];  // not_connected, connected

void first_event(benchmark::State& state, int variant) {
  std::vector<double> us;
  us.reserve(kIterations);
  std::uint64_t dropped_before[STEPTRACE_DROP_CAUSE_COUNT];
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) {
    dropped_before[c] = steptrace_dropped_by_cause(static_cast<steptrace_drop_cause>(c));
  }
  int spares_taken = 0;
  for (auto _ : state) {
    std::uint64_t ns = 0;
    const Mappings before = ring_mappings(0);
    Mappings after;
    std::thread([&ns, &after] {
      const std::uint64_t t0 = monotonic_ns();
      steptrace_start(STEPTRACE_FORWARD);
      ns = monotonic_ns() - t0;
      after = ring_mappings(0);
      steptrace_end(STEPTRACE_FORWARD);
    }).join();
    if (a_spare_was_taken(before, after)) ++spares_taken;
    state.SetIterationTime(static_cast<double>(ns) / 1e9);
    us.push_back(static_cast<double>(ns) / 1e3);
    if (g_connected) {
      std::this_thread::sleep_for(kGap);
      steptrace_flush(10000);
    }
  }
  std::sort(us.begin(), us.end());
  state.counters["p50_us"] = us[us.size() / 2];
  state.counters["p90_us"] = us[us.size() * 9 / 10];
  state.counters["max_us"] = us.back();
  Tally& t = g_tally[variant];
  t.threads += us.size();
  t.spares_taken += static_cast<std::uint64_t>(spares_taken);
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) {
    t.dropped[c] +=
        steptrace_dropped_by_cause(static_cast<steptrace_drop_cause>(c)) - dropped_before[c];
  }
}

constexpr const char* kVariants[] = {"first_event/not_connected", "first_event/connected"};

void register_benchmarks() {
  for (int v = 0; v < 2; ++v) {
    auto* b = benchmark::RegisterBenchmark(kVariants[v], first_event, v)
                  ->UseManualTime()
                  ->Iterations(kIterations)
                  ->Unit(benchmark::kMicrosecond);
    if (v == 1) b->Setup(connect_once);
  }
}

void print_summary(const MedianReporter& r, const std::string& spares) {
  const bool shm = std::getenv("STEPTRACE_SHM_RINGS") == nullptr ||
                   std::string(std::getenv("STEPTRACE_SHM_RINGS")) != "0";
  std::printf("\nclient: default mode (never blocks), STEPTRACE_SHM_RINGS=%s: %s\n",
              shm ? "1" : "0",
              shm ? "own rings are memfds; connected, threads take spares"
                  : "own rings are anonymous memory; no spares");
  std::printf("\nfirst event, medians of the repetitions (us):\n");
  std::optional<Figure> f[2];
  for (int v = 0; v < 2; ++v) {
    f[v] = r.median(std::string(kVariants[v]) + "@1");
    if (!f[v]) continue;
    std::printf("  %-26s mean %7.1f  p50 %7.1f  p90 %7.1f  max %7.1f\n", kVariants[v],
                f[v]->real_time, f[v]->counters["p50_us"], f[v]->counters["p90_us"],
                f[v]->counters["max_us"]);
  }
  if (f[0] && f[1] && f[1]->real_time > 0 && f[1]->counters["p50_us"] > 0) {
    std::printf("  not_connected / connected (same run): mean %.2f, p50 %.2f, p90 %.2f\n",
                f[0]->real_time / f[1]->real_time,
                f[0]->counters["p50_us"] / f[1]->counters["p50_us"],
                f[0]->counters["p90_us"] / f[1]->counters["p90_us"]);
  }
  std::printf("\nthreads and their events dropped, by cause (2 events per thread):\n");
  for (int v = 0; v < 2; ++v) {
    const Tally& t = g_tally[v];
    std::printf(
        "  %-26s threads %5llu (%llu took a spare)  buffer_full %llu  "
        "not_connected %llu  in_flight %llu  invalid %llu\n",
        kVariants[v], static_cast<unsigned long long>(t.threads),
        static_cast<unsigned long long>(t.spares_taken),
        static_cast<unsigned long long>(t.dropped[0]),
        static_cast<unsigned long long>(t.dropped[1]),
        static_cast<unsigned long long>(t.dropped[2]),
        static_cast<unsigned long long>(t.dropped[3]));
  }
  if (g_connect_failures > 0) std::printf("  CONNECT OR FLUSH FAILED\n");

  std::printf(
      "\nmemory of the spares (KiB; smaps of the memfd:steptrace-ring mappings, a "
      "child with 2 spares and no thread ring):\n");
  int count[2] = {0, 0};
  std::uint64_t size[2] = {0, 0}, rss[2] = {0, 0}, pss[2] = {0, 0};
  std::istringstream in(spares);
  if (in >> count[0] >> size[0] >> rss[0] >> pss[0] >> count[1] >> size[1] >> rss[1] >> pss[1]) {
    const char* who[] = {"client", "daemon"};
    for (int i = 0; i < 2; ++i) {
      std::printf("  %-7s mappings %d  Size %8llu  Rss %5llu  Pss %5llu\n", who[i], count[i],
                  static_cast<unsigned long long>(size[i]), static_cast<unsigned long long>(rss[i]),
                  static_cast<unsigned long long>(pss[i]));
    }
  } else {
    std::printf("  not measured: the daemon never mapped 2 spares%s\n",
                shm ? "" : " (STEPTRACE_SHM_RINGS=0: there are none)");
  }
}

}  // namespace

int main(int argc, char** argv) {
  // The library reads its environment when it is loaded: without a flusher of its own
  // (no auto-connect) until first_event/connected connects, run again with it set.
  if (std::getenv("STEPTRACE_AUTOCONNECT") == nullptr) {
    ::setenv("STEPTRACE_AUTOCONNECT", "0", 1);
    ::execv("/proc/self/exe", argv);
    std::perror("execv /proc/self/exe");
    return 1;
  }
  if (!steptrace::bench::initialize(
          argc, argv, {"--benchmark_repetitions=5", "--benchmark_display_aggregates_only=true"}))
    return 2;

  steptrace::testing::TempDir dir;
  g_socket = dir.file("steptraced.sock");
  steptrace::testing::DaemonProcess daemon(g_socket);
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  const std::string spares = measure_spares(daemon.pid());  // before the library is used here
  if (steptrace_set_buffer_size(0, kTotalRingBytes) != 0) return 1;

  std::printf("machine: %s\ndaemon: steptraced pid %d on %s\n",
              steptrace::bench::machine_description().c_str(), static_cast<int>(daemon.pid()),
              g_socket.c_str());
  register_benchmarks();
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_summary(reporter, spares);
  steptrace_shutdown();
  benchmark::Shutdown();
  daemon.stop();
  return g_connect_failures > 0 ? 1 : 0;
}
