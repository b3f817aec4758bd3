// The protocol side of one client connection, without Asio: what the bytes a peer sends
// mean and what goes back. Session (session.h) is the transport around it: it reads
// into read_buffer(), writes what the stream sends, arms one timer at next_deadline(),
// and closes the socket when the stream says so. Unit tests drive a ClientStream
// directly with a recording transport. client_stream.cpp reads and answers the bytes;
// client_stream_rings.cpp holds the shared-memory rings (passed descriptors,
// RingAttach, drains).
//
// The first byte decides the mode:
//   0xF7 (proto::kMagic[0]) -> binary: bytes go straight into a proto::Decoder; each
//     validated message goes to the Collector (attach on the hello, then events, step
//     registrations, ledger annotations, dropped counts); a Flush is answered with a
//     FlushAck once everything before it is applied.
//   anything else -> text: lines go to the CommandTable and replies are sent in order;
//     a reply that renders state (report, ledger, stats, metrics) is made by the
//     RenderWorker off the io thread, and the stream reads and answers nothing more
//     until it is back. A streamed reply (trace) renders a piece at a time, the next
//     once the client has read the last; a deferred one (trace --for) waits first.
// Every failure takes one path, fail(): count it by kind, log it (rate-limited), send
// the peer an error in its dialect (an Error frame `<errc name>: <description>`, or an
// `error: ...` line), and finish.
//
// Lifecycle (state()):
//
//     kSniffing ──0xF7──────────────▶ kBinary ──────────────┐
//        │ │                            │ shutdown           │ error, EOF, timeout
//        │ └──other byte──▶ kText ◀─────┼──resume─┐          ▼
//        │                   │  render   │         │     kFinishing ──sent──▶ kClosed
//        │                   └──job────▶ │ kAwaitingReply    ▲
//        │                               ▼                   │
//        │                           kDraining ──────────────┼──────────────▶ kClosed
//        └── over max_connections: error reply ──────────────┘
//
// kFinishing reads nothing more; the transport closes once its queue is written.
// Text after the peer's EOF (input_ended()) answers the lines already read, then
// finishes. Any state goes to kClosed when the transport closes (closed()).
//
// Timeouts: a connection that sends nothing is closed after handshake_s; a frame or line
// that has begun must finish within frame_s of its start. Idle binary connections
// between frames stay open. (Writes the peer does not read are the transport's clock;
// it reports them through write_timed_out().)
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>

#include "daemon/serve/commands.h"
#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"
#include "daemon/serve/shared_rings.h"
#include "daemon/state/collector.h"
#include "proto/codec.h"

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

class ClientStream;

// Descriptors clients passed (SCM_RIGHTS) that wait for their RingAttach frame to be
// complete, all connections together; past it a passed descriptor is closed at once and
// its ring refused (the client sends that ring's events on the socket).
inline constexpr std::size_t kMaxPendingRingFds = 32;
// One uid's share of it: a tenant cannot refuse every other tenant's rings.
inline constexpr std::size_t kMaxPendingRingFdsPerUid = 8;

// What every connection shares; owned by the Server, which outlives its sessions.
struct SessionShared {
  Collector& collector;
  ServerCounters& counters;  // the Server's: bytes, frames, protocol errors, commands
  const Config& config;
  const CommandTable& commands;
  RateLimitedLog& log;
  RenderWorker* renderer = nullptr;  // null: render jobs run on the io thread (tests)
  Environment env;
  std::uint32_t daemon_euid = 0;
  // Set when shutdown begins: sessions start no new asynchronous read, so every byte
  // already read by a completed read is applied by its handler before the final drain.
  bool stopping = false;
  // Shared-memory rings: the bytes every connection maps, the streams that map any (the
  // server's ring timer drains them), and the server's hook that starts that timer.
  RingBudget ring_budget{};
  std::size_t pending_fds = 0;                                // <= kMaxPendingRingFds
  std::map<std::uint32_t, std::size_t> pending_fds_by_uid{};  // each <= kMaxPendingRingFdsPerUid
  std::set<ClientStream*> ring_streams{};
  // A ring was mapped: the server reads the rings within 1 ms (Server::schedule_ring_drain).
  std::function<void()> rings_active{};
};

// Drains every connection's shared-memory rings into the collector (the ring timer, and
// before a text command is answered); returns the events read.
std::uint64_t drain_all_rings(SessionShared& shared);

// What a ClientStream needs from the connection it runs on.
class StreamTransport {
 public:
  virtual ~StreamTransport() = default;
  // Queues bytes for the peer, in order.
  virtual void send(std::string bytes) = 0;
  // Bytes sent and not yet written to the socket.
  virtual std::size_t unsent_bytes() const = 0;
  // Renders `job` (off the io thread) and hands the text to ClientStream::rendered().
  virtual void render(RenderJob job) = 0;
  // Renders the next piece of `stream` (off the io thread) and hands it to
  // ClientStream::piece_rendered().
  virtual void render_piece(std::shared_ptr<ReplyStream> stream) = 0;
  // Calls `fire` on the io thread after `delay`, unless the connection closes first
  // (then `fire` is destroyed uncalled).
  virtual void defer(std::chrono::milliseconds delay, std::function<void()> fire) = 0;
};

// An Error frame (PROTOCOL.md 4.9) with `message` cut to the field's size.
std::string error_frame(proto::ErrorCode code, std::string_view message);

// Why the server refuses a connection it accepted (answered, then closed).
enum class Refusal : std::uint8_t {
  kNone,
  kMaxConnections,        // limits.max_connections connections are open
  kMaxConnectionsPerUid,  // the peer's uid has limits.max_connections_per_uid open
};

class ClientStream {
 public:
  using Clock = std::chrono::steady_clock;
  enum class State {
    kSniffing,       // nothing read yet
    kBinary,         // decoding frames
    kText,           // answering command lines
    kAwaitingReply,  // text: a render job is out; nothing more is read or answered
    kFinishing,      // an error or the end: read no more, close once sent
    kDraining,       // binary, shutting down: apply what was sent, answer nothing new
    kClosed,         // the transport closed the connection
  };
  // Output queued beyond this pauses reading and answering until it is written.
  static constexpr std::size_t kMaxPendingWrite = 256 * 1024;
  // Replies waiting for their clients to read them, all connections together: past it a
  // rendered reply is replaced by an error (the client may retry), so clients that ask
  // for big reports and never read them cannot pile up the daemon's memory. A reply is
  // always sent when nothing else waits, however big.
  static constexpr std::size_t kMaxPendingOutputTotal = std::size_t{256} << 20;

  // `peer` comes from the kernel (SO_PEERCRED, /proc). A `refusal`: the server is over
  // one of its connection limits; the first bytes are answered with an error naming it,
  // in the peer's dialect.
  ClientStream(SessionShared& shared, StreamTransport& transport, PeerIdentity peer,
               Refusal refusal, Clock::time_point now);
  ~ClientStream();
  ClientStream(const ClientStream&) = delete;
  ClientStream& operator=(const ClientStream&) = delete;

  State state() const { return state_; }
  // True when the transport should read more now (not finishing, not awaiting a
  // reply, not after EOF, output not backed up).
  bool wants_input() const;
  // Where the next read lands, and how much it may hold.
  std::span<char> read_buffer();
  // `n` bytes were read into read_buffer().
  void received(std::size_t n);
  // The peer sends no more (EOF or a reset).
  void input_ended();
  // Descriptors the peer passed (SCM_RIGHTS) with the bytes about to be received(): each
  // belongs to the next RingAttach frame. Owned (closed) from here on. `truncated`: the
  // kernel dropped some (MSG_CTRUNC).
  void received_fds(std::span<const int> fds, bool truncated);
  // Folds what this connection's shared-memory rings hold; the events read.
  std::uint64_t drain_rings();
  // The reply of the render job handed to StreamTransport::render(). Sent at once; the
  // lines after it wait for resume().
  void rendered(std::string text);
  // A piece of a streamed reply (ReplyStream); `more`: pieces follow. The next piece is
  // asked for once the output is no longer backed up (resume()).
  void piece_rendered(std::string text, bool more);
  // Room again (output written, or a reply back): text answers the lines that waited,
  // and after the peer's EOF finishes.
  void resume();

  // The earliest handshake or frame deadline, if any; on_timer() when it passes.
  std::optional<Clock::time_point> next_deadline() const;
  void on_timer(Clock::time_point now);
  // The peer did not read a reply within frame_s (the transport's clock).
  void write_timed_out();

  // Shutdown: stop reading asynchronously. True when the transport should read what is
  // readable now into read_buffer() and hand it to received() (binary or not yet known).
  bool begin_drain();
  // The transport closed: detach from the collector. Nothing is sent after this.
  void closed();

  const PeerIdentity& peer() const { return peer_; }
  std::string describe_peer() const;
  // The collector's handle for this process, from its hello on.
  std::optional<ProcessHandle> handle() const { return handle_; }
  // What finished the stream because of its input (empty otherwise).
  std::error_code failure() const { return failure_; }

 private:
  void choose_mode(std::uint8_t first_byte);
  void process_binary();
  // `at`: the message's place in a Batch (protocol version 7), if any.
  std::error_code apply(const proto::Message& message, proto::BatchPosition at = {});
  bool peer_pid_reused() const;
  bool rejected() const { return refusal_ != Refusal::kNone; }
  void process_text();
  void answer_line(std::string_view line);
  void answer(Reply reply);
  void await_reply();
  void request_piece();
  void maybe_finish();
  void set_frame_deadline(bool frame_finished);
  // Shared-memory rings (protocol version 5).
  std::error_code attach_ring(const proto::RingAttach& attach);
  SharedRings& rings();
  std::uint64_t drain_rings(SharedRings::Pass pass, std::optional<std::uint32_t> thread = {},
                            std::uint64_t until_ns = UINT64_MAX);
  // The process's drops: the last DroppedByCause plus what the rings' headers say.
  void update_drops();
  void close_pending_fds();
  // A pending descriptor leaves the reserve (closed, or taken by a RingAttach).
  void fd_taken(int fd, bool close);
  bool output_backed_up() const { return transport_.unsent_bytes() >= kMaxPendingWrite; }
  // Counts `kind`, logs `log_line` about the peer (rate-limited), sends `reply` (may be
  // empty) and finishes. The one way a connection ends because of its input.
  void fail(const std::string& kind, const std::string& log_line, std::string reply);
  // fail() for an error code: the reply is an Error frame in binary mode.
  void fail(std::error_code ec, const std::string& detail = {});

  SessionShared& shared_;
  StreamTransport& transport_;
  PeerIdentity peer_;
  Refusal refusal_;
  State state_ = State::kSniffing;
  enum class Dialect { kUnknown, kBinary, kText };
  Dialect dialect_ = Dialect::kUnknown;  // known from the first byte on
  bool input_ended_ = false;             // the peer sent EOF

  proto::Decoder decoder_;
  std::array<char, 4096> text_buf_{};  // first read and text mode
  std::string line_buf_;
  std::optional<ProcessHandle> handle_;        // attached to the collector since the hello
  std::shared_ptr<ReplyStream> reply_stream_;  // a streamed reply going out
  bool piece_out_ = false;                     // a piece of it is rendering
  std::error_code failure_;
  std::unique_ptr<SharedRings> rings_;   // from the first RingAttach or ClockSync on
  std::deque<int> pending_fds_;          // received, not yet taken by a RingAttach
  proto::DroppedByCause frame_drops_{};  // the last DroppedByCause frame

  std::optional<Clock::time_point> handshake_deadline_;
  std::optional<Clock::time_point> frame_deadline_;
  std::optional<Clock::time_point> idle_deadline_;  // text mode, waiting for a command
};

}  // namespace steptrace::daemon
