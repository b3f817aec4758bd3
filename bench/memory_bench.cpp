// Memory bounds, measured with the real daemon:
//  (1) client: a trainer records many spans while the daemon is stopped (SIGSTOP), so
//      nothing drains; its resident memory (VmRSS) must stay bounded by the per-thread
//      buffers, whatever the number of spans. Measured with 1 thread, then N threads twice.
//  (2) daemon: VmRSS of steptraced with P distinct processes x 12 steps tracked. Each
//      process is a real short-lived child (the daemon keys processes by SO_PEERCRED pid
//      and /proc start time), forked in waves; it connects with the proto::Encoder, sends
//      a hello, S spans of each of the 12 built-in steps and a flush, waits for the
//      acknowledgement and exits. The daemon is configured to keep that many exited
//      processes. The report must show all P processes with exact counts, else exit 1.
//
//  (3) charged vs held (issue 26, problem 2): a Collector fed through its ingest API, as
//      serve/ClientStream feeds it, in a forked child per attack, so each starts from its
//      own baseline. Per attack: the RSS growth (VmRSS after the feed, untrimmed, less
//      VmRSS before the Collector existed, trimmed), the bytes the state budget charged
//      (TableFigures::state_bytes_charged), their ratio (target within 25%), limit hits;
//      then every process disconnects and dies, the Collector evicts them (it keeps no
//      exited process) and returns freed heap to the kernel itself (malloc_trim,
//      daemon/state/charge.h): the RSS and charge after 1.5 s of liveness ticks (what
//      steptraced's 500 ms timer would run), with no malloc_trim of the bench's. Attacks:
//        histograms  H processes x 1,024 custom steps, each step's spans spread over every
//                    power of two a span may last (1 ns .. 2^49 ns, under max_span_ns):
//                    full histograms, recorded a power of two at a time over all steps;
//        threads     T processes x 1,024 custom steps x 700 thread ids, each thread one
//                    span of every step (one stack per (thread, step)).
//
//   memory_bench [--spans-per-thread M] [--threads N] [--processes P] [--spans-per-step S]
//                [--charge-only] [--hist-processes H] [--thread-processes T]
//     defaults: M = 20,000,000, N = 4, P = 1000, S = 100, H = 40, T = 8
#include <malloc.h>
#include <steptrace/steptrace.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <barrier>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_support.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"
#include "tests/support/daemon_process.h"

namespace {

using steptrace::bench::monotonic_ns;
using steptrace::bench::vm_rss_kib;
namespace proto = steptrace::proto;

struct Options {
  std::uint64_t spans_per_thread = 20'000'000;
  int threads = 4;
  int processes = 1000;
  int spans_per_step = 100;
  bool charge_only = false;
  int hist_processes = 40;
  int thread_processes = 8;
};

// ---- (1) client ------------------------------------------------------------------------

// Runs in a forked child so the library starts fresh. Prints its own figures.
int client_bound(const std::string& socket, pid_t daemon_pid, const Options& opt) {
  if (const int rc = steptrace_connect(socket.c_str()); rc != 0) {
    std::fprintf(stderr, "client: connect failed: %d\n", rc);
    return 1;
  }
  steptrace_start(STEPTRACE_FORWARD);
  steptrace_end(STEPTRACE_FORWARD);
  if (steptrace_flush(10000) != 0) {
    std::fprintf(stderr, "client: first flush failed\n");
    return 1;
  }
  ::kill(daemon_pid, SIGSTOP);
  const std::uint64_t rss_start = vm_rss_kib().value_or(0);
  std::printf("client: daemon stopped (SIGSTOP); trainer VmRSS before recording %llu KiB\n",
              static_cast<unsigned long long>(rss_start));
  // The N-thread phase runs twice: new threads after old ones exited undrained show
  // whether the buffers of exited threads are reused or kept.
  for (int threads : {1, opt.threads, opt.threads}) {
    const std::uint64_t rss_before = vm_rss_kib().value_or(0);
    const std::uint64_t dropped_before = steptrace_dropped();
    std::uint64_t rss_loaded = 0;
    // Every thread records, then all wait while the RSS is read (their buffers are
    // still theirs), then they exit.
    std::barrier recorded(threads + 1);
    std::barrier measured(threads + 1);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&] {
        for (std::uint64_t i = 0; i < opt.spans_per_thread; ++i) {
          steptrace_start(STEPTRACE_MATMUL);
          steptrace_end(STEPTRACE_MATMUL);
        }
        recorded.arrive_and_wait();
        measured.arrive_and_wait();
      });
    }
    recorded.arrive_and_wait();
    rss_loaded = vm_rss_kib().value_or(0);
    measured.arrive_and_wait();
    for (auto& t : pool) t.join();
    const std::uint64_t events = 2 * opt.spans_per_thread * static_cast<std::uint64_t>(threads);
    const std::uint64_t dropped = steptrace_dropped() - dropped_before;
    std::printf(
        "client: %d thread(s) x %llu spans (%llu events = %.0f MiB of records): VmRSS "
        "%llu -> %llu KiB, growth %lld KiB (%.1f KiB per thread); dropped %llu "
        "(%.2f%%)\n",
        threads, static_cast<unsigned long long>(opt.spans_per_thread),
        static_cast<unsigned long long>(events), static_cast<double>(events) * 16 / (1 << 20),
        static_cast<unsigned long long>(rss_before), static_cast<unsigned long long>(rss_loaded),
        static_cast<long long>(rss_loaded) - static_cast<long long>(rss_before),
        (static_cast<double>(rss_loaded) - static_cast<double>(rss_before)) / threads,
        static_cast<unsigned long long>(dropped),
        100.0 * static_cast<double>(dropped) / static_cast<double>(events));
  }
  const std::uint64_t rss_end = vm_rss_kib().value_or(0);
  std::printf("client: total growth with the daemon stopped: %lld KiB\n",
              static_cast<long long>(rss_end) - static_cast<long long>(rss_start));
  ::kill(daemon_pid, SIGCONT);
  std::fflush(stdout);
  steptrace_shutdown();
  return 0;
}

// ---- (2) daemon ------------------------------------------------------------------------

bool send_all(int fd, std::span<const std::byte> bytes) {
  while (!bytes.empty()) {
    const ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    bytes = bytes.subspan(static_cast<std::size_t>(n));
  }
  return true;
}

// One simulated trainer: 12 built-in steps x `spans` spans with varied durations, a
// flush, and the wait for its acknowledgement. Exit status 0 when acknowledged.
[[noreturn]] void fake_trainer(const std::string& socket, int spans, int seed) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  if (fd < 0 || ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    std::_Exit(3);
  }
  std::vector<proto::EventRecord> events;
  const auto tid = static_cast<std::uint32_t>(::getpid());
  std::uint64_t t = monotonic_ns() - 10'000'000'000ull;
  for (std::uint16_t step = 0; step < proto::kBuiltinStepCount; ++step) {
    const std::uint64_t base = 2'000ull << (step % 10);  // 2 us .. 1 ms
    for (int i = 0; i < spans; ++i) {
      const std::uint64_t d = base + base * static_cast<std::uint64_t>((i * 37 + seed) % 100) / 50;
      events.push_back({t, tid, step, static_cast<std::uint8_t>(proto::EventKind::kStart), 0});
      events.push_back({t + d, tid, step, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0});
      t += d + 100;
    }
  }
  std::vector<std::byte> buffer(events.size() * sizeof(proto::EventRecord) + 4096);
  proto::Encoder enc(buffer);
  enc.hello("bench", "memory_bench");
  std::span<const proto::EventRecord> rest(events);
  while (!rest.empty()) {
    const std::size_t n = enc.events(rest);
    if (n == 0) std::_Exit(4);
    rest = rest.subspan(n);
  }
  enc.flush(1);
  if (!send_all(fd, enc.bytes())) std::_Exit(5);
  proto::Decoder dec(proto::Side::kClient);
  for (;;) {
    auto in = dec.prepare();
    const ssize_t n = ::recv(fd, in.data(), in.size(), 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) std::_Exit(6);
    dec.commit(static_cast<std::size_t>(n));
    for (;;) {
      auto r = dec.next();
      if (r.error) std::_Exit(7);
      if (!r.message) break;
      if (auto* ack = std::get_if<proto::FlushAck>(&*r.message); ack && ack->sequence == 1) {
        ::close(fd);
        std::_Exit(0);
      }
      if (std::holds_alternative<proto::ErrorReport>(*r.message)) std::_Exit(8);
    }
  }
}

int daemon_footprint(const Options& opt) {
  steptrace::testing::TempDir dir;
  const std::string config = dir.file("steptraced.json");
  {
    std::ofstream out(config);
    out << nlohmann::json{{"liveness_interval_ms", 100},
                          {"limits",
                           {{"max_processes", opt.processes + 1000},
                            {"max_exited_processes", opt.processes + 500}}}}
               .dump(2);
  }
  const std::string socket = dir.file("steptraced.sock");
  steptrace::testing::DaemonProcess daemon(socket, {"--config", config});
  if (!daemon.start()) {
    std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
    return 1;
  }
  const std::uint64_t rss0 = vm_rss_kib(daemon.pid()).value_or(0);
  constexpr int kWave = 100;
  int failed = 0;
  for (int started = 0; started < opt.processes;) {
    std::vector<pid_t> wave;
    for (int i = 0; i < kWave && started < opt.processes; ++i, ++started) {
      const pid_t pid = ::fork();
      if (pid == 0) fake_trainer(socket, opt.spans_per_step, started);
      if (pid < 0) {
        std::perror("fork");
        return 1;
      }
      wave.push_back(pid);
    }
    for (pid_t pid : wave) {
      int status = 0;
      ::waitpid(pid, &status, 0);
      if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
    }
  }
  // Let the daemon notice the exits (liveness_interval_ms = 100).
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const auto report = steptrace::bench::daemon_json(socket, "report --json");
  if (!report) return 1;
  int complete = 0;
  int exited = 0;
  for (const auto& p : report->value("processes", nlohmann::json::array())) {
    if (!p.value("alive", true)) ++exited;
    int steps_ok = 0;
    for (const auto& s : p.value("steps", nlohmann::json::array())) {
      if (s.value("count", 0) == opt.spans_per_step) ++steps_ok;
    }
    if (steps_ok == static_cast<int>(proto::kBuiltinStepCount)) ++complete;
  }
  const std::uint64_t rss = vm_rss_kib(daemon.pid()).value_or(0);
  const std::uint64_t hwm = steptrace::bench::vm_hwm_kib(daemon.pid()).value_or(0);
  std::printf(
      "daemon: %d processes x 12 steps (%d spans each) tracked (%d complete in the "
      "report, %d exited, %d children failed)\n",
      opt.processes, opt.spans_per_step, complete, exited, failed);
  std::printf(
      "daemon: VmRSS %llu KiB (%.1f MiB) after start, %llu KiB (%.1f MiB) with them "
      "tracked; growth %.1f KiB per process; VmHWM %llu KiB\n",
      static_cast<unsigned long long>(rss0), static_cast<double>(rss0) / 1024,
      static_cast<unsigned long long>(rss), static_cast<double>(rss) / 1024,
      (static_cast<double>(rss) - static_cast<double>(rss0)) / opt.processes,
      static_cast<unsigned long long>(hwm));
  daemon.stop();
  if (failed != 0 || complete != opt.processes) {
    std::fprintf(stderr, "MEMORY BENCH FAILED: want %d complete processes in the report\n",
                 opt.processes);
    return 1;
  }
  return 0;
}

// ---- (3) charged vs held ---------------------------------------------------------------

namespace daemon = steptrace::daemon;

constexpr std::int32_t kFirstPid = 200000;
constexpr std::size_t kBatch = 4096;  // events per Collector::events call, as one frame
constexpr std::uint32_t kCustomSteps = 1024;
constexpr std::uint32_t kTidsPerProcess = 700;
constexpr unsigned kTopPower = 49;  // 2^49 ns: the longest power of two under max_span_ns

struct Attack {
  const char* name;
  int processes;
  // Feeds process `p` (its handle) through `fold` (one batch of events).
  void (*feed)(daemon::Collector&, daemon::ProcessHandle);
};

bool process_dead = false;  // the attack's processes, once they disconnect

daemon::Environment attack_environment() {
  daemon::Environment env;
  env.monotonic_now_ns = [] { return steptrace::bench::monotonic_ns(); };
  env.probe = [](std::int32_t pid) -> std::optional<daemon::ProcessProbe> {
    if (process_dead) return std::nullopt;
    return daemon::ProcessProbe{static_cast<std::uint64_t>(pid), false, "attacker"};
  };
  return env;
}

class Batcher {
 public:
  Batcher(daemon::Collector& collector, daemon::ProcessHandle handle)
      : collector_(collector), handle_(handle) {
    batch_.reserve(kBatch);
  }
  ~Batcher() { fold(); }
  Batcher(const Batcher&) = delete;
  Batcher& operator=(const Batcher&) = delete;
  void span(std::uint32_t tid, std::uint32_t step, std::uint64_t duration) {
    const auto id = static_cast<std::uint16_t>(step);
    batch_.push_back({t_, tid, id, static_cast<std::uint8_t>(proto::EventKind::kStart), 0});
    batch_.push_back(
        {t_ + duration, tid, id, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0});
    t_ += 1000;  // spans overlap in time: only their durations matter here
    if (batch_.size() >= kBatch) fold();
  }
  void fold() {
    if (batch_.empty()) return;
    const proto::EventSpan span{reinterpret_cast<const std::byte*>(batch_.data()), batch_.size()};
    (void)collector_.events(handle_, span);  // refusals are counted as limit hits
    batch_.clear();
  }

 private:
  daemon::Collector& collector_;
  daemon::ProcessHandle handle_;
  std::vector<proto::EventRecord> batch_;
  std::uint64_t t_ = 1'000'000'000;
};

void register_steps(daemon::Collector& collector, daemon::ProcessHandle handle) {
  for (std::uint32_t i = 0; i < kCustomSteps; ++i) {
    proto::RegisterStep reg{};
    reg.step = proto::kFirstCustomStep + i;
    proto::set_field(reg.name, "attack/custom_step_" + std::to_string(i));
    (void)collector.register_step(handle, reg);
  }
}

void feed_histograms(daemon::Collector& collector, daemon::ProcessHandle handle) {
  register_steps(collector, handle);
  Batcher batcher(collector, handle);
  // A power of two at a time over all steps: each histogram grows a chunk per round.
  for (unsigned power = 0; power <= kTopPower; ++power) {
    for (std::uint32_t i = 0; i < kCustomSteps; ++i) {
      const std::uint64_t d =
          (std::uint64_t{1} << power) + (i % 7) * (std::uint64_t{1} << power) / 8;
      batcher.span(1, proto::kFirstCustomStep + i, d);
    }
  }
}

void feed_threads(daemon::Collector& collector, daemon::ProcessHandle handle) {
  register_steps(collector, handle);
  Batcher batcher(collector, handle);
  for (std::uint32_t tid = 1; tid <= kTidsPerProcess; ++tid) {
    for (std::uint32_t i = 0; i < kCustomSteps; ++i)
      batcher.span(tid, proto::kFirstCustomStep + i, 1000);
  }
}

double mib_of_kib(std::uint64_t kib) { return static_cast<double>(kib) / 1024.0; }
double mib_of_bytes(std::uint64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

std::uint64_t state_limit_hits(const daemon::DaemonCounters& counters) {
  std::uint64_t n = 0;
  for (const char* name : {"max_process_state_bytes", "max_state_bytes"}) {
    if (const auto it = counters.limits_hit.find(name); it != counters.limits_hit.end())
      n += it->second;
  }
  return n;
}

// One attack, in this (forked) process. Exit status 0 when it ran.
int run_attack(const Attack& attack) {
  ::malloc_trim(0);
  const std::uint64_t rss0 = vm_rss_kib().value_or(0);
  daemon::Limits limits;
  limits.max_exited_processes = 0;  // evicted as soon as they are found dead
  daemon::FlightRecorderConfig recorder;
  recorder.budget_bytes = 0;  // its own budget, not the state's
  daemon::Collector collector(limits, attack_environment(), recorder);
  std::vector<daemon::ProcessHandle> handles;
  for (int p = 0; p < attack.processes; ++p) {
    const std::int32_t pid = kFirstPid + p;
    const daemon::PeerIdentity peer{{pid, static_cast<std::uint64_t>(pid)}, 3000, 3000, "attacker"};
    daemon::ProcessHandle handle = 0;
    if (auto ec = collector.attach(peer, handle)) {
      std::fprintf(stderr, "%s: attach %d: %s\n", attack.name, p, ec.message().c_str());
      return 1;
    }
    attack.feed(collector, handle);
    handles.push_back(handle);
  }
  const std::uint64_t rss1 = vm_rss_kib().value_or(0);
  const auto table = collector.freeze()->table();
  const double grown = mib_of_kib(rss1 - std::min(rss1, rss0));
  const double charged = mib_of_bytes(table.state_bytes_charged);
  std::printf(
      "charge: %-10s %3d processes: RSS %.1f -> %.1f MiB (+%.1f MiB), charged %.1f MiB: "
      "charged/RSS growth %.2f; state limit hits %llu\n",
      attack.name, attack.processes, mib_of_kib(rss0), mib_of_kib(rss1), grown, charged,
      grown > 0 ? charged / grown : 0.0,
      static_cast<unsigned long long>(state_limit_hits(collector.counters())));
  // They exit: the Collector evicts them and hands the heap back by itself.
  process_dead = true;
  for (const daemon::ProcessHandle handle : handles) collector.detach(handle);
  // The daemon's liveness timer ticks every 500 ms: the ticks of the next 1.5 s (a trim
  // runs at most once a second).
  for (int tick = 0; tick < 3; ++tick) {
    collector.refresh_liveness();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  collector.refresh_liveness();
  const std::uint64_t rss2 = vm_rss_kib().value_or(0);
  const auto after = collector.freeze()->table();
  std::printf(
      "charge: %-10s after they exited and were evicted: %zu tracked, RSS %.1f MiB "
      "(+%.1f MiB over the start), charged %.2f MiB (the retired histograms and jobs)\n",
      attack.name, static_cast<std::size_t>(after.tracked), mib_of_kib(rss2),
      mib_of_kib(rss2 - std::min(rss2, rss0)), mib_of_bytes(after.state_bytes_charged));
  std::fflush(stdout);
  return 0;
}

int charged_vs_held(const Options& opt) {
  const Attack attacks[] = {{"histograms", opt.hist_processes, feed_histograms},
                            {"threads", opt.thread_processes, feed_threads}};
  int failed = 0;
  for (const Attack& attack : attacks) {
    std::fflush(stdout);
    const pid_t child = ::fork();
    if (child == 0) std::_Exit(run_attack(attack));
    int status = 0;
    ::waitpid(child, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) ++failed;
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--spans-per-thread" && has_value) {
      opt.spans_per_thread = std::strtoull(argv[++i], nullptr, 10);
    } else if (arg == "--threads" && has_value) {
      opt.threads = std::atoi(argv[++i]);
    } else if (arg == "--processes" && has_value) {
      opt.processes = std::atoi(argv[++i]);
    } else if (arg == "--spans-per-step" && has_value) {
      opt.spans_per_step = std::atoi(argv[++i]);
    } else if (arg == "--charge-only") {
      opt.charge_only = true;
    } else if (arg == "--hist-processes" && has_value) {
      opt.hist_processes = std::atoi(argv[++i]);
    } else if (arg == "--thread-processes" && has_value) {
      opt.thread_processes = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr,
                   "usage: %s [--spans-per-thread M] [--threads N] [--processes P] "
                   "[--spans-per-step S] [--charge-only] [--hist-processes H] "
                   "[--thread-processes T]\n",
                   argv[0]);
      return 2;
    }
  }
  if (opt.threads < 1 || opt.processes < 1 || opt.spans_per_step < 1) {
    std::fprintf(stderr, "--threads, --processes and --spans-per-step must be >= 1\n");
    return 2;
  }
  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  std::fflush(stdout);
  if (opt.charge_only) return charged_vs_held(opt);

  {
    steptrace::testing::TempDir dir;
    const std::string socket = dir.file("steptraced.sock");
    steptrace::testing::DaemonProcess daemon(socket);
    if (!daemon.start()) {
      std::fprintf(stderr, "steptraced did not start:\n%s\n", daemon.log().c_str());
      return 1;
    }
    const pid_t child = ::fork();
    if (child == 0) {
      const int rc = client_bound(socket, daemon.pid(), opt);
      std::fflush(stdout);
      std::_Exit(rc);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    daemon.signal(SIGCONT);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "client measurement failed (status %d)\n", status);
      return 1;
    }
    daemon.stop();
  }
  std::fflush(stdout);
  if (const int rc = daemon_footprint(opt); rc != 0) return rc;
  return charged_vs_held(opt);
}
