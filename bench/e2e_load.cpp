// End-to-end load: P trainer processes (fork) each record a fixed number of spans into one
// real steptraced and flush; prints events per second delivered (2 events per span) from
// the first span of the first process to the last flush acknowledgement, and checks the
// daemon's `report --json` after every run. Two client modes:
//
//   block (the default): steptrace_set_block_when_full(1), spans as fast as the whole
//     pipeline sustains with zero loss (a full thread buffer waits for its reader instead
//     of dropping). Every process's per-step counts, zero drops, no open spans and the
//     daemon's events_received must be exact, else it prints why and exits 1.
//   default (--mode default --rate S): the library's default, never-blocking mode; each
//     process paces itself to S spans/s: bursts of B spans back to back, each burst
//     started on an absolute schedule (start + spans done / S; clock_nanosleep while
//     ahead of it, no sleep while behind), the 4 steps round robin as in block mode. A
//     run is exact when the same checks pass (so nothing was dropped). When events were
//     dropped the run also checks the accounting: the daemon's per-process `dropped`
//     must equal the child's steptrace_dropped(), and sent = received + dropped (the
//     growth of the daemon's events_received); an event missing from both is LOST.
//   --search: the default mode, bisecting over S for the highest paced rate whose probe
//     drops nothing: a probe at S runs up to R runs (fresh trainers each, N spans per
//     process) and passes when all R are exact (it stops at the first that is not). It
//     probes --max-rate first (a pass ends the search: the limit is higher), then the
//     geometric middle of [--min-rate, --max-rate], narrowing the bracket until
//     max/min <= 1 + --precision; when no probe passed, --min-rate last. Prints every
//     probe, then the highest passing rate and the median run of its probe.
//
// Per run it prints the daemon's CPU time (utime+stime from /proc/PID/stat over the timed
// window, in 10 ms ticks) and per event, the trainers' CPU over the same window (the
// recording thread alone, and the whole process: recording thread + flusher), the whole
// machine's busy and hypervisor-stolen CPU over the window (/proc/stat: includes anything
// else running), and how many events the daemon read from shared-memory rings (protocol
// 5, `stats --json` shared_rings) rather than socket frames, i.e. the transport
// (STEPTRACE_SHM_RINGS=0 in the environment keeps every event on the socket). Paced runs
// also print how far the trainers fell behind their schedule (the largest lag, and the
// bursts started more than 1 ms late): a late trainer records back to back until it is
// on schedule again, which is when a ring fills fastest.
//
//   e2e_load [--procs P] [--spans N] [--runs R]
//            [--mode block|default] [--rate S] [--burst B]
//            [--search [--min-rate S0] [--max-rate S1] [--precision F]] [--durable]
//     P processes (default 2), N spans per process and run (default 10,000,000), R runs
//     (default 3; the median run, by events/s, is reported). --rate: spans/s per process
//     (default mode; required without --search). --burst: spans per burst (default
//     4096, rounded down to a multiple of 4). --search bounds default to 1,000,000 and
//     32,000,000 spans/s per process, --precision to 0.05. It starts its own daemon on
//     a temporary socket (the steptraced built beside it). --durable gives the daemon a
//     state directory (snapshots every second while the state changes, as installed)
//     and prints what the snapshots wrote under load and over 5 idle seconds.
//   Exit status: 0 when every run was exact (block, --rate) or the search found a passing
//   rate with no event lost; 1 otherwise (counts not exact, an event lost, a child
//   failed, the lowest rate dropped); 2 on bad arguments.
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_support.h"
#include "tests/support/daemon_process.h"

namespace {

using steptrace::bench::monotonic_ns;

// The spans cycle through these steps so the daemon folds into several keys.
constexpr std::uint32_t kSteps[] = {STEPTRACE_FORWARD, STEPTRACE_BACKWARD, STEPTRACE_MATMUL,
                                    STEPTRACE_ATTENTION};
constexpr const char* kStepNames[] = {"Forward", "Backward", "Matmul", "Attention"};
constexpr std::size_t kStepCount = std::size(kSteps);

enum class Mode { kBlock, kDefault };

struct Load {
  Mode mode = Mode::kBlock;
  std::uint64_t spans = 10'000'000;  // per process
  double rate = 0;                   // spans/s per process (kDefault), 0: unpaced
  std::uint64_t burst = 4096;        // spans per burst (kDefault)
};

struct ChildResult {
  pid_t pid = 0;               // results arrive in the order the children finish
  std::uint64_t start_ns = 0;  // CLOCK_MONOTONIC: comparable across processes
  std::uint64_t end_ns = 0;    // after steptrace_flush returned
  std::uint64_t dropped = 0;
  double thread_cpu_s = 0;        // the recording thread, start .. flush returned
  std::uint64_t max_lag_ns = 0;   // paced: the latest a burst started after it was due
  std::uint64_t late_bursts = 0;  // paced: bursts started more than 1 ms after due
  double process_cpu_s = 0;       // the whole process (recording thread + flusher), same window
  int connect_rc = 0;
  int flush_rc = 0;
};

bool write_all(int fd, const void* data, std::size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = ::read(fd, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

double cpu_of(int who) {
  rusage usage{};
  ::getrusage(who, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

void record_spans(std::uint64_t n) {
  for (std::uint64_t i = 0; i < n; i += kStepCount) {
    for (std::uint32_t step : kSteps) {
      steptrace_start(step);
      steptrace_end(step);
    }
  }
}

// Bursts of load.burst spans, burst k due at start + k * burst / rate; a late burst is
// not skipped (the next ones follow at once until the schedule is met again).
void record_paced(const Load& load, std::uint64_t start_ns, ChildResult& result) {
  const double ns_per_span = 1e9 / load.rate;
  for (std::uint64_t done = 0; done < load.spans;) {
    const std::uint64_t due =
        start_ns + static_cast<std::uint64_t>(static_cast<double>(done) * ns_per_span);
    const std::uint64_t now = monotonic_ns();
    if (now > due) {
      result.max_lag_ns = std::max(result.max_lag_ns, now - due);
      if (now - due > 1'000'000) ++result.late_bursts;
    }
    if (now < due) {
      const timespec at{static_cast<time_t>(due / 1'000'000'000u),
                        static_cast<long>(due % 1'000'000'000u)};
      while (::clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &at, nullptr) == EINTR) {
      }
    }
    const std::uint64_t n = std::min(load.burst, load.spans - done);
    record_spans(n);
    done += n;
  }
}

// The trainer: connects, warms up (one WaitPoll span, flushed: the thread buffer and the
// connection exist before the clock starts), reports ready, waits for the start signal
// (EOF on go_fd), records `load.spans` spans and flushes.
[[noreturn]] void run_child(const std::string& socket, const Load& load, int ready_fd, int go_fd,
                            int result_fd) {
  ChildResult result;
  result.pid = ::getpid();
  steptrace_set_block_when_full(load.mode == Mode::kBlock ? 1 : 0);
  // Paced sleeps end when due, not up to 50 us later (the default timer slack).
  if (load.mode == Mode::kDefault) ::prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
  result.connect_rc = steptrace_connect(socket.c_str());
  steptrace_start(STEPTRACE_WAIT_POLL);
  steptrace_end(STEPTRACE_WAIT_POLL);
  result.flush_rc = steptrace_flush(30000);
  const char ready = 'r';
  write_all(ready_fd, &ready, 1);
  char go = 0;
  while (::read(go_fd, &go, 1) < 0 && errno == EINTR) {
  }
  const double thread_cpu_before = cpu_of(RUSAGE_THREAD);
  const double process_cpu_before = cpu_of(RUSAGE_SELF);
  result.start_ns = monotonic_ns();
  if (load.mode == Mode::kDefault && load.rate > 0) {
    record_paced(load, result.start_ns, result);
  } else {
    record_spans(load.spans);
  }
  const int flush_rc = steptrace_flush(120000);
  result.end_ns = monotonic_ns();
  result.thread_cpu_s = cpu_of(RUSAGE_THREAD) - thread_cpu_before;
  result.process_cpu_s = cpu_of(RUSAGE_SELF) - process_cpu_before;
  if (result.flush_rc == 0) result.flush_rc = flush_rc;
  result.dropped = steptrace_dropped();
  write_all(result_fd, &result, sizeof result);
  steptrace_shutdown();
  std::_Exit(0);
}

// Busy, stolen (by the hypervisor) and total jiffies of the whole machine, from
// /proc/stat's "cpu" line.
struct MachineCpu {
  std::uint64_t busy = 0;
  std::uint64_t steal = 0;
  std::uint64_t total = 0;
};

MachineCpu machine_cpu() {
  std::ifstream in("/proc/stat");
  std::string line;
  std::getline(in, line);
  std::istringstream fields(line);
  std::string name;
  fields >> name;
  MachineCpu cpu;
  std::uint64_t value = 0;
  // user nice system idle iowait irq softirq steal
  for (int i = 0; i < 8 && (fields >> value); ++i) {
    cpu.total += value;
    if (i == 7) {
      cpu.steal += value;
    } else if (i != 3 && i != 4) {
      cpu.busy += value;
    }
  }
  return cpu;
}

struct RunFigures {
  bool ok = false;    // exact: every count as sent, nothing dropped
  bool lost = false;  // an event neither delivered nor counted as dropped
  bool harness_failed = false;
  double seconds = 0;
  double events_per_s = 0;
  double daemon_cpu_s = 0;
  double record_cpu_s = 0;           // recording threads, timed window, all processes
  double trainer_cpu_s = 0;          // whole trainer processes, timed window
  double trainers_life_cpu_s = 0;    // whole life (wait4), incl. warm-up and exit
  double machine_busy_cores = 0;     // average busy CPUs of the whole machine in the window
  double machine_steal_cores = 0;    // average CPUs stolen by the hypervisor in the window
  std::uint64_t dropped = 0;         // by the children's own count
  std::uint64_t max_lag_ns = 0;      // paced: the most a trainer fell behind its schedule
  std::uint64_t late_bursts = 0;     // paced: bursts started > 1 ms late, all trainers
  std::uint64_t ring_events = 0;     // of this run's events, read from shared rings
  std::uint64_t rings_attached = 0;  // rings the daemon mapped in this run
  std::uint64_t rings_refused = 0;   // rings it refused in this run
  std::uint64_t events = 0;          // sent in the timed window
  std::uint64_t received = 0;        // the growth of the daemon's events_received (+ warm-up)
};

// Checks one child's row in the report. Returns "" when exact, else what differs;
// `dropped_out` gets the row's `dropped`.
std::string check_process(const nlohmann::json& report, pid_t pid, std::uint64_t spans_per_step,
                          std::uint64_t& dropped_out) {
  for (const auto& p : report.value("processes", nlohmann::json::array())) {
    if (p.value("pid", -1) != pid) continue;
    std::string errors;
    dropped_out = p.value("dropped", std::uint64_t{0});
    if (p.value("dropped", std::uint64_t{1}) != 0) {
      errors += " dropped=" + p["dropped"].dump();
    }
    auto count_of = [&](const std::string& name, const char* field) -> std::uint64_t {
      for (const auto& s : p.value("steps", nlohmann::json::array())) {
        if (s.value("step", "") == name) return s.value(field, std::uint64_t{0});
      }
      return 0;
    };
    for (const char* name : kStepNames) {
      const auto count = count_of(name, "count");
      if (count != spans_per_step) {
        errors += std::string(" ") + name + ".count=" + std::to_string(count) + " (want " +
                  std::to_string(spans_per_step) + ")";
      }
      if (const auto open = count_of(name, "open"); open != 0) {
        errors += std::string(" ") + name + ".open=" + std::to_string(open);
      }
    }
    if (const auto warm = count_of("WaitPoll", "count"); warm != 1) {
      errors += " WaitPoll.count=" + std::to_string(warm) + " (want 1)";
    }
    return errors;
  }
  return " process missing from the report";
}

class Runner {
 public:
  Runner(const std::string& socket, steptrace::testing::DaemonProcess& daemon, int procs)
      : socket_(socket), daemon_(daemon), procs_(procs) {}

  // One run: fork the trainers, time them, check the daemon's report and print the run's
  // figures. What differs is printed on stderr when an event was lost, a child failed, or
  // the counts are off with nothing dropped; a run that dropped (counted) events is only
  // marked "counts not exact" (expected of a search probe above the limit).
  RunFigures run(const Load& load, const char* label) {
    RunFigures f;
    int ready[2], go[2], results[2];
    if (::pipe(ready) != 0 || ::pipe(go) != 0 || ::pipe(results) != 0) {
      std::perror("pipe");
      f.harness_failed = true;
      return f;
    }
    std::vector<pid_t> children;
    for (int c = 0; c < procs_; ++c) {
      const pid_t pid = ::fork();
      if (pid < 0) {
        std::perror("fork");
        std::exit(1);
      }
      if (pid == 0) {
        ::close(go[1]);
        run_child(socket_, load, ready[1], go[0], results[1]);
      }
      children.push_back(pid);
    }
    // Only the children write these: a child that dies then shows up as EOF.
    for (int fd : {go[0], ready[1], results[1]}) ::close(fd);
    for (int c = 0; c < procs_; ++c) {
      char byte = 0;
      if (!read_all(ready[0], &byte, 1)) {
        std::fprintf(stderr, "a child died before it was ready\n");
        std::exit(1);
      }
    }
    const double cpu_before = steptrace::bench::cpu_seconds(daemon_.pid()).value_or(0);
    const MachineCpu machine_before = machine_cpu();
    ::close(go[1]);  // EOF: every child starts now
    std::vector<ChildResult> child_results(static_cast<std::size_t>(procs_));
    for (auto& r : child_results) {
      if (!read_all(results[0], &r, sizeof r)) {
        std::fprintf(stderr, "a child died before it reported\n");
        std::exit(1);
      }
    }
    const double cpu_after = steptrace::bench::cpu_seconds(daemon_.pid()).value_or(0);
    const MachineCpu machine_after = machine_cpu();
    for (pid_t pid : children) {
      int status = 0;
      rusage usage{};
      ::wait4(pid, &status, 0, &usage);
      f.trainers_life_cpu_s +=
          static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
          static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "child %d exited with status %d\n", static_cast<int>(pid), status);
        f.harness_failed = true;
      }
    }
    for (int fd : {ready[0], results[0]}) ::close(fd);

    std::uint64_t first = UINT64_MAX, last = 0;
    bool child_failed = false;
    for (const auto& r : child_results) {
      first = std::min(first, r.start_ns);
      last = std::max(last, r.end_ns);
      f.record_cpu_s += r.thread_cpu_s;
      f.trainer_cpu_s += r.process_cpu_s;
      f.dropped += r.dropped;
      f.max_lag_ns = std::max(f.max_lag_ns, r.max_lag_ns);
      f.late_bursts += r.late_bursts;
      if (r.connect_rc != 0 || r.flush_rc != 0) child_failed = true;
    }
    f.events = 2 * load.spans * static_cast<std::uint64_t>(procs_);
    f.seconds = static_cast<double>(last - first) / 1e9;
    f.events_per_s = static_cast<double>(f.events) / f.seconds;
    f.daemon_cpu_s = cpu_after - cpu_before;
    const std::uint64_t jiffies = machine_after.total - machine_before.total;
    const double cores = static_cast<double>(sysconf(_SC_NPROCESSORS_ONLN));
    if (jiffies > 0) {
      f.machine_busy_cores = static_cast<double>(machine_after.busy - machine_before.busy) /
                             static_cast<double>(jiffies) * cores;
      f.machine_steal_cores = static_cast<double>(machine_after.steal - machine_before.steal) /
                              static_cast<double>(jiffies) * cores;
    }

    // Exactness, from the daemon's side.
    const auto report = steptrace::bench::daemon_json(socket_, "report --json");
    if (!report) std::exit(1);
    bool exact = !child_failed && !f.harness_failed;
    std::string why;
    std::uint64_t daemon_dropped = 0;
    for (const ChildResult& r : child_results) {
      std::uint64_t row_dropped = 0;
      const std::string errors =
          check_process(*report, r.pid, load.spans / kStepCount, row_dropped);
      daemon_dropped += row_dropped;
      if (!errors.empty()) {
        exact = false;
        why += " pid " + std::to_string(r.pid) + ":" + errors + ";";
      }
      if (row_dropped != r.dropped) {
        f.lost = true;
        why += " pid " + std::to_string(r.pid) + ": daemon's dropped " +
               std::to_string(row_dropped) + " != the child's steptrace_dropped() " +
               std::to_string(r.dropped) + ";";
      }
    }
    if (std::any_of(child_results.begin(), child_results.end(), [&](const ChildResult& r) {
          return std::find(children.begin(), children.end(), r.pid) == children.end();
        })) {
      f.harness_failed = true;
      why += " a result came from an unknown pid;";
    }
    const auto received =
        report->value(nlohmann::json::json_pointer("/daemon/events_received"), std::uint64_t{0});
    // The transport: what the daemon read from shared rings (`stats --json`).
    const auto stats = steptrace::bench::daemon_json(socket_, "stats --json");
    if (!stats) std::exit(1);
    const auto ring_events =
        stats->value(nlohmann::json::json_pointer("/shared_rings/events"), std::uint64_t{0});
    const auto rings_attached =
        stats->value(nlohmann::json::json_pointer("/shared_rings/attached"), std::uint64_t{0});
    const auto rings_refused =
        stats->value(nlohmann::json::json_pointer("/shared_rings/refused"), std::uint64_t{0});
    f.ring_events = ring_events - ring_events_before_;
    f.rings_attached = rings_attached - rings_attached_before_;
    f.rings_refused = rings_refused - rings_refused_before_;
    rings_attached_before_ = rings_attached;
    rings_refused_before_ = rings_refused;
    const std::uint64_t sent = static_cast<std::uint64_t>(procs_) * (2 * load.spans + 2);
    const std::uint64_t got = received - received_before_;
    if (got + daemon_dropped != sent) {
      f.lost = true;
      why += " events: sent " + std::to_string(sent) + ", daemon received " + std::to_string(got) +
             " + dropped " + std::to_string(daemon_dropped) + " (unaccounted " +
             std::to_string(static_cast<long long>(sent - got - daemon_dropped)) + ");";
    }
    if (got != sent) exact = false;
    f.received = got;
    received_before_ = received;
    ring_events_before_ = ring_events;
    f.ok = exact && !f.lost;

    std::printf(
        "%s: %.3f s, %.2f M events/s delivered, dropped %llu (%.3f%%)%s; transport: %llu of "
        "%llu events read from shared rings (rings mapped %llu, refused %llu)\n"
        "    CPU: daemon %.2f s (%.0f%% of one core, %.2f ns per event); trainers: recording "
        "threads %.2f s, whole processes %.2f s (%.2f s whole life); machine busy %.2f of %ld "
        "cores (+%.2f stolen)\n",
        label, f.seconds, f.events_per_s / 1e6, static_cast<unsigned long long>(f.dropped),
        100.0 * static_cast<double>(f.dropped) / static_cast<double>(f.events),
        f.ok ? ", counts exact" : (f.lost ? ", EVENTS LOST" : ", counts not exact"),
        static_cast<unsigned long long>(f.ring_events), static_cast<unsigned long long>(got),
        static_cast<unsigned long long>(f.rings_attached),
        static_cast<unsigned long long>(f.rings_refused), f.daemon_cpu_s,
        100.0 * f.daemon_cpu_s / f.seconds, 1e9 * f.daemon_cpu_s / static_cast<double>(f.events),
        f.record_cpu_s, f.trainer_cpu_s, f.trainers_life_cpu_s, f.machine_busy_cores,
        sysconf(_SC_NPROCESSORS_ONLN), f.machine_steal_cores);
    if (!why.empty() && (f.lost || child_failed || f.harness_failed || f.dropped == 0)) {
      std::fprintf(stderr, "%s:%s\n", label, why.c_str());
    }
    if (load.mode == Mode::kDefault && load.rate > 0) {
      std::printf(
          "    pace: %.2f ns of recording-thread CPU per event; trainers at most %.2f ms "
          "behind schedule, %llu bursts more than 1 ms late\n",
          1e9 * f.record_cpu_s / static_cast<double>(f.events),
          static_cast<double>(f.max_lag_ns) / 1e6, static_cast<unsigned long long>(f.late_bursts));
    }
    std::fflush(stdout);
    return f;
  }

 private:
  std::string socket_;
  steptrace::testing::DaemonProcess& daemon_;
  int procs_;
  std::uint64_t received_before_ = 0;
  std::uint64_t ring_events_before_ = 0;
  std::uint64_t rings_attached_before_ = 0;
  std::uint64_t rings_refused_before_ = 0;
};

const RunFigures& median_of(std::vector<RunFigures>& figures) {
  std::sort(figures.begin(), figures.end(), [](const RunFigures& a, const RunFigures& b) {
    return a.events_per_s < b.events_per_s;
  });
  return figures[figures.size() / 2];
}

void print_median(const char* what, const RunFigures& m) {
  std::printf(
      "%s: %.2f M events/s delivered, dropped %llu; daemon CPU %.2f ns per event (%.0f%% of "
      "one core); trainers' CPU %.2f ns per event (recording threads %.2f); machine busy %.2f "
      "cores (+%.2f stolen); %llu of %llu events from shared rings\n",
      what, m.events_per_s / 1e6, static_cast<unsigned long long>(m.dropped),
      1e9 * m.daemon_cpu_s / static_cast<double>(m.events), 100.0 * m.daemon_cpu_s / m.seconds,
      1e9 * m.trainer_cpu_s / static_cast<double>(m.events),
      1e9 * m.record_cpu_s / static_cast<double>(m.events), m.machine_busy_cores,
      m.machine_steal_cores, static_cast<unsigned long long>(m.ring_events),
      static_cast<unsigned long long>(m.received));
}

}  // namespace

// --durable: what the snapshots wrote while the runs went on (snapshots x the last one's
// size, per second of the daemon's life), then over 5 idle seconds (3 s after the load).
void print_durability(const std::string& socket, const std::string& file,
                      std::chrono::steady_clock::time_point started) {
  auto written = [&] {
    const auto stats = steptrace::bench::daemon_json(socket, "stats --json");
    return stats ? (*stats)["snapshots"]["written"].get<std::uint64_t>() : 0;
  };
  const double life_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  const std::uint64_t busy = written();
  std::error_code ec;
  const auto bytes = std::filesystem::file_size(file, ec);
  const double size = ec ? 0.0 : static_cast<double>(bytes);
  std::printf(
      "durable: %llu snapshots in %.1f s of load, the last %.0f bytes: ~%.0f bytes/s written\n",
      static_cast<unsigned long long>(busy), life_s, size, busy * size / life_s);
  // The liveness check notices the trainers' exit (a change) within a second: idle after.
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const std::uint64_t settled = written();
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const std::uint64_t idle = written() - settled;
  std::printf("durable, idle: %llu snapshots in 5 s: %.0f bytes/s written\n",
              static_cast<unsigned long long>(idle), idle * size / 5.0);
}

int main(int argc, char** argv) {
  int procs = 2;
  int runs = 3;
  Load load;
  bool search = false;
  bool mode_given = false;
  double min_rate = 1e6, max_rate = 32e6, precision = 0.05;
  bool durable = false;  // --durable: the daemon keeps a state dir (snapshots every second)
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--procs" && has_value) {
      procs = std::atoi(argv[++i]);
    } else if (arg == "--spans" && has_value) {
      load.spans = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--runs" && has_value) {
      runs = std::atoi(argv[++i]);
    } else if (arg == "--mode" && has_value) {
      const std::string mode = argv[++i];
      mode_given = true;
      if (mode == "block") {
        load.mode = Mode::kBlock;
      } else if (mode == "default") {
        load.mode = Mode::kDefault;
      } else {
        std::fprintf(stderr, "--mode: block or default\n");
        return 2;
      }
    } else if (arg == "--rate" && has_value) {
      load.rate = std::strtod(argv[++i], nullptr);
    } else if (arg == "--burst" && has_value) {
      load.burst = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--search") {
      search = true;
    } else if (arg == "--durable") {
      durable = true;
    } else if (arg == "--min-rate" && has_value) {
      min_rate = std::strtod(argv[++i], nullptr);
    } else if (arg == "--max-rate" && has_value) {
      max_rate = std::strtod(argv[++i], nullptr);
    } else if (arg == "--precision" && has_value) {
      precision = std::strtod(argv[++i], nullptr);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--procs P] [--spans N] [--runs R] [--mode block|default] "
                   "[--rate S] [--burst B] [--search [--min-rate S0] [--max-rate S1] "
                   "[--precision F]] [--durable]\n",
                   argv[0]);
      return 2;
    }
  }
  if (search) {
    if (mode_given && load.mode != Mode::kDefault) {
      std::fprintf(stderr, "--search runs the default mode\n");
      return 2;
    }
    load.mode = Mode::kDefault;
  }
  load.burst -= load.burst % kStepCount;
  if (procs < 1 || runs < 1 || load.spans < kStepCount || load.burst < kStepCount) {
    std::fprintf(stderr, "need --procs >= 1, --runs >= 1, --spans and --burst >= %zu\n",
                 kStepCount);
    return 2;
  }
  if (load.mode == Mode::kDefault && !search && !(load.rate > 0)) {
    std::fprintf(stderr, "--mode default needs --rate S (spans/s per process) or --search\n");
    return 2;
  }
  if (search && !(min_rate > 0 && max_rate > min_rate && precision > 0)) {
    std::fprintf(stderr, "--search needs 0 < --min-rate < --max-rate and --precision > 0\n");
    return 2;
  }
  load.spans -= load.spans % kStepCount;  // every step gets exactly spans / kStepCount

  steptrace::testing::TempDir dir;
  const std::string socket = dir.file("steptraced.sock");
  const std::string state = dir.file("state");
  steptrace::testing::DaemonProcess daemon(
      socket,
      durable ? std::vector<std::string>{"--state-dir", state} : std::vector<std::string>{});
  const auto daemon_started = std::chrono::steady_clock::now();
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  const char* shm_env = std::getenv("STEPTRACE_SHM_RINGS");
  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  std::printf(
      "e2e: %d processes x %llu spans (%llu events) per run, %d runs, mode %s, "
      "STEPTRACE_SHM_RINGS=%s, daemon pid %d\n",
      procs, static_cast<unsigned long long>(load.spans),
      static_cast<unsigned long long>(2 * load.spans * static_cast<std::uint64_t>(procs)), runs,
      load.mode == Mode::kBlock ? "block (block_when_full=1)" : "default (never blocks)",
      shm_env ? shm_env : "(unset)", static_cast<int>(daemon.pid()));
  Runner runner(socket, daemon, procs);

  if (!search) {
    if (load.mode == Mode::kDefault) {
      std::printf(
          "paced: %.0f spans/s per process (%.2f M events/s in all), bursts of %llu spans\n",
          load.rate, 2 * load.rate * procs / 1e6, static_cast<unsigned long long>(load.burst));
    }
    std::vector<RunFigures> figures;
    bool exact = true;
    for (int run = 0; run < runs && exact; ++run) {
      const std::string label = "run " + std::to_string(run + 1);
      RunFigures f = runner.run(load, label.c_str());
      exact = f.ok;
      figures.push_back(f);
    }
    if (!exact) {
      std::fprintf(stderr, "E2E FAILED: the daemon's counts are not exact (see above)\n");
      return 1;
    }
    const RunFigures& median = median_of(figures);
    print_median("e2e median", median);
    if (durable) print_durability(socket, state + "/steptraced.snapshot.json", daemon_started);
    if (load.mode == Mode::kBlock) {
      std::printf(
          "e2e median: %.2f million events/s delivered with zero loss, counts exact "
          "(target >= 20 million: %s)\n",
          median.events_per_s / 1e6, median.events_per_s >= 20e6 ? "met" : "MISSED");
    }
    daemon.stop();
    return 0;
  }

  // The search. A probe: up to `runs` runs at one rate, all exact to pass.
  std::printf(
      "search: paced rate per process in [%.0f, %.0f] spans/s, bursts of %llu spans, "
      "a probe passes when %d of %d runs are exact with 0 dropped; stop at max/min <= "
      "%.2f\n",
      min_rate, max_rate, static_cast<unsigned long long>(load.burst), runs, runs, 1 + precision);
  bool lost = false;
  int probes = 0;
  auto probe = [&](double rate, std::vector<RunFigures>& figures) {
    Load at = load;
    at.rate = rate;
    ++probes;
    std::printf("probe %d: %.0f spans/s per process (%.2f M events/s in all)\n", probes, rate,
                2 * rate * procs / 1e6);
    figures.clear();
    for (int run = 0; run < runs; ++run) {
      const std::string label = "  run " + std::to_string(run + 1);
      RunFigures f = runner.run(at, label.c_str());
      if (f.lost || f.harness_failed) lost = true;
      figures.push_back(f);
      if (!f.ok) break;
    }
    const bool pass =
        static_cast<int>(figures.size()) == runs &&
        std::all_of(figures.begin(), figures.end(), [](const RunFigures& f) { return f.ok; });
    std::printf("probe %d: %s\n", probes, pass ? "PASS" : "FAIL");
    return pass;
  };
  double lo = min_rate, hi = max_rate;
  std::optional<double> best;
  std::vector<RunFigures> best_figures, figures;
  if (probe(hi, figures)) {
    best = hi;
    best_figures = figures;
  } else {
    while (hi / lo > 1 + precision) {
      const double mid = std::sqrt(lo * hi);
      if (probe(mid, figures)) {
        lo = mid;
        best = mid;
        best_figures = figures;
      } else {
        hi = mid;
      }
    }
    if (!best && probe(min_rate, figures)) {
      best = min_rate;
      best_figures = figures;
    }
  }
  if (lost)
    std::fprintf(stderr, "E2E: events were LOST or a child failed in a probe (see above)\n");
  if (!best) {
    std::fprintf(stderr, "E2E SEARCH FAILED: even %.0f spans/s per process dropped events\n",
                 min_rate);
    return 1;
  }
  std::printf("search: highest rate with 0 dropped: %.0f spans/s per process%s (%d probes)\n",
              *best, *best == max_rate ? " (the upper bound: the limit is higher)" : "", probes);
  const RunFigures& median = median_of(best_figures);
  print_median("e2e search median", median);
  daemon.stop();
  return lost ? 1 : 0;
}
