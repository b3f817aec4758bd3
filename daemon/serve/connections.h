// steptraced's connection registry: every open Session, with the counts the connection
// limits are checked against (like the connection manager of the Boost.Asio server
// examples).
//
// Data flow: the listener accepts a socket -> admit() reads the peer's credentials and
// counts it against limits.max_connections and limits.max_connections_per_uid; over
// either, the connection is still served, by a Session that answers "too many
// connections" and closes (at most kMaxRejecting at once; beyond that it is closed
// without a word) -> the Session registers here and unregisters when it closes ->
// shutdown takes what is left in the backlog with take_for_drain() (past the limits, up
// to the fds the reserve keeps) and drains live(); the end of the server close_all()s.
//
// The counts: connections_now (ServerCounters, the total admitted and open), and the
// per-uid count kept here only; both change in one place each way (add / remove).
#pragma once

#include <sys/socket.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include <boost/asio/io_context.hpp>
#include <boost/asio/local/stream_protocol.hpp>

#include "daemon/serve/client_stream.h"
#include "daemon/serve/config.h"
#include "daemon/serve/session.h"

namespace steptrace::daemon {

class ConnectionRegistry {
 public:
  using Socket = boost::asio::local::stream_protocol::socket;
  // At most this many connections at once are kept to answer "too many connections";
  // beyond it they are closed without a word.
  static constexpr std::size_t kMaxRejecting = 64;

  // `shared`: what every Session gets (its counters and log are the server's). Every
  // member runs on `io`'s thread (io_thread.h, asserted in debug builds).
  ConnectionRegistry(boost::asio::io_context& io, SessionShared& shared,
                     const ServerLimits& limits);
  ~ConnectionRegistry();  // close_all()
  ConnectionRegistry(const ConnectionRegistry&) = delete;
  ConnectionRegistry& operator=(const ConnectionRegistry&) = delete;

  // A connection the listener accepted: served, or refused with a reply, or closed.
  void admit(Socket socket);
  // A connection queued at shutdown: drained, past the connection limits, as far as the
  // fds kept for refusals allow; else closed unread (connections_undrained).
  void take_for_drain(Socket socket);
  // Connections take_for_drain() took.
  std::uint64_t taken_for_drain() const { return taken_for_drain_; }
  // Every open Session, held (closing one calls back into the registry, so callers
  // iterate over this copy).
  std::vector<std::shared_ptr<Session>> live() const;
  void close_all();

 private:
  struct Entry {
    std::weak_ptr<Session> session;
    std::uint32_t uid = 0;  // the peer's (SO_PEERCRED)
    Refusal refusal = Refusal::kNone;
  };
  // The limit `uid`'s connection would pass, if any (logged and counted).
  Refusal check_limits(std::uint32_t uid);
  // Counts the connection in and starts its Session, which remove()s it when it closes.
  void add(Socket socket, std::optional<ucred> cred, Refusal refusal);
  void remove(Session* session);

  boost::asio::io_context& io_;
  SessionShared& shared_;
  const ServerLimits& limits_;
  std::unordered_map<Session*, Entry> sessions_;
  std::unordered_map<std::uint32_t, std::size_t> connections_by_uid_;  // admitted, open
  std::size_t rejecting_ = 0;  // sessions answering "too many connections"
  std::uint64_t taken_for_drain_ = 0;
};

}  // namespace steptrace::daemon
