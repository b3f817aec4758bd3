// Rings in shared memory (protocol version 5) across process deaths: what a trainer
// recorded reaches the daemon even when the trainer dies without flushing, and every
// event it recorded is either counted or reported dropped, exactly: sent == counted +
// dropped. The real steptraced on a temporary socket and real processes (fork/exec):
// steptrace_dying_trainer (dying_trainer.cpp), which connects, has its ring attached
// (one warm-up Backward span and a flush), records K Forward events (start, end, start,
// ...: K / 2 spans, an odd K leaves one open) and dies without a flush: SIGKILL, _exit,
// SIGSEGV, abort; and python3 with the package in bindings/python (shm_death_child.py):
// os._exit, multiprocessing Pool workers (fork), torch DataLoader workers.
//
// Counts are read back with `report --json --pid N` once the process's connection is
// closed (its `connections` is 0): the daemon then has made its last pass over the
// process's rings and counted the spans left open as abandoned. Events of a process:
// 2 x count + open + abandoned + unmatched_ends per step; drops: `dropped` and
// `dropped_by_cause` (a v5 library leaves the ring's own counters out of its
// DroppedByCause frames: the daemon reads them in the ring's header). `stats --json`'s
// shared_rings shows the premise: the ring was mapped (attached) and its events were
// read from shared memory (events).
//
// No timing assertions; waits are polls bounded by generous deadlines, sized for a
// loaded 2-core machine, also under AddressSanitizer. STEPTRACE_TEST_SEED=N repeats the
// random event counts of a run (the seed is printed, and named in every failure).
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/settled_process.h"
#include "tests/support/test_seed.h"

namespace steptrace::testing {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kKilled = 128 + SIGKILL;
constexpr int kSegfault = 128 + SIGSEGV;
constexpr int kAborted = 128 + SIGABRT;

constexpr const char* kCauses[] = {"buffer_full", "not_connected", "in_flight", "invalid"};

// Spare rings a library keeps offered to a version-8 daemon (client/src/flusher.cpp).
constexpr long long kSpareRings = 2;

// The ring of STEPTRACE_BUFFER_BYTES=64K: 4096 16-byte records.
constexpr long long kSmallRingRecords = 64 * 1024 / 16;

// `stats --json`'s shared_rings.
struct RingStats {
  long long attached = -1;
  long long refused = -1;
  long long mapped = -1;
  long long events = -1;
  long long records_refused = -1;
  long long bad_rings = -1;
};

RingStats ring_stats(const std::string& socket) {
  RingStats r;
  const auto doc = json_command(socket, "stats --json");
  EXPECT_TRUE(doc && doc->contains("shared_rings")) << "stats --json has no shared_rings";
  if (!doc || !doc->contains("shared_rings")) return r;
  const auto& s = doc->at("shared_rings");
  r.attached = s.at("attached").get<long long>();
  r.refused = s.at("refused").get<long long>();
  r.mapped = s.at("mapped").get<long long>();
  r.events = s.at("events").get<long long>();
  r.records_refused = s.at("records_refused").get<long long>();
  r.bad_rings = s.at("bad_rings").get<long long>();
  return r;
}

// `report --json`'s daemon.events_received: events applied, from all clients.
long long events_received(const std::string& socket) {
  const auto doc = json_command(socket, "report --json");
  EXPECT_TRUE(doc.has_value()) << "report --json";
  return doc ? doc->at("daemon").at("events_received").get<long long>() : -1;
}

long long step_field(const nlohmann::json& process, const std::string& step, const char* field) {
  if (!process.is_object()) return -1;
  for (const auto& s : process.at("steps")) {
    if (s.at("step") == step) return s.at(field).get<long long>();
  }
  return 0;
}

// The events of `step` the daemon accounts for: each complete span is two, each span
// still open or abandoned one, each end without a start one.
long long events_counted(const nlohmann::json& process, const std::string& step) {
  return 2 * step_field(process, step, "count") + step_field(process, step, "open") +
         step_field(process, step, "abandoned") + step_field(process, step, "unmatched_ends");
}

long long dropped(const nlohmann::json& process, const char* cause = nullptr) {
  if (!process.is_object()) return -1;
  if (cause == nullptr) return process.at("dropped").get<long long>();
  return process.at("dropped_by_cause").value(cause, -1LL);
}

// Nothing of the process was dropped, by any cause.
void expect_nothing_dropped(const nlohmann::json& process) {
  EXPECT_EQ(dropped(process), 0);
  for (const char* cause : kCauses) EXPECT_EQ(dropped(process, cause), 0) << cause;
}

// A dying trainer that recorded `events` Forward events after its warm-up span and died
// with nothing dropped: all of them counted, exactly.
void expect_all_counted(const nlohmann::json& process, long long events) {
  ASSERT_TRUE(process.is_object());
  EXPECT_EQ(step_field(process, "Forward", "count"), events / 2);
  EXPECT_EQ(step_field(process, "Forward", "open"), 0);
  EXPECT_EQ(step_field(process, "Forward", "abandoned"), events % 2);
  EXPECT_EQ(process.at("abandoned").get<long long>(), events % 2);
  EXPECT_EQ(process.at("unmatched_ends").get<long long>(), 0);
  EXPECT_EQ(step_field(process, "Backward", "count"), 1);  // the warm-up span
  expect_nothing_dropped(process);
}

bool file_exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Every thread of `pid` is in the stopped state ('T' in /proc/PID/task/TID/stat).
bool all_threads_stopped(pid_t pid) {
  std::error_code ec;
  const std::string tasks = "/proc/" + std::to_string(pid) + "/task";
  bool any = false;
  for (const auto& entry : std::filesystem::directory_iterator(tasks, ec)) {
    std::ifstream in(entry.path() / "stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto paren = stat.rfind(')');
    if (paren == std::string::npos || paren + 2 >= stat.size()) return false;
    if (stat[paren + 2] != 'T') return false;
    any = true;
  }
  return !ec && any;
}

// The daemon, SIGCONTed again when the scope ends (a failed assertion included).
struct Resumer {
  const DaemonProcess& daemon;
  ~Resumer() { daemon.signal(SIGCONT); }
};

class ShmDeath : public ::testing::Test {
 protected:
  void SetUp() override {
    daemon_ = std::make_unique<DaemonProcess>(socket());
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string file(const std::string& name) const { return dir_.file(name); }

  pid_t dying_trainer(long long events, const std::string& death,
                      std::vector<std::string> extra = {},
                      const std::vector<std::string>& env = {}) const {
    std::vector<std::string> argv{STEPTRACE_DYING_TRAINER, socket(), std::to_string(events), death};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return spawn_process(argv, env);
  }

  // A dying trainer recording `events` events, then `death`: its exit status is
  // `status`, its ring was mapped, and every event is counted.
  void expect_death_loses_nothing(const std::string& death, long long events, int status) {
    const RingStats before = ring_stats(socket());
    const pid_t pid = dying_trainer(events, death);
    ASSERT_GT(pid, 0);
    ASSERT_EQ(wait_or_kill(pid, 60000), status)
        << "the trainer did not die as `" << death << "` (2: connect or flush failed)";
    const auto process = settled_process(socket(), pid, 10);
    expect_all_counted(process, events);
    const RingStats after = ring_stats(socket());
    // Its first ring and the spares, all offered before the warm-up flush was answered
    // (a thread that took a spare may have had another made and mapped since).
    EXPECT_GE(after.attached - before.attached, 1 + kSpareRings) << "its rings were not mapped";
    EXPECT_EQ(after.refused, before.refused);
    // The Forward events can only have come from the ring: it was shared from before the
    // first of them, and the process flushed nothing. (The warm-up's two events may have
    // gone on the socket, if the flusher took them before it offered the ring.)
    EXPECT_GE(after.events - before.events, events);
    EXPECT_LE(after.events - before.events, events + 2);
    EXPECT_EQ(after.records_refused, before.records_refused);
    EXPECT_EQ(after.bad_rings, before.bad_rings);
  }

  // python3's environment: the package in bindings/python, the library just built.
  std::vector<std::string> python_env() const {
    std::vector<std::string> env{std::string("STEPTRACE_LIBRARY=") + STEPTRACE_CLIENT_SO,
                                 std::string("PYTHONPATH=") + STEPTRACE_PYTHON_PATH};
    if (std::string(STEPTRACE_LIBASAN).empty()) return env;
    // python3 is not instrumented: the ASan runtime must come first.
    env.push_back(std::string("LD_PRELOAD=") + STEPTRACE_LIBASAN);
    env.push_back("ASAN_OPTIONS=detect_leaks=0");
    return env;
  }
  pid_t python_child(const std::vector<std::string>& args,
                     const std::string& python = STEPTRACE_PYTHON) const {
    std::vector<std::string> argv{python, "-B", STEPTRACE_SHM_DEATH_CHILD};
    argv.insert(argv.end(), args.begin(), args.end());
    return spawn_process(argv, python_env());
  }

  // Runs shm_death_child.py MODE SOCKET OUTFILE ARGS... (exit 0 expected) and checks every
  // worker it reports, and the parent. Returns its exit status.
  int run_python_workers(const std::string& mode, const std::vector<std::string>& args,
                         const std::string& python = STEPTRACE_PYTHON) {
    const std::string out = file(mode + ".json");
    std::vector<std::string> all{mode, socket(), out};
    all.insert(all.end(), args.begin(), args.end());
    const int status = wait_or_kill(python_child(all, python), 180000);
    if (status != 0) return status;
    std::ifstream in(out);
    const auto doc = nlohmann::json::parse(in, nullptr, false);
    EXPECT_FALSE(doc.is_discarded()) << "no results in " << out;
    if (doc.is_discarded()) return status;
    long long recorded = 0;
    long long counted = 0;
    EXPECT_FALSE(doc.at("workers").empty()) << doc.dump();
    for (const auto& [pid_text, spans_json] : doc.at("workers").items()) {
      const long long pid = std::stoll(pid_text);
      const long long spans = spans_json.get<long long>();
      SCOPED_TRACE("worker pid " + pid_text + ", " + std::to_string(spans) + " spans");
      const auto worker = settled_process(socket(), pid, 10);
      EXPECT_EQ(step_field(worker, "Forward", "count"), spans);
      EXPECT_EQ(step_field(worker, "Backward", "count"), 1);  // its warm-up span
      EXPECT_EQ(worker.value("abandoned", -1LL), 0);
      EXPECT_EQ(worker.value("unmatched_ends", -1LL), 0);
      expect_nothing_dropped(worker);
      recorded += spans;
      counted += step_field(worker, "Forward", "count");
    }
    EXPECT_EQ(counted, recorded);
    // The parent: its own spans, none of its workers', none of theirs in it.
    const auto parent = settled_process(socket(), doc.at("parent").get<long long>(), 10);
    EXPECT_EQ(step_field(parent, "Backward", "count"), doc.at("parent_spans").get<long long>());
    EXPECT_EQ(step_field(parent, "Forward", "count"), 0);
    expect_nothing_dropped(parent);
    std::cerr << mode << ": " << doc.at("workers").size() << " workers recorded " << recorded
              << " spans, " << counted << " counted\n";
    return status;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

// 100 trainers, one after another against one daemon, each recording a random number K
// of events (1..200,000, within the default 4 MiB ring: nothing needs dropping) and then
// SIGKILLing itself: K / 2 spans counted, K % 2 abandoned, nothing dropped. The first
// three take K = 1, 2 and 200,000.
TEST_F(ShmDeath, SigkilledTrainersLoseNoEvent) {
  constexpr int kTrainers = 100;
  constexpr long long kMaxEvents = 200'000;
  const std::uint64_t seed = announced_seed("SigkilledTrainersLoseNoEvent");
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<long long> pick(1, kMaxEvents);
  const auto t0 = Clock::now();
  for (int i = 0; i < kTrainers; ++i) {
    const long long events = i == 0 ? 1 : i == 1 ? 2 : i == 2 ? kMaxEvents : pick(rng);
    SCOPED_TRACE("trainer " + std::to_string(i) + ": K = " + std::to_string(events));
    expect_death_loses_nothing("kill", events, kKilled);
    if (HasFailure()) break;  // the seed and K above repeat it
  }
  std::cerr << kTrainers << " SIGKILLed trainers in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count()
            << " ms\n";
}

// A new thread's first events, then SIGKILL at once, 40 times: the thread takes a spare
// ring the daemon maps already (protocol version 8), so nothing it recorded waits for the
// flusher to offer its ring. Before spare rings, its ring was made on its first event and
// offered when the flusher next ran: a death before that lost the events, with no count on
// either side. K is 1..2,000 (a few microseconds of recording); the first two take 1 and 2.
TEST_F(ShmDeath, ANewThreadSigkilledRightAfterItsFirstEventsLosesNone) {
  constexpr int kTrainers = 40;
  const std::uint64_t seed = announced_seed("ANewThreadSigkilledRightAfterItsFirstEventsLosesNone");
  SCOPED_TRACE(seed_note(seed));
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<long long> pick(1, 2000);
  for (int i = 0; i < kTrainers; ++i) {
    const long long events = i == 0 ? 1 : i == 1 ? 2 : pick(rng);
    SCOPED_TRACE("trainer " + std::to_string(i) + ": K = " + std::to_string(events));
    expect_death_loses_nothing("thread-kill", events, kKilled);
    if (HasFailure()) break;
  }
}

TEST_F(ShmDeath, ExitWithoutFlushLosesNoEvent) { expect_death_loses_nothing("exit", 150'001, 0); }

TEST_F(ShmDeath, SegfaultLosesNoEvent) { expect_death_loses_nothing("segv", 99'999, kSegfault); }

TEST_F(ShmDeath, AbortLosesNoEvent) { expect_death_loses_nothing("abort", 12'345, kAborted); }

// Drops, then death. The trainer (a 64 KiB ring: 4096 records) has its ring attached and
// says it is ready; the daemon is SIGSTOPped (every thread stopped); the trainer records
// 20,000 events, far more than its ring holds with nobody draining it, and SIGKILLs
// itself; then SIGCONT. The daemon's last pass over the ring finds the ring full and the
// producer's drop counter: every event is counted or dropped, exactly, every drop as
// buffer_full (connected, the daemon fell behind), and what was counted is exactly the
// ring's slots (nobody drained it meanwhile).
TEST_F(ShmDeath, DaemonStoppedWhileTheRingOverflowsThenSigkillCountsEveryEvent) {
  constexpr long long kEvents = 20'000;
  const std::string ready = file("ready");
  const std::string go = file("go");
  const RingStats before = ring_stats(socket());
  const pid_t pid = dying_trainer(kEvents, "kill", {ready, go}, {"STEPTRACE_BUFFER_BYTES=64K"});
  ASSERT_GT(pid, 0);
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  while (!file_exists(ready) && Clock::now() < deadline) {
    ASSERT_EQ(wait_process(pid, 0), -1) << "the trainer exited before it was ready";
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  if (!file_exists(ready)) {
    wait_or_kill(pid, 0);
    FAIL() << "the trainer never got ready";
  }
  // Its ring and the 2 spare rings the library keeps offered (protocol version 8), made
  // and offered with it before the warm-up flush was answered.
  const RingStats attached = ring_stats(socket());
  EXPECT_EQ(attached.attached, before.attached + 1 + kSpareRings) << "its ring is not mapped";

  int status = -1;
  {
    const Resumer resume{*daemon_};
    daemon_->signal(SIGSTOP);
    const auto stop_deadline = Clock::now() + std::chrono::seconds(10);
    while (!all_threads_stopped(daemon_->pid()) && Clock::now() < stop_deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ASSERT_TRUE(all_threads_stopped(daemon_->pid())) << "the daemon did not stop";
    std::ofstream(go) << "go\n";
    status = wait_or_kill(pid, 60000);
  }
  ASSERT_EQ(status, kKilled);

  const auto process = settled_process(socket(), pid, 10);
  ASSERT_TRUE(process.is_object());
  const long long counted = events_counted(process, "Forward");
  const long long lost = dropped(process);
  std::cerr << "daemon stopped, ring of " << kSmallRingRecords << " records: " << kEvents
            << " events recorded, " << counted << " counted, " << lost << " dropped\n";
  EXPECT_EQ(counted + lost, kEvents);
  EXPECT_GT(lost, 0);
  EXPECT_EQ(dropped(process, "buffer_full"), lost);
  EXPECT_EQ(dropped(process, "not_connected"), 0);
  EXPECT_EQ(dropped(process, "in_flight"), 0);
  EXPECT_EQ(dropped(process, "invalid"), 0);
  EXPECT_EQ(counted, kSmallRingRecords);
  EXPECT_EQ(step_field(process, "Backward", "count"), 1);  // the warm-up span
  // The daemon as a whole, this trainer its only client: the same sum, warm-up included.
  EXPECT_EQ(events_received(socket()) + lost, kEvents + 2);
  const RingStats after = ring_stats(socket());
  EXPECT_EQ(after.bad_rings, before.bad_rings);
  EXPECT_EQ(after.records_refused, before.records_refused);
}

// A graceful restart loses nothing a shared ring held. Each round: a daemon with a state
// dir; a trainer (its ring mapped, its connection open) records while the daemon is
// SIGSTOPped; the daemon gets SIGTERM, then SIGCONT, and stops; a new daemon restores
// its snapshot. The stopping daemon's last pass over the ring (when it closes the
// connection) must come before its final snapshot, or what that pass consumed is in no
// snapshot while the ring says it was taken: lost, and counted nowhere. Several rounds,
// since the ring timer may get to the ring first after SIGCONT.
TEST_F(ShmDeath, GracefulRestartKeepsWhatTheLastRingPassRead) {
  constexpr int kRounds = 6;
  constexpr long long kEvents = 400;  // below the 64 KiB ring's high-water mark (512): no nudge
  const std::string state = file("state");
  ASSERT_EQ(::mkdir(state.c_str(), 0700), 0);
  const auto start_daemon = [&] {
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--state-dir", state});
    return daemon_->start();
  };
  const auto wait_file = [](const std::string& path) {
    const auto deadline = Clock::now() + std::chrono::seconds(30);
    while (!file_exists(path) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return file_exists(path);
  };
  daemon_.reset();
  int lost_rounds = 0;
  for (int round = 0; round < kRounds; ++round) {
    SCOPED_TRACE("round " + std::to_string(round));
    ASSERT_TRUE(start_daemon()) << daemon_->log();
    const std::string ready = file("ready" + std::to_string(round));
    const std::string go = file("go" + std::to_string(round));
    const pid_t pid = dying_trainer(kEvents, "live", {ready, go}, {"STEPTRACE_BUFFER_BYTES=64K"});
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(wait_file(ready)) << "the trainer never got ready";
    {
      const Resumer resume{*daemon_};
      daemon_->signal(SIGSTOP);
      const auto stop_deadline = Clock::now() + std::chrono::seconds(10);
      while (!all_threads_stopped(daemon_->pid()) && Clock::now() < stop_deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      ASSERT_TRUE(all_threads_stopped(daemon_->pid())) << "the daemon did not stop";
      std::ofstream(go) << "go\n";
      ASSERT_TRUE(wait_file(go + ".done")) << "the trainer did not record";
      daemon_->signal(SIGTERM);
    }
    ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
    ::kill(pid, SIGKILL);
    ASSERT_EQ(wait_or_kill(pid, 10000), kKilled);
    ASSERT_TRUE(start_daemon()) << daemon_->log();
    const auto process = settled_process(socket(), pid, 10);
    ASSERT_TRUE(process.is_object()) << "the restored daemon does not know pid " << pid;
    const long long counted = step_field(process, "Forward", "count");
    lost_rounds += counted == kEvents / 2 ? 0 : 1;
    EXPECT_EQ(counted, kEvents / 2);
    expect_nothing_dropped(process);
    ASSERT_EQ(daemon_->stop(SIGTERM), 0) << daemon_->log();
  }
  std::cerr << "graceful restarts: " << lost_rounds << " of " << kRounds << " rounds lost events\n";
}

// ---- Python --------------------------------------------------------------------------

#define SKIP_WITHOUT_PYTHON()                                               \
  do {                                                                      \
    if (std::string(STEPTRACE_PYTHON).empty()) {                            \
      GTEST_SKIP() << "no python3 was found when the build was configured"; \
    }                                                                       \
  } while (0)

// python3: N spans, then os._exit(0) (no atexit hook, no flush).
TEST_F(ShmDeath, PythonOsExitLosesNoSpan) {
  SKIP_WITHOUT_PYTHON();
  constexpr long long kSpans = 30'000;
  const pid_t pid = python_child({"exit", socket(), std::to_string(kSpans)});
  ASSERT_GT(pid, 0);
  ASSERT_EQ(wait_or_kill(pid, 120000), 0);
  const auto process = settled_process(socket(), pid, 10);
  expect_all_counted(process, 2 * kSpans);
}

// A multiprocessing Pool (fork): 3 workers run 9 tasks (1000 + 37 i spans each), return
// what they recorded, and are terminated (SIGTERM) without flushing. Every worker's
// spans are counted under its own pid.
TEST_F(ShmDeath, PythonPoolTerminatedLosesNoSpan) {
  SKIP_WITHOUT_PYTHON();
  EXPECT_EQ(run_python_workers("pool", {"3", "9", "terminate"}), 0);
}

// The same with maxtasksperchild=1: each worker leaves by itself after one task, through
// multiprocessing's os._exit (no atexit hook, no flush).
TEST_F(ShmDeath, PythonPoolWorkersExitingLoseNoSpan) {
  SKIP_WITHOUT_PYTHON();
  EXPECT_EQ(run_python_workers("pool", {"3", "6", "exit"}), 0);
}

// torch.utils.data.DataLoader, num_workers=2, persistent_workers=False: each item's
// __getitem__ records one span in its worker; after the epoch the workers are shut down
// (os._exit, no flush). Every item's span arrives, under the pid that fetched it.
// The interpreter is the one that imported torch when the build was configured (the
// build's python3, else Debian's /usr/bin/python3 with python3-torch, which
// `scripts/setup.sh --tests` installs).
TEST_F(ShmDeath, PythonTorchDataLoaderWorkersLoseNoSpan) {
  if (std::string(STEPTRACE_TORCH_PYTHON).empty()) {
    GTEST_SKIP() << "no python3 that imports torch was found when the build was configured "
                    "(install python3-torch, e.g. scripts/setup.sh --tests, and configure again)";
  }
  EXPECT_EQ(run_python_workers("dataloader", {"2000"}, STEPTRACE_TORCH_PYTHON), 0)
      << "exit status 77: torch could not be imported after all";
}

}  // namespace
}  // namespace steptrace::testing
