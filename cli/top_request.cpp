#include "cli/top_request.h"

#include <sys/socket.h>
#include <sys/un.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <system_error>

#include "proto/errc.h"

namespace steptrace::cli {
namespace {

// A daemon whose listen backlog is full refuses a non-blocking connect with EAGAIN (a
// Unix socket has no connect in progress to wait for): try again this much later.
constexpr std::chrono::milliseconds kConnectRetry{20};

std::error_code errno_code(int error) { return {error, std::system_category()}; }

}  // namespace

PendingCommand::PendingCommand(const std::string& socket_path, const std::string& line,
                               std::chrono::milliseconds timeout)
    : socket_path_(socket_path),
      request_(line + "\n"),
      deadline_(std::chrono::steady_clock::now() + timeout) {
  if (socket_path_.empty() || socket_path_.size() >= sizeof(sockaddr_un::sun_path)) {
    fail(Stage::kConnect, std::make_error_code(std::errc::filename_too_long));
    return;
  }
  advance();
}

pollfd PendingCommand::poll_entry() const {
  if (done_ || !socket_.valid()) return {-1, 0, 0};
  return {socket_.get(), static_cast<short>(stage_ == Stage::kReceive ? POLLIN : POLLOUT), 0};
}

int PendingCommand::poll_timeout_ms() const {
  if (done_) return 0;
  auto left =
      std::chrono::ceil<std::chrono::milliseconds>(deadline_ - std::chrono::steady_clock::now());
  if (!socket_.valid()) left = std::min(left, kConnectRetry);  // between connect retries
  return static_cast<int>(std::clamp<long long>(left.count(), 0, 60'000));
}

void PendingCommand::advance() {
  if (done_) return;
  if (stage_ == Stage::kConnect) try_connect();
  if (!done_ && stage_ == Stage::kSend) try_send();
  if (!done_ && stage_ == Stage::kReceive) try_receive();
  if (!done_ && std::chrono::steady_clock::now() >= deadline_) {
    fail(stage_, make_error_code(errc::timed_out));
  }
}

void PendingCommand::try_connect() {
  socket_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!socket_.valid()) return fail(Stage::kConnect, errno_code(errno));
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path, socket_path_.data(), socket_path_.size());
  int rc = 0;
  do {
    rc = ::connect(socket_.get(), reinterpret_cast<const sockaddr*>(&address), sizeof address);
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) {
    stage_ = Stage::kSend;
    return;
  }
  if (errno == EAGAIN) {  // backlog full: a new socket and another try after kConnectRetry
    socket_.reset();
    return;
  }
  fail(Stage::kConnect, errno_code(errno));
}

void PendingCommand::try_send() {
  while (sent_ < request_.size()) {
    const ssize_t n =
        ::send(socket_.get(), request_.data() + sent_, request_.size() - sent_, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;  // poll for POLLOUT
    if (n < 0) return fail(Stage::kSend, errno_code(errno));
    sent_ += static_cast<std::size_t>(n);
  }
  // The daemon answers once it has the whole line and closes the connection after the
  // reply, as for run_command().
  if (::shutdown(socket_.get(), SHUT_WR) != 0) return fail(Stage::kSend, errno_code(errno));
  stage_ = Stage::kReceive;
}

void PendingCommand::try_receive() {
  char buffer[64 * 1024];
  for (;;) {
    const ssize_t n = ::recv(socket_.get(), buffer, sizeof buffer, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno == EAGAIN) return;  // poll for POLLIN
    if (n < 0) return fail(Stage::kReceive, errno_code(errno));
    if (n == 0) {
      done_ = true;
      socket_.reset();
      return;
    }
    if (reply_.size() + static_cast<std::size_t>(n) > kMaxReplyBytes) {
      return fail(Stage::kReceive, make_error_code(errc::limit_reached));
    }
    reply_.append(buffer, static_cast<std::size_t>(n));
  }
}

void PendingCommand::fail(Stage stage, std::error_code error) {
  stage_ = stage;
  error_ = error;
  done_ = true;
  socket_.reset();
}

CommandResult PendingCommand::take_result() {
  if (!error_) return std::move(reply_);
  CommandFailure failure{stage_, error_};
  failure.received = reply_.size();
  return failure;
}

}  // namespace steptrace::cli
