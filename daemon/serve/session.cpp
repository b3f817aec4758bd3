#include "daemon/serve/session.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cassert>
#include <cerrno>
#include <cstring>
#include <span>

#include <spdlog/spdlog.h>
#include <boost/asio/write.hpp>

#include "daemon/serve/io_thread.h"

namespace steptrace::daemon {

using State = ClientStream::State;

std::optional<ucred> peer_credentials(Session::Socket& socket) {
  ucred cred{};
  socklen_t len = sizeof cred;
  if (::getsockopt(socket.native_handle(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return std::nullopt;
  }
  return cred;
}

Session::Session(Socket socket, SessionShared& shared, CloseCallback on_close,
                 std::optional<ucred> cred, Refusal refusal)
    : socket_(std::move(socket)),
      shared_(shared),
      on_close_(std::move(on_close)),
      cred_(cred),
      refusal_(refusal),
      timer_(socket_.get_executor()),
      defer_timer_(socket_.get_executor()) {}

Session::~Session() = default;

void Session::start() {
  assert(on_io_thread(socket_.get_executor()));
  PeerIdentity peer;
  if (cred_) {
    const ucred& cred = *cred_;
    peer.key.pid = cred.pid;
    peer.uid = cred.uid;
    peer.gid = cred.gid;
    // Probe now, while the peer surely lives: its start time tells a recycled pid apart.
    if (cred.pid > 0 && shared_.env.probe) {
      if (auto probe = shared_.env.probe(cred.pid); probe && probe->error == 0) {
        peer.key.start_time = probe->start_time;
        peer.comm = probe->comm;
      }
    }
  } else {
    // No credentials: the peer stays pid 0, uid nobody; it may not reset anything.
    peer.uid = kNobodyUid;
    peer.gid = kNobodyGid;
  }
  stream_.emplace(shared_, static_cast<StreamTransport&>(*this), std::move(peer), refusal_,
                  Clock::now());
  after_stream();
}

void Session::after_stream() {
  assert(on_io_thread(socket_.get_executor()));
  if (closed()) return;
  if (stream_->state() == State::kFinishing && !writing_ && write_queue_.empty()) {
    close();
    return;
  }
  update_timer();
  read_more();
}

// ---- reading -----------------------------------------------------------------------

void Session::read_more() {
  if (reading_ || closed() || shared_.stopping || !stream_->wants_input()) return;
  reading_ = true;
  // Wait, then recvmsg: a plain read would drop the descriptors a client passes.
  socket_.async_wait(
      Socket::wait_read,
      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_readable(ec); });
}

std::size_t Session::receive(boost::system::error_code& ec) {
  // The library passes one per send, and a read ends after a send that carries any: more
  // is cut (MSG_CTRUNC, the kernel closes the rest) and the stream fails.
  constexpr std::size_t kMaxFdsPerRead = 2;
  const auto buffer = stream_->read_buffer();
  iovec iov{buffer.data(), buffer.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerRead)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof control;
  ssize_t n;
  do {
    n = ::recvmsg(socket_.native_handle(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    ec = boost::system::error_code(errno, boost::system::system_category());
    return 0;
  }
  int fds[kMaxFdsPerRead];
  std::size_t count = 0;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const std::size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (std::size_t i = 0; i < k && count < kMaxFdsPerRead; ++i) {
      std::memcpy(&fds[count++], CMSG_DATA(c) + i * sizeof(int), sizeof(int));
    }
  }
  const bool truncated = (msg.msg_flags & MSG_CTRUNC) != 0;
  if (count > 0 || truncated) stream_->received_fds(std::span<const int>(fds, count), truncated);
  if (n == 0) {
    ec = boost::asio::error::eof;
    return 0;
  }
  ec = {};
  return static_cast<std::size_t>(n);
}

void Session::on_readable(const boost::system::error_code& ec) {
  assert(on_io_thread(socket_.get_executor()));
  reading_ = false;
  if (closed()) return;
  // Shutting down: what the client sent is still in the socket; drain() reads it.
  if (stream_->state() == State::kDraining) return;
  if (ec) {
    stream_->input_ended();  // the wait failed: the peer is gone either way
    after_stream();
    return;
  }
  boost::system::error_code read_ec;
  const std::size_t n = receive(read_ec);
  if (closed()) return;
  if (read_ec == boost::asio::error::would_block || read_ec == boost::asio::error::try_again) {
    after_stream();
    return;
  }
  if (read_ec) {
    stream_->input_ended();  // EOF or a reset: either way the peer sends no more
  } else {
    stream_->received(n);
  }
  after_stream();
}

// ---- writing -----------------------------------------------------------------------

void Session::send(std::string bytes) {
  if (closed() || bytes.empty()) return;
  pending_write_bytes_ += bytes.size();
  shared_.counters.reply_bytes_pending += bytes.size();
  if (shared_.renderer != nullptr) shared_.renderer->reply_bytes().add(uid(), bytes.size());
  write_queue_.push_back(std::move(bytes));
  if (!writing_) write_next();
}

void Session::written(std::size_t n) {
  pending_write_bytes_ -= std::min(pending_write_bytes_, n);
  shared_.counters.reply_bytes_pending -=
      std::min<std::uint64_t>(shared_.counters.reply_bytes_pending, n);
  if (shared_.renderer != nullptr) shared_.renderer->reply_bytes().remove(uid(), n);
}

std::optional<std::string> Session::over_reply_budget(std::size_t more) {
  if (shared_.renderer == nullptr) return std::nullopt;
  const std::size_t limit = shared_.config.server_limits.max_pending_reply_bytes_per_uid;
  const std::size_t waiting = shared_.renderer->reply_bytes().of(uid());
  // A reply is always sent when none of its uid's waits, however big (as the global
  // budget does): the cap bounds what one tenant piles up, not what it may ask for.
  if (waiting == 0 || waiting + more <= limit) return std::nullopt;
  shared_.collector.count_limit(LimitKind::kMaxPendingReplyBytesPerUid);
  shared_.log.warn("max_pending_reply_bytes_per_uid", "reply to " + stream_->describe_peer() +
                                                          " refused: uid " + std::to_string(uid()) +
                                                          " has " + std::to_string(waiting) +
                                                          " bytes of replies waiting to be read");
  return "error: busy: uid " + std::to_string(uid()) + " has " + std::to_string(waiting >> 10) +
         " KiB of replies waiting for its clients to read them "
         "(limits.max_pending_reply_bytes_per_uid=" +
         std::to_string(limit) + "); read them, or retry\n";
}

void Session::render(RenderJob job) {
  assert(on_io_thread(socket_.get_executor()));
  if (shared_.renderer == nullptr) {
    stream_->rendered(run_render_job(job, *shared_.collector.freeze(&shared_.counters)));
    return;
  }
  // Already at the cap: answer now, without rendering what could not be sent.
  if (shared_.renderer->reply_bytes().of(uid()) >=
      shared_.config.server_limits.max_pending_reply_bytes_per_uid) {
    if (auto busy = over_reply_budget(0)) {
      stream_->rendered(std::move(*busy));
      return;
    }
  }
  shared_.renderer->submit(
      std::move(job),
      [self = shared_from_this()](std::string text) {
        if (self->closed()) return;
        if (auto busy = self->over_reply_budget(text.size())) text = std::move(*busy);
        self->stream_->rendered(std::move(text));
        self->stream_->resume();
        self->after_stream();
      },
      RenderOwner::of_uid(uid()));
}

void Session::render_piece(std::shared_ptr<ReplyStream> stream) {
  auto piece = [](ReplyStream& reply, std::string& out) {
    try {
      return reply.next(out);
    } catch (const std::exception& e) {
      // A renderer bug ends the reply, saying so, and leaves the daemon up.
      out += std::string("\nerror: internal error: ") + e.what() + "\n";
      return false;
    }
  };
  if (shared_.renderer == nullptr) {
    std::string out;
    const bool more = piece(*stream, out);
    stream_->piece_rendered(std::move(out), more);
    return;
  }
  // `more` is written on the render thread before its result is posted back. The task
  // holds the reply weakly: the stream's is the only owner, so a connection that closed
  // while the piece waited for its lane (the hang-up watch below) took the reply with it,
  // and the piece is not rendered: a trace's first piece, which chooses its processes
  // (--children reads /proc), reads nothing for a client that is gone.
  auto more = std::make_shared<bool>(false);
  piece_waiting_ = true;
  shared_.renderer->submit_task(
      [piece, weak = std::weak_ptr<ReplyStream>(stream), more] {
        std::string out;
        if (const auto alive = weak.lock()) *more = piece(*alive, out);
        return out;
      },
      [self = shared_from_this(), more](std::string text) {
        self->piece_waiting_ = false;
        if (self->closed()) return;
        self->stream_->piece_rendered(std::move(text), *more);
        self->stream_->resume();
        self->after_stream();
      },
      RenderOwner::of_uid(uid()));
  watch_hangup();
}

void Session::defer(std::chrono::milliseconds delay, std::function<void()> fire) {
  deferred_ = true;
  defer_timer_.expires_after(delay);
  defer_timer_.async_wait(
      [self = shared_from_this(), fire = std::move(fire)](const boost::system::error_code& ec) {
        if (ec || self->closed()) return;
        self->deferred_ = false;
        fire();
        self->stream_->resume();
        self->after_stream();
      });
  watch_hangup();
}

// Nothing is read while the reply waits, so without this a client that closed would hold
// its connection (and its uid's slots) for up to an hour; or, while a piece of a streamed
// reply waits for its turn on the render thread (behind its uid's other jobs), have it
// rendered for no one. What is watched is the hang-up alone: a shutdown of the peer's
// writing side is how the CLI asks (send, shut down, read until close), so end of input
// is no reason to stop; and bytes sent meanwhile are further commands (PROTOCOL.md 10.2:
// a client may send several before reading), which wait in the kernel's socket buffer,
// bounded, until this reply is out. On a Unix stream socket the kernel sets EPOLLHUP only
// when the peer's socket is released (closed by its last holder, or its process died),
// never for a half-close: exactly the client that can no longer read the reply. Asio
// re-arms the descriptor (EPOLL_CTL_MOD) when the wait starts, so a hang-up that came
// before it is reported at once.
void Session::watch_hangup() {
  if (watching_ || closed()) return;
  watching_ = true;
  socket_.async_wait(
      Socket::wait_error,
      [self = shared_from_this()](const boost::system::error_code& ec) { self->on_hangup(ec); });
}

void Session::on_hangup(const boost::system::error_code& ec) {
  assert(on_io_thread(socket_.get_executor()));
  watching_ = false;
  // Cancelled (shutdown), or the reply was made meanwhile: its writes notice a closed peer.
  if (ec || closed() || (!deferred_ && !piece_waiting_)) return;
  pollfd p{socket_.native_handle(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) != 1 || (p.revents & (POLLHUP | POLLERR)) == 0) {
    // Not a hang-up (EPOLLPRI has no meaning here): watching again could spin, so the
    // reply's own timer ends this wait, as it did before the watch existed.
    spdlog::debug("{}: socket event {:#x} while a reply waits", stream_->describe_peer(),
                  static_cast<unsigned>(p.revents));
    return;
  }
  ++shared_.counters.closed_waiting;
  spdlog::debug("{} closed its connection while its {} waited", stream_->describe_peer(),
                deferred_ ? "trace --for" : "reply's next piece");
  // Cancels the reply's timer, or drops the reply whose piece waits (its task then renders
  // nothing): what it holds (capture, uid's trace slot) goes with it.
  close();
}

void Session::write_next() {
  writing_ = true;
  write_deadline_ = Clock::now() + std::chrono::seconds(shared_.config.timeouts.frame_s);
  update_timer();
  boost::asio::async_write(
      socket_, boost::asio::buffer(write_queue_.front()),
      [self = shared_from_this()](const boost::system::error_code& ec, std::size_t) {
        self->writing_ = false;
        if (self->closed()) return;
        self->written(self->write_queue_.front().size());
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
        self->stream_->resume();
        self->after_stream();
      });
}

// ---- timeouts ----------------------------------------------------------------------

void Session::update_timer() {
  if (closed()) return;
  std::optional<Clock::time_point> next = stream_->next_deadline();
  if (write_deadline_ && (!next || *write_deadline_ < *next)) next = write_deadline_;
  if (next == armed_for_) return;
  ++timer_generation_;
  armed_for_ = next;
  if (!next) {
    timer_.cancel();
    return;
  }
  timer_.expires_at(*next);
  timer_.async_wait([self = shared_from_this(),
                     generation = timer_generation_](const boost::system::error_code&) {
    if (self->closed() || generation != self->timer_generation_) return;
    self->armed_for_.reset();
    self->on_timeout();
  });
}

void Session::on_timeout() {
  assert(on_io_thread(socket_.get_executor()));
  const auto now = Clock::now();
  if (write_deadline_ && *write_deadline_ <= now) {
    stream_->write_timed_out();
    close();  // what is queued will never be read
    return;
  }
  stream_->on_timer(now);
  after_stream();
}

// ---- shutdown ----------------------------------------------------------------------

void Session::begin_drain() {
  assert(on_io_thread(socket_.get_executor()));
  if (closed() || !stream_->begin_drain()) return;
  draining_ = true;
  boost::system::error_code ec;
  // A read in flight may have completed already, its handler queued: cancelling cannot
  // take those bytes back, so on_read applies them, and drain() reads only after it ran.
  socket_.cancel(ec);
}

void Session::drain(Clock::time_point deadline) {
  assert(on_io_thread(socket_.get_executor()));
  if (closed() || !draining_ || stream_->state() != State::kDraining) return;
  boost::system::error_code ec;
  socket_.non_blocking(true, ec);
  std::size_t drained = 0;
  while (stream_->state() == State::kDraining && Clock::now() < deadline) {
    const std::size_t n = receive(ec);
    if (closed()) break;
    if (ec) {
      // would_block: nothing more was sent. EOF or a reset: the peer is done, which also
      // tells its rings' last pass to refuse what waits for a registration rather than
      // hand it over to a next daemon no one will offer it to.
      if (ec != boost::asio::error::would_block && ec != boost::asio::error::try_again) {
        stream_->input_ended();
      }
      break;
    }
    drained += n;
    stream_->received(n);
  }
  if (drained > 0) spdlog::debug("drained {} bytes from {}", drained, stream_->describe_peer());
}

void Session::close() {
  assert(on_io_thread(socket_.get_executor()));
  if (closed()) return;
  // What it still had queued will never be written: no longer waiting for anyone.
  written(pending_write_bytes_);
  stream_->closed();
  ++timer_generation_;
  timer_.cancel();
  defer_timer_.cancel();
  boost::system::error_code ec;
  socket_.shutdown(Socket::shutdown_both, ec);
  socket_.close(ec);
  if (on_close_) {
    auto callback = std::move(on_close_);
    on_close_ = nullptr;
    callback(this);
  }
}

}  // namespace steptrace::daemon
