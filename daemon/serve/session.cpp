#include "daemon/serve/session.h"

#include <sys/socket.h>

#include <spdlog/spdlog.h>
#include <boost/asio/write.hpp>

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

std::string error_frame(proto::ErrorCode code, std::string_view message) {
  std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::ErrorReport)> buf{};
  proto::Encoder encoder(buf);
  encoder.error(code, message);
  return {reinterpret_cast<const char*>(buf.data()), encoder.size()};
}

template <class... Ts>
struct Overloaded : Ts... {
  using Ts::operator()...;
};
template <class... Ts>
Overloaded(Ts...) -> Overloaded<Ts...>;

}  // namespace

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

// ---- Session -----------------------------------------------------------------------

Session::Session(Socket socket, SessionShared& shared, CloseCallback on_close, bool reject)
    : socket_(std::move(socket)),
      shared_(shared),
      on_close_(std::move(on_close)),
      reject_(reject),
      decoder_(proto::Side::kDaemon, shared.config.server_limits.max_frame_bytes),
      timer_(socket_.get_executor()) {}

Session::~Session() = default;

void Session::start() {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(socket_.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0) {
    peer_.key.pid = cred.pid;
    peer_.uid = cred.uid;
    peer_.gid = cred.gid;
    // Probe now, while the peer surely lives: its start time tells a recycled pid apart.
    if (cred.pid > 0 && shared_.env.probe) {
      if (auto probe = shared_.env.probe(cred.pid)) {
        peer_.key.start_time = probe->start_time;
        peer_.comm = probe->comm;
      }
    }
  } else {
    // No credentials: the peer stays pid 0, uid nobody; it may not reset anything.
    peer_.uid = 65534;
    peer_.gid = 65534;
  }
  handshake_deadline_ = Clock::now() + std::chrono::seconds(shared_.config.timeouts.handshake_s);
  update_timer();
  read_more();
}

std::string Session::describe_peer() const {
  return "pid " + std::to_string(peer_.key.pid) + " (" + (peer_.comm.empty() ? "?" : peer_.comm) +
         ", uid " + std::to_string(peer_.uid) + ")";
}

// ---- reading -----------------------------------------------------------------------

void Session::read_more() {
  if (reading_ || closed_ || finishing_ || eof_ || draining_ || shared_.stopping ||
      awaiting_reply_) {
    return;
  }
  if (pending_write_bytes_ >= kMaxPendingWrite) return;  // resumed when writes drain
  reading_ = true;
  auto self = shared_from_this();
  auto handler = [self](const boost::system::error_code& ec, std::size_t n) {
    self->on_read(ec, n);
  };
  if (mode_ == Mode::kBinary && !reject_) {
    auto space = decoder_.prepare(kReadChunk);
    socket_.async_read_some(boost::asio::buffer(space.data(), space.size()), handler);
  } else {
    socket_.async_read_some(boost::asio::buffer(text_buf_), handler);
  }
}

void Session::on_read(const boost::system::error_code& ec, std::size_t n) {
  reading_ = false;
  if (closed_ || draining_) return;
  if (ec) {
    // EOF or a reset: either way the peer sends no more.
    on_eof();
    return;
  }
  if (mode_ == Mode::kUnknown) {
    handshake_deadline_.reset();
    choose_mode(static_cast<std::uint8_t>(text_buf_[0]));
    if (closed_ || finishing_) return;
    if (mode_ == Mode::kBinary) {
      decoder_.feed(std::as_bytes(std::span(text_buf_.data(), n)));
    } else {
      line_buf_.append(text_buf_.data(), n);
    }
  } else if (mode_ == Mode::kBinary) {
    decoder_.commit(n);
  } else {
    line_buf_.append(text_buf_.data(), n);
  }
  if (mode_ == Mode::kBinary) {
    shared_.collector.counters().bytes_received += n;
    process_binary();
  } else {
    process_text();
  }
  read_more();
}

void Session::choose_mode(std::uint8_t first_byte) {
  mode_ = first_byte == proto::kMagic[0] ? Mode::kBinary : Mode::kText;
  if (!reject_) return;
  const std::string why = "too many connections (max_connections=" +
                          std::to_string(shared_.config.server_limits.max_connections) + ")";
  queue_write(mode_ == Mode::kBinary ? error_frame(proto::ErrorCode::kLimit, why)
                                     : "error: " + why + "\n");
  close_after_writes();
}

void Session::on_eof() {
  eof_ = true;
  if (reject_ || mode_ == Mode::kUnknown) {
    close_after_writes();
    return;
  }
  if (mode_ == Mode::kBinary) {
    if (const auto ec = decoder_.finish(); ec && !decoder_.failed()) {
      ++shared_.collector.counters().protocol_errors[error_name(ec)];
      shared_.log.warn(error_name(ec), "client " + describe_peer() + ": " + ec.message() + " (" +
                                           std::to_string(decoder_.buffered()) +
                                           " bytes left); connection closed");
    }
    frame_deadline_.reset();
    update_timer();
    close_after_writes();
    return;
  }
  process_text();
  maybe_finish();
}

// ---- binary ------------------------------------------------------------------------

void Session::process_binary() {
  bool frame_finished = false;
  while (!finishing_ && !closed_) {
    auto result = decoder_.next();
    if (result.error) {
      fail(result.error);
      return;
    }
    if (!result.message) break;
    frame_finished = true;
    if (!std::holds_alternative<proto::Hello>(*result.message)) {
      ++shared_.collector.counters().frames_received;
    }
    if (const auto ec = apply(*result.message)) {
      fail(ec);
      return;
    }
  }
  set_frame_deadline(frame_finished);
}

std::error_code Session::apply(const proto::Message& message) {
  Collector& collector = shared_.collector;
  return std::visit(
      Overloaded{
          [&](const proto::Hello& hello) -> std::error_code {
            if (auto ec = collector.attach(peer_, handle_)) return ec;
            attached_ = true;
            collector.hello(handle_, hello);
            return {};
          },
          [&](const proto::EventSpan& events) { return collector.events(handle_, events); },
          [&](const proto::RegisterStep& step) { return collector.register_step(handle_, step); },
          [&](const proto::LedgerRecord& record) -> std::error_code {
            collector.ledger(handle_, record);
            return {};
          },
          [&](const proto::DroppedReport& dropped) -> std::error_code {
            collector.dropped(handle_, dropped.total_dropped);
            return {};
          },
          [&](const proto::DroppedByCause& causes) -> std::error_code {
            collector.dropped_by_cause(handle_, causes);
            return {};
          },
          [&](const proto::FlushRequest& flush) -> std::error_code {
            std::array<std::byte, sizeof(proto::FrameHeader) + sizeof(proto::FlushAck)> buf{};
            proto::Encoder encoder(buf);
            encoder.flush_ack(flush.sequence);
            queue_write({reinterpret_cast<const char*>(buf.data()), encoder.size()});
            return {};
          },
          // The daemon-side decoder never yields these.
          [&](const proto::FlushAck&) -> std::error_code { return errc::unknown_frame_type; },
          [&](const proto::ErrorReport&) -> std::error_code { return errc::unknown_frame_type; },
      },
      message);
}

void Session::fail(std::error_code ec) {
  const std::string name = error_name(ec);
  ++shared_.collector.counters().protocol_errors[name];
  shared_.log.warn(name, "client " + describe_peer() + ": " + ec.message() + " [" + name +
                             "]; connection closed");
  queue_write(error_frame(wire_code(ec), ec.message()));
  frame_deadline_.reset();
  close_after_writes();
}

void Session::set_frame_deadline(bool frame_finished) {
  const bool partial = mode_ == Mode::kBinary ? decoder_.buffered() > 0 : !line_buf_.empty();
  // While replies back up, the daemon itself stopped reading: what waits is on the write
  // deadline (a client that does not read), not on the client's sending.
  const bool paused = pending_write_bytes_ >= kMaxPendingWrite || awaiting_reply_;
  if (!partial || finishing_ || paused) {
    frame_deadline_.reset();
  } else if (frame_finished || !frame_deadline_) {
    // A new frame (or line) began in this read: its clock starts now and is not
    // extended by later bytes of the same frame.
    frame_deadline_ = Clock::now() + std::chrono::seconds(shared_.config.timeouts.frame_s);
  }
  update_timer();
}

// ---- text --------------------------------------------------------------------------

void Session::process_text() {
  bool line_finished = false;
  const std::size_t max_line = shared_.config.server_limits.max_line_bytes;
  while (!finishing_ && !closed_ && !awaiting_reply_ && pending_write_bytes_ < kMaxPendingWrite) {
    const auto nl = line_buf_.find('\n');
    if (nl == std::string::npos) break;
    line_finished = true;
    if (nl > max_line) {
      line_too_long_ = true;
      break;
    }
    const std::string line = line_buf_.substr(0, nl);
    line_buf_.erase(0, nl + 1);
    answer_line(line);
  }
  if (!finishing_ && (line_too_long_ ||
                      (line_buf_.find('\n') == std::string::npos && line_buf_.size() > max_line))) {
    ++shared_.collector.counters().protocol_errors[kLineTooLongKind];
    shared_.log.warn(kLineTooLongKind, "client " + describe_peer() + ": command line longer than " +
                                           std::to_string(max_line) + " bytes; connection closed");
    line_buf_.clear();
    queue_write("error: line too long\n");
    frame_deadline_.reset();
    close_after_writes();
    return;
  }
  set_frame_deadline(line_finished);
}

void Session::answer_line(std::string_view line) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.find_first_not_of(" \t") == std::string_view::npos) return;  // blank: no reply
  const CommandContext context{shared_.collector, peer_.uid, shared_.daemon_euid};
  Reply reply = shared_.commands.dispatch(line, context);
  if (!reply.render) {
    queue_write(std::move(reply.text));
    return;
  }
  if (shared_.renderer == nullptr) {
    shared_.collector.refresh_liveness();
    queue_write(run_render_job(reply.render, *shared_.collector.freeze()));
    return;
  }
  awaiting_reply_ = true;
  shared_.renderer->submit(std::move(reply.render), [self = shared_from_this()](std::string text) {
    self->awaiting_reply_ = false;
    if (self->closed_) return;
    // The write's completion goes on with the next line, EOF, or reading.
    self->queue_write(std::move(text));
  });
}

void Session::maybe_finish() {
  if (!eof_ || mode_ != Mode::kText || finishing_ || closed_ || awaiting_reply_) return;
  if (line_buf_.find('\n') != std::string::npos) return;  // more lines wait for the writes
  if (!line_buf_.empty()) {
    // The last line had no '\n' (`printf ping | socat ...`): answer it too.
    const std::string line = std::move(line_buf_);
    line_buf_.clear();
    answer_line(line);
  }
  frame_deadline_.reset();
  close_after_writes();
}

// ---- writing -----------------------------------------------------------------------

void Session::queue_write(std::string data) {
  if (closed_ || data.empty()) return;
  pending_write_bytes_ += data.size();
  write_queue_.push_back(std::move(data));
  if (!writing_) write_next();
}

void Session::write_next() {
  writing_ = true;
  write_deadline_ = Clock::now() + std::chrono::seconds(shared_.config.timeouts.frame_s);
  update_timer();
  auto self = shared_from_this();
  boost::asio::async_write(socket_, boost::asio::buffer(write_queue_.front()),
                           [self](const boost::system::error_code& ec, std::size_t) {
                             self->writing_ = false;
                             if (self->closed_) return;
                             self->pending_write_bytes_ -= self->write_queue_.front().size();
                             self->write_queue_.pop_front();
                             if (ec) {
                               self->close();
                               return;
                             }
                             if (!self->write_queue_.empty()) {
                               self->write_next();
                               return;
                             }
                             self->write_deadline_.reset();
                             self->update_timer();
                             if (self->finishing_) {
                               self->close();
                               return;
                             }
                             if (self->mode_ == Mode::kText) {
                               self->process_text();
                               self->maybe_finish();
                             }
                             self->read_more();
                           });
}

void Session::close_after_writes() {
  finishing_ = true;
  if (!writing_ && write_queue_.empty()) close();
}

// ---- timeouts ----------------------------------------------------------------------

void Session::update_timer() {
  if (closed_) return;
  std::optional<Clock::time_point> next;
  for (const auto& d : {handshake_deadline_, frame_deadline_, write_deadline_}) {
    if (d && (!next || *d < *next)) next = d;
  }
  if (next == armed_for_) return;
  ++timer_generation_;
  armed_for_ = next;
  if (!next) {
    timer_.cancel();
    return;
  }
  timer_.expires_at(*next);
  auto self = shared_from_this();
  timer_.async_wait([self, generation = timer_generation_](const boost::system::error_code&) {
    if (self->closed_ || generation != self->timer_generation_) return;
    self->armed_for_.reset();
    self->on_timeout();
  });
}

void Session::on_timeout() {
  const auto now = Clock::now();
  const auto& timeouts = shared_.config.timeouts;
  if (handshake_deadline_ && *handshake_deadline_ <= now) {
    ++shared_.collector.counters().protocol_errors[errc_name(errc::timed_out)];
    shared_.log.warn("timed_out", "client " + describe_peer() + " sent nothing within " +
                                      std::to_string(timeouts.handshake_s) +
                                      " s; connection closed");
    close();
    return;
  }
  if (write_deadline_ && *write_deadline_ <= now) {
    ++shared_.collector.counters().protocol_errors[kWriteTimeoutKind];
    shared_.log.warn(kWriteTimeoutKind,
                     "client " + describe_peer() + " did not read a reply within " +
                         std::to_string(timeouts.frame_s) + " s; connection closed");
    close();
    return;
  }
  if (frame_deadline_ && *frame_deadline_ <= now) {
    frame_deadline_.reset();
    ++shared_.collector.counters().protocol_errors[errc_name(errc::timed_out)];
    const std::string what = mode_ == Mode::kBinary ? "frame" : "line";
    shared_.log.warn("timed_out", "client " + describe_peer() + ": a " + what +
                                      " was not completed within " +
                                      std::to_string(timeouts.frame_s) + " s; connection closed");
    const std::string message =
        what + " not completed within " + std::to_string(timeouts.frame_s) + " s";
    // Error frames name the rule first (`<errc name>: ...`, PROTOCOL.md 4.9).
    queue_write(mode_ == Mode::kBinary
                    ? error_frame(proto::ErrorCode::kProtocol,
                                  std::string(errc_name(errc::timed_out)) + ": " + message)
                    : "error: " + message + "\n");
    close_after_writes();
    return;
  }
  update_timer();
}

// ---- shutdown ----------------------------------------------------------------------

void Session::drain(Clock::time_point deadline) {
  if (closed_ || reject_ || finishing_ || eof_ || mode_ == Mode::kText) return;
  draining_ = true;
  boost::system::error_code ec;
  // The pending async read is cancelled before we read synchronously; its handler sees
  // draining_ and touches nothing (the decoder's buffer it pointed into is not used).
  socket_.cancel(ec);
  socket_.non_blocking(true, ec);
  if (mode_ == Mode::kUnknown) {
    // Accepted but not read yet (e.g. still in the backlog at the signal).
    const std::size_t n = socket_.read_some(boost::asio::buffer(text_buf_), ec);
    if (ec) return;
    handshake_deadline_.reset();
    choose_mode(static_cast<std::uint8_t>(text_buf_[0]));
    if (mode_ != Mode::kBinary) return;  // commands are not answered while stopping
    decoder_.feed(std::as_bytes(std::span(text_buf_.data(), n)));
    shared_.collector.counters().bytes_received += n;
    process_binary();
  }
  std::size_t drained = 0;
  while (!ec && !finishing_ && Clock::now() < deadline) {
    auto space = decoder_.prepare(kReadChunk);
    const std::size_t n = socket_.read_some(boost::asio::buffer(space.data(), space.size()), ec);
    if (ec) break;  // would_block: nothing more was sent; eof: the peer is done
    decoder_.commit(n);
    drained += n;
    shared_.collector.counters().bytes_received += n;
    process_binary();
  }
  if (drained > 0) spdlog::debug("drained {} bytes from {}", drained, describe_peer());
}

void Session::close() {
  if (closed_) return;
  closed_ = true;
  ++timer_generation_;
  timer_.cancel();
  boost::system::error_code ec;
  socket_.shutdown(Socket::shutdown_both, ec);
  socket_.close(ec);
  if (attached_) {
    attached_ = false;
    shared_.collector.detach(handle_);
  }
  if (on_close_) {
    auto callback = std::move(on_close_);
    on_close_ = nullptr;
    callback(this);
  }
}

}  // namespace steptrace::daemon
