// `top`'s terminal guard (cli/top_terminal.h) on a real pseudo-terminal: every way out of
// its scope, an exception included, gives the terminal back (cooked mode, cursor shown,
// alternate screen left); and PendingCommand (cli/top_request.h), the exchange that never
// blocks, against a scripted server: a reply, a reply cut short, and a server that never
// answers (the deadline; and the caller's poll() is free meanwhile).
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <termios.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <variant>

#include "cli/top_request.h"
#include "cli/top_terminal.h"
#include "proto/errc.h"

namespace {

using steptrace::cli::PendingCommand;
using steptrace::cli::TerminalSession;

// A pseudo-terminal: the master (the test's end) and the slave (top's end), as a
// descriptor for the modes and a FILE* for the escape sequences.
class Pty {
 public:
  Pty() {
    master_ = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master_ < 0 || ::grantpt(master_) != 0 || ::unlockpt(master_) != 0) return;
    slave_ = ::open(::ptsname(master_), O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (slave_ >= 0) out_ = ::fdopen(::dup(slave_), "w");
  }
  ~Pty() {
    if (out_ != nullptr) std::fclose(out_);
    if (slave_ >= 0) ::close(slave_);
    if (master_ >= 0) ::close(master_);
  }
  Pty(const Pty&) = delete;
  Pty& operator=(const Pty&) = delete;

  bool ok() const { return out_ != nullptr; }
  int slave() const { return slave_; }
  std::FILE* out() const { return out_; }
  bool cooked() const {
    termios modes{};
    return ::tcgetattr(slave_, &modes) == 0 && (modes.c_lflag & ICANON) != 0 &&
           (modes.c_lflag & ECHO) != 0;
  }
  // Everything the slave's side wrote so far.
  std::string written() {
    std::string out;
    pollfd in{master_, POLLIN, 0};
    while (::poll(&in, 1, 100) > 0 && (in.revents & POLLIN) != 0) {
      char buffer[256];
      const ssize_t n = ::read(master_, buffer, sizeof buffer);
      if (n <= 0) break;
      out.append(buffer, static_cast<std::size_t>(n));
    }
    return out;
  }

 private:
  int master_ = -1;
  int slave_ = -1;
  std::FILE* out_ = nullptr;
};

constexpr const char* kEnter = "\x1b[?1049h\x1b[?25l";
constexpr const char* kLeave = "\x1b[?25h\x1b[?1049l";

TEST(TopTerminal, AnExceptionOnItsWayUpRestoresTheTerminal) {
  Pty pty;
  ASSERT_TRUE(pty.ok());
  ASSERT_TRUE(pty.cooked());
  try {
    TerminalSession session(pty.slave(), pty.out(), /*ansi=*/true);
    EXPECT_FALSE(pty.cooked()) << "keys one at a time from the start";
    session.show();
    session.show();  // once
    throw std::runtime_error("a refresh went wrong");
  } catch (const std::runtime_error&) {
  }
  EXPECT_TRUE(pty.cooked());
  EXPECT_EQ(pty.written(), std::string(kEnter) + kLeave);
}

TEST(TopTerminal, NotShownLeavesTheScreenAloneAndStillRestoresTheModes) {
  // A first refresh that fails: its error stays on the main screen.
  Pty pty;
  ASSERT_TRUE(pty.ok());
  { TerminalSession session(pty.slave(), pty.out(), /*ansi=*/true); }
  EXPECT_TRUE(pty.cooked());
  EXPECT_EQ(pty.written(), "");
}

TEST(TopTerminal, WithoutEscapeSequencesOnlyTheModes) {
  Pty pty;
  ASSERT_TRUE(pty.ok());
  {
    TerminalSession session(pty.slave(), pty.out(), /*ansi=*/false);
    session.show();
    EXPECT_FALSE(pty.cooked());
  }
  EXPECT_TRUE(pty.cooked());
  EXPECT_EQ(pty.written(), "");
}

// A server on a Unix socket that answers one connection with `reply` (after the request
// line), then closes it; `reply` empty and `hold` true: reads the request and never
// answers until the test ends.
class OneShotServer {
 public:
  OneShotServer(std::string reply, bool hold) {
    if (::pipe(stop_) != 0) return;
    char dir[] = "/tmp/sttopXXXXXX";
    if (::mkdtemp(dir) == nullptr) return;
    dir_ = dir;
    path_ = dir_ + "/s.sock";
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof address.sun_path - 1);
    if (::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listener_, 4) != 0) {
      return;
    }
    thread_ = std::thread([this, reply = std::move(reply), hold] {
      const int fd = ::accept(listener_, nullptr, nullptr);
      if (fd < 0) {
        request_.set_value("(accept failed)");
        return;
      }
      std::string request;
      char c = 0;
      while (::read(fd, &c, 1) == 1 && c != '\n') request += c;
      request_.set_value(std::move(request));
      if (hold) {
        pollfd wait{stop_[0], POLLIN, 0};
        ::poll(&wait, 1, 30'000);
      } else {
        [[maybe_unused]] const ssize_t n = ::write(fd, reply.data(), reply.size());
      }
      ::close(fd);
    });
  }
  ~OneShotServer() {
    [[maybe_unused]] const ssize_t n = ::write(stop_[1], "x", 1);
    if (thread_.joinable()) thread_.join();
    ::close(stop_[0]);
    ::close(stop_[1]);
    if (listener_ >= 0) ::close(listener_);
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  OneShotServer(const OneShotServer&) = delete;
  OneShotServer& operator=(const OneShotServer&) = delete;

  const std::string& path() const { return path_; }
  // The line the server read, once it has (the server's thread may be slow to get to it
  // on a loaded machine, after the client gave up).
  std::string request() {
    auto read = request_.get_future();
    if (read.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
      return "(no request within 10 s)";
    }
    return read.get();
  }

 private:
  int stop_[2] = {-1, -1};
  std::string dir_;
  std::string path_;
  int listener_ = -1;
  std::thread thread_;
  std::promise<std::string> request_;
};

// Runs `pending` to its end as top does: its own poll() with the socket in it.
void drive(PendingCommand& pending) {
  while (!pending.done()) {
    pollfd fd = pending.poll_entry();
    ::poll(&fd, 1, pending.poll_timeout_ms());
    pending.advance();
  }
}

TEST(TopRequest, ReadsTheWholeReply) {
  const std::string reply(200'000, 'x');  // more than one read
  OneShotServer server(reply, /*hold=*/false);
  PendingCommand pending(server.path(), "report --json", std::chrono::seconds(10));
  drive(pending);
  auto result = pending.take_result();
  ASSERT_TRUE(std::holds_alternative<std::string>(result));
  EXPECT_EQ(std::get<std::string>(result), reply);
}

TEST(TopRequest, ADaemonThatNeverAnswersTimesOutAndLeavesThePollFree) {
  OneShotServer server("", /*hold=*/true);
  const auto start = std::chrono::steady_clock::now();
  PendingCommand pending(server.path(), "report --json", std::chrono::milliseconds(300));
  EXPECT_FALSE(pending.done());
  EXPECT_LE(pending.poll_timeout_ms(), 300);
  drive(pending);
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(300));
  auto result = pending.take_result();
  ASSERT_TRUE(std::holds_alternative<steptrace::cli::CommandFailure>(result));
  const auto& failure = std::get<steptrace::cli::CommandFailure>(result);
  EXPECT_EQ(failure.stage, steptrace::cli::Stage::kReceive);
  EXPECT_EQ(failure.error, steptrace::errc::timed_out);
  EXPECT_EQ(server.request(), "report --json");
}

TEST(TopRequest, NoSuchSocketFailsAtConnect) {
  PendingCommand pending("/nonexistent/steptrace.sock", "report --json", std::chrono::seconds(1));
  drive(pending);
  auto result = pending.take_result();
  ASSERT_TRUE(std::holds_alternative<steptrace::cli::CommandFailure>(result));
  EXPECT_EQ(std::get<steptrace::cli::CommandFailure>(result).stage,
            steptrace::cli::Stage::kConnect);
  EXPECT_EQ(std::get<steptrace::cli::CommandFailure>(result).error,
            std::errc::no_such_file_or_directory);
}

}  // namespace
