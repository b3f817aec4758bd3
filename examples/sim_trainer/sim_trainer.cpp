// sim_trainer: several training processes sharing one (simulated) GPU, traced by
// steptrace. Runs without a GPU.
//
// The parent forks --workers processes. Each worker names itself sim-worker-K, connects
// to steptraced, and coordinates VRAM through a shared ledger file (ledger_file.h) the
// way real trainers do: under the file lock it removes entries of dead processes
// (LedgerCleanup), computes free VRAM (VramQuery, reported as a VRAM sample), waits
// while it does not fit (WaitPoll), reserves (LedgerReserve), trains --steps steps of a
// tiny CPU model (workload.h: Forward/Backward/Matmul/...), releases (LedgerRelease) and
// flushes. Workers report progress to the parent over a pipe, one line per message.
//
// With --kill-one, worker 0 starts alone; once it holds its reservation (and the daemon
// has it), the parent SIGKILLs it. Its entry stays in the ledger file (and shows as
// LEAKED in the daemon's ledger view) until the next worker's LedgerCleanup removes it,
// which the daemon credits to that worker. At the end the parent, as a janitor connected
// to steptrace itself, cleans anything still left by dead processes and checks that
// nothing is held.
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <steptrace/steptrace.hpp>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
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
constexpr int kExitNotKilled = 6;

constexpr std::uint64_t kGiB = 1024ULL * 1024 * 1024;

struct Config {
  int workers = 3;
  int steps = 20;
  std::string ledger;
  std::string gpu = "GPU-00000000-sim0-0000-0000-000000000000";
  std::uint64_t vram_total = 8 * kGiB;
  std::uint64_t reserve = 3 * kGiB;
  bool kill_one = false;
  std::string socket;  // empty: $STEPTRACE_SOCKET, then the default
  int dim = 48;
  int poll_ms = 5;
  int max_wait_ms = 30000;
  int pause_after_kill_ms = 0;
  bool json = false;
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

// Removes entries of dead holders; each removal is announced to steptrace and the parent.
std::error_code clean_dead_entries(sim::LockedLedger& ledger, const Config& config,
                                   const std::string& who, int report_fd) {
  Span span(Step::kLedgerCleanup);
  auto& entries = ledger.contents().entries;
  bool changed = false;
  for (auto it = entries.begin(); it != entries.end();) {
    if (sim::pid_is_dead(it->pid)) {
      steptrace_ledger_cleanup(config.gpu.c_str(), it->id, static_cast<std::uint32_t>(it->pid));
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

// Waits until the reservation fits and takes it; returns its id, or an exit code.
std::optional<std::uint64_t> acquire(const Config& config, int index, int report_fd, int& polls,
                                     int& exit_code) {
  const std::string who = std::to_string(index);
  const auto deadline = Clock::now() + std::chrono::milliseconds(config.max_wait_ms);
  for (;;) {
    sim::LockedLedger ledger;
    std::string error;
    std::error_code ec = ledger.lock(config.ledger, error);
    if (!ec) {
      ec = clean_dead_entries(ledger, config, who, report_fd);
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
      const std::uint64_t reserved = ledger.contents().reserved_bytes();
      free_bytes = config.vram_total > reserved ? config.vram_total - reserved : 0;
      steptrace_vram_sample(config.gpu.c_str(), free_bytes, config.vram_total);
    }
    if (free_bytes >= config.reserve) {
      Span span(Step::kLedgerReserve);
      auto& contents = ledger.contents();
      const std::uint64_t id = contents.next_id++;
      contents.entries.push_back({id, ::getpid(), config.reserve, task_name(index)});
      if (auto wec = ledger.write()) {
        send_message(report_fd, "error " + who + " cannot write ledger file " + config.ledger +
                                    ": " + wec.message());
        exit_code = kExitLedgerError;
        return std::nullopt;
      }
      steptrace_ledger_reserve(config.gpu.c_str(), id, config.reserve, task_name(index).c_str());
      return id;
    }
    ledger.unlock();
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

std::error_code release(const Config& config, std::uint64_t id, std::string& error) {
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
  steptrace_ledger_release(config.gpu.c_str(), id);
  return {};
}

int run_worker(const Config& config, int index, int report_fd, bool victim) {
  const std::string name = "sim-worker-" + std::to_string(index);
  ::prctl(PR_SET_NAME, name.c_str(), 0, 0, 0);
  const std::string who = std::to_string(index);
  if (const int rc = steptrace_connect(config.socket.empty() ? nullptr : config.socket.c_str());
      rc != 0) {
    std::fprintf(stderr, "%s: steptraced not reachable yet (%s); events are kept until it is\n",
                 name.c_str(), std::strerror(-rc));
  }
  sim::Workload model(static_cast<std::size_t>(config.dim), static_cast<unsigned>(index) + 1);

  int polls = 0;
  int exit_code = kExitOk;
  const auto id = acquire(config, index, report_fd, polls, exit_code);
  if (!id) return exit_code;

  if (victim) {
    // The daemon must know the reservation before we die, or it could not show the leak.
    const int flushed = steptrace_flush(2000);
    send_message(report_fd, "reserved " + who + " " + std::to_string(*id) + " " +
                                std::to_string(polls) + " " + std::to_string(flushed));
    // Train until the parent kills us (bounded, in case it never does).
    const auto give_up = Clock::now() + std::chrono::seconds(60);
    while (Clock::now() < give_up) model.step();
    send_message(report_fd, "error " + who + " was never killed");
    return kExitNotKilled;
  }
  send_message(report_fd,
               "reserved " + who + " " + std::to_string(*id) + " " + std::to_string(polls) + " 0");
  for (int s = 0; s < config.steps; ++s) model.step();

  std::string error;
  if (release(config, *id, error)) {
    send_message(report_fd, "error " + who + " " + error);
    return kExitLedgerError;
  }
  const int flushed = steptrace_flush(2000);
  char checksum[64];
  std::snprintf(checksum, sizeof checksum, "%.6g", model.checksum());
  send_message(report_fd, "done " + who + " " + std::to_string(config.steps) + " " +
                              std::to_string(flushed) + " " + checksum);
  return flushed == 0 ? kExitOk : kExitFlushFailed;
}

// ---------------------------------------------------------------------------------
// Parent side

struct WorkerRecord {
  int index = 0;
  pid_t pid = -1;
  bool victim = false;
  std::optional<int> status;  // exit status, 128+signal when killed
  std::optional<std::uint64_t> reservation;
  int polls = 0;
  int steps = 0;
  int flush_rc = 0;
  std::string checksum;
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
  bool spawn(int index, bool victim);
  // Reads worker messages and reaps workers until `done()` or the deadline; false on timeout.
  template <typename Done>
  bool pump(Clock::time_point deadline, Done done);
  void handle_line(const std::string& line);
  void reap(bool block);
  WorkerRecord* by_index(int index);
  bool janitor(std::vector<std::pair<std::uint64_t, pid_t>>& cleaned, std::string& error);
  void kill_all();

  Config config_;
  std::vector<WorkerRecord> workers_;
  int read_fd_ = -1;
  int write_fd_ = -1;
  bool eof_ = false;
  std::string pending_;
};

bool Parent::spawn(int index, bool victim) {
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
    const int code = run_worker(config_, index, write_fd_, victim);
    steptrace_shutdown();
    std::fflush(nullptr);
    std::_Exit(code);
  }
  WorkerRecord record;
  record.index = index;
  record.pid = pid;
  record.victim = victim;
  workers_.push_back(std::move(record));
  return true;
}

WorkerRecord* Parent::by_index(int index) {
  for (auto& w : workers_) {
    if (w.index == index) return &w;
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
      w->errors.push_back("steptrace_flush before the kill failed (" +
                          std::string(std::strerror(-flushed)) +
                          "): the daemon may not know the reservation");
    }
  } else if (kind == "cleaned") {
    std::uint64_t id = 0;
    pid_t holder = 0;
    in >> id >> holder;
    w->cleaned.emplace_back(id, holder);
  } else if (kind == "done") {
    in >> w->steps >> w->flush_rc >> w->checksum;
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
    const int ready = ::poll(&p, 1, static_cast<int>(std::min<long long>(left, 50)));
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
      steptrace_ledger_cleanup(config_.gpu.c_str(), it->id, static_cast<std::uint32_t>(it->pid));
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
        error = "reservation " + std::to_string(e.id) + " of worker " + std::to_string(w.index) +
                " is still held in " + config_.ledger;
        return false;
      }
    }
  }
  return true;
}

std::string bytes_text(std::uint64_t bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(bytes) / kGiB);
  return buf;
}

int Parent::run() {
  int fds[2];
  if (::pipe(fds) != 0) {
    std::perror("sim_trainer: pipe");
    return kExitFailed;
  }
  read_fd_ = fds[0];
  write_fd_ = fds[1];
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  bool ok = true;
  std::vector<std::string> problems;

  int first = 0;
  if (config_.kill_one) {
    if (!spawn(0, /*victim=*/true)) return kExitFailed;
    first = 1;
    WorkerRecord& victim = workers_.front();
    const bool reserved = pump(deadline, [&] {
      return workers_.front().reservation.has_value() || workers_.front().status.has_value();
    });
    if (!reserved || !victim.reservation) {
      problems.push_back("worker 0 never reserved VRAM, so it could not be killed holding it");
      kill_all();
      ok = false;
    } else {
      ::kill(victim.pid, SIGKILL);
      reap(true);  // reaped now, so the others see its pid gone (kill(pid, 0) == ESRCH)
      if (config_.pause_after_kill_ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(config_.pause_after_kill_ms));
      }
    }
  }
  if (ok) {
    for (int i = first; i < config_.workers; ++i) {
      if (!spawn(i, false)) {
        ok = false;
        break;
      }
    }
  }
  ::close(write_fd_);
  write_fd_ = -1;
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
    const int expected = w.victim ? 128 + SIGKILL : kExitOk;
    if (w.status != expected) {
      problems.push_back("worker " + std::to_string(w.index) + " (pid " + std::to_string(w.pid) +
                         ") exited with status " + std::to_string(w.status.value_or(-1)) +
                         ", expected " + std::to_string(expected));
      ok = false;
    }
    for (const auto& e : w.errors) {
      problems.push_back("worker " + std::to_string(w.index) + ": " + e);
      ok = false;
    }
  }

  if (config_.json) {
    nlohmann::json out;
    out["ok"] = ok;
    out["janitor_pid"] = ::getpid();
    out["steps"] = config_.steps;
    out["gpu"] = config_.gpu;
    auto& list = out["workers"] = nlohmann::json::array();
    for (const auto& w : workers_) {
      nlohmann::json cleaned = nlohmann::json::array();
      for (const auto& [id, holder] : w.cleaned)
        cleaned.push_back({{"id", id}, {"holder_pid", holder}});
      list.push_back(
          {{"index", w.index},
           {"pid", w.pid},
           {"killed", w.victim},
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
    out["problems"] = problems;
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("sim_trainer: %d workers x %d steps on %s (%s total, %s each), ledger %s\n",
                config_.workers, config_.steps, config_.gpu.c_str(),
                bytes_text(config_.vram_total).c_str(), bytes_text(config_.reserve).c_str(),
                config_.ledger.c_str());
    for (const auto& w : workers_) {
      std::printf("  worker %d pid %d: ", w.index, static_cast<int>(w.pid));
      if (w.victim) {
        std::printf("SIGKILLed while holding reservation %s",
                    w.reservation ? std::to_string(*w.reservation).c_str() : "(none)");
      } else {
        std::printf("%d steps, reservation %s, waited %d polls for VRAM", w.steps,
                    w.reservation ? std::to_string(*w.reservation).c_str() : "(none)", w.polls);
      }
      for (const auto& [id, holder] : w.cleaned) {
        std::printf(", cleaned up reservation %" PRIu64 " of dead pid %d", id,
                    static_cast<int>(holder));
      }
      std::printf("\n");
    }
    std::printf("  janitor pid %d: ", static_cast<int>(::getpid()));
    if (janitor_cleaned.empty()) std::printf("nothing left to clean");
    for (const auto& [id, holder] : janitor_cleaned) {
      std::printf("cleaned up reservation %" PRIu64 " of dead pid %d; ", id,
                  static_cast<int>(holder));
    }
    std::printf("\n");
    for (const auto& p : problems) std::printf("  problem: %s\n", p.c_str());
    std::printf("sim_trainer: %s\n",
                ok ? "ok, every reservation released or cleaned up" : "FAILED");
  }
  std::fflush(stdout);
  return ok ? kExitOk : kExitFailed;
}

}  // namespace

int main(int argc, char** argv) {
  Config config;
  CLI::App app{
      "sim_trainer: several training processes sharing one simulated GPU through a VRAM "
      "ledger file, traced by steptrace (no GPU needed)",
      "sim_trainer"};
  app.add_option("--workers", config.workers, "Worker processes")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--steps", config.steps, "Training steps per worker")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000000));
  app.add_option("--ledger", config.ledger, "Shared ledger file (created if missing)")->required();
  app.add_option("--gpu", config.gpu, "GPU UUID to report")->capture_default_str();
  app.add_option("--vram-total", config.vram_total, "Simulated VRAM of the GPU, bytes")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 50));
  app.add_option("--reserve", config.reserve, "Bytes each worker reserves")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{1}, std::uint64_t{1} << 50));
  app.add_flag("--kill-one", config.kill_one,
               "SIGKILL worker 0 while it holds its reservation; later workers clean it up");
  app.add_option("--socket", config.socket, "steptraced's socket (default: $STEPTRACE_SOCKET)");
  app.add_option("--dim", config.dim, "Model width (work per step grows as dim^3)")
      ->capture_default_str()
      ->check(CLI::Range(4, 1024));
  app.add_option("--poll-ms", config.poll_ms, "Sleep between VRAM polls")
      ->capture_default_str()
      ->check(CLI::Range(1, 10000));
  app.add_option("--max-wait-ms", config.max_wait_ms, "Give up waiting for VRAM after this")
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
  if (config.gpu.empty() || config.gpu.size() > 63 ||
      !std::all_of(config.gpu.begin(), config.gpu.end(),
                   [](char c) { return c > ' ' && c < 0x7f; })) {
    std::fprintf(stderr, "sim_trainer: --gpu must be 1..63 printable characters without spaces\n");
    return kExitUsage;
  }
  if (config.reserve > config.vram_total) {
    std::fprintf(stderr,
                 "sim_trainer: --reserve (%" PRIu64 ") exceeds --vram-total (%" PRIu64
                 "); no worker could ever fit\n",
                 config.reserve, config.vram_total);
    return kExitUsage;
  }
  if (config.kill_one && config.workers < 2) {
    std::fprintf(stderr, "sim_trainer: --kill-one needs --workers 2 or more\n");
    return kExitUsage;
  }
  return Parent(std::move(config)).run();
}
