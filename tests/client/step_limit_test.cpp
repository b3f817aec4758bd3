// Custom steps past the daemon's limit (limits.max_custom_steps, PROTOCOL.md 4.4) with
// real processes killed at random moments: the daemon refuses those registrations without
// ending the connection, refuses each event of such a step and counts it as the process's
// `refused` drops, and nothing a trainer recorded disappears silently: per process,
// sent == counted + dropped (by cause), exactly.
//
// The real steptraced (limits.max_custom_steps = 3) on a temporary socket and real
// trainers (step_limit_trainer.cpp, fork/exec; default mode, rings in shared memory)
// that register 8 custom steps (5 refused) and record spans on all of them, a Forward
// span nested in each. The trainers count every event they record in a file a kill
// cannot take (step_limit_counts.h). Counts are read back with `report --json --pid N`
// once the process's connection is closed (the daemon's last pass over its rings is
// done): the events it counted are 2 x count + open + abandoned + unmatched_ends +
// depth_dropped over its steps (and equal its `events`), its drops the six causes of
// `dropped_by_cause` (section 10.4).
//
// No timing assertions: waits are polls bounded by generous deadlines, sized for a loaded
// 2-core machine, also under AddressSanitizer. STEPTRACE_TEST_SEED=N repeats the random
// kill moments of a run (the seed is printed, and named in every failure).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/client/step_limit_counts.h"
#include "tests/support/daemon_process.h"
#include "tests/support/settled_process.h"
#include "tests/support/test_seed.h"

namespace steptrace::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kMaxCustomSteps = 3;  // the daemon's limit
constexpr int kSteps = 8;           // each trainer registers these: 5 refused
constexpr int kThreads = 2;         // recording threads a trainer
constexpr int kKilled = 128 + SIGKILL;

// The six causes of dropped_by_cause (PROTOCOL.md 10.4).
constexpr const char* kCauses[] = {"buffer_full", "not_connected", "in_flight",
                                   "invalid",     "daemon_crash",  "refused"};

nlohmann::json step_row(const nlohmann::json& process, const std::string& step) {
  for (const auto& s : process.at("steps")) {
    if (s.at("step") == step) return s;
  }
  return {};
}

long long step_count(const nlohmann::json& process, const std::string& step) {
  const auto row = step_row(process, step);
  return row.is_object() ? row.at("count").get<long long>() : 0;
}

// The events the daemon accounts for in the process's steps: each complete span two,
// each span open or abandoned one, each end without a start one, each start dropped past
// max_open_depth one.
long long events_counted(const nlohmann::json& process) {
  long long n = 0;
  for (const auto& s : process.at("steps")) {
    n += 2 * s.at("count").get<long long>() + s.at("open").get<long long>() +
         s.at("abandoned").get<long long>() + s.at("unmatched_ends").get<long long>() +
         s.at("depth_dropped").get<long long>();
  }
  return n;
}

long long dropped(const nlohmann::json& process, const char* cause) {
  return process.at("dropped_by_cause").value(cause, -1LL);
}

long long dropped_sum(const nlohmann::json& process) {
  long long n = 0;
  for (const char* cause : kCauses) n += dropped(process, cause);
  return n;
}

long long limit_hits(const std::string& socket) {
  const auto doc = json_command(socket, "stats --json");
  EXPECT_TRUE(doc.has_value()) << "stats --json";
  if (!doc) return -1;
  return doc->at("limits_hit").value("max_custom_steps", 0LL);
}

// What a trainer's count file says (nullopt when it is not whole).
std::optional<StepLimitCounts> read_counts(const std::string& path) {
  StepLimitCounts c;
  std::ifstream in(path, std::ios::binary);
  if (!in.read(reinterpret_cast<char*>(&c), sizeof c) || c.magic != kStepLimitMagic) {
    return std::nullopt;
  }
  return c;
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// A once-trainer's process: its threads' `spans` rounds of the 8 steps, kept or
// refused, and nothing else dropped; `sent` events in all.
void expect_refused_exactly(const nlohmann::json& p, long long spans, long long sent) {
  ASSERT_TRUE(p.is_object());
  for (int s = 0; s < kSteps; ++s) {
    const std::string step = "Limit" + std::to_string(s);
    if (s < kMaxCustomSteps) {
      EXPECT_EQ(step_count(p, step), kThreads * spans) << step;
    } else {
      EXPECT_FALSE(step_row(p, step).is_object()) << step << " was refused: " << p.dump();
    }
  }
  EXPECT_EQ(step_count(p, "Forward"), kThreads * (spans * kSteps + 1));  // + the warm-ups
  EXPECT_EQ(p.at("abandoned").get<long long>(), 0);
  EXPECT_EQ(p.at("unmatched_ends").get<long long>(), 0);
  const long long refused = 2LL * kThreads * spans * (kSteps - kMaxCustomSteps);
  EXPECT_EQ(dropped(p, "refused"), refused);
  for (const char* cause : kCauses) {
    if (std::string(cause) != "refused") {
      EXPECT_EQ(dropped(p, cause), 0) << cause;
    }
  }
  EXPECT_EQ(p.at("dropped").get<long long>(), refused);
  EXPECT_EQ(events_counted(p), p.at("events").get<long long>());
  EXPECT_EQ(p.at("events").get<long long>() + refused, sent);
}

class StepLimit : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << R"({"limits": {"max_custom_steps": )" << kMaxCustomSteps
                          << R"(, "max_exited_processes": 1000}})";
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string file(const std::string& name) const { return dir_.file(name); }

  pid_t trainer(const std::string& name, long long spans) const {
    return spawn_process({STEPTRACE_STEP_LIMIT_TRAINER, socket(), file(name + ".counts"),
                          file(name + ".ready"), std::to_string(kSteps), std::to_string(kThreads),
                          std::to_string(spans)});
  }

  // Waits for the trainer's ready file; false (and its exit status in `status`) when it
  // exited first or did not get there within 60 s.
  bool wait_ready(pid_t pid, const std::string& name, int& status) const {
    const auto deadline = Clock::now() + std::chrono::seconds(60);
    while (!file_exists(file(name + ".ready"))) {
      if ((status = wait_process(pid, 0)) >= 0 || Clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return true;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// A trainer that exits normally after a flush: the refusal's rules, exactly. Each of its
// 2 threads records 200 spans of each of 8 custom steps (a Forward span nested in each).
// The daemon keeps Limit0..Limit2 and refuses Limit3..Limit7 (5 limit hits), and goes on
// reading the connection and the rings past the refused steps' events: the flush is
// answered, the kept steps and Forward are counted exactly, the refused steps have no
// row, and their events (2 x 2 x 200 x 5) are the process's `refused` drops, nothing
// else dropped.
TEST_F(StepLimit, RefusedStepsEventsAreCountedAsRefusedAndTheRestArrives) {
  constexpr long long kSpans = 200;
  const long long hits_before = limit_hits(socket());
  const pid_t pid = trainer("once", kSpans);
  ASSERT_GT(pid, 0);
  const auto deadline = Clock::now() + std::chrono::seconds(180);
  int status = -1;
  while (!file_exists(file("once.ready.flushed")) && Clock::now() < deadline) {
    if ((status = wait_process(pid, 0)) >= 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(file_exists(file("once.ready.flushed")))
      << "the trainer did not get to its flush (exit status " << status
      << "; 2: connect or the warm-up flush failed, 4: a registration refused)";
  const auto counts = read_counts(file("once.counts"));
  ASSERT_TRUE(counts.has_value());
  EXPECT_EQ(counts->flush_rc, 0) << "the flush after the refused steps' events failed";
  EXPECT_EQ(limit_hits(socket()) - hits_before, kSteps - kMaxCustomSteps);
  long long sent = 0;
  for (int t = 0; t < kThreads; ++t) sent += counts->thread[t].done;

  // Live (the trainer still connected, its flush answered: the daemon read past the
  // refused steps' events), then after its exit.
  const auto live = json_command(socket(), "report --json --pid " + std::to_string(pid));
  ASSERT_TRUE(live.has_value());
  ASSERT_EQ(live->at("processes").size(), 1u);
  {
    SCOPED_TRACE("live");
    expect_refused_exactly(live->at("processes").at(0), kSpans, sent);
  }
  std::ofstream(file("once.ready.exit")) << "exit\n";
  EXPECT_EQ(wait_or_kill(pid, 60000), 0);
  SCOPED_TRACE("exited");
  expect_refused_exactly(settled_process(socket(), pid, 30), kSpans, sent);
}

// 24 trainers, 4 at a time, each SIGKILLed at a random moment 0..200 ms after it is
// ready: before, among or after its 8 registrations (one every ~10 ms), in the middle of
// recording on kept and refused steps, of a flush. Per process: counted + dropped (all
// causes, `refused` among them) lies within what its threads' counts say they recorded
// (done <= sent <= begun, one event apart at most per thread); the steps' counts agree
// with the report's `events`; `dropped` is the sum of the causes. Over all of them
// refused drops and limit hits were seen (the premise).
TEST_F(StepLimit, TrainersKilledAtRandomMomentsLoseNothingSilently) {
  constexpr int kTrainers = 24;
  constexpr int kParallel = 4;
  const std::uint64_t seed = announced_seed("TrainersKilledAtRandomMomentsLoseNothingSilently");
  SCOPED_TRACE(seed_note(seed, "the kill moments"));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> pick_ms(0, 200);
  const long long hits_before = limit_hits(socket());
  long long refused_total = 0;
  long long sent_total = 0;
  long long kept_custom_spans = 0;
  const auto t0 = Clock::now();
  for (int wave = 0; wave * kParallel < kTrainers && !HasFailure(); ++wave) {
    std::vector<std::pair<pid_t, std::string>> running;
    for (int i = 0; i < kParallel; ++i) {
      const std::string name = "kill" + std::to_string(wave * kParallel + i);
      const pid_t pid = trainer(name, 0);
      ASSERT_GT(pid, 0);
      running.emplace_back(pid, name);
    }
    for (const auto& [pid, name] : running) {
      SCOPED_TRACE(name + ", pid " + std::to_string(pid));
      int status = -1;
      const bool ready = wait_ready(pid, name, status);
      std::this_thread::sleep_for(std::chrono::milliseconds(pick_ms(rng)));
      ::kill(pid, SIGKILL);
      EXPECT_TRUE(ready) << "the trainer was not ready (exit status " << status
                         << "; 2: connect or the warm-up flush failed)";
      if (ready) status = wait_or_kill(pid, 60000);
      EXPECT_EQ(status, kKilled);
    }
    for (const auto& [pid, name] : running) {
      SCOPED_TRACE(name + ", pid " + std::to_string(pid));
      const auto counts = read_counts(file(name + ".counts"));
      ASSERT_TRUE(counts.has_value()) << "no count file";
      long long done = 0;
      long long begun = 0;
      for (int t = 0; t < kThreads; ++t) {
        done += counts->thread[t].done;
        begun += counts->thread[t].begun;
      }
      const auto p = settled_process(socket(), pid, 30);
      ASSERT_TRUE(p.is_object());
      const long long events = p.at("events").get<long long>();
      const long long drops = dropped_sum(p);
      EXPECT_EQ(events_counted(p), events) << p.dump();
      EXPECT_EQ(p.at("dropped").get<long long>(), drops) << p.dump();
      EXPECT_GE(events + drops, done) << "lost silently: " << p.dump();
      EXPECT_LE(events + drops, begun) << "counted more than it recorded: " << p.dump();
      // The kept steps never exceed the limit, and no refused step has a row.
      for (int s = kMaxCustomSteps; s < kSteps; ++s) {
        EXPECT_FALSE(step_row(p, "Limit" + std::to_string(s)).is_object()) << p.dump();
      }
      std::cerr << name << ": registered " << counts->registered << ", recorded " << done
                << ", counted " << events << ", refused " << dropped(p, "refused") << ", invalid "
                << dropped(p, "invalid") << ", buffer_full " << dropped(p, "buffer_full") << "\n";
      refused_total += dropped(p, "refused");
      sent_total += done;
      for (int s = 0; s < kMaxCustomSteps; ++s) {
        kept_custom_spans += step_count(p, "Limit" + std::to_string(s));
      }
    }
  }
  std::cerr << kTrainers << " trainers killed in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()
            << " ms: " << sent_total << " events recorded, " << refused_total << " refused\n";
  EXPECT_GT(refused_total, 0) << "no kill came after a refused registration's events";
  EXPECT_GT(kept_custom_spans, 0);
  EXPECT_GT(limit_hits(socket()), hits_before);
}

}  // namespace
}  // namespace steptrace::testing
