// Test support: a client worker process for integration tests, fork/exec'd with its stdin
// and stdout on pipes, so a test reads the lines it prints and sends it request lines.
// Written for tests/ledger/ledger_worker.cpp (`hold` and `lease` keep their reservations
// while their stdin is open, print "ready" once flushed, answer "release GPU ID" with
// "released"), which tests/ledger and tests/nvml run; any program taking the daemon's
// socket as its first argument fits.
#pragma once

#include <sys/types.h>

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace steptrace::testing {

// SIGKILLed and reaped by the destructor if it still runs.
class Worker {
 public:
  // How long expect_line waits by default.
  static constexpr int kLineTimeoutMs = 30000;

  // Runs `program socket args...` with this process's environment. With `as_uid` (not 0;
  // the test must be root) the child drops to that uid and gid (setgroups, setresgid,
  // setresuid) before the exec and exits 126 when it cannot, or could get root back.
  // pid() is -1 when the pipes or the fork failed (then every read fails).
  Worker(const std::string& program, const std::string& socket, std::vector<std::string> args,
         uid_t as_uid = 0);
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // -1 once it was reaped (finish, kill_and_reap, or running() saw it exit).
  pid_t pid() const { return pid_; }

  // The next line the worker printed; nullopt on EOF (it exited) or timeout.
  std::optional<std::string> read_line(int timeout_ms);

  // Waits for the line `want`; on anything else says what the worker did instead (the
  // line, or its exit status when it printed nothing more).
  ::testing::AssertionResult expect_line(const std::string& want, int timeout_ms = kLineTimeoutMs);

  // Writes one request line to the worker's stdin; false when it is gone (never SIGPIPE).
  bool send(const std::string& request);

  // ledger_worker: asks a holder to release one of its reservations and waits until it
  // has flushed ("released").
  ::testing::AssertionResult release(const std::string& gpu, std::uint64_t id);

  // Whether the process still runs (has not exited; a zombie would answer kill(pid, 0)).
  // Reaps it when it has exited.
  bool running();

  // Closes its stdin (a holder then exits 0) and returns the exit status (128+signal),
  // -1 on timeout (it then still runs, and the destructor kills it).
  int finish(int timeout_ms = 30000);

  void kill_and_reap();

 private:
  int wait_exit(int timeout_ms);
  void close_pipes();

  pid_t pid_ = -1;
  int in_ = -1;
  int out_ = -1;
  std::string buffer_;
};

}  // namespace steptrace::testing
