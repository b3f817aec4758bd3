// The optional HTTP listener for Prometheus: `GET /metrics` (and HEAD) answers
// report::metrics_text(*collector.freeze()) in the text exposition format 0.0.4.
//
// Data flow: Server builds it on its io_context when metrics_listen is set -> accept loop
// -> one HttpConnection per TCP client (keep-alive) -> the body is rendered by the
// RenderWorker from a view of the Collector, off the io thread, on its fast lane (never
// behind a tenant's report) in the scrapers' own turn (RenderOwner::http()). Fully
// asynchronous, so neither a slow scraper nor a large table stalls ingest.
//
// Scrapes share renders: at most one metrics render is out; every scrape that arrived
// before it was submitted gets its text (one string, each response a view of it), and
// those that arrive meanwhile wait for the next, which starts when it is back. So each
// response still shows what the daemon knew when its request arrived, a scrape waits at
// most two renders, and memory does not grow with the number of scrapers (60 keep-alive
// loops once held 60 copies: 937 MB on a big table).
//
// Slow and idle clients (slowloris) cannot starve a scraper:
// - a connection has kHeaderTimeout from its accept, or from the end of its previous
//   response (keep-alive idle), to deliver a complete request (header at most
//   kHeaderLimit, body at most kBodyLimit); a response must be written within
//   kWriteTimeout. Either deadline closes the connection, however the bytes trickle in;
// - at most kMaxConnections connections at once, at most kMaxConnectionsPerAddress from
//   one address (all local users share 127.0.0.1, so the total matters as much);
// - a new connection over either cap takes the place of the connection from that address
//   (per-address cap) or from anyone (total cap) that has waited longest without
//   delivering a complete request, else of the one stalled longest (>= kStalledWrite) in
//   writing its response; only when every slot is busy rendering or writing a response is
//   the new connection refused. A scraper sends its request at once, so it is served
//   while any number of slow connections come and go.
// What was refused, evicted or timed out is counted (stats()) and logged, rate-limited.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/address.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/serve/client_stream.h"
#include "daemon/serve/config.h"
#include "daemon/serve/render_worker.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

class HttpConnection;  // http_metrics.cpp

class HttpMetricsServer {
 public:
  static constexpr std::size_t kMaxConnections = 64;
  static constexpr std::size_t kMaxConnectionsPerAddress = 32;
  static constexpr std::size_t kHeaderLimit = 8 * 1024;
  static constexpr std::size_t kBodyLimit = 1024;
  static constexpr std::chrono::seconds kHeaderTimeout{5};
  static constexpr std::chrono::seconds kWriteTimeout{10};
  static constexpr std::chrono::seconds kStalledWrite{1};

  // What the listener counted since it started (io thread).
  using Stats = HttpCounters;

  // `counters`: where to count (the Server's, so stats and metrics show them); none: its own.
  HttpMetricsServer(boost::asio::io_context& io, RenderWorker& renderer,
                    HttpCounters* counters = nullptr);
  ~HttpMetricsServer();
  HttpMetricsServer(const HttpMetricsServer&) = delete;
  HttpMetricsServer& operator=(const HttpMetricsServer&) = delete;

  // Binds and starts accepting; an error message when the address cannot be used.
  std::optional<std::string> listen(const ListenAddress& address);
  // Stops accepting and closes every open connection.
  void close();
  boost::asio::ip::tcp::endpoint local_endpoint() const;
  const Stats& stats() const { return *shared_->stats; }
  std::size_t connections() const { return shared_->open; }
  // Metrics renders made for scrapes (each shared by every scrape waiting for it).
  std::uint64_t scrape_renders() const { return shared_->scrape_renders; }

  // Shared with connections, which may outlive this object inside the io_context. Only
  // the io thread touches it. The lists hold connections in the order they entered the
  // state, oldest first; a connection removes itself when it leaves the state or closes.
  struct Shared {
    RenderWorker* renderer = nullptr;
    // Scrapes waiting for the next render, and whether one is out (see above).
    std::vector<std::shared_ptr<HttpConnection>> scrapes_waiting;
    bool scrape_rendering = false;
    std::uint64_t scrape_renders = 0;  // renders made for scrapes (tests)
    std::size_t open = 0;              // connections counted against the caps
    std::map<boost::asio::ip::address, std::size_t> per_address;
    std::list<HttpConnection*> reading;  // waiting for (the rest of) a request
    std::list<HttpConnection*> writing;  // writing a response
    std::list<HttpConnection*> all;
    Stats own_stats;
    Stats* stats = &own_stats;  // the Server's counters, or own_stats
    RateLimitedLog log;
  };

 private:
  void accept();
  // Makes room for a connection from `address`: true when it may be admitted (possibly
  // after evicting another), false when it must be refused.
  bool make_room(const boost::asio::ip::address& address);

  boost::asio::io_context& io_;
  boost::asio::ip::tcp::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  std::shared_ptr<Shared> shared_;
};

}  // namespace steptrace::daemon
