// The per-thread event buffer of libsteptrace: a bounded single-producer/single-consumer
// ring of fixed 16-byte records.
//
// Data flow: the owning trainer thread is the only producer (steptrace_start/end write
// one record and publish it with a release store of head_); the flusher thread is the
// only consumer (reads head_ with acquire, copies records out, then frees the slots
// with a release store of tail_). Neither side locks, allocates or makes a system call.
//
// Bound: kRingCapacity = 8192 records x 16 bytes = 128 KiB per recording thread. When
// the ring is full the record is dropped and counted in dropped_ (a per-thread counter
// written only by the producer with relaxed stores), unless the caller chooses to wait.
//
// A record is laid out exactly as proto::EventRecord, except that timestamp_ns holds raw
// clock ticks (TSC or CLOCK_MONOTONIC ns, see clock.h); the flusher converts them to
// CLOCK_MONOTONIC nanoseconds while encoding.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <utility>

#include "proto/wire_format.h"

namespace steptrace::client {

inline constexpr std::size_t kRingCapacity = 8192;
inline constexpr std::size_t kRingHighWater = kRingCapacity / 2;
static_assert((kRingCapacity & (kRingCapacity - 1)) == 0, "capacity must be a power of two");

// The second 8 bytes of an EventRecord (thread_id, step, kind, reserved) as one word.
constexpr std::uint64_t event_meta(std::uint32_t thread_id, std::uint32_t step,
                                   proto::EventKind kind) {
  return std::uint64_t{thread_id} | (std::uint64_t{step & 0xffffu} << 32) |
         (std::uint64_t{static_cast<std::uint8_t>(kind)} << 48);
}

class EventRing {
 public:
  struct Slot {
    std::uint64_t ticks;
    std::uint64_t meta;
  };
  static_assert(sizeof(Slot) == sizeof(proto::EventRecord));

  explicit EventRing(std::uint32_t thread_id) : thread_id_(thread_id) {}
  EventRing(const EventRing&) = delete;
  EventRing& operator=(const EventRing&) = delete;

  std::uint32_t thread_id() const { return thread_id_; }

  // ---- producer (the owning thread) ------------------------------------------------
  // Appends one record; false (nothing written) when the ring is full.
  bool try_push(std::uint64_t ticks, std::uint64_t meta) noexcept {
    const std::uint64_t head = head_.load(std::memory_order_relaxed);
    if (head - cached_tail_ >= kRingCapacity) {
      cached_tail_ = tail_.load(std::memory_order_acquire);
      if (head - cached_tail_ >= kRingCapacity) return false;
    }
    Slot& slot = slots_[head & (kRingCapacity - 1)];
    slot.ticks = ticks;
    slot.meta = meta;
    head_.store(head + 1, std::memory_order_release);
    return true;
  }
  void count_drop() noexcept {
    dropped_.store(dropped_.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }

  // ---- consumer (the flusher) --------------------------------------------------------
  std::uint64_t published() const noexcept { return head_.load(std::memory_order_acquire); }
  std::uint64_t consumed() const noexcept { return tail_.load(std::memory_order_relaxed); }
  std::uint64_t dropped() const noexcept { return dropped_.load(std::memory_order_relaxed); }
  // The records [consumed(), upto) as at most two contiguous runs (the ring wraps).
  // `upto` must be a value published() returned.
  std::pair<std::span<const Slot>, std::span<const Slot>> readable(std::uint64_t upto) const {
    return range(consumed(), upto);
  }
  // The records [from, to) (consumed() <= from <= to <= a published() value).
  std::pair<std::span<const Slot>, std::span<const Slot>> range(std::uint64_t from,
                                                                std::uint64_t to) const {
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t first = static_cast<std::size_t>(from & (kRingCapacity - 1));
    const std::size_t run = std::min(n, kRingCapacity - first);
    return {std::span<const Slot>(slots_ + first, run), std::span<const Slot>(slots_, n - run)};
  }
  const Slot& at(std::uint64_t index) const { return slots_[index & (kRingCapacity - 1)]; }
  // Frees the slots before `new_tail` for the producer.
  void release(std::uint64_t new_tail) noexcept {
    tail_.store(new_tail, std::memory_order_release);
  }
  std::size_t fill() const noexcept { return static_cast<std::size_t>(published() - consumed()); }

  // ---- ownership -------------------------------------------------------------------
  // The owning thread exited: the flusher drains the ring and then frees it.
  void orphan() noexcept { orphaned_.store(true, std::memory_order_release); }
  bool orphaned() const noexcept { return orphaned_.load(std::memory_order_acquire); }

  // Producer-only state for the opt-in blocking mode: after one bounded wait timed out
  // the thread drops without waiting until the flusher frees a slot again.
  bool stalled = false;
  std::uint64_t stalled_tail = 0;

 private:
  const std::uint32_t thread_id_;
  alignas(64) std::atomic<std::uint64_t> head_{0};
  std::uint64_t cached_tail_ = 0;  // producer's last view of tail_
  std::atomic<std::uint64_t> dropped_{0};
  alignas(64) std::atomic<std::uint64_t> tail_{0};
  std::atomic<bool> orphaned_{false};
  alignas(64) Slot slots_[kRingCapacity];
};

}  // namespace steptrace::client
