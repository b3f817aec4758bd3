// The optional HTTP listener for Prometheus: `GET /metrics` (and HEAD) answers
// report::metrics_text(*collector.freeze()) in the text exposition format 0.0.4.
//
// Data flow: Server builds it on its io_context when metrics_listen is set -> accept loop
// -> one HttpConnection per TCP client (keep-alive; header limit 8 KiB, tiny body limit,
// 10 s per request, at most 64 at once) -> the body is rendered by the RenderWorker from
// a view of the Collector, off the io thread. Fully asynchronous, so neither a slow
// scraper nor a large table stalls ingest.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

class HttpMetricsServer {
 public:
  static constexpr std::size_t kMaxConnections = 64;
  static constexpr std::size_t kHeaderLimit = 8 * 1024;
  static constexpr std::size_t kBodyLimit = 1024;
  static constexpr int kRequestTimeoutS = 10;

  HttpMetricsServer(boost::asio::io_context& io, RenderWorker& renderer);
  ~HttpMetricsServer();
  HttpMetricsServer(const HttpMetricsServer&) = delete;
  HttpMetricsServer& operator=(const HttpMetricsServer&) = delete;

  // Binds and starts accepting; an error message when the address cannot be used.
  std::optional<std::string> listen(const ListenAddress& address);
  void close();
  boost::asio::ip::tcp::endpoint local_endpoint() const;

  // Shared with connections, which may outlive this object inside the io_context.
  struct Shared {
    RenderWorker* renderer = nullptr;
    std::size_t active = 0;
  };

 private:
  void accept();

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace steptrace::daemon
