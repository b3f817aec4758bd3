#include "daemon/serve/http_metrics.h"
#include "daemon/report/report.h"

#include <spdlog/spdlog.h>
#include <algorithm>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/http/span_body.hpp>
#include <chrono>
#include <utility>

namespace steptrace::daemon {

namespace beast = boost::beast;
namespace http = beast::http;
using Tcp = boost::asio::ip::tcp;

namespace {

constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

std::string describe(const Tcp::endpoint& peer) {
  const auto address = peer.address();
  const std::string host = address.is_v6() ? "[" + address.to_string() + "]" : address.to_string();
  return host + ":" + std::to_string(peer.port());
}

// Submits one metrics render for every scrape waiting (HttpMetricsServer::Shared).
void render_scrapes(const std::shared_ptr<HttpMetricsServer::Shared>& shared);

}  // namespace

// One TCP client of the metrics listener. Lives as long as an operation or a render job
// holds it; counted against the caps from construction until release(), which eviction,
// close() or the destructor calls, whichever comes first.
class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  using Shared = HttpMetricsServer::Shared;
  using Clock = std::chrono::steady_clock;

  HttpConnection(Tcp::socket socket, Tcp::endpoint peer, std::shared_ptr<Shared> shared)
      : stream_(std::move(socket)), peer_(std::move(peer)), shared_(std::move(shared)) {
    ++shared_->open;
    ++shared_->per_address[peer_.address()];
    all_pos_ = shared_->all.insert(shared_->all.end(), this);
  }
  ~HttpConnection() { release(); }
  HttpConnection(const HttpConnection&) = delete;
  HttpConnection& operator=(const HttpConnection&) = delete;

  void start() { read(); }

  const Tcp::endpoint& peer() const { return peer_; }
  // When the connection entered its current state (reading or writing).
  Clock::time_point since() const { return since_; }

  // Closes the connection now (eviction, shutdown): it stops counting against the caps
  // at once, its pending operation completes with operation_aborted and does nothing.
  void close_now() {
    release();
    stream_.close();
  }

  // The metrics text of the render this scrape waited for, shared with the others.
  void respond_metrics(const std::shared_ptr<const std::string>& text) {
    if (released_) return;
    if (head_) {
      response_.content_length(text->size());
    } else {
      set_body(text);
      response_.prepare_payload();
    }
    write(response_.keep_alive());
  }

 private:
  enum class Phase { kNone, kReading, kWriting };

  void enter(Phase phase) {
    leave();
    auto& list = phase == Phase::kReading ? shared_->reading : shared_->writing;
    pos_ = list.insert(list.end(), this);
    phase_ = phase;
    since_ = Clock::now();
  }

  void leave() {
    if (phase_ == Phase::kNone) return;
    (phase_ == Phase::kReading ? shared_->reading : shared_->writing).erase(pos_);
    phase_ = Phase::kNone;
  }

  void release() {
    if (released_) return;
    released_ = true;
    leave();
    shared_->all.erase(all_pos_);
    --shared_->open;
    const auto it = shared_->per_address.find(peer_.address());
    if (it != shared_->per_address.end() && --it->second == 0) shared_->per_address.erase(it);
  }

  void read() {
    parser_.emplace();
    parser_->header_limit(HttpMetricsServer::kHeaderLimit);
    parser_->body_limit(HttpMetricsServer::kBodyLimit);
    // One deadline for the whole request, from its first byte or none: however slowly the
    // bytes trickle in, the connection is closed when it passes. A keep-alive connection
    // idle that long is closed the same way.
    stream_.expires_after(HttpMetricsServer::kHeaderTimeout);
    enter(Phase::kReading);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
    leave();
    if (released_) return;  // evicted or shut down
    if (ec == http::error::end_of_stream) {
      stream_.socket().shutdown(Tcp::socket::shutdown_send, ec);
      return;
    }
    if (ec == http::error::body_limit) {
      respond_error(http::status::payload_too_large, "request body too large\n");
      return;
    }
    if (ec == http::error::header_limit) {
      respond_error(http::status::request_header_fields_too_large, "request header too large\n");
      return;
    }
    if (ec == beast::error::timeout) {
      // The stream closed the socket. A keep-alive connection that merely went quiet
      // after its last response is normal; one that never finished a request is not.
      if (served_ > 0 && !parser_->got_some()) {
        ++shared_->stats->idle_closed;
      } else {
        ++shared_->stats->header_timeouts;
        shared_->log.warn("http_header_timeout",
                          "HTTP metrics: " + describe(peer_) + " sent no complete request in " +
                              std::to_string(HttpMetricsServer::kHeaderTimeout.count()) +
                              " s; connection closed");
      }
      return;
    }
    if (ec) {
      if (ec != boost::asio::error::operation_aborted) {
        // A malformed request: answer 400 and close.
        respond_error(http::status::bad_request, "bad request\n");
      }
      return;
    }
    handle(parser_->get());
  }

  void set_body(std::shared_ptr<const std::string> text) {
    body_ = std::move(text);
    response_.body() = {body_->data(), body_->size()};
  }
  void set_body(std::string text) {
    set_body(std::make_shared<const std::string>(std::move(text)));
  }

  void handle(const http::request<http::string_body>& req) {
    response_ = {};
    body_.reset();
    response_.version(req.version());
    response_.keep_alive(req.keep_alive());
    response_.set(http::field::server, "steptraced");
    std::string_view target(req.target().data(), req.target().size());
    if (const auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
    if (target != "/metrics") {
      response_.result(http::status::not_found);
      response_.set(http::field::content_type, "text/plain; charset=utf-8");
      set_body("not found; try /metrics\n");
      response_.prepare_payload();
    } else if (req.method() != http::verb::get && req.method() != http::verb::head) {
      response_.result(http::status::method_not_allowed);
      response_.set(http::field::allow, "GET, HEAD");
      response_.set(http::field::content_type, "text/plain; charset=utf-8");
      set_body("method not allowed\n");
      response_.prepare_payload();
    } else {
      response_.result(http::status::ok);
      response_.set(http::field::content_type, kContentType);
      if (shared_->renderer == nullptr) return;  // shutting down
      head_ = req.method() == http::verb::head;
      shared_->scrapes_waiting.push_back(shared_from_this());
      if (!shared_->scrape_rendering) render_scrapes(shared_);
      return;
    }
    write(response_.keep_alive());
  }

  void respond_error(http::status status, std::string body) {
    ++shared_->stats->bad_requests;
    response_ = {};
    body_.reset();
    response_.version(11);
    response_.result(status);
    response_.keep_alive(false);
    response_.set(http::field::content_type, "text/plain; charset=utf-8");
    set_body(std::move(body));
    response_.prepare_payload();
    write(false);
  }

  void write(bool keep_alive) {
    stream_.expires_after(HttpMetricsServer::kWriteTimeout);
    enter(Phase::kWriting);
    http::async_write(stream_, response_,
                      [self = shared_from_this(), keep_alive](beast::error_code ec, std::size_t) {
                        self->on_write(ec, keep_alive);
                      });
  }

  void on_write(beast::error_code ec, bool keep_alive) {
    leave();
    if (released_) return;
    if (ec) {
      if (ec == beast::error::timeout) {
        ++shared_->stats->write_timeouts;
        shared_->log.warn("http_write_timeout",
                          "HTTP metrics: " + describe(peer_) + " did not read its response in " +
                              std::to_string(HttpMetricsServer::kWriteTimeout.count()) +
                              " s; connection closed");
      }
      return;
    }
    ++shared_->stats->responses;
    ++served_;
    // Written: let go of the text now rather than at the next request (a keep-alive
    // scraper would hold the last one between scrapes).
    response_.body() = {};
    body_.reset();
    if (!keep_alive) {
      stream_.socket().shutdown(Tcp::socket::shutdown_send, ec);
      return;
    }
    read();
  }

  beast::tcp_stream stream_;
  Tcp::endpoint peer_;
  std::shared_ptr<Shared> shared_;
  beast::flat_buffer buffer_{HttpMetricsServer::kHeaderLimit + HttpMetricsServer::kBodyLimit};
  std::optional<http::request_parser<http::string_body>> parser_;
  // The body is a view of body_, which may be the metrics text every scrape waiting for
  // one render shares.
  http::response<http::span_body<const char>> response_;
  std::shared_ptr<const std::string> body_;
  bool head_ = false;  // the metrics request was HEAD
  Phase phase_ = Phase::kNone;
  std::list<HttpConnection*>::iterator pos_;      // in reading or writing, per phase_
  std::list<HttpConnection*>::iterator all_pos_;  // in shared_->all until released
  Clock::time_point since_ = Clock::now();
  std::uint64_t served_ = 0;  // responses written in full
  bool released_ = false;
};

namespace {

// A render's metrics text, counted in HttpCounters::reply_bytes until the last response
// holding it lets it go. Every holder lives on the io thread (the render's done callback
// and the connections), so the deleter runs there too; at shutdown the Server's counters
// may be gone, hence shared->stats, which then points to the listener's own.
std::shared_ptr<const std::string> held_text(
    const std::shared_ptr<HttpMetricsServer::Shared>& shared, std::string text) {
  // Its size, not its capacity: the render reserves generously, and the pages it never
  // wrote (the block is mapped alone: heap::return_big_blocks_when_freed) are not resident.
  const std::uint64_t bytes = text.size();
  shared->stats->reply_bytes += bytes;
  return {new const std::string(std::move(text)), [shared, bytes](const std::string* held) {
            delete held;
            auto& gauge = shared->stats->reply_bytes;
            gauge -= std::min(gauge, bytes);
          }};
}

void render_scrapes(const std::shared_ptr<HttpMetricsServer::Shared>& shared) {
  if (shared->renderer == nullptr || shared->scrapes_waiting.empty()) return;
  shared->scrape_rendering = true;
  ++shared->scrape_renders;
  shared->renderer->submit(
      RenderJob([](const CollectorView& view) { return report::metrics_text(view); },
                RenderLane::kFast),
      [shared, waiting = std::move(shared->scrapes_waiting)](std::string text) {
        shared->scrape_rendering = false;
        const auto body = held_text(shared, std::move(text));
        for (const auto& connection : waiting) connection->respond_metrics(body);
        render_scrapes(shared);  // those that asked meanwhile
      },
      RenderOwner::http());
  shared->scrapes_waiting.clear();
}

}  // namespace

HttpMetricsServer::HttpMetricsServer(boost::asio::io_context& io, RenderWorker& renderer,
                                     HttpCounters* counters)
    : io_(io), acceptor_(io), retry_timer_(io), shared_(std::make_shared<Shared>()) {
  shared_->renderer = &renderer;
  if (counters != nullptr) shared_->stats = counters;
}

HttpMetricsServer::~HttpMetricsServer() {
  close();
  // Connections still queued in the io_context must not reach the collector, nor the
  // Server's counters: the texts they still hold are let go against the listener's own.
  shared_->renderer = nullptr;
  shared_->own_stats.reply_bytes = shared_->stats->reply_bytes;
  shared_->stats = &shared_->own_stats;
}

std::optional<std::string> HttpMetricsServer::listen(const ListenAddress& address) {
  boost::system::error_code ec;
  const auto ip = boost::asio::ip::make_address(address.host, ec);
  if (ec) return "metrics_listen: bad address " + address.host;
  const Tcp::endpoint endpoint(ip, address.port);
  acceptor_.open(endpoint.protocol(), ec);
  if (!ec) acceptor_.set_option(Tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(endpoint, ec);
  if (!ec) acceptor_.listen(boost::asio::socket_base::max_listen_connections, ec);
  if (ec) {
    acceptor_.close();
    return "cannot listen for HTTP metrics on " + address.host + ":" +
           std::to_string(address.port) + ": " + ec.message();
  }
  accept();
  return std::nullopt;
}

bool HttpMetricsServer::make_room(const boost::asio::ip::address& address) {
  const auto it = shared_->per_address.find(address);
  const bool address_full =
      it != shared_->per_address.end() && it->second >= kMaxConnectionsPerAddress;
  if (!address_full && shared_->open < kMaxConnections) return true;
  // Over the per-address cap only a connection from the same address may make room.
  const auto eligible = [&](const HttpConnection* c) {
    return !address_full || c->peer().address() == address;
  };
  HttpConnection* victim = nullptr;
  for (HttpConnection* c : shared_->reading) {  // oldest first
    if (eligible(c)) {
      victim = c;
      break;
    }
  }
  bool stalled_writer = false;
  if (victim == nullptr) {
    const auto stalled_since = std::chrono::steady_clock::now() - kStalledWrite;
    for (HttpConnection* c : shared_->writing) {
      if (c->since() > stalled_since) break;
      if (eligible(c)) {
        victim = c;
        stalled_writer = true;
        break;
      }
    }
  }
  if (victim == nullptr) return false;
  ++shared_->stats->evicted;
  const std::string why =
      stalled_writer ? "was not reading its response" : "had not sent a complete request";
  shared_->log.warn("http_evicted",
                    "HTTP metrics: closed a connection from " + describe(victim->peer()) +
                        " that " + why + ", to admit a new one (" + std::to_string(shared_->open) +
                        " open, at most " + std::to_string(kMaxConnections) + ", " +
                        std::to_string(kMaxConnectionsPerAddress) + " per address)");
  victim->close_now();
  return true;
}

void HttpMetricsServer::accept() {
  acceptor_.async_accept(
      io_, [this, shared = shared_](boost::system::error_code ec, Tcp::socket socket) {
        if (ec == boost::asio::error::operation_aborted || !acceptor_.is_open()) return;
        if (ec) {
          // Out of descriptors or similar: back off instead of spinning on the error.
          retry_timer_.expires_after(std::chrono::milliseconds(100));
          retry_timer_.async_wait([this](boost::system::error_code wait_ec) {
            if (!wait_ec && acceptor_.is_open()) accept();
          });
          return;
        }
        const Tcp::endpoint peer = socket.remote_endpoint(ec);
        if (ec) {
          socket.close(ec);  // already gone
        } else if (!make_room(peer.address())) {
          // Every slot is busy with a request being answered: close at once; a scraper
          // retries on its next interval.
          ++shared->stats->refused;
          shared->log.warn("http_refused", "HTTP metrics: connection from " + describe(peer) +
                                               " refused: " + std::to_string(shared->open) +
                                               " connections busy answering requests");
          socket.close(ec);
        } else {
          ++shared->stats->accepted;
          std::make_shared<HttpConnection>(std::move(socket), peer, shared)->start();
        }
        accept();
      });
}

void HttpMetricsServer::close() {
  boost::system::error_code ec;
  acceptor_.close(ec);
  retry_timer_.cancel();
  // close_now() removes the connection from the list.
  while (!shared_->all.empty()) shared_->all.front()->close_now();
}

boost::asio::ip::tcp::endpoint HttpMetricsServer::local_endpoint() const {
  boost::system::error_code ec;
  return acceptor_.local_endpoint(ec);
}

}  // namespace steptrace::daemon
