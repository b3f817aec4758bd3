// Test support: runs the real steptraced as a child process on a temporary socket, and
// talks to it with text commands, the way integration tests need. No mocks.
#pragma once

#include <sys/types.h>

#include <map>
#include <optional>
#include <string>
#include <vector>

namespace steptrace::testing {

// A fresh private directory under $TMPDIR (or /tmp), removed by the destructor.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

class DaemonProcess {
 public:
  // `args` are passed after `--socket <socket>`; stderr goes to `<socket>.log`.
  explicit DaemonProcess(std::string socket, std::vector<std::string> args = {});
  ~DaemonProcess();  // SIGKILLs the daemon if it still runs
  DaemonProcess(const DaemonProcess&) = delete;
  DaemonProcess& operator=(const DaemonProcess&) = delete;

  // fork/exec steptraced, then wait up to timeout_ms until `ping` answers `pong`.
  // False (with the daemon's log in log()) when it exits or never answers.
  bool start(int timeout_ms = 10000);
  // Sends `sig` and waits for exit; returns the exit status (128+signal when killed),
  // or -1 when not running.
  int stop(int sig = 15 /*SIGTERM*/, int timeout_ms = 20000);
  void signal(int sig) const;  // e.g. SIGSTOP/SIGCONT, without waiting
  bool running() const;

  pid_t pid() const { return pid_; }
  const std::string& socket() const { return socket_; }
  std::string log() const;  // what the daemon wrote to stderr so far

 private:
  std::string socket_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

// Connects to `socket`, sends `line` plus '\n', shuts down the writing side and reads
// the reply until the daemon closes. nullopt when the connection fails or timed out.
std::optional<std::string> command(const std::string& socket, const std::string& line,
                                   int timeout_ms = 10000);

// A TCP port on 127.0.0.1 that was free a moment ago (for --metrics-listen).
int free_port();

// fork/exec `argv` (argv[0] is a path), wait, and return the exit status (128+signal).
// The child's environment is this process's plus `env` ("NAME=value").
int run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {},
                int timeout_ms = 120000);
// Like run_process but does not wait; returns the child's pid.
pid_t spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env = {});
// Waits for a child from spawn_process; exit status (128+signal), -1 on timeout.
int wait_process(pid_t pid, int timeout_ms = 120000);
// wait_process, but a child still running at the deadline is killed and reaped (and -1
// returned).
int wait_or_kill(pid_t pid, int timeout_ms);

// The "key value" lines a test trainer writes (its outfile); nullopt when there is no file.
using KeyValues = std::map<std::string, long long>;
std::optional<KeyValues> read_key_values(const std::string& path);

}  // namespace steptrace::testing
