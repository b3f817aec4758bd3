// State shared by the trainer-facing API (client.cpp) and the flusher thread
// (flusher.cpp): the per-thread rings and their memory budget, the custom steps, the
// ledger queue, pending flush requests and the drop counters. One instance per process,
// created on first use and never destroyed (the library stays usable from static
// destructors).
//
// Lock order (also what the fork handlers take, in this order): Client control mutex,
// FlushSync::mu, RingRegistry::mu, StepRegistry mutex, LedgerQueue mutex. Nothing on
// the hot path takes any of them.
//
// Drops are counted under exactly one proto::DropCause each: by the producer in its
// ring (buffer_full, not_connected: a full ring), and otherwise in
// ClientState::other_dropped (unknown step ids, refused ledger calls, a full ledger
// queue, threads without a ring, recording after shutdown, events lost with a broken
// connection, events left at exit); RingRegistry::retired keeps the counts of rings
// already freed.
#pragma once

#include <time.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "client/src/clock.h"
#include "client/src/event_ring.h"
#include "client/src/identity.h"
#include "client/src/ledger_queue.h"
#include "client/src/ring_budget.h"
#include "client/src/step_registry.h"
#include "proto/unique_fd.h"

namespace steptrace::client {

// Rings of exited threads kept (with their unsent events) while no daemon drains them;
// past this the oldest is freed and its events counted as dropped.
inline constexpr std::size_t kMaxOrphanRings = 64;

constexpr std::size_t cause_index(proto::DropCause cause) {
  return static_cast<std::size_t>(cause);
}

struct RingRegistry {
  std::mutex mu;
  // Freed by the flusher once orphaned and drained. A thread's t_ring and pthread key
  // value point at its ring without owning it.
  std::vector<std::unique_ptr<EventRing>> rings;
  proto::DroppedByCause retired{};  // drops of rings already freed
  // The part of `retired` from rings freed while the daemon of the current connection
  // mapped them: that daemon counts those from the rings' headers itself (cleared on
  // each new connection, whose daemon never saw them).
  proto::DroppedByCause retired_shared{};
  // Events daemons took (the Delivered frame): of rings already freed, and of Events
  // frames a FlushAck acknowledged. With each ring's daemon_took, what the process
  // delivered.
  std::uint64_t delivered = 0;
  std::uint32_t next_ring_id = 0;

  // The memory budget of the rings (ring_budget.h). All require mu.
  std::uint64_t per_thread_bytes = kDefaultRingBytes;
  std::uint64_t total_bytes = kDefaultTotalRingBytes;
  std::uint64_t used_bytes = 0;  // sum of bytes() of the rings in `rings`
  // Bumped whenever a ring's bytes return to the budget: a thread that got no ring
  // tries again when it sees a new value.
  std::atomic<std::uint64_t> budget_epoch{0};

  // Requires mu. The events daemons took of this process's, up to each ring's daemon
  // that let it go (a ring whose daemon still runs counts up to its offer).
  std::uint64_t delivered_locked() {
    std::uint64_t total = delivered;
    for (auto& ring : rings) {
      ring->consumer_gone();  // settles the rings of a daemon that is gone
      total += ring->daemon_took;
    }
    return total;
  }

  // Spares threads took so far (take_spare_locked). With budget_epoch, what tells the
  // flusher that it may have spares to make (Flusher::keep_spares): bumped under mu, read
  // without it.
  std::atomic<std::uint64_t> spares_taken{0};

  // Requires mu. A spare ring a thread may take (EventRing::takeable_spare), one already
  // offered to the daemon first, claimed for `thread_id`; nullptr when there is none.
  EventRing* take_spare_locked(std::uint32_t thread_id) {
    EventRing* found = nullptr;
    for (auto& ring : rings) {
      if (!ring->takeable_spare(per_thread_bytes)) continue;
      if (ring->sharing != EventRing::Sharing::kLocal) {
        found = ring.get();
        break;
      }
      if (found == nullptr) found = ring.get();
    }
    if (found == nullptr) return nullptr;
    found->claim(thread_id);
    spares_taken.fetch_add(1, std::memory_order_relaxed);
    return found;
  }
  // Requires mu. How many take_spare_locked could give.
  std::size_t spares_locked() const {
    return static_cast<std::size_t>(
        std::count_if(rings.begin(), rings.end(),
                      [this](const auto& ring) { return ring->takeable_spare(per_thread_bytes); }));
  }

  // Requires mu. Frees `ring` (orphaned, or any ring when nothing will drain it again),
  // counting what it never delivered under not_connected.
  void free_ring_locked(std::size_t index) {
    const EventRing& ring = *rings[index];
    retired.count[cause_index(proto::DropCause::kBufferFull)] += ring.dropped_buffer_full();
    retired.count[cause_index(proto::DropCause::kNotConnected)] +=
        ring.dropped_not_connected() + ring.fill();
    if (ring.sharing != EventRing::Sharing::kLocal) {
      retired_shared.count[cause_index(proto::DropCause::kBufferFull)] +=
          ring.dropped_buffer_full();
      retired_shared.count[cause_index(proto::DropCause::kNotConnected)] +=
          ring.dropped_not_connected();
    }
    delivered += ring.taken_by_daemons();
    used_bytes -= ring.bytes();
    rings.erase(rings.begin() + static_cast<std::ptrdiff_t>(index));  // frees it
    budget_epoch.fetch_add(1, std::memory_order_release);
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
  void fail_all_locked(int error) { fail_upto_locked(UINT64_MAX, error); }
  // Fails the pending calls whose sequence is at most `sequence`.
  void fail_upto_locked(std::uint64_t sequence, int error) {
    for (auto* w : waiters) {
      if (w->result == 1 && w->sequence <= sequence) w->result = error;
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

  // Drops no ring counts, per proto::DropCause.
  std::atomic<std::uint64_t> other_dropped[proto::kDropCauseCount] = {};
  std::atomic<bool> connected{false};
  // The eventfd the flusher polls: wake_event owns it, wake_fd is its number for the
  // producers, read without a lock (-1: none).
  proto::UniqueFd wake_event;
  std::atomic<int> wake_fd{-1};
  // The hello version of the next connection: kProtocolVersion, one less each time a
  // daemon answered a hello with ErrorCode::kUnsupportedVersion, down to 1; it never goes
  // up again (PROTOCOL.md section 6).
  std::atomic<std::uint16_t> protocol_version{proto::kProtocolVersion};
  // Protocol version 7: the number of the process's next socket batch (flusher thread
  // only; every Flusher of the process continues it). It starts at the wall clock in ns,
  // so that a library loaded again in the same process (exec keeps the pid and start
  // time the daemon knows it by) numbers its batches after the last image's: the daemon
  // would skip lower numbers as already applied.
  std::uint64_t next_batch_number = 0;
  std::uint64_t next_batch() {
    if (next_batch_number == 0) {
      timespec now{};
      ::clock_gettime(CLOCK_REALTIME, &now);
      next_batch_number = static_cast<std::uint64_t>(now.tv_sec) * 1'000'000'000u +
                          static_cast<std::uint64_t>(now.tv_nsec) + 1;
    }
    return next_batch_number++;
  }
  // STEPTRACE_QUIET=1 (read at load): no first-contact notice on stderr.
  bool quiet = false;
  // Rings in memfds the daemon maps (protocol version 5); STEPTRACE_SHM_RINGS=0 (read at
  // load) keeps every ring on the socket path.
  bool shm_rings = true;
  // Rings the daemon refused to map (RingAck not kMapped): they went on the socket path.
  std::atomic<std::uint64_t> rings_refused{0};
  // The job and ranks from the environment (read at load; identity.h).
  ProcessIdentity identity;
  // The first-contact notice was printed (or is being): never again in this process.
  std::atomic<bool> notice_printed{false};

  void wake() noexcept;
  // `fd` is the wake eventfd from now on; the previous one is closed.
  void set_wake_event(proto::UniqueFd fd) noexcept {
    wake_fd.store(fd.get(), std::memory_order_relaxed);
    wake_event = std::move(fd);
  }
  // Calls refused for their arguments (steptrace_rejected): bad step names, unknown ids,
  // unusable ledger calls.
  std::atomic<std::uint64_t> rejected{0};
  void count_rejected() noexcept { rejected.fetch_add(1, std::memory_order_relaxed); }
  void count_drops(proto::DropCause cause, std::uint64_t n = 1) noexcept {
    other_dropped[cause_index(cause)].fetch_add(n, std::memory_order_relaxed);
  }
  // All drops so far, per cause. Requires registry.mu.
  proto::DroppedByCause dropped_locked() const {
    proto::DroppedByCause d = registry.retired;
    for (std::size_t c = 0; c < proto::kDropCauseCount; ++c) {
      d.count[c] += other_dropped[c].load(std::memory_order_relaxed);
    }
    for (const auto& ring : registry.rings) {
      d.count[cause_index(proto::DropCause::kBufferFull)] += ring->dropped_buffer_full();
      d.count[cause_index(proto::DropCause::kNotConnected)] += ring->dropped_not_connected();
    }
    return d;
  }
  // What the DroppedByCause frame says on a connection whose daemon maps some rings:
  // everything but the counts in the headers of the rings offered to it (it reads those
  // itself, PROTOCOL.md 11.4), so each drop is counted in one place. Requires registry.mu.
  proto::DroppedByCause dropped_for_daemon_locked() const {
    proto::DroppedByCause d = dropped_locked();
    auto take = [&](proto::DropCause cause, std::uint64_t n) {
      std::uint64_t& c = d.count[cause_index(cause)];
      c = c >= n ? c - n : 0;
    };
    for (std::size_t c = 0; c < proto::kDropCauseCount; ++c) {
      take(static_cast<proto::DropCause>(c), registry.retired_shared.count[c]);
    }
    for (const auto& ring : registry.rings) {
      if (ring->sharing == EventRing::Sharing::kLocal) continue;
      take(proto::DropCause::kBufferFull, ring->dropped_buffer_full());
      take(proto::DropCause::kNotConnected, ring->dropped_not_connected());
    }
    return d;
  }
  // Their sum. Requires registry.mu.
  std::uint64_t total_dropped_locked() const {
    const proto::DroppedByCause d = dropped_locked();
    std::uint64_t total = 0;
    for (const std::uint64_t n : d.count) total += n;
    return total;
  }
};

}  // namespace steptrace::client
