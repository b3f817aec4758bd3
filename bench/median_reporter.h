// A Google Benchmark console reporter that also remembers, per benchmark, the median
// of its repetitions (or the single run when there are no repetitions), so main() can
// print ratios between two benchmarks measured in the same run. Header-only; used by
// hot_path_bench and ingest_bench.
#pragma once

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <benchmark/benchmark.h>

namespace steptrace::bench {

struct Figure {
  double real_time = 0;  // per iteration, in the benchmark's time unit
  double cpu_time = 0;
  std::map<std::string, double> counters;  // finalized (rates already per second)
  int repetitions = 0;
};

class MedianReporter : public benchmark::ConsoleReporter {
 public:
  void ReportRuns(const std::vector<Run>& runs) override {
    ConsoleReporter::ReportRuns(runs);
    for (const Run& run : runs) {
      if (run.error_occurred) continue;
      const std::string key = key_of(run);
      if (run.run_type == Run::RT_Aggregate) {
        if (run.aggregate_name == "median") medians_[key] = to_figure(run);
      } else {
        singles_[key].push_back(to_figure(run));
      }
    }
  }

  // "function[/args]@threads", e.g. "steptrace/live_daemon@2" or "ingest/validated/1000@1":
  // the name without min_time/repetition decorations.
  static std::string key_of(const Run& run) {
    std::string key = run.run_name.function_name;
    if (!run.run_name.args.empty()) key += "/" + run.run_name.args;
    return key + "@" + std::to_string(run.threads);
  }

  // The median for `name` (as key_of builds it); nullopt when it did not run.
  std::optional<Figure> median(const std::string& name) const {
    if (auto it = medians_.find(name); it != medians_.end()) {
      Figure f = it->second;
      if (auto s = singles_.find(name); s != singles_.end()) {
        f.repetitions = static_cast<int>(s->second.size());
      }
      return f;
    }
    auto it = singles_.find(name);
    if (it == singles_.end() || it->second.empty()) return std::nullopt;
    std::vector<Figure> runs = it->second;
    std::sort(runs.begin(), runs.end(),
              [](const Figure& a, const Figure& b) { return a.real_time < b.real_time; });
    Figure f = runs[runs.size() / 2];
    f.repetitions = static_cast<int>(runs.size());
    return f;
  }

 private:
  static Figure to_figure(const Run& run) {
    Figure f;
    f.real_time = run.GetAdjustedRealTime();
    f.cpu_time = run.GetAdjustedCPUTime();
    for (const auto& [name, counter] : run.counters) f.counters[name] = counter.value;
    return f;
  }

  std::map<std::string, Figure> medians_;
  std::map<std::string, std::vector<Figure>> singles_;
};

// argv plus default flags the caller asks for unless the command line already sets
// them (e.g. {"--benchmark_repetitions=5"}). The strings must outlive the result.
inline std::vector<char*> with_default_flags(int argc, char** argv,
                                             std::vector<std::string>& defaults) {
  std::vector<char*> out(argv, argv + argc);
  for (auto& flag : defaults) {
    const std::string name = flag.substr(0, flag.find('='));
    const bool given = std::any_of(argv + 1, argv + argc, [&](const char* arg) {
      return std::string(arg).rfind(name, 0) == 0;
    });
    if (!given) out.push_back(flag.data());
  }
  out.push_back(nullptr);
  return out;
}

// Google Benchmark initialised from argv plus `defaults` (with_default_flags); false when
// the command line holds an argument it does not know (then said on stderr).
inline bool initialize(int argc, char** argv, std::vector<std::string> defaults) {
  std::vector<char*> args = with_default_flags(argc, argv, defaults);
  int n = static_cast<int>(args.size()) - 1;
  benchmark::Initialize(&n, args.data());
  return !benchmark::ReportUnrecognizedArguments(n, args.data());
}

}  // namespace steptrace::bench
