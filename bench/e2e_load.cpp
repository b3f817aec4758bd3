// End-to-end load: P trainer processes (fork) each record a fixed number of spans as fast
// as the whole pipeline sustains with zero loss (steptrace_set_block_when_full(1): a full
// thread buffer waits for the flusher instead of dropping) into one real steptraced, and
// flush. Prints events per second delivered (2 events per span) from the first span of
// the first process to the last flush acknowledgement, then checks the daemon's
// `report --json`: every process's per-step counts, zero drops, no open spans and the
// daemon's events_received must be exact, else it prints why and exits 1.
//
//   e2e_load [--procs P] [--spans N] [--runs R]
//     P processes (default 2), N spans per process and run (default 10,000,000), R runs
//     (default 3; the median run is reported). It starts its own daemon on a temporary
//     socket (the steptraced built beside it).
#include <steptrace/steptrace.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
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

struct ChildResult {
  std::uint64_t start_ns = 0;  // CLOCK_MONOTONIC: comparable across processes
  std::uint64_t end_ns = 0;    // after steptrace_flush returned
  std::uint64_t dropped = 0;
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

// The trainer: connects, warms up (one WaitPoll span, flushed: the thread buffer and the
// connection exist before the clock starts), reports ready, waits for the start signal
// (EOF on go_fd), records `spans` spans and flushes.
[[noreturn]] void run_child(const std::string& socket, std::uint64_t spans, int ready_fd, int go_fd,
                            int result_fd) {
  ChildResult result;
  steptrace_set_block_when_full(1);
  result.connect_rc = steptrace_connect(socket.c_str());
  steptrace_start(STEPTRACE_WAIT_POLL);
  steptrace_end(STEPTRACE_WAIT_POLL);
  result.flush_rc = steptrace_flush(30000);
  const char ready = 'r';
  write_all(ready_fd, &ready, 1);
  char go = 0;
  while (::read(go_fd, &go, 1) < 0 && errno == EINTR) {
  }
  result.start_ns = monotonic_ns();
  for (std::uint64_t i = 0; i < spans; i += kStepCount) {
    for (std::uint32_t step : kSteps) {
      steptrace_start(step);
      steptrace_end(step);
    }
  }
  const int flush_rc = steptrace_flush(120000);
  result.end_ns = monotonic_ns();
  if (result.flush_rc == 0) result.flush_rc = flush_rc;
  result.dropped = steptrace_dropped();
  write_all(result_fd, &result, sizeof result);
  steptrace_shutdown();
  std::_Exit(0);
}

struct RunFigures {
  double seconds = 0;
  double events_per_s = 0;
  double daemon_cpu_s = 0;
  double trainers_cpu_s = 0;  // all trainer processes, recording threads and flushers
};

// Checks one child's row in the report. Returns "" when exact, else what differs.
std::string check_process(const nlohmann::json& report, pid_t pid, std::uint64_t spans_per_step) {
  for (const auto& p : report.value("processes", nlohmann::json::array())) {
    if (p.value("pid", -1) != pid) continue;
    std::string errors;
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

}  // namespace

int main(int argc, char** argv) {
  int procs = 2;
  std::uint64_t spans = 10'000'000;
  int runs = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--procs" && has_value) {
      procs = std::atoi(argv[++i]);
    } else if (arg == "--spans" && has_value) {
      spans = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--runs" && has_value) {
      runs = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: %s [--procs P] [--spans N] [--runs R]\n", argv[0]);
      return 2;
    }
  }
  if (procs < 1 || runs < 1 || spans < kStepCount) {
    std::fprintf(stderr, "need --procs >= 1, --runs >= 1, --spans >= %zu\n", kStepCount);
    return 2;
  }
  spans -= spans % kStepCount;  // every step gets exactly spans / kStepCount

  steptrace::testing::TempDir dir;
  const std::string socket = dir.file("steptraced.sock");
  steptrace::testing::DaemonProcess daemon(socket);
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  std::printf(
      "e2e: %d processes x %llu spans (%llu events) per run, %d runs, "
      "block_when_full=1, daemon pid %d\n",
      procs, static_cast<unsigned long long>(spans),
      static_cast<unsigned long long>(2 * spans * static_cast<std::uint64_t>(procs)), runs,
      static_cast<int>(daemon.pid()));

  std::vector<RunFigures> figures;
  std::uint64_t expected_received = 0;
  bool exact = true;
  for (int run = 0; run < runs && exact; ++run) {
    int ready[2], go[2], results[2];
    if (::pipe(ready) != 0 || ::pipe(go) != 0 || ::pipe(results) != 0) {
      std::perror("pipe");
      return 1;
    }
    std::vector<pid_t> children;
    for (int c = 0; c < procs; ++c) {
      const pid_t pid = ::fork();
      if (pid < 0) {
        std::perror("fork");
        return 1;
      }
      if (pid == 0) {
        ::close(go[1]);
        run_child(socket, spans, ready[1], go[0], results[1]);
      }
      children.push_back(pid);
    }
    // Only the children write these: a child that dies then shows up as EOF.
    for (int fd : {go[0], ready[1], results[1]}) ::close(fd);
    for (int c = 0; c < procs; ++c) {
      char byte = 0;
      if (!read_all(ready[0], &byte, 1)) {
        std::fprintf(stderr, "a child died before it was ready\n");
        return 1;
      }
    }
    const double cpu_before = steptrace::bench::cpu_seconds(daemon.pid()).value_or(0);
    ::close(go[1]);  // EOF: every child starts now
    std::vector<ChildResult> child_results(static_cast<std::size_t>(procs));
    for (auto& r : child_results) {
      if (!read_all(results[0], &r, sizeof r)) {
        std::fprintf(stderr, "a child died before it reported\n");
        return 1;
      }
    }
    const double cpu_after = steptrace::bench::cpu_seconds(daemon.pid()).value_or(0);
    double trainers_cpu = 0;
    for (pid_t pid : children) {
      int status = 0;
      rusage usage{};
      ::wait4(pid, &status, 0, &usage);
      trainers_cpu += static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
                      static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        std::fprintf(stderr, "child %d exited with status %d\n", static_cast<int>(pid), status);
        exact = false;
      }
    }
    for (int fd : {ready[0], results[0]}) ::close(fd);

    std::uint64_t first = UINT64_MAX, last = 0;
    for (const auto& r : child_results) {
      first = std::min(first, r.start_ns);
      last = std::max(last, r.end_ns);
      if (r.connect_rc != 0 || r.flush_rc != 0 || r.dropped != 0) {
        std::fprintf(stderr, "child: connect=%d flush=%d dropped=%llu\n", r.connect_rc, r.flush_rc,
                     static_cast<unsigned long long>(r.dropped));
        exact = false;
      }
    }
    RunFigures f;
    f.seconds = static_cast<double>(last - first) / 1e9;
    f.events_per_s = static_cast<double>(2 * spans * static_cast<std::uint64_t>(procs)) / f.seconds;
    f.daemon_cpu_s = cpu_after - cpu_before;
    f.trainers_cpu_s = trainers_cpu;
    figures.push_back(f);
    std::printf(
        "run %d: %.3f s, %.2f million events/s delivered; CPU: daemon %.2f s (%.0f%% of "
        "one core), trainers %.2f s (whole life, incl. warm-up and exit)\n",
        run + 1, f.seconds, f.events_per_s / 1e6, f.daemon_cpu_s,
        100.0 * f.daemon_cpu_s / f.seconds, f.trainers_cpu_s);

    // Exactness, from the daemon's side.
    expected_received += static_cast<std::uint64_t>(procs) * (2 * spans + 2);
    const auto report = steptrace::bench::daemon_json(socket, "report --json");
    if (!report) return 1;
    for (pid_t pid : children) {
      const std::string errors = check_process(*report, pid, spans / kStepCount);
      if (!errors.empty()) {
        std::fprintf(stderr, "pid %d:%s\n", static_cast<int>(pid), errors.c_str());
        exact = false;
      }
    }
    const auto received =
        report->value(nlohmann::json::json_pointer("/daemon/events_received"), std::uint64_t{0});
    if (received != expected_received) {
      std::fprintf(stderr, "daemon events_received %llu, want %llu\n",
                   static_cast<unsigned long long>(received),
                   static_cast<unsigned long long>(expected_received));
      exact = false;
    }
  }
  if (!exact) {
    std::fprintf(stderr, "E2E FAILED: the daemon's counts are not exact (see above)\n");
    return 1;
  }
  std::sort(figures.begin(), figures.end(), [](const RunFigures& a, const RunFigures& b) {
    return a.events_per_s < b.events_per_s;
  });
  const RunFigures& median = figures[figures.size() / 2];
  std::printf(
      "e2e median: %.2f million events/s delivered with zero loss, counts exact "
      "(target >= 20 million: %s)\n",
      median.events_per_s / 1e6, median.events_per_s >= 20e6 ? "met" : "MISSED");
  daemon.stop();
  return 0;
}
