// Snapshot restore, version 1 against version 2, in the same run: how long a restart takes
// to read the daemon's state back, and how much memory it needs while it does.
//   v1 ("steptrace.snapshot/v1"): one JSON document, read whole, parsed into one
//      nlohmann::json tree, then decoded (what builds before issue 25 wrote; issue 25 item 3:
//      "restoring a 211 MB snapshot takes 20 s and 4.2 GB").
//   v2 ("steptrace.snapshot/v2"): one checksummed record per line, read and decoded a line
//      at a time (daemon/persist/snapshot.h, snapshot_codec.h).
//
// The state is real: a Collector fed through its ingest API (attach, hello, identity,
// register_step, events, as serve/ClientStream calls it) with N processes x K custom
// steps, S spans each (durations within a factor 4 of a per-step base, as ingest_bench's
// "validated": 2-3 histogram chunks per step), spread over U uids, each process with one
// span left open on a second thread. Its image (CollectorView::image) is written as a v2
// file (save_snapshot(dir, image, SIZE_MAX)) and as a v1 file
// (save_snapshot(dir, encode_snapshot(image))) into two directories.
//
// Each phase runs in a forked child of a parent that never holds the state, so a child's
// VmHWM is its own phase's peak (the HWM is also reset through /proc/self/clear_refs):
// one child builds and writes both files, then per format one child restores as the
// daemon does at start: load_snapshot(dir, limits), then adopt_snapshot(collector, image).
// Figures, in MiB of resident memory above the child's start (malloc_trim'd before each
// RSS reading, so freed memory is not counted as held):
//   load peak     VmHWM at the end of load_snapshot
//   restore peak  VmHWM at the end of adopt (the image and the Collector's records both
//                 live while adopt builds the records)
//   image         VmRSS holding the loaded StateImage
//   restored      VmRSS holding the Collector after adopt (the image consumed): the state
//                 the daemon keeps; its own estimate (TableFigures::state_bytes_estimate)
//                 is printed beside it
// and ratios of the restore peak to the file's size and to the restored state; the load's
// wall time and its CPU time (user + system: what to compare when other work shares the
// cores); and malloc's heap right after the load (mallinfo2: size, free, free chunks). A child
// exits 1 when a record was skipped or the restored counts (processes, steps, spans)
// differ from what was built.
//
//   snapshot_bench [--processes N[,N...]] [--steps K] [--spans S] [--uids U]
//                  [--formats v1,v2]
//     defaults: N = 610,2440 (files of about 50 and 200 MB), K = 100, S = 256, U = 4
#include <malloc.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "bench/bench_support.h"
#include "daemon/persist/snapshot.h"
#include "daemon/persist/snapshot_codec.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"
#include "tests/support/daemon_process.h"

namespace {

namespace proto = steptrace::proto;
namespace daemon = steptrace::daemon;
namespace fs = std::filesystem;
using steptrace::bench::vm_hwm_kib;
using steptrace::bench::vm_rss_kib;

constexpr std::int32_t kFirstPid = 100000;
constexpr std::uint32_t kFirstUid = 2000;
constexpr std::size_t kBatch = 4096;  // events per Collector::events call, as one frame
constexpr std::uint32_t kRanksPerJob = 8;

struct Options {
  std::vector<int> processes = {610, 2440};
  int steps = 100;  // custom steps per process
  int spans = 256;  // per step
  int uids = 4;
  bool v1 = true;
  bool v2 = true;
};

std::uint64_t start_time_of(std::int32_t pid) { return 1000u + static_cast<std::uint64_t>(pid); }

// Every process of the bench is alive (restored processes stay in the table as live).
daemon::Environment bench_environment() {
  daemon::Environment env;
  env.monotonic_now_ns = [] { return steptrace::bench::monotonic_ns(); };
  env.probe = [](std::int32_t pid) -> std::optional<daemon::ProcessProbe> {
    return daemon::ProcessProbe{start_time_of(pid), false, "trainer"};
  };
  return env;
}

// The daemon's limits, with room for the bench's table and files (a restore under
// limits too small would skip records, which is not what is measured).
daemon::Limits bench_limits(const Options& opt, int processes) {
  daemon::Limits limits;
  const auto n = static_cast<std::size_t>(processes);
  limits.max_processes = std::max(limits.max_processes, n);
  limits.max_processes_per_uid = std::max(limits.max_processes_per_uid, n);
  limits.max_custom_steps = std::max(limits.max_custom_steps, static_cast<std::size_t>(opt.steps));
  limits.max_snapshot_bytes = std::size_t{16} << 30;
  return limits;
}

// No flight recorder: a snapshot does not keep it, and its budget would blur the figures.
daemon::FlightRecorderConfig no_recorder() {
  daemon::FlightRecorderConfig config;
  config.budget_bytes = 0;
  return config;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// RSS in KiB after handing freed memory back, so that what is counted is what is held.
std::uint64_t trimmed_rss_kib() {
  ::malloc_trim(0);
  return vm_rss_kib().value_or(0);
}

// Resets VmHWM to the current RSS (Linux >= 4.0); false when the kernel refuses.
bool reset_hwm() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}

// This process's user + system CPU time: the figure to compare when other work shares the
// cores (wall time then includes waiting for a core).
double cpu_s() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  const auto s = [](const timeval& tv) {
    return static_cast<double>(tv.tv_sec) + static_cast<double>(tv.tv_usec) / 1e6;
  };
  return s(usage.ru_utime) + s(usage.ru_stime);
}

double mib(std::uint64_t kib) { return static_cast<double>(kib) / 1024.0; }

// ---- building the state ------------------------------------------------------------------

proto::Hello bench_hello() {
  proto::Hello hello{};
  std::memcpy(hello.magic, proto::kMagic, sizeof proto::kMagic);
  hello.version = proto::kProtocolVersion;
  proto::set_field_lossy(hello.library_version, "0.1.0");
  proto::set_field_lossy(hello.process_name, "trainer");
  return hello;
}

// Attaches process `p`, registers its steps and folds its spans; "" or what failed.
std::string feed_process(daemon::Collector& collector, const Options& opt, int p) {
  const std::int32_t pid = kFirstPid + p;
  const daemon::PeerIdentity peer{{pid, start_time_of(pid)},
                                  kFirstUid + static_cast<std::uint32_t>(p % opt.uids),
                                  kFirstUid + static_cast<std::uint32_t>(p % opt.uids),
                                  "trainer"};
  daemon::ProcessHandle handle = 0;
  if (auto ec = collector.attach(peer, handle)) return "attach: " + ec.message();
  collector.hello(handle, bench_hello());
  proto::Identity identity{};
  proto::set_field_lossy(identity.job, "bench-job-" + std::to_string(p / kRanksPerJob));
  identity.rank = static_cast<std::uint32_t>(p) % kRanksPerJob;
  identity.local_rank = identity.rank;
  identity.world_size = kRanksPerJob;
  collector.identity(handle, identity);
  for (int slot = 0; slot < opt.steps; ++slot) {
    proto::RegisterStep reg{};
    reg.step = proto::kFirstCustomStep + static_cast<std::uint32_t>(slot);
    proto::set_field(reg.name, "model/layer_" + std::to_string(slot) + "/forward");
    if (auto ec = collector.register_step(handle, reg)) return "register_step: " + ec.message();
  }
  const auto tid = static_cast<std::uint32_t>(pid);
  constexpr auto kStart = static_cast<std::uint8_t>(proto::EventKind::kStart);
  constexpr auto kEnd = static_cast<std::uint8_t>(proto::EventKind::kEnd);
  std::vector<proto::EventRecord> batch;
  batch.reserve(kBatch);
  const auto fold = [&]() -> std::string {
    const proto::EventSpan span{reinterpret_cast<const std::byte*>(batch.data()), batch.size()};
    if (auto ec = collector.events(handle, span)) return "events: " + ec.message();
    batch.clear();
    return {};
  };
  std::uint64_t t = 1'000'000'000;
  const auto total = static_cast<std::uint64_t>(opt.steps) * static_cast<std::uint64_t>(opt.spans);
  for (std::uint64_t i = 0; i < total; ++i) {
    const auto slot = static_cast<std::uint32_t>(i % static_cast<std::uint64_t>(opt.steps));
    const auto step = static_cast<std::uint16_t>(proto::kFirstCustomStep + slot);
    const std::uint64_t base = 1000ull << (slot % 10);
    const std::uint64_t noise = (i * 2654435761u + static_cast<std::uint64_t>(p)) >> 7;
    const std::uint64_t d = base + noise % (3 * base);
    batch.push_back({t, tid, step, kStart, 0});
    batch.push_back({t + d, tid, step, kEnd, 0});
    t += d + 50;
    if (batch.size() >= kBatch) {
      if (auto error = fold(); !error.empty()) return error;
    }
  }
  // One span left open on a second thread (a step in progress when the snapshot is taken).
  batch.push_back({t, tid + 1, static_cast<std::uint16_t>(proto::kFirstCustomStep), kStart, 0});
  return fold();
}

// What the builder child measured and wrote (sent to the parent through a pipe).
struct BuildFigures {
  int ok = 0;
  double feed_s = 0;
  double image_s = 0;
  double save_v2_s = 0;
  double encode_v1_s = 0;
  double save_v1_s = 0;
  std::uint64_t live_kib = 0;        // the fed Collector's records
  std::uint64_t estimate_bytes = 0;  // its TableFigures::state_bytes_estimate
  std::uint64_t v1_doc_kib = 0;      // the v1 document (nlohmann::json) held before it is written
  std::uint64_t steps = 0;           // (process, step) pairs with data in the image
  std::uint64_t spans = 0;           // ended spans in the image
};

BuildFigures build_and_save(const Options& opt, int processes, const fs::path& v2_dir,
                            const fs::path& v1_dir) {
  BuildFigures f;
  const daemon::Limits limits = bench_limits(opt, processes);
  const std::uint64_t rss0 = trimmed_rss_kib();
  daemon::Collector collector(limits, bench_environment(), no_recorder());
  auto start = std::chrono::steady_clock::now();
  for (int p = 0; p < processes; ++p) {
    if (const std::string error = feed_process(collector, opt, p); !error.empty()) {
      std::fprintf(stderr, "build: process %d: %s\n", p, error.c_str());
      return f;
    }
  }
  f.feed_s = seconds_since(start);
  f.live_kib = trimmed_rss_kib() - rss0;
  start = std::chrono::steady_clock::now();
  const auto view = collector.freeze();
  f.estimate_bytes = view->table().state_bytes_estimate;
  const daemon::StateImage image = view->image();
  f.image_s = seconds_since(start);
  for (const daemon::ProcessImage& p : image.processes) {
    f.steps += p.steps.size();
    for (const daemon::StepImage& s : p.steps) f.spans += s.hist.count();
  }
  start = std::chrono::steady_clock::now();
  const daemon::SavedSnapshot saved = daemon::save_snapshot(v2_dir, image, SIZE_MAX);
  f.save_v2_s = seconds_since(start);
  if (saved.ec || saved.encoded.left_out != 0) {
    std::fprintf(stderr, "build: v2 save: %s, %llu left out\n", saved.ec.message().c_str(),
                 static_cast<unsigned long long>(saved.encoded.left_out));
    return f;
  }
  if (opt.v1) {
    const std::uint64_t before_doc = trimmed_rss_kib();
    start = std::chrono::steady_clock::now();
    const nlohmann::json doc = daemon::encode_snapshot(image);
    f.encode_v1_s = seconds_since(start);
    f.v1_doc_kib = trimmed_rss_kib() - before_doc;
    start = std::chrono::steady_clock::now();
    if (const auto ec = daemon::save_snapshot(v1_dir, doc)) {
      std::fprintf(stderr, "build: v1 save: %s\n", ec.message().c_str());
      return f;
    }
    f.save_v1_s = seconds_since(start);
  }
  f.ok = 1;
  return f;
}

// ---- restoring it ------------------------------------------------------------------------

struct LoadFigures {
  int ok = 0;
  int version = 0;
  double load_s = 0;
  double load_cpu_s = 0;
  double adopt_s = 0;
  std::uint64_t rss0_kib = 0;
  std::uint64_t load_peak_kib = 0;     // above rss0
  std::uint64_t image_kib = 0;         // above rss0
  std::uint64_t restore_peak_kib = 0;  // above rss0
  std::uint64_t restored_kib = 0;      // above rss0
  std::uint64_t estimate_bytes = 0;    // the restored Collector's state_bytes_estimate
  std::uint64_t processes = 0;
  std::uint64_t steps = 0;
  std::uint64_t spans = 0;
  std::uint64_t skipped = 0;
  bool hwm_reset = false;
  // malloc's heap right after load_snapshot (mallinfo2): how fragmented the reading left it.
  std::uint64_t heap_bytes = 0;        // arena: the main heap's size
  std::uint64_t heap_free_bytes = 0;   // fordblks: free inside it
  std::uint64_t heap_free_chunks = 0;  // ordblks: in that many chunks
};

LoadFigures load_and_adopt(const fs::path& dir, const daemon::Limits& limits) {
  LoadFigures f;
  f.rss0_kib = trimmed_rss_kib();
  f.hwm_reset = reset_hwm();
  const std::uint64_t base = std::max(f.rss0_kib, f.hwm_reset ? 0 : vm_hwm_kib().value_or(0));
  auto start = std::chrono::steady_clock::now();
  const double cpu0 = cpu_s();
  daemon::LoadedSnapshot loaded = daemon::load_snapshot(dir, limits);
  f.load_s = seconds_since(start);
  f.load_cpu_s = cpu_s() - cpu0;
  f.load_peak_kib = vm_hwm_kib().value_or(0) - base;
  const struct mallinfo2 heap = ::mallinfo2();
  f.heap_bytes = heap.arena;
  f.heap_free_bytes = heap.fordblks;
  f.heap_free_chunks = heap.ordblks;
  f.image_kib = trimmed_rss_kib() - f.rss0_kib;
  f.version = loaded.version;
  if (loaded.status != daemon::LoadedSnapshot::Status::kLoaded) {
    std::fprintf(stderr, "load %s: %s\n", dir.c_str(), loaded.error.c_str());
    return f;
  }
  const daemon::StateImage& image = loaded.image;
  f.skipped = image.skipped.size() + image.skipped_unnamed;
  for (const std::string& reason : image.skipped)
    std::fprintf(stderr, "skipped: %s\n", reason.c_str());
  f.processes = image.processes.size();
  for (const daemon::ProcessImage& p : image.processes) {
    f.steps += p.steps.size();
    for (const daemon::StepImage& s : p.steps) f.spans += s.hist.count();
  }
  daemon::Collector collector(limits, bench_environment(), no_recorder());
  start = std::chrono::steady_clock::now();
  const std::error_code ec = daemon::adopt_snapshot(collector, std::move(loaded.image));
  f.adopt_s = seconds_since(start);
  f.restore_peak_kib = vm_hwm_kib().value_or(0) - base;
  loaded = {};
  f.restored_kib = trimmed_rss_kib() - f.rss0_kib;
  if (ec) {
    std::fprintf(stderr, "adopt %s: %s\n", dir.c_str(), ec.message().c_str());
    return f;
  }
  f.estimate_bytes = collector.freeze()->table().state_bytes_estimate;
  f.ok = 1;
  return f;
}

// ---- the parent: children, the table ------------------------------------------------------

// Runs `fn` in a forked child and returns what it computed (a trivially copyable value,
// sent back through a pipe); nullopt when the child failed.
template <class T, class Fn>
std::optional<T> in_child(Fn&& fn) {
  int fds[2];
  if (::pipe(fds) != 0) return std::nullopt;
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t child = ::fork();
  if (child < 0) return std::nullopt;
  if (child == 0) {
    ::close(fds[0]);
    const T value = fn();
    const bool sent = ::write(fds[1], &value, sizeof value) == static_cast<ssize_t>(sizeof value);
    std::fflush(stdout);
    std::fflush(stderr);
    std::_Exit(sent ? 0 : 1);
  }
  ::close(fds[1]);
  T value{};
  std::size_t got = 0;
  while (got < sizeof value) {
    const ssize_t n = ::read(fds[0], reinterpret_cast<char*>(&value) + got, sizeof value - got);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    got += static_cast<std::size_t>(n);
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  if (got != sizeof value || !WIFEXITED(status) || WEXITSTATUS(status) != 0) return std::nullopt;
  return value;
}

double file_mb(const fs::path& dir) {
  std::error_code ec;
  const auto bytes = fs::file_size(dir / daemon::kSnapshotFileName, ec);
  return ec ? 0.0 : static_cast<double>(bytes) / 1e6;
}

void print_build(int processes, const Options& opt, const BuildFigures& b) {
  std::printf(
      "\n== %d processes x %d custom steps x %d spans (%d uids): %llu steps with data, "
      "%llu spans\n"
      "build: fed in %.2f s; live Collector %.1f MiB (its estimate %.1f MiB); image in %.2f s; "
      "v2 written in %.2f s",
      processes, opt.steps, opt.spans, opt.uids, static_cast<unsigned long long>(b.steps),
      static_cast<unsigned long long>(b.spans), b.feed_s, mib(b.live_kib),
      static_cast<double>(b.estimate_bytes) / (1024.0 * 1024.0), b.image_s, b.save_v2_s);
  if (opt.v1) {
    std::printf("; v1 document built in %.2f s (%.1f MiB held), written in %.2f s", b.encode_v1_s,
                mib(b.v1_doc_kib), b.save_v1_s);
  }
  std::printf("\n");
}

// Columns: wall and CPU seconds of load_snapshot, wall seconds of adopt, then MiB above
// the child's start (see the top of this file), the ratios of the restore peak.
constexpr const char* kHeaderFormat = "%-6s %8s %7s %7s %7s %8s %8s %8s %8s %8s %9s %9s %7s\n";

void print_header() {
  std::printf(kHeaderFormat, "", "file", "load", "load", "adopt", "load", "image", "restore",
              "restored", "estimate", "peak /", "peak /", "records");
  std::printf(kHeaderFormat, "format", "MB", "wall s", "cpu s", "wall s", "peak", "MiB", "peak",
              "MiB", "MiB", "file", "restored", "skipped");
}

void print_row(const char* name, double mb, const LoadFigures& l) {
  const double peak = mib(l.restore_peak_kib);
  const double restored = mib(l.restored_kib);
  std::printf("%-6s %8.1f %7.2f %7.2f %7.2f %8.1f %8.1f %8.1f %8.1f %8.1f %9.2f %9.2f %7llu\n",
              name, mb, l.load_s, l.load_cpu_s, l.adopt_s, mib(l.load_peak_kib), mib(l.image_kib),
              peak, restored, static_cast<double>(l.estimate_bytes) / (1024.0 * 1024.0),
              peak / (mb * 1e6 / (1024.0 * 1024.0)), restored > 0 ? peak / restored : 0.0,
              static_cast<unsigned long long>(l.skipped));
}

// Builds, writes and restores one size; false when anything failed or did not match.
bool run_size(const Options& opt, int processes) {
  steptrace::testing::TempDir tmp;
  const fs::path v2_dir = fs::path(tmp.path()) / "v2";
  const fs::path v1_dir = fs::path(tmp.path()) / "v1";
  // save_snapshot writes only into a directory no one else may write to.
  if (::mkdir(v2_dir.c_str(), 0700) != 0 || ::mkdir(v1_dir.c_str(), 0700) != 0) {
    std::fprintf(stderr, "mkdir under %s failed\n", tmp.path().c_str());
    return false;
  }
  const auto built =
      in_child<BuildFigures>([&] { return build_and_save(opt, processes, v2_dir, v1_dir); });
  if (!built || built->ok == 0) {
    std::fprintf(stderr, "building %d processes failed\n", processes);
    return false;
  }
  print_build(processes, opt, *built);
  print_header();
  const daemon::Limits limits = bench_limits(opt, processes);
  bool ok = true;
  for (const auto& [name, dir, wanted] :
       {std::tuple{"v1", v1_dir, opt.v1}, std::tuple{"v2", v2_dir, opt.v2}}) {
    if (!wanted) continue;
    const double mb = file_mb(dir);
    const auto loaded = in_child<LoadFigures>([&, d = dir] { return load_and_adopt(d, limits); });
    if (!loaded || loaded->ok == 0) {
      std::printf("%-6s %8.1f  restore FAILED\n", name, mb);
      ok = false;
      continue;
    }
    print_row(name, mb, *loaded);
    if (loaded->skipped != 0 || loaded->processes != static_cast<std::uint64_t>(processes) ||
        loaded->steps != built->steps || loaded->spans != built->spans) {
      std::printf("  MISMATCH: %llu processes, %llu steps, %llu spans restored\n",
                  static_cast<unsigned long long>(loaded->processes),
                  static_cast<unsigned long long>(loaded->steps),
                  static_cast<unsigned long long>(loaded->spans));
      ok = false;
    }
    std::printf("       heap after load: %.1f MiB, %.1f MiB of it free in %llu chunks\n",
                static_cast<double>(loaded->heap_bytes) / (1024.0 * 1024.0),
                static_cast<double>(loaded->heap_free_bytes) / (1024.0 * 1024.0),
                static_cast<unsigned long long>(loaded->heap_free_chunks));
    if (!loaded->hwm_reset) std::printf("  (VmHWM could not be reset: peaks are upper bounds)\n");
  }
  std::fflush(stdout);
  return ok;
}

std::vector<int> parse_list(const std::string& text) {
  std::vector<int> out;
  std::size_t at = 0;
  while (at <= text.size()) {
    const std::size_t comma = std::min(text.find(',', at), text.size());
    out.push_back(std::atoi(text.substr(at, comma - at).c_str()));
    at = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    if (arg == "--processes" && has_value) {
      opt.processes = parse_list(argv[++i]);
    } else if (arg == "--steps" && has_value) {
      opt.steps = std::atoi(argv[++i]);
    } else if (arg == "--spans" && has_value) {
      opt.spans = std::atoi(argv[++i]);
    } else if (arg == "--uids" && has_value) {
      opt.uids = std::atoi(argv[++i]);
    } else if (arg == "--formats" && has_value) {
      const std::string formats = argv[++i];
      opt.v1 = formats.find("v1") != std::string::npos;
      opt.v2 = formats.find("v2") != std::string::npos;
    } else {
      std::fprintf(stderr,
                   "usage: %s [--processes N[,N...]] [--steps K] [--spans S] [--uids U] "
                   "[--formats v1,v2]\n",
                   argv[0]);
      return 2;
    }
  }
  const bool counts_ok = opt.steps >= 1 && opt.steps <= static_cast<int>(proto::kMaxCustomSteps) &&
                         opt.spans >= 1 && opt.uids >= 1 && (opt.v1 || opt.v2);
  bool processes_ok = !opt.processes.empty();
  for (int n : opt.processes) processes_ok = processes_ok && n >= 1;
  if (!counts_ok || !processes_ok) {
    std::fprintf(stderr, "--processes, --steps (<= %u), --spans and --uids must be >= 1\n",
                 static_cast<unsigned>(proto::kMaxCustomSteps));
    return 2;
  }
  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  bool ok = true;
  for (int processes : opt.processes) ok = run_size(opt, processes) && ok;
  if (!ok) {
    std::fprintf(stderr,
                 "SNAPSHOT BENCH FAILED: a restore failed, skipped records or "
                 "restored other counts than were built\n");
    return 1;
  }
  return 0;
}
