#include "daemon/serve/connections.h"

#include <cassert>
#include <string>
#include <utility>

#include "daemon/serve/io_thread.h"

namespace steptrace::daemon {
namespace {

// A peer whose credentials are unreadable counts as uid nobody (such a peer is refused
// by the commands that need a uid anyway).
std::uint32_t uid_of(const std::optional<ucred>& cred) { return cred ? cred->uid : kNobodyUid; }

}  // namespace

ConnectionRegistry::ConnectionRegistry(boost::asio::io_context& io, SessionShared& shared,
                                       const ServerLimits& limits)
    : io_(io), shared_(shared), limits_(limits) {}

ConnectionRegistry::~ConnectionRegistry() { close_all(); }

void ConnectionRegistry::admit(Socket socket) {
  assert(on_io_thread(io_));
  ++shared_.counters.connections_total;
  // Read once here, for the quota and for the session.
  const std::optional<ucred> cred = peer_credentials(socket);
  const Refusal refusal = check_limits(uid_of(cred));
  if (refusal != Refusal::kNone) {
    ++shared_.counters.connections_rejected;  // a limit hit too (DaemonCounters::add)
    if (rejecting_ >= kMaxRejecting) {
      boost::system::error_code close_ec;
      socket.close(close_ec);
      return;
    }
  }
  add(std::move(socket), cred, refusal);
}

Refusal ConnectionRegistry::check_limits(std::uint32_t uid) {
  ServerCounters& counters = shared_.counters;
  if (counters.connections_now >= limits_.max_connections) {
    shared_.log.warn("max_connections", "connection rejected: max_connections (" +
                                            std::to_string(limits_.max_connections) + ") reached");
    return Refusal::kMaxConnections;
  }
  if (const auto it = connections_by_uid_.find(uid);
      it != connections_by_uid_.end() && it->second >= limits_.max_connections_per_uid) {
    // One tenant may not take every slot: the others still get in.
    ++counters.connections_rejected_per_uid;
    shared_.log.warn("max_connections_per_uid",
                     "connection of uid " + std::to_string(uid) +
                         " rejected: max_connections_per_uid (" +
                         std::to_string(limits_.max_connections_per_uid) + ") reached");
    return Refusal::kMaxConnectionsPerUid;
  }
  return Refusal::kNone;
}

void ConnectionRegistry::take_for_drain(Socket socket) {
  assert(on_io_thread(io_));
  ++shared_.counters.connections_total;
  if (sessions_.size() >= limits_.max_connections + kMaxRejecting) {
    ++shared_.counters.connections_undrained;
    boost::system::error_code ec;
    socket.close(ec);
    return;
  }
  ++taken_for_drain_;
  const std::optional<ucred> cred = peer_credentials(socket);
  add(std::move(socket), cred, Refusal::kNone);
}

void ConnectionRegistry::add(Socket socket, std::optional<ucred> cred, Refusal refusal) {
  const std::uint32_t uid = uid_of(cred);
  if (refusal != Refusal::kNone) {
    ++rejecting_;
  } else {
    ++shared_.counters.connections_now;
    ++connections_by_uid_[uid];
  }
  auto session = std::make_shared<Session>(
      std::move(socket), shared_, [this](Session* s) { remove(s); }, cred, refusal);
  sessions_.emplace(session.get(), Entry{session, uid, refusal});
  session->start();
}

void ConnectionRegistry::remove(Session* session) {
  assert(on_io_thread(io_));
  auto it = sessions_.find(session);
  if (it == sessions_.end()) return;
  if (it->second.refusal != Refusal::kNone) {
    --rejecting_;
  } else {
    --shared_.counters.connections_now;
    const auto by_uid = connections_by_uid_.find(it->second.uid);
    if (by_uid != connections_by_uid_.end() && --by_uid->second == 0) {
      connections_by_uid_.erase(by_uid);
    }
  }
  sessions_.erase(it);
}

std::vector<std::shared_ptr<Session>> ConnectionRegistry::live() const {
  assert(on_io_thread(io_));
  std::vector<std::shared_ptr<Session>> live;
  for (const auto& [ptr, entry] : sessions_) {
    if (auto s = entry.session.lock()) live.push_back(std::move(s));
  }
  return live;
}

void ConnectionRegistry::close_all() {
  // close() calls back into remove(), so iterate over a copy.
  for (auto& s : live()) s->close();
}

}  // namespace steptrace::daemon
