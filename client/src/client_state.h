// State shared by the trainer-facing API (client.cpp) and the flusher thread
// (flusher.cpp): the per-thread rings, the custom steps, the ledger queue, pending
// flush requests and the drop counters. One instance per process, created on first use
// and never destroyed (the library stays usable from static destructors).
//
// Lock order (also what the fork handlers take, in this order): Client control mutex,
// FlushSync::mu, RingRegistry::mu, StepRegistry mutex, LedgerQueue mutex. Nothing on
// the hot path takes any of them.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "client/src/clock.h"
#include "client/src/event_ring.h"
#include "client/src/ledger_queue.h"
#include "client/src/step_registry.h"

namespace steptrace::client {

// Rings of exited threads kept (with their unsent events) while no daemon drains them;
// past this the oldest is freed and its events counted as dropped.
inline constexpr std::size_t kMaxOrphanRings = 64;

struct RingRegistry {
  std::mutex mu;
  std::vector<EventRing*> rings;      // owned; freed by the flusher once orphaned and drained
  std::uint64_t retired_dropped = 0;  // drops of rings already freed

  // Requires mu. Frees `ring` (orphaned), counting what it never delivered.
  void free_ring_locked(std::size_t index) {
    EventRing* ring = rings[index];
    retired_dropped += ring->dropped() + ring->fill();
    rings.erase(rings.begin() + static_cast<std::ptrdiff_t>(index));
    delete ring;
  }
};

// One steptrace_flush call waiting for its acknowledgement.
struct FlushWaiter {
  std::uint64_t sequence = 0;
  int result = 1;  // 1: pending, 0: acknowledged, -errno: failed
};

struct FlushSync {
  std::mutex mu;
  std::condition_variable cv;
  std::uint64_t requested = 0;        // last sequence handed out
  std::vector<FlushWaiter*> waiters;  // pending calls

  // Require mu.
  void resolve_acked_locked(std::uint64_t sequence) {
    for (auto* w : waiters) {
      if (w->result == 1 && w->sequence <= sequence) w->result = 0;
    }
    cv.notify_all();
  }
  void fail_all_locked(int error) {
    for (auto* w : waiters) {
      if (w->result == 1) w->result = error;
    }
    cv.notify_all();
  }
};

struct ClientState {
  RingRegistry registry;
  StepRegistry steps;
  LedgerQueue ledger;
  FlushSync flush;
  TickConverter converter;  // used by the flusher thread only
  ClockSource clock_source = ClockSource::kMonotonic;

  std::atomic<std::uint64_t> other_dropped{0};  // unknown steps, after shutdown, ledger, in flight
  std::atomic<bool> connected{false};
  std::atomic<int> wake_fd{-1};  // eventfd the flusher polls

  void wake() noexcept;
  // All drops so far. Requires registry.mu.
  std::uint64_t total_dropped_locked() const {
    std::uint64_t total = registry.retired_dropped + other_dropped.load(std::memory_order_relaxed);
    for (const EventRing* ring : registry.rings) total += ring->dropped();
    return total;
  }
};

}  // namespace steptrace::client
