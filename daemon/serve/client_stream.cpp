#include "daemon/serve/client_stream.h"

#include "proto/printable.h"

#include <spdlog/spdlog.h>

#include <utility>
#include <variant>

namespace steptrace::daemon {
namespace {

std::string error_name(std::error_code ec) {
  if (ec.category() == steptrace_category()) return errc_name(static_cast<errc>(ec.value()));
  return "other";
}

proto::ErrorCode wire_code(std::error_code ec) {
  if (ec == errc::unsupported_version) return proto::ErrorCode::kUnsupportedVersion;
  if (ec == errc::limit_reached) return proto::ErrorCode::kLimit;
  return proto::ErrorCode::kProtocol;
}

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

constexpr std::size_t kReadChunk = 64 * 1024;

}  // namespace

std::string error_frame(proto::ErrorCode code, std::string_view message) {
  std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::ErrorReport)> buf{};
  proto::Encoder encoder(buf);
  encoder.error(code, message);
  return {reinterpret_cast<const char*>(buf.data()), encoder.size()};
}

// ---- RateLimitedLog ----------------------------------------------------------------

void RateLimitedLog::warn(const std::string& kind, const std::string& message) {
  const auto now = std::chrono::steady_clock::now();
  auto [it, inserted] = windows_.try_emplace(kind);
  Window& w = it->second;
  if (inserted || now - w.start >= kWindow) {
    if (w.suppressed > 0) {
      spdlog::warn("{} similar '{}' messages suppressed in the last {} s", w.suppressed, kind,
                   std::chrono::duration_cast<std::chrono::seconds>(now - w.start).count());
    }
    w = Window{now, 0, 0};
  }
  if (w.logged < kBurst) {
    ++w.logged;
    spdlog::warn("{}", message);
  } else {
    ++w.suppressed;
  }
}

// ---- ClientStream ------------------------------------------------------------------

ClientStream::ClientStream(SessionShared& shared, StreamTransport& transport, PeerIdentity peer,
                           Refusal refusal, Clock::time_point now)
    : shared_(shared),
      transport_(transport),
      peer_(std::move(peer)),
      refusal_(refusal),
      decoder_(proto::Side::kDaemon, shared.config.server_limits.max_frame_bytes),
      handshake_deadline_(now + std::chrono::seconds(shared.config.timeouts.handshake_s)) {}

ClientStream::~ClientStream() {
  close_pending_fds();
  if (rings_) shared_.ring_streams.erase(this);
}

std::string ClientStream::describe_peer() const {
  // The comm is the client's choice (any bytes but NUL): never raw into the log.
  return "pid " + std::to_string(peer_.key.pid) + " (" +
         (peer_.comm.empty() ? "?" : proto::printable(peer_.comm, 16)) + ", uid " +
         std::to_string(peer_.uid) + ")";
}

bool ClientStream::wants_input() const {
  const bool reading_state =
      state_ == State::kSniffing || state_ == State::kBinary || state_ == State::kText;
  return reading_state && !input_ended_ && !output_backed_up();
}

std::span<char> ClientStream::read_buffer() {
  if (dialect_ == Dialect::kBinary && !rejected()) {
    const auto space = decoder_.prepare(kReadChunk);
    return {reinterpret_cast<char*>(space.data()), space.size()};
  }
  return text_buf_;
}

void ClientStream::received(std::size_t n) {
  if (state_ == State::kFinishing || state_ == State::kClosed || n == 0) return;
  if (dialect_ == Dialect::kUnknown) {
    handshake_deadline_.reset();
    choose_mode(static_cast<std::uint8_t>(text_buf_[0]));
    if (state_ == State::kFinishing) return;
    if (dialect_ == Dialect::kBinary) {
      decoder_.feed(std::as_bytes(std::span(text_buf_.data(), n)));
    } else {
      close_pending_fds();  // a text connection has no use for descriptors
      line_buf_.append(text_buf_.data(), n);
    }
  } else if (dialect_ == Dialect::kBinary) {
    decoder_.commit(n);
  } else {
    line_buf_.append(text_buf_.data(), n);
  }
  if (dialect_ == Dialect::kBinary) {
    shared_.counters.bytes_received += n;
    process_binary();
    // Every frame of the read is decoded and none is cut: a descriptor still waiting came
    // without a RingAttach to take it (an honest library passes none such).
    if (!pending_fds_.empty() && decoder_.buffered() == 0 &&
        (state_ == State::kBinary || state_ == State::kDraining)) {
      close_pending_fds();
      fail(make_error_code(errc::bad_ring), "a descriptor without a RingAttach frame to take it");
    }
  } else {
    process_text();
  }
}

void ClientStream::choose_mode(std::uint8_t first_byte) {
  dialect_ = first_byte == proto::kMagic[0] ? Dialect::kBinary : Dialect::kText;
  if (rejected()) {
    const auto& limits = shared_.config.server_limits;
    const std::string why =
        refusal_ == Refusal::kMaxConnectionsPerUid
            ? "too many connections from uid " + std::to_string(peer_.uid) +
                  " (max_connections_per_uid=" + std::to_string(limits.max_connections_per_uid) +
                  ")"
            : "too many connections (max_connections=" + std::to_string(limits.max_connections) +
                  ")";
    transport_.send(dialect_ == Dialect::kBinary ? error_frame(proto::ErrorCode::kLimit, why)
                                                 : "error: " + why + "\n");
    state_ = State::kFinishing;
    return;
  }
  if (state_ == State::kDraining) {
    // Commands are not answered while stopping; binary input is still applied.
    if (dialect_ == Dialect::kText) state_ = State::kFinishing;
    return;
  }
  state_ = dialect_ == Dialect::kBinary ? State::kBinary : State::kText;
}

void ClientStream::input_ended() {
  if (state_ == State::kFinishing || state_ == State::kClosed) return;
  input_ended_ = true;
  handshake_deadline_.reset();
  if (rejected() || dialect_ == Dialect::kUnknown) {
    state_ = State::kFinishing;
    return;
  }
  if (dialect_ == Dialect::kBinary) {
    if (const auto ec = decoder_.finish(); ec && !decoder_.failed()) {
      failure_ = ec;
      fail(error_name(ec),
           ec.message() + " (" + std::to_string(decoder_.buffered()) + " bytes left)", {});
      return;
    }
    frame_deadline_.reset();
    state_ = State::kFinishing;
    return;
  }
  process_text();
  maybe_finish();
}

// ---- failing -----------------------------------------------------------------------

void ClientStream::fail(const std::string& kind, const std::string& log_line, std::string reply) {
  ++shared_.counters.protocol_errors[kind];
  shared_.log.warn(kind, "client " + describe_peer() + ": " + log_line + "; connection closed");
  handshake_deadline_.reset();
  frame_deadline_.reset();
  idle_deadline_.reset();
  if (!reply.empty()) transport_.send(std::move(reply));
  state_ = State::kFinishing;
}

void ClientStream::fail(std::error_code ec, const std::string& detail) {
  failure_ = ec;
  const std::string name = error_name(ec);
  const std::string what = detail.empty() ? ec.message() : detail;
  std::string reply;
  if (dialect_ == Dialect::kBinary) {
    const proto::ErrorCode code = wire_code(ec);
    // Code 1 names the broken rule first (`<errc name>: ...`, PROTOCOL.md 4.9); code 2
    // is exactly "unsupported protocol version".
    reply = error_frame(code, code == proto::ErrorCode::kProtocol ? name + ": " + what : what);
  } else if (dialect_ == Dialect::kText) {
    reply = "error: " + what + "\n";
  }
  fail(name, what + " [" + name + "]", std::move(reply));
}

// ---- binary ------------------------------------------------------------------------

void ClientStream::process_binary() {
  bool frame_finished = false;
  while (state_ == State::kBinary || state_ == State::kDraining) {
    auto result = decoder_.next();
    if (result.error) {
      fail(result.error);
      return;
    }
    if (!result.message) break;
    frame_finished = true;
    if (std::holds_alternative<proto::Hello>(*result.message) && peer_pid_reused()) {
      fail(make_error_code(errc::permission_denied),
           "pid " + std::to_string(peer_.key.pid) +
               " runs another process than the one that connected (pid reused)");
      return;
    }
    if (!std::holds_alternative<proto::Hello>(*result.message)) {
      ++shared_.counters.frames_received;
    }
    if (const auto ec = apply(*result.message, result.batch)) {
      fail(ec);
      return;
    }
  }
  set_frame_deadline(frame_finished);
}

std::error_code ClientStream::apply(const proto::Message& message, proto::BatchPosition at) {
  Collector& collector = shared_.collector;
  // The decoder yields a hello first and only once, so every other message has a handle.
  const ProcessHandle handle = handle_.value_or(0);
  // A frame of a batch applied before (resent after a lost connection): skipped, but a
  // Flush is answered again, since the client waits for its ack to let the batch go.
  if (at.sequence != 0 && !collector.batch_frame(handle, at.sequence, at.index) &&
      !std::holds_alternative<proto::FlushRequest>(message)) {
    if (const auto* events = std::get_if<proto::EventSpan>(&message)) {
      collector.resent_events_skipped(handle, events->size());
    }
    return {};
  }
  return std::visit(
      Overloaded{
          [&](const proto::Hello& hello) -> std::error_code {
            ProcessHandle attached = 0;
            if (auto ec = collector.attach(peer_, attached)) return ec;
            handle_ = attached;
            collector.hello(attached, hello);
            return {};
          },
          [&](const proto::EventSpan& events) { return collector.events(handle, events); },
          [&](const proto::RegisterStep& step) {
            if (rings_) rings_->step_registered();
            return collector.register_step(handle, step);
          },
          [&](const proto::LedgerRecord& record) -> std::error_code {
            // The ring of the record's thread first, up to the record's stamp: the
            // events before it come before it, as on the socket path.
            if (rings_)
              drain_rings(SharedRings::Pass::kLive, record.thread_id, record.timestamp_ns);
            collector.ledger(handle, record);
            return {};
          },
          [&](const proto::DroppedReport& dropped) -> std::error_code {
            collector.dropped(handle, dropped.total_dropped);
            return {};
          },
          [&](const proto::DroppedByCause& causes) -> std::error_code {
            frame_drops_ = causes;
            update_drops();
            return {};
          },
          [&](const proto::RingAttach& attach) { return attach_ring(attach); },
          [&](const proto::ClockSync& clock) -> std::error_code {
            rings().set_clock(clock);
            return {};
          },
          [&](const proto::Identity& identity) -> std::error_code {
            collector.identity(handle, identity);
            return {};
          },
          [&](const proto::Delivered& delivered) -> std::error_code {
            collector.delivered(handle, delivered.events);
            return {};
          },
          // The decoder numbers the frames after it (DecodeResult::batch).
          [&](const proto::Batch&) -> std::error_code { return {}; },
          [&](const proto::FlushRequest& flush) -> std::error_code {
            // Everything the process published before it asked is folded before the ack.
            if (rings_) drain_rings(SharedRings::Pass::kLive);
            std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::FlushAck)> buf{};
            proto::Encoder encoder(buf);
            encoder.flush_ack(flush.sequence);
            transport_.send({reinterpret_cast<const char*>(buf.data()), encoder.size()});
            return {};
          },
          // The daemon-side decoder never yields these.
          [&](const proto::FlushAck&) -> std::error_code { return errc::unknown_frame_type; },
          [&](const proto::ErrorReport&) -> std::error_code { return errc::unknown_frame_type; },
          [&](const proto::RingAck&) -> std::error_code { return errc::unknown_frame_type; },
      },
      message);
}

void ClientStream::set_frame_deadline(bool frame_finished) {
  const bool partial = dialect_ == Dialect::kBinary ? decoder_.buffered() > 0 : !line_buf_.empty();
  // While replies back up, the daemon itself stopped reading: what waits is on the write
  // deadline (a client that does not read), not on the client's sending.
  const bool paused = output_backed_up() || state_ == State::kAwaitingReply;
  const bool reading = state_ == State::kBinary || state_ == State::kText;
  if (!partial || !reading || paused) {
    frame_deadline_.reset();
  } else if (frame_finished || !frame_deadline_) {
    // A new frame (or line) began in this read: its clock starts now and is not
    // extended by later bytes of the same frame.
    frame_deadline_ = Clock::now() + std::chrono::seconds(shared_.config.timeouts.frame_s);
  }
}

// The peer's start time was read when the connection was accepted. If its pid now runs
// another process, the one that connected is gone and someone else holds its socket (an
// inherited descriptor): nothing it sends may be credited to either process.
bool ClientStream::peer_pid_reused() const {
  if (peer_.key.pid <= 0 || peer_.key.start_time == 0 || !shared_.env.probe) return false;
  const auto probe = shared_.env.probe(peer_.key.pid);
  return probe && probe->error == 0 && probe->start_time != peer_.key.start_time;
}

// ---- text --------------------------------------------------------------------------

void ClientStream::process_text() {
  bool line_finished = false;
  bool too_long = false;
  const std::size_t max_line = shared_.config.server_limits.max_line_bytes;
  while (state_ == State::kText && !output_backed_up()) {
    const auto nl = line_buf_.find('\n');
    if (nl == std::string::npos) break;
    line_finished = true;
    if (nl > max_line) {
      too_long = true;
      break;
    }
    const std::string line = line_buf_.substr(0, nl);
    line_buf_.erase(0, nl + 1);
    answer_line(line);
  }
  // Waiting for a command (nothing partial, no reply out): the idle clock runs, so a
  // tenant cannot hold connection slots with text connections that never speak again.
  if (state_ == State::kText && line_buf_.empty() && !output_backed_up()) {
    if (line_finished || !idle_deadline_) {
      idle_deadline_ =
          Clock::now() + std::chrono::milliseconds(shared_.config.timeouts.text_idle_ms);
    }
  } else {
    idle_deadline_.reset();
  }
  if (state_ != State::kFinishing && state_ != State::kClosed &&
      (too_long || (line_buf_.find('\n') == std::string::npos && line_buf_.size() > max_line))) {
    line_buf_.clear();
    fail(kLineTooLongKind, "command line longer than " + std::to_string(max_line) + " bytes",
         "error: line too long\n");
    return;
  }
  set_frame_deadline(line_finished);
}

void ClientStream::answer_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.find_first_not_of(" \t") == std::string_view::npos) return;  // blank: no reply
  ++shared_.counters.commands_served;
  // Reports show what the rings hold now, not as of the ring timer's last pass.
  drain_all_rings(shared_);
  const CommandContext context{shared_.collector,
                               peer_.uid,
                               shared_.daemon_euid,
                               &peer_,
                               shared_.config.server_limits.max_pending_traces_per_uid,
                               &shared_.config.overhead_rules};
  answer(shared_.commands.dispatch(line, context));
}

void ClientStream::await_reply() {
  state_ = State::kAwaitingReply;
  // Nothing is read while the reply is out (a trace may take minutes): a line the client
  // left unfinished before EOF must not time the connection out under its own reply.
  idle_deadline_.reset();
  frame_deadline_.reset();
}

void ClientStream::answer(Reply reply) {
  if (reply.deferred) {
    await_reply();
    transport_.defer(reply.deferred->delay, [this, make = std::move(reply.deferred->make)] {
      if (state_ != State::kAwaitingReply) return;
      state_ = State::kText;
      answer(make());
    });
    return;
  }
  if (reply.stream) {
    await_reply();
    reply_stream_ = std::move(reply.stream);
    request_piece();
    return;
  }
  if (!reply.render) {
    transport_.send(std::move(reply.text));
    return;
  }
  await_reply();
  transport_.render(std::move(reply.render));
}

void ClientStream::request_piece() {
  piece_out_ = true;
  transport_.render_piece(reply_stream_);
}

void ClientStream::piece_rendered(std::string text, bool more) {
  if (state_ != State::kAwaitingReply || !reply_stream_) return;
  piece_out_ = false;
  transport_.send(std::move(text));
  if (!more) {
    reply_stream_->finished();
    reply_stream_.reset();
    state_ = State::kText;
  }
}

void ClientStream::rendered(std::string text) {
  if (state_ != State::kAwaitingReply) return;
  state_ = State::kText;
  // Every session's reply bytes the sockets have not taken (Session::send keeps it).
  const std::uint64_t waiting = shared_.counters.reply_bytes_pending;
  if (waiting != 0 && waiting + text.size() > kMaxPendingOutputTotal) {
    ++shared_.counters.replies_refused;
    shared_.log.warn("replies_refused", "reply of " + std::to_string(text.size()) + " bytes to " +
                                            describe_peer() +
                                            " refused: " + std::to_string(waiting) +
                                            " bytes of replies wait to be read");
    text = "error: busy: " + std::to_string(waiting >> 20) +
           " MiB of replies wait for their clients to read them (limit " +
           std::to_string(kMaxPendingOutputTotal >> 20) + " MiB); retry, or ask for less\n";
  }
  transport_.send(std::move(text));
}

void ClientStream::resume() {
  if (state_ == State::kAwaitingReply && reply_stream_ && !piece_out_ && !output_backed_up()) {
    request_piece();
    return;
  }
  if (state_ != State::kText) return;
  process_text();
  maybe_finish();
}

void ClientStream::maybe_finish() {
  if (!input_ended_ || state_ != State::kText) return;
  if (line_buf_.find('\n') != std::string::npos) return;  // more lines wait for room
  if (!line_buf_.empty()) {
    // The last line had no '\n' (`printf ping | socat ...`): answer it too.
    const std::string line = std::move(line_buf_);
    line_buf_.clear();
    answer_line(line);
    if (state_ != State::kText) return;  // its reply is rendering: finish after it
  }
  frame_deadline_.reset();
  idle_deadline_.reset();
  state_ = State::kFinishing;
}

// ---- timeouts ----------------------------------------------------------------------

std::optional<ClientStream::Clock::time_point> ClientStream::next_deadline() const {
  if (state_ == State::kClosed) return std::nullopt;
  std::optional<Clock::time_point> next;
  for (const auto& deadline : {handshake_deadline_, frame_deadline_, idle_deadline_}) {
    if (deadline && (!next || *deadline < *next)) next = deadline;
  }
  return next;
}

void ClientStream::on_timer(Clock::time_point now) {
  if (state_ == State::kFinishing || state_ == State::kClosed) return;
  const auto& timeouts = shared_.config.timeouts;
  if (handshake_deadline_ && *handshake_deadline_ <= now) {
    failure_ = errc::timed_out;
    fail(errc_name(errc::timed_out),
         "sent nothing within " + std::to_string(timeouts.handshake_s) + " s", {});
    return;
  }
  if (frame_deadline_ && *frame_deadline_ <= now) {
    const std::string what = dialect_ == Dialect::kBinary ? "frame" : "line";
    fail(errc::timed_out,
         what + " not completed within " + std::to_string(timeouts.frame_s) + " s");
    return;
  }
  if (idle_deadline_ && *idle_deadline_ <= now && state_ == State::kText) {
    fail(errc::timed_out, "no command within " + std::to_string(timeouts.text_idle_ms) +
                              " ms (timeouts.text_idle_ms)");
  }
}

void ClientStream::write_timed_out() {
  if (state_ == State::kClosed) return;
  fail(kWriteTimeoutKind,
       "did not read a reply within " + std::to_string(shared_.config.timeouts.frame_s) + " s", {});
}

// ---- shutdown ----------------------------------------------------------------------

bool ClientStream::begin_drain() {
  if (rejected() || input_ended_) return false;
  if (state_ != State::kSniffing && state_ != State::kBinary) return false;
  state_ = State::kDraining;
  handshake_deadline_.reset();
  frame_deadline_.reset();
  idle_deadline_.reset();
  return true;
}

void ClientStream::closed() {
  // The daemon stopping with the process still connected (it sent no EOF): its rings go
  // back to it with what waits for a registration, for the next daemon.
  const bool handing_over = state_ == State::kDraining && !input_ended_;
  state_ = State::kClosed;
  reply_stream_.reset();
  handshake_deadline_.reset();
  frame_deadline_.reset();
  idle_deadline_.reset();
  close_pending_fds();
  if (handle_) {
    const ProcessHandle handle = *handle_;
    // The process may be dead: its rings are all that is left of what it recorded.
    if (rings_) {
      drain_rings(handing_over ? SharedRings::Pass::kHandOver : SharedRings::Pass::kFinal);
      update_drops();
      shared_.ring_streams.erase(this);
      rings_.reset();
    }
    handle_.reset();
    shared_.collector.detach(handle);
  }
  if (rings_) {
    shared_.ring_streams.erase(this);
    rings_.reset();
  }
}

}  // namespace steptrace::daemon
