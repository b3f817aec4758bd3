// A temporary system user for tests that run clients as other users (CI runs as root):
// made with useradd (no home, no login shell) and removed by the destructor. created() is
// false when useradd failed (not root), and the test says so.
#pragma once

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <functional>
#include <string>
#include <utility>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {

class TemporaryUser {
 public:
  explicit TemporaryUser(std::string name) : name_(std::move(name)) {
    (void)run_process({"/usr/sbin/userdel", name_}, {}, kWaitMs);  // a leftover of a crash
    if (run_process({"/usr/sbin/useradd", "--system", "--no-create-home", "--shell",
                     "/usr/sbin/nologin", name_},
                    {}, kWaitMs) != 0) {
      return;
    }
    const passwd* pw = ::getpwnam(name_.c_str());
    if (pw == nullptr) return;
    uid_ = pw->pw_uid;
    gid_ = pw->pw_gid;
    created_ = true;
  }
  ~TemporaryUser() {
    if (created_) (void)run_process({"/usr/sbin/userdel", name_}, {}, kWaitMs);
  }
  TemporaryUser(const TemporaryUser&) = delete;
  TemporaryUser& operator=(const TemporaryUser&) = delete;

  bool created() const { return created_ && uid_ != 0; }
  const std::string& name() const { return name_; }
  uid_t uid() const { return uid_; }
  gid_t gid() const { return gid_; }

 private:
  static constexpr int kWaitMs = 30000;
  std::string name_;
  uid_t uid_ = 0;
  gid_t gid_ = 0;
  bool created_ = false;
};

// A process forked from the test that runs `body` as `user` (setgroups, setgid, setuid:
// its connections are that uid's) and reports to the test through a pipe (report_fd()).
// SIGKILLed and reaped by the destructor unless it ended: the kernel then closes its
// sockets, as when a client crashes or its user presses ^C.
class ClientAs {
 public:
  using Body = std::function<int(int report_fd)>;
  ClientAs(const TemporaryUser& user, const Body& body) {
    int pipe_fds[2];
    if (::pipe2(pipe_fds, O_CLOEXEC) != 0) return;
    pid_ = ::fork();
    if (pid_ == 0) {
      ::close(pipe_fds[0]);
      if (::setgroups(0, nullptr) != 0 || ::setgid(user.gid()) != 0 || ::setuid(user.uid()) != 0 ||
          ::setuid(0) == 0) {
        ::_exit(126);  // could not drop root (or could get it back)
      }
      ::_exit(body(pipe_fds[1]));
    }
    ::close(pipe_fds[1]);
    report_ = pipe_fds[0];
  }
  ~ClientAs() {
    kill();
    if (report_ >= 0) ::close(report_);
  }
  ClientAs(const ClientAs&) = delete;
  ClientAs& operator=(const ClientAs&) = delete;

  // The read end of what the client reports.
  int report_fd() const { return report_; }
  // Its exit status (128+signal), -1 when it did not end within `timeout_ms`.
  int wait(int timeout_ms = 10000) {
    if (pid_ <= 0) return -1;
    const int status = wait_or_kill(pid_, timeout_ms);
    pid_ = -1;
    return status;
  }
  void kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

 private:
  pid_t pid_ = -1;
  int report_ = -1;
};

}  // namespace steptrace::testing
