// One client connection of steptraced: a binary event stream or a text command stream.
//
// Data flow: Server accepts a Unix stream socket -> Session::start() takes the peer's
// credentials from the kernel (SO_PEERCRED: pid, uid, gid; never a pid the client
// claims) and its start time and comm from /proc -> the first byte decides the mode:
//   0xF7 (proto::kMagic[0]) -> binary: bytes are read straight into a proto::Decoder;
//     each validated message goes to the Collector (attach on the hello, then events,
//     step registrations, ledger annotations, dropped counts); a Flush is answered with a
//     FlushAck once everything before it is applied. Any decoder or collector error sends
//     an Error frame (best effort), is counted by kind and logged (rate-limited), and
//     closes only this connection.
//   anything else -> text: lines go to the CommandTable and replies are written in order;
//     a reply that renders state (report, ledger, stats, metrics) is made by the
//     RenderWorker off the io thread, and this session reads and answers nothing more
//     until it is back; after the client's EOF and the last reply, the connection closes.
// Timeouts (one steady_timer): a connection that sends nothing is closed after
// handshake_s; a frame or line that has begun must finish within frame_s of its start;
// a reply the peer does not read within frame_s closes it. Idle binary connections
// between frames stay open. Writes are queued with at most one async_write in flight,
// and reading pauses while too much output is queued, so memory stays bounded.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <system_error>

#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/state/collector.h"
#include "daemon/serve/commands.h"
#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"

namespace steptrace::daemon {

// Logs at most kBurst lines per kind per kWindow; when a window with suppressed lines
// ends, one line says how many were suppressed. Bad clients cannot flood the journal.
class RateLimitedLog {
 public:
  static constexpr unsigned kBurst = 10;
  static constexpr std::chrono::seconds kWindow{10};
  void warn(const std::string& kind, const std::string& message);

 private:
  struct Window {
    std::chrono::steady_clock::time_point start;
    unsigned logged = 0;
    std::uint64_t suppressed = 0;
  };
  std::map<std::string, Window> windows_;
};

// What every session shares; owned by the Server, which outlives its sessions' handlers.
struct SessionShared {
  Collector& collector;
  const Config& config;
  const CommandTable& commands;
  RateLimitedLog& log;
  RenderWorker* renderer = nullptr;  // null: render jobs run on the io thread (tests)
  Environment env;
  std::uint32_t daemon_euid = 0;
  // Set when shutdown begins: sessions start no new asynchronous read, so every byte
  // already read by a completed read is applied by its handler before the final drain.
  bool stopping = false;
};

class Session : public std::enable_shared_from_this<Session> {
 public:
  using Socket = boost::asio::local::stream_protocol::socket;
  using Clock = std::chrono::steady_clock;
  using CloseCallback = std::function<void(Session*)>;

  // `reject`: the server is over max_connections; answer the first bytes with an error
  // in the client's dialect and close.
  Session(Socket socket, SessionShared& shared, CloseCallback on_close, bool reject = false);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  void start();
  // Shutdown: applies what a binary peer already sent (what is readable now) until
  // `deadline`, without waiting for more.
  void drain(Clock::time_point deadline);
  void close();

 private:
  enum class Mode { kUnknown, kBinary, kText };
  static constexpr std::size_t kReadChunk = 64 * 1024;
  static constexpr std::size_t kMaxPendingWrite = 256 * 1024;

  void read_more();
  void on_read(const boost::system::error_code& ec, std::size_t n);
  void on_eof();
  void choose_mode(std::uint8_t first_byte);

  void process_binary();
  std::error_code apply(const proto::Message& message);
  void fail(std::error_code ec);
  void process_text();
  void answer_line(std::string_view line);
  void maybe_finish();

  void queue_write(std::string data);
  void write_next();
  void close_after_writes();

  void update_timer();
  void on_timeout();
  void set_frame_deadline(bool frame_finished);

  std::string describe_peer() const;

  Socket socket_;
  SessionShared& shared_;
  CloseCallback on_close_;
  bool reject_;
  PeerIdentity peer_;
  Mode mode_ = Mode::kUnknown;

  proto::Decoder decoder_;
  std::array<char, 4096> text_buf_{};  // first read and text mode
  std::string line_buf_;
  bool line_too_long_ = false;
  bool awaiting_reply_ = false;  // a render job of this session's is queued or rendering

  ProcessHandle handle_ = 0;
  bool attached_ = false;

  std::deque<std::string> write_queue_;
  std::size_t pending_write_bytes_ = 0;
  bool writing_ = false;
  bool reading_ = false;
  bool eof_ = false;
  bool finishing_ = false;  // close once the write queue is empty; read no more
  bool draining_ = false;
  bool closed_ = false;

  boost::asio::steady_timer timer_;
  std::uint64_t timer_generation_ = 0;
  std::optional<Clock::time_point> armed_for_;
  std::optional<Clock::time_point> handshake_deadline_;
  std::optional<Clock::time_point> frame_deadline_;
  std::optional<Clock::time_point> write_deadline_;
};

}  // namespace steptrace::daemon
