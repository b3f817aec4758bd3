// steptraced's listening socket: the Unix stream socket clients connect to, and the
// accept loop on it.
//
// Data flow: open() adopts the socket systemd passed (socket activation) or binds
// config.socket itself (refusing an unsafe directory, a live daemon already there or a
// path that is not a socket; replacing a stale socket), sets its mode and listens ->
// accept() hands every accepted socket to the server's handler (`admit`); a failed accept
// (EMFILE and friends) backs off 100 ms -> at shutdown, take_backlog() removes the socket
// file (no new client finds it), takes what is already queued, boundedly, and closes the
// acceptor; a connection accepted but not yet handled when that began goes to `drain`
// too. The socket file is removed when the listener ends, only if it is still the one it
// bound (never one another daemon bound after it, never systemd's).
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <functional>
#include <optional>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>
#include <boost/asio/steady_timer.hpp>

#include "daemon/serve/client_stream.h"
#include "daemon/serve/config.h"

namespace steptrace::daemon {

class Listener {
 public:
  using Socket = boost::asio::local::stream_protocol::socket;
  using Handler = std::function<void(Socket)>;

  // `log`: the server's, for a failed accept.
  Listener(boost::asio::io_context& io, const Config& config, RateLimitedLog& log);
  ~Listener();  // remove_socket_file()
  Listener(const Listener&) = delete;
  Listener& operator=(const Listener&) = delete;

  // Binds (or adopts) the socket and listens. On failure a one-line message, with no
  // socket file left behind.
  std::optional<std::string> open();
  // The socket's path (after open()).
  const std::string& path() const { return path_; }
  // Closes the acceptor and removes the socket file (start() failed after open()).
  void close();

  // Starts the accept loop: `admit` gets each accepted socket until take_backlog() runs;
  // `drain` gets one accepted before it and handled after (its data was sent before
  // the shutdown, so it is drained too).
  void accept(Handler admit, Handler drain);
  // Shutdown: removes the socket file, stops the accept loop, hands at most `bound`
  // connections still in the listen backlog to `drain` and closes the acceptor.
  void take_backlog(std::size_t bound);
  // Removes the socket file if this listener bound it and it is still that socket.
  void remove_socket_file();

 private:
  std::optional<std::string> adopt_activation_socket();
  std::optional<std::string> clear_old_socket();
  std::optional<std::string> bind_and_listen();
  void accept_next();
  void on_accept(const boost::system::error_code& ec, Socket socket);

  boost::asio::io_context& io_;
  const Config& config_;
  RateLimitedLog& log_;
  boost::asio::local::stream_protocol::acceptor acceptor_;
  boost::asio::steady_timer retry_timer_;
  Handler admit_;
  Handler drain_;
  bool stopping_ = false;  // take_backlog() ran

  std::string path_;
  bool adopted_ = false;  // systemd's: never removed by us
  bool bound_ = false;
  dev_t dev_ = 0;  // the socket file we bound, told apart from one bound after us
  ino_t ino_ = 0;
};

}  // namespace steptrace::daemon
