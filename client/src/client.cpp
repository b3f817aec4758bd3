#include "client/src/client.h"

#include <pthread.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string_view>

#include <steptrace/steptrace.h>

#include "proto/commands.h"

namespace steptrace::client {

// The public C spelling of the default socket is the daemon's (proto/commands.h).
static_assert(std::string_view(STEPTRACE_DEFAULT_SOCKET) == proto::kDefaultSocketPath);

std::atomic<std::uint8_t> g_mode{kModeOff};
std::atomic<std::uint32_t> g_custom_steps{0};
bool g_use_tsc = false;
std::atomic<bool> g_block_when_full{false};
constinit thread_local EventRing* t_ring __attribute__((tls_model("initial-exec"))) = nullptr;

namespace {

thread_local std::uint32_t t_tid __attribute__((tls_model("initial-exec"))) = 0;
// Of a thread that got no ring: the budget epoch it was refused at.
thread_local std::uint64_t t_no_ring_epoch = 0;

constexpr std::uint64_t kBlockWaitNs = 100'000'000;  // bounded wait of the opt-in mode
constexpr int kExitFlushMs = 500;

std::uint32_t current_tid() noexcept {
  if (t_tid == 0) t_tid = static_cast<std::uint32_t>(::gettid());
  return t_tid;
}

bool env_true(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const std::string_view s(v);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

bool env_false(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const std::string_view s(v);
  return s == "0" || s == "false" || s == "no" || s == "off";
}

// An explicit path, else $STEPTRACE_SOCKET, else the default.
std::string socket_path_for(const char* socket_path) {
  if (socket_path != nullptr && socket_path[0] != '\0') return socket_path;
  if (const char* env = std::getenv("STEPTRACE_SOCKET"); env != nullptr && env[0] != '\0') {
    return env;
  }
  return STEPTRACE_DEFAULT_SOCKET;
}

void on_thread_exit(void* p) {
  auto* ring = static_cast<EventRing*>(p);
  if (t_ring == ring) t_ring = nullptr;
  Client::get().retire_ring(ring);
}

void fork_prepare_hook() { Client::get().fork_prepare(); }
void fork_parent_hook() { Client::get().fork_parent(); }
void fork_child_hook() { Client::get().fork_child(); }
void at_exit_hook() { Client::get().at_exit(); }

}  // namespace

void ClientState::wake() noexcept {
  const int fd = wake_fd.load(std::memory_order_relaxed);
  if (fd < 0) return;
  const std::uint64_t one = 1;
  [[maybe_unused]] const ssize_t r = ::write(fd, &one, sizeof one);
}

EventRing* first_event() noexcept {
  try {
    Client& client = Client::get();
    client.restart_after_fork_if_needed();
    client.auto_connect_if_needed();
    EventRing* ring = client.create_ring();
    t_ring = ring;
    return ring;
  } catch (...) {
    return nullptr;
  }
}

void push_slow(EventRing* ring, EventRing::Push pushed, std::uint64_t ticks,
               std::uint64_t meta) noexcept {
  Client& client = Client::get();
  if (pushed == EventRing::Push::kPushedWake) {
    client.state().wake();
    return;
  }
  client.ring_full(ring, ticks, meta);
}

void count_drop(proto::DropCause cause) noexcept { Client::get().state().count_drops(cause); }
void count_invalid_call() noexcept {
  ClientState& s = Client::get().state();
  s.count_rejected();
  s.count_drops(proto::DropCause::kInvalid);
}

// ---- Client ------------------------------------------------------------------------

Client& Client::get() {
  static Client* const kInstance = [] {
    auto* client = new Client();  // never destroyed: usable from static destructors
    ::pthread_atfork(fork_prepare_hook, fork_parent_hook, fork_child_hook);
    std::atexit(at_exit_hook);
    return client;
  }();
  return *kInstance;
}

Client::Client() : thread_key_(on_thread_exit) {
  env_disabled_ = env_true("STEPTRACE_DISABLE");
  s_.quiet = env_true("STEPTRACE_QUIET");
  s_.shm_rings = !env_false("STEPTRACE_SHM_RINGS");
  {
    std::vector<std::string> problems;
    s_.identity = identity_from_env([](const char* name) { return std::getenv(name); }, problems);
    if (!s_.quiet && !env_disabled_) {
      for (const std::string& line : problems)
        std::fprintf(stderr, "steptrace: %s\n", line.c_str());
    }
  }
  auto_pending_.store(!env_disabled_ && !env_false("STEPTRACE_AUTOCONNECT"),
                      std::memory_order_relaxed);
  g_block_when_full.store(env_true("STEPTRACE_BLOCK_WHEN_FULL"), std::memory_order_relaxed);
  const BufferSizes sizes = buffer_sizes_from_env(std::getenv("STEPTRACE_BUFFER_BYTES"),
                                                  std::getenv("STEPTRACE_BUFFER_TOTAL_BYTES"));
  s_.registry.per_thread_bytes = sizes.per_thread;
  s_.registry.total_bytes = sizes.total;
  s_.clock_source = choose_clock_source(std::getenv("STEPTRACE_CLOCK"), cpu_has_invariant_tsc(),
                                        current_clocksource());
  g_use_tsc = s_.clock_source == ClockSource::kTsc;
  if (g_use_tsc) s_.converter.start(take_clock_sample());
  s_.set_wake_event(proto::UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)));
  update_mode_locked();
}

void Client::update_mode_locked() {
  Mode mode = kModeRecord;
  if (env_disabled_ || !user_enabled_) {
    mode = kModeOff;
  } else if (lifecycle_ == Lifecycle::kStopped) {
    mode = kModeDrop;
  }
  g_mode.store(mode, std::memory_order_release);
}

EventRing* Client::no_ring() noexcept {
  static EventRing* const kRing = new EventRing(0, 0);  // maps nothing; never destroyed
  return kRing;
}

EventRing* Client::create_ring() {
  const std::uint32_t tid = current_tid();
  RingRegistry& registry = s_.registry;
  std::unique_lock lock(registry.mu);
  // A spare ring the flusher made and offered already (protocol version 8): the daemon
  // maps it before this thread records anything, so a SIGKILL right after the thread's
  // first span loses nothing uncounted. No system call here but the flusher's wake.
  if (EventRing* spare = registry.take_spare_locked(tid)) {
    thread_key_.set(spare);
    // The flusher makes the next spare under the lock: woken after it is released, not
    // into a wait for it while this thread still holds it.
    lock.unlock();
    s_.wake();
    return spare;
  }
  auto size = [&] {
    const std::uint64_t used = std::min(registry.used_bytes, registry.total_bytes);
    return next_ring_bytes(registry.per_thread_bytes, registry.total_bytes - used);
  };
  std::uint64_t bytes = size();
  if (bytes < registry.per_thread_bytes && !s_.connected.load(std::memory_order_acquire)) {
    // Nobody drains the rings of exited threads now: a live thread comes first. Their
    // events are counted under not_connected, oldest ring first.
    for (std::size_t i = 0; i < registry.rings.size() && bytes < registry.per_thread_bytes;) {
      if (registry.rings[i]->orphaned() && registry.rings[i]->consumer_gone()) {
        registry.free_ring_locked(i);
        bytes = size();
      } else {
        ++i;
      }
    }
  }
  if (bytes == 0) {
    t_no_ring_epoch = registry.budget_epoch.load(std::memory_order_relaxed);
    return no_ring();
  }
  registry.rings.reserve(registry.rings.size() + 1);  // the push_back below cannot throw
  auto ring = std::make_unique<EventRing>(tid, static_cast<std::size_t>(bytes / kRingRecordBytes),
                                          s_.shm_rings);
  ring->ring_id = registry.next_ring_id++;
  EventRing* const own = ring.get();
  registry.rings.push_back(std::move(ring));
  registry.used_bytes += bytes;
  thread_key_.set(own);
  // The flusher offers the new ring to the daemon now rather than at its next poll: what
  // the thread records survives the process's death once the daemon maps it.
  if (own->memfd() >= 0) s_.wake();
  return own;
}

void Client::retire_ring(EventRing* ring) noexcept {
  std::lock_guard lock(s_.registry.mu);
  auto& rings = s_.registry.rings;
  const auto it = std::find_if(rings.begin(), rings.end(),
                               [ring](const auto& owned) { return owned.get() == ring; });
  if (it == rings.end()) return;  // already freed (e.g. over a fork)
  ring->orphan();
  if (ring->fill() == 0) {
    s_.registry.free_ring_locked(static_cast<std::size_t>(it - rings.begin()));
    return;
  }
  if (s_.connected.load(std::memory_order_acquire)) return;  // the flusher drains it soon
  // Nobody drains: keep only the newest kMaxOrphanRings exited threads' events.
  std::size_t orphans = 0;
  for (std::size_t i = rings.size(); i-- > 0;) {
    if (rings[i]->orphaned() && rings[i]->consumer_gone() && ++orphans > kMaxOrphanRings) {
      s_.registry.free_ring_locked(i);
    }
  }
}

void Client::ring_full(EventRing* ring, std::uint64_t ticks, std::uint64_t meta) noexcept {
  if (ring->capacity() == 0) {
    // No ring: try again for one once a freed ring has returned its bytes.
    if (s_.registry.budget_epoch.load(std::memory_order_acquire) != t_no_ring_epoch) {
      EventRing* fresh = nullptr;
      try {
        fresh = create_ring();
      } catch (...) {
      }
      if (fresh != nullptr && fresh->capacity() != 0) {
        t_ring = fresh;
        const std::uint64_t own_meta = (meta & ~std::uint64_t{0xffffffff}) | fresh->thread_id();
        if (fresh->try_push(ticks, own_meta) != EventRing::Push::kFull) return;
      }
    }
    s_.count_drops(proto::DropCause::kBufferFull);
    return;
  }
  if (g_block_when_full.load(std::memory_order_relaxed) &&
      s_.connected.load(std::memory_order_acquire)) {
    if (ring->stalled && ring->consumed() != ring->stalled_tail) ring->stalled = false;
    if (!ring->stalled) {
      s_.wake();
      const std::uint64_t deadline = monotonic_ns() + kBlockWaitNs;
      const timespec pause{0, 50'000};
      for (;;) {
        if (ring->try_push(ticks, meta) != EventRing::Push::kFull) return;
        if (!s_.connected.load(std::memory_order_acquire) || monotonic_ns() >= deadline) break;
        ::nanosleep(&pause, nullptr);
      }
      ring->stalled = true;
      ring->stalled_tail = ring->consumed();
    }
  }
  if (s_.connected.load(std::memory_order_relaxed)) {
    ring->count_buffer_full();
  } else {
    ring->count_not_connected();
  }
}

int Client::connect(const char* socket_path) {
  restart_after_fork_if_needed();
  std::lock_guard lock(control_mu_);
  auto_pending_.store(false, std::memory_order_relaxed);  // the program decides now
  if (env_disabled_) return 0;  // STEPTRACE_DISABLE=1: no thread, no connection
  const std::string path = socket_path_for(socket_path);
  lifecycle_ = Lifecycle::kRunning;
  update_mode_locked();
  if (flusher_ && flusher_->socket_path() == path && s_.connected.load()) return 0;
  stop_flusher_locked(0);
  proto::UniqueFd fd;
  const int rc = connect_unix_socket(path, fd);
  // On failure the flusher's own first attempt (at once) prints the first-contact
  // notice, from its thread.
  start_flusher_locked(path, std::move(fd));
  return rc;
}

void Client::start_flusher_locked(const std::string& path, proto::UniqueFd fd) {
  flusher_ = std::make_unique<Flusher>(s_, path, std::move(fd));
  flusher_->start();
  flusher_running_.store(true, std::memory_order_release);
  socket_path_ = path;
}

void Client::auto_connect() noexcept {
  try {
    std::lock_guard lock(control_mu_);
    if (!auto_pending_.exchange(false, std::memory_order_relaxed)) return;
    if (env_disabled_ || lifecycle_ != Lifecycle::kIdle || flusher_) return;
    lifecycle_ = Lifecycle::kRunning;
    update_mode_locked();
    // No connect here: the flusher connects in the background, with its backoff.
    start_flusher_locked(socket_path_for(nullptr), proto::UniqueFd());
  } catch (...) {
  }
}

bool Client::stop_flusher_locked(int flush_timeout_ms) {
  if (!flusher_) return false;
  // Also when not connected right now (an auto-connect still on its first attempt, a
  // daemon restarting): the flush makes one immediate connection attempt and returns
  // -ENOTCONN at once when it fails.
  if (flush_timeout_ms > 0 && flusher_running_.load(std::memory_order_acquire)) {
    flush_impl(flush_timeout_ms);
  }
  const bool connected = s_.connected.load(std::memory_order_acquire);
  flusher_running_.store(false, std::memory_order_release);
  flusher_->stop();
  flusher_.reset();
  std::lock_guard lock(s_.flush.mu);
  s_.flush.fail_all_locked(-ENOTCONN);
  return connected;
}

std::uint32_t Client::register_step(const char* name) {
  restart_after_fork_if_needed();
  auto_connect_if_needed();
  const std::uint32_t id = name == nullptr ? kInvalidStep : s_.steps.register_step(name);
  if (id == kInvalidStep) {
    s_.count_rejected();
    return id;
  }
  const std::uint32_t count = s_.steps.count();
  // A new step: the flusher registers it with the daemon now, since events of it in a
  // shared ring wait for that registration (and are refused if the process dies first).
  if (g_custom_steps.exchange(count, std::memory_order_acq_rel) != count) s_.wake();
  return id;
}

void Client::ledger(proto::LedgerOp op, const char* gpu_uuid, std::uint64_t reservation_id,
                    std::uint64_t bytes, std::uint64_t total_bytes, std::uint32_t holder_pid,
                    const char* task) {
  restart_after_fork_if_needed();
  const std::uint8_t mode = g_mode.load(std::memory_order_relaxed);
  if (mode == kModeOff) return;
  if (mode == kModeDrop) {
    s_.count_drops(proto::DropCause::kNotConnected);
    return;
  }
  auto_connect_if_needed();
  auto record = make_ledger_record(op, gpu_uuid, task, read_clock(), current_tid());
  const bool leased = op == proto::LedgerOp::kReserveLease || op == proto::LedgerOp::kRenew;
  // total_bytes carries the lease of those two ops.
  if (!record || (leased && (total_bytes == 0 || total_bytes > proto::kMaxLeaseMs))) {
    s_.count_rejected();
    s_.count_drops(proto::DropCause::kInvalid);
    return;
  }
  record->reservation_id = reservation_id;
  record->bytes = bytes;
  record->total_bytes = total_bytes;
  record->holder_pid = holder_pid;
  if (!s_.ledger.push(*record)) {
    s_.count_drops(s_.connected.load(std::memory_order_relaxed) ? proto::DropCause::kBufferFull
                                                                : proto::DropCause::kNotConnected);
    return;
  }
  // A quiet flusher (every ring read by the daemon) sleeps: it sends this one now.
  s_.wake();
}

int Client::flush(int timeout_ms) {
  restart_after_fork_if_needed();
  return flush_impl(timeout_ms);
}

int Client::flush_impl(int timeout_ms) {
  if (!flusher_running_.load(std::memory_order_acquire)) return -ENOTCONN;
  FlushWaiter waiter;
  std::unique_lock lock(s_.flush.mu);
  waiter.sequence = ++s_.flush.requested;
  s_.flush.waiters.push_back(&waiter);
  s_.wake();
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  s_.flush.cv.wait_until(lock, deadline, [&] { return waiter.result != 1; });
  auto& waiters = s_.flush.waiters;
  waiters.erase(std::remove(waiters.begin(), waiters.end(), &waiter), waiters.end());
  if (waiter.result != 1) return waiter.result;
  return s_.connected.load(std::memory_order_acquire) ? -ETIMEDOUT : -ENOTCONN;
}

std::uint64_t Client::dropped() {
  restart_after_fork_if_needed();
  std::lock_guard lock(s_.registry.mu);
  return s_.total_dropped_locked();
}

proto::DroppedByCause Client::dropped_by_cause() {
  restart_after_fork_if_needed();
  std::lock_guard lock(s_.registry.mu);
  return s_.dropped_locked();
}

int Client::set_buffer_size(std::uint64_t per_thread_bytes, std::uint64_t total_bytes) {
  if ((per_thread_bytes != 0 && !valid_ring_bytes(per_thread_bytes)) ||
      (total_bytes != 0 && !valid_total_ring_bytes(total_bytes))) {
    return -EINVAL;
  }
  std::lock_guard lock(s_.registry.mu);
  if (per_thread_bytes != 0) s_.registry.per_thread_bytes = std::bit_floor(per_thread_bytes);
  if (total_bytes != 0) s_.registry.total_bytes = total_bytes;
  // Threads refused a ring may fit now.
  s_.registry.budget_epoch.fetch_add(1, std::memory_order_release);
  return 0;
}

void Client::set_enabled(bool on) {
  restart_after_fork_if_needed();
  std::lock_guard lock(control_mu_);
  user_enabled_ = on;
  update_mode_locked();
}

void Client::set_block_when_full(bool on) {
  g_block_when_full.store(on, std::memory_order_relaxed);
}

void Client::shutdown(int flush_timeout_ms) {
  std::lock_guard lock(control_mu_);
  auto_pending_.store(false, std::memory_order_relaxed);
  stop_flusher_locked(flush_timeout_ms);
  restart_pending_.store(false, std::memory_order_relaxed);
  lifecycle_ = Lifecycle::kStopped;
  update_mode_locked();
}

void Client::at_exit() noexcept {
  try {
    // Never hang exit: give up on the lock if some thread holds it for long.
    std::unique_lock lock(control_mu_, std::defer_lock);
    if (!lock.try_lock_for(std::chrono::milliseconds(kExitFlushMs))) return;
    auto_pending_.store(false, std::memory_order_relaxed);
    bool was_connected = s_.connected.load(std::memory_order_acquire);
    // An auto-connected process gets the same final flush: it waits for the connection
    // the flusher may still be making.
    was_connected = stop_flusher_locked(kExitFlushMs) || was_connected;
    restart_pending_.store(false, std::memory_order_relaxed);
    lifecycle_ = Lifecycle::kStopped;
    update_mode_locked();
    // Whatever the final flush did not take is lost now: with the daemon connected it
    // was on its way (the flush timed out, or it was recorded after), else it had no
    // daemon to go to.
    count_unsent_at_exit(was_connected ? proto::DropCause::kInFlight
                                       : proto::DropCause::kNotConnected);
  } catch (...) {
  }
}

void Client::count_unsent_at_exit(proto::DropCause cause) noexcept {
  try {
    std::uint64_t unsent = 0;
    std::lock_guard lock(s_.registry.mu);
    for (const auto& ring : s_.registry.rings) {
      // The daemon that maps the ring drains it once it sees this process's socket close.
      if (ring->sharing != EventRing::Sharing::kLocal || !ring->consumer_gone()) continue;
      const std::uint64_t head = ring->published();
      unsent += head - ring->consumed();
      ring->release(head);  // the flusher is gone: this thread is the consumer now
    }
    std::vector<proto::LedgerRecord> queued;
    s_.ledger.take(queued);
    unsent += queued.size();
    s_.count_drops(cause, unsent);
  } catch (...) {
  }
}

void Client::restart_after_fork() noexcept {
  try {
    std::lock_guard lock(control_mu_);
    if (!restart_pending_.exchange(false)) return;
    proto::UniqueFd fd;
    connect_unix_socket(socket_path_, fd);  // else the flusher connects in the background
    flusher_ = std::make_unique<Flusher>(s_, socket_path_, std::move(fd));
    flusher_->start();
    flusher_running_.store(true, std::memory_order_release);
  } catch (...) {
  }
}

void Client::fork_prepare() noexcept {
  control_mu_.lock();
  s_.flush.mu.lock();
  s_.registry.mu.lock();
  s_.steps.mutex().lock();
  s_.ledger.mutex().lock();
}

void Client::fork_parent() noexcept {
  s_.ledger.mutex().unlock();
  s_.steps.mutex().unlock();
  s_.registry.mu.unlock();
  s_.flush.mu.unlock();
  control_mu_.unlock();
}

void Client::fork_child() noexcept {
  // Only this thread exists now. Start clean: nothing of the parent's is sent twice.
  // (fork() has already made malloc usable in the child when these handlers run.) The
  // parent's shared rings are not mapped here (MADV_DONTFORK): forget them untouched.
  for (auto& ring : s_.registry.rings) ring->forget_after_fork();
  s_.registry.rings.clear();
  s_.registry.retired_shared = {};
  t_ring = nullptr;
  t_tid = 0;
  thread_key_.set(nullptr);
  s_.registry.retired = {};
  s_.registry.delivered = 0;  // this process delivered nothing yet
  s_.registry.used_bytes = 0;
  s_.registry.budget_epoch.fetch_add(1, std::memory_order_relaxed);
  for (auto& count : s_.other_dropped) count.store(0, std::memory_order_relaxed);
  s_.ledger.clear_after_fork();
  s_.flush.waiters.clear();
  new (&s_.flush.cv) std::condition_variable();  // the parent's waiters do not exist here
  s_.connected.store(false, std::memory_order_relaxed);
  if (g_use_tsc) s_.converter.start(take_clock_sample());  // the parent may have been mid-update
  s_.set_wake_event(
      proto::UniqueFd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)));  // closes the parent's
  if (flusher_) {
    flusher_->abandon_after_fork();
    Flusher* old = flusher_.release();
    old->next_abandoned = abandoned_;
    abandoned_ = old;
    flusher_running_.store(false, std::memory_order_relaxed);
    restart_pending_.store(true, std::memory_order_relaxed);
  }
  fork_parent();  // same unlocks: this thread took them in fork_prepare
}

}  // namespace steptrace::client
