// VRAM-ledger annotations on their way to the flusher (not the hot path).
//
// steptrace_ledger_* / steptrace_vram_sample build a proto::LedgerRecord (timestamp read
// from the same clock as the events, in raw ticks until the flusher converts it to
// CLOCK_MONOTONIC ns with the events' conversion; kernel thread id, strings cut to 63 characters
// with the kLedger*Truncated flags set and unprintable bytes replaced by '?') and push it into this
// bounded, mutex-guarded queue; when it is full the record is dropped and counted. The flusher
// reads a clock cutoff, then the rings' published heads, then takes the records stamped
// before the cutoff, and sends each one between its own thread's events in recording
// order: an annotation reaches the daemon after the start and before the end event
// around it, and never overtakes an end event it follows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "proto/wire_format.h"

namespace steptrace::client {

inline constexpr std::size_t kLedgerQueueCapacity = 1024;

// Builds a record; nullopt when gpu_uuid is null or empty (the caller counts a drop).
// A null task is empty.
std::optional<proto::LedgerRecord> make_ledger_record(proto::LedgerOp op, const char* gpu_uuid,
                                                      const char* task, std::uint64_t timestamp_ns,
                                                      std::uint32_t thread_id);

class LedgerQueue {
 public:
  explicit LedgerQueue(std::size_t capacity = kLedgerQueueCapacity) : capacity_(capacity) {
    queue_.reserve(capacity_);
  }
  // False (nothing queued) when full.
  bool push(const proto::LedgerRecord& record) {
    std::lock_guard lock(mu_);
    if (queue_.size() >= capacity_) return false;
    queue_.push_back(record);
    return true;
  }
  // Swaps the queued records into `out` (cleared first; keep its capacity reserved).
  void take(std::vector<proto::LedgerRecord>& out) {
    out.clear();
    std::lock_guard lock(mu_);
    queue_.swap(out);
    if (queue_.capacity() < capacity_) queue_.reserve(capacity_);
  }
  // Moves the records stamped at or before `cutoff` into `out` (cleared first), in
  // queue order; later ones stay queued, in order.
  void take_until(std::uint64_t cutoff, std::vector<proto::LedgerRecord>& out) {
    out.clear();
    std::lock_guard lock(mu_);
    std::size_t kept = 0;
    for (const auto& record : queue_) {
      if (record.timestamp_ns <= cutoff) {
        out.push_back(record);
      } else {
        queue_[kept++] = record;
      }
    }
    queue_.resize(kept);
  }
  std::size_t capacity() const { return capacity_; }
  std::mutex& mutex() { return mu_; }
  // Fork child, single-threaded: drop what the parent had queued.
  void clear_after_fork() { queue_.clear(); }

 private:
  const std::size_t capacity_;
  std::mutex mu_;
  std::vector<proto::LedgerRecord> queue_;
};

}  // namespace steptrace::client
