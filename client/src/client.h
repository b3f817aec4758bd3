// libsteptrace's core: the per-process Client (lifecycle, flusher, fork and exit
// handling) and the inline hot path that steptrace_start/end compile to.
//
// Hot path (record()): one relaxed load of the mode (off / record / drop-and-count),
// a range check of the step id, the thread's ring pointer (an initial-exec TLS slot),
// one clock read, one 16-byte store and a release store of the ring head. The first
// event of a thread takes the slow path (first_event): it maps the thread's ring (its
// size from the budget, ring_budget.h), registers it under the registry mutex and arms a
// pthread key whose destructor hands the ring to the flusher when the thread exits
// (drained, then freed: nothing lost); in a process that never called connect or
// shutdown it also starts the auto-connect (Client::auto_connect_if_needed: the flusher,
// which connects in the background). A thread the budget has no room for gets
// no_ring(), a ring of capacity 0 that is always full. Other slow paths (push_slow):
// the push that reaches the ring's high-water mark wakes the flusher (one eventfd
// write), and a full ring drops and counts (or, opt-in, waits a bounded time).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "client/src/client_state.h"
#include "client/src/clock.h"
#include "client/src/event_ring.h"
#include "client/src/flusher.h"
#include "client/src/thread_key.h"

namespace steptrace::client {

enum Mode : std::uint8_t {
  kModeOff = 0,     // disabled (STEPTRACE_DISABLE=1 or steptrace_set_enabled(0)): nothing
  kModeRecord = 1,  // record into the rings
  kModeDrop = 2,    // after shutdown / exit: drop and count
};

// Constant-initialized, so the hot path is safe even before the library's own
// initializers ran (mode 0 = off).
extern std::atomic<std::uint8_t> g_mode;
extern std::atomic<std::uint32_t> g_custom_steps;  // registered custom step count
extern bool g_use_tsc;
extern std::atomic<bool> g_block_when_full;
extern constinit thread_local EventRing* t_ring __attribute__((tls_model("initial-exec")));

inline std::uint64_t read_clock() noexcept { return g_use_tsc ? tsc_ticks() : monotonic_ns(); }

// Slow paths, out of line.
EventRing* first_event() noexcept;
void push_slow(EventRing* ring, EventRing::Push pushed, std::uint64_t ticks,
               std::uint64_t meta) noexcept;
void count_drop(proto::DropCause cause) noexcept;
// A span call with an unknown id: a rejected call, and its event dropped as invalid.
void count_invalid_call() noexcept;

inline void record(std::uint32_t step, proto::EventKind kind) noexcept {
  const std::uint8_t mode = g_mode.load(std::memory_order_relaxed);
  if (mode != kModeRecord) [[unlikely]] {
    if (mode == kModeDrop) count_drop(proto::DropCause::kNotConnected);
    return;
  }
  if (step >= proto::kBuiltinStepCount &&
      step - proto::kFirstCustomStep >= g_custom_steps.load(std::memory_order_relaxed))
      [[unlikely]] {
    count_invalid_call();  // unknown id: never sent as an invalid frame
    return;
  }
  EventRing* ring = t_ring;
  if (ring == nullptr) [[unlikely]] {
    ring = first_event();
    if (ring == nullptr) {
      count_drop(proto::DropCause::kBufferFull);  // could not map a ring
      return;
    }
  }
  const std::uint64_t meta = event_meta(ring->thread_id(), step, kind);
  const std::uint64_t ticks = read_clock();
  const EventRing::Push pushed = ring->try_push(ticks, meta);
  if (pushed != EventRing::Push::kPushed) [[unlikely]]
    push_slow(ring, pushed, ticks, meta);
}

class Client {
 public:
  static Client& get();

  ClientState& state() { return s_; }

  // The calling thread's new ring, or no_ring() when the budget has no room.
  EventRing* create_ring();
  void retire_ring(EventRing* ring) noexcept;
  void ring_full(EventRing* ring, std::uint64_t ticks, std::uint64_t meta) noexcept;
  // The stand-in ring of threads without one: capacity 0, every push fails.
  static EventRing* no_ring() noexcept;

  int connect(const char* socket_path);
  // Auto-connect (issue 12): on a thread's first event, the first ledger call or the
  // first register_step of a process that never called connect or shutdown, start the
  // flusher with no connection (it connects itself, with backoff, off the caller's
  // thread) to $STEPTRACE_SOCKET or the default path. STEPTRACE_AUTOCONNECT=0 and
  // STEPTRACE_DISABLE=1 turn it off. One relaxed load once the decision is made.
  void auto_connect_if_needed() noexcept {
    if (auto_pending_.load(std::memory_order_relaxed)) auto_connect();
  }
  std::uint32_t register_step(const char* name);
  void ledger(proto::LedgerOp op, const char* gpu_uuid, std::uint64_t reservation_id,
              std::uint64_t bytes, std::uint64_t total_bytes, std::uint32_t holder_pid,
              const char* task);
  int flush(int timeout_ms);
  std::uint64_t dropped();
  proto::DroppedByCause dropped_by_cause();
  // 0, or -EINVAL (nothing changed) when a non-zero size is out of range.
  int set_buffer_size(std::uint64_t per_thread_bytes, std::uint64_t total_bytes);
  void set_enabled(bool on);
  void set_block_when_full(bool on);
  void shutdown(int flush_timeout_ms);
  void at_exit() noexcept;

  // The child of a fork whose parent had connected starts its own flusher here (on its
  // first event or API call after the fork).
  void restart_after_fork_if_needed() noexcept {
    if (restart_pending_.load(std::memory_order_relaxed)) restart_after_fork();
  }

  void fork_prepare() noexcept;
  void fork_parent() noexcept;
  void fork_child() noexcept;

 private:
  Client();
  enum class Lifecycle { kIdle, kRunning, kStopped };
  void update_mode_locked();
  // Returns whether the daemon was connected at the end of the final flush.
  bool stop_flusher_locked(int flush_timeout_ms);
  void auto_connect() noexcept;
  void start_flusher_locked(const std::string& path, proto::UniqueFd fd);
  int flush_impl(int timeout_ms);
  void restart_after_fork() noexcept;
  // At exit, after the flusher stopped: counts what is still buffered as dropped.
  void count_unsent_at_exit(proto::DropCause cause) noexcept;

  ClientState s_;
  // Its destructor hands a thread's ring to the flusher when the thread exits (the
  // value is the ring; not owned).
  ThreadKey thread_key_;
  std::timed_mutex control_mu_;  // lifecycle, flusher, socket path
  std::unique_ptr<Flusher> flusher_;
  std::atomic<bool> flusher_running_{false};
  Flusher* abandoned_ = nullptr;  // flushers inherited over fork, leaked on purpose
  std::string socket_path_;
  Lifecycle lifecycle_ = Lifecycle::kIdle;
  bool env_disabled_ = false;
  bool user_enabled_ = true;
  std::atomic<bool> restart_pending_{false};
  // True while an auto-connect may still happen (lifecycle kIdle, not disabled).
  std::atomic<bool> auto_pending_{false};
};

}  // namespace steptrace::client
