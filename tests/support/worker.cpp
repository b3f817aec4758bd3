#include "tests/support/worker.h"

#include <fcntl.h>
#include <grp.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>

#include "tests/support/daemon_process.h"

extern char** environ;

namespace steptrace::testing {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

Worker::Worker(const std::string& program, const std::string& socket, std::vector<std::string> args,
               uid_t as_uid) {
  args.insert(args.begin(), {program, socket});
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  int to_child[2];
  int from_child[2];
  if (::pipe2(to_child, O_CLOEXEC) != 0) return;
  if (::pipe2(from_child, O_CLOEXEC) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return;
  }
  pid_ = ::fork();
  if (pid_ == 0) {
    // Only async-signal-safe calls from here: the test may have threads.
    ::dup2(to_child[0], STDIN_FILENO);  // dup2 clears close-on-exec on the copies
    ::dup2(from_child[1], STDOUT_FILENO);
    if (as_uid != 0 && (::setgroups(0, nullptr) != 0 || ::setresgid(as_uid, as_uid, as_uid) != 0 ||
                        ::setresuid(as_uid, as_uid, as_uid) != 0 || ::setuid(0) == 0)) {
      ::_exit(126);  // could not drop root (or could get it back)
    }
    ::execve(argv[0], argv.data(), environ);
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  in_ = to_child[1];
  out_ = from_child[0];
  if (pid_ < 0) close_pipes();
}

Worker::~Worker() {
  if (pid_ > 0) kill_and_reap();
  close_pipes();
}

std::optional<std::string> Worker::read_line(int timeout_ms) {
  const auto deadline = Clock::now() + milliseconds(timeout_ms);
  for (;;) {
    if (const auto nl = buffer_.find('\n'); nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (out_ < 0 || left.count() <= 0) return std::nullopt;
    pollfd p{out_, POLLIN, 0};
    const int r = ::poll(&p, 1, static_cast<int>(left.count()));
    if (r < 0 && errno != EINTR) return std::nullopt;
    if (r <= 0) continue;
    char buf[256];
    const ssize_t n = ::read(out_, buf, sizeof buf);
    if (n == 0) return std::nullopt;
    if (n < 0) {
      if (errno == EINTR) continue;
      return std::nullopt;
    }
    buffer_.append(buf, static_cast<std::size_t>(n));
  }
}

::testing::AssertionResult Worker::expect_line(const std::string& want, int timeout_ms) {
  const auto line = read_line(timeout_ms);
  if (line == want) return ::testing::AssertionSuccess();
  auto failure = ::testing::AssertionFailure()
                 << "worker " << pid_ << ": wanted \"" << want << "\", got ";
  if (line) return failure << '"' << *line << '"';
  return failure << "nothing; exit status " << wait_exit(5000);
}

bool Worker::send(const std::string& request) {
  const std::string line = request + "\n";
  // A worker that died must fail the test, not kill it with SIGPIPE.
  struct sigaction ignore {};
  struct sigaction old {};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGPIPE, &ignore, &old);
  const bool sent = ::write(in_, line.data(), line.size()) == static_cast<ssize_t>(line.size());
  ::sigaction(SIGPIPE, &old, nullptr);
  return sent;
}

::testing::AssertionResult Worker::release(const std::string& gpu, std::uint64_t id) {
  if (!send("release " + gpu + " " + std::to_string(id))) {
    return ::testing::AssertionFailure() << "worker " << pid_ << " gone";
  }
  return expect_line("released");
}

bool Worker::running() {
  if (pid_ <= 0) return false;
  int status = 0;
  if (::waitpid(pid_, &status, WNOHANG) == 0) return true;
  pid_ = -1;  // exited (and now reaped)
  return false;
}

int Worker::finish(int timeout_ms) {
  if (in_ >= 0) ::close(in_);
  in_ = -1;
  return wait_exit(timeout_ms);
}

void Worker::kill_and_reap() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

int Worker::wait_exit(int timeout_ms) {
  if (pid_ <= 0) return -1;
  const int status = wait_process(pid_, timeout_ms);
  if (status >= 0) pid_ = -1;
  return status;
}

void Worker::close_pipes() {
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
  in_ = out_ = -1;
}

}  // namespace steptrace::testing
