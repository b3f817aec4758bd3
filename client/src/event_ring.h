// The per-thread event buffer of libsteptrace: a bounded single-producer/single-consumer
// ring of fixed 16-byte records.
//
// Data flow: the owning trainer thread is the only producer (steptrace_start/end write
// one record and publish it with a release store of head_); the flusher thread is the
// only consumer (reads head_ with acquire, copies records out, then frees the slots
// with a release store of tail_). Neither side locks or allocates; the producer makes
// no system call except one eventfd write per high-water episode (below).
//
// Capacity: a power of two of records chosen when the ring is made (kMinRingRecords ..
// kMaxRingRecords: 64 KiB .. 1 GiB; the library's default is 4 MiB = 262,144 records,
// see ring_budget.h). Memory: proto/shm_ring.h's layout, a 4 KiB header (head, tail,
// drop counters, orphaned) then the slots, in a sealed memfd mapped MAP_SHARED and
// MADV_DONTFORK (protocol version 5: the daemon maps it too and consumes it directly,
// so what a thread recorded survives the process's death), or, when memfds are off
// (STEPTRACE_SHM_RINGS=0) or fail, an anonymous private mapping with MAP_NORESERVE.
// Either way a page is committed when the producer first writes it, so a ring costs
// resident memory only as far as its thread has ever filled it. munmap on free.
//
// Consumer: the flusher (Sharing::kLocal: it encodes the events for the socket) or, once
// the daemon answered a RingAttach with kMapped, the daemon (kShared). One at a time.
//
// High water: min(capacity / 8, kMaxHighWater) records. The push that finds that many
// records unconsumed returns kPushedWake once: the caller then wakes the flusher (one
// eventfd write), so a burst is drained without waiting for the flusher's 1-2 ms poll.
// No further wake comes until the producer sees the consumer's tail move (the flusher
// ran); if the ring is still above the mark then, the next push wakes again. While the
// ring is below the mark the producer's fast path is unchanged: one compare of head
// against the cached tail; above it each push re-reads tail_ (one acquire load).
// Why capacity / 8, at most 32,768 records (512 KiB): the wake costs one syscall per
// that many events (<= 0.1 ns per event at the default size; >= 512 events even for
// the smallest ring); 7/8 of the ring is left as headroom for the flusher to wake up
// and drain; and at 4 M events/s (2 M spans/s, the design rate per thread) 32,768
// records are 8 ms of events, four times the poll period, so at a steady rate the poll
// alone keeps up and the wake fires only in bursts or when the flusher fell behind.
//
// When the ring is full the record is not written; the caller drops and counts it in
// one of the ring's two producer-written counters (relaxed atomics): buffer_full (the
// daemon is connected but fell behind) or not_connected.
//
// A record is laid out exactly as proto::EventRecord, except that timestamp_ns holds raw
// clock ticks (TSC or CLOCK_MONOTONIC ns, see clock.h); the flusher converts them to
// CLOCK_MONOTONIC nanoseconds while encoding.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cassert>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <new>
#include <span>
#include <utility>

#include "client/src/thread_owner.h"
#include "proto/shm_ring.h"
#include "proto/wire_format.h"

namespace steptrace::client {

inline constexpr std::size_t kRingRecordBytes = sizeof(proto::EventRecord);
inline constexpr std::size_t kMinRingRecords = std::size_t{64} * 1024 / kRingRecordBytes;
inline constexpr std::size_t kMaxRingRecords = (std::size_t{1} << 30) / kRingRecordBytes;
inline constexpr std::size_t kMaxHighWater = 32768;
static_assert(kMinRingRecords == proto::kMinShmRingRecords &&
                  kMaxRingRecords == proto::kMaxShmRingRecords,
              "every ring the budget allows can be shared");

constexpr std::size_t ring_high_water(std::size_t capacity) {
  return std::min(capacity / 8, kMaxHighWater);
}

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

  enum class Push : std::uint8_t {
    kPushed,      // written
    kPushedWake,  // written, and the ring just reached its high-water mark: wake the flusher
    kFull,        // nothing written
  };
  // Who consumes the ring on the current connection (flusher thread, under RingRegistry::mu).
  enum class Sharing : std::uint8_t {
    kLocal,    // the flusher: it encodes the events and sends them on the socket
    kOffered,  // a RingAttach was sent, no RingAck yet: nobody consumes
    kShared,   // the daemon maps the memfd and consumes it
  };

  // `capacity`: records, a power of two (0 makes a ring that is always full and maps
  // nothing: the stand-in of a thread that got no ring). `shared`: back it with a sealed
  // memfd the daemon can map (proto/shm_ring.h); when that fails the ring is anonymous
  // memory and goes over the socket. Throws std::bad_alloc when no mapping can be made.
  EventRing(std::uint32_t thread_id, std::size_t capacity, bool shared = false)
      : thread_id_(thread_id),
        mask_(capacity == 0 ? 0 : capacity - 1),
        high_water_(ring_high_water(capacity)),
        capacity_(capacity) {
    map(shared);
    slots_ = capacity == 0 ? nullptr
                           : reinterpret_cast<Slot*>(reinterpret_cast<std::byte*>(header_) +
                                                     proto::kRingHeaderBytes);
  }
  ~EventRing() {
    if (header_ != &own_header_ && header_ != nullptr) ::munmap(header_, mapped_bytes());
    if (memfd_ >= 0) ::close(memfd_);
  }
  EventRing(const EventRing&) = delete;
  EventRing& operator=(const EventRing&) = delete;

  std::uint32_t thread_id() const { return thread_id_; }
  // A spare ring (made with thread 0 by the flusher, protocol version 8) becomes the
  // calling thread's: its id goes into the header (release) before any record, so the
  // daemon, which may map the ring already, reads it after a head that shows a record.
  // Requires RingRegistry::mu (the flusher reads thread_id() under it).
  void claim(std::uint32_t thread_id) noexcept {
    assert(thread_id_ == 0 && thread_id != 0);
    thread_id_ = thread_id;
    proto::ring_thread_field(*header_).store(thread_id, std::memory_order_release);
  }
  bool spare() const { return thread_id_ == 0 && capacity_ != 0; }
  // A spare a new thread may take: not claimed, not given up (orphaned), and of the size
  // threads get now (`per_thread_bytes`, RingRegistry's). The one test behind
  // RingRegistry::take_spare_locked, spares_locked and the flusher's keep_spares, which
  // orphans the spares that fail it. Requires RingRegistry::mu.
  bool takeable_spare(std::uint64_t per_thread_bytes) const {
    return spare() && !orphaned() && bytes() == per_thread_bytes;
  }
  std::size_t capacity() const { return capacity_; }
  std::size_t high_water() const { return high_water_; }
  // The budget's bytes: the slots (the header page is not counted).
  std::size_t bytes() const { return capacity_ * sizeof(Slot); }
  // The memfd the daemon may map (-1: anonymous memory, socket path only).
  int memfd() const { return memfd_; }

  // ---- producer (the owning thread) ------------------------------------------------
  Push try_push(std::uint64_t ticks, std::uint64_t meta) noexcept {
    assert(is_producer());
    const std::uint64_t head = head_;
    Push result = Push::kPushed;
    if (head - cached_tail_ >= high_water_) [[unlikely]] {
      result = refresh(head);
      if (result == Push::kFull) return result;
    }
    Slot& slot = slots_[head & mask_];
    slot.ticks = ticks;
    slot.meta = meta;
    head_ = head + 1;
    proto::ring_field(header_->head).store(head + 1, std::memory_order_release);
    return result;
  }
  // Producer-only counters (relaxed; the flusher, the daemon and steptrace_dropped read them).
  void count_buffer_full() noexcept {
    assert(is_producer());
    bump(header_->dropped_buffer_full);
  }
  void count_not_connected() noexcept {
    assert(is_producer());
    bump(header_->dropped_not_connected);
  }

  // ---- consumer (the flusher, or the daemon once shared) -----------------------------
  std::uint64_t published() const noexcept {
    return proto::ring_field(header_->head).load(std::memory_order_acquire);
  }
  std::uint64_t consumed() const noexcept {
    return proto::ring_field(header_->tail).load(std::memory_order_acquire);
  }
  std::uint64_t dropped_buffer_full() const noexcept {
    return proto::ring_field(header_->dropped_buffer_full).load(std::memory_order_relaxed);
  }
  std::uint64_t dropped_not_connected() const noexcept {
    return proto::ring_field(header_->dropped_not_connected).load(std::memory_order_relaxed);
  }
  std::uint64_t dropped() const noexcept { return dropped_buffer_full() + dropped_not_connected(); }
  // The records [consumed(), upto) as at most two contiguous runs (the ring wraps).
  // `upto` must be a value published() returned.
  std::pair<std::span<const Slot>, std::span<const Slot>> readable(std::uint64_t upto) const {
    return range(consumed(), upto);
  }
  // The records [from, to) (consumed() <= from <= to <= a published() value).
  std::pair<std::span<const Slot>, std::span<const Slot>> range(std::uint64_t from,
                                                                std::uint64_t to) const {
    const std::size_t n = static_cast<std::size_t>(to - from);
    const std::size_t first = static_cast<std::size_t>(from & mask_);
    const std::size_t run = std::min(n, capacity_ - first);
    return {std::span<const Slot>(slots_ + first, run), std::span<const Slot>(slots_, n - run)};
  }
  const Slot& at(std::uint64_t index) const { return slots_[index & mask_]; }
  // Frees the slots before `new_tail` for the producer.
  void release(std::uint64_t new_tail) noexcept {
    proto::ring_field(header_->tail).store(new_tail, std::memory_order_release);
  }
  std::size_t fill() const noexcept { return static_cast<std::size_t>(published() - consumed()); }

  // ---- ownership -------------------------------------------------------------------
  // The owning thread exited: its consumer drains the ring and then frees it.
  void orphan() noexcept {
    orphaned_.store(true, std::memory_order_release);
    proto::ring_field(header_->orphaned).store(1, std::memory_order_release);
  }
  bool orphaned() const noexcept { return orphaned_.load(std::memory_order_acquire); }
  // Fork child: the shared mapping is not inherited (MADV_DONTFORK): forget it without
  // touching it, and close the inherited memfd.
  void forget_after_fork() noexcept {
    if (memfd_ >= 0) {
      ::close(memfd_);
      memfd_ = -1;
      header_ = nullptr;  // not mapped here: never unmapped either
    }
  }

  // Flusher-only, under RingRegistry::mu: the ring's consumer on this connection and its
  // name in RingAttach/RingAck.
  Sharing sharing = Sharing::kLocal;
  bool refused = false;     // the daemon of this connection refused it: not offered again
  bool made_spare = false;  // made by keep_spares (claimed or not): its RingAck says whether
                            // the daemon still takes spares
  // Offered to a daemon (which may have mapped it); cleared once that daemon let it go.
  bool was_shared = false;
  // Whether no daemon reads the ring any more (requires RingRegistry::mu): never shared,
  // or the header's consumer_pid is 0 (that daemon unmapped it after its last pass) or
  // names no live process (it crashed). Until then nobody else consumes or frees it.
  bool consumer_gone() noexcept {
    if (!was_shared) return true;
    const std::uint64_t pid =
        proto::ring_field(header_->consumer_pid).load(std::memory_order_acquire);
    if (pid != 0 && pid <= 0x7fffffff &&
        (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH)) {
      return false;
    }
    was_shared = false;
    daemon_took += consumed() - shared_from;  // only that daemon moved the tail meanwhile
    return true;
  }
  // Offered to a daemon at tail `tail`, read before the offer went out: from then on the
  // daemon may consume the ring, and it may do so before the sending call returns here.
  void offered(std::uint64_t tail) noexcept {
    was_shared = true;
    shared_from = tail;
  }
  // The daemon said it does not map the ring: it never consumed any of it.
  void refused_by_daemon() noexcept {
    was_shared = false;
    refused = true;
  }
  // Records daemons consumed (folded) from this ring, over every daemon that let it go
  // (the Delivered frame's part of the ring).
  std::uint64_t daemon_took = 0;
  // The same, and what the daemon that may still map it took, for a ring freed without
  // waiting for that daemon (its thread exited and the daemon read everything: the tail
  // cannot move any more).
  std::uint64_t taken_by_daemons() const noexcept {
    return daemon_took + (was_shared ? consumed() - shared_from : 0);
  }
  std::uint64_t shared_from = 0;  // the tail when it was offered
  std::uint32_t ring_id = 0;

  // Producer-only state for the opt-in blocking mode: after one bounded wait timed out
  // the thread drops without waiting until the flusher frees a slot again.
  bool stalled = false;
  std::uint64_t stalled_tail = 0;

  // Debug builds: whether the caller is the ring's one producer, the first thread that
  // pushed or counted (the thread that makes a ring need not be the one that fills it).
  // A ring of capacity 0 is the shared stand-in of threads without one (Client::no_ring):
  // it has no producer state to protect, so any thread may call it.
  bool is_producer() noexcept { return capacity_ == 0 || producer_.claim_or_is_caller(); }

 private:
  std::size_t mapped_bytes() const { return proto::shm_ring_bytes(capacity_); }
  void map(bool shared) {
    if (capacity_ == 0) {
      header_ = &own_header_;
      return;
    }
    const std::size_t size = mapped_bytes();
    if (shared) {
      const int fd = ::memfd_create("steptrace-ring", MFD_CLOEXEC | MFD_ALLOW_SEALING);
      if (fd >= 0) {
        void* p = MAP_FAILED;
        if (::ftruncate(fd, static_cast<off_t>(size)) == 0 &&
            ::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0) {
          p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        }
        // A forked child must never write into its parent's rings.
        if (p != MAP_FAILED && ::madvise(p, size, MADV_DONTFORK) != 0) {
          ::munmap(p, size);
          p = MAP_FAILED;
        }
        if (p != MAP_FAILED) {
          memfd_ = fd;
          header_ = static_cast<proto::RingHeader*>(p);
          init_header();
          return;
        }
        ::close(fd);
      }
    }
    void* p = ::mmap(nullptr, size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    header_ = static_cast<proto::RingHeader*>(p);
    init_header();
  }
  void init_header() noexcept {
    header_->magic = proto::kRingMagic;
    header_->layout_version = proto::kRingLayoutVersion;
    proto::ring_thread_field(*header_).store(thread_id_, std::memory_order_relaxed);
    header_->capacity = capacity_;
  }
  static void bump(std::uint64_t& field) noexcept {
    auto counter = proto::ring_field(field);
    counter.store(counter.load(std::memory_order_relaxed) + 1, std::memory_order_relaxed);
  }
  // The producer's slow path: at or above the high-water mark by its cached view.
  Push refresh(std::uint64_t head) noexcept {
    const std::uint64_t tail = consumed();
    if (tail != cached_tail_) {  // the consumer ran since the last look: a new episode
      cached_tail_ = tail;
      wake_sent_ = false;
    }
    // A consumer that wrote a tail past the head (only a broken one could) frees nothing.
    const std::uint64_t fill = head - tail;
    if (fill >= capacity_) return Push::kFull;
    if (fill < high_water_ || wake_sent_) return Push::kPushed;
    wake_sent_ = true;
    return Push::kPushedWake;
  }

  // Producer's line: read and written by the owning thread per event.
  alignas(64) std::uint64_t head_ = 0;  // the producer's own copy of header_->head
  std::uint64_t cached_tail_ = 0;       // producer's last view of the tail
  proto::RingHeader* header_ = nullptr;
  Slot* slots_ = nullptr;
  std::uint32_t thread_id_;  // 0: a spare ring no thread has claimed yet
  bool wake_sent_ = false;   // a wake was asked for since cached_tail_ last moved
  const std::size_t mask_;
  const std::size_t high_water_;
  const std::size_t capacity_;
  int memfd_ = -1;
  alignas(64) std::atomic<bool> orphaned_{false};
  ThreadOwner producer_;            // debug builds only: read by is_producer()
  proto::RingHeader own_header_{};  // the header of a ring of capacity 0
};

}  // namespace steptrace::client
