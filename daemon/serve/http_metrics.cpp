#include "daemon/serve/http_metrics.h"
#include "daemon/report/report.h"

#include <spdlog/spdlog.h>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <chrono>

namespace steptrace::daemon {
namespace {

namespace beast = boost::beast;
namespace http = beast::http;
using Tcp = boost::asio::ip::tcp;

constexpr const char* kContentType = "text/plain; version=0.0.4; charset=utf-8";

class HttpConnection : public std::enable_shared_from_this<HttpConnection> {
 public:
  HttpConnection(Tcp::socket socket, std::shared_ptr<HttpMetricsServer::Shared> shared)
      : stream_(std::move(socket)), shared_(std::move(shared)) {
    ++shared_->active;
  }
  ~HttpConnection() { --shared_->active; }

  void start() { read(); }

 private:
  void read() {
    parser_.emplace();
    parser_->header_limit(HttpMetricsServer::kHeaderLimit);
    parser_->body_limit(HttpMetricsServer::kBodyLimit);
    // Covers the whole request, so a slow sender cannot hold the connection.
    stream_.expires_after(std::chrono::seconds(HttpMetricsServer::kRequestTimeoutS));
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, std::size_t) { self->on_read(ec); });
  }

  void on_read(beast::error_code ec) {
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
    if (ec) {
      if (ec != beast::error::timeout && ec != boost::asio::error::operation_aborted) {
        // A malformed request: answer 400 and close.
        respond_error(http::status::bad_request, "bad request\n");
      }
      return;
    }
    handle(parser_->get());
  }

  void handle(const http::request<http::string_body>& req) {
    response_ = {};
    response_.version(req.version());
    response_.keep_alive(req.keep_alive());
    response_.set(http::field::server, "steptraced");
    std::string_view target(req.target().data(), req.target().size());
    if (const auto q = target.find('?'); q != std::string_view::npos) target = target.substr(0, q);
    if (target != "/metrics") {
      response_.result(http::status::not_found);
      response_.set(http::field::content_type, "text/plain; charset=utf-8");
      response_.body() = "not found; try /metrics\n";
      response_.prepare_payload();
    } else if (req.method() != http::verb::get && req.method() != http::verb::head) {
      response_.result(http::status::method_not_allowed);
      response_.set(http::field::allow, "GET, HEAD");
      response_.set(http::field::content_type, "text/plain; charset=utf-8");
      response_.body() = "method not allowed\n";
      response_.prepare_payload();
    } else {
      response_.result(http::status::ok);
      response_.set(http::field::content_type, kContentType);
      RenderWorker* renderer = shared_->renderer;
      if (renderer == nullptr) return;  // shutting down
      const bool head = req.method() == http::verb::head;
      renderer->submit([](const CollectorView& view) { return report::metrics_text(view); },
                       [self = shared_from_this(), head](std::string body) {
                         self->respond_metrics(head, std::move(body));
                       });
      return;
    }
    write(response_.keep_alive());
  }

  void respond_metrics(bool head, std::string body) {
    if (head) {
      response_.content_length(body.size());
    } else {
      response_.body() = std::move(body);
      response_.prepare_payload();
    }
    write(response_.keep_alive());
  }

  void respond_error(http::status status, std::string body) {
    response_ = {};
    response_.version(11);
    response_.result(status);
    response_.keep_alive(false);
    response_.set(http::field::content_type, "text/plain; charset=utf-8");
    response_.body() = std::move(body);
    response_.prepare_payload();
    write(false);
  }

  void write(bool keep_alive) {
    stream_.expires_after(std::chrono::seconds(HttpMetricsServer::kRequestTimeoutS));
    http::async_write(stream_, response_,
                      [self = shared_from_this(), keep_alive](beast::error_code ec, std::size_t) {
                        if (ec) return;
                        if (!keep_alive) {
                          self->stream_.socket().shutdown(Tcp::socket::shutdown_send, ec);
                          return;
                        }
                        self->read();
                      });
  }

  beast::tcp_stream stream_;
  beast::flat_buffer buffer_{HttpMetricsServer::kHeaderLimit + HttpMetricsServer::kBodyLimit};
  std::optional<http::request_parser<http::string_body>> parser_;
  http::response<http::string_body> response_;
  std::shared_ptr<HttpMetricsServer::Shared> shared_;
};

}  // namespace

HttpMetricsServer::HttpMetricsServer(boost::asio::io_context& io, RenderWorker& renderer)
    : io_(io), acceptor_(io), retry_timer_(io), shared_(std::make_shared<Shared>()) {
  shared_->renderer = &renderer;
}

HttpMetricsServer::~HttpMetricsServer() {
  close();
  // Connections still queued in the io_context must not reach the collector.
  shared_->renderer = nullptr;
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
        if (shared->active >= kMaxConnections) {
          // Over the cap: close at once; a scraper retries on its next interval.
          socket.close(ec);
        } else {
          std::make_shared<HttpConnection>(std::move(socket), shared)->start();
        }
        accept();
      });
}

void HttpMetricsServer::close() {
  boost::system::error_code ec;
  acceptor_.close(ec);
  retry_timer_.cancel();
}

boost::asio::ip::tcp::endpoint HttpMetricsServer::local_endpoint() const {
  boost::system::error_code ec;
  return acceptor_.local_endpoint(ec);
}

}  // namespace steptrace::daemon
