#include "tests/support/daemon_process.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string_view>
#include <thread>

extern char** environ;

namespace steptrace::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<char*> c_argv(std::vector<std::string>& args) {
  std::vector<char*> out;
  for (auto& a : args) out.push_back(a.data());
  out.push_back(nullptr);
  return out;
}

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

}  // namespace

TempDir::TempDir() {
  const char* base = std::getenv("TMPDIR");
  std::string pattern = std::string(base && *base ? base : "/tmp") + "/steptrace-test-XXXXXX";
  if (mkdtemp(pattern.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

DaemonProcess::DaemonProcess(std::string socket, std::vector<std::string> args)
    : socket_(std::move(socket)), args_(std::move(args)) {}

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) {
    ::kill(pid_, SIGCONT);
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
  }
}

bool DaemonProcess::start(int timeout_ms) {
  std::vector<std::string> argv{STEPTRACED_BIN, "--socket", socket_};
  argv.insert(argv.end(), args_.begin(), args_.end());
  const std::string log_path = socket_ + ".log";
  pid_ = ::fork();
  if (pid_ < 0) return false;
  if (pid_ == 0) {
    int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      ::dup2(fd, STDERR_FILENO);
      ::close(fd);
    }
    auto args = c_argv(argv);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    if (!running()) return false;
    auto reply = command(socket_, "ping", 1000);
    if (reply && reply->rfind("pong", 0) == 0) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

int DaemonProcess::stop(int sig, int timeout_ms) {
  if (pid_ <= 0) return -1;
  ::kill(pid_, SIGCONT);
  ::kill(pid_, sig);
  const int status = wait_process(pid_, timeout_ms);
  if (status >= 0) pid_ = -1;
  return status;
}

void DaemonProcess::signal(int sig) const {
  if (pid_ > 0) ::kill(pid_, sig);
}

bool DaemonProcess::running() const {
  if (pid_ <= 0) return false;
  int status = 0;
  const pid_t r = ::waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    const_cast<DaemonProcess*>(this)->pid_ = -1;
    return false;
  }
  return r == 0;
}

std::string DaemonProcess::log() const {
  std::ifstream in(socket_ + ".log");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::optional<std::string> command(const std::string& socket, const std::string& line,
                                   int timeout_ms) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return std::nullopt;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (socket.size() >= sizeof addr.sun_path) {
    ::close(fd);
    return std::nullopt;
  }
  std::memcpy(addr.sun_path, socket.c_str(), socket.size() + 1);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return std::nullopt;
  }
  const std::string out = line + "\n";
  std::size_t sent = 0;
  while (sent < out.size()) {
    const ssize_t n = ::send(fd, out.data() + sent, out.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) {
      ::close(fd);
      return std::nullopt;
    }
    sent += static_cast<std::size_t>(n);
  }
  ::shutdown(fd, SHUT_WR);
  std::string reply;
  char buf[65536];
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      ::close(fd);
      return std::nullopt;
    }
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return std::nullopt;
    }
    reply.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return reply;
}

pid_t spawn_process(const std::vector<std::string>& argv, const std::vector<std::string>& env) {
  std::vector<std::string> args = argv;
  std::vector<std::string> envs;
  // `env` overrides what the test inherited: drop inherited entries it names.
  auto named_in_env = [&env](std::string_view entry) {
    const std::string_view name = entry.substr(0, entry.find('='));
    for (const auto& e : env) {
      if (std::string_view(e).substr(0, e.find('=')) == name) return true;
    }
    return false;
  };
  for (char** e = environ; *e; ++e) {
    if (!named_in_env(*e)) envs.emplace_back(*e);
  }
  envs.insert(envs.end(), env.begin(), env.end());
  const pid_t pid = ::fork();
  if (pid == 0) {
    auto a = c_argv(args);
    auto e = c_argv(envs);
    ::execve(a[0], a.data(), e.data());
    std::_Exit(127);
  }
  return pid;
}

int wait_process(pid_t pid, int timeout_ms) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return decode_status(status);
    if (r < 0) return -1;
    if (Clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

int wait_or_kill(pid_t pid, int timeout_ms) {
  const int status = wait_process(pid, timeout_ms);
  if (status < 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  return status;
}

int run_process(const std::vector<std::string>& argv, const std::vector<std::string>& env,
                int timeout_ms) {
  const pid_t pid = spawn_process(argv, env);
  if (pid < 0) return -1;
  return wait_or_kill(pid, timeout_ms);
}

int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

std::optional<KeyValues> read_key_values(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  KeyValues v;
  std::string key;
  long long value = 0;
  while (in >> key >> value) v[key] = value;
  return v;
}

}  // namespace steptrace::testing
