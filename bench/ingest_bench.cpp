// Daemon ingest on one core, in process: proto::Encoder builds 64 KiB event frames,
// proto::Decoder (one per simulated connection, as the daemon's sessions have) takes the
// bytes and validates them, and daemon::Collector::events() folds them into per
// (process, step) aggregates. Measured for 10, 1,000 and 100,000 distinct keys:
//      10 keys =    1 process  x  10 built-in steps
//   1,000 keys =   10 processes x 100 steps (12 built-in + 88 registered custom steps)
// 100,000 keys = 1000 processes x 100 steps
// Each process owns one prebuilt frame of 4096 events: 2048 start/end pairs on one
// thread, cycling through its steps. Durations vary within a factor 4 of a per-step base
// ("validated", what a real step looks like: 2-3 histogram chunks per key), or over
// 0.5..130 us for every step ("validated_wide_spread": 9 chunks per key, a larger working
// set). One iteration feeds every process's frame once.
//
// Also measured ("render/*"): how long one report, or one Prometheus scrape, takes to
// render from that state (called on the bench thread). The daemon renders on its render
// thread from a view (daemon/serve/render_worker.h), so this is how long a request waits for its
// reply, and how long a view lives while ingest goes on.
//
// While rendering ("ingest/validated_while_rendering"): the "validated" feed while a
// second thread renders `report --json` and the metrics text alternately, in a loop, from
// views, as the daemon's RenderWorker does (daemon/serve/render_worker.h): between frames the
// ingest thread checks one atomic; when the render thread is idle it freezes a view
// (Collector::freeze) and hands it over, and when the render thread hands a view back it
// releases it; views are made and destroyed on the ingest thread only. While a view lives,
// the first frame of each process clones that process's record (copy-on-write), so each
// view costs about one clone per process. Compared with "validated" in the same run.
//
// Baseline in the same run ("ingest/lower_bound"): the same bytes copied the same way
// (the stand-in for the socket read) and folded into a flat array of counters with no
// validation and no span matching. The ratio shows what validation + aggregation cost.
//
// The flight recorder (daemon/state/flight_recorder.h): every benchmark here runs with it
// OFF (budget 0) except "ingest/validated_recorder_on", which is "validated" with the
// daemon's default recorder (32 MiB, 300 s): after folding each batch, Collector::events
// copies it into the process's 4 KiB chunks, evicting the oldest chunk once the budget
// is full. Both variants first feed enough frames to fill the budget (untimed, the same
// number for both), so the timed loop measures the recorder's steady state, as in a
// daemon that has run a while. They are registered side by side per key count, and the
// repetitions of all benchmarks are interleaved at random by default
// (--benchmark_enable_random_interleaving), so on/off see the same load.
// --recorder_budget_mib=N (this bench's own flag) runs "recorder_on" with another budget.
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "bench/bench_support.h"
#include "bench/median_reporter.h"
#include "daemon/report/report.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"

namespace {

namespace proto = steptrace::proto;
namespace daemon = steptrace::daemon;

constexpr std::size_t kEventsPerFrame = 4096;  // 64 KiB of payload
constexpr std::int32_t kFirstPid = 100000;

std::uint64_t start_time_of(std::int32_t pid) { return 1000u + static_cast<std::uint64_t>(pid); }

struct Shape {
  int processes;
  int steps;  // per process
};

Shape shape_for(std::int64_t keys) {
  if (keys <= static_cast<std::int64_t>(proto::kBuiltinStepCount)) {
    return {1, static_cast<int>(keys)};
  }
  return {static_cast<int>(keys / 100), 100};
}

std::uint16_t step_id(int slot) {
  return static_cast<std::uint16_t>(slot < static_cast<int>(proto::kBuiltinStepCount)
                                        ? slot
                                        : proto::kFirstCustomStep +
                                              (slot - proto::kBuiltinStepCount));
}

// How span durations vary within one step.
enum class Spread {
  kTypical,  // within a factor 4 of the step's base (1 us .. 512 us by step): 2-3 powers of two
  kWide,     // 0.5 us .. 130 us for every step: 9 powers of two, the histogram's worst side
};

// One events frame (header + 4096 records) for a process with `steps` steps.
std::vector<std::byte> build_frame(std::uint32_t tid, int steps, int seed, Spread spread) {
  std::vector<proto::EventRecord> events;
  events.reserve(kEventsPerFrame);
  std::uint64_t t = 1'000'000'000;
  for (std::size_t i = 0; events.size() < kEventsPerFrame; ++i) {
    const int slot =
        static_cast<int>((i + static_cast<std::size_t>(seed)) % static_cast<std::size_t>(steps));
    const std::uint16_t step = step_id(slot);
    const std::uint64_t noise = (i * 2654435761u + static_cast<std::size_t>(seed)) >> 7;
    std::uint64_t d = 0;
    if (spread == Spread::kTypical) {
      const std::uint64_t base = 1000ull << (slot % 10);
      d = base + noise % (3 * base);
    } else {
      d = 500 + noise % 130'000;
    }
    events.push_back({t, tid, step, static_cast<std::uint8_t>(proto::EventKind::kStart), 0});
    events.push_back({t + d, tid, step, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0});
    t += d + 50;
  }
  std::vector<std::byte> frame(sizeof(proto::FrameHeader) +
                               kEventsPerFrame * sizeof(proto::EventRecord));
  proto::Encoder enc(frame);
  if (enc.events(events) != kEventsPerFrame) std::abort();
  return frame;
}

daemon::Environment bench_environment() {
  daemon::Environment env;
  env.monotonic_now_ns = [] { return steptrace::bench::monotonic_ns(); };
  env.probe = [](std::int32_t pid) -> std::optional<daemon::ProcessProbe> {
    return daemon::ProcessProbe{start_time_of(pid), false, "trainer"};
  };
  return env;
}

enum class Recorder { kOff, kOn };

// The budget of "recorder_on": the daemon's default unless --recorder_budget_mib says.
std::size_t g_recorder_budget = daemon::FlightRecorderConfig{}.budget_bytes;

// kOn: the daemon's default flight recorder (g_recorder_budget); kOff: budget 0.
daemon::FlightRecorderConfig recorder_config(Recorder recorder) {
  daemon::FlightRecorderConfig config;
  config.budget_bytes = recorder == Recorder::kOff ? 0 : g_recorder_budget;
  return config;
}

// The daemon side of `processes` connections, each with its decoder past the hello and
// its custom steps registered.
struct IngestFixture {
  IngestFixture(Shape s, Spread spread, Recorder recorder)
      : shape(s), collector(daemon::Limits{}, bench_environment(), recorder_config(recorder)) {
    std::vector<std::byte> hello_bytes(sizeof(proto::Hello));
    proto::Encoder hello_enc(hello_bytes);
    hello_enc.hello("bench", "trainer");
    for (int p = 0; p < shape.processes; ++p) {
      const std::int32_t pid = kFirstPid + p;
      daemon::PeerIdentity peer{{pid, start_time_of(pid)},
                                static_cast<std::uint32_t>(getuid()),
                                static_cast<std::uint32_t>(getgid()),
                                "trainer"};
      daemon::ProcessHandle handle = 0;
      if (auto ec = collector.attach(peer, handle)) {
        error = "attach: " + ec.message();
        return;
      }
      handles.push_back(handle);
      auto& dec = decoders.emplace_back(std::make_unique<proto::Decoder>(proto::Side::kDaemon));
      dec->feed(hello_bytes);
      auto r = dec->next();
      if (r.error || !r.message || !std::holds_alternative<proto::Hello>(*r.message)) {
        error = "hello did not decode";
        return;
      }
      collector.hello(handle, std::get<proto::Hello>(*r.message));
      for (int slot = static_cast<int>(proto::kBuiltinStepCount); slot < shape.steps; ++slot) {
        proto::RegisterStep reg{};
        reg.step = step_id(slot);
        proto::set_field(reg.name, "custom_step_" + std::to_string(slot));
        if (auto ec = collector.register_step(handle, reg)) {
          error = "register_step: " + ec.message();
          return;
        }
      }
      frames.push_back(build_frame(static_cast<std::uint32_t>(pid), shape.steps, p, spread));
    }
  }

  Shape shape;
  daemon::Collector collector;
  std::vector<daemon::ProcessHandle> handles;
  std::vector<std::unique_ptr<proto::Decoder>> decoders;
  std::vector<std::vector<std::byte>> frames;
  std::string error;
};

// Feeds every process's frame once through its decoder into the collector, calling
// `between_frames()` before each frame; the first error, or empty.
template <class BetweenFrames>
std::string feed_all(IngestFixture& fx, BetweenFrames&& between_frames) {
  for (std::size_t p = 0; p < fx.frames.size(); ++p) {
    between_frames();
    proto::Decoder& dec = *fx.decoders[p];
    dec.feed(fx.frames[p]);
    for (;;) {
      auto r = dec.next();
      if (r.error) return "decode: " + r.error.message();
      if (!r.message) break;
      if (auto* events = std::get_if<proto::EventSpan>(&*r.message)) {
        if (auto ec = fx.collector.events(fx.handles[p], *events)) return "events: " + ec.message();
      }
    }
  }
  return {};
}

std::string feed_all(IngestFixture& fx) {
  return feed_all(fx, [] {});
}

// Spans the first process's report counts (every frame adds kEventsPerFrame / 2).
std::uint64_t first_process_spans(const daemon::Collector& collector) {
  std::uint64_t spans = 0;
  const auto doc = steptrace::daemon::report::report_json(*collector.freeze(), kFirstPid);
  for (const auto& proc : doc.value("processes", nlohmann::json::array())) {
    for (const auto& step : proc.value("steps", nlohmann::json::array())) {
      spans += step.value("count", std::uint64_t{0});
    }
  }
  return spans;
}

// The fold must have counted every span of `feeds` feeds; an error message, or empty.
std::string check_spans(const daemon::Collector& collector, std::int64_t feeds) {
  const std::uint64_t spans = first_process_spans(collector);
  const auto want = static_cast<std::uint64_t>(feeds) * (kEventsPerFrame / 2);
  if (spans == want) return {};
  return "report counts " + std::to_string(spans) + " spans for pid " + std::to_string(kFirstPid) +
         ", want " + std::to_string(want);
}

void set_ingest_rates(benchmark::State& state, const IngestFixture& fx) {
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(fx.frames.size()) *
                          static_cast<std::int64_t>(kEventsPerFrame));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(fx.frames.size()) *
                          static_cast<std::int64_t>(fx.frames[0].size()));
}

// Feeds, before the timed loop, that fill the recorder's budget (and two more): the same
// count whether the recorder is on or off.
std::int64_t warmup_feeds(const IngestFixture& fx) {
  const std::size_t per_feed = fx.frames.size() * kEventsPerFrame * sizeof(proto::EventRecord);
  return static_cast<std::int64_t>(g_recorder_budget / per_feed) + 2;
}

// The recorder's figures after the run: bytes charged per event it holds, events held,
// MiB charged, and whether its budget was full when timing started.
void set_recorder_counters(benchmark::State& state, IngestFixture& fx, bool full_at_start) {
  const daemon::FlightRecorderCounters c = fx.collector.recorder().counters();
  const std::uint64_t retained = c.events_recorded - c.events_evicted;
  state.counters["rec_bytes_per_event"] =
      retained != 0 ? static_cast<double>(c.bytes) / static_cast<double>(retained) : 0.0;
  state.counters["rec_events_held"] = static_cast<double>(retained);
  state.counters["rec_MiB"] = static_cast<double>(c.bytes) / (1 << 20);
  state.counters["rec_full_at_start"] = full_at_start ? 1.0 : 0.0;
}

template <Spread kSpread, Recorder kRecorder = Recorder::kOff>
void bm_ingest(benchmark::State& state) {
  IngestFixture fx(shape_for(state.range(0)), kSpread, kRecorder);
  if (!fx.error.empty()) {
    state.SkipWithError(fx.error.c_str());
    return;
  }
  const std::int64_t warmup = warmup_feeds(fx);
  for (std::int64_t i = 0; i < warmup; ++i) {
    if (const std::string error = feed_all(fx); !error.empty()) {
      state.SkipWithError(error.c_str());
      return;
    }
  }
  // Within one chunk of the budget: the next chunk evicts the oldest.
  const daemon::FlightRecorderCounters at_start = fx.collector.recorder().counters();
  const bool full_at_start = at_start.budget_bytes != 0 &&
                             at_start.bytes + sizeof(daemon::TraceChunk) > at_start.budget_bytes;
  for (auto _ : state) {
    if (const std::string error = feed_all(fx); !error.empty()) {
      state.SkipWithError(error.c_str());
      break;
    }
  }
  // The fold must have counted every span: check the first process's report.
  if (const std::string error = check_spans(fx.collector, warmup + state.iterations());
      !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  set_ingest_rates(state, fx);
  if constexpr (kRecorder == Recorder::kOn) set_recorder_counters(state, fx, full_at_start);
}

// The daemon's render protocol (daemon/serve/render_worker.cpp) on two threads, with one atomic
// for the handoff instead of the io_context's posts. The ingest thread calls poll()
// between frames (one acquire load unless a handoff is due): when the render thread is
// idle it freezes a view and hands it over; when the render thread has handed one back
// it releases it (views are made and destroyed on the ingest thread only, so only it
// touches the records' use counts) and freezes the next, at most one per 10 ms as the
// daemon's RenderWorker paces them, so the render thread is nearly always busy. The render thread
// reads the view through a raw pointer and renders `report --json` (serialised) and the metrics
// text alternately.
class RenderLoop {
 public:
  explicit RenderLoop(daemon::Collector& collector)
      : collector_(collector), thread_([this] { render_thread(); }) {}
  ~RenderLoop() { stop(); }
  RenderLoop(const RenderLoop&) = delete;
  RenderLoop& operator=(const RenderLoop&) = delete;

  // Ingest thread, between frames.
  void poll() {
    const int phase = phase_.load(std::memory_order_acquire);
    if (phase == kRendering) [[likely]]
      return;
    hand_over(phase);
  }

  // Ingest thread: waits for the render in flight, stops the render thread and releases
  // the last view. Idempotent.
  void stop() {
    if (!thread_.joinable()) return;
    for (int phase; (phase = phase_.load(std::memory_order_acquire)) == kRendering;) {
      phase_.wait(phase, std::memory_order_acquire);
    }
    phase_.store(kStop, std::memory_order_release);
    phase_.notify_all();
    thread_.join();
    view_.reset();
  }

  // Ingest thread. Renders handed back, and views made, since construction.
  std::uint64_t renders_done() const { return renders_done_; }
  std::uint64_t views_made() const { return views_made_; }
  // After stop(): mean render time in ms, per kind (0: report --json, 1: metrics).
  double mean_ms(int kind) const {
    return renders_[kind]
               ? static_cast<double>(render_ns_[kind]) / 1e6 / static_cast<double>(renders_[kind])
               : 0.0;
  }

 private:
  enum : int { kIdle, kRendering, kDone, kStop };
  // daemon/serve/render_worker.h: RenderWorker::kMinViewInterval.
  static constexpr std::chrono::milliseconds kMinViewInterval{10};
  std::chrono::steady_clock::time_point last_freeze_{};

  void hand_over(int phase) {
    if (phase == kDone) {
      view_.reset();  // released here, as the daemon does on its io thread
      ++renders_done_;
      phase_.store(kIdle, std::memory_order_relaxed);
    }
    // At most one view per kMinViewInterval, as RenderWorker paces them.
    const auto now = std::chrono::steady_clock::now();
    if (now < last_freeze_ + kMinViewInterval) return;
    last_freeze_ = now;
    view_ = collector_.freeze();
    ++views_made_;
    handed_ = view_.get();  // published by the release store below
    phase_.store(kRendering, std::memory_order_release);
    phase_.notify_one();
  }

  void render_thread() {
    int kind = 0;  // 0: report --json, 1: metrics
    for (;;) {
      int phase = phase_.load(std::memory_order_acquire);
      while (phase == kIdle || phase == kDone) {
        phase_.wait(phase, std::memory_order_acquire);
        phase = phase_.load(std::memory_order_acquire);
      }
      if (phase == kStop) return;
      const daemon::CollectorView& view = *handed_;
      const auto t0 = std::chrono::steady_clock::now();
      std::string out = kind == 0
                            ? steptrace::daemon::report::report_json(view, std::nullopt).dump()
                            : steptrace::daemon::report::metrics_text(view);
      benchmark::DoNotOptimize(out.data());
      render_ns_[kind] +=
          static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                         std::chrono::steady_clock::now() - t0)
                                         .count());
      ++renders_[kind];
      kind ^= 1;
      out = {};  // freed before the view goes back, as the daemon sends it first
      phase_.store(kDone, std::memory_order_release);
      phase_.notify_all();  // stop() may be waiting
    }
  }

  daemon::Collector& collector_;
  std::shared_ptr<const daemon::CollectorView> view_;  // ingest thread only
  const daemon::CollectorView* handed_ = nullptr;      // written before kRendering
  std::atomic<int> phase_{kIdle};
  std::uint64_t renders_done_ = 0;
  std::uint64_t views_made_ = 0;
  // Render thread only; read after join.
  std::uint64_t render_ns_[2] = {0, 0};
  std::uint64_t renders_[2] = {0, 0};
  std::thread thread_;  // last: starts once everything above is constructed
};

void bm_ingest_while_rendering(benchmark::State& state) {
  IngestFixture fx(shape_for(state.range(0)), Spread::kTypical, Recorder::kOff);
  if (!fx.error.empty()) {
    state.SkipWithError(fx.error.c_str());
    return;
  }
  RenderLoop renders(fx.collector);
  std::string error;
  for (auto _ : state) {
    error = feed_all(fx, [&renders] { renders.poll(); });
    if (!error.empty()) break;
  }
  // Counted before stop(): renders handed back and views made within the timed loop.
  const std::uint64_t done = renders.renders_done();
  const std::uint64_t views = renders.views_made();
  renders.stop();
  if (!error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  if (const std::string e = check_spans(fx.collector, state.iterations()); !e.empty()) {
    state.SkipWithError(e.c_str());
    return;
  }
  set_ingest_rates(state, fx);
  state.counters["renders"] = static_cast<double>(done);
  state.counters["views"] = static_cast<double>(views);
  // A render outlasts one feed of every process at each size measured here, so the first
  // frame of each process after a freeze clones its record: about one clone per process
  // per view.
  state.counters["clones_est"] = static_cast<double>(views * fx.frames.size());
  state.counters["json_ms"] = renders.mean_ms(0);
  state.counters["metrics_ms"] = renders.mean_ms(1);
}

// The lower bound: same frames, same copy, then count/total per key with no checks.
void bm_lower_bound(benchmark::State& state) {
  const Shape shape = shape_for(state.range(0));
  struct Counter {
    std::uint64_t count = 0;
    std::uint64_t total = 0;
  };
  std::vector<Counter> flat(static_cast<std::size_t>(shape.processes) *
                            (proto::kBuiltinStepCount + proto::kMaxCustomSteps));
  std::vector<std::vector<std::byte>> frames;
  std::vector<std::vector<std::byte>> reads;  // one receive buffer per connection
  for (int p = 0; p < shape.processes; ++p) {
    frames.push_back(
        build_frame(static_cast<std::uint32_t>(kFirstPid + p), shape.steps, p, Spread::kTypical));
    reads.emplace_back(frames.back().size());
  }
  constexpr std::size_t kStride = proto::kBuiltinStepCount + proto::kMaxCustomSteps;
  for (auto _ : state) {
    for (std::size_t p = 0; p < frames.size(); ++p) {
      std::memcpy(reads[p].data(), frames[p].data(), frames[p].size());
      const std::byte* rec = reads[p].data() + sizeof(proto::FrameHeader);
      Counter* base = flat.data() + p * kStride;
      for (std::size_t i = 0; i < kEventsPerFrame; ++i, rec += sizeof(proto::EventRecord)) {
        proto::EventRecord e;
        std::memcpy(&e, rec, sizeof e);
        const std::size_t slot = e.step < proto::kBuiltinStepCount
                                     ? e.step
                                     : e.step - proto::kFirstCustomStep + proto::kBuiltinStepCount;
        const bool end = e.kind == static_cast<std::uint8_t>(proto::EventKind::kEnd);
        base[slot].count += end;
        base[slot].total += end ? e.timestamp_ns : 0 - e.timestamp_ns;
      }
    }
    benchmark::DoNotOptimize(flat.data());
    benchmark::ClobberMemory();
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(frames.size()) *
                          static_cast<std::int64_t>(kEventsPerFrame));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(frames.size()) *
                          static_cast<std::int64_t>(frames[0].size()));
}

// Renders of the state after one frame per process: the metrics text (a scrape), the
// JSON report (serialised) and the text report.
enum class Render { kMetrics, kReportJson, kReportText };

template <Render kWhat>
void bm_render(benchmark::State& state) {
  IngestFixture fx(shape_for(state.range(0)), Spread::kTypical, Recorder::kOff);
  if (!fx.error.empty()) {
    state.SkipWithError(fx.error.c_str());
    return;
  }
  if (const std::string error = feed_all(fx); !error.empty()) {
    state.SkipWithError(error.c_str());
    return;
  }
  std::size_t bytes = 0;
  for (auto _ : state) {
    std::string out;
    if constexpr (kWhat == Render::kMetrics) {
      out = steptrace::daemon::report::metrics_text(*fx.collector.freeze());
    } else if constexpr (kWhat == Render::kReportJson) {
      out = steptrace::daemon::report::report_json(*fx.collector.freeze(), std::nullopt).dump();
    } else {
      out = steptrace::daemon::report::report_text(*fx.collector.freeze(), std::nullopt);
    }
    bytes = out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["output_bytes"] = static_cast<double>(bytes);
}

constexpr std::int64_t kKeyCounts[] = {10, 1000, 100000};

}  // namespace

int main(int argc, char** argv) {
  // Our own flag, taken out before Google Benchmark sees the arguments.
  constexpr std::string_view kBudgetFlag = "--recorder_budget_mib=";
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg.rfind(kBudgetFlag, 0) != 0) continue;
    const long mib = std::strtol(argv[i] + kBudgetFlag.size(), nullptr, 10);
    if (mib <= 0) {
      std::fprintf(stderr, "ingest_bench: %s wants a positive number of MiB\n", argv[i]);
      return 2;
    }
    g_recorder_budget = static_cast<std::size_t>(mib) << 20;
    std::copy(argv + i + 1, argv + argc + 1, argv + i);  // argv[argc] is null
    --argc;
    --i;
  }
  if (!steptrace::bench::initialize(
          argc, argv,
          {"--benchmark_repetitions=5", "--benchmark_display_aggregates_only=true",
           "--benchmark_enable_random_interleaving=true"}))
    return 2;

  // Recorder off and on side by side, per key count.
  for (auto keys : kKeyCounts) {
    benchmark::RegisterBenchmark("ingest/validated", bm_ingest<Spread::kTypical, Recorder::kOff>)
        ->Arg(keys)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark("ingest/validated_recorder_on",
                                 bm_ingest<Spread::kTypical, Recorder::kOn>)
        ->Arg(keys)
        ->Unit(benchmark::kMicrosecond);
  }
  for (auto* b :
       {benchmark::RegisterBenchmark("ingest/validated_wide_spread", bm_ingest<Spread::kWide>),
        benchmark::RegisterBenchmark("ingest/lower_bound", bm_lower_bound)}) {
    for (auto keys : kKeyCounts) b->Arg(keys);
    b->Unit(benchmark::kMicrosecond);
  }
  // At 100,000 keys a render takes 0.1-1 s (report --json the longest): run long enough
  // for several.
  benchmark::RegisterBenchmark("ingest/validated_while_rendering", bm_ingest_while_rendering)
      ->Arg(10)
      ->Arg(1000)
      ->Unit(benchmark::kMicrosecond);
  benchmark::RegisterBenchmark("ingest/validated_while_rendering", bm_ingest_while_rendering)
      ->Arg(100000)
      ->MinTime(4.0)
      ->Unit(benchmark::kMicrosecond);
  for (auto* b :
       {benchmark::RegisterBenchmark("render/metrics_text", bm_render<Render::kMetrics>),
        benchmark::RegisterBenchmark("render/report_json", bm_render<Render::kReportJson>),
        benchmark::RegisterBenchmark("render/report_text", bm_render<Render::kReportText>)}) {
    for (auto keys : kKeyCounts) b->Arg(keys);
    b->Unit(benchmark::kMillisecond);
  }
  std::printf("machine: %s\n", steptrace::bench::machine_description().c_str());
  steptrace::bench::MedianReporter reporter;
  benchmark::RunSpecifiedBenchmarks(&reporter);

  std::printf("\n== ingest summary: medians of this run, one core ==\n");
  std::printf("  %8s | %22s | %22s | %22s | %s\n", "keys", "validated+aggregated",
              "same, wide spread", "lower bound", "lower bound / validated");
  for (auto keys : kKeyCounts) {
    const std::string suffix = "/" + std::to_string(keys) + "@1";
    auto ours = reporter.median("ingest/validated" + suffix);
    auto wide = reporter.median("ingest/validated_wide_spread" + suffix);
    auto base = reporter.median("ingest/lower_bound" + suffix);
    auto rate = [](const std::optional<steptrace::bench::Figure>& f) {
      if (!f) return 0.0;
      auto it = f->counters.find("items_per_second");
      return it == f->counters.end() ? 0.0 : it->second;
    };
    std::printf("  %8lld | %12.1f M events/s | %12.1f M events/s | %12.1f M events/s | %.2fx",
                static_cast<long long>(keys), rate(ours) / 1e6, rate(wide) / 1e6, rate(base) / 1e6,
                rate(ours) > 0 ? rate(base) / rate(ours) : 0.0);
    if (keys == 1000) {
      std::printf("   (target >= 80 M events/s: %s)", rate(ours) >= 80e6 ? "met" : "MISSED");
    }
    std::printf("\n");
  }
  std::printf(
      "\n== flight recorder: validated ingest with the recorder off (budget 0) and on (%zu MiB, "
      "full), medians ==\n",
      g_recorder_budget >> 20);
  std::printf("  %8s | %16s | %16s | %14s | %10s | %14s | %s\n", "keys", "recorder off",
              "recorder on", "on/off (cpu)", "on/off (wall)", "bytes/event held", "events held");
  for (auto keys : kKeyCounts) {
    const std::string suffix = "/" + std::to_string(keys) + "@1";
    auto off = reporter.median("ingest/validated" + suffix);
    auto on = reporter.median("ingest/validated_recorder_on" + suffix);
    if (!off || !on) continue;
    auto counter = [](const steptrace::bench::Figure& f, const char* name) {
      auto it = f.counters.find(name);
      return it == f.counters.end() ? 0.0 : it->second;
    };
    const double cpu_off = counter(*off, "items_per_second");
    const double cpu_on = counter(*on, "items_per_second");
    const double cpu_ratio = cpu_off > 0 ? cpu_on / cpu_off : 0.0;
    const double wall_ratio = on->real_time > 0 ? off->real_time / on->real_time : 0.0;
    std::printf(
        "  %8lld | %7.1f M ev/s | %7.1f M ev/s | %14.3f | %13.3f | %16.2f | %.0f%s   (on/off >= "
        "0.80: %s)\n",
        static_cast<long long>(keys), cpu_off / 1e6, cpu_on / 1e6, cpu_ratio, wall_ratio,
        counter(*on, "rec_bytes_per_event"), counter(*on, "rec_events_held"),
        counter(*on, "rec_full_at_start") > 0 ? "" : " (budget NOT full at start)",
        cpu_ratio >= 0.8 ? "met" : "MISSED");
  }
  std::printf(
      "\n== ingest while rendering: report --json and metrics alternately on a second thread "
      "(medians) ==\n");
  std::printf("  %8s | %16s | %16s | %12s | %12s | %7s | %7s | %10s | %s\n", "keys", "validated",
              "while rendering", "ratio (cpu)", "ratio (wall)", "renders", "views", "clones est",
              "mean render ms json / metrics (while ingesting)");
  for (auto keys : kKeyCounts) {
    const std::string suffix = "/" + std::to_string(keys) + "@1";
    auto plain = reporter.median("ingest/validated" + suffix);
    auto busy = reporter.median("ingest/validated_while_rendering" + suffix);
    if (!plain || !busy) continue;
    auto counter = [](const steptrace::bench::Figure& f, const char* name) {
      auto it = f.counters.find(name);
      return it == f.counters.end() ? 0.0 : it->second;
    };
    // items_per_second is per CPU second of the ingest thread; the wall rate also counts
    // time the ingest thread waited for a core.
    const double events_per_iteration =
        static_cast<double>(shape_for(keys).processes) * static_cast<double>(kEventsPerFrame);
    auto wall = [&](const steptrace::bench::Figure& f) {
      return f.real_time > 0 ? events_per_iteration / (f.real_time * 1e-6) : 0.0;  // us
    };
    const double cpu_plain = counter(*plain, "items_per_second");
    const double cpu_busy = counter(*busy, "items_per_second");
    const double cpu_ratio = cpu_plain > 0 ? cpu_busy / cpu_plain : 0.0;
    const double wall_ratio = wall(*plain) > 0 ? wall(*busy) / wall(*plain) : 0.0;
    std::printf(
        "  %8lld | %7.1f M ev/s | %7.1f M ev/s | %12.3f | %12.3f | %7.0f | %7.0f | %10.0f "
        "| %8.2f / %8.2f   (ratio >= 0.90: %s)\n",
        static_cast<long long>(keys), cpu_plain / 1e6, cpu_busy / 1e6, cpu_ratio, wall_ratio,
        counter(*busy, "renders"), counter(*busy, "views"), counter(*busy, "clones_est"),
        counter(*busy, "json_ms"), counter(*busy, "metrics_ms"),
        cpu_ratio >= 0.9 ? "met" : "MISSED");
  }
  std::printf("\n== render summary: one render, alone on one thread (median) ==\n");
  std::printf("  %8s | %24s | %24s | %24s\n", "keys", "metrics (a scrape)", "report --json",
              "report (text)");
  for (auto keys : kKeyCounts) {
    const std::string suffix = "/" + std::to_string(keys) + "@1";
    auto cell = [&](const char* name) {
      auto f = reporter.median(std::string(name) + suffix);
      if (!f) return std::string("-");
      auto it = f->counters.find("output_bytes");
      char buf[64];
      std::snprintf(buf, sizeof buf, "%8.3f ms, %6.0f KiB", f->real_time,  // ms: the unit set above
                    it == f->counters.end() ? 0.0 : it->second / 1024);
      return std::string(buf);
    };
    std::printf("  %8lld | %24s | %24s | %24s\n", static_cast<long long>(keys),
                cell("render/metrics_text").c_str(), cell("render/report_json").c_str(),
                cell("render/report_text").c_str());
  }
  benchmark::Shutdown();
  return 0;
}
