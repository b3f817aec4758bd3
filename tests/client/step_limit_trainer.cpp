// A trainer past the daemon's custom-step limit, for client_step_limit_test
// (step_limit_test.cpp): a real process using libsteptrace (shared, default mode: never
// blocking, per-thread rings in shared memory) that registers more custom steps than the
// daemon allows (limits.max_custom_steps), records spans on all of them, and keeps what
// it recorded in a file a SIGKILL cannot take (step_limit_counts.h).
//
//   steptrace_step_limit_trainer SOCKET COUNTFILE READYFILE STEPS THREADS SPANS
//
// 1. Creates COUNTFILE and maps it; steptrace_connect(SOCKET) (exit 2 when it fails).
// 2. THREADS threads (1..16) each record one warm-up Forward span, which makes the
//    thread's ring; then steptrace_flush, retried for up to 60 s (exit 2 when it never
//    succeeds): answered only once the daemon maps every ring, so from here on nothing a
//    thread records can die with the process unseen. Writes READYFILE.
// 3. Each thread records iterations of one span of a custom step with a Forward span
//    nested in it (4 events), 25 iterations then a 1 ms sleep (~100,000 events a second
//    a thread). Every event is counted in COUNTFILE around its call.
//      SPANS = 0: until killed. Thread 0 registers the next of the STEPS custom steps
//        (Limit0, Limit1, ...) every 250 iterations (~10 ms), so a kill lands before,
//        among or after the registrations the daemon refuses; each iteration takes a
//        step registered so far (a built-in Backward before the first). Meanwhile the
//        main thread calls steptrace_flush(2000) every 20 ms (its result in COUNTFILE).
//      SPANS > 0: the STEPS steps are registered first; each thread records SPANS
//        rounds of one iteration per step, then the main thread flushes (retried for up
//        to 60 s; the result in COUNTFILE's flush_rc), writes READYFILE.flushed, waits
//        (connected) until READYFILE.exit exists (at most 60 s) and exits 0: the test
//        checks the counts exactly, live and after the exit.
//
// Exit 4 when the library refused a registration, 7 when the test that started it is
// gone, 64 on bad arguments. The process dies with its parent (PR_SET_PDEATHSIG).
#include <fcntl.h>
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>
#include <vector>

#include "tests/client/step_limit_counts.h"

#include "tests/support/flush_until.h"

namespace {

using steptrace::testing::flush_until;

using Clock = std::chrono::steady_clock;
using steptrace::testing::StepLimitCounts;

constexpr int kBurst = 25;           // iterations between two 1 ms sleeps
constexpr int kRegisterEvery = 250;  // iterations of thread 0 between two registrations
constexpr int kMaxSteps = 1024;

struct Options {
  std::string socket;
  std::string countfile;
  std::string readyfile;
  int steps = 0;
  int threads = 0;
  long long spans = 0;
};

[[noreturn]] void fail(int status, const char* what) {
  std::fprintf(stderr, "step_limit_trainer %d: %s\n", static_cast<int>(::getpid()), what);
  std::_Exit(status);
}

template <typename T>
void store(T& field, T value) {
  std::atomic_ref<T>(field).store(value, std::memory_order_release);
}

// COUNTFILE, created and mapped; its header written.
StepLimitCounts* map_counts(const Options& o) {
  const int fd = ::open(o.countfile.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0 || ::ftruncate(fd, sizeof(StepLimitCounts)) != 0) fail(2, "cannot make COUNTFILE");
  void* p = ::mmap(nullptr, sizeof(StepLimitCounts), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p == MAP_FAILED) fail(2, "cannot map COUNTFILE");
  auto* counts = new (p) StepLimitCounts{};
  counts->pid = ::getpid();
  counts->threads = o.threads;
  store(counts->magic, steptrace::testing::kStepLimitMagic);
  return counts;
}

void write_ready(const std::string& path) {
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(2, "cannot write READYFILE");
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail(2, "cannot rename READYFILE");
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

class Trainer {
 public:
  Trainer(const Options& o, StepLimitCounts& counts)
      : o_(o), counts_(counts), ids_(kMaxSteps), recorded_(static_cast<std::size_t>(o.threads)) {}

  int run() {
    std::vector<std::thread> pool;
    for (int t = 0; t < o_.threads; ++t) pool.emplace_back([this, t] { thread_main(t); });
    while (warm_.load(std::memory_order_acquire) < o_.threads) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    const int rc = flush_until(60000);
    store<std::int64_t>(counts_.flush_rc, rc);
    if (rc != 0) fail(2, "the warm-up flush failed");
    if (o_.spans > 0) {
      for (int s = 0; s < o_.steps; ++s) register_next();
    }
    write_ready(o_.readyfile);
    go_.store(true, std::memory_order_release);
    if (o_.spans == 0) {
      for (;;) {  // until killed
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        store<std::int64_t>(counts_.flush_rc, steptrace_flush(2000));
      }
    }
    for (auto& t : pool) t.join();
    store<std::int64_t>(counts_.flush_rc, flush_until(60000));
    // Still connected while the test reads the report: what the daemon shows live.
    write_ready(o_.readyfile + ".flushed");
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (!file_exists(o_.readyfile + ".exit") && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return 0;
  }

 private:
  // One event, counted around its call.
  void record(int t, bool start, std::uint32_t step) {
    auto& c = counts_.thread[t];
    std::int64_t& n = recorded_[static_cast<std::size_t>(t)];  // this thread's alone
    store(c.begun, n + 1);
    if (start) {
      steptrace_start(step);
    } else {
      steptrace_end(step);
    }
    store(c.done, ++n);
  }

  void iteration(int t, std::uint32_t outer) {
    record(t, true, outer);
    record(t, true, STEPTRACE_FORWARD);
    record(t, false, STEPTRACE_FORWARD);
    record(t, false, outer);
  }

  void register_next() {
    const int n = registered_.load(std::memory_order_relaxed);
    if (n >= o_.steps) return;
    char name[32];
    std::snprintf(name, sizeof name, "Limit%d", n);
    const std::uint32_t id = steptrace_register_step(name);
    if (id == UINT32_MAX) fail(4, "steptrace_register_step refused a step");
    ids_[static_cast<std::size_t>(n)] = id;
    registered_.store(n + 1, std::memory_order_release);
    store<std::int64_t>(counts_.registered, n + 1);
  }

  void thread_main(int t) {
    iteration_warm_up(t);
    while (!go_.load(std::memory_order_acquire)) {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (o_.spans > 0) {
      long long i = 0;
      for (long long r = 0; r < o_.spans; ++r) {
        for (int s = 0; s < o_.steps; ++s) {
          iteration(t, ids_[static_cast<std::size_t>(s)]);
          if (++i % kBurst == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
      }
      return;
    }
    for (long long i = 0;; ++i) {  // until killed
      if (t == 0 && i % kRegisterEvery == 0) register_next();
      const int n = registered_.load(std::memory_order_acquire);
      iteration(t, n == 0 ? std::uint32_t{STEPTRACE_BACKWARD}
                          : ids_[static_cast<std::size_t>((i + t) % n)]);
      if ((i + 1) % kBurst == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  void iteration_warm_up(int t) {
    record(t, true, STEPTRACE_FORWARD);
    record(t, false, STEPTRACE_FORWARD);
    warm_.fetch_add(1, std::memory_order_acq_rel);
  }

  const Options& o_;
  StepLimitCounts& counts_;
  std::vector<std::uint32_t> ids_;
  std::vector<std::int64_t> recorded_;  // per thread: the events it recorded
  std::atomic<int> registered_{0};
  std::atomic<int> warm_{0};
  std::atomic<bool> go_{false};
};

bool parse(int argc, char** argv, Options& o) {
  if (argc != 7) return false;
  o.socket = argv[1];
  o.countfile = argv[2];
  o.readyfile = argv[3];
  char* end = nullptr;
  const long steps = std::strtol(argv[4], &end, 10);
  if (end == argv[4] || *end != '\0' || steps < 1 || steps > kMaxSteps) return false;
  const long threads = std::strtol(argv[5], &end, 10);
  if (end == argv[5] || *end != '\0' || threads < 1 ||
      threads > steptrace::testing::kStepLimitMaxThreads) {
    return false;
  }
  const long long spans = std::strtoll(argv[6], &end, 10);
  if (end == argv[6] || *end != '\0' || spans < 0) return false;
  o.steps = static_cast<int>(steps);
  o.threads = static_cast<int>(threads);
  o.spans = spans;
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr, "usage: %s SOCKET COUNTFILE READYFILE STEPS THREADS SPANS\n", argv[0]);
    return 64;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 7;    // the test is gone already
  steptrace_set_block_when_full(0);  // the default mode, whatever the environment says
  StepLimitCounts* counts = map_counts(o);
  if (steptrace_connect(o.socket.c_str()) != 0) fail(2, "steptrace_connect");
  Trainer trainer(o, *counts);
  return trainer.run();
}
