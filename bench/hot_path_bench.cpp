// Hot path of libsteptrace: one span (steptrace_start + steptrace_end), measured next to a
// C++ replica of the reference tracer (the in-process Rust tracer steptrace replaces; its
// design is described below) in the same binary and run, with 1 thread and with 2
// threads contending.
//
// main() starts a real steptraced on a temporary socket and connects the library to it,
// so the flusher drains the per-thread buffers while the benchmark records. Variants:
//   steptrace/live_daemon         spans as fast as the loop goes; what the flusher cannot
//                                 keep up with is dropped (counted, printed at the end)
//   steptrace/live_daemon_paced   what a trainer sees: bursts of kBurst spans (timed),
//                                 then kComputeUs of busy "compute" (timer paused, no
//                                 flush): the flusher and daemon drain in the background
//                                 and keep up, so every event is delivered (checked)
//   steptrace/no_daemon           connected to a socket nobody listens on: all dropped
//   steptrace/disabled            steptrace_set_enabled(0)
//   replica/hashmap               the reference design: 3 mutexes, hash maps
//   replica/flat                  the same 3 mutexes with arrays instead of maps
//   replica/disabled              the reference's disabled path (one mutex)
// At the end it prints the medians, the ratios replica/ours and the drop accounting,
// all from this run. Timings are printed, never asserted.
#include <steptrace/steptrace.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include <benchmark/benchmark.h>

#include "bench/bench_support.h"
#include "bench/median_reporter.h"
#include "tests/support/daemon_process.h"

namespace {

using steptrace::bench::Figure;
using steptrace::bench::MedianReporter;

// ---- the reference design, replicated --------------------------------------------
// The reference (Rust): `enabled: Mutex<bool>`, `active_spans: Mutex<HashMap<TraceStep, Instant>>`,
// `aggregated: Mutex<HashMap<TraceStep, (usize, Duration)>>`. start() locks enabled,
// then spans, and inserts Instant::now(); end() locks enabled, then spans, removes the
// entry, and with spans still held locks the aggregate and updates it.

enum class TraceStep : std::uint8_t { kForward, kBackward, kMatmul };
using Clock = std::chrono::steady_clock;

// Maps as the reference has them. std::unordered_map allocates a node per insert where
// Rust's HashMap does not, but Rust hashes with SipHash-1-3 where std::hash of an enum is
// the identity; replica/flat below removes the maps entirely as a lower bound.
struct HashMaps {
  std::unordered_map<TraceStep, Clock::time_point> spans;
  std::unordered_map<TraceStep, std::pair<std::size_t, Clock::duration>> agg;

  void insert(TraceStep s, Clock::time_point t) { spans.insert_or_assign(s, t); }
  std::optional<Clock::time_point> remove(TraceStep s) {
    auto it = spans.find(s);
    if (it == spans.end()) return std::nullopt;
    const auto t = it->second;
    spans.erase(it);
    return t;
  }
  void add(TraceStep s, Clock::duration d) {
    auto& e = agg.try_emplace(s, 0, Clock::duration::zero()).first->second;
    ++e.first;
    e.second += d;
  }
};

struct FlatMaps {
  std::array<std::optional<Clock::time_point>, 16> spans;
  std::array<std::pair<std::size_t, Clock::duration>, 16> agg{};

  void insert(TraceStep s, Clock::time_point t) { spans[static_cast<std::size_t>(s)] = t; }
  std::optional<Clock::time_point> remove(TraceStep s) {
    auto& slot = spans[static_cast<std::size_t>(s)];
    const auto t = slot;
    slot.reset();
    return t;
  }
  void add(TraceStep s, Clock::duration d) {
    auto& e = agg[static_cast<std::size_t>(s)];
    ++e.first;
    e.second += d;
  }
};

template <typename Maps>
class ReplicaTracer {
 public:
  void set_enabled(bool on) {
    std::lock_guard lock(enabled_mu_);
    enabled_ = on;
  }
  bool is_enabled() {
    std::lock_guard lock(enabled_mu_);
    return enabled_;
  }
  void start(TraceStep step) {
    if (!is_enabled()) return;
    std::lock_guard spans(spans_mu_);
    maps_.insert(step, Clock::now());
  }
  void end(TraceStep step) {
    if (!is_enabled()) return;
    std::lock_guard spans(spans_mu_);
    if (auto start = maps_.remove(step)) {
      const auto duration = Clock::now() - *start;
      std::lock_guard agg(agg_mu_);
      maps_.add(step, duration);
    }
  }

 private:
  std::mutex enabled_mu_;
  bool enabled_ = false;
  std::mutex spans_mu_;
  std::mutex agg_mu_;  // guards maps_.agg; spans_mu_ guards maps_.spans
  Maps maps_;
};

ReplicaTracer<HashMaps> g_replica_hash;
ReplicaTracer<FlatMaps> g_replica_flat;
ReplicaTracer<FlatMaps> g_replica_disabled;

// ---- connection modes and drop accounting -------------------------------------------

enum Mode { kLive, kLivePaced, kNoDaemon, kDisabled, kModeCount };
constexpr const char* kModeNames[kModeCount] = {"live_daemon", "live_daemon_paced", "no_daemon",
                                                "disabled"};

// The paced variant: bursts of kBurst spans back to back, then kComputeUs of busy work
// standing for a trainer's compute (a step of many small ops, then a kernel). That is
// ~1,000 spans per ~0.25 ms, about 4 M spans/s per thread on average: twice the design
// rate, which the flusher and the daemon still keep up with on 2 cores. The paused
// timer's two clock reads are spread over the burst's spans.
constexpr int kBurst = 1024;
constexpr int kComputeUs = 200;

std::string g_live_socket;
std::string g_absent_socket;
bool g_connected_live = true;  // main() connects to the live daemon first

struct Tally {
  std::atomic<std::uint64_t> recorded{0};  // events the benchmark loops recorded
  std::uint64_t dropped = 0;               // steptrace_dropped() growth over the runs
  std::uint64_t dropped_at_setup = 0;
  int flush_failures = 0;
};
std::array<Tally, kModeCount> g_tally;
// After the last live variant's flush: what the daemon says it received, and what the
// live variants recorded minus what they dropped by then.
std::optional<std::uint64_t> g_daemon_received;
std::uint64_t g_delivered = 0;

std::uint64_t daemon_events_received() {
  auto report = steptrace::bench::daemon_json(g_live_socket, "report --json");
  if (!report) return 0;
  return report->value(nlohmann::json::json_pointer("/daemon/events_received"), std::uint64_t{0});
}

void connect_to(bool live) {
  if (g_connected_live == live) return;
  steptrace_shutdown();
  const int rc = steptrace_connect(live ? g_live_socket.c_str() : g_absent_socket.c_str());
  if (live && rc != 0) std::fprintf(stderr, "reconnecting to the daemon failed: %d\n", rc);
  g_connected_live = live;
}

template <Mode M>
void setup(const benchmark::State&) {
  connect_to(M != kNoDaemon);
  steptrace_set_enabled(M == kDisabled ? 0 : 1);
  g_tally[M].dropped_at_setup = steptrace_dropped();
}

template <Mode M>
void teardown(const benchmark::State&) {
  // Live: wait until the daemon has what was not dropped, so the totals add up below.
  if (M == kLive || M == kLivePaced) {
    if (steptrace_flush(10000) != 0) ++g_tally[M].flush_failures;
  }
  g_tally[M].dropped += steptrace_dropped() - g_tally[M].dropped_at_setup;
  steptrace_set_enabled(1);
  if (M == kLive || M == kLivePaced) {
    g_daemon_received = daemon_events_received();
    g_delivered = 0;
    for (Mode m : {kLive, kLivePaced}) g_delivered += g_tally[m].recorded - g_tally[m].dropped;
  }
}

// ---- benchmarks -----------------------------------------------------------------------

template <Mode M>
void bm_span(benchmark::State& state) {
  for (auto _ : state) {
    steptrace_start(STEPTRACE_FORWARD);
    steptrace_end(STEPTRACE_FORWARD);
  }
  if (M != kDisabled) g_tally[M].recorded += 2 * static_cast<std::uint64_t>(state.iterations());
}

void bm_span_paced(benchmark::State& state) {
  int in_burst = 0;
  for (auto _ : state) {
    steptrace_start(STEPTRACE_FORWARD);
    steptrace_end(STEPTRACE_FORWARD);
    if (++in_burst == kBurst) {
      in_burst = 0;
      state.PauseTiming();
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kComputeUs);
      while (std::chrono::steady_clock::now() < until) {
      }
      state.ResumeTiming();
    }
  }
  g_tally[kLivePaced].recorded += 2 * static_cast<std::uint64_t>(state.iterations());
}

template <typename Tracer>
void bm_replica(benchmark::State& state, Tracer* tracer) {
  for (auto _ : state) {
    tracer->start(TraceStep::kForward);
    tracer->end(TraceStep::kForward);
  }
}

void register_benchmarks() {
  using benchmark::RegisterBenchmark;
  auto both = [](benchmark::internal::Benchmark* b) {
    b->Unit(benchmark::kNanosecond)->Threads(1)->Threads(2);
  };
  both(RegisterBenchmark("steptrace/live_daemon", bm_span<kLive>)
           ->Setup(setup<kLive>)
           ->Teardown(teardown<kLive>));
  // Measured time is only the bursts; the flush round trips stretch the wall time, so
  // a shorter minimum keeps the run short.
  both(RegisterBenchmark("steptrace/live_daemon_paced", bm_span_paced)
           ->Setup(setup<kLivePaced>)
           ->Teardown(teardown<kLivePaced>)
           ->MinTime(0.1));
  both(RegisterBenchmark("replica/hashmap", bm_replica<ReplicaTracer<HashMaps>>, &g_replica_hash));
  both(RegisterBenchmark("replica/flat", bm_replica<ReplicaTracer<FlatMaps>>, &g_replica_flat));
  both(RegisterBenchmark("steptrace/disabled", bm_span<kDisabled>)
           ->Setup(setup<kDisabled>)
           ->Teardown(teardown<kDisabled>));
  both(RegisterBenchmark("replica/disabled", bm_replica<ReplicaTracer<FlatMaps>>,
                         &g_replica_disabled));
  both(RegisterBenchmark("steptrace/no_daemon", bm_span<kNoDaemon>)
           ->Setup(setup<kNoDaemon>)
           ->Teardown(teardown<kNoDaemon>));
}

// ---- summary -------------------------------------------------------------------------

std::optional<Figure> figure(const MedianReporter& r, const std::string& name, int threads) {
  return r.median(name + "@" + std::to_string(threads));
}

void print_row(const MedianReporter& r, const std::string& name) {
  std::printf("  %-30s", name.c_str());
  for (int threads : {1, 2}) {
    if (auto f = figure(r, name, threads)) {
      std::printf(" | %9.2f ns  (cpu %9.2f)", f->real_time, f->cpu_time);
    } else {
      std::printf(" | %25s", "not run");
    }
  }
  std::printf("\n");
}

void print_ratio(const MedianReporter& r, const std::string& replica, const std::string& ours,
                 const double targets[2]) {
  for (int threads : {1, 2}) {
    auto a = figure(r, replica, threads);
    auto b = figure(r, ours, threads);
    if (!a || !b || b->real_time <= 0) continue;
    const double ratio = a->real_time / b->real_time;
    std::printf("  %s / %s, %d thread%s: %.1fx (cpu time: %.1fx)", replica.c_str(), ours.c_str(),
                threads, threads == 1 ? "" : "s", ratio,
                b->cpu_time > 0 ? a->cpu_time / b->cpu_time : 0.0);
    if (targets) {
      std::printf("  (target >= %.0fx: %s)", targets[threads - 1],
                  ratio >= targets[threads - 1] ? "met" : "MISSED");
    }
    std::printf("\n");
  }
}

void print_summary(const MedianReporter& r) {
  std::printf(
      "\n== hot path summary: medians of this run (Google Benchmark 'Time' per span; "
      "with 2 threads that is wall time / spans of both threads) ==\n");
  std::printf("  %-30s | %27s | %27s\n", "variant", "1 thread", "2 threads");
  for (const char* name :
       {"steptrace/live_daemon", "steptrace/live_daemon_paced", "steptrace/no_daemon",
        "steptrace/disabled", "replica/hashmap", "replica/flat", "replica/disabled"}) {
    print_row(r, name);
  }
  std::printf("\nratios (same run):\n");
  const double targets[2] = {4, 15};
  print_ratio(r, "replica/hashmap", "steptrace/live_daemon", targets);
  print_ratio(r, "replica/hashmap", "steptrace/live_daemon_paced", targets);
  print_ratio(r, "replica/flat", "steptrace/live_daemon", nullptr);
  print_ratio(r, "replica/disabled", "steptrace/disabled", nullptr);
  if (auto live = figure(r, "steptrace/live_daemon", 1)) {
    std::printf(
        "  steptrace/live_daemon, 1 thread: %.2f ns per span, cpu %.2f ns (target <= 30 "
        "ns: %s)\n",
        live->real_time, live->cpu_time, live->real_time <= 30 ? "met" : "MISSED");
  }
  auto live = figure(r, "steptrace/live_daemon", 1);
  auto absent = figure(r, "steptrace/no_daemon", 1);
  if (live && absent && live->real_time > 0) {
    std::printf(
        "  no_daemon / live_daemon, 1 thread: %.2f, cpu time %.2f (1.00 = dropping costs "
        "the same)\n",
        absent->real_time / live->real_time,
        live->cpu_time > 0 ? absent->cpu_time / live->cpu_time : 0.0);
  }

  std::printf("\nevents recorded and dropped (all trials of each variant):\n");
  for (int m = 0; m < kModeCount; ++m) {
    const Tally& t = g_tally[m];
    if (m == kDisabled) continue;
    const double pct =
        t.recorded ? 100.0 * static_cast<double>(t.dropped) / static_cast<double>(t.recorded) : 0.0;
    std::printf("  %-20s recorded %12llu  dropped %12llu (%5.1f%%)%s\n", kModeNames[m],
                static_cast<unsigned long long>(t.recorded),
                static_cast<unsigned long long>(t.dropped), pct,
                t.flush_failures ? "  FLUSH FAILED" : "");
  }
  if (g_daemon_received) {
    std::printf(
        "  after the live variants: daemon events_received %llu, recorded - dropped %llu "
        "(%s)\n",
        static_cast<unsigned long long>(*g_daemon_received),
        static_cast<unsigned long long>(g_delivered),
        *g_daemon_received == g_delivered ? "equal" : "DIFFERENT");
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (!steptrace::bench::initialize(
          argc, argv, {"--benchmark_repetitions=5", "--benchmark_display_aggregates_only=true"}))
    return 2;

  // The daemon is forked before the library starts its flusher thread.
  steptrace::testing::TempDir dir;
  g_live_socket = dir.file("steptraced.sock");
  g_absent_socket = dir.file("nobody-listens.sock");
  steptrace::testing::DaemonProcess daemon(g_live_socket);
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  setenv("STEPTRACE_SOCKET", g_live_socket.c_str(), 1);
  if (const int rc = steptrace_connect(g_live_socket.c_str()); rc != 0) {
    std::fprintf(stderr, "steptrace_connect(%s) failed: %d\n", g_live_socket.c_str(), rc);
    return 1;
  }
  g_replica_hash.set_enabled(true);
  g_replica_flat.set_enabled(true);
  g_replica_disabled.set_enabled(false);

  std::printf("machine: %s\ndaemon: steptraced pid %d on %s\n",
              steptrace::bench::machine_description().c_str(), static_cast<int>(daemon.pid()),
              g_live_socket.c_str());
  register_benchmarks();
  MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);
  print_summary(reporter);
  steptrace_shutdown();
  benchmark::Shutdown();
  daemon.stop();
  return 0;
}
