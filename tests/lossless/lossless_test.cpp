// "Lossless by default": in the library's default mode (never blocking), bursts far
// larger than the old per-thread buffer (8192 records = 4096 spans) and a daemon busy
// rendering reports of a large table lose nothing. The real steptraced on a temporary
// socket, real client processes (lossless_trainer, fork/exec); counts are read back with
// `report --json --pid N` and `report --json`'s daemon.events_received.
//
// Sized with wide margins for a loaded 2-core machine, also under AddressSanitizer:
// modest average rates, flushes with long timeouts, no timing assertions. Every burst
// of these tests fits in a 4 MiB per-thread buffer (262,144 records) even if the flusher
// did not run at all while it was recorded.
#include <signal.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using Values = std::map<std::string, long long>;
using Clock = std::chrono::steady_clock;

constexpr const char* kCauseNames[] = {"buffer_full", "not_connected", "in_flight", "invalid"};

std::optional<Values> read_values(const std::string& path) {
  return steptrace::testing::read_key_values(path);
}

nlohmann::json json_command(const std::string& socket, const std::string& line) {
  const auto reply = command(socket, line, 120000);
  EXPECT_TRUE(reply.has_value()) << line;
  if (!reply) return {};
  auto doc = nlohmann::json::parse(*reply, nullptr, false);
  EXPECT_FALSE(doc.is_discarded()) << line << ": " << reply->substr(0, 200);
  return doc.is_discarded() ? nlohmann::json{} : doc;
}

nlohmann::json process_report(const std::string& socket, long long pid) {
  const auto doc = json_command(socket, "report --json --pid " + std::to_string(pid));
  if (doc.is_object()) {
    for (const auto& p : doc.at("processes")) {
      if (p.at("pid").get<long long>() == pid) return p;
    }
  }
  ADD_FAILURE() << "pid " << pid << " not in the report";
  return {};
}

long long step_field(const nlohmann::json& process, const std::string& step, const char* field) {
  if (!process.is_object()) return -1;
  for (const auto& s : process.at("steps")) {
    if (s.at("step") == step) return s.at(field).get<long long>();
  }
  return 0;
}

long long events_received(const std::string& socket) {
  const auto doc = json_command(socket, "report --json");
  return doc.is_object() ? doc.at("daemon").at("events_received").get<long long>() : -1;
}

class Lossless : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << R"({"limits": {"max_processes": 2000, "max_exited_processes": 1000}})";
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  void TearDown() override {
    for (pid_t pid : fillers_) ::kill(pid, SIGTERM);
    for (pid_t pid : fillers_) wait_or_kill(pid, 10000);
  }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string out(const std::string& name) const { return dir_.file(name); }

  // Runs `lossless_trainer burst` and returns its values (empty after a failure).
  Values run_burst(const std::string& name, int threads, int bursts, int burst_spans,
                   long long interval_us) {
    const int status = run_process(
        {STEPTRACE_LOSSLESS_TRAINER, "burst", socket(), out(name), std::to_string(threads),
         std::to_string(bursts), std::to_string(burst_spans), std::to_string(interval_us)},
        {}, 180000);
    EXPECT_EQ(status, 0);
    const auto v = read_values(out(name));
    EXPECT_TRUE(v.has_value()) << "the trainer wrote no results";
    return v.value_or(Values{});
  }

  // Everything the trainer recorded arrived, and nothing was dropped, as the trainer and
  // the daemon see it.
  void expect_exact(const Values& v, long long spans) {
    ASSERT_TRUE(v.contains("pid"));
    std::cerr << "recorded " << v.at("recorded_events") << " events in " << v.at("record_ms")
              << " ms; steptrace_dropped() " << v.at("dropped") << "\n";
    EXPECT_EQ(v.at("connect_rc"), 0);
    EXPECT_EQ(v.at("flush_rc"), 0);
    EXPECT_EQ(v.at("recorded_events"), 2 * spans);
    EXPECT_EQ(v.at("dropped"), 0);
    for (const char* cause : kCauseNames) {
      const std::string key = std::string("dropped_") + cause;
      ASSERT_TRUE(v.contains(key)) << key;
      EXPECT_EQ(v.at(key), 0) << key;
    }
    const auto proc = process_report(socket(), v.at("pid"));
    ASSERT_TRUE(proc.is_object());
    EXPECT_EQ(step_field(proc, "Transpose", "count"), spans);
    EXPECT_EQ(step_field(proc, "Transpose", "open"), 0);
    EXPECT_EQ(step_field(proc, "Transpose", "unmatched_ends"), 0);
    EXPECT_EQ(proc.at("dropped").get<long long>(), 0);
    EXPECT_TRUE(proc.contains("dropped_by_cause")) << "the report has no dropped_by_cause";
    if (proc.contains("dropped_by_cause")) {
      for (const char* cause : kCauseNames) {
        EXPECT_EQ(proc.at("dropped_by_cause").value(cause, -1LL), 0) << cause;
      }
    }
  }

  // Starts `count` fillers (each `steps` custom steps, kept running), `parallel` at a
  // time, and waits until each has flushed. Returns false when one failed.
  bool fill(int count, int steps, int parallel) {
    for (int started = 0; started < count;) {
      std::vector<std::pair<pid_t, std::string>> wave;
      for (int i = 0; i < parallel && started < count; ++i, ++started) {
        const std::string file = out("fill" + std::to_string(started));
        const pid_t pid = spawn_process(
            {STEPTRACE_LOSSLESS_TRAINER, "fill", socket(), file, std::to_string(steps)});
        if (pid <= 0) return false;
        fillers_.push_back(pid);
        wave.emplace_back(pid, file);
      }
      for (const auto& [pid, file] : wave) {
        const auto deadline = Clock::now() + std::chrono::seconds(120);
        std::optional<Values> v;
        int status = -1;
        while (!(v = read_values(file)) && Clock::now() < deadline) {
          if ((status = wait_process(pid, 0)) >= 0) break;  // exited without a result
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        }
        if (!v || v->at("rc") != 0) {
          ADD_FAILURE() << "filler " << pid << ": rc " << (v ? v->at("rc") : -1LL)
                        << ", exit status " << status;
          return false;
        }
      }
    }
    return true;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<pid_t> fillers_;
};

// (a) Bursts of 40,000 spans back to back on each thread, ~10x the old per-thread buffer,
// three of them a second apart (an average of 40,000 spans/s per thread): all of them
// arrive. 1 and 2 threads.
class LosslessBurst : public Lossless, public ::testing::WithParamInterface<int> {};

TEST_P(LosslessBurst, BurstsTenTimesTheOldBufferArriveExactly) {
  const int threads = GetParam();
  constexpr int kBursts = 3;
  constexpr int kBurstSpans = 40'000;
  const Values v = run_burst("burst", threads, kBursts, kBurstSpans, 1'000'000);
  const long long spans = static_cast<long long>(threads) * kBursts * kBurstSpans;
  expect_exact(v, spans);
  EXPECT_EQ(events_received(socket()), 2 * spans);
}

INSTANTIATE_TEST_SUITE_P(Threads, LosslessBurst, ::testing::Values(1, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::to_string(info.param) + "thread" +
                                  (info.param == 1 ? "" : "s");
                         });

// (b) A table of 100 processes x 200 custom steps (20,000 keys: a `report --json` render
// takes tens of ms, `metrics` a little less; seconds under ASan). A reader process
// renders `report --json` and `metrics` of it in a loop from before the trainer starts
// until after it exits; meanwhile the trainer records 2 threads x 150,000 spans in
// bursts of 1,000 every 10 ms (100,000 spans/s per thread, 200,000 in all, 1.5 s; a
// thread's 4 MiB buffer holds 1.3 s of it). Every span arrives, nothing is dropped.
TEST_F(Lossless, ExactWhileAnotherClientRendersReportsOfALargeTable) {
  constexpr int kFillers = 100;
  constexpr int kSteps = 200;
  ASSERT_TRUE(fill(kFillers, kSteps, 10));
  const auto stats = json_command(socket(), "stats --json");
  ASSERT_TRUE(stats.is_object());
  ASSERT_EQ(stats.at("custom_steps").get<long long>(), kFillers * kSteps) << stats.dump();
  ASSERT_GE(stats.at("processes").at("live").get<long long>(), kFillers) << stats.dump();

  const std::string reader_out = out("reader");
  const std::string stopfile = out("reader.stop");
  const pid_t reader =
      spawn_process({STEPTRACE_LOSSLESS_TRAINER, "reader", socket(), reader_out, stopfile});
  ASSERT_GT(reader, 0);
  // The reader has finished one render (so it is looping) before the trainer starts.
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  while (!read_values(reader_out) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto before = read_values(reader_out);

  constexpr int kThreads = 2;
  constexpr int kBursts = 150;
  constexpr int kBurstSpans = 1'000;
  const Values v = run_burst("trainer", kThreads, kBursts, kBurstSpans, 10'000);

  std::ofstream(stopfile) << "stop\n";
  const int reader_status = wait_or_kill(reader, 180000);
  const auto rendered = read_values(reader_out);
  ASSERT_TRUE(before.has_value()) << "the reader never finished a render";
  ASSERT_TRUE(rendered.has_value());
  std::cerr << "reader: " << before->at("renders") << " renders before the trainer, "
            << rendered->at("renders") << " in all (" << rendered->at("reports")
            << " report --json, " << rendered->at("metrics") << " metrics), longest "
            << rendered->at("max_ms") << " ms\n";
  EXPECT_EQ(reader_status, 0);
  EXPECT_EQ(rendered->at("bad"), 0);
  // It rendered before the trainer and kept going: the render after the first had
  // started before the trainer could finish.
  EXPECT_GE(rendered->at("reports"), 1);
  EXPECT_GE(rendered->at("metrics"), 1);

  const long long spans = static_cast<long long>(kThreads) * kBursts * kBurstSpans;
  expect_exact(v, spans);
  EXPECT_EQ(events_received(socket()), 2LL * kFillers * kSteps + 2 * spans);
}

}  // namespace
}  // namespace steptrace::testing
