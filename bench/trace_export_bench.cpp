// The flight recorder's side of `trace`, in process, on one core (the daemon's render
// thread for the export, its io thread for the capture):
//
//   trace/export_1M       TraceExport::next() over a capture of 1,000,000 events into one
//                         reused buffer with the default piece size (kPieceBytes, 1 MiB),
//                         as the daemon streams a reply: ms per whole document, MB written.
//   trace/render_trace_1M render_trace(): the same document as one string (tests, small
//                         captures), for comparison.
//   trace/capture_1M      FlightRecorder::capture() of those events: what `trace` costs
//                         the io thread before the render thread takes over.
//
// The capture: 4 processes x 8 threads x 31,250 events, each thread a run of
// Forward { Matmul { Attention, Attention }, Transpose } (Backward instead of Forward every
// other time): 10 events, 5 spans, 3 deep. The events go to FlightRecorder::record() in
// batches of 1,024 of one thread (as a client's flusher sends one thread's ring at a time),
// threads and processes in turn. The document is checked once: 500,000 complete events,
// 32 thread names, 4 process names.
//
// Also, once at start, printed: bytes per stored event once the default 32 MiB budget is
// full (the recorder's own count, FlightRecorderCounters::bytes over the events it holds,
// and this process's RSS growth over the same events).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <benchmark/benchmark.h>

#include "bench/bench_support.h"
#include "bench/median_reporter.h"
#include "daemon/report/trace_export.h"
#include "daemon/state/flight_recorder.h"
#include "proto/wire_format.h"

namespace {

namespace proto = steptrace::proto;
namespace daemon = steptrace::daemon;

constexpr int kProcesses = 4;
constexpr int kThreads = 8;
constexpr std::size_t kEventsPerThread = 31'250;
constexpr std::size_t kEvents = kProcesses * kThreads * kEventsPerThread;  // 1,000,000
constexpr std::size_t kPatternEvents = 10;                                 // 5 spans
constexpr std::size_t kSpans = kEvents / kPatternEvents * 5;
constexpr std::size_t kBatch = 1024;
constexpr std::int32_t kFirstPid = 4000;
constexpr std::uint64_t kBaseNs = 1'000'000'000'000;

static_assert(kEventsPerThread % kPatternEvents == 0, "whole patterns per thread");

std::uint32_t tid_of(int process, int thread) {
  return static_cast<std::uint32_t>(kFirstPid + process * 100 + thread);
}

// One thread's events: `kEventsPerThread / kPatternEvents` nested patterns back to back.
std::vector<proto::EventRecord> thread_events(std::uint32_t tid, int seed) {
  enum : std::uint16_t { kForward = 0, kBackward = 1, kMatmul = 2, kAttention = 3, kTranspose = 4 };
  std::vector<proto::EventRecord> out;
  out.reserve(kEventsPerThread);
  std::uint64_t t = kBaseNs + static_cast<std::uint64_t>(seed) * 1000;
  std::uint64_t noise = static_cast<std::uint64_t>(seed) * 2654435761u + 1;
  const auto advance = [&](std::uint64_t base) {
    noise = noise * 6364136223846793005ULL + 1442695040888963407ULL;
    t += base + (noise >> 33) % base;
  };
  const auto event = [&](std::uint16_t step, proto::EventKind kind) {
    out.push_back({t, tid, step, static_cast<std::uint8_t>(kind), 0});
  };
  for (std::size_t i = 0; out.size() < kEventsPerThread; ++i) {
    const std::uint16_t outer = i % 2 == 0 ? kForward : kBackward;
    event(outer, proto::EventKind::kStart);
    advance(200);
    event(kMatmul, proto::EventKind::kStart);
    for (int k = 0; k < 2; ++k) {
      advance(100);
      event(kAttention, proto::EventKind::kStart);
      advance(3000);
      event(kAttention, proto::EventKind::kEnd);
    }
    advance(100);
    event(kMatmul, proto::EventKind::kEnd);
    advance(100);
    event(kTranspose, proto::EventKind::kStart);
    advance(500);
    event(kTranspose, proto::EventKind::kEnd);
    advance(100);
    event(outer, proto::EventKind::kEnd);
    advance(1000);
  }
  return out;
}

// All threads' events; [process][thread].
std::vector<std::vector<std::vector<proto::EventRecord>>> all_events() {
  std::vector<std::vector<std::vector<proto::EventRecord>>> out(kProcesses);
  for (int p = 0; p < kProcesses; ++p) {
    for (int th = 0; th < kThreads; ++th) {
      out[p].push_back(thread_events(tid_of(p, th), p * kThreads + th));
    }
  }
  return out;
}

daemon::PeerIdentity peer_of(int process) {
  const std::int32_t pid = kFirstPid + process * 100;
  return {{pid, 1000u + static_cast<std::uint64_t>(pid)}, 0, 0, "trainer"};
}

// Records `rounds` passes over every thread's events (batches of kBatch, threads and
// processes in turn) into `recorder`; returns the daemon clock after the last batch.
std::uint64_t fill(daemon::FlightRecorder& recorder,
                   const std::vector<std::vector<std::vector<proto::EventRecord>>>& events,
                   int rounds) {
  for (int p = 0; p < kProcesses; ++p)
    recorder.begin_process(static_cast<std::uint32_t>(p), peer_of(p));
  std::uint64_t now = kBaseNs;
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t offset = 0; offset < kEventsPerThread; offset += kBatch) {
      const std::size_t n = std::min(kBatch, kEventsPerThread - offset);
      for (int th = 0; th < kThreads; ++th) {
        for (int p = 0; p < kProcesses; ++p) {
          const auto* data = reinterpret_cast<const std::byte*>(events[p][th].data() + offset);
          recorder.record(static_cast<std::uint32_t>(p), proto::EventSpan(data, n), now);
          now += 1000;
        }
      }
    }
  }
  return now;
}

struct Fixture {
  Fixture() : events(all_events()) {
    const std::uint64_t now = fill(recorder, events, 1);
    capture = recorder.capture({}, 0, now + 10'000'000);
  }
  std::vector<std::vector<std::vector<proto::EventRecord>>> events;
  daemon::FlightRecorder recorder;  // the default budget (32 MiB) holds the 1 M events
  std::shared_ptr<const daemon::TraceCapture> capture;
};

Fixture& fixture() {
  static Fixture fx;
  return fx;
}

std::size_t count(std::string_view text, std::string_view what) {
  std::size_t n = 0;
  for (std::size_t at = text.find(what); at != std::string_view::npos;
       at = text.find(what, at + what.size())) {
    ++n;
  }
  return n;
}

// The document holds every span, thread and process; an error message, or empty.
std::string check_document() {
  Fixture& fx = fixture();
  const daemon::FlightRecorderCounters c = fx.recorder.counters();
  if (c.events_recorded != kEvents || c.events_evicted != 0) {
    return "recorder holds " + std::to_string(c.events_recorded - c.events_evicted) +
           " events, want " + std::to_string(kEvents);
  }
  const std::string doc = daemon::render_trace(fx.capture);
  const std::size_t spans = count(doc, R"("ph":"X")");
  const std::size_t threads = count(doc, R"("name":"thread_name")");
  const std::size_t processes = count(doc, R"("name":"process_name")");
  if (spans != kSpans || threads != kProcesses * kThreads || processes != kProcesses ||
      doc.empty() || doc.back() != '\n') {
    return "document has " + std::to_string(spans) + " spans, " + std::to_string(threads) +
           " threads, " + std::to_string(processes) + " processes";
  }
  return {};
}

void bm_export(benchmark::State& state) {
  Fixture& fx = fixture();
  std::string out;  // reused, as the daemon's reply buffer
  std::size_t bytes = 0;
  std::size_t pieces = 0;
  for (auto _ : state) {
    daemon::TraceExport exporter(fx.capture);
    bytes = 0;
    pieces = 0;
    bool more = true;
    while (more) {
      more = exporter.next(out);
      bytes += out.size();
      ++pieces;
      benchmark::DoNotOptimize(out.data());
      out.clear();
    }
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kEvents));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(bytes));
  state.counters["output_MB"] = static_cast<double>(bytes) / 1e6;
  state.counters["pieces"] = static_cast<double>(pieces);
}

void bm_render_trace(benchmark::State& state) {
  Fixture& fx = fixture();
  std::size_t bytes = 0;
  for (auto _ : state) {
    const std::string doc = daemon::render_trace(fx.capture);
    bytes = doc.size();
    benchmark::DoNotOptimize(doc.data());
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(kEvents));
  state.counters["output_MB"] = static_cast<double>(bytes) / 1e6;
}

void bm_capture(benchmark::State& state) {
  Fixture& fx = fixture();
  std::size_t chunks = 0;
  for (auto _ : state) {
    auto capture = fx.recorder.capture({}, 0, kBaseNs);
    chunks = 0;
    for (const auto& p : capture->processes) chunks += p.chunks.size();
    benchmark::DoNotOptimize(capture.get());
  }
  state.counters["chunks"] = static_cast<double>(chunks);
}

// Fills a recorder with the default budget to several times its size; prints what it
// charges per event held, and this process's RSS growth per event held.
void print_bytes_per_event() {
  const auto& events = fixture().events;
  const std::optional<std::uint64_t> rss_before = steptrace::bench::vm_rss_kib();
  daemon::FlightRecorder recorder;  // default: 32 MiB
  fill(recorder, events, 3);        // 3 M events, ~48 MB offered
  const std::optional<std::uint64_t> rss_after = steptrace::bench::vm_rss_kib();
  const daemon::FlightRecorderCounters c = recorder.counters();
  const std::uint64_t held = c.events_recorded - c.events_evicted;
  std::printf(
      "flight recorder, default budget %.0f MiB, after %llu events (4 processes x 8 threads): "
      "holds %llu events (%llu evicted), charges %.2f MiB = %.2f bytes per event held",
      static_cast<double>(c.budget_bytes) / (1 << 20),
      static_cast<unsigned long long>(c.events_recorded), static_cast<unsigned long long>(held),
      static_cast<unsigned long long>(c.events_evicted), static_cast<double>(c.bytes) / (1 << 20),
      held ? static_cast<double>(c.bytes) / static_cast<double>(held) : 0.0);
  if (rss_before && rss_after && held != 0) {
    std::printf("; RSS grew %.2f MiB = %.2f bytes per event held",
                static_cast<double>(*rss_after - *rss_before) / 1024,
                static_cast<double>(*rss_after - *rss_before) * 1024 / static_cast<double>(held));
  }
  std::printf(" (wire record: %zu bytes)\n", sizeof(proto::EventRecord));
}

}  // namespace

int main(int argc, char** argv) {
  if (!steptrace::bench::initialize(
          argc, argv, {"--benchmark_repetitions=5", "--benchmark_display_aggregates_only=true"}))
    return 2;

  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  print_bytes_per_event();
  if (const std::string error = check_document(); !error.empty()) {
    std::fprintf(stderr, "trace_export_bench: %s\n", error.c_str());
    return 1;
  }
  benchmark::RegisterBenchmark("trace/export_1M", bm_export)->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("trace/render_trace_1M", bm_render_trace)
      ->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("trace/capture_1M", bm_capture)->Unit(benchmark::kMicrosecond);

  steptrace::bench::MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  std::printf("\n== trace export: %zu events (%d processes x %d threads), %zu spans (medians) ==\n",
              kEvents, kProcesses, kThreads, kSpans);
  auto counter = [](const steptrace::bench::Figure& f, const char* name) {
    auto it = f.counters.find(name);
    return it == f.counters.end() ? 0.0 : it->second;
  };
  if (auto f = reporter.median("trace/export_1M@1")) {
    std::printf(
        "  TraceExport::next, %zu-byte pieces: %.1f ms per export (cpu %.1f ms), %.1f MB in %.0f "
        "pieces, %.1f M events/s, %.0f MB/s\n",
        daemon::TraceExport::kPieceBytes, f->real_time, f->cpu_time, counter(*f, "output_MB"),
        counter(*f, "pieces"), counter(*f, "items_per_second") / 1e6,
        counter(*f, "bytes_per_second") / 1e6);
  }
  if (auto f = reporter.median("trace/render_trace_1M@1")) {
    std::printf("  render_trace (one string): %.1f ms (cpu %.1f ms), %.1f MB\n", f->real_time,
                f->cpu_time, counter(*f, "output_MB"));
  }
  if (auto f = reporter.median("trace/capture_1M@1")) {
    std::printf("  FlightRecorder::capture (io thread): %.1f us for %.0f chunks\n", f->real_time,
                counter(*f, "chunks"));
  }
  benchmark::Shutdown();
  return 0;
}
