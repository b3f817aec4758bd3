// One client connection of steptraced: the Asio transport around a ClientStream
// (client_stream.h), which decides what the bytes mean and what to answer.
//
// Data flow: Server accepts a Unix stream socket -> Session::start() takes the peer's
// credentials from the kernel (SO_PEERCRED: pid, uid, gid; never a pid the client
// claims) and its start time and comm from /proc, and makes the stream -> reads go into
// the stream's read_buffer() -> what the stream sends is written in order, with at most
// one async_write in flight -> render jobs go to the RenderWorker in the peer uid's turn,
// their text back to the stream (replaced by `error: busy: ...` when the uid's unread
// replies would pass limits.max_pending_reply_bytes_per_uid: the worker's ReplyBytes,
// which send() and the writes keep) -> when the stream finishes and its output is
// written, the socket closes.
// One steady_timer serves the stream's deadlines and this session's write deadline (a
// reply the peer does not read within frame_s closes the connection). Reading pauses
// while the stream does not want input (output backed up, a reply rendering), so memory
// stays bounded. While a deferred reply (trace --for) waits, or a piece of a streamed
// reply (trace) waits for the render thread, the session watches the socket for the
// peer's hang-up (watch_hangup()): a client that closes ends the wait at once, and with
// it the capture, the reply (its piece is then not rendered) and the connection.
// Everything here runs on the io thread (what calls into the stream, and so into the
// Collector, asserts it in debug builds: io_thread.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <sys/socket.h>

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/serve/client_stream.h"

namespace steptrace::daemon {

class Session : public std::enable_shared_from_this<Session>, private StreamTransport {
 public:
  using Socket = boost::asio::local::stream_protocol::socket;
  using Clock = std::chrono::steady_clock;
  using CloseCallback = std::function<void(Session*)>;

  // `cred`: the peer's, read once by the server (peer_credentials); none: pid 0, uid
  // nobody. A `refusal`: the server is over a connection limit; answer the first bytes
  // with an error naming it in the client's dialect and close.
  Session(Socket socket, SessionShared& shared, CloseCallback on_close, std::optional<ucred> cred,
          Refusal refusal = Refusal::kNone);
  ~Session() override;
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void start();
  // Shutdown: applies what a binary peer already sent (what is readable now) until
  // `deadline`, without waiting for more.
  // In two steps, with the io_context's queue run in between: begin_drain() cancels the
  // read in flight, whose handler still applies what it had read (the bytes reached the
  // buffer before the cancel); drain() then reads what is left, without waiting.
  void begin_drain();
  void drain(Clock::time_point deadline);
  void close();

 private:
  // StreamTransport
  void send(std::string bytes) override;
  std::size_t unsent_bytes() const override { return pending_write_bytes_; }
  void render(RenderJob job) override;
  void render_piece(std::shared_ptr<ReplyStream> stream) override;
  void defer(std::chrono::milliseconds delay, std::function<void()> fire) override;

  bool closed() const { return !stream_ || stream_->state() == ClientStream::State::kClosed; }
  std::uint32_t uid() const { return stream_->peer().uid; }
  // `n` bytes queued by send() were written, or will never be (closed).
  void written(std::size_t n);
  // The `error: busy: ...` reply (counted, logged) when `more` reply bytes would take the
  // peer's uid past limits.max_pending_reply_bytes_per_uid.
  std::optional<std::string> over_reply_budget(std::size_t more);
  // After every call into the stream: close when it finished and all is written, else
  // re-arm the timer and read on if it wants input.
  void after_stream();
  void read_more();
  void on_readable(const boost::system::error_code& ec);
  // One recvmsg into the stream's read buffer, without waiting; descriptors passed along
  // (SCM_RIGHTS, protocol version 5) go to the stream first. 0 with `ec` set: would
  // block, end of stream, or an error.
  std::size_t receive(boost::system::error_code& ec);
  // While a deferred reply or a piece waits: an async_wait for an error or hang-up
  // (EPOLLERR, EPOLLHUP), never for readability, see session.cpp.
  void watch_hangup();
  void on_hangup(const boost::system::error_code& ec);
  void write_next();
  void update_timer();
  void on_timeout();

  Socket socket_;
  SessionShared& shared_;
  CloseCallback on_close_;
  std::optional<ucred> cred_;
  Refusal refusal_;
  std::optional<ClientStream> stream_;  // made in start(), once the peer is known

  std::deque<std::string> write_queue_;
  std::size_t pending_write_bytes_ = 0;
  bool writing_ = false;        // an async_write is in flight
  bool reading_ = false;        // an async_wait for input is in flight
  bool draining_ = false;       // begin_drain() cancelled reading for the shutdown drain
  bool deferred_ = false;       // a deferred reply waits (defer() until it fires)
  bool piece_waiting_ = false;  // a piece of a streamed reply is with the RenderWorker
  bool watching_ = false;       // watch_hangup()'s async_wait is in flight

  boost::asio::steady_timer timer_;
  boost::asio::steady_timer defer_timer_;  // a deferred reply (trace --for)
  std::uint64_t timer_generation_ = 0;
  std::optional<Clock::time_point> armed_for_;
  std::optional<Clock::time_point> write_deadline_;
};

// The peer's pid, uid and gid from the kernel (SO_PEERCRED); nullopt when unreadable.
std::optional<ucred> peer_credentials(Session::Socket& socket);

}  // namespace steptrace::daemon
