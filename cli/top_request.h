// `top`'s exchange with the daemon, without ever blocking: the same command and reply as
// run_command() (cli/control_client.h: one connection, the line plus '\n', the writing
// side shut down, the reply read to the end of stream, one deadline for the whole
// exchange), but driven by the caller's own poll(), so that `top` waits for the reply,
// the keyboard and its signals at once: q or Ctrl-C during a slow refresh (a stopped
// daemon, a big table) quits at once instead of after the reply or the timeout.
#pragma once

#include <poll.h>

#include <chrono>
#include <string>

#include "cli/control_client.h"
#include "proto/unique_fd.h"

namespace steptrace::cli {

class PendingCommand {
 public:
  // Starts the exchange (a Unix socket's connect and the short write of a command line
  // return at once, or are retried later). Never throws but for std::bad_alloc.
  PendingCommand(const std::string& socket_path, const std::string& line,
                 std::chrono::milliseconds timeout);
  PendingCommand(const PendingCommand&) = delete;
  PendingCommand& operator=(const PendingCommand&) = delete;

  // What to poll for while !done(): the socket and its events (fd -1 when there is
  // nothing to wait for on it, e.g. between connect retries), and how long at most
  // (milliseconds: the deadline, or the next connect retry).
  pollfd poll_entry() const;
  int poll_timeout_ms() const;

  // Moves the exchange on as far as it goes without waiting (whatever poll() returned,
  // a signal included), and fails it once the deadline has passed.
  void advance();

  bool done() const { return done_; }
  // Once done(): the whole reply, or the failure (as run_command() reports them:
  // errc::timed_out, errc::limit_reached for a reply over kMaxReplyBytes).
  CommandResult take_result();

 private:
  void try_connect();
  void try_send();
  void try_receive();
  void fail(Stage stage, std::error_code error);

  std::string socket_path_;
  std::string request_;
  std::chrono::steady_clock::time_point deadline_;
  proto::UniqueFd socket_;
  Stage stage_ = Stage::kConnect;
  std::size_t sent_ = 0;
  std::string reply_;
  bool done_ = false;
  std::error_code error_;
};

}  // namespace steptrace::cli
