// systemd's socket activation, emulated for durability_test: the test holds the
// listening Unix socket, as steptraced.socket (systemd/) does, and starts each steptraced
// on it the systemd way (the socket as fd 3, LISTEN_FDS=1, LISTEN_PID=the daemon's pid,
// no --socket: daemon/serve/systemd_integration.h), so that the socket outlives every
// daemon: a client that connects while none runs waits in the listen backlog for the
// next one, as during `systemctl restart steptraced`.
#pragma once

#include <fcntl.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/rtnetlink.h>
#include <linux/sock_diag.h>
#include <linux/unix_diag.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "proto/unique_fd.h"
#include "tests/support/daemon_process.h"

extern char** environ;

namespace steptrace::testing {

// `path` as a Unix socket address; false when it does not fit.
inline bool unix_address(const std::string& path, sockaddr_un& addr) {
  addr = sockaddr_un{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return false;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return true;
}

// A listening Unix stream socket bound at `path`, with systemd's default backlog
// (SOMAXCONN); invalid on failure (errno says why). Close-on-exec: the trainers the test
// starts must not hold it; each daemon gets its own copy as fd 3.
inline proto::UniqueFd listen_unix(const std::string& path) {
  sockaddr_un addr{};
  if (!unix_address(path, addr)) {
    errno = ENAMETOOLONG;
    return {};
  }
  proto::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd || ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::listen(fd.get(), SOMAXCONN) != 0) {
    return {};
  }
  return fd;
}

// The connections waiting in the backlog of the listening Unix socket `fd`, not yet
// accepted: what `ss -xl` shows as its Recv-Q (sock_diag, UNIX_DIAG_RQLEN). nullopt when
// the kernel does not say (no sock_diag in this kernel or sandbox).
inline std::optional<std::uint32_t> backlog_length(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  const proto::UniqueFd diag(::socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG));
  if (!diag) return std::nullopt;
  struct {
    nlmsghdr header;
    unix_diag_req body;
  } request{};
  request.header.nlmsg_len = sizeof request;
  request.header.nlmsg_type = SOCK_DIAG_BY_FAMILY;
  request.header.nlmsg_flags = NLM_F_REQUEST;
  request.body.sdiag_family = AF_UNIX;
  request.body.udiag_states = 1U << TCP_LISTEN;
  request.body.udiag_ino = static_cast<std::uint32_t>(st.st_ino);
  request.body.udiag_show = UDIAG_SHOW_RQLEN;
  request.body.udiag_cookie[0] = request.body.udiag_cookie[1] = INET_DIAG_NOCOOKIE;
  if (::send(diag.get(), &request, sizeof request, 0) != static_cast<ssize_t>(sizeof request)) {
    return std::nullopt;
  }
  alignas(nlmsghdr) char reply[8192];
  pollfd p{diag.get(), POLLIN, 0};
  if (::poll(&p, 1, 1000) != 1) return std::nullopt;
  const ssize_t n = ::recv(diag.get(), reply, sizeof reply, 0);
  const auto* header = reinterpret_cast<const nlmsghdr*>(reply);
  if (n < static_cast<ssize_t>(NLMSG_LENGTH(sizeof(unix_diag_msg))) ||
      header->nlmsg_len > static_cast<std::size_t>(n) ||
      header->nlmsg_len < NLMSG_LENGTH(sizeof(unix_diag_msg)) ||
      header->nlmsg_type != SOCK_DIAG_BY_FAMILY) {
    return std::nullopt;
  }
  const auto* message = static_cast<const unix_diag_msg*>(NLMSG_DATA(header));
  int left = static_cast<int>(header->nlmsg_len - NLMSG_LENGTH(sizeof *message));
  for (auto* attr = reinterpret_cast<const rtattr*>(message + 1); RTA_OK(attr, left);
       attr = RTA_NEXT(attr, left)) {
    if (attr->rta_type == UNIX_DIAG_RQLEN) {
      return static_cast<const unix_diag_rqlen*>(RTA_DATA(attr))->udiag_rqueue;
    }
  }
  return std::nullopt;
}

// One steptraced started on a listening socket the test owns, with `args` (no --socket)
// and its stderr appended to `log_path`.
class ActivatedDaemon {
 public:
  ActivatedDaemon(int listen_fd, std::string socket, std::string log_path,
                  std::vector<std::string> args)
      : listen_fd_(listen_fd),
        socket_(std::move(socket)),
        log_path_(std::move(log_path)),
        args_(std::move(args)) {}
  ~ActivatedDaemon() {
    if (pid_ > 0) wait_or_kill(pid_, 0);
  }
  ActivatedDaemon(const ActivatedDaemon&) = delete;
  ActivatedDaemon& operator=(const ActivatedDaemon&) = delete;

  // fork/exec steptraced on the socket, then wait up to `timeout_ms` until `ping`
  // answers `pong` (the pings wait in the backlog until the daemon accepts them).
  bool start(int timeout_ms) {
    std::vector<std::string> argv{STEPTRACED_BIN};
    argv.insert(argv.end(), args_.begin(), args_.end());
    std::vector<std::string> env = activation_environment();
    std::vector<char*> c_args = pointers(argv);
    std::vector<char*> c_env = pointers(env);
    pid_ = ::fork();
    if (pid_ < 0) return false;
    if (pid_ == 0) exec_child(c_args, c_env, env.back());
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < deadline) {
      if (wait_process(pid_, 0) >= 0) {
        pid_ = -1;
        return false;
      }
      const auto reply = command(socket_, "ping", 2000);
      if (reply && reply->rfind("pong", 0) == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
  }

  // Sends `sig` and waits for the exit: its status (128+signal when killed), -1 when not
  // running or still running at the deadline.
  int stop(int sig, int timeout_ms) {
    if (pid_ <= 0) return -1;
    ::kill(pid_, sig);
    const int status = wait_process(pid_, timeout_ms);
    if (status >= 0) pid_ = -1;
    return status;
  }

 private:
  static std::vector<char*> pointers(std::vector<std::string>& strings) {
    std::vector<char*> out;
    for (auto& s : strings) out.push_back(s.data());
    out.push_back(nullptr);
    return out;
  }

  // This process's environment without systemd's variables, plus LISTEN_FDS=1 and, last,
  // LISTEN_PID= with room for the pid, which only the child knows.
  static std::vector<std::string> activation_environment() {
    std::vector<std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string_view entry(*e);
      if (entry.starts_with("LISTEN_") || entry.starts_with("NOTIFY_SOCKET=")) continue;
      env.emplace_back(entry);
    }
    env.emplace_back("LISTEN_FDS=1");
    env.emplace_back("LISTEN_PID=" + std::string(20, '\0'));
    return env;
  }

  // In the child, between fork and exec: only async-signal-safe calls (no allocation).
  [[noreturn]] void exec_child(std::vector<char*>& args, std::vector<char*>& env,
                               std::string& listen_pid) const {
    const int log = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (log >= 0) ::dup2(log, STDERR_FILENO);
    // dup2 clears close-on-exec on the copy; a socket that is fd 3 already keeps it.
    if (listen_fd_ != 3) {
      ::dup2(listen_fd_, 3);
    } else {
      ::fcntl(3, F_SETFD, 0);
    }
    char digits[20];
    int n = 0;
    for (auto pid = static_cast<unsigned long>(::getpid()); pid != 0 || n == 0; pid /= 10) {
      digits[n++] = static_cast<char>('0' + pid % 10);
    }
    char* out = listen_pid.data() + std::strlen("LISTEN_PID=");
    while (n > 0) *out++ = digits[--n];
    *out = '\0';
    ::execve(args[0], args.data(), env.data());
    std::_Exit(127);
  }

  int listen_fd_;
  std::string socket_;
  std::string log_path_;
  std::vector<std::string> args_;
  pid_t pid_ = -1;
};

// A client that connects while no daemon runs and sends `ping`: the connection must be
// accepted at once (queued in the backlog, not refused) and answered by the next daemon.
class BacklogProbe {
 public:
  explicit BacklogProbe(const std::string& path) {
    sockaddr_un addr{};
    proto::UniqueFd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!fd || !unix_address(path, addr)) {
      error_ = fd ? ENAMETOOLONG : errno;
      return;
    }
    // Non-blocking, like the library's connect: a full backlog fails with EAGAIN.
    if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      error_ = errno;
      return;
    }
    const char line[] = "ping\n";
    constexpr auto kLength = static_cast<ssize_t>(sizeof line - 1);
    if (::send(fd.get(), line, kLength, MSG_NOSIGNAL) != kLength) {
      error_ = errno;
      return;
    }
    ::shutdown(fd.get(), SHUT_WR);
    fd_ = std::move(fd);
  }

  // 0 when the connection was made and the command sent; the errno of the failure.
  int error() const { return error_; }

  // The reply until the daemon closes, waiting at most `timeout_ms`; nullopt on a timeout
  // or an error.
  std::optional<std::string> reply(int timeout_ms) {
    if (!fd_) return std::nullopt;
    std::string text;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (;;) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return std::nullopt;
      pollfd p{fd_.get(), POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_.get(), buf, sizeof buf, 0);
      if (n == 0) return text;
      if (n < 0 && errno != EINTR && errno != EAGAIN) return std::nullopt;
      if (n > 0) text.append(buf, static_cast<std::size_t>(n));
    }
  }

 private:
  proto::UniqueFd fd_;
  int error_ = 0;
};

}  // namespace steptrace::testing
