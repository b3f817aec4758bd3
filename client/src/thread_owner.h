// The library's single-thread rules (one producer per ring, connection state touched by
// the flusher thread only), checked in debug builds: a ThreadOwner remembers the thread
// that owns something, and `assert(owner.is_caller())` at the places the rule covers
// fails when another thread gets there. With NDEBUG the asserts compile out and nothing
// here runs: the hot path stays one relaxed load and one store, no lock, no allocation.
#pragma once

#include <atomic>
#include <thread>

namespace steptrace::client {

class ThreadOwner {
 public:
  // The calling thread owns from now on (e.g. a flusher thread that starts).
  void claim() noexcept { owner_.store(std::this_thread::get_id(), std::memory_order_relaxed); }
  // Whether the calling thread is the owner.
  bool is_caller() const noexcept {
    return owner_.load(std::memory_order_relaxed) == std::this_thread::get_id();
  }
  // The first caller claims; then whether the caller is the owner.
  bool claim_or_is_caller() noexcept {
    std::thread::id owner{};
    const std::thread::id self = std::this_thread::get_id();
    return owner_.compare_exchange_strong(owner, self, std::memory_order_relaxed) || owner == self;
  }

 private:
  std::atomic<std::thread::id> owner_{};  // default id: nobody yet
};

}  // namespace steptrace::client
