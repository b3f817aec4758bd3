// A damaged or oversized snapshot costs its bad records alone (issue 25, item 3), with the
// real steptraced and real trainers (durable_trainer.cpp; tests/ledger's ledger_worker
// for a VRAM reservation): the daemon's "steptrace.snapshot/v2" file
// (daemon/persist/snapshot_codec.h: a `<crc32> <json>` record per line) is damaged between
// a SIGTERM and the next start on the same state dir, or cut by limits.max_snapshot_bytes
// when it is written, and the next daemon restores every record but those:
//   - one bit flipped in one process's line: that process is gone, the others' totals are
//     exactly as before, `stats --json` snapshots.records_skipped is 1, and the log names
//     the line ("line N: checksum mismatch");
//   - the file cut inside its last process line: that process is gone, the others
//     restored, records_skipped is 2 (the torn line and the missing end record);
//   - one uid whose processes' records exceed max_snapshot_bytes (1 MiB) next to an
//     innocent uid: the records left out (snapshots.records_left_out) are the greedy
//     uid's last ones, and the innocent's totals and reservation come back exactly.
// The last case runs clients as two temporary users (useradd; removed after): CI runs as
// root, and without root it is skipped.
#include <pwd.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/ledger_json.h"
#include "tests/support/temporary_user.h"
#include "tests/support/worker.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// durable_trainer's rate: 1 thread, bursts of 100 spans, 20 a second (4,000 events a
// second): modest under AddressSanitizer on 2 cores, and a stop file seen within 50 ms.
const std::vector<std::string> kTrainerRate{"1", "100", "20"};
constexpr int kTrainers = 4;
constexpr std::size_t kCrcPrefix = 9;  // "<8 hex digits> " before each record's JSON
constexpr int kWaitMs = 30000;         // deadline of every wait (never reached when all is well)

std::optional<json> json_command(const std::string& socket, const std::string& line) {
  const auto reply = command(socket, line, kWaitMs);
  if (!reply) return std::nullopt;
  json doc = json::parse(*reply, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return std::nullopt;
  return doc;
}

// Polls `probe` every 10 ms until it holds or kWaitMs pass; whether it held.
bool wait_for(const std::function<bool()>& probe) {
  const auto deadline = Clock::now() + milliseconds(kWaitMs);
  while (!probe()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

// What a restore must bring back unchanged of a report's process entry: its totals (not
// what changes by itself: connections, exit ages, open spans' current state).
json totals_of(const json& p) {
  return {{"uid", p.value("uid", -1LL)},
          {"alive", p.value("alive", true)},
          {"events", p.value("events", json())},
          {"dropped", p.value("dropped", -1LL)},
          {"dropped_by_cause", p.value("dropped_by_cause", json())},
          {"unmatched_ends", p.value("unmatched_ends", -1LL)},
          {"abandoned", p.value("abandoned", -1LL)},
          {"steps", p.value("steps", json())}};
}

// The report entry of `pid` (`report --json --pid`: a whole report of the greedy test's
// thousands of custom steps takes seconds under AddressSanitizer); null when absent.
json report_entry(const std::string& socket, long long pid) {
  const auto doc = json_command(socket, "report --json --pid " + std::to_string(pid));
  EXPECT_TRUE(doc.has_value()) << "report --json --pid " << pid << " did not answer";
  for (const auto& p : doc ? doc->value("processes", json::array()) : json::array()) {
    if (p.value("pid", -1LL) == pid) return p;
  }
  return json();
}

// The totals (totals_of) of those of `pids` in the report, by pid.
std::map<long long, json> report_totals(const std::string& socket,
                                        const std::vector<long long>& pids) {
  std::map<long long, json> out;
  for (const long long pid : pids) {
    const json p = report_entry(socket, pid);
    if (p.is_object()) out[pid] = totals_of(p);
  }
  return out;
}

// `stats --json` snapshots.NAME, -1 when absent or no answer.
long long snapshot_stat(const std::string& socket, const char* name) {
  const auto doc = json_command(socket, "stats --json");
  if (!doc) return -1;
  return doc->value("snapshots", json::object()).value(name, -1LL);
}

// `stats --json` processes.NAME (the daemon's table: tracked, live, connected), -1 when
// absent or no answer. Cheap, unlike a report of thousands of steps.
long long table_stat(const std::string& socket, const char* name) {
  const auto doc = json_command(socket, "stats --json");
  if (!doc) return -1;
  return doc->value("processes", json::object()).value(name, -1LL);
}

// The lines of a snapshot file, without their '\n'.
std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

void write_lines(const std::string& path, const std::vector<std::string>& lines) {
  std::ofstream out(path, std::ios::trunc);
  for (const auto& line : lines) out << line << '\n';
}

// A record's JSON (its line without the checksum); discarded when it is no JSON.
json record_of(const std::string& line) {
  if (line.size() <= kCrcPrefix) return json(json::value_t::discarded);
  return json::parse(line.substr(kCrcPrefix), nullptr, false);
}

// The "process" record of a line; null when the line holds another record.
json process_of(const std::string& line) {
  const json record = record_of(line);
  if (!record.is_object() || !record.contains("process")) return json();
  return record.at("process");
}

// The index of the line holding the process record of `pid`.
std::optional<std::size_t> process_line(const std::vector<std::string>& lines, long long pid) {
  for (std::size_t i = 0; i < lines.size(); ++i) {
    const json p = process_of(lines[i]);
    if (p.is_object() && p.value("pid", -1LL) == pid) return i;
  }
  return std::nullopt;
}

class SnapshotDamage : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(::mkdir(state_dir().c_str(), 0700), 0); }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string state_dir() const { return dir_.file("state"); }
  std::string snapshot() const { return state_dir() + "/steptraced.snapshot.json"; }
  std::string config() const { return dir_.file("steptraced.json"); }
  // Where clients write their outfiles and find the stop file (every user may).
  std::string shared_dir() const { return dir_.file("shared"); }
  std::string stop_file() const { return shared_dir() + "/stop"; }
  // Every daemon's stderr: they all append to the socket's log.
  std::string log() const { return daemon_ ? daemon_->log() : std::string(); }

  // A daemon on the test's socket, state dir and config (`config_` as written); a fatal
  // failure when it does not answer.
  void start_daemon() {
    std::ofstream(config()) << config_.dump();
    daemon_ = std::make_unique<DaemonProcess>(
        socket(), std::vector<std::string>{"--config", config(), "--state-dir", state_dir()});
    ASSERT_TRUE(daemon_->start(60000)) << log();
  }

  void stop_daemon() { ASSERT_EQ(daemon_->stop(SIGTERM, 60000), 0) << log(); }

  void make_shared_dir() {
    ASSERT_EQ(::mkdir(shared_dir().c_str(), 0777), 0);
    ASSERT_EQ(::chmod(shared_dir().c_str(), 0777), 0);  // whatever the umask
  }

  // Waits until each of `pids` is in the report with events: it has recorded (the stop
  // file would otherwise stop it before its first burst).
  ::testing::AssertionResult wait_recording(const std::vector<long long>& pids) const {
    for (const long long pid : pids) {
      json last;
      if (!wait_for([&] {
            last = report_entry(socket(), pid);
            return last.is_object() && last.value("events", 0LL) > 0;
          })) {
        return ::testing::AssertionFailure() << "trainer " << pid << " recorded nothing within "
                                             << kWaitMs << " ms: " << last.dump();
      }
    }
    return ::testing::AssertionSuccess();
  }

  // Once `pid` (exited and reaped) shows as exited, its connection closed (the daemon's
  // last pass over its rings is done; the liveness tick, every 500 ms, marks it exited):
  // its report entry has every event it recorded (its OUTFILE), exactly.
  void expect_settled(long long pid, const std::string& outfile) const {
    const auto values = read_key_values(outfile);
    ASSERT_TRUE(values && values->contains("recorded_events")) << "no " << outfile;
    EXPECT_EQ(values->at("flush_rc"), 0) << "pid " << pid;
    json last;
    const bool settled = wait_for([&] {
      last = report_entry(socket(), pid);
      return last.is_object() && last.value("connections", -1LL) == 0 && !last.value("alive", true);
    });
    ASSERT_TRUE(settled) << "pid " << pid << " exited, still connected or alive: " << last.dump();
    ASSERT_EQ(last.value("events", -1LL), values->at("recorded_events"))
        << "pid " << pid << " before any damage: " << last.dump();
  }

  // `count` trainers (as root) record, stop, flush and exit; their pids, each settled.
  std::vector<long long> run_trainers(int count) {
    std::vector<long long> pids;
    std::vector<std::string> outfiles;
    for (int i = 0; i < count; ++i) {
      outfiles.push_back(dir_.file("trainer" + std::to_string(i) + ".out"));
      std::vector<std::string> argv{STEPTRACE_DURABLE_TRAINER, socket(), outfiles.back(),
                                    stop_file()};
      argv.insert(argv.end(), kTrainerRate.begin(), kTrainerRate.end());
      const pid_t pid = spawn_process(argv, {"STEPTRACE_QUIET=1"});
      EXPECT_GT(pid, 0);
      if (pid > 0) pids.push_back(pid);
    }
    EXPECT_TRUE(wait_recording(pids));
    std::ofstream(stop_file()) << "stop\n";
    for (const long long pid : pids) {
      EXPECT_EQ(wait_or_kill(static_cast<pid_t>(pid), kWaitMs), 0) << "trainer " << pid;
    }
    for (std::size_t i = 0; i < pids.size(); ++i) expect_settled(pids[i], outfiles[i]);
    return pids;
  }

  // Restarted on the damaged file: `lost` is gone, every other process of `before` has
  // exactly its totals, `skipped` records were skipped.
  void expect_restored_but(const std::map<long long, json>& before, long long lost,
                           long long skipped) {
    ASSERT_NO_FATAL_FAILURE(start_daemon());
    std::vector<long long> pids;
    for (const auto& [pid, totals] : before) pids.push_back(pid);
    const auto after = report_totals(socket(), pids);
    EXPECT_FALSE(after.contains(lost))
        << "the damaged record's process " << lost << " was restored: " << after.at(lost).dump();
    for (const auto& [pid, totals] : before) {
      if (pid == lost) continue;
      ASSERT_TRUE(after.contains(pid)) << "process " << pid << " lost with the damaged record";
      EXPECT_EQ(after.at(pid), totals) << "process " << pid;
    }
    EXPECT_EQ(after.size(), before.size() - 1);
    EXPECT_EQ(snapshot_stat(socket(), "records_skipped"), skipped) << log();
    EXPECT_EQ(snapshot_stat(socket(), "errors"), 0) << log();
  }

  TempDir dir_;
  json config_ = json::object();
  std::unique_ptr<DaemonProcess> daemon_;
};

TEST_F(SnapshotDamage, ABitFlippedSnapshotRestoresEverythingButTheDamagedRecord) {
  ASSERT_NO_FATAL_FAILURE(make_shared_dir());
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const std::vector<long long> pids = run_trainers(kTrainers);
  ASSERT_FALSE(HasFailure());
  const auto before = report_totals(socket(), pids);
  ASSERT_EQ(before.size(), pids.size());
  ASSERT_NO_FATAL_FAILURE(stop_daemon());

  std::vector<std::string> lines = read_lines(snapshot());
  const long long victim = pids[1];
  const auto at = process_line(lines, victim);
  ASSERT_TRUE(at.has_value()) << "no process record of " << victim << " in " << snapshot();
  for (const long long pid : pids) {
    EXPECT_TRUE(process_line(lines, pid).has_value()) << "no record of " << pid;
  }
  // One bit in the middle of the record's JSON: CRC-32 catches every single-bit error, and
  // XOR 1 makes a '\n' of no character but VT (0x0b), which JSON text never holds, so the
  // file keeps its lines.
  std::string& line = lines[*at];
  const std::size_t flip = kCrcPrefix + (line.size() - kCrcPrefix) / 2;
  line[flip] = static_cast<char>(line[flip] ^ 0x01);
  ASSERT_NE(line[flip], '\n');
  write_lines(snapshot(), lines);

  ASSERT_NO_FATAL_FAILURE(expect_restored_but(before, victim, 1));
  const std::string named = "line " + std::to_string(*at + 1) + ": checksum mismatch";
  EXPECT_NE(log().find(named), std::string::npos) << "the log does not say \"" << named << "\":\n"
                                                  << log();
}

TEST_F(SnapshotDamage, ATruncatedSnapshotRestoresUpToTheLastGoodRecord) {
  ASSERT_NO_FATAL_FAILURE(make_shared_dir());
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const std::vector<long long> pids = run_trainers(kTrainers);
  ASSERT_FALSE(HasFailure());
  const auto before = report_totals(socket(), pids);
  ASSERT_EQ(before.size(), pids.size());
  ASSERT_NO_FATAL_FAILURE(stop_daemon());

  // The file ends with the last process's line, then the end record.
  const std::vector<std::string> lines = read_lines(snapshot());
  ASSERT_GE(lines.size(), 3U + kTrainers) << "header, counters, ledger, processes, end";
  ASSERT_TRUE(record_of(lines.back()).contains("end")) << lines.back();
  const std::size_t last = lines.size() - 2;
  const json victim_record = process_of(lines[last]);
  ASSERT_TRUE(victim_record.is_object())
      << "the line before the end is no process: " << lines[last];
  const long long victim = victim_record.value("pid", -1LL);
  {
    std::ofstream out(snapshot(), std::ios::trunc);
    for (std::size_t i = 0; i < last; ++i) out << lines[i] << '\n';
    out << lines[last].substr(0, lines[last].size() / 2);  // no '\n': torn
  }

  ASSERT_NO_FATAL_FAILURE(expect_restored_but(before, victim, 2));
  const std::string text = log();
  const std::string torn = "line " + std::to_string(last + 1) + ": torn";
  EXPECT_NE(text.find(torn), std::string::npos) << "no \"" << torn << "\" in the log:\n" << text;
  EXPECT_NE(text.find("the file ends before its end record"), std::string::npos) << text;
}

// Copies `binary` and libsteptrace into `dir` (which every user can read) and returns a
// script there that runs the copy on it: another user may not reach the build tree (a
// checkout under a private home), whose libsteptrace the binary's RUNPATH names.
std::string stage(const std::string& dir, const std::string& binary) {
  namespace fs = std::filesystem;
  const fs::path lib = fs::path(dir) / STEPTRACE_CLIENT_SONAME;
  if (!fs::exists(lib)) fs::copy_file(STEPTRACE_CLIENT_SO, lib);
  const fs::path copy = fs::path(dir) / fs::path(binary).filename();
  fs::copy_file(binary, copy, fs::copy_options::overwrite_existing);
  const std::string script = copy.string() + ".sh";
  std::ofstream(script) << "#!/bin/sh\nLD_LIBRARY_PATH='" << dir << "' exec '" << copy.string()
                        << "' \"$@\"\n";
  for (const fs::path& p : {lib, copy, fs::path(script)}) {
    fs::permissions(p, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                           fs::perms::others_read | fs::perms::others_exec);
  }
  return script;
}

// The sizes of the snapshot's process lines by uid, for the record (printed).
std::map<std::uint32_t, std::vector<std::size_t>> process_lines_by_uid(
    const std::vector<std::string>& lines) {
  std::map<std::uint32_t, std::vector<std::size_t>> out;
  for (const auto& line : lines) {
    const json p = process_of(line);
    if (p.is_object()) out[p.value("uid", 0U)].push_back(line.size() + 1);
  }
  return out;
}

class GreedySnapshot : public SnapshotDamage {
 protected:
  // A custom step with one span takes ~257 bytes of its process's record (its histogram,
  // mostly; measured: 256,926 bytes for 1,000 such steps). The greedy uid's 6 trainers of
  // 800 steps (~206 KB each, ~1.24 MB together) exceed the 1 MiB cap. The innocent's
  // trainer has 1,000 (~257 KB): larger than any greedy record, so that no gap a file
  // written in table order leaves after the greedy records (< 206 KB) could hold it; only
  // the turns by uid keep it. In turns: the greedy's first, the innocent's holder (~350
  // bytes), the greedy's second, the innocent's trainer, the greedy's third fit (~880 KB);
  // the greedy's last 3 are left out.
  static constexpr int kGreedyTrainers = 6;
  static constexpr long long kGreedyLeftOut = 3;  // ~880 KB + 206 KB > 1 MiB, by ~35 KB
  static constexpr const char* kGreedySteps = "800";
  static constexpr const char* kInnocentSteps = "1000";
  static constexpr std::uint64_t kMaxSnapshotBytes = 1 << 20;  // the minimum
  static constexpr std::uint64_t kReservedBytes = 3ULL * 1024 * 1024 * 1024 + 7;
  inline static const std::string kGpu = "GPU-5a0d0000-1111-4c2a-8e6f-cccccccccccc";

  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root: it creates two temporary users (useradd) and runs "
                      "clients as them; CI runs it as root";
    }
    ASSERT_NO_FATAL_FAILURE(SnapshotDamage::SetUp());
    const std::string tag = std::to_string(::getpid() % 1000000);
    first_ = std::make_unique<TemporaryUser>("stsnap" + tag + "a");
    second_ = std::make_unique<TemporaryUser>("stsnap" + tag + "b");
    ASSERT_TRUE(first_->created()) << "useradd " << first_->name() << " failed";
    ASSERT_TRUE(second_->created()) << "useradd " << second_->name() << " failed";
    // The innocent uid is the larger: in each turn of the snapshot's processes (by uid,
    // ascending) the greedy uid's record comes first, so the innocent's are not kept
    // merely for sorting first.
    greedy_ = std::min(first_->uid(), second_->uid());
    innocent_ = std::max(first_->uid(), second_->uid());
    // The users reach the socket (directory searchable, socket for all), the shared
    // directory and the staged binaries.
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
    ASSERT_NO_FATAL_FAILURE(make_shared_dir());
    const std::string bin = dir_.file("bin");
    ASSERT_EQ(::mkdir(bin.c_str(), 0755), 0);
    ASSERT_EQ(::chmod(bin.c_str(), 0755), 0);
    trainer_ = stage(bin, STEPTRACE_DURABLE_TRAINER);
    holder_ = stage(bin, STEPTRACE_LEDGER_WORKER);
    config_ = {{"socket_mode", "0666"},
               {"snapshot_interval_s", 1},
               {"limits", {{"max_snapshot_bytes", kMaxSnapshotBytes}}}};
  }

  // durable_trainer as `uid`, registering `steps` custom steps (one span each) before it
  // records at kTrainerRate; started, with its outfile, in trainers_.
  void start_trainer(uid_t uid, const std::string& steps) {
    outfiles_.push_back(shared_dir() + "/trainer" + std::to_string(outfiles_.size()) + ".out");
    std::vector<std::string> args{outfiles_.back(), stop_file()};
    args.insert(args.end(), kTrainerRate.begin(), kTrainerRate.end());
    args.push_back(steps);
    trainers_.push_back(std::make_unique<Worker>(trainer_, socket(), args, uid));
  }

  // The greedy uid's trainers first, then the innocent's holder and trainer: in the
  // daemon's table the innocent's come last, where a file written in table order would
  // cut them. All record, stop, flush and exit (the holder lives on); each settled. The
  // waits read `stats`, not reports: a report of the greedy's 4,800 custom steps takes
  // seconds under AddressSanitizer.
  void run_clients() {
    for (int i = 0; i < kGreedyTrainers; ++i) start_trainer(greedy_, kGreedySteps);
    ASSERT_TRUE(wait_for([&] { return table_stat(socket(), "tracked") == kGreedyTrainers; }))
        << "the greedy trainers did not all connect: " << table_stat(socket(), "tracked");
    holder_worker_ = std::make_unique<Worker>(
        holder_, socket(),
        std::vector<std::string>{"hold", kGpu, "1", std::to_string(kReservedBytes), "innocent"},
        innocent_);
    ASSERT_TRUE(holder_worker_->expect_line("ready"));
    start_trainer(innocent_, kInnocentSteps);
    ASSERT_TRUE(wait_recording({trainers_.back()->pid()}));
    pids_ = trainer_pids();  // before they are reaped (a reaped Worker's pid is -1)
    pids_.push_back(holder_worker_->pid());
    std::ofstream(stop_file()) << "stop\n";
    for (std::size_t i = 0; i < trainers_.size(); ++i) {
      ASSERT_EQ(trainers_[i]->finish(kWaitMs), 0) << "trainer " << pids_[i];
    }
    // Every trainer exited (marked so once its connection closed): the holder alone lives.
    ASSERT_TRUE(wait_for([&] { return table_stat(socket(), "live") == 1; }))
        << "live processes: " << table_stat(socket(), "live");
    for (std::size_t i = 0; i + 1 < trainers_.size(); ++i) {
      const auto values = read_key_values(outfiles_[i]);
      ASSERT_TRUE(values && values->contains("flush_rc")) << "no " << outfiles_[i];
      EXPECT_EQ(values->at("flush_rc"), 0) << "greedy trainer " << pids_[i];
    }
    ASSERT_NO_FATAL_FAILURE(expect_settled(innocent_pid(), outfiles_.back()));
  }

  long long innocent_pid() const { return pids_[kGreedyTrainers]; }
  long long holder_pid() const { return pids_.back(); }

  std::vector<long long> trainer_pids() const {
    std::vector<long long> pids;
    for (const auto& t : trainers_) pids.push_back(t->pid());
    return pids;
  }

  // The ledger's reservation of the innocent holder, without its age.
  json reservation() const {
    const auto ledger = json_command(socket(), "ledger --json");
    const json* gpu = ledger ? find_gpu(*ledger, kGpu) : nullptr;
    const json* r = gpu ? find_reservation(*gpu, 1) : nullptr;
    if (r == nullptr) return json();
    json out = *r;
    out.erase("age_s");
    return out;
  }

  // The final snapshot's records left out, said by its end record; its size and process
  // lines printed.
  long long final_left_out() {
    const std::vector<std::string> lines = read_lines(snapshot());
    EXPECT_FALSE(lines.empty());
    if (lines.empty()) return -1;
    const long long left_out =
        record_of(lines.back()).value("end", json::object()).value("left_out", -1LL);
    std::size_t bytes = 0;
    for (const auto& line : lines) bytes += line.size() + 1;
    auto by_uid = process_lines_by_uid(lines);
    std::cerr << "final snapshot: " << bytes << " bytes, " << left_out
              << " records left out; process lines (bytes): greedy uid "
              << json(by_uid[greedy_]).dump() << ", innocent uid " << json(by_uid[innocent_]).dump()
              << "\n";
    EXPECT_LE(bytes, kMaxSnapshotBytes);
    return left_out;
  }

  std::unique_ptr<TemporaryUser> first_;
  std::unique_ptr<TemporaryUser> second_;
  uid_t greedy_ = 0;
  uid_t innocent_ = 0;
  std::string trainer_;  // the staged scripts
  std::string holder_;
  // Declared after the users: destroyed (killed, reaped) before userdel runs.
  std::vector<std::unique_ptr<Worker>> trainers_;
  std::vector<std::string> outfiles_;
  std::unique_ptr<Worker> holder_worker_;
  std::vector<long long> pids_;  // the trainers', then the holder's
};

// The innocent's two processes are compared whole; the greedy's by what `stats` counts of
// them (reports of their 4,800 custom steps take seconds each under AddressSanitizer).
TEST_F(GreedySnapshot, AGreedyUidCannotPushAnInnocentOneOutOfTheSnapshot) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  ASSERT_NO_FATAL_FAILURE(run_clients());
  const std::vector<long long> innocent{innocent_pid(), holder_pid()};
  const auto before = report_totals(socket(), innocent);
  ASSERT_EQ(before.size(), innocent.size());
  const json reserved = reservation();
  ASSERT_EQ(reserved.value("bytes", 0ULL), kReservedBytes) << reserved.dump();
  ASSERT_EQ(table_stat(socket(), "tracked"), kGreedyTrainers + 2);
  // A periodic snapshot (every second while state changes) already left records out.
  EXPECT_TRUE(wait_for([&] { return snapshot_stat(socket(), "records_left_out") > 0; }))
      << "stats --json snapshots.records_left_out stayed "
      << snapshot_stat(socket(), "records_left_out") << ":\n"
      << log();
  ASSERT_NO_FATAL_FAILURE(stop_daemon());
  const long long left_out = final_left_out();
  EXPECT_EQ(left_out, kGreedyLeftOut) << "the records' sizes changed? see kGreedySteps";
  EXPECT_GT(left_out, 0) << "the greedy uid's records fit in " << kMaxSnapshotBytes << " bytes";
  EXPECT_LT(left_out, kGreedyTrainers) << "the greedy uid lost every process";

  ASSERT_NO_FATAL_FAILURE(start_daemon());
  EXPECT_EQ(report_totals(socket(), innocent), before) << "the innocent uid's processes";
  EXPECT_EQ(reservation(), reserved) << "the innocent's reservation";
  EXPECT_EQ(snapshot_stat(socket(), "records_skipped"), 0) << log();
  // The greedy uid lost exactly the records left out: its other processes, each with its
  // 800 custom steps, are back beside the innocent's two.
  const long long greedy_restored = kGreedyTrainers - left_out;
  EXPECT_EQ(table_stat(socket(), "tracked"), greedy_restored + 2);
  const auto doc = json_command(socket(), "stats --json");
  ASSERT_TRUE(doc.has_value());
  EXPECT_EQ(doc->value("custom_steps", -1LL),
            std::stoll(kInnocentSteps) + greedy_restored * std::stoll(kGreedySteps));
  EXPECT_EQ(holder_worker_->finish(), 0);
}

// The shared ledger view across a real restart (issue 26): who holds a reservation and
// who established a GPU's total are in the snapshot, so after the restart another uid
// still may neither release the one nor contradict the other, and the owner still may
// correct its total (a total owned by no uid, as older snapshots restore it, it could
// not).
class LedgerOwnersSurvive : public SnapshotDamage {
 protected:
  static constexpr std::uint64_t kGiB = 1ULL << 30;
  inline static const std::string kGpu = "GPU-5a0d0000-2222-4c2a-8e6f-dddddddddddd";

  void SetUp() override {
    if (::geteuid() != 0) {
      GTEST_SKIP() << "needs root: it creates two temporary users (useradd) and runs "
                      "clients as them; CI runs it as root";
    }
    ASSERT_NO_FATAL_FAILURE(SnapshotDamage::SetUp());
    const std::string tag = std::to_string(::getpid() % 1000000);
    owner_ = std::make_unique<TemporaryUser>("stown" + tag + "a");
    other_ = std::make_unique<TemporaryUser>("stown" + tag + "b");
    ASSERT_TRUE(owner_->created()) << "useradd " << owner_->name() << " failed";
    ASSERT_TRUE(other_->created()) << "useradd " << other_->name() << " failed";
    ASSERT_EQ(::chmod(dir_.path().c_str(), 0711), 0);
    const std::string bin = dir_.file("bin");
    ASSERT_EQ(::mkdir(bin.c_str(), 0755), 0);
    ASSERT_EQ(::chmod(bin.c_str(), 0755), 0);
    worker_ = stage(bin, STEPTRACE_LEDGER_WORKER);
    config_ = {{"socket_mode", "0666"}, {"snapshot_interval_s", 1}};
  }

  // ledger_worker ARGS... as `user`, to its end; its exit status.
  int run(const TemporaryUser& user, std::vector<std::string> args) const {
    return Worker(worker_, socket(), std::move(args), user.uid()).finish();
  }
  std::uint64_t anomaly(const char* kind) const {
    const auto doc = json_command(socket(), "stats --json");
    return doc ? doc->value("ledger_anomalies", json::object()).value(kind, std::uint64_t{0}) : 0;
  }
  // The GPU's entry of `ledger --json`; null when absent.
  json gpu() const {
    const auto ledger = json_command(socket(), "ledger --json");
    const json* g = ledger ? find_gpu(*ledger, kGpu) : nullptr;
    return g != nullptr ? *g : json();
  }
  // Its total_bytes (the established total, without NVML); 0 when unknown.
  std::uint64_t total() const {
    const json g = gpu();
    return g.is_object() && g["total_bytes"].is_number_unsigned()
               ? g["total_bytes"].get<std::uint64_t>()
               : 0;
  }

  std::unique_ptr<TemporaryUser> owner_;
  std::unique_ptr<TemporaryUser> other_;
  std::string worker_;
  // Declared after the users: destroyed (killed, reaped) before userdel runs.
  std::unique_ptr<Worker> holder_;
};

TEST_F(LedgerOwnersSurvive, AForeignReleaseOrTotalAfterARestartIsRefusedAndCounted) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  holder_ = std::make_unique<Worker>(
      worker_, socket(), std::vector<std::string>{"hold", kGpu, "1", "4096", "t"}, owner_->uid());
  ASSERT_TRUE(holder_->expect_line("ready"));
  ASSERT_EQ(run(*owner_, {"sample", kGpu, std::to_string(8 * kGiB), std::to_string(16 * kGiB)}), 0);
  ASSERT_EQ(total(), 16 * kGiB);
  ASSERT_NO_FATAL_FAILURE(stop_daemon());
  ASSERT_NO_FATAL_FAILURE(start_daemon());

  // The other uid's release and contradicting total: refused, counted, nothing changed.
  ASSERT_EQ(run(*other_, {"release", kGpu, "1"}), 0);
  EXPECT_EQ(anomaly("release_refused"), 1U) << log();
  EXPECT_NE(find_reservation(gpu(), 1), nullptr) << gpu().dump();
  ASSERT_EQ(run(*other_, {"sample", kGpu, std::to_string(kGiB), std::to_string(2 * kGiB)}), 0);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 1U);
  EXPECT_EQ(total(), 16 * kGiB);
  // The owner, who established the total before the restart, still may change it.
  ASSERT_EQ(run(*owner_, {"sample", kGpu, std::to_string(8 * kGiB), std::to_string(32 * kGiB)}), 0);
  EXPECT_EQ(anomaly("vram_total_mismatch"), 1U);
  EXPECT_EQ(total(), 32 * kGiB);
  EXPECT_EQ(holder_->finish(), 0);
}

}  // namespace
}  // namespace steptrace::testing
