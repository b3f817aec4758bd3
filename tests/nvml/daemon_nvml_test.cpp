// NVML end to end: the real steptraced (fork/exec) loads the scripted fake
// libnvidia-ml.so.1 (fake_nvml.c, one build per process-list entry point) through
// `nvml: on` and `nvml_library`, samples it every 100 ms, and joins what it reports with
// the ledger that real ledger_worker processes fill. Read back with `ledger --json`,
// `metrics` and `ping`:
//   - device figures (name, total, used, free) win over a client's VramSample;
//   - the findings UNDECLARED, OVER (at the tolerance boundary), IDLE and GHOST appear and
//     go as the script changes;
//   - the v2 and v1 process-list entry points give process figures too;
//   - `nvml: on` with a library that cannot be loaded or initialised stops start-up with a
//     message naming the cause; `auto` runs without device figures;
//   - a GPU that vanishes from the script leaves the device view;
//   - a library slower than the interval does not slow the io thread;
//   - the Prometheus families steptrace_gpu_device_* and steptrace_gpu_findings;
//   - per-device failures in device_error; over-commitment judged against the total the
//     ledger reports (the device's when NVML has the GPU).
// The script is named by $FAKE_NVML_SCRIPT, set in this process before the daemon is
// started (it inherits the environment), and rewritten atomically (rename) while the
// daemon runs: the fake re-reads it at every sample.
#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"
#include "tests/support/ledger_json.h"
#include "tests/support/worker.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr std::uint64_t kMiB = 1024ull * 1024;
constexpr std::uint64_t kGiB = 1024 * kMiB;
constexpr int kPollTimeoutMs = 10000;
constexpr int kReadyTimeoutMs = 20000;

const std::string kGpuA = "GPU-8f2c1a3e-0000-4e5b-9a7d-aaaaaaaaaaaa";
const std::string kGpuB = "GPU-3b9d7c21-1111-4c2a-8e6f-bbbbbbbbbbbb";
const std::string kGpuC = "GPU-5d1e9f40-2222-4a3b-9c8d-cccccccccccc";
const std::string kNameA = "NVIDIA A100-SXM4-80GB";
const std::string kNameB = "NVIDIA H100 80GB HBM3";
const std::string kNameC = "Tesla T4";

// One `gpu` line of the fake's script.
std::string gpu_line(const std::string& uuid, std::uint64_t total, std::uint64_t used,
                     const std::string& name) {
  return "gpu " + uuid + " total " + std::to_string(total) + " used " + std::to_string(used) +
         " name " + name + "\n";
}

std::string proc_line(std::int64_t pid, std::uint64_t bytes) {
  return "proc " + std::to_string(pid) + " " + std::to_string(bytes) + "\n";
}

// A pid this pid namespace does not show (GHOST material).
pid_t absent_pid() {
  for (pid_t pid = 999999; pid > 900000; --pid) {
    if (::kill(pid, 0) != 0 && errno == ESRCH &&
        !std::filesystem::exists("/proc/" + std::to_string(pid))) {
      return pid;
    }
  }
  return 999999;
}

// The finding of `kind` for `pid` in a GPU's `findings`; nullptr when absent.
const json* find_finding(const json& gpu, const std::string& kind, std::int64_t pid) {
  if (!gpu.contains("findings")) return nullptr;
  for (const auto& f : gpu["findings"]) {
    if (f["kind"] == kind && f["pid"] == pid) return &f;
  }
  return nullptr;
}

// The device's process entry of `pid`; nullptr when absent.
const json* find_device_process(const json& gpu, std::int64_t pid) {
  if (!gpu.contains("device") || !gpu["device"].is_object()) return nullptr;
  for (const auto& p : gpu["device"]["processes"]) {
    if (p["pid"] == pid) return &p;
  }
  return nullptr;
}

bool has_device(const json* gpu) {
  return gpu != nullptr && gpu->contains("device") && (*gpu)["device"].is_object();
}

class NvmlDaemonTestBase : public ::testing::Test {
 protected:
  void SetUp() override {
    write_script("");
    ASSERT_EQ(::setenv("FAKE_NVML_SCRIPT", script_path().c_str(), 1), 0);
  }
  void TearDown() override {
    daemon_.reset();
    ::unsetenv("FAKE_NVML_SCRIPT");
  }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string script_path() const { return dir_.file("nvml.script"); }

  // Replaces the script in one step, so a sample reads the old or the new one whole.
  void write_script(const std::string& text) {
    const std::string tmp = dir_.file("nvml.script.tmp");
    {
      std::ofstream out(tmp, std::ios::trunc);
      out << text;
    }
    std::filesystem::rename(tmp, script_path());
  }

  std::string write_config(const json& config) {
    const std::string path = dir_.file("steptraced.json");
    std::ofstream out(path, std::ios::trunc);
    out << config.dump(2) << '\n';
    return path;
  }

  // `nvml: on` on `library`, sampling every 100 ms, plus `extra` keys.
  json nvml_config(const std::string& library, const json& extra = json::object()) const {
    json config = {{"nvml", "on"}, {"nvml_library", library}, {"nvml_interval_ms", 100}};
    config.update(extra);
    return config;
  }

  ::testing::AssertionResult start_daemon(const json& config, std::vector<std::string> flags = {}) {
    std::vector<std::string> args{"--config", write_config(config)};
    args.insert(args.end(), flags.begin(), flags.end());
    daemon_ = std::make_unique<DaemonProcess>(socket(), std::move(args));
    if (daemon_->start()) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "steptraced did not start:\n" << daemon_->log();
  }

  // Runs steptraced to its exit (it must fail at start-up): the exit status, and its
  // stderr in `log`.
  int run_daemon_to_exit(const json& config, std::string& log) {
    const std::string log_path = dir_.file("exit.log");
    const int status =
        run_process({"/bin/sh", "-c", "exec \"$0\" --socket \"$1\" --config \"$2\" 2>\"$3\"",
                     STEPTRACED_BIN, socket(), write_config(config), log_path},
                    {}, 10000);
    std::ifstream in(log_path);
    std::stringstream text;
    text << in.rdbuf();
    log = text.str();
    return status;
  }

  std::optional<json> ledger() const {
    const auto reply = command(socket(), "ledger --json", 5000);
    if (!reply) return std::nullopt;
    json parsed = json::parse(*reply, nullptr, false);
    if (parsed.is_discarded()) return std::nullopt;
    return parsed;
  }

  // Polls `ledger --json` until `done` holds (up to kPollTimeoutMs); says what the
  // ledger last looked like when it never did.
  ::testing::AssertionResult wait_ledger(const std::function<bool(const json&)>& done,
                                         const std::string& what, json* last_out = nullptr) {
    const auto deadline = Clock::now() + milliseconds(kPollTimeoutMs);
    json last;
    while (Clock::now() < deadline) {
      if (auto l = ledger()) {
        last = *l;
        if (done(last)) {
          if (last_out != nullptr) *last_out = last;
          return ::testing::AssertionSuccess();
        }
      }
      std::this_thread::sleep_for(milliseconds(50));
    }
    if (last_out != nullptr) *last_out = last;
    return ::testing::AssertionFailure() << "never saw " << what << "; last ledger --json:\n"
                                         << last.dump(2) << "\ndaemon log:\n"
                                         << (daemon_ ? daemon_->log() : std::string());
  }

  // Waits until the device of `uuid` shows `pid` with `bytes` (so the sample holding
  // it was applied), then returns that ledger.
  ::testing::AssertionResult wait_process_bytes(const std::string& uuid, std::int64_t pid,
                                                std::uint64_t bytes, json* last_out) {
    return wait_ledger(
        [&](const json& l) {
          const json* g = find_gpu(l, uuid);
          if (!has_device(g)) return false;
          const json* p = find_device_process(*g, pid);
          return p != nullptr && (*p)["used_bytes"] == bytes;
        },
        "pid " + std::to_string(pid) + " using " + std::to_string(bytes) + " on " + uuid, last_out);
  }

  // A holder of reservation `id` (`bytes` on `uuid`), ready (its reserve applied).
  std::unique_ptr<Worker> hold(const std::string& uuid, std::uint64_t id, std::uint64_t bytes) {
    auto worker = std::make_unique<Worker>(
        STEPTRACE_LEDGER_WORKER, socket(),
        std::vector<std::string>{"hold", uuid, std::to_string(id), std::to_string(bytes), "train"});
    EXPECT_TRUE(worker->expect_line("ready", kReadyTimeoutMs));
    return worker;
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
};

class NvmlDaemonTest : public NvmlDaemonTestBase {};

// 1. The device's figures show per GPU, and total/free come from it even when a client
// sent a VramSample saying otherwise.
TEST_F(NvmlDaemonTest, DeviceFiguresWinOverClientSample) {
  write_script(gpu_line(kGpuA, 80 * kGiB, 3 * kGiB, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_TRUE(wait_ledger([](const json& l) { return has_device(find_gpu(l, kGpuA)); },
                          "the device of GPU A"));

  // A client's sample with other numbers (free 10 GiB of 76 GiB: a total within 10% of
  // the device's, else it would be refused as vram_total_mismatch).
  ASSERT_EQ(run_process({STEPTRACE_LEDGER_WORKER, socket(), "sample", kGpuA,
                         std::to_string(10 * kGiB), std::to_string(76 * kGiB)},
                        {}, 30000),
            0);
  json l;
  ASSERT_TRUE(wait_ledger(
      [](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["operations"].is_object() &&
               (*g)["operations"].value("vram_sample", 0) >= 1;
      },
      "GPU A with the client's sample applied", &l));
  const json* g = find_gpu(l, kGpuA);
  ASSERT_NE(g, nullptr);
  const json& d = (*g)["device"];
  EXPECT_EQ(d["name"], kNameA);
  EXPECT_EQ(d["total_bytes"], 80 * kGiB);
  EXPECT_EQ(d["used_bytes"], 3 * kGiB);
  EXPECT_EQ(d["free_bytes"], 77 * kGiB);
  EXPECT_TRUE(d["processes_known"].get<bool>());
  EXPECT_TRUE(d["processes"].empty());
  EXPECT_GE(d["sample_age_s"].get<double>(), 0.0);
  EXPECT_LT(d["sample_age_s"].get<double>(), 5.0);
  EXPECT_EQ((*g)["capacity_source"], "device");
  EXPECT_EQ((*g)["total_bytes"], 80 * kGiB);
  EXPECT_EQ((*g)["free_bytes"], 77 * kGiB);
  EXPECT_EQ((*g)["available_bytes"], 80 * kGiB);  // nothing reserved
  EXPECT_TRUE((*g)["findings"].empty());
  EXPECT_FALSE(l.contains("device_error")) << l.dump(2);

  // The device's used figure follows the script.
  write_script(gpu_line(kGpuA, 80 * kGiB, 5 * kGiB, kNameA));
  EXPECT_TRUE(wait_ledger(
      [](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["device"]["used_bytes"] == 5 * kGiB &&
               (*g)["free_bytes"] == 75 * kGiB && (*g)["capacity_source"] == "device";
      },
      "GPU A's used bytes updated to 5 GiB"));
}

// 2. A visible process using memory on a GPU where it holds no reservation.
TEST_F(NvmlDaemonTest, UndeclaredUse) {
  const pid_t self = ::getpid();
  write_script(gpu_line(kGpuA, 80 * kGiB, 2 * kGiB, kNameA) + proc_line(self, 2 * kGiB));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  json l;
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "UNDECLARED", self) != nullptr;
      },
      "UNDECLARED for the test's pid", &l));
  const json& g = *find_gpu(l, kGpuA);
  const json& f = *find_finding(g, "UNDECLARED", self);
  EXPECT_EQ(f["used_bytes"], 2 * kGiB);
  EXPECT_EQ(f["reserved_bytes"], 0);
  EXPECT_FALSE(f.contains("reservation_id"));
  EXPECT_EQ(g["findings"].size(), 1u) << g.dump(2);
  const json* p = find_device_process(g, self);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ((*p)["used_bytes"], 2 * kGiB);
  EXPECT_TRUE((*p)["visible"].get<bool>());
  // A device-only GPU: no ledger figures of its own, capacity from the device.
  EXPECT_EQ(g["capacity_source"], "device");
  EXPECT_TRUE(g["reservations"].empty());
  // The timeline has the samples: the device's used bytes and the findings by kind.
  const auto trace = command(socket(), "trace", 10000);
  ASSERT_TRUE(trace.has_value());
  const json doc = json::parse(*trace);
  bool used = false;
  bool undeclared = false;
  for (const json& e : doc["traceEvents"]) {
    if (e["ph"] != "C") continue;
    used = used || (e["name"] == "VRAM used (device) " + kGpuA && e["args"]["bytes"] == 2 * kGiB);
    undeclared = undeclared || (e["name"] == "findings " + kGpuA && e["args"]["UNDECLARED"] == 1);
  }
  EXPECT_TRUE(used) << *trace;
  EXPECT_TRUE(undeclared) << *trace;

  // It stops using memory: the finding goes.
  write_script(gpu_line(kGpuA, 80 * kGiB, 0, kNameA) + proc_line(self, 0));
  EXPECT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        const json* p = g == nullptr ? nullptr : find_device_process(*g, self);
        return p != nullptr && (*p)["used_bytes"] == 0 && (*g)["findings"].empty();
      },
      "no finding once the test's pid uses 0 bytes"));
}

// 3. A holder over its reservation by more than the tolerance (10%): OVER; at the
// tolerance exactly: none.
TEST_F(NvmlDaemonTest, OverReservationBeyondTolerance) {
  constexpr std::uint64_t kReserved = 1'000'000'000;
  constexpr std::uint64_t kAllowed = 1'100'000'000;  // kReserved x 1.10
  write_script(gpu_line(kGpuA, 80 * kGiB, 0, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3, {{"nvml_over_tolerance_pct", 10}})));
  auto holder = hold(kGpuA, 7, kReserved);
  ASSERT_FALSE(HasFatalFailure());
  const pid_t pid = holder->pid();

  // At the boundary: no finding at all.
  write_script(gpu_line(kGpuA, 80 * kGiB, kAllowed, kNameA) + proc_line(pid, kAllowed));
  json l;
  ASSERT_TRUE(wait_process_bytes(kGpuA, pid, kAllowed, &l));
  EXPECT_TRUE((*find_gpu(l, kGpuA))["findings"].empty()) << l.dump(2);

  // One byte more: OVER, with what it uses and what it reserved.
  write_script(gpu_line(kGpuA, 80 * kGiB, kAllowed + 1, kNameA) + proc_line(pid, kAllowed + 1));
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "OVER", pid) != nullptr;
      },
      "OVER for the holder", &l));
  const json& g = *find_gpu(l, kGpuA);
  const json& f = *find_finding(g, "OVER", pid);
  EXPECT_EQ(f["used_bytes"], kAllowed + 1);
  EXPECT_EQ(f["reserved_bytes"], kReserved);
  EXPECT_EQ(g["findings"].size(), 1u) << g.dump(2);
  EXPECT_EQ(g["reserved_bytes"], kReserved);

  // Back within its reservation: OVER goes.
  write_script(gpu_line(kGpuA, 80 * kGiB, kReserved, kNameA) + proc_line(pid, kReserved));
  ASSERT_TRUE(wait_process_bytes(kGpuA, pid, kReserved, &l));
  EXPECT_TRUE((*find_gpu(l, kGpuA))["findings"].empty()) << l.dump(2);
}

// 4. A live holder whose pid uses nothing on the GPU for nvml_idle_s: IDLE with its
// reservation id; gone once it uses memory.
TEST_F(NvmlDaemonTest, IdleReservationAndItsEnd) {
  write_script(gpu_line(kGpuA, 80 * kGiB, 0, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3, {{"nvml_idle_s", 1}})));
  const auto spawned = Clock::now();
  auto holder = hold(kGpuA, 42, 4 * kGiB);
  ASSERT_FALSE(HasFatalFailure());
  const pid_t pid = holder->pid();
  write_script(gpu_line(kGpuA, 80 * kGiB, 0, kNameA) + proc_line(pid, 0));

  json l;
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "IDLE", pid) != nullptr;
      },
      "IDLE for the holder", &l));
  // The reservation was made after the spawn, and IDLE needs a second since.
  EXPECT_GE(std::chrono::duration_cast<milliseconds>(Clock::now() - spawned).count(), 1000);
  const json& g = *find_gpu(l, kGpuA);
  const json& f = *find_finding(g, "IDLE", pid);
  EXPECT_EQ(f["reservation_id"], 42);
  EXPECT_EQ(f["reserved_bytes"], 4 * kGiB);
  EXPECT_EQ(f["used_bytes"], 0);
  EXPECT_EQ(g["findings"].size(), 1u) << g.dump(2);
  const json* r = find_reservation(g, 42);
  ASSERT_NE(r, nullptr);
  EXPECT_TRUE((*r)["holder_alive"].get<bool>());

  // It starts using memory: IDLE goes (and nothing else shows: within its reservation).
  write_script(gpu_line(kGpuA, 80 * kGiB, 3 * kGiB, kNameA) + proc_line(pid, 3 * kGiB));
  ASSERT_TRUE(wait_process_bytes(kGpuA, pid, 3 * kGiB, &l));
  EXPECT_TRUE((*find_gpu(l, kGpuA))["findings"].empty()) << l.dump(2);
}

// 5. A pid NVML reports that /proc does not show: GHOST.
TEST_F(NvmlDaemonTest, GhostPid) {
  const pid_t ghost = absent_pid();
  write_script(gpu_line(kGpuA, 80 * kGiB, 6 * kGiB, kNameA) + proc_line(ghost, 6 * kGiB));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  json l;
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "GHOST", ghost) != nullptr;
      },
      "GHOST for pid " + std::to_string(ghost), &l));
  const json& g = *find_gpu(l, kGpuA);
  const json& f = *find_finding(g, "GHOST", ghost);
  EXPECT_EQ(f["used_bytes"], 6 * kGiB);
  EXPECT_EQ(f["reserved_bytes"], 0);
  EXPECT_EQ(g["findings"].size(), 1u) << g.dump(2);  // not UNDECLARED as well
  const json* p = find_device_process(g, ghost);
  ASSERT_NE(p, nullptr);
  EXPECT_FALSE((*p)["visible"].get<bool>());
}

// 5b. A reaped child's pid is a ghost too.
TEST_F(NvmlDaemonTest, ReapedChildIsGhost) {
  const pid_t child = spawn_process({"/bin/true"});
  ASSERT_GT(child, 0);
  ASSERT_EQ(wait_process(child, 10000), 0);
  write_script(gpu_line(kGpuA, 80 * kGiB, kGiB, kNameA) + proc_line(child, kGiB));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  EXPECT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "GHOST", child) != nullptr;
      },
      "GHOST for the reaped child " + std::to_string(child)));
}

// 7. `nvml: on` and nvmlInit_v2 fails: no daemon, and the message says why.
TEST_F(NvmlDaemonTest, OnWithInitFailureStopsStartup) {
  write_script("init_fail 9\n" + gpu_line(kGpuA, 80 * kGiB, 0, kNameA));
  std::string log;
  const int status = run_daemon_to_exit(nvml_config(FAKE_NVML_V3), log);
  EXPECT_NE(status, 0) << log;
  EXPECT_NE(status, -1) << "steptraced still ran after 10 s:\n" << log;
  EXPECT_NE(log.find("nvmlInit_v2"), std::string::npos) << log;
  EXPECT_NE(log.find("Driver Not Loaded"), std::string::npos) << log;
  EXPECT_FALSE(std::filesystem::exists(socket())) << "socket left behind";
}

// 7. `nvml: on` and the library is missing: no daemon, and the message names the path.
TEST_F(NvmlDaemonTest, OnWithMissingLibraryStopsStartup) {
  const std::string missing = dir_.file("no-such-dir/libnvidia-ml.so.1");
  std::string log;
  const int status = run_daemon_to_exit(nvml_config(missing), log);
  EXPECT_NE(status, 0) << log;
  EXPECT_NE(status, -1) << "steptraced still ran after 10 s:\n" << log;
  EXPECT_NE(log.find(missing), std::string::npos) << log;
}

// 7. `--nvml auto` (over the file's `on`) with a missing library: the daemon runs, and
// client-only GPUs have no device figures.
TEST_F(NvmlDaemonTest, AutoWithMissingLibraryRunsWithoutDevices) {
  const std::string missing = dir_.file("no-such-dir/libnvidia-ml.so.1");
  ASSERT_TRUE(start_daemon(nvml_config(missing), {"--nvml", "auto"}));
  ASSERT_EQ(run_process({STEPTRACE_LEDGER_WORKER, socket(), "sample", kGpuA,
                         std::to_string(10 * kGiB), std::to_string(16 * kGiB)},
                        {}, 30000),
            0);
  json l;
  ASSERT_TRUE(wait_ledger([](const json& l) { return find_gpu(l, kGpuA) != nullptr; },
                          "GPU A from the client's sample", &l));
  const json& g = *find_gpu(l, kGpuA);
  EXPECT_TRUE(g["device"].is_null()) << g.dump(2);
  EXPECT_EQ(g["capacity_source"], "client");
  EXPECT_EQ(g["total_bytes"], 16 * kGiB);
  EXPECT_EQ(g["free_bytes"], 10 * kGiB);
  EXPECT_TRUE(g["findings"].empty());
  EXPECT_FALSE(l.contains("device_error")) << l.dump(2);
  EXPECT_EQ(l["gpus"].size(), 1u) << l.dump(2);
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_EQ(metrics->find("steptrace_gpu_device_total_bytes{"), std::string::npos) << *metrics;
  EXPECT_EQ(metrics->find("steptrace_gpu_findings{"), std::string::npos) << *metrics;
  EXPECT_NE(metrics->find("steptrace_nvml_samples_total 0\n"), std::string::npos) << *metrics;
  // The daemon says why it runs without NVML.
  EXPECT_NE(daemon_->log().find(missing), std::string::npos) << daemon_->log();
}

// 8. A GPU that vanishes from the script leaves the device view: a GPU with ledger
// entries keeps them (device null, client capacity), a device-only one goes.
TEST_F(NvmlDaemonTest, VanishedGpuLeavesDeviceView) {
  write_script(gpu_line(kGpuA, 80 * kGiB, kGiB, kNameA) + gpu_line(kGpuB, 80 * kGiB, 0, kNameB) +
               gpu_line(kGpuC, 16 * kGiB, 0, kNameC));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_EQ(run_process({STEPTRACE_LEDGER_WORKER, socket(), "sample", kGpuA,
                         std::to_string(10 * kGiB), std::to_string(76 * kGiB)},
                        {}, 30000),
            0);
  ASSERT_TRUE(wait_ledger(
      [](const json& l) {
        const json* a = find_gpu(l, kGpuA);
        return has_device(a) && (*a)["operations"].value("vram_sample", 0) >= 1 &&
               has_device(find_gpu(l, kGpuB)) && has_device(find_gpu(l, kGpuC));
      },
      "GPUs A, B and C with devices"));

  write_script(gpu_line(kGpuC, 16 * kGiB, 2 * kGiB, kNameC));
  json l;
  ASSERT_TRUE(wait_ledger(
      [](const json& l) {
        const json* c = find_gpu(l, kGpuC);
        return has_device(c) && (*c)["device"]["used_bytes"] == 2 * kGiB;
      },
      "GPU C's new figures", &l));
  const json* a = find_gpu(l, kGpuA);
  ASSERT_NE(a, nullptr) << "GPU A has ledger entries (a client's sample) and must stay";
  EXPECT_TRUE((*a)["device"].is_null()) << a->dump(2);
  EXPECT_EQ((*a)["capacity_source"], "client");
  EXPECT_EQ((*a)["total_bytes"], 76 * kGiB);
  EXPECT_EQ((*a)["free_bytes"], 10 * kGiB);
  EXPECT_EQ(find_gpu(l, kGpuB), nullptr) << "device-only GPU B stayed:\n" << l.dump(2);
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_EQ(metrics->find("gpu_uuid=\"" + kGpuA + "\""), std::string::npos) << *metrics;
  EXPECT_EQ(metrics->find("gpu_uuid=\"" + kGpuB + "\""), std::string::npos) << *metrics;
  EXPECT_NE(metrics->find("steptrace_gpu_device_total_bytes{gpu_uuid=\"" + kGpuC + "\"}"),
            std::string::npos)
      << *metrics;
}

// 9. A library slower than the interval (500 ms a sample, every 100 ms): the io thread
// answers promptly, and sampling goes on.
TEST_F(NvmlDaemonTest, SlowLibraryDoesNotBlockIoThread) {
  write_script("sleep_ms 500\n" + gpu_line(kGpuA, 80 * kGiB, kGiB, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_TRUE(wait_ledger([](const json& l) { return has_device(find_gpu(l, kGpuA)); },
                          "the device of GPU A"));
  for (int i = 0; i < 8; ++i) {
    const auto before = Clock::now();
    const auto reply = command(socket(), "ping", 5000);
    const auto took = std::chrono::duration_cast<milliseconds>(Clock::now() - before).count();
    ASSERT_TRUE(reply.has_value()) << "ping " << i;
    EXPECT_EQ(*reply, "pong\n");
    EXPECT_LT(took, 1000) << "ping " << i << " took " << took << " ms";
    std::this_thread::sleep_for(milliseconds(130));
  }
  write_script("sleep_ms 500\n" + gpu_line(kGpuA, 80 * kGiB, 9 * kGiB, kNameA));
  EXPECT_TRUE(wait_ledger(
      [](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["device"]["used_bytes"] == 9 * kGiB;
      },
      "a later sample (used 9 GiB) applied"));
  // Every sample is about 500 ms old at most (plus the poll): not stalled.
  const auto l = ledger();
  ASSERT_TRUE(l.has_value());
  const json* g = find_gpu(*l, kGpuA);
  ASSERT_TRUE(has_device(g));
  EXPECT_LT((*g)["device"]["sample_age_s"].get<double>(), 3.0) << g->dump(2);
  // stats counts the samples and those slower than the interval (every one here).
  const auto stats = command(socket(), "stats --json", 5000);
  ASSERT_TRUE(stats.has_value());
  const json nvml = json::parse(*stats).at("nvml");
  EXPECT_GE(nvml.at("samples").get<std::uint64_t>(), 2u) << nvml.dump();
  EXPECT_GE(nvml.at("slow_samples").get<std::uint64_t>(), 1u) << nvml.dump();
  EXPECT_EQ(nvml.at("sample_errors"), 0) << nvml.dump();
  EXPECT_EQ(nvml.at("devices"), 1) << nvml.dump();
  // SIGTERM during a slow sample: a clean exit, after one sample at most.
  const auto before = Clock::now();
  EXPECT_EQ(daemon_->stop(SIGTERM, 10000), 0) << daemon_->log();
  EXPECT_LT(std::chrono::duration_cast<milliseconds>(Clock::now() - before).count(), 5000);
}

// 10. Metrics: the device gauges and the findings count, labelled gpu_uuid.
TEST_F(NvmlDaemonTest, MetricsCarryDeviceAndFindings) {
  const pid_t self = ::getpid();
  write_script(gpu_line(kGpuA, 80 * kGiB, 2 * kGiB, kNameA) + proc_line(self, 2 * kGiB));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return g != nullptr && find_finding(*g, "UNDECLARED", self) != nullptr;
      },
      "UNDECLARED for the test's pid"));
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  const std::string label = "{gpu_uuid=\"" + kGpuA + "\"}";
  const auto line = [&](const std::string& name_and_labels, const std::string& value) {
    return "\n" + name_and_labels + " " + value + "\n";
  };
  EXPECT_NE(
      metrics->find(line("steptrace_gpu_device_total_bytes" + label, std::to_string(80 * kGiB))),
      std::string::npos)
      << *metrics;
  EXPECT_NE(
      metrics->find(line("steptrace_gpu_device_used_bytes" + label, std::to_string(2 * kGiB))),
      std::string::npos)
      << *metrics;
  EXPECT_NE(
      metrics->find(line("steptrace_gpu_device_free_bytes" + label, std::to_string(78 * kGiB))),
      std::string::npos)
      << *metrics;
  const std::string findings = "steptrace_gpu_findings{gpu_uuid=\"" + kGpuA + "\",kind=";
  EXPECT_NE(metrics->find(line(findings + "\"UNDECLARED\"}", "1")), std::string::npos) << *metrics;
  for (const char* kind : {"OVER", "IDLE", "GHOST"}) {
    EXPECT_NE(metrics->find(line(findings + "\"" + kind + "\"}", "0")), std::string::npos)
        << kind << "\n"
        << *metrics;
  }
}

// Per-device failures: the top-level device_error names the device, the call and NVML's
// text; a device whose memory call failed is left out, one whose process call failed
// stays without process figures (and so without findings). It clears with the failure.
TEST_F(NvmlDaemonTest, DeviceErrorsAndUnknownProcesses) {
  const pid_t self = ::getpid();
  write_script(gpu_line(kGpuA, 80 * kGiB, kGiB, kNameA) + proc_line(self, kGiB) +
               "fail processes 3\n" + gpu_line(kGpuB, 80 * kGiB, 0, kNameB) + "fail memory 4\n");
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  json l;
  ASSERT_TRUE(
      wait_ledger([](const json& l) { return l.contains("device_error"); }, "a device_error", &l));
  const std::string error = l["device_error"];
  EXPECT_NE(error.find("GPU 1 (" + kGpuB +
                       "): nvmlDeviceGetMemoryInfo failed: "
                       "Insufficient Permissions (4)"),
            std::string::npos)
      << error;
  EXPECT_NE(error.find("GPU 0 (" + kGpuA + ")"), std::string::npos) << error;
  EXPECT_NE(error.find("Not Supported (3)"), std::string::npos) << error;
  EXPECT_EQ(find_gpu(l, kGpuB), nullptr) << l.dump(2);
  const json* a = find_gpu(l, kGpuA);
  ASSERT_TRUE(has_device(a)) << l.dump(2);
  EXPECT_FALSE((*a)["device"]["processes_known"].get<bool>());
  EXPECT_TRUE((*a)["device"]["processes"].empty());
  EXPECT_TRUE((*a)["findings"].empty()) << a->dump(2);
  EXPECT_EQ((*a)["capacity_source"], "device");
  const auto stats = command(socket(), "stats --json", 5000);
  ASSERT_TRUE(stats.has_value());
  EXPECT_GE(json::parse(*stats)["nvml"]["sample_errors"].get<std::uint64_t>(), 1u) << *stats;

  write_script(gpu_line(kGpuA, 80 * kGiB, kGiB, kNameA) + proc_line(self, kGiB) +
               gpu_line(kGpuB, 80 * kGiB, 0, kNameB));
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* a = find_gpu(l, kGpuA);
        return !l.contains("device_error") && has_device(find_gpu(l, kGpuB)) && a != nullptr &&
               find_finding(*a, "UNDECLARED", self) != nullptr;
      },
      "no device_error, GPU B back and UNDECLARED on GPU A"));
}

// Over-commitment follows the capacity the ledger reports: with the device's total (no
// client sample), reserving more than it is over-committed, as available_bytes < 0 says.
TEST_F(NvmlDaemonTest, OvercommitJudgedAgainstDeviceTotal) {
  write_script(gpu_line(kGpuA, 16 * kGiB, 0, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_TRUE(wait_ledger([](const json& l) { return has_device(find_gpu(l, kGpuA)); },
                          "the device of GPU A"));
  // Two reservations that each fit (one larger than the GPU is refused outright).
  auto holder = hold(kGpuA, 1, 12 * kGiB);
  ASSERT_FALSE(HasFatalFailure());
  auto holder2 = hold(kGpuA, 2, 8 * kGiB);
  ASSERT_FALSE(HasFatalFailure());
  json l;
  ASSERT_TRUE(wait_ledger(
      [](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["reserved_bytes"] == 20 * kGiB;
      },
      "20 GiB reserved on GPU A", &l));
  const json& g = *find_gpu(l, kGpuA);
  EXPECT_EQ(g["capacity_source"], "device");
  EXPECT_EQ(g["total_bytes"], 16 * kGiB);
  EXPECT_EQ(g["available_bytes"], -static_cast<std::int64_t>(4 * kGiB));
  EXPECT_EQ(g["overcommitted"], true) << g.dump(2);
  EXPECT_GE(g["overcommit_events"].get<std::uint64_t>(), 1u) << g.dump(2);
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics.has_value());
  EXPECT_NE(metrics->find("\nsteptrace_gpu_overcommitted{gpu=\"" + kGpuA + "\"} 1\n"),
            std::string::npos)
      << *metrics;
}

// And the other way: a client's sample with a smaller total than the device's does not
// make a reservation that fits the device over-committed, nor does the text report say
// so against the client's total while it shows the device's.
TEST_F(NvmlDaemonTest, NoOvercommitWhenTheDeviceHoldsTheReservation) {
  write_script(gpu_line(kGpuA, 80 * kGiB, 0, kNameA));
  ASSERT_TRUE(start_daemon(nvml_config(FAKE_NVML_V3)));
  ASSERT_EQ(run_process({STEPTRACE_LEDGER_WORKER, socket(), "sample", kGpuA,
                         std::to_string(16 * kGiB), std::to_string(16 * kGiB)},
                        {}, 30000),
            0);
  auto holder = hold(kGpuA, 1, 20 * kGiB);
  ASSERT_FALSE(HasFatalFailure());
  json l;
  ASSERT_TRUE(wait_ledger(
      [](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["reserved_bytes"] == 20 * kGiB;
      },
      "20 GiB reserved on GPU A", &l));
  const json& g = *find_gpu(l, kGpuA);
  EXPECT_EQ(g["capacity_source"], "device");
  EXPECT_EQ(g["total_bytes"], 80 * kGiB);
  EXPECT_EQ(g["available_bytes"], 60 * kGiB);
  EXPECT_EQ(g["overcommitted"], false) << g.dump(2);
  const auto text = command(socket(), "ledger");
  ASSERT_TRUE(text.has_value());
  EXPECT_EQ(text->find("OVERCOMMITTED"), std::string::npos) << *text;
}

// 6. Every process-list entry point (v3, the CUDA 12.2.0/12.2.1 v3, v2, v1) gives
// process figures, and the findings built on them.
struct Variant {
  const char* name;
  const char* library;
  const char* entry_point;  // as the start-up log names it
};

// Names the variant in test output (not its bytes: ctest names would change per build).
// gtest looks the name up. NOLINTNEXTLINE(readability-identifier-naming)
void PrintTo(const Variant& variant, std::ostream* out) { *out << variant.name; }

class NvmlVariantTest : public NvmlDaemonTestBase, public ::testing::WithParamInterface<Variant> {};

TEST_P(NvmlVariantTest, ProcessFiguresFromEveryEntryPoint) {
  const pid_t self = ::getpid();
  const pid_t ghost = absent_pid();
  write_script(gpu_line(kGpuA, 40 * kGiB, 5 * kGiB, kNameA) + proc_line(self, 3 * kGiB) +
               proc_line(ghost, 2 * kGiB) + "proc " + std::to_string(self == 1 ? 2 : 1) + " na\n");
  ASSERT_TRUE(start_daemon(nvml_config(GetParam().library)));
  json l;
  ASSERT_TRUE(wait_ledger(
      [&](const json& l) {
        const json* g = find_gpu(l, kGpuA);
        return has_device(g) && (*g)["device"]["processes"].size() == 3;
      },
      "three processes on GPU A", &l));
  const json& g = *find_gpu(l, kGpuA);
  EXPECT_TRUE(g["device"]["processes_known"].get<bool>());
  const json* mine = find_device_process(g, self);
  ASSERT_NE(mine, nullptr) << g.dump(2);
  EXPECT_EQ((*mine)["used_bytes"], 3 * kGiB);
  EXPECT_TRUE((*mine)["visible"].get<bool>());
  const json* gone = find_device_process(g, ghost);
  ASSERT_NE(gone, nullptr) << g.dump(2);
  EXPECT_EQ((*gone)["used_bytes"], 2 * kGiB);
  EXPECT_FALSE((*gone)["visible"].get<bool>());
  const json* hidden = find_device_process(g, self == 1 ? 2 : 1);
  ASSERT_NE(hidden, nullptr) << g.dump(2);
  EXPECT_TRUE((*hidden)["used_bytes"].is_null()) << g.dump(2);

  const json* undeclared = find_finding(g, "UNDECLARED", self);
  ASSERT_NE(undeclared, nullptr) << g.dump(2);
  EXPECT_EQ((*undeclared)["used_bytes"], 3 * kGiB);
  const json* ghosted = find_finding(g, "GHOST", ghost);
  ASSERT_NE(ghosted, nullptr) << g.dump(2);
  EXPECT_EQ((*ghosted)["used_bytes"], 2 * kGiB);
  EXPECT_EQ(g["findings"].size(), 2u) << g.dump(2);  // an unknown figure is no finding
  EXPECT_NE(daemon_->log().find(std::string("(process list: ") + GetParam().entry_point + ")"),
            std::string::npos)
      << daemon_->log();
}

INSTANTIATE_TEST_SUITE_P(
    EntryPoints, NvmlVariantTest,
    ::testing::Values(Variant{"v3", FAKE_NVML_V3, "nvmlDeviceGetComputeRunningProcesses_v3"},
                      Variant{"v3cc", FAKE_NVML_V3CC, "nvmlDeviceGetComputeRunningProcesses_v3"},
                      Variant{"v2", FAKE_NVML_V2, "nvmlDeviceGetComputeRunningProcesses_v2"},
                      Variant{"v1", FAKE_NVML_V1, "nvmlDeviceGetComputeRunningProcesses"}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace steptrace::testing
