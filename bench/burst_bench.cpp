// Bursts in the default (never-blocking) client mode: how many events of a bursty
// trainer reach the daemon, and how many are dropped and why, with the daemon idle and
// with another client rendering `report --json` and `metrics` of a large table in a loop.
//
// The harness starts the real steptraced (the one built beside it) on a temporary
// socket, then for each cell of a matrix (rate x burst size x threads [x processes])
// runs fresh trainer processes: this binary re-executed as `--trainer`. Each of its T
// threads records spans of Transpose (flat start/end pairs) in bursts of B spans back to
// back, bursts spaced so the thread's average is R spans/s, for a fixed number of spans;
// then steptrace_flush(10000) and exit. Per cell it prints events sent, delivered (the
// daemon's `report --json --pid PID`), dropped as the client reported them to the
// daemon (`dropped`, and `dropped_by_cause` when the report has it), the child's own
// steptrace_dropped(), and what is unaccounted for (sent - delivered - dropped: an event
// lost without being counted; should always be 0).
//
// Phase "idle": the matrix against a daemon doing nothing else. Phase "loaded": first a
// table of ~100,000 keys (process x step) is built by filler processes (`--filler`: each
// registers S custom steps, records one span of each, flushes, disconnects and sleeps
// until the end of the phase: `metrics` has per-process series for live processes only,
// so they must keep running; with --exited-fillers they exit instead and only the
// report is large), its size checked in `stats --json` and the report, one
// `report --json` and one `metrics` render timed at that size; then a reader process
// (`--reader`) renders `report --json` and `metrics` in turn, without pause, while the
// same matrix runs again. The "renders" column counts the reader's renders that
// overlapped the cell.
//
//   burst_bench [--quick] [--phases idle,loaded] [--cells R:B:T[:P],...]
//               [--spans N] [--max-seconds S] [--table-keys K] [--steps-per-filler S]
//               [--fill-parallel N] [--render-samples N] [--exited-fillers] [--verbose]
//
// A cell runs min(N, R x S) spans per thread (default N = 1,000,000, S = 2 s), rounded
// down to whole bursts (at least one). Exit status: 0 when every cell ran, whatever was
// dropped (the figures are printed, never judged); 1 on a harness failure (the daemon did
// not start, a child failed to run or connect, a pid is missing from the report, the
// table came out smaller than asked); 2 on bad arguments.
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cinttypes>
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

#include "bench/bench_support.h"
#include "tests/support/daemon_process.h"
#include "tests/support/fill_steps.h"

namespace {

using Clock = std::chrono::steady_clock;
using steptrace::bench::monotonic_ns;
using Values = std::map<std::string, long long>;

constexpr const char* kCauseNames[] = {"buffer_full", "not_connected", "in_flight", "invalid"};
constexpr int kCauseCount = STEPTRACE_DROP_CAUSE_COUNT;
constexpr const char* kStepName = "Transpose";  // STEPTRACE_TRANSPOSE, the spans of a cell

// ---- small shared helpers ----------------------------------------------------------------

void write_values(const std::string& path, const Values& values) {
  {
    std::ofstream out(path + ".tmp");
    for (const auto& [key, value] : values) out << key << ' ' << value << '\n';
  }
  std::rename((path + ".tmp").c_str(), path.c_str());
}

std::optional<Values> read_values(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  Values values;
  std::string key;
  long long value = 0;
  while (in >> key >> value) values[key] = value;
  return values;
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return {};
  return std::string(buf, static_cast<std::size_t>(n));
}

// This process's steptrace_dropped_by_cause, per cause.
std::optional<std::array<std::uint64_t, kCauseCount>> client_drops_by_cause() {
  std::array<std::uint64_t, kCauseCount> out{};
  for (int c = 0; c < kCauseCount; ++c) {
    out[static_cast<std::size_t>(c)] = steptrace_dropped_by_cause(c);
  }
  return out;
}

// ---- child: a trainer ---------------------------------------------------------------------

// burst_bench --trainer SOCKET OUTFILE RATE BURST THREADS SPANS_PER_THREAD
// Exit 0 once it has written OUTFILE (whatever was dropped or whether the final flush was
// acknowledged: those are figures), 3 when it could not connect or the warm-up flush
// failed, 64 on bad arguments.
int trainer_main(int argc, char** argv) {
  if (argc != 8) return 64;
  const std::string socket = argv[2];
  const std::string outfile = argv[3];
  const double rate = std::strtod(argv[4], nullptr);
  const std::uint64_t burst = std::strtoull(argv[5], nullptr, 10);
  const int threads = std::atoi(argv[6]);
  const std::uint64_t spans = std::strtoull(argv[7], nullptr, 10);
  if (rate <= 0 || burst == 0 || threads < 1 || spans == 0) return 64;

  Values out;
  out["pid"] = ::getpid();
  steptrace_set_block_when_full(0);  // the default mode, whatever the environment says
  out["connect_rc"] = steptrace_connect(socket.c_str());
  // Warm-up: the connection exists and is acknowledged before the first burst. One span
  // of another step, so it is not counted with the cell's spans.
  steptrace_start(STEPTRACE_WAIT_POLL);
  steptrace_end(STEPTRACE_WAIT_POLL);
  out["warmup_flush_rc"] = steptrace_flush(10000);
  if (out["connect_rc"] != 0 || out["warmup_flush_rc"] != 0) {
    write_values(outfile, out);
    return 3;
  }
  const std::uint64_t dropped_before = steptrace_dropped();

  const auto interval = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(static_cast<double>(burst) / rate));
  std::vector<long long> elapsed_ns(static_cast<std::size_t>(threads));
  std::vector<long long> late_bursts(static_cast<std::size_t>(threads));
  std::vector<std::thread> pool;
  const auto t0 = Clock::now() + std::chrono::milliseconds(5);  // all threads start together
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::this_thread::sleep_until(t0);
      auto next = t0;
      std::uint64_t left = spans;
      while (left > 0) {
        if (Clock::now() > next + interval) ++late_bursts[static_cast<std::size_t>(t)];
        const std::uint64_t n = std::min(left, burst);
        for (std::uint64_t i = 0; i < n; ++i) {
          steptrace_start(STEPTRACE_TRANSPOSE);
          steptrace_end(STEPTRACE_TRANSPOSE);
        }
        left -= n;
        next += interval;
        std::this_thread::sleep_until(next);  // also after the last burst: its share of time
      }
      elapsed_ns[static_cast<std::size_t>(t)] =
          std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
    });
  }
  for (auto& th : pool) th.join();
  const auto flush_start = Clock::now();
  out["flush_rc"] = steptrace_flush(10000);
  out["flush_ms"] =
      std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - flush_start).count();
  out["sent_events"] = static_cast<long long>(2 * spans * static_cast<std::uint64_t>(threads));
  out["dropped"] = static_cast<long long>(steptrace_dropped());
  out["dropped_before"] = static_cast<long long>(dropped_before);
  if (const auto causes = client_drops_by_cause()) {
    for (int c = 0; c < kCauseCount; ++c) {
      out[std::string("dropped_") + kCauseNames[c]] =
          static_cast<long long>((*causes)[static_cast<std::size_t>(c)]);
    }
  }
  out["record_ns_max"] = *std::max_element(elapsed_ns.begin(), elapsed_ns.end());
  long long late = 0;
  for (long long l : late_bursts) late += l;
  out["late_bursts"] = late;
  write_values(outfile, out);
  return 0;
}

// ---- child: a filler of the table ---------------------------------------------------------

// burst_bench --filler SOCKET OUTFILE STEPS STAY_S: registers STEPS custom steps, records
// one span of each, flushes, and writes "rc N" to OUTFILE (0: all of it acknowledged,
// nothing dropped). With STAY_S > 0 it then disconnects (steptrace_shutdown: no flusher
// thread left) and sleeps up to STAY_S seconds, or until SIGTERM or its parent's exit: the
// daemon keeps a disconnected process that still runs as alive, and only live processes
// have per-process series in `metrics`.
int filler_main(int argc, char** argv) {
  if (argc != 6) return 64;
  const std::string outfile = argv[3];
  const int steps = std::atoi(argv[4]);
  const int stay_s = std::atoi(argv[5]);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 7;  // the harness is gone already
  int rc = 0;
  if (steptrace_connect(argv[2]) != 0) rc = 3;
  if (rc == 0) rc = steptrace::testing::record_fill_steps(steps);
  if (rc == 0 && steptrace_flush(30000) != 0) rc = 5;
  if (rc == 0 && steptrace_dropped() != 0) rc = 6;
  if (stay_s > 0) steptrace_shutdown();
  write_values(outfile, {{"rc", rc}, {"pid", ::getpid()}});
  if (rc == 0 && stay_s > 0) ::sleep(static_cast<unsigned>(stay_s));
  return rc;
}

// ---- child: the reader ----------------------------------------------------------------------

// burst_bench --reader SOCKET LOGFILE STOPFILE: `report --json`, then `metrics`, in a
// loop until STOPFILE exists. One line per render in LOGFILE, written as it completes:
// "KIND START_NS END_NS BYTES OK" (KIND r or m; OK 1 when the reply looks whole).
int reader_main(int argc, char** argv) {
  if (argc != 5) return 64;
  const std::string socket = argv[2];
  std::FILE* log = std::fopen(argv[3], "w");
  if (log == nullptr) return 3;
  const std::string stopfile = argv[4];
  for (std::uint64_t i = 0; !file_exists(stopfile); ++i) {
    const bool json = i % 2 == 0;
    const std::uint64_t start = monotonic_ns();
    const auto reply =
        steptrace::testing::command(socket, json ? "report --json" : "metrics", 120000);
    const std::uint64_t end = monotonic_ns();
    const bool ok = reply && !reply->empty() && reply->back() == '\n' &&
                    (json ? reply->front() == '{' : reply->find("# TYPE") != std::string::npos);
    std::fprintf(log, "%c %" PRIu64 " %" PRIu64 " %zu %d\n", json ? 'r' : 'm', start, end,
                 reply ? reply->size() : 0, ok ? 1 : 0);
    std::fflush(log);
  }
  std::fclose(log);
  return 0;
}

// ---- the harness --------------------------------------------------------------------------

struct Cell {
  double rate = 0;  // spans/s per thread
  std::uint64_t burst = 0;
  int threads = 1;
  int procs = 1;
};

struct Options {
  bool quick = false;
  bool verbose = false;
  bool exited_fillers = false;
  bool idle = true;
  bool loaded = true;
  std::vector<Cell> cells;
  std::uint64_t spans = 1'000'000;
  double max_seconds = 2.0;
  int table_keys = 100'000;
  int steps_per_filler = 200;
  int fill_parallel = 16;
  int render_samples = 3;
};

struct Render {
  char kind = 'r';
  std::uint64_t start_ns = 0;
  std::uint64_t end_ns = 0;
  std::uint64_t bytes = 0;
  bool ok = false;
};

// What the daemon's report says about one process's spans of kStepName.
struct DaemonView {
  bool found = false;
  std::uint64_t delivered = 0;  // events: 2 x count + open + abandoned + depth_dropped + unmatched
  std::uint64_t dropped = 0;
  bool has_causes = false;
  std::array<std::uint64_t, kCauseCount> causes{};
};

struct CellResult {
  std::uint64_t spans_per_thread = 0;
  std::uint64_t sent = 0;
  DaemonView daemon;  // summed over the cell's processes
  std::uint64_t child_dropped = 0;
  bool child_has_causes = true;
  std::array<std::uint64_t, kCauseCount> child_causes{};
  int flush_failures = 0;
  double rate_achieved = 0;  // spans/s per thread, the slowest thread's
  long long late_bursts = 0;
  double seconds = 0;  // spawn to the last exit
  std::uint64_t start_ns = 0, end_ns = 0;
  bool harness_ok = true;
};

std::vector<Cell> default_cells(bool quick) {
  if (quick) {
    return {{20'000, 5'000, 1, 1},
            {1'000'000, 10'000, 2, 1},
            {2'000'000, 1'000, 1, 1},
            {100'000, 65'536, 1, 1},
            {1'000'000, 10'000, 1, 2}};
  }
  std::vector<Cell> cells;
  const std::pair<double, std::uint64_t> rate_burst[] = {
      {20'000, 5'000}, {1'000'000, 10'000}, {2'000'000, 1'000}, {100'000, 65'536}};
  for (const auto& [rate, burst] : rate_burst) {
    for (int threads : {1, 2, 4}) cells.push_back({rate, burst, threads, 1});
  }
  cells.push_back({1'000'000, 10'000, 2, 3});
  return cells;
}

std::optional<std::vector<Cell>> parse_cells(const std::string& text) {
  std::vector<Cell> cells;
  std::stringstream list(text);
  std::string item;
  while (std::getline(list, item, ',')) {
    Cell c;
    char sep1 = 0, sep2 = 0, sep3 = 0;
    std::istringstream in(item);
    if (!(in >> c.rate >> sep1 >> c.burst >> sep2 >> c.threads) || sep1 != ':' || sep2 != ':') {
      return std::nullopt;
    }
    if (in >> sep3) {
      if (sep3 != ':' || !(in >> c.procs)) return std::nullopt;
    }
    if (c.rate <= 0 || c.burst == 0 || c.threads < 1 || c.procs < 1) return std::nullopt;
    cells.push_back(c);
  }
  if (cells.empty()) return std::nullopt;
  return cells;
}

std::uint64_t spans_for(const Cell& cell, const Options& opt) {
  const auto cap = std::min(static_cast<double>(opt.spans), cell.rate * opt.max_seconds);
  const std::uint64_t bursts =
      std::max<std::uint64_t>(1, static_cast<std::uint64_t>(cap) / cell.burst);
  return bursts * cell.burst;
}

DaemonView daemon_view(const nlohmann::json& report, long long pid) {
  DaemonView view;
  for (const auto& p : report.value("processes", nlohmann::json::array())) {
    if (p.value("pid", -1LL) != pid) continue;
    view.found = true;
    view.dropped = p.value("dropped", std::uint64_t{0});
    if (p.contains("dropped_by_cause") && p["dropped_by_cause"].is_object()) {
      view.has_causes = true;
      for (int c = 0; c < kCauseCount; ++c) {
        view.causes[static_cast<std::size_t>(c)] =
            p["dropped_by_cause"].value(kCauseNames[c], std::uint64_t{0});
      }
    }
    for (const auto& s : p.value("steps", nlohmann::json::array())) {
      if (s.value("step", "") != kStepName) continue;
      auto field = [&s](const char* name) { return s.value(name, std::uint64_t{0}); };
      view.delivered = 2 * field("count") + field("open") + field("abandoned") +
                       field("depth_dropped") + field("unmatched_ends");
    }
  }
  return view;
}

std::string causes_text(bool has, const std::array<std::uint64_t, kCauseCount>& causes) {
  if (!has) return "-";
  std::string out;
  for (int c = 0; c < kCauseCount; ++c) {
    if (c > 0) out += '/';
    out += std::to_string(causes[static_cast<std::size_t>(c)]);
  }
  return out;
}

std::string rate_text(double rate) {
  char buf[32];
  if (rate >= 1e6) {
    std::snprintf(buf, sizeof buf, "%gM", rate / 1e6);
  } else if (rate >= 1e3) {
    std::snprintf(buf, sizeof buf, "%gk", rate / 1e3);
  } else {
    std::snprintf(buf, sizeof buf, "%g", rate);
  }
  return buf;
}

void print_header(bool with_renders) {
  std::printf("%-6s %6s %6s %3s %5s %9s %10s %10s %9s %-22s %9s %7s %5s %9s %5s %6s%s\n", "phase",
              "rate", "burst", "thr", "procs", "spans/thr", "sent", "delivered", "dropped",
              "by cause (report)", "child_drp", "unacct", "flush", "achieved", "late", "secs",
              with_renders ? " renders" : "");
}

void print_row(const char* phase, const Cell& cell, const CellResult& r, bool with_renders,
               int renders) {
  const long long unaccounted = static_cast<long long>(r.sent) -
                                static_cast<long long>(r.daemon.delivered) -
                                static_cast<long long>(r.daemon.dropped);
  std::printf("%-6s %6s %6" PRIu64 " %3d %5d %9" PRIu64 " %10" PRIu64 " %10" PRIu64 " %9" PRIu64
              " %-22s %9" PRIu64 " %7lld %5s %9s %5lld %6.2f",
              phase, rate_text(cell.rate).c_str(), cell.burst, cell.threads, cell.procs,
              r.spans_per_thread, r.sent, r.daemon.delivered, r.daemon.dropped,
              causes_text(r.daemon.has_causes, r.daemon.causes).c_str(), r.child_dropped,
              unaccounted, r.flush_failures == 0 ? "ok" : "FAIL",
              rate_text(r.rate_achieved).c_str(), r.late_bursts, r.seconds);
  if (with_renders) std::printf(" %7d", renders);
  std::printf("%s\n", r.harness_ok ? "" : "  (harness failure, see stderr)");
  std::fflush(stdout);
}

class Harness {
 public:
  Harness(Options opt, std::string exe, std::string socket, std::string dir)
      : opt_(std::move(opt)),
        exe_(std::move(exe)),
        socket_(std::move(socket)),
        dir_(std::move(dir)) {}

  CellResult run_cell(const Cell& cell) {
    CellResult r;
    r.spans_per_thread = spans_for(cell, opt_);
    r.sent = 2 * r.spans_per_thread * static_cast<std::uint64_t>(cell.threads) *
             static_cast<std::uint64_t>(cell.procs);
    std::vector<pid_t> pids;
    std::vector<std::string> outs;
    r.start_ns = monotonic_ns();
    const auto t0 = Clock::now();
    for (int p = 0; p < cell.procs; ++p) {
      outs.push_back(dir_ + "/trainer-" + std::to_string(serial_++));
      char rate[32];
      std::snprintf(rate, sizeof rate, "%.0f", cell.rate);
      pids.push_back(steptrace::testing::spawn_process(
          {exe_, "--trainer", socket_, outs.back(), rate, std::to_string(cell.burst),
           std::to_string(cell.threads), std::to_string(r.spans_per_thread)}));
    }
    std::vector<int> statuses;
    for (pid_t pid : pids) {
      statuses.push_back(pid > 0 ? steptrace::testing::wait_or_kill(pid, 300000) : -1);
    }
    r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    r.end_ns = monotonic_ns();
    r.rate_achieved = 1e300;
    for (std::size_t p = 0; p < pids.size(); ++p) {
      const auto v = read_values(outs[p]);
      if (statuses[p] != 0 || !v) {
        std::fprintf(stderr, "trainer %zu of the cell: exit status %d%s\n", p, statuses[p],
                     v ? " (connect or warm-up flush failed)" : ", no results");
        if (v) {
          for (const auto& [k, val] : *v) std::fprintf(stderr, "  %s %lld\n", k.c_str(), val);
        }
        r.harness_ok = false;
        continue;
      }
      if (opt_.verbose) {
        std::printf("  child:");
        for (const auto& [k, val] : *v) std::printf(" %s=%lld", k.c_str(), val);
        std::printf("\n");
      }
      r.child_dropped += static_cast<std::uint64_t>(v->at("dropped"));
      if (v->at("flush_rc") != 0) ++r.flush_failures;
      r.late_bursts += v->at("late_bursts");
      const double secs = static_cast<double>(v->at("record_ns_max")) / 1e9;
      r.rate_achieved =
          std::min(r.rate_achieved, static_cast<double>(r.spans_per_thread) / std::max(secs, 1e-9));
      if (!v->contains("dropped_buffer_full")) r.child_has_causes = false;
      for (int c = 0; c < kCauseCount; ++c) {
        const auto it = v->find(std::string("dropped_") + kCauseNames[c]);
        if (it != v->end()) {
          r.child_causes[static_cast<std::size_t>(c)] += static_cast<std::uint64_t>(it->second);
        }
      }
      // After a failed flush the daemon may still be reading what the child wrote.
      if (v->at("flush_rc") != 0) std::this_thread::sleep_for(std::chrono::seconds(1));
      const long long pid = v->at("pid");
      const auto report =
          steptrace::bench::daemon_json(socket_, "report --json --pid " + std::to_string(pid));
      const DaemonView view = report ? daemon_view(*report, pid) : DaemonView{};
      if (!view.found) {
        std::fprintf(stderr, "pid %lld is missing from the daemon's report\n", pid);
        r.harness_ok = false;
        continue;
      }
      r.daemon.delivered += view.delivered;
      r.daemon.dropped += view.dropped;
      r.daemon.has_causes = view.has_causes;
      for (int c = 0; c < kCauseCount; ++c) {
        r.daemon.causes[static_cast<std::size_t>(c)] += view.causes[static_cast<std::size_t>(c)];
      }
    }
    if (r.rate_achieved > 1e299) r.rate_achieved = 0;
    return r;
  }

  // Spawns `count` fillers, `fill_parallel` at a time, each waited for until it has
  // written its result (and, unless --exited-fillers, stays running). False when one failed.
  bool fill(int count) {
    int failed = 0;
    const int stay_s = opt_.exited_fillers ? 0 : 3600;
    for (int started = 0; started < count;) {
      std::vector<std::pair<pid_t, std::string>> wave;
      for (int i = 0; i < opt_.fill_parallel && started < count; ++i, ++started) {
        const std::string out = dir_ + "/filler-" + std::to_string(started);
        const pid_t pid = steptrace::testing::spawn_process({exe_, "--filler", socket_, out,
                                                             std::to_string(opt_.steps_per_filler),
                                                             std::to_string(stay_s)});
        if (pid <= 0) {
          ++failed;
          continue;
        }
        wave.emplace_back(pid, out);
      }
      for (const auto& [pid, out] : wave) {
        const auto deadline = Clock::now() + std::chrono::seconds(120);
        std::optional<Values> v;
        int status = -1;
        while (!(v = read_values(out)) && Clock::now() < deadline) {
          status = steptrace::testing::wait_process(pid, 0);
          if (status >= 0) break;  // exited without a result
          std::this_thread::sleep_for(std::chrono::milliseconds(2));
        }
        if (stay_s > 0 && status < 0) {
          fillers_.push_back(pid);
        } else if (status < 0) {
          status = steptrace::testing::wait_process(pid, 60000);
        }
        if (!v || v->at("rc") != 0) {
          ++failed;
          if (failed <= 5) {
            std::fprintf(stderr, "filler %d failed: rc %lld, exit status %d\n",
                         static_cast<int>(pid), v ? v->at("rc") : -1LL, status);
          }
        }
      }
    }
    if (failed > 0) std::fprintf(stderr, "%d filler processes failed\n", failed);
    return failed == 0;
  }

  // SIGTERM to the fillers still running, and waits for them.
  void stop_fillers() {
    for (pid_t pid : fillers_) ::kill(pid, SIGTERM);
    for (pid_t pid : fillers_) {
      if (steptrace::testing::wait_process(pid, 10000) < 0) {
        ::kill(pid, SIGKILL);
        steptrace::testing::wait_process(pid, 10000);
      }
    }
    fillers_.clear();
  }

  ~Harness() { stop_fillers(); }
  Harness(const Harness&) = delete;
  Harness& operator=(const Harness&) = delete;

 private:
  Options opt_;
  std::string exe_;
  std::string socket_;
  std::string dir_;
  int serial_ = 0;
  std::vector<pid_t> fillers_;  // running (--exited-fillers not given)
};

std::vector<Render> read_renders(const std::string& path) {
  std::vector<Render> renders;
  std::ifstream in(path);
  Render r;
  int ok = 0;
  while (in >> r.kind >> r.start_ns >> r.end_ns >> r.bytes >> ok) {
    r.ok = ok != 0;
    renders.push_back(r);
  }
  return renders;
}

double median_ms(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `command` `samples` times in a row; prints the median and the reply's size.
void time_render(const std::string& socket, const std::string& command, int samples) {
  std::vector<double> ms;
  std::size_t bytes = 0;
  for (int i = 0; i < samples; ++i) {
    const auto t0 = Clock::now();
    const auto reply = steptrace::testing::command(socket, command, 120000);
    ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    bytes = reply ? reply->size() : 0;
  }
  std::printf("  %-14s %9.1f ms (median of %d, request to last byte), %.1f MiB\n", command.c_str(),
              median_ms(ms), samples, static_cast<double>(bytes) / (1024.0 * 1024.0));
}

void usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s [--quick] [--phases idle,loaded] [--cells R:B:T[:P],...] [--spans N]\n"
               "          [--max-seconds S] [--table-keys K] [--steps-per-filler S]\n"
               "          [--fill-parallel N] [--render-samples N] [--exited-fillers]\n"
               "          [--verbose]\n",
               argv0);
}

std::optional<Options> parse_options(int argc, char** argv) {
  Options opt;
  bool cells_given = false, keys_given = false, seconds_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--quick") {
      opt.quick = true;
    } else if (arg == "--verbose") {
      opt.verbose = true;
    } else if (arg == "--exited-fillers") {
      opt.exited_fillers = true;
    } else if (arg == "--phases" && has_value) {
      const std::string p = argv[++i];
      opt.idle = p.find("idle") != std::string::npos;
      opt.loaded = p.find("loaded") != std::string::npos;
      if (!opt.idle && !opt.loaded) return std::nullopt;
    } else if (arg == "--cells" && has_value) {
      auto cells = parse_cells(argv[++i]);
      if (!cells) return std::nullopt;
      opt.cells = *cells;
      cells_given = true;
    } else if (arg == "--spans" && has_value) {
      opt.spans = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--max-seconds" && has_value) {
      opt.max_seconds = std::strtod(argv[++i], nullptr);
      seconds_given = true;
    } else if (arg == "--table-keys" && has_value) {
      opt.table_keys = std::atoi(argv[++i]);
      keys_given = true;
    } else if (arg == "--steps-per-filler" && has_value) {
      opt.steps_per_filler = std::atoi(argv[++i]);
    } else if (arg == "--fill-parallel" && has_value) {
      opt.fill_parallel = std::atoi(argv[++i]);
    } else if (arg == "--render-samples" && has_value) {
      opt.render_samples = std::atoi(argv[++i]);
    } else {
      return std::nullopt;
    }
  }
  if (!cells_given) opt.cells = default_cells(opt.quick);
  if (opt.quick && !keys_given) opt.table_keys = 20'000;
  if (opt.quick && !seconds_given) opt.max_seconds = 1.0;
  if (opt.spans == 0 || opt.max_seconds <= 0 || opt.table_keys < 0 || opt.steps_per_filler < 1 ||
      opt.steps_per_filler > 1024 || opt.fill_parallel < 1 || opt.render_samples < 1) {
    return std::nullopt;
  }
  return opt;
}

int harness_main(int argc, char** argv) {
  const auto parsed = parse_options(argc, argv);
  if (!parsed) {
    usage(argv[0]);
    return 2;
  }
  const Options opt = *parsed;
  const std::string exe = self_exe();
  if (exe.empty()) {
    std::fprintf(stderr, "cannot read /proc/self/exe\n");
    return 1;
  }
  const int fillers =
      opt.table_keys == 0 ? 0 : (opt.table_keys + opt.steps_per_filler - 1) / opt.steps_per_filler;
  const int trainers_max = 2 * static_cast<int>(opt.cells.size()) * 8 + 100;

  steptrace::testing::TempDir dir;
  const std::string config = dir.file("steptraced.json");
  {
    std::ofstream out(config);
    out << nlohmann::json{{"limits",
                           {{"max_processes", fillers + trainers_max + 1000},
                            {"max_exited_processes", fillers + trainers_max + 500}}}}
               .dump(2);
  }
  const std::string socket = dir.file("steptraced.sock");
  steptrace::testing::DaemonProcess daemon(socket, {"--config", config});
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  std::printf("machine: %s; load average: ", steptrace::bench::machine_description().c_str());
  {
    std::ifstream load("/proc/loadavg");
    std::string a, b, c;
    load >> a >> b >> c;
    std::printf("%s %s %s\n", a.c_str(), b.c_str(), c.c_str());
  }
  std::printf(
      "burst_bench: %zu cells per phase, spans per thread = min(%" PRIu64
      ", rate x %.1f s) in whole bursts; default client mode (never blocking); daemon pid %d\n",
      opt.cells.size(), opt.spans, opt.max_seconds, static_cast<int>(daemon.pid()));
  std::printf(
      "columns: rate = spans/s per thread; sent/delivered/dropped/unacct in events (2 per "
      "span); dropped = the report's \"dropped\"; by cause = "
      "buffer_full/not_connected/in_flight/invalid from the report's \"dropped_by_cause\" "
      "(- when absent); child_drp = the children's steptrace_dropped(); unacct = sent - "
      "delivered - dropped; flush = steptrace_flush(10000) after the last burst; achieved = "
      "the slowest thread's spans/s; late = bursts that started over one interval late; "
      "secs = spawn to exit\n\n");
  std::fflush(stdout);

  Harness harness(opt, exe, socket, dir.path());
  bool harness_ok = true;
  auto note = [&harness_ok](const CellResult& r) { harness_ok = harness_ok && r.harness_ok; };

  if (opt.idle) {
    std::printf("== phase idle: the daemon does nothing else\n");
    print_header(false);
    for (const Cell& cell : opt.cells) {
      const CellResult r = harness.run_cell(cell);
      note(r);
      print_row("idle", cell, r, false, 0);
    }
    std::printf("\n");
  }

  if (opt.loaded) {
    std::printf("== phase loaded: table of %d keys (%d filler processes x %d custom steps, %s)\n",
                fillers * opt.steps_per_filler, fillers, opt.steps_per_filler,
                opt.exited_fillers ? "exited: in the report, not in metrics"
                                   : "kept running, disconnected: in the report and in metrics");
    std::fflush(stdout);
    const auto fill_t0 = Clock::now();
    if (!harness.fill(fillers)) harness_ok = false;
    std::printf("  filled in %.1f s\n",
                std::chrono::duration<double>(Clock::now() - fill_t0).count());
    const auto stats = steptrace::bench::daemon_json(socket, "stats --json");
    if (!stats) return 1;
    const auto custom_steps =
        stats->value(nlohmann::json::json_pointer("/custom_steps"), std::uint64_t{0});
    const auto tracked =
        stats->value(nlohmann::json::json_pointer("/processes/tracked"), std::uint64_t{0});
    const auto live =
        stats->value(nlohmann::json::json_pointer("/processes/live"), std::uint64_t{0});
    const auto report = steptrace::bench::daemon_json(socket, "report --json");
    if (!report) return 1;
    std::uint64_t keys = 0;
    for (const auto& p : report->value("processes", nlohmann::json::array())) {
      keys += p.value("steps", nlohmann::json::array()).size();
    }
    std::printf("  stats --json: %" PRIu64 " processes tracked (%" PRIu64 " live), %" PRIu64
                " custom steps; report --json: %" PRIu64 " keys (process x step with data)\n",
                tracked, live, custom_steps, keys);
    const std::uint64_t want = static_cast<std::uint64_t>(fillers * opt.steps_per_filler);
    if (custom_steps < want || keys < want) {
      std::fprintf(stderr, "the table has fewer keys than the %" PRIu64 " asked for\n", want);
      harness_ok = false;
    }
    std::printf("  render times at this size, nothing else running:\n");
    time_render(socket, "report --json", opt.render_samples);
    time_render(socket, "metrics", opt.render_samples);

    const std::string reader_log = dir.file("reader.log");
    const std::string stopfile = dir.file("reader.stop");
    const pid_t reader =
        steptrace::testing::spawn_process({exe, "--reader", socket, reader_log, stopfile});
    // Wait for its first render, so it is busy from the first cell on.
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    while (read_renders(reader_log).empty() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const std::uint64_t matrix_start = monotonic_ns();
    std::printf("  reader pid %d renders report --json and metrics in a loop\n",
                static_cast<int>(reader));
    print_header(true);
    for (const Cell& cell : opt.cells) {
      const CellResult r = harness.run_cell(cell);
      note(r);
      // Renders are counted when the cell ends; one still running is counted then if it
      // started during the cell.
      int overlapping = 0;
      for (const Render& x : read_renders(reader_log)) {
        if (x.start_ns < r.end_ns && x.end_ns > r.start_ns) ++overlapping;
      }
      print_row("loaded", cell, r, true, overlapping);
    }
    const std::uint64_t matrix_end = monotonic_ns();
    std::ofstream(stopfile) << "stop\n";
    const int reader_status = steptrace::testing::wait_process(reader, 300000);
    if (reader_status != 0) {
      std::fprintf(stderr, "reader exit status %d\n", reader_status);
      if (reader_status < 0) ::kill(reader, SIGKILL);
      harness_ok = false;
    }
    std::vector<double> report_ms, metrics_ms;
    int bad = 0;
    for (const Render& x : read_renders(reader_log)) {
      if (!x.ok) ++bad;
      if (x.end_ns <= matrix_start || x.start_ns >= matrix_end) continue;
      (x.kind == 'r' ? report_ms : metrics_ms)
          .push_back(static_cast<double>(x.end_ns - x.start_ns) / 1e6);
    }
    auto max_of = [](const std::vector<double>& v) {
      return v.empty() ? 0.0 : *std::max_element(v.begin(), v.end());
    };
    std::printf(
        "  reader during the matrix (%.1f s): %zu renders of report --json (median %.1f ms, "
        "max %.1f ms), %zu of metrics (median %.1f ms, max %.1f ms); %d incomplete replies\n\n",
        static_cast<double>(matrix_end - matrix_start) / 1e9, report_ms.size(),
        median_ms(report_ms), max_of(report_ms), metrics_ms.size(), median_ms(metrics_ms),
        max_of(metrics_ms), bad);
    if (bad > 0) harness_ok = false;
    harness.stop_fillers();
  }

  daemon.stop();
  if (!harness_ok) {
    std::fprintf(stderr, "BURST BENCH: harness failures (see above); figures incomplete\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--trainer") return trainer_main(argc, argv);
  if (mode == "--filler") return filler_main(argc, argv);
  if (mode == "--reader") return reader_main(argc, argv);
  return harness_main(argc, argv);
}
