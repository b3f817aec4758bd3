// A test trainer: a real process using libsteptrace (shared) the way a training loop
// does, its behaviour chosen by argv. Used by client_integration_test and
// client_job_integration_test (which sets its job and rank in its environment).
//
//   steptrace_test_trainer MODE SOCKET OUTFILE [ARGS...]
//
// Writes "key value" lines to OUTFILE (pid, recorded events, dropped, ...), and exits
// 0 when everything it could check itself held (connect/flush results, drop counts).
#include <dirent.h>
#include <fcntl.h>
#include <steptrace/steptrace.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <steptrace/steptrace.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

struct Out {
  std::map<std::string, long long> values;
  void set(const std::string& k, long long v) { values[k] = v; }
  void write(const std::string& path) const {
    std::ofstream f(path + ".tmp");
    for (const auto& [k, v] : values) f << k << ' ' << v << '\n';
    f.close();
    std::rename((path + ".tmp").c_str(), path.c_str());
  }
};

// KEY (steptrace_dropped) and KEY_<cause> for each steptrace_drop_cause.
void set_dropped(Out& out, const std::string& key) {
  static constexpr const char* kCauses[STEPTRACE_DROP_CAUSE_COUNT] = {
      "buffer_full", "not_connected", "in_flight", "invalid"};
  out.set(key, static_cast<long long>(steptrace_dropped()));
  for (int c = 0; c < STEPTRACE_DROP_CAUSE_COUNT; ++c) {
    out.set(key + "_" + kCauses[c], static_cast<long long>(steptrace_dropped_by_cause(c)));
  }
}

void fail(const char* what) {
  std::fprintf(stderr, "trainer %d: %s\n", static_cast<int>(getpid()), what);
  std::exit(2);
}

// Flushes until it succeeds or the deadline passes (the daemon may be reconnecting).
bool flush_until(int total_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(total_ms);
  while (Clock::now() < deadline) {
    if (steptrace_flush(1000) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

// N spans of `step`, flushing every 1000 so no ring ever fills (exact delivery).
void paced_spans(std::uint32_t step, int n) {
  for (int i = 0; i < n; ++i) {
    steptrace::Span span(step);
    if ((i + 1) % 1000 == 0 && steptrace_flush(10000) != 0) fail("periodic flush failed");
  }
}

long long monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1'000'000'000LL + ts.tv_nsec;
}

// Time this thread has spent runnable but waiting for a CPU, in ns; -1 when the kernel
// does not say (/proc/thread-self/schedstat needs CONFIG_SCHED_INFO).
long long run_queue_wait_ns() {
  const int fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return -1;
  char buf[128];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return -1;
  buf[n] = '\0';
  unsigned long long on_cpu = 0, waiting = 0;
  if (std::sscanf(buf, "%llu %llu", &on_cpu, &waiting) != 2) return -1;
  return static_cast<long long>(waiting);
}

// N spans of `step`, each steptrace_start/steptrace_end call timed on its own.
// longest_ns is the longest call. On a loaded machine that is mostly preemption, so
// longest_unqueued_ns takes off what the thread spent waiting for a CPU meanwhile (read
// for slow calls only, counted from the start of their batch of 1024 spans): what is
// left is time the call itself ran or slept.
struct CallTimes {
  long long longest_ns = 0;
  long long longest_unqueued_ns = 0;
  long long over_1ms = 0;
  long long voluntary_switches = 0;  // the thread gave up its CPU itself (slept, blocked)
};

// This thread's voluntary context switches so far (-1: unreadable).
long long voluntary_switches() {
  std::ifstream in("/proc/thread-self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("voluntary_ctxt_switches:", 0) == 0) return std::atoll(line.c_str() + 24);
  }
  return -1;
}
CallTimes timed_spans(std::uint32_t step, int n) {
  constexpr long long kSlowNs = 1'000'000;
  CallTimes times;
  long long batch_wait = -1;
  auto note = [&](long long ns) {
    times.longest_ns = std::max(times.longest_ns, ns);
    long long unqueued = ns;
    if (ns > kSlowNs) {
      ++times.over_1ms;
      const long long wait = batch_wait < 0 ? -1 : run_queue_wait_ns();
      if (wait >= 0) unqueued = ns - (wait - batch_wait);
    }
    times.longest_unqueued_ns = std::max(times.longest_unqueued_ns, unqueued);
  };
  const long long switches0 = voluntary_switches();
  for (int i = 0; i < n; ++i) {
    if (i % 1024 == 0) batch_wait = run_queue_wait_ns();
    const long long t0 = monotonic_ns();
    steptrace_start(step);
    const long long t1 = monotonic_ns();
    steptrace_end(step);
    const long long t2 = monotonic_ns();
    note(t1 - t0);
    note(t2 - t1);
  }
  const long long switches1 = voluntary_switches();
  times.voluntary_switches = switches0 < 0 || switches1 < 0 ? -1 : switches1 - switches0;
  return times;
}

// How long f() took, minus what this thread spent waiting for a CPU meanwhile (the raw
// time when the kernel does not report that).
template <class F>
long long unqueued_call_ns(F&& f) {
  const long long wait0 = run_queue_wait_ns();
  const long long t0 = monotonic_ns();
  f();
  const long long took = monotonic_ns() - t0;
  const long long wait1 = run_queue_wait_ns();
  return wait0 < 0 || wait1 < 0 ? took : took - (wait1 - wait0);
}

long long vm_rss_kib() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::atoll(line.c_str() + 6);
  }
  return -1;
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s MODE SOCKET OUTFILE [ARGS...]\n", argv[0]);
    return 64;
  }
  const std::string mode = argv[1];
  const std::string socket = argv[2];
  const std::string outfile = argv[3];
  auto arg = [&](int i, int def) { return argc > i ? std::atoi(argv[i]) : def; };
  Out out;
  out.set("pid", getpid());

  if (mode == "basic") {  // N Forward spans + N spans of a custom step, exact
    const int n = arg(4, 1000);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    const std::uint32_t custom = steptrace_register_step("Tokenize");
    if (custom == UINT32_MAX) fail("register");
    paced_spans(STEPTRACE_FORWARD, n);
    paced_spans(custom, n);
    if (steptrace_flush(10000) != 0) fail("flush");
    set_dropped(out, "dropped");
  } else if (mode == "threads") {  // T threads x N Matmul spans, exact
    const int threads = arg(4, 8);
    const int n = arg(5, 1000);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([n] { paced_spans(STEPTRACE_MATMUL, n); });
    for (auto& t : pool) t.join();  // thread exit hands each ring to the flusher
    if (steptrace_flush(10000) != 0) fail("flush");
    set_dropped(out, "dropped");
  } else if (mode == "nested") {  // Forward { Attention { Matmul Matmul } } x N
    const int n = arg(4, 500);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    for (int i = 0; i < n; ++i) {
      steptrace::Span forward(steptrace::Step::kForward);
      steptrace::Span attention(steptrace::Step::kAttention);
      { steptrace::Span m(steptrace::Step::kMatmul); }
      { steptrace::Span m(steptrace::Step::kMatmul); }
      if ((i + 1) % 500 == 0 && steptrace_flush(10000) != 0) fail("flush");
    }
    if (steptrace_flush(10000) != 0) fail("flush");
    set_dropped(out, "dropped");
  } else if (mode == "nested_same") {  // Forward { BEFORE; Forward { INNER }; AFTER } x N
    // ARGS: N INNER_MS BEFORE_MS AFTER_MS [matmul] (sleeps). Matched as a stack, the inner
    // span lasts INNER and the outer BEFORE + INNER + AFTER; matched first-in-first-out,
    // both would last at least INNER + min(BEFORE, AFTER). With "matmul" the inner span
    // is a Matmul (the outer one's self time is then BEFORE + AFTER).
    const int n = arg(4, 8);
    const std::chrono::milliseconds inner_ms(arg(5, 10));
    const std::chrono::milliseconds before_ms(arg(6, 40));
    const std::chrono::milliseconds after_ms(arg(7, 40));
    const steptrace::Step inner_step = argc > 8 && std::string(argv[8]) == "matmul"
                                           ? steptrace::Step::kMatmul
                                           : steptrace::Step::kForward;
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    for (int i = 0; i < n; ++i) {
      steptrace::Span outer(steptrace::Step::kForward);
      std::this_thread::sleep_for(before_ms);
      {
        steptrace::Span inner(inner_step);
        std::this_thread::sleep_for(inner_ms);
      }
      std::this_thread::sleep_for(after_ms);
    }
    if (steptrace_flush(10000) != 0) fail("flush");
    set_dropped(out, "dropped");
  } else if (mode == "hold") {  // N x Forward { Matmul }, flushed; alive until RELEASE exists
    // ARGS: N RELEASE. OUTFILE is written once the daemon has applied every span; the
    // process then stays connected, recording nothing more, until the file RELEASE
    // exists (exit 0) or 120 s passed (exit 3).
    const int n = arg(4, 100);
    if (argc < 6) fail("hold needs N RELEASE");
    const std::string release = argv[5];
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    for (int i = 0; i < n; ++i) {
      steptrace::Span forward(steptrace::Step::kForward);
      { steptrace::Span matmul(steptrace::Step::kMatmul); }
      if ((i + 1) % 1000 == 0 && steptrace_flush(10000) != 0) fail("periodic flush");
    }
    if (steptrace_flush(10000) != 0) fail("flush");
    if (steptrace_dropped() != 0) fail("dropped events");
    set_dropped(out, "dropped");
    out.write(outfile);
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    while (!file_exists(release)) {
      if (Clock::now() > deadline) return 3;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return 0;
  } else if (mode == "fork") {  // parent Forward, child Backward; nothing sent twice
    // SOCKET "auto": no steptrace_connect, the parent auto-connects ($STEPTRACE_SOCKET).
    const int n = arg(4, 1000);
    if (socket != "auto" && steptrace_connect(socket.c_str()) != 0) fail("connect");
    paced_spans(STEPTRACE_FORWARD, n);
    // Recorded but maybe not yet sent when fork() copies the buffers.
    for (int i = 0; i < 100; ++i) steptrace::Span span(steptrace::Step::kForward);
    const pid_t child = fork();
    if (child < 0) fail("fork");
    if (child == 0) {
      if (steptrace_dropped() != 0) _exit(3);
      paced_spans(STEPTRACE_BACKWARD, n);
      if (steptrace_flush(10000) != 0) _exit(4);
      _exit(steptrace_dropped() == 0 ? 0 : 5);
    }
    int status = 0;
    if (waitpid(child, &status, 0) != child) fail("waitpid");
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) fail("child failed");
    if (steptrace_flush(10000) != 0) fail("flush");
    out.set("child", child);
    set_dropped(out, "dropped");
  } else if (mode == "late") {  // daemon absent at start; the test starts it later
    const int before = arg(4, 10000);
    const int after = arg(5, 1000);
    const auto t0 = Clock::now();
    const long long switches0 = voluntary_switches();
    int rc = 0;
    // Every call is timed on its own: none may wait for the absent daemon.
    const long long connect_ns = unqueued_call_ns([&] { rc = steptrace_connect(socket.c_str()); });
    out.set("connect_rc", rc);
    const CallTimes spans = timed_spans(STEPTRACE_FORWARD, before);
    const long long ledger_ns =
        unqueued_call_ns([] { steptrace_ledger_reserve("GPU-late", 1, 4096, "late-task"); });
    const long long switches1 = voluntary_switches();
    // Sleeping, or blocking on a lock or the socket, is a voluntary context switch of this
    // thread; being preempted is not.
    out.set("phase1_voluntary_switches",
            switches0 < 0 || switches1 < 0 ? -1 : switches1 - switches0);
    out.set("phase1_ms",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    out.set("connect_unqueued_ns", connect_ns);
    out.set("max_call_ns", spans.longest_ns);
    out.set("max_call_unqueued_ns", std::max(spans.longest_unqueued_ns, ledger_ns));
    set_dropped(out, "dropped_phase1");
    out.write(outfile + ".phase1");
    if (!flush_until(20000)) fail("never reconnected");
    paced_spans(STEPTRACE_FORWARD, after);
    if (steptrace_flush(10000) != 0) fail("final flush");
    out.set("recorded_events", 2LL * (before + after));
    set_dropped(out, "dropped");
  } else if (mode == "restart") {  // the daemon is stopped or killed and restarted meanwhile
    const std::string go = outfile + ".go";
    const int rounds = arg(4, 400);
    const bool outer = arg(5, 0) != 0;  // one Forward span open across the restart
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    std::optional<steptrace::Span> forward;
    if (outer) forward.emplace(steptrace::Step::kForward);
    out.write(outfile + ".phase1");
    long long spans = outer ? 1 : 0;
    // Keep recording at a steady pace until the test says the daemon is back, then a
    // little more.
    for (int r = 0; r < rounds || !file_exists(go); ++r) {
      for (int i = 0; i < 200; ++i, ++spans) steptrace::Span span(steptrace::Step::kTransfer);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (r > 100000) fail("no go file");
    }
    forward.reset();
    if (!flush_until(20000)) fail("never reconnected");
    out.set("recorded_events", 2 * spans);
    set_dropped(out, "dropped");
  } else if (mode == "stopped") {  // the daemon is SIGSTOPped: nothing may block
    const int n = arg(4, 2000000);
    const int rc = steptrace_connect(socket.c_str());
    out.set("connect_rc", rc);
    steptrace_set_block_when_full(arg(5, 0));
    const long long rss_before = vm_rss_kib();
    const auto t0 = Clock::now();
    std::vector<std::thread> pool;
    for (int t = 0; t < 2; ++t) {
      pool.emplace_back([n] {
        for (int i = 0; i < n; ++i) steptrace::Span span(steptrace::Step::kForward);
      });
    }
    for (auto& t : pool) t.join();
    out.set("record_ms",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    const int flush_rc = steptrace_flush(100);
    out.set("flush_rc", flush_rc);
    out.set("rss_before_kib", rss_before);
    out.set("rss_after_kib", vm_rss_kib());
    out.set("recorded_events", 4LL * n);
    set_dropped(out, "dropped");
  } else if (mode == "nonblocking") {  // the default mode against a SIGSTOPped daemon
    // ARGS: THREADS SPANS_PER_THREAD [BLOCK_WHEN_FULL]. Writes OUTFILE.phase1 once the
    // recording is done (the test then sends SIGCONT), then flushes until the daemon
    // has everything, including the final drop count.
    const int threads = arg(4, 3);
    const int n = arg(5, 1000000);
    out.set("connect_rc", steptrace_connect(socket.c_str()));
    steptrace_set_block_when_full(arg(6, 0));
    std::vector<CallTimes> times(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    pool.reserve(times.size());
    const long long rss_before = vm_rss_kib();
    const auto t0 = Clock::now();
    for (auto& t : times) pool.emplace_back([&t, n] { t = timed_spans(STEPTRACE_FORWARD, n); });
    for (auto& t : pool) t.join();
    out.set("record_ms",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    out.set("rss_before_kib", rss_before);
    out.set("rss_after_kib", vm_rss_kib());
    long long longest = 0, longest_unqueued = 0, over_1ms = 0, switches = 0;
    for (const auto& t : times) {
      longest = std::max(longest, t.longest_ns);
      longest_unqueued = std::max(longest_unqueued, t.longest_unqueued_ns);
      over_1ms += t.over_1ms;
      switches = t.voluntary_switches < 0 ? -1 : std::max(switches, t.voluntary_switches);
    }
    out.set("max_voluntary_switches", switches);
    out.set("max_call_ns", longest);
    out.set("max_call_unqueued_ns", longest_unqueued);
    out.set("calls_over_1ms", over_1ms);
    out.set("recorded_events", 2LL * threads * n);
    set_dropped(out, "dropped_phase1");
    out.write(outfile + ".phase1");
    if (!flush_until(30000)) fail("no flush acknowledged after SIGCONT");
    set_dropped(out, "dropped");
  } else if (mode == "burst") {  // THREADS x SPANS Forward spans in a tight loop, unpaced
    // No pacing: far faster than the flusher and the daemon drain, so the default mode
    // drops most of it. Then one ledger annotation and one flush, whatever their results
    // (the test sets STEPTRACE_DISABLE / STEPTRACE_BLOCK_WHEN_FULL and judges them).
    // Each call is timed: max_call_ns shows whether a full ring's bounded wait ran out.
    const int threads = arg(4, 2);
    const int n = arg(5, 200000);
    out.set("connect_rc", steptrace_connect(socket.c_str()));
    std::vector<CallTimes> times(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    for (auto& t : times) pool.emplace_back([&t, n] { t = timed_spans(STEPTRACE_FORWARD, n); });
    for (auto& t : pool) t.join();
    long long longest = 0;
    for (const auto& t : times) longest = std::max(longest, t.longest_ns);
    out.set("max_call_ns", longest);
    steptrace_ledger_reserve("GPU-burst", 1, 4096, "burst-task");
    out.set("flush_rc", steptrace_flush(30000));
    out.set("recorded_events", 2LL * threads * n);
    set_dropped(out, "dropped");
  } else if (mode == "bursts") {  // THREADS x BURSTS bursts of SPANS spans, one per PERIOD_MS
    // Unpaced within a burst (as fast as the loop goes), bursts started PERIOD_MS apart,
    // each after the daemon took the one before (a flush), the first after a warm-up span
    // and a flush (the daemon maps the thread's ring): the default buffers must take each
    // burst whole while the daemon drains it. recorded_events counts the warm-ups.
    const int threads = arg(4, 2);
    const int bursts = arg(5, 4);
    const int n = arg(6, 65536);
    const int period_ms = arg(7, 50);
    out.set("connect_rc", steptrace_connect(socket.c_str()));
    std::vector<long long> longest(static_cast<std::size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        // The thread's ring is made by its first event and handed to the daemon by the
        // flusher thread: a flush answered means the daemon maps it. Without this the
        // first bursts wait unread in a ring nobody consumes for as long as a loaded
        // machine keeps the flusher from running.
        { steptrace::Span warm_up(steptrace::Step::kForward); }
        if (steptrace_flush(30000) != 0) fail("warm-up flush");
        auto next = Clock::now();
        long long slowest = 0;
        for (int b = 0; b < bursts; ++b) {
          std::this_thread::sleep_until(next);
          next += std::chrono::milliseconds(period_ms);
          const long long t0 = monotonic_ns();
          for (int i = 0; i < n; ++i) steptrace::Span span(steptrace::Step::kForward);
          slowest = std::max(slowest, monotonic_ns() - t0);
          // The daemon took it before the next burst starts (at the period, or later on a
          // loaded machine): each burst lands in a ring the daemon has emptied, so what is
          // checked is that a burst fits, not how soon a starved daemon gets to run.
          if (steptrace_flush(30000) != 0) fail("flush after a burst");
        }
        longest[static_cast<std::size_t>(t)] = slowest;
      });
    }
    for (auto& t : pool) t.join();
    out.set("longest_burst_ns", *std::max_element(longest.begin(), longest.end()));
    out.set("flush_rc", steptrace_flush(30000));
    out.set("recorded_events", 2LL * threads * (bursts * n + 1));  // + the warm-ups
    set_dropped(out, "dropped");
  } else if (mode == "exit") {  // returns from main, no flush, with the daemon SIGSTOPped
    // ARGS: THREADS SPANS_PER_THREAD [LIVE]: LIVE=1 leaves a thread recording through
    // exit. Everything after main returns is the library's at-exit path.
    const int threads = arg(4, 2);
    const int n = arg(5, 200000);
    out.set("connect_rc", steptrace_connect(socket.c_str()));
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([n] {
        for (int i = 0; i < n; ++i) steptrace::Span span(steptrace::Step::kForward);
      });
    }
    for (auto& t : pool) t.join();
    if (arg(6, 0) != 0) {
      static std::atomic<bool> live_started{false};
      std::thread([] {
        for (;;) {
          steptrace::Span span(steptrace::Step::kBackward);
          live_started.store(true, std::memory_order_relaxed);
        }
      }).detach();
      while (!live_started.load(std::memory_order_relaxed)) std::this_thread::yield();
    }
    set_dropped(out, "dropped");
    out.set("main_return_ns", monotonic_ns());  // the file is written just after
  } else if (mode == "auto") {  // never calls steptrace_connect: auto-connect, exact
    // ARGS: N [FLUSH]: N Forward spans + N spans of a custom step; FLUSH=0 returns from
    // main without steptrace_flush (the at-exit flush must deliver them).
    const int n = arg(4, 1000);
    const std::uint32_t custom = steptrace_register_step("Tokenize");
    if (custom == UINT32_MAX) fail("register");
    paced_spans(STEPTRACE_FORWARD, n);
    paced_spans(custom, n);
    if (arg(5, 1) != 0) out.set("flush_rc", steptrace_flush(10000));
    set_dropped(out, "dropped");
  } else if (mode == "noconnect") {  // never calls steptrace_connect; records MS ms
    const int ms = arg(4, 300);
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
    long long spans = 0;
    while (std::chrono::steady_clock::now() < until) {
      steptrace::Span span(steptrace::Step::kForward);
      ++spans;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    steptrace_ledger_release("GPU-auto", 1);
    out.set("spans", spans);
    long long threads = 0;  // this process's threads: 1 unless a flusher was started
    if (DIR* dir = ::opendir("/proc/self/task")) {
      while (const dirent* e = ::readdir(dir)) {
        if (e->d_name[0] != '.') ++threads;
      }
      ::closedir(dir);
    }
    out.set("threads", threads);
    out.set("flush_rc", steptrace_flush(2000));
    set_dropped(out, "dropped");
  } else {
    fail("unknown mode");
  }
  out.write(outfile);
  return 0;  // the atexit hook flushes (bounded) and stops the flusher
}
