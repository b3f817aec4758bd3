// The daemon's one threading rule, checked in debug builds: everything mutable (the
// Collector, the sessions and their registry, the timers) is touched, and every
// CollectorView made and released, by the io thread only: the one thread that runs the
// Server's io_context (docs/ARCHITECTURE.md, "Threads"). The Collector takes no locks
// because of it.
//
// An IoThread remembers that thread, one per io_context (an Asio service, so whatever
// holds the io_context, or an executor of it, finds the same one without being handed
// it), and `assert(on_io_thread(io))` at the entry points the rule covers fails when
// another thread gets there. The first check claims: the thread that starts the server
// (the snapshot is restored before run()) is the one that runs it. With NDEBUG the
// asserts compile out and nothing here runs: no lookup, no atomic, nothing on the ingest
// path. (The client's ThreadOwner, client/src/thread_owner.h, is the same idea.)
#pragma once

#include <atomic>
#include <cassert>
#include <thread>

#include <boost/asio/any_io_executor.hpp>
#include <boost/asio/execution/context.hpp>
#include <boost/asio/execution_context.hpp>
#include <boost/asio/query.hpp>

namespace steptrace::daemon {

class IoThread : public boost::asio::execution_context::service {
 public:
  static inline boost::asio::execution_context::id id;

  explicit IoThread(boost::asio::execution_context& context) : service(context) {}

  // The first caller claims; then whether the caller is the owner.
  bool claim_or_is_caller() noexcept {
    std::thread::id owner{};
    const std::thread::id self = std::this_thread::get_id();
    return owner_.compare_exchange_strong(owner, self, std::memory_order_relaxed) || owner == self;
  }

 private:
  void shutdown() override {}

  std::atomic<std::thread::id> owner_{};  // default id: nobody yet
};

// Whether the caller is `context`'s io thread (the first caller becomes it).
inline bool on_io_thread(boost::asio::execution_context& context) {
  return boost::asio::use_service<IoThread>(context).claim_or_is_caller();
}
inline bool on_io_thread(const boost::asio::any_io_executor& executor) {
  return on_io_thread(boost::asio::query(executor, boost::asio::execution::context));
}

}  // namespace steptrace::daemon
