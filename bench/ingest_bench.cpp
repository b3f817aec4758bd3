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
// render from that state. The daemon renders on its one io thread, so this is how long a
// request holds ingest back (the sockets buffer meanwhile; nothing is lost).
//
// Baseline in the same run ("ingest/lower_bound"): the same bytes copied the same way
// (the stand-in for the socket read) and folded into a flat array of counters with no
// validation and no span matching. The ratio shows what validation + aggregation cost.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include "bench/bench_support.h"
#include "bench/median_reporter.h"
#include "daemon/collector.h"
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

// The daemon side of `processes` connections, each with its decoder past the hello and
// its custom steps registered.
struct IngestFixture {
  IngestFixture(Shape s, Spread spread)
      : shape(s), collector(daemon::Limits{}, bench_environment()) {
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

// Feeds every process's frame once through its decoder into the collector; the first
// error, or empty.
std::string feed_all(IngestFixture& fx) {
  for (std::size_t p = 0; p < fx.frames.size(); ++p) {
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

template <Spread kSpread>
void bm_ingest(benchmark::State& state) {
  IngestFixture fx(shape_for(state.range(0)), kSpread);
  if (!fx.error.empty()) {
    state.SkipWithError(fx.error.c_str());
    return;
  }
  for (auto _ : state) {
    if (const std::string error = feed_all(fx); !error.empty()) {
      state.SkipWithError(error.c_str());
      break;
    }
  }
  // The fold must have counted every span: check the first process's report.
  std::uint64_t spans = 0;
  const auto report = fx.collector.report_json(kFirstPid);
  for (const auto& proc : report.value("processes", nlohmann::json::array())) {
    for (const auto& step : proc.value("steps", nlohmann::json::array())) {
      spans += step.value("count", std::uint64_t{0});
    }
  }
  if (spans != static_cast<std::uint64_t>(state.iterations()) * (kEventsPerFrame / 2)) {
    state.SkipWithError(("report counts " + std::to_string(spans) + " spans for pid " +
                         std::to_string(kFirstPid) + ", want " +
                         std::to_string(state.iterations() * (kEventsPerFrame / 2)))
                            .c_str());
    return;
  }
  state.SetItemsProcessed(state.iterations() * static_cast<std::int64_t>(fx.frames.size()) *
                          static_cast<std::int64_t>(kEventsPerFrame));
  state.SetBytesProcessed(state.iterations() * static_cast<std::int64_t>(fx.frames.size()) *
                          static_cast<std::int64_t>(fx.frames[0].size()));
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
  IngestFixture fx(shape_for(state.range(0)), Spread::kTypical);
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
      out = fx.collector.metrics_text();
    } else if constexpr (kWhat == Render::kReportJson) {
      out = fx.collector.report_json(std::nullopt).dump();
    } else {
      out = fx.collector.report_text(std::nullopt);
    }
    bytes = out.size();
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["output_bytes"] = static_cast<double>(bytes);
}

constexpr std::int64_t kKeyCounts[] = {10, 1000, 100000};

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> defaults{"--benchmark_repetitions=5",
                                    "--benchmark_display_aggregates_only=true"};
  std::vector<char*> args = steptrace::bench::with_default_flags(argc, argv, defaults);
  int n = static_cast<int>(args.size()) - 1;
  benchmark::Initialize(&n, args.data());
  if (benchmark::ReportUnrecognizedArguments(n, args.data())) return 2;

  for (auto* b :
       {benchmark::RegisterBenchmark("ingest/validated", bm_ingest<Spread::kTypical>),
        benchmark::RegisterBenchmark("ingest/validated_wide_spread", bm_ingest<Spread::kWide>),
        benchmark::RegisterBenchmark("ingest/lower_bound", bm_lower_bound)}) {
    for (auto keys : kKeyCounts) b->Arg(keys);
    b->Unit(benchmark::kMicrosecond);
  }
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
  std::printf("\n== render summary: one render on the daemon's io thread (median) ==\n");
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
