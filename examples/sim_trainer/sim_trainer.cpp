// sim_trainer: several training processes sharing (simulated) GPUs, traced by steptrace.
// Runs without a GPU.
//
// The parent forks the workers, --workers of them on each --gpu. Each worker names itself
// sim-worker-K, connects to steptraced, and coordinates VRAM through a shared ledger file
// (ledger_file.h) the way real trainers do: under the file lock it removes entries of
// dead processes on any GPU (LedgerCleanup), computes its GPU's free VRAM (VramQuery,
// reported as a VRAM sample), waits while it does not fit (WaitPoll), reserves
// (LedgerReserve); once every worker started with it holds its reservation (a barrier,
// like a distributed job's start), it trains --steps steps of a tiny CPU model
// (workload.h: Forward/Backward/Matmul/...), releases (LedgerRelease) and flushes.
// Workers start one at a time, in index order, so who reserves first is deterministic.
// They report progress to the parent over a pipe, one line per message.
//
// With --kill-one, worker 0 starts alone; once it holds its reservation (and the daemon
// has it), the parent SIGKILLs it. Its entry stays in the ledger file (and shows as
// LEAKED in the daemon's ledger view) until the next worker's LedgerCleanup removes it,
// which the daemon credits to that worker. --overcommit makes one worker reserve
// without waiting for room (a trainer ignoring the ledger), --anomalies makes one send
// annotations the daemon refuses and counts, and --late-workers start only once the
// others hold their reservations, so they wait for VRAM. --checkpoints lets an observer
// (scripts/run.sh) look at the daemon, or restart it, at fixed points.
//
// With --hang-one, the last worker (of the last GPU) reserves with a lease (--lease-ms,
// steptrace_ledger_reserve_lease) and renews it (steptrace_ledger_renew) every training
// step, and while it waits at the start barrier, as a real trainer's heartbeat would.
// Halfway through its steps it hangs without dying: it stops renewing and sleeps. The
// parent, a watchdog, polls steptraced's `ledger --json` until the daemon marks the lease
// EXPIRED (at its liveness tick, once the lease passed unrenewed), then as janitor cleans
// the expired entry up (credited to the parent) and SIGKILLs the hung worker; the others
// go on. It starts once the others hold their reservations (with the late workers, but it
// waits at the barrier), so its short lease never has to outlive a daemon restart at the
// `holding` checkpoint (a restored lease gets one more lease, but a library reconnects
// with a backoff of up to 1 s).
//
// At the end the parent, as a janitor connected to steptrace itself, cleans anything
// still left by dead processes and checks that nothing is held.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>
#include <steptrace/steptrace.hpp>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "ledger_file.h"
#include "workload.h"

namespace {

using Clock = std::chrono::steady_clock;
using steptrace::Span;
using steptrace::Step;

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUsage = 2;
// Worker exit codes, reported in the summary.
constexpr int kExitLedgerError = 3;
constexpr int kExitWaitTimeout = 4;
constexpr int kExitFlushFailed = 5;
constexpr int kExitNotKilled = 6;  // the --kill-one victim or the --hang-one worker
constexpr int kExitNoStart = 7;

constexpr std::uint64_t kGiB = 1024ULL * 1024 * 1024;
constexpr const char* kDefaultGpu = "GPU-00000000-sim0-0000-0000-000000000000";
constexpr int kDefaultWorkers = 3;
// Bound on the whole run, and so on how long a worker waits at the start barrier.
constexpr auto kRunBudget = std::chrono::seconds(120);
// --hang-one: how long, past its lease, the watchdog waits for steptraced to show the hung
// worker's lease EXPIRED (it takes at most one liveness interval; this is for a loaded host).
constexpr auto kExpiryWait = std::chrono::seconds(30);

// What one worker does, fixed by the command line before any process starts.
struct Role {
  int index = 0;
  int gpu = 0;              // index into Config::gpus
  bool victim = false;      // --kill-one: SIGKILLed while it holds its reservation
  bool late = false;        // --late-workers: started once the others hold their VRAM
  bool overcommit = false;  // --overcommit: reserves without waiting for room
  bool anomalies = false;   // --anomalies: also sends annotations the daemon refuses
  bool hangs = false;       // --hang-one: renews a lease every step, then hangs alive
};

struct Config {
  std::vector<std::string> gpus;  // empty: kDefaultGpu
  std::vector<int> workers;       // per GPU; empty: kDefaultWorkers on each
  int steps = 20;
  std::string ledger;
  std::uint64_t vram_total = 8 * kGiB;
  std::uint64_t reserve = 3 * kGiB;
  bool kill_one = false;
  bool overcommit = false;
  bool anomalies = false;
  int late_workers = 0;
  bool hang_one = false;
  int lease_ms = 1000;
  std::string checkpoints;  // empty: no checkpoints
  std::string socket;       // empty: $STEPTRACE_SOCKET, then the default
  int dim = 48;
  int poll_ms = 5;
  int max_wait_ms = 30000;
  int pause_after_kill_ms = 0;
  bool json = false;
  std::vector<Role> plan;  // one per worker, in index order
};

// ---------------------------------------------------------------------------------
// Worker side

// Sends one message line to the parent in a single write (atomic below PIPE_BUF).
void send_message(int fd, const std::string& line) {
  const std::string out = line + "\n";
  std::size_t done = 0;
  while (done < out.size()) {
    const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // the parent is gone; nothing useful left to tell
    done += static_cast<std::size_t>(n);
  }
}

std::string task_name(int index) { return "sim-train-" + std::to_string(index); }

// Removes entries of dead holders, on any GPU; each removal is announced to steptrace
// and the parent.
std::error_code clean_dead_entries(sim::LockedLedger& ledger, const std::string& who,
                                   int report_fd) {
  Span span(Step::kLedgerCleanup);
  auto& entries = ledger.contents().entries;
  bool changed = false;
  for (auto it = entries.begin(); it != entries.end();) {
    if (sim::pid_is_dead(it->pid)) {
      steptrace_ledger_cleanup(it->gpu.c_str(), it->id, static_cast<std::uint32_t>(it->pid));
      if (report_fd >= 0) {
        send_message(report_fd, "cleaned " + who + " " + std::to_string(it->id) + " " +
                                    std::to_string(it->pid));
      }
      it = entries.erase(it);
      changed = true;
    } else {
      ++it;
    }
  }
  return changed ? ledger.write() : std::error_code{};
}

// Waits until the reservation fits (or, for an over-committing worker, does not wait)
// and takes it; returns its id, or nullopt with an exit code.
std::optional<std::uint64_t> acquire(const Config& config, const Role& role, int report_fd,
                                     int& polls, int& exit_code) {
  const std::string who = std::to_string(role.index);
  const std::string& gpu = config.gpus[static_cast<std::size_t>(role.gpu)];
  const std::string task = task_name(role.index);
  const auto deadline = Clock::now() + std::chrono::milliseconds(config.max_wait_ms);
  bool told_waiting = false;
  for (;;) {
    sim::LockedLedger ledger;
    std::string error;
    std::error_code ec = ledger.lock(config.ledger, error);
    if (!ec) {
      ec = clean_dead_entries(ledger, who, report_fd);
      if (ec) error = "cannot rewrite ledger file " + config.ledger + ": " + ec.message();
    }
    if (ec) {
      send_message(report_fd, "error " + who + " " + error);
      exit_code = kExitLedgerError;
      return std::nullopt;
    }
    std::uint64_t free_bytes = 0;
    {
      Span span(Step::kVramQuery);
      const std::uint64_t reserved = ledger.contents().reserved_bytes(gpu);
      free_bytes = config.vram_total > reserved ? config.vram_total - reserved : 0;
      steptrace_vram_sample(gpu.c_str(), free_bytes, config.vram_total);
    }
    if (free_bytes >= config.reserve || role.overcommit) {
      Span span(Step::kLedgerReserve);
      auto& contents = ledger.contents();
      const std::uint64_t id = contents.next_id++;
      // --anomalies: two more ids handed out and never held, for the bad annotations.
      const std::uint64_t zero_id = role.anomalies ? contents.next_id++ : 0;
      const std::uint64_t unknown_id = role.anomalies ? contents.next_id++ : 0;
      contents.entries.push_back({id, ::getpid(), config.reserve, gpu, task});
      if (auto wec = ledger.write()) {
        send_message(report_fd, "error " + who + " cannot write ledger file " + config.ledger +
                                    ": " + wec.message());
        exit_code = kExitLedgerError;
        return std::nullopt;
      }
      if (role.hangs) {
        steptrace_ledger_reserve_lease(gpu.c_str(), id, config.reserve, task.c_str(),
                                       static_cast<std::uint32_t>(config.lease_ms));
      } else {
        steptrace_ledger_reserve(gpu.c_str(), id, config.reserve, task.c_str());
      }
      if (role.anomalies) {
        // Bugs of a careless trainer; the daemon refuses each and counts it in `stats`.
        steptrace_ledger_reserve(gpu.c_str(), id, config.reserve, task.c_str());  // duplicate
        steptrace_ledger_reserve(gpu.c_str(), zero_id, 0, task.c_str());          // 0 bytes
        steptrace_ledger_release(gpu.c_str(), unknown_id);  // an id nobody holds
      }
      return id;
    }
    ledger.unlock();
    if (!told_waiting) {
      send_message(report_fd, "waiting " + who);
      told_waiting = true;
    }
    if (Clock::now() >= deadline) {
      send_message(report_fd, "error " + who + " VRAM did not free up within " +
                                  std::to_string(config.max_wait_ms) + " ms");
      exit_code = kExitWaitTimeout;
      return std::nullopt;
    }
    Span span(Step::kWaitPoll);
    std::this_thread::sleep_for(std::chrono::milliseconds(config.poll_ms));
    ++polls;
  }
}

std::error_code release(const Config& config, const std::string& gpu, std::uint64_t id,
                        std::string& error) {
  sim::LockedLedger ledger;
  if (auto ec = ledger.lock(config.ledger, error)) return ec;
  Span span(Step::kLedgerRelease);
  auto& entries = ledger.contents().entries;
  const auto it = std::find_if(entries.begin(), entries.end(), [&](const sim::LedgerEntry& e) {
    return e.id == id && e.pid == ::getpid();
  });
  if (it == entries.end()) {
    error = "reservation " + std::to_string(id) + " vanished from the ledger file";
    return std::make_error_code(std::errc::no_such_file_or_directory);
  }
  entries.erase(it);
  if (auto ec = ledger.write()) {
    error = "cannot write ledger file " + config.ledger + ": " + ec.message();
    return ec;
  }
  steptrace_ledger_release(gpu.c_str(), id);
  return {};
}

// Blocks until the parent closes the start barrier's write end (EOF on `go_fd`), calling
// `heartbeat` (when set) every `heartbeat_ms` meanwhile.
bool wait_for_start(int go_fd, int heartbeat_ms = 0,
                    const std::function<void()>& heartbeat = nullptr) {
  const auto deadline = Clock::now() + kRunBudget;
  const auto beat = std::chrono::milliseconds(std::max(1, heartbeat_ms));
  auto next_beat = Clock::now() + beat;
  for (;;) {
    const auto now = Clock::now();
    if (heartbeat && now >= next_beat) {
      heartbeat();
      next_beat = now + beat;
    }
    long long wait = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - now).count();
    if (wait <= 0) return false;
    wait = std::min<long long>(wait, 1000);
    if (heartbeat) {
      wait = std::clamp<long long>(
          std::chrono::duration_cast<std::chrono::milliseconds>(next_beat - now).count(), 1, wait);
    }
    pollfd p{go_fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(wait));
    if (ready < 0 && errno != EINTR) return false;
    if (ready <= 0) continue;
    char byte;
    const ssize_t n = ::read(go_fd, &byte, 1);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR && errno != EAGAIN) return false;
  }
}

// `go_fd` < 0: no barrier, train at once.
int run_worker(const Config& config, const Role& role, int report_fd, int go_fd) {
  const std::string name = "sim-worker-" + std::to_string(role.index);
  ::prctl(PR_SET_NAME, name.c_str(), 0, 0, 0);
  const std::string who = std::to_string(role.index);
  const std::string& gpu = config.gpus[static_cast<std::size_t>(role.gpu)];
  if (const int rc = steptrace_connect(config.socket.empty() ? nullptr : config.socket.c_str());
      rc != 0) {
    std::fprintf(stderr, "%s: steptraced not reachable yet (%s); events are kept until it is\n",
                 name.c_str(), std::strerror(-rc));
  }
  sim::Workload model(static_cast<std::size_t>(config.dim), static_cast<unsigned>(role.index) + 1);

  int polls = 0;
  int exit_code = kExitOk;
  const auto id = acquire(config, role, report_fd, polls, exit_code);
  if (!id) return exit_code;

  // The daemon must know the reservation before the victim dies, or it could not show
  // the leak; and an observer at a checkpoint must see everything done so far.
  const bool flush = role.victim || (!config.checkpoints.empty() && go_fd >= 0);
  const int flushed = flush ? steptrace_flush(2000) : 0;
  send_message(report_fd, "reserved " + who + " " + std::to_string(*id) + " " +
                              std::to_string(polls) + " " + std::to_string(flushed));
  if (role.victim) {
    // Train until the parent kills us (bounded, in case it never does).
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < give_up) model.step();
    send_message(report_fd, "error " + who + " was never killed");
    return kExitNotKilled;
  }
  // --hang-one: the lease's heartbeat. A renewal every step while training, and four a
  // lease while idle at the barrier, so a healthy worker's lease never passes.
  const auto lease = static_cast<std::uint32_t>(config.lease_ms);
  int renewals = 0;
  const auto renew = [&] {
    steptrace_ledger_renew(gpu.c_str(), *id, lease);
    ++renewals;
  };
  // Holding the reservation, idle (no span open), until every worker started with us
  // holds its own.
  if (go_fd >= 0 &&
      !wait_for_start(go_fd, config.lease_ms / 4, role.hangs ? renew : std::function<void()>())) {
    send_message(report_fd, "error " + who + " was never told to start training");
    return kExitNoStart;
  }
  if (role.hangs) {
    const int healthy = std::max(1, config.steps / 2);
    for (int s = 0; s < healthy; ++s) {
      model.step();
      renew();
    }
    // Everything sent so far is applied (so the lease runs from the last renewal, and the
    // daemon knows the spans); from here on nothing: no renewal, no release, no exit. The
    // library's own thread stays connected, as in a trainer stuck in a collective.
    const int flushed = steptrace_flush(2000);
    send_message(report_fd, "hung " + who + " " + std::to_string(healthy) + " " +
                                std::to_string(renewals) + " " + std::to_string(flushed));
    const auto give_up = Clock::now() + kRunBudget;
    while (Clock::now() < give_up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    send_message(report_fd, "error " + who + " hung but was never killed");
    return kExitNotKilled;
  }
  for (int s = 0; s < config.steps; ++s) model.step();

  std::string error;
  if (release(config, gpu, *id, error)) {
    send_message(report_fd, "error " + who + " " + error);
    return kExitLedgerError;
  }
  const int final_flush = steptrace_flush(2000);
  char checksum[64];
  std::snprintf(checksum, sizeof checksum, "%.6g", model.checksum());
  send_message(report_fd, "done " + who + " " + std::to_string(config.steps) + " " +
                              std::to_string(final_flush) + " " + checksum);
  return final_flush == 0 ? kExitOk : kExitFlushFailed;
}

// ---------------------------------------------------------------------------------
// Parent side

struct WorkerRecord {
  Role role;
  pid_t pid = -1;
  std::optional<int> status;  // exit status, 128+signal when killed
  std::optional<std::uint64_t> reservation;
  bool waited = false;  // had to wait for VRAM
  int polls = 0;
  int steps = 0;
  int flush_rc = 0;
  std::string checksum;
  bool hung = false;     // --hang-one: it said it hangs (after `steps` steps)
  int renewals = 0;      // lease renewals it sent before hanging
  bool expired = false;  // the watchdog saw steptraced show its lease EXPIRED
  std::vector<std::pair<std::uint64_t, pid_t>> cleaned;  // (reservation id, dead holder)
  std::vector<std::string> errors;
};

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

class Parent {
 public:
  explicit Parent(Config config) : config_(std::move(config)) {}

  int run();

 private:
  bool spawn(const Role& role);
  // Spawns a worker and waits until it holds VRAM, waits for it, or exits.
  bool start(const Role& role, Clock::time_point deadline, std::vector<std::string>& problems);
  // With --checkpoints: creates DIR/NAME.reached, then waits for DIR/NAME.go.
  bool checkpoint(const std::string& name, Clock::time_point deadline,
                  std::vector<std::string>& problems);
  // Reads worker messages and reaps workers until `done()` or the deadline; false on timeout.
  template <typename Done>
  bool pump(Clock::time_point deadline, Done done);
  void handle_line(const std::string& line);
  void reap(bool block);
  WorkerRecord* by_index(int index);
  bool janitor(std::vector<std::pair<std::uint64_t, pid_t>>& cleaned, std::string& error);
  // --hang-one, once the barrier is open: waits for the worker to hang and steptraced to
  // mark its lease EXPIRED, then cleans its entry up and SIGKILLs it (whatever happened).
  bool watchdog(WorkerRecord& hung, Clock::time_point deadline, std::vector<std::string>& problems);
  // Whether steptraced's `ledger --json` shows `gpu`'s reservation `id` EXPIRED.
  bool daemon_shows_expired(const std::string& gpu, std::uint64_t id) const;
  void kill_all();
  void print_summary(bool ok, const std::vector<std::pair<std::uint64_t, pid_t>>& janitor_cleaned,
                     const std::vector<std::string>& problems) const;

  Config config_;
  std::vector<WorkerRecord> workers_;
  int read_fd_ = -1;
  int write_fd_ = -1;
  int go_read_ = -1;   // start barrier: workers block on it until EOF
  int go_write_ = -1;  // closed by the parent to let them train
  bool eof_ = false;
  std::string pending_;
  // --hang-one: (reservation id, hung holder) the janitor cleaned up once EXPIRED.
  std::vector<std::pair<std::uint64_t, pid_t>> expired_cleaned_;
};

bool Parent::spawn(const Role& role) {
  std::fflush(nullptr);  // a child must not inherit (and later flush) our buffered output
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    std::perror("sim_trainer: fork");
    return false;
  }
  if (pid == 0) {
    // A worker must not outlive the parent (e.g. a SIGKILLed sim_trainer).
    ::prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    if (::getppid() != parent) std::_Exit(kExitFailed);  // it died before the prctl
    ::close(read_fd_);
    if (go_write_ >= 0) ::close(go_write_);  // else the barrier could never see EOF
    // Late workers start after the barrier opened: they do not wait at it.
    const int go_fd = role.late ? -1 : go_read_;
    const int code = run_worker(config_, role, write_fd_, go_fd);
    steptrace_shutdown();
    std::fflush(nullptr);
    std::_Exit(code);
  }
  WorkerRecord record;
  record.role = role;
  record.pid = pid;
  workers_.push_back(std::move(record));
  return true;
}

bool Parent::start(const Role& role, Clock::time_point deadline,
                   std::vector<std::string>& problems) {
  if (!spawn(role)) {
    problems.push_back("cannot fork worker " + std::to_string(role.index));
    return false;
  }
  const bool settled = pump(deadline, [&] {
    const WorkerRecord* w = by_index(role.index);
    return w->reservation.has_value() || w->waited || w->status.has_value();
  });
  if (!settled) {
    problems.push_back("worker " + std::to_string(role.index) +
                       " neither reserved VRAM nor waited for it in time");
  }
  return settled;
}

bool Parent::checkpoint(const std::string& name, Clock::time_point deadline,
                        std::vector<std::string>& problems) {
  if (config_.checkpoints.empty()) return true;
  const std::string reached = config_.checkpoints + "/" + name + ".reached";
  const std::string go = config_.checkpoints + "/" + name + ".go";
  const int fd = ::open(reached.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    problems.push_back("cannot create " + reached + ": " + std::strerror(errno));
    return false;
  }
  ::close(fd);
  const auto until =
      std::min(deadline, Clock::now() + std::chrono::milliseconds(config_.max_wait_ms));
  if (!pump(until, [&] { return ::access(go.c_str(), F_OK) == 0; })) {
    problems.push_back("checkpoint " + name + ": " + go + " did not appear within " +
                       std::to_string(config_.max_wait_ms) + " ms");
    return false;
  }
  return true;
}

WorkerRecord* Parent::by_index(int index) {
  for (auto& w : workers_) {
    if (w.role.index == index) return &w;
  }
  return nullptr;
}

void Parent::handle_line(const std::string& line) {
  std::istringstream in(line);
  std::string kind;
  int index = -1;
  in >> kind >> index;
  WorkerRecord* w = by_index(index);
  if (w == nullptr) {
    std::fprintf(stderr, "sim_trainer: unexpected message from a worker: %s\n", line.c_str());
    return;
  }
  if (kind == "reserved") {
    std::uint64_t id = 0;
    int flushed = 0;
    in >> id >> w->polls >> flushed;
    w->reservation = id;
    if (flushed != 0) {
      w->errors.push_back("steptrace_flush after reserving failed (" +
                          std::string(std::strerror(-flushed)) +
                          "): the daemon may not know the reservation");
    }
  } else if (kind == "waiting") {
    w->waited = true;
  } else if (kind == "cleaned") {
    std::uint64_t id = 0;
    pid_t holder = 0;
    in >> id >> holder;
    w->cleaned.emplace_back(id, holder);
  } else if (kind == "done") {
    in >> w->steps >> w->flush_rc >> w->checksum;
  } else if (kind == "hung") {
    int flushed = 0;
    in >> w->steps >> w->renewals >> flushed;
    w->hung = true;
    if (flushed != 0) {
      w->errors.push_back("steptrace_flush before hanging failed (" +
                          std::string(std::strerror(-flushed)) + ")");
    }
  } else if (kind == "error") {
    std::string rest;
    std::getline(in, rest);
    w->errors.push_back(rest.empty() ? rest : rest.substr(1));
  } else {
    std::fprintf(stderr, "sim_trainer: unexpected message from a worker: %s\n", line.c_str());
  }
}

void Parent::reap(bool block) {
  for (auto& w : workers_) {
    if (w.status) continue;
    int status = 0;
    const pid_t r = ::waitpid(w.pid, &status, block ? 0 : WNOHANG);
    if (r == w.pid) w.status = decode_status(status);
  }
}

template <typename Done>
bool Parent::pump(Clock::time_point deadline, Done done) {
  char buf[4096];
  while (!done()) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    if (eof_) {
      reap(false);
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      continue;
    }
    pollfd p{read_fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 10)));
    if (ready > 0) {
      const ssize_t n = ::read(read_fd_, buf, sizeof buf);
      if (n == 0) eof_ = true;
      if (n > 0) {
        pending_.append(buf, static_cast<std::size_t>(n));
        for (std::size_t nl; (nl = pending_.find('\n')) != std::string::npos;) {
          handle_line(pending_.substr(0, nl));
          pending_.erase(0, nl + 1);
        }
      }
    }
    reap(false);
  }
  return true;
}

void Parent::kill_all() {
  for (auto& w : workers_) {
    if (!w.status) ::kill(w.pid, SIGKILL);
  }
  reap(true);
}

bool Parent::janitor(std::vector<std::pair<std::uint64_t, pid_t>>& cleaned, std::string& error) {
  sim::LockedLedger ledger;
  if (ledger.lock(config_.ledger, error)) return false;
  Span span(Step::kLedgerCleanup);
  auto& entries = ledger.contents().entries;
  const auto before = entries.size();
  for (auto it = entries.begin(); it != entries.end();) {
    if (sim::pid_is_dead(it->pid)) {
      steptrace_ledger_cleanup(it->gpu.c_str(), it->id, static_cast<std::uint32_t>(it->pid));
      cleaned.emplace_back(it->id, it->pid);
      it = entries.erase(it);
    } else {
      ++it;
    }
  }
  if (entries.size() != before) {
    if (auto ec = ledger.write()) {
      error = "cannot write ledger file " + config_.ledger + ": " + ec.message();
      return false;
    }
  }
  for (const auto& e : entries) {
    for (const auto& w : workers_) {
      if (e.pid == w.pid) {
        error = "reservation " + std::to_string(e.id) + " of worker " +
                std::to_string(w.role.index) + " is still held in " + config_.ledger;
        return false;
      }
    }
  }
  return true;
}

// steptraced's socket, found as the library finds it: --socket, else $STEPTRACE_SOCKET,
// else the default.
std::string socket_path(const Config& config) {
  if (!config.socket.empty()) return config.socket;
  if (const char* env = std::getenv("STEPTRACE_SOCKET"); env != nullptr && env[0] != '\0') {
    return env;
  }
  return STEPTRACE_DEFAULT_SOCKET;
}

// One text command (proto/PROTOCOL.md), as `steptrace` sends it: connect, send the line,
// shut down the writing side, read the reply until the daemon closes. nullopt when the
// daemon cannot be reached or does not answer within `timeout`.
std::optional<std::string> daemon_command(const std::string& path, const std::string& line,
                                          std::chrono::milliseconds timeout) {
  struct Fd {
    int fd;
    ~Fd() {
      if (fd >= 0) ::close(fd);
    }
  } sock{::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (sock.fd < 0 || path.size() >= sizeof addr.sun_path) return std::nullopt;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  if (::connect(sock.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) return std::nullopt;
  const std::string out = line + "\n";
  for (std::size_t sent = 0; sent < out.size();) {
    const ssize_t n = ::send(sock.fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return std::nullopt;
    sent += static_cast<std::size_t>(n);
  }
  ::shutdown(sock.fd, SHUT_WR);
  std::string reply;
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return std::nullopt;
    pollfd p{sock.fd, POLLIN, 0};
    const int ready = ::poll(&p, 1, static_cast<int>(left));
    if (ready < 0 && errno != EINTR) return std::nullopt;
    if (ready <= 0) continue;
    char buf[16384];
    const ssize_t n = ::recv(sock.fd, buf, sizeof buf, 0);
    if (n == 0) return reply;
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    reply.append(buf, static_cast<std::size_t>(n));
  }
}

bool Parent::daemon_shows_expired(const std::string& gpu, std::uint64_t id) const {
  const auto reply =
      daemon_command(socket_path(config_), "ledger --json", std::chrono::milliseconds(5000));
  if (!reply) return false;
  const auto view = nlohmann::json::parse(*reply, nullptr, false);
  if (view.is_discarded() || !view.contains("gpus") || !view["gpus"].is_array()) return false;
  for (const auto& g : view["gpus"]) {
    if (g.value("gpu", "") != gpu || !g.contains("reservations")) continue;
    for (const auto& r : g["reservations"]) {
      if (r.value("id", std::uint64_t{0}) == id) return r.value("state", "") == "EXPIRED";
    }
  }
  return false;
}

bool Parent::watchdog(WorkerRecord& hung, Clock::time_point deadline,
                      std::vector<std::string>& problems) {
  const std::string who = "worker " + std::to_string(hung.role.index);
  const std::string& gpu = config_.gpus[static_cast<std::size_t>(hung.role.gpu)];
  bool ok = pump(deadline, [&] { return hung.hung || hung.status.has_value(); }) && hung.hung &&
            hung.reservation.has_value();
  if (!ok) {
    problems.push_back(who + " never hung holding its reservation (" +
                       (hung.status ? "it exited with status " + std::to_string(*hung.status)
                                    : std::string("it was still running")) +
                       ")");
  }
  bool connected = false;
  if (ok) {
    // The janitor connects now that every worker is forked.
    if (const int rc = steptrace_connect(config_.socket.empty() ? nullptr : config_.socket.c_str());
        rc != 0) {
      problems.push_back(std::string("the watchdog cannot reach steptraced: ") +
                         std::strerror(-rc));
      ok = false;
    } else {
      connected = true;
    }
  }
  if (ok) {
    // The watchdog acts on what steptraced says, as one reading `steptrace ledger --json`:
    // the lease passed unrenewed, and the daemon marks it EXPIRED at its liveness tick.
    const auto wait = std::chrono::milliseconds(config_.lease_ms) + kExpiryWait;
    auto next_query = Clock::now();
    ok = pump(std::min(deadline, Clock::now() + wait), [&] {
      if (Clock::now() < next_query) return false;
      next_query = Clock::now() + std::chrono::milliseconds(50);
      return daemon_shows_expired(gpu, *hung.reservation);
    });
    hung.expired = ok;
    if (!ok) {
      problems.push_back("steptraced did not show " + who + "'s lease EXPIRED within " +
                         std::to_string(wait.count()) + " ms of it hanging");
    }
  }
  if (ok) ok = checkpoint("expired", deadline, problems);
  // Whatever happened above, the janitor removes the hung worker's entry (the file, then
  // steptraced: anyone may clean up an EXPIRED lease) and the watchdog SIGKILLs it, so
  // the run can end.
  if (hung.reservation) {
    sim::LockedLedger ledger;
    std::string error;
    if (ledger.lock(config_.ledger, error)) {
      problems.push_back(error);
      ok = false;
    } else {
      Span span(Step::kLedgerCleanup);
      auto& entries = ledger.contents().entries;
      const auto it = std::find_if(entries.begin(), entries.end(), [&](const sim::LedgerEntry& e) {
        return e.id == *hung.reservation && e.pid == hung.pid;
      });
      if (it == entries.end()) {
        problems.push_back(who + "'s reservation " + std::to_string(*hung.reservation) +
                           " vanished from the ledger file");
        ok = false;
      } else {
        entries.erase(it);
        if (auto ec = ledger.write()) {
          problems.push_back("cannot write ledger file " + config_.ledger + ": " + ec.message());
          ok = false;
        }
        steptrace_ledger_cleanup(gpu.c_str(), *hung.reservation,
                                 static_cast<std::uint32_t>(hung.pid));
        expired_cleaned_.emplace_back(*hung.reservation, hung.pid);
      }
    }
  }
  // Applied while the holder still lives: the cleanup of a live holder's EXPIRED lease.
  if (connected) {
    if (const int rc = steptrace_flush(2000); rc != 0) {
      problems.push_back(std::string("janitor's steptrace_flush failed: ") + std::strerror(-rc));
      ok = false;
    }
  }
  if (!hung.status) {
    ::kill(hung.pid, SIGKILL);
    int status = 0;
    if (::waitpid(hung.pid, &status, 0) == hung.pid) hung.status = decode_status(status);
  }
  return ok;
}

std::string bytes_text(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiB);
  return buf;
}

int Parent::run() {
  int fds[2];
  int go[2];
  if (::pipe(fds) != 0 || ::pipe(go) != 0) {
    std::perror("sim_trainer: pipe");
    return kExitFailed;
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  go_read_ = go[0];
  go_write_ = go[1];
  const auto deadline = Clock::now() + kRunBudget;
  bool ok = true;
  std::vector<std::string> problems;

  // 1. --kill-one: worker 0 alone, SIGKILLed once it holds its reservation.
  for (const Role& role : config_.plan) {
    if (!role.victim) continue;
    if (!spawn(role)) {
      problems.push_back("cannot fork worker " + std::to_string(role.index));
      ok = false;
      break;
    }
    const bool reserved = pump(deadline, [&] {
      const WorkerRecord* w = by_index(role.index);
      return w->reservation.has_value() || w->status.has_value();
    });
    WorkerRecord& victim = *by_index(role.index);
    if (!reserved || !victim.reservation) {
      problems.push_back("worker " + std::to_string(role.index) +
                         " never reserved VRAM, so it could not be killed holding it");
      ok = false;
      break;
    }
    ::kill(victim.pid, SIGKILL);
    reap(true);  // reaped now, so the others see its pid gone (kill(pid, 0) == ESRCH)
    if (config_.pause_after_kill_ms > 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(config_.pause_after_kill_ms));
    }
    ok = checkpoint("killed", deadline, problems);
  }
  // 2. The others, one at a time; they hold their reservations at the start barrier.
  for (const Role& role : config_.plan) {
    if (!ok) break;
    if (!role.victim && !role.late && !role.hangs) ok = start(role, deadline, problems);
  }
  if (ok) ok = checkpoint("holding", deadline, problems);
  // 3. Late workers: the others still hold their VRAM, so these (usually) wait for it.
  // The --hang-one worker starts here too (after a restart at `holding`), but waits at
  // the barrier, renewing its lease.
  bool any_late = false;
  for (const Role& role : config_.plan) {
    if (!ok) break;
    if (role.late || role.hangs) {
      any_late = any_late || role.late;
      ok = start(role, deadline, problems);
    }
  }
  if (ok && any_late) ok = checkpoint("waiting", deadline, problems);
  // 4. Open the barrier: the holders train, release, and the late workers get their turn.
  // After a failure they are killed first, idle at the barrier rather than halfway through
  // rewriting the ledger file.
  if (!ok) kill_all();
  ::close(go_write_);
  go_write_ = -1;
  ::close(go_read_);
  go_read_ = -1;
  ::close(write_fd_);
  write_fd_ = -1;
  // --hang-one: the watchdog and janitor deal with the worker that hangs; the others go on.
  for (auto& w : workers_) {
    if (ok && w.role.hangs) ok = watchdog(w, deadline, problems);
  }
  const bool finished = pump(deadline, [&] {
    if (!eof_) return false;
    for (const auto& w : workers_) {
      if (!w.status) return false;
    }
    return true;
  });
  if (!finished) {
    problems.push_back("workers did not finish within 120 s; killed them");
    kill_all();
    ok = false;
  }
  ::close(read_fd_);

  // Janitor: this process, traced too, cleans what dead workers left and checks the rest.
  if (const int rc = steptrace_connect(config_.socket.empty() ? nullptr : config_.socket.c_str());
      rc != 0) {
    problems.push_back(std::string("janitor cannot reach steptraced: ") + std::strerror(-rc));
    ok = false;
  }
  std::vector<std::pair<std::uint64_t, pid_t>> janitor_cleaned;
  std::string janitor_error;
  if (!janitor(janitor_cleaned, janitor_error)) {
    problems.push_back(janitor_error);
    ok = false;
  }
  if (const int rc = steptrace_flush(2000); rc != 0) {
    problems.push_back(std::string("janitor's steptrace_flush failed: ") + std::strerror(-rc));
    ok = false;
  }
  steptrace_shutdown();

  for (const auto& w : workers_) {
    const int expected = w.role.victim || w.role.hangs ? 128 + SIGKILL : kExitOk;
    if (w.status != expected) {
      problems.push_back("worker " + std::to_string(w.role.index) + " (pid " +
                         std::to_string(w.pid) + ") exited with status " +
                         std::to_string(w.status.value_or(-1)) + ", expected " +
                         std::to_string(expected));
      ok = false;
    }
    for (const auto& e : w.errors) {
      problems.push_back("worker " + std::to_string(w.role.index) + ": " + e);
      ok = false;
    }
  }
  // Workers were started out of index order (late ones last): list them in order.
  std::sort(workers_.begin(), workers_.end(), [](const WorkerRecord& a, const WorkerRecord& b) {
    return a.role.index < b.role.index;
  });
  print_summary(ok, janitor_cleaned, problems);
  return ok ? kExitOk : kExitFailed;
}

void Parent::print_summary(bool ok,
                           const std::vector<std::pair<std::uint64_t, pid_t>>& janitor_cleaned,
                           const std::vector<std::string>& problems) const {
  if (config_.json) {
    nlohmann::json out;
    out["ok"] = ok;
    out["janitor_pid"] = ::getpid();
    out["steps"] = config_.steps;
    out["gpu"] = config_.gpus.front();
    out["gpus"] = config_.gpus;
    auto& list = out["workers"] = nlohmann::json::array();
    for (const auto& w : workers_) {
      nlohmann::json cleaned = nlohmann::json::array();
      for (const auto& [id, holder] : w.cleaned)
        cleaned.push_back({{"id", id}, {"holder_pid", holder}});
      list.push_back(
          {{"index", w.role.index},
           {"pid", w.pid},
           {"gpu", config_.gpus[static_cast<std::size_t>(w.role.gpu)]},
           {"killed", w.role.victim},
           {"late", w.role.late},
           {"overcommit", w.role.overcommit},
           {"anomalies", w.role.anomalies},
           {"hung", w.role.hangs},
           {"lease_ms", w.role.hangs ? nlohmann::json(config_.lease_ms) : nlohmann::json()},
           {"renewals", w.renewals},
           {"expired_seen", w.expired},
           {"status", w.status.value_or(-1)},
           {"reservation", w.reservation ? nlohmann::json(*w.reservation) : nlohmann::json()},
           {"wait_polls", w.polls},
           {"steps", w.steps},
           {"cleaned", std::move(cleaned)}});
    }
    nlohmann::json cleaned = nlohmann::json::array();
    for (const auto& [id, holder] : janitor_cleaned)
      cleaned.push_back({{"id", id}, {"holder_pid", holder}});
    out["janitor_cleaned"] = std::move(cleaned);
    nlohmann::json expired = nlohmann::json::array();
    for (const auto& [id, holder] : expired_cleaned_)
      expired.push_back({{"id", id}, {"holder_pid", holder}});
    out["janitor_cleaned_expired"] = std::move(expired);
    out["problems"] = problems;
    std::printf("%s\n", out.dump().c_str());
    std::fflush(stdout);
    return;
  }
  std::printf("sim_trainer: %zu workers x %d steps, %s per GPU, %s per reservation, ledger %s\n",
              config_.plan.size(), config_.steps, bytes_text(config_.vram_total).c_str(),
              bytes_text(config_.reserve).c_str(), config_.ledger.c_str());
  for (std::size_t g = 0; g < config_.gpus.size(); ++g) {
    std::printf("  gpu %zu %s: worker%s", g, config_.gpus[g].c_str(),
                config_.workers[g] == 1 ? "" : "s");
    for (const Role& role : config_.plan) {
      if (role.gpu == static_cast<int>(g)) std::printf(" %d", role.index);
    }
    std::printf("\n");
  }
  for (const auto& w : workers_) {
    std::printf("  worker %d pid %d on gpu %d: ", w.role.index, static_cast<int>(w.pid),
                w.role.gpu);
    const std::string reservation = w.reservation ? std::to_string(*w.reservation) : "(none)";
    if (w.role.victim) {
      std::printf("SIGKILLed while holding reservation %s", reservation.c_str());
    } else if (w.role.hangs) {
      std::printf(
          "%d steps with reservation %s under a %d ms lease, renewed %d times, then hung "
          "without dying; SIGKILLed by the watchdog%s",
          w.steps, reservation.c_str(), config_.lease_ms, w.renewals,
          w.expired ? " once its lease was EXPIRED" : "");
    } else {
      std::printf("%s%d steps, reservation %s", w.role.late ? "started late, " : "", w.steps,
                  reservation.c_str());
      if (w.role.overcommit) {
        std::printf(" taken without waiting for room");
      } else {
        std::printf(", waited %d polls for VRAM", w.polls);
      }
      if (w.role.anomalies) {
        std::printf(", sent 3 bad annotations (duplicate id, 0 bytes, unknown release)");
      }
    }
    for (const auto& [id, holder] : w.cleaned) {
      std::printf(", cleaned up reservation %" PRIu64 " of dead pid %d", id,
                  static_cast<int>(holder));
    }
    std::printf("\n");
  }
  std::printf("  janitor pid %d: ", static_cast<int>(::getpid()));
  for (const auto& [id, holder_pid] : expired_cleaned_) {
    const auto holder = holder_pid;  // a lambda may not capture a structured binding (C++17)
    const bool seen = std::any_of(workers_.begin(), workers_.end(), [&](const WorkerRecord& w) {
      return w.pid == holder && w.expired;
    });
    std::printf("cleaned up the %sreservation %" PRIu64 " of hung pid %d; ", seen ? "EXPIRED " : "",
                id, static_cast<int>(holder));
  }
  if (janitor_cleaned.empty()) {
    std::printf("%s",
                expired_cleaned_.empty() ? "nothing left to clean" : "nothing else left to clean");
  }
  for (const auto& [id, holder] : janitor_cleaned) {
    std::printf("cleaned up reservation %" PRIu64 " of dead pid %d; ", id,
                static_cast<int>(holder));
  }
  std::printf("\n");
  for (const auto& p : problems) std::printf("  problem: %s\n", p.c_str());
  std::printf("sim_trainer: %s\n", ok ? "ok, every reservation released or cleaned up" : "FAILED");
  std::fflush(stdout);
}

bool valid_gpu(const std::string& gpu) {
  return !gpu.empty() && gpu.size() <= 63 &&
         std::all_of(gpu.begin(), gpu.end(), [](char c) { return c > ' ' && c < 0x7f; });
}

// Fills config.gpus/workers defaults and config.plan; false with a message on a bad
// combination of options.
bool make_plan(Config& config, std::string& error) {
  if (config.gpus.empty()) config.gpus.push_back(kDefaultGpu);
  if (config.workers.empty()) config.workers.push_back(kDefaultWorkers);
  if (config.workers.size() == 1) config.workers.resize(config.gpus.size(), config.workers[0]);
  if (config.workers.size() != config.gpus.size()) {
    error = "give one --workers for every --gpu (or a single one for all)";
    return false;
  }
  for (const auto& gpu : config.gpus) {
    if (!valid_gpu(gpu)) {
      error = "--gpu must be 1..63 printable characters without spaces";
      return false;
    }
    if (std::count(config.gpus.begin(), config.gpus.end(), gpu) > 1) {
      error = "--gpu " + gpu + " is given twice";
      return false;
    }
  }
  int total = 0;
  for (const int n : config.workers) total += n;
  if (total > 64) {
    error = "at most 64 workers in all";
    return false;
  }
  if (config.kill_one && total < 2) {
    error = "--kill-one needs 2 workers or more";
    return false;
  }
  // Roles on the first GPU: [victim] [anomalies ... overcommit] [late ...]; with
  // --hang-one, the last worker of the last GPU hangs.
  const int first = config.workers[0];
  const int victims = config.kill_one ? 1 : 0;
  const int initial = first - victims - config.late_workers;
  if (initial < 0) {
    error = "--late-workers " + std::to_string(config.late_workers) +
            " leaves no room on the first GPU's " + std::to_string(first) + " workers";
    return false;
  }
  if ((config.overcommit || config.anomalies) && initial < 1) {
    error =
        "--overcommit and --anomalies need a worker on the first GPU that is neither killed "
        "nor late";
    return false;
  }
  int index = 0;
  for (std::size_t g = 0; g < config.gpus.size(); ++g) {
    for (int k = 0; k < config.workers[g]; ++k) {
      Role role;
      role.index = index++;
      role.gpu = static_cast<int>(g);
      if (g == 0) {
        role.victim = k < victims;
        role.late = k >= first - config.late_workers;
        role.anomalies = config.anomalies && k == victims;
        role.overcommit = config.overcommit && k == victims + initial - 1;
      }
      config.plan.push_back(role);
    }
  }
  if (config.hang_one) {
    Role& last = config.plan.back();
    if (last.victim || last.late || last.anomalies || last.overcommit) {
      error =
          "--hang-one needs the last worker of the last GPU free of other roles (killed, late, "
          "over-committing, anomalies): add a worker to the last --workers";
      return false;
    }
    last.hangs = true;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  CLI::App app{
      "sim_trainer: several training processes sharing simulated GPUs through a VRAM ledger "
      "file, traced by steptrace (no GPU needed)",
      "sim_trainer"};
  app.add_option(
         "--gpu", config.gpus,
         "GPU UUID to report; repeat for several GPUs (default: " + std::string(kDefaultGpu) + ")")
      ->expected(1)
      ->take_all();
  app.add_option("--workers", config.workers,
                 "Worker processes on each --gpu, in order; one value applies to every GPU "
                 "(default: " +
                     std::to_string(kDefaultWorkers) + ")")
      ->expected(1)
      ->take_all()
      ->check(CLI::Range(1, 64));
  app.add_option("--steps", config.steps, "Training steps per worker")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000000));
  app.add_option("--ledger", config.ledger, "Shared ledger file (created if missing)")->required();
  app.add_option("--vram-total", config.vram_total, "Simulated VRAM of each GPU, bytes")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 50));
  app.add_option("--reserve", config.reserve, "Bytes each worker reserves")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 50));
  app.add_flag("--kill-one", config.kill_one,
               "SIGKILL worker 0 (first GPU) while it holds its reservation; the next worker "
               "cleans it up");
  app.add_flag("--overcommit", config.overcommit,
               "The last first-GPU worker that is neither killed nor late reserves without "
               "waiting for room, so the GPU can end up over-committed");
  app.add_flag("--anomalies", config.anomalies,
               "The first first-GPU worker that is neither killed nor late also sends three "
               "annotations the daemon refuses and counts: its reservation id again, a 0-byte "
               "reserve, a release of an id nobody holds");
  app.add_option("--late-workers", config.late_workers,
                 "The last N workers of the first GPU start only once the others hold their "
                 "reservations (so they wait for VRAM), and skip the start barrier")
      ->capture_default_str()
      ->check(CLI::Range(0, 64));
  app.add_flag("--hang-one", config.hang_one,
               "The last worker of the last GPU reserves with a lease (--lease-ms) and renews it "
               "every step (and while it waits to train), then halfway through its steps hangs "
               "without dying: it stops renewing and sleeps. It starts once the others hold their "
               "reservations. The parent, a watchdog, waits until steptraced's `ledger --json` "
               "shows the lease EXPIRED, cleans the entry up (credited to it) and SIGKILLs the "
               "hung worker; the others go on");
  app.add_option("--lease-ms", config.lease_ms,
                 "With --hang-one: the hanging worker's lease, renewed every step (a step must "
                 "take less)")
      ->capture_default_str()
      ->check(CLI::Range(1, 604800000));
  app.add_option(
      "--checkpoints", config.checkpoints,
      "Directory for an observer such as scripts/run.sh: at each checkpoint create "
      "DIR/NAME.reached, then wait (up to --max-wait-ms) for DIR/NAME.go. NAME: killed "
      "(with --kill-one, after the kill, before the others start), holding (every "
      "other worker holds its VRAM or waits for it, all flushed to steptraced, none "
      "trains yet), waiting (with --late-workers, once they have started), expired (with "
      "--hang-one, once steptraced shows the hung worker's lease EXPIRED, before the "
      "janitor cleans it up and the watchdog kills it)");
  app.add_option("--socket", config.socket, "steptraced's socket (default: $STEPTRACE_SOCKET)");
  app.add_option("--dim", config.dim, "Model width (work per step grows as dim^3)")
      ->capture_default_str()
      ->check(CLI::Range(4, 1024));
  app.add_option("--poll-ms", config.poll_ms, "Sleep between VRAM polls")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  app.add_option("--max-wait-ms", config.max_wait_ms,
                 "Give up waiting for VRAM, or for a checkpoint's .go file, after this")
      ->capture_default_str()
      ->check(CLI::Range(1, 600000));
  app.add_option("--pause-after-kill-ms", config.pause_after_kill_ms,
                 "With --kill-one: wait this long after the kill before starting the others "
                 "(the leak stays visible in `steptrace ledger` meanwhile)")
      ->capture_default_str()
      ->check(CLI::Range(0, 600000));
  app.add_flag("--json", config.json, "Print the summary as one JSON object");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  if (config.reserve > config.vram_total) {
    std::fprintf(stderr,
                 "sim_trainer: --reserve (%" PRIu64 ") exceeds --vram-total (%" PRIu64
                 "); no worker could ever fit\n",
                 config.reserve, config.vram_total);
    return kExitUsage;
  }
  std::string error;
  if (!make_plan(config, error)) {
    std::fprintf(stderr, "sim_trainer: %s\n", error.c_str());
    return kExitUsage;
  }
  return Parent(std::move(config)).run();
}
