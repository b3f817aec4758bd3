// A test trainer: a real process using libsteptrace (shared) the way a training loop
// does, its behaviour chosen by argv. Used by client_integration_test.
//
//   steptrace_test_trainer MODE SOCKET OUTFILE [ARGS...]
//
// Writes "key value" lines to OUTFILE (pid, recorded events, dropped, ...), and exits
// 0 when everything it could check itself held (connect/flush results, drop counts).
#include <steptrace/steptrace.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <steptrace/steptrace.hpp>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
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
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
  } else if (mode == "threads") {  // T threads x N Matmul spans, exact
    const int threads = arg(4, 8);
    const int n = arg(5, 1000);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) pool.emplace_back([n] { paced_spans(STEPTRACE_MATMUL, n); });
    for (auto& t : pool) t.join();  // thread exit hands each ring to the flusher
    if (steptrace_flush(10000) != 0) fail("flush");
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
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
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
  } else if (mode == "fork") {  // parent Forward, child Backward; nothing sent twice
    const int n = arg(4, 1000);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
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
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
  } else if (mode == "late") {  // daemon absent at start; the test starts it later
    const int before = arg(4, 10000);
    const int after = arg(5, 1000);
    const auto t0 = Clock::now();
    const int rc = steptrace_connect(socket.c_str());
    out.set("connect_rc", rc);
    for (int i = 0; i < before; ++i) steptrace::Span span(steptrace::Step::kForward);
    steptrace_ledger_reserve("GPU-late", 1, 4096, "late-task");
    out.set("phase1_ms",
            std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count());
    out.set("dropped_phase1", static_cast<long long>(steptrace_dropped()));
    out.write(outfile + ".phase1");
    if (!flush_until(20000)) fail("never reconnected");
    paced_spans(STEPTRACE_FORWARD, after);
    if (steptrace_flush(10000) != 0) fail("final flush");
    out.set("recorded_events", 2LL * (before + after));
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
  } else if (mode == "restart") {  // the daemon is SIGKILLed and restarted meanwhile
    const std::string go = outfile + ".go";
    const int rounds = arg(4, 400);
    if (steptrace_connect(socket.c_str()) != 0) fail("connect");
    out.write(outfile + ".phase1");
    long long spans = 0;
    // Keep recording at a steady pace until the test says the daemon is back, then a
    // little more.
    for (int r = 0; r < rounds || !file_exists(go); ++r) {
      for (int i = 0; i < 200; ++i, ++spans) steptrace::Span span(steptrace::Step::kTransfer);
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      if (r > 100000) fail("no go file");
    }
    if (!flush_until(20000)) fail("never reconnected");
    out.set("recorded_events", 2 * spans);
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
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
    out.set("dropped", static_cast<long long>(steptrace_dropped()));
  } else {
    fail("unknown mode");
  }
  out.write(outfile);
  return 0;  // the atexit hook flushes (bounded) and stops the flusher
}
