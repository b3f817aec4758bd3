// A client process for trace_test: a real trainer linked with libsteptrace (shared) that
// records what the test then looks for in the daemon's `trace`, and writes its own
// record of what it did. Options (all "--name value" except the flags):
//
//   --socket PATH     the daemon (required)
//   --out FILE        where the record goes (required; written as FILE.tmp, renamed)
//   --threads N       recording threads (default 1)
//   --spans N         top-level spans per thread (default 10)
//   --depth D         nesting of built-in steps, Forward > Matmul > Attention (1..3,
//                     default 3)
//   --custom NAME     registers the custom step NAME and records it innermost, inside
//                     the deepest built-in step
//   --ledger UUID     the main thread, inside an Alloc span: Reserve (id 7, kReserveBytes),
//                     VramSample (kFreeBytes of kTotalBytes), Release (id 7)
//   --open            after the threads are done, the main thread starts a Backward span
//                     and never ends it
//   --bulk            one thread records a Forward span, then --spans Transpose spans,
//                     then a Backward span, flushing every 200,000 spans (400,000
//                     events: run it with STEPTRACE_BUFFER_BYTES of 8M or more and nothing
//                     is dropped); the record holds only the first and the last span
//   --fast-ms MS      one thread records Transpose spans for MS ms, in batches of 1,000,
//                     at most one batch per millisecond (~1 M spans/s), in the default
//                     (never blocking) mode; the record holds the count
//   --hold-ms MS      after the record is written, stay alive (connected) for MS ms
//                     (killed with the test: PR_SET_PDEATHSIG)
//
// Every mode flushes (steptrace_flush until it succeeds, up to 60 s) before the record
// is written, so the daemon has applied everything in it. Record lines, times in
// CLOCK_MONOTONIC ns read right before and right after the call:
//
//   pid P / comm NAME / flush_rc R / dropped N / recorded_spans N
//   span TID PARENT NAME BEFORE_START AFTER_START BEFORE_END AFTER_END
//        (PARENT: the index of the enclosing span among the span lines, -1 for none)
//   first ... / last ...   (--bulk: as span lines, without PARENT)
//   ledger OP TID BEFORE AFTER   (OP: reserve, sample, release)
//   open TID NAME BEFORE_START AFTER_START
//
// Exit status: 0 once the record is written (the test judges its contents), 64 for bad
// options.
#include <signal.h>
#include <steptrace/steptrace.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/flush_until.h"

namespace {

using steptrace::testing::flush_until;

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kReservationId = 7;
constexpr std::uint64_t kReserveBytes = 123'456'789;
constexpr std::uint64_t kFreeBytes = 1'000'000'000;
constexpr std::uint64_t kTotalBytes = 2'000'000'000;
constexpr int kBulkFlushEvery = 200'000;
constexpr int kFastBatch = 1'000;

struct Options {
  std::string socket;
  std::string out;
  int threads = 1;
  long long spans = 10;
  int depth = 3;
  std::string custom;
  std::string ledger;
  bool open = false;
  bool bulk = false;
  long long fast_ms = 0;
  long long hold_ms = 0;
};

std::uint64_t now_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ULL +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

long tid() { return ::syscall(SYS_gettid); }

struct SpanRecord {
  long tid = 0;
  long long parent = -1;  // index in the same thread's vector until written
  std::string name;
  std::uint64_t before_start = 0;
  std::uint64_t after_start = 0;
  std::uint64_t before_end = 0;
  std::uint64_t after_end = 0;
};

struct Level {
  std::uint32_t step = 0;
  std::string name;
};

// One span of levels[level] with the deeper levels nested inside it.
void nested(const std::vector<Level>& levels, std::size_t level, long long parent,
            std::vector<SpanRecord>& out) {
  if (level >= levels.size()) return;
  SpanRecord r;
  r.tid = tid();
  r.parent = parent;
  r.name = levels[level].name;
  r.before_start = now_ns();
  steptrace_start(levels[level].step);
  r.after_start = now_ns();
  const auto index = static_cast<long long>(out.size());
  out.push_back(r);
  nested(levels, level + 1, index, out);
  out[index].before_end = now_ns();
  steptrace_end(levels[level].step);
  out[index].after_end = now_ns();
}

// A span of `step` with nothing inside, timed.
SpanRecord timed_span(std::uint32_t step, const char* name) {
  SpanRecord r;
  r.tid = tid();
  r.name = name;
  r.before_start = now_ns();
  steptrace_start(step);
  r.after_start = now_ns();
  r.before_end = now_ns();
  steptrace_end(step);
  r.after_end = now_ns();
  return r;
}

std::string comm() {
  std::ifstream in("/proc/self/comm");
  std::string name;
  std::getline(in, name);
  return name;
}

std::string span_fields(const SpanRecord& r) {
  std::ostringstream line;
  line << r.tid << ' ' << r.name << ' ' << r.before_start << ' ' << r.after_start << ' '
       << r.before_end << ' ' << r.after_end;
  return line.str();
}

bool parse(int argc, char** argv, Options& o) {
  for (int i = 1; i < argc; ++i) {
    const std::string name = argv[i];
    if (name == "--open") {
      o.open = true;
      continue;
    }
    if (name == "--bulk") {
      o.bulk = true;
      continue;
    }
    if (i + 1 >= argc) return false;
    const std::string value = argv[++i];
    if (name == "--socket") {
      o.socket = value;
    } else if (name == "--out") {
      o.out = value;
    } else if (name == "--threads") {
      o.threads = std::atoi(value.c_str());
    } else if (name == "--spans") {
      o.spans = std::atoll(value.c_str());
    } else if (name == "--depth") {
      o.depth = std::atoi(value.c_str());
    } else if (name == "--custom") {
      o.custom = value;
    } else if (name == "--ledger") {
      o.ledger = value;
    } else if (name == "--fast-ms") {
      o.fast_ms = std::atoll(value.c_str());
    } else if (name == "--hold-ms") {
      o.hold_ms = std::atoll(value.c_str());
    } else {
      return false;
    }
  }
  return !o.socket.empty() && !o.out.empty() && o.threads >= 1 && o.spans >= 0 && o.depth >= 1 &&
         o.depth <= 3 && o.custom.find(' ') == std::string::npos;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, o)) {
    std::fprintf(stderr,
                 "usage: %s --socket PATH --out FILE [--threads N] [--spans N] [--depth 1..3] "
                 "[--custom NAME] [--ledger UUID] [--open] [--bulk] [--fast-ms MS] "
                 "[--hold-ms MS]\n",
                 argv[0]);
    return 64;
  }
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() == 1) return 7;  // the test is gone already

  std::ostringstream record;
  record << "pid " << ::getpid() << "\ncomm " << comm() << "\n";
  steptrace_set_block_when_full(0);  // the default mode, whatever the environment says
  record << "connect_rc " << steptrace_connect(o.socket.c_str()) << "\n";

  long long recorded_spans = 0;
  if (o.bulk) {
    const SpanRecord first = timed_span(STEPTRACE_FORWARD, "Forward");
    for (long long i = 0; i < o.spans; ++i) {
      steptrace_start(STEPTRACE_TRANSPOSE);
      steptrace_end(STEPTRACE_TRANSPOSE);
      if ((i + 1) % kBulkFlushEvery == 0) flush_until(60000);
    }
    const SpanRecord last = timed_span(STEPTRACE_BACKWARD, "Backward");
    recorded_spans = o.spans + 2;
    record << "first " << span_fields(first) << "\nlast " << span_fields(last) << "\n";
  } else if (o.fast_ms > 0) {
    const auto start = Clock::now();
    const auto stop = start + std::chrono::milliseconds(o.fast_ms);
    auto next = start;
    while (Clock::now() < stop) {
      for (int i = 0; i < kFastBatch; ++i) {
        steptrace_start(STEPTRACE_TRANSPOSE);
        steptrace_end(STEPTRACE_TRANSPOSE);
      }
      recorded_spans += kFastBatch;
      next += std::chrono::milliseconds(1);
      const auto now = Clock::now();
      if (next > now) {
        std::this_thread::sleep_until(next);
      } else if (now - next > std::chrono::milliseconds(10)) {
        next = now;  // behind: no catching up in one long burst
      }
    }
  } else {
    std::vector<Level> levels{{STEPTRACE_FORWARD, "Forward"},
                              {STEPTRACE_MATMUL, "Matmul"},
                              {STEPTRACE_ATTENTION, "Attention"}};
    levels.resize(static_cast<std::size_t>(o.depth));
    if (!o.custom.empty()) {
      const std::uint32_t id = steptrace_register_step(o.custom.c_str());
      if (id == UINT32_MAX) {
        std::fprintf(stderr, "trace_client: cannot register step '%s'\n", o.custom.c_str());
        return 3;
      }
      levels.push_back({id, o.custom});
    }
    std::vector<std::vector<SpanRecord>> per_thread(static_cast<std::size_t>(o.threads));
    std::vector<std::thread> pool;
    for (int t = 0; t < o.threads; ++t) {
      pool.emplace_back([&, t] {
        auto& out = per_thread[static_cast<std::size_t>(t)];
        out.reserve(static_cast<std::size_t>(o.spans) * levels.size());
        for (long long i = 0; i < o.spans; ++i) nested(levels, 0, -1, out);
      });
    }
    for (auto& t : pool) t.join();
    // Span lines with PARENT as an index among all span lines.
    long long base = 0;
    for (const auto& spans : per_thread) {
      for (const SpanRecord& r : spans) {
        record << "span " << r.tid << ' ' << (r.parent < 0 ? -1 : base + r.parent) << ' ' << r.name
               << ' ' << r.before_start << ' ' << r.after_start << ' ' << r.before_end << ' '
               << r.after_end << "\n";
      }
      base += static_cast<long long>(spans.size());
      recorded_spans += static_cast<long long>(spans.size());
    }
  }

  if (!o.ledger.empty()) {
    // Alloc on the main thread (its id is the pid), the ledger records inside it.
    SpanRecord alloc;
    alloc.tid = tid();
    alloc.name = "Alloc";
    alloc.before_start = now_ns();
    steptrace_start(STEPTRACE_ALLOC);
    alloc.after_start = now_ns();
    const auto ledger = [&](const char* op, auto&& call) {
      const std::uint64_t before = now_ns();
      call();
      const std::uint64_t after = now_ns();
      record << "ledger " << op << ' ' << tid() << ' ' << before << ' ' << after << "\n";
    };
    const char* gpu = o.ledger.c_str();
    ledger("reserve", [&] { steptrace_ledger_reserve(gpu, kReservationId, kReserveBytes, "t"); });
    ledger("sample", [&] { steptrace_vram_sample(gpu, kFreeBytes, kTotalBytes); });
    ledger("release", [&] { steptrace_ledger_release(gpu, kReservationId); });
    alloc.before_end = now_ns();
    steptrace_end(STEPTRACE_ALLOC);
    alloc.after_end = now_ns();
    ++recorded_spans;
    record << "span " << alloc.tid << " -1 Alloc " << alloc.before_start << ' ' << alloc.after_start
           << ' ' << alloc.before_end << ' ' << alloc.after_end << "\n";
  }

  if (o.open) {
    const std::uint64_t before = now_ns();
    steptrace_start(STEPTRACE_BACKWARD);
    const std::uint64_t after = now_ns();
    record << "open " << tid() << " Backward " << before << ' ' << after << "\n";
  }

  record << "flush_rc " << flush_until(60000) << "\n";
  record << "dropped " << steptrace_dropped() << "\n";
  record << "recorded_spans " << recorded_spans << "\n";
  {
    std::ofstream out(o.out + ".tmp");
    out << record.str();
  }
  std::rename((o.out + ".tmp").c_str(), o.out.c_str());

  if (o.hold_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.hold_ms));
  return 0;
}
