#include "daemon/state/flight_recorder.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cassert>
#include <cstring>
#include <ctime>
#include <utility>

#if defined(__SSE2__)
#include <emmintrin.h>
#define STEPTRACE_STREAMING_STORES 1
#else
#define STEPTRACE_STREAMING_STORES 0
#endif

namespace steptrace::daemon {
namespace {

// What a window costs beyond its chunks: the record, its slot, its comm and names.
constexpr std::size_t kWindowCharge = sizeof(TraceWindow) + 2 * sizeof(void*) + 64;
constexpr std::size_t kMarkCharge = sizeof(TraceMark);
constexpr std::size_t kNameCharge = sizeof(StepNames::value_type) + 32 + proto::kNameField;

// What a window is charged while it exists (its record and its custom step names).
std::size_t window_charge(const TraceWindow& w) {
  return kWindowCharge + w.names->size() * kNameCharge;
}

// How many chunks ahead eviction fetches its chunk_order_ entry.
constexpr std::size_t kPrefetchOrder = 8;

// A chunk evicted while no capture holds it is kept for the next one (in steady state one
// at a time: each new chunk evicts one); past this many, an evicted chunk is freed.
constexpr std::size_t kSpares = 64;

// Copies `bytes` from `src` to `dst`, writing the whole cache lines of `dst` with
// non-temporal stores when there are a few: `dst` is a chunk just evicted, so not in
// cache, and an ordinary store would first read each line from memory (and push a line
// of the aggregates out of cache for it). The partial lines at either end are ordinary
// stores, so no line is written both ways. Returns whether it streamed: then a store
// fence is owed before anything is published (record() ends with it).
bool copy_events(std::byte* dst, const std::byte* src, std::size_t bytes) {
#if STEPTRACE_STREAMING_STORES
  constexpr std::size_t kLine = 64;
  constexpr std::size_t kMinLines = 4;  // below this, memcpy: not worth a fence
  const std::size_t head = (kLine - reinterpret_cast<std::uintptr_t>(dst) % kLine) % kLine;
  if (bytes >= head + kMinLines * kLine) {
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    bytes -= head;
    const std::size_t lines = bytes / kLine;
    for (std::size_t i = 0; i < lines; ++i, dst += kLine, src += kLine) {
      const auto* from = reinterpret_cast<const __m128i*>(src);
      auto* to = reinterpret_cast<__m128i*>(dst);
      const __m128i a = _mm_loadu_si128(from);
      const __m128i b = _mm_loadu_si128(from + 1);
      const __m128i c = _mm_loadu_si128(from + 2);
      const __m128i d = _mm_loadu_si128(from + 3);
      _mm_stream_si128(to, a);
      _mm_stream_si128(to + 1, b);
      _mm_stream_si128(to + 2, c);
      _mm_stream_si128(to + 3, d);
    }
    std::memcpy(dst, src, bytes - lines * kLine);
    return true;
  }
#endif
  std::memcpy(dst, src, bytes);
  return false;
}

// Orders the non-temporal stores before every later store of this thread (they are not
// ordered by ordinary release stores, nor, for the C++ model, by anything else).
void fence_streamed_stores() {
#if STEPTRACE_STREAMING_STORES
  _mm_sfence();
#endif
}

std::size_t names_cap(const FlightRecorderConfig& config) {
  const std::size_t budget =
      config.budget_bytes != 0 ? config.budget_bytes : FlightRecorderConfig::kCaptureBudget;
  return budget / FlightRecorderConfig::kNameShare;
}

std::int64_t wall_offset_ns() {
  timespec real{};
  timespec mono{};
  ::clock_gettime(CLOCK_REALTIME, &real);
  ::clock_gettime(CLOCK_MONOTONIC, &mono);
  return (static_cast<std::int64_t>(real.tv_sec) - mono.tv_sec) * 1'000'000'000LL +
         (real.tv_nsec - mono.tv_nsec);
}

std::string host_name() {
  std::array<char, 256> buf{};
  if (::gethostname(buf.data(), buf.size() - 1) != 0) return "unknown";
  return buf.data();
}

}  // namespace

std::string_view trace_drop_cause(std::uint8_t cause) {
  if (cause < proto::kReportDropCauseCount) return proto::kReportDropCauseNames[cause];
  if (cause == kDaemonDropOpenDepth) return "max_open_depth";
  if (cause == kDaemonDropStateLimit) return "state_limits";
  return "unknown";
}

FlightRecorder::FlightRecorder(FlightRecorderConfig config)
    : config_(config), budget_(config.budget_bytes), names_cap_(names_cap(config)) {
  counters_.budget_bytes = budget_;
}

void FlightRecorder::drop_window_charge(const TraceWindow& window) {
  counters_.bytes -= window_charge(window);
  names_bytes_ -= window.names->size() * kNameCharge;
}

void FlightRecorder::begin_process(std::uint32_t handle, const PeerIdentity& peer) {
  if (handle >= by_handle_.size()) by_handle_.resize(handle + 1);
  auto& slot = by_handle_[handle];
  if (slot && slot->key == peer.key) return;
  if (slot) {
    if (slot->chunks.empty()) {
      drop_window_charge(*slot);
    } else {
      orphans_.push_back(std::move(slot));
    }
  }
  slot = std::make_shared<TraceWindow>();
  slot->key = peer.key;
  slot->comm = peer.comm;
  slot->names = std::make_shared<const StepNames>();
  counters_.bytes += kWindowCharge;
}

void FlightRecorder::register_step(std::uint32_t handle, std::uint32_t id,
                                   const std::string& name) {
  if (handle >= by_handle_.size() || !by_handle_[handle]) return;
  TraceWindow& window = *by_handle_[handle];
  if (window.names->contains(id)) return;
  // The names of all windows stay while their windows do: held to a share of the budget.
  if (names_bytes_ + kNameCharge > names_cap_) return;
  // Copy on write: a capture may be reading the names on the render thread.
  auto names = std::make_shared<StepNames>(*window.names);
  names->emplace(id, name);
  window.names = std::move(names);
  counters_.bytes += kNameCharge;
  names_bytes_ += kNameCharge;
}

void FlightRecorder::new_chunk(TraceWindow& window, std::uint64_t now_ns) {
  std::shared_ptr<TraceChunk> chunk;
  if (!spare_.empty()) {
    chunk = std::move(spare_.back());
    spare_.pop_back();
    chunk->count = 0;
  } else {
    chunk = std::make_shared<TraceChunk>();
  }
  chunk->started_ns = now_ns;
  chunk->arrived_ns = now_ns;
  const TraceChunk* started = chunk.get();
  window.chunks.push_back(std::move(chunk));
  chunk_order_.push_back({&window, started, now_ns, ++chunk_serial_});
  counters_.bytes += sizeof(TraceChunk);
  if (counters_.bytes <= budget_) return;
  evict_to(budget_);
  if (chunk_order_.size() > kPrefetchOrder) prefetch_next_eviction();
}

void FlightRecorder::prefetch_next_eviction() const {
  // With the budget full, each new chunk is the one evicted the time before, and the
  // oldest now is the one after: fetch what writing it will not overwrite whole (its
  // first and last cache lines), and what evicting it reads (its window's queue entry;
  // the order entry was fetched kPrefetchOrder chunks ago), so ingest does not wait for
  // them then.
  __builtin_prefetch(&chunk_order_[kPrefetchOrder]);
  const ChunkOrder& next = chunk_order_.front();
  const char* bytes = reinterpret_cast<const char*>(next.chunk);
  __builtin_prefetch(bytes, 1);
  __builtin_prefetch(bytes + sizeof(TraceChunk) - 1, 1);
  __builtin_prefetch(&next.window->chunks.front(), 1);
}

void FlightRecorder::record(std::uint32_t handle, proto::EventSpan events, std::uint64_t now_ns) {
  if (budget_ == 0 || events.empty() || handle >= by_handle_.size() || !by_handle_[handle]) {
    return;
  }
  TraceWindow& window = *by_handle_[handle];
  const std::byte* data = events.data();
  std::size_t left = events.size();
  bool streamed = false;
  while (left != 0) {
    if (window.chunks.empty() || window.chunks.back()->count == TraceChunk::kEvents) {
      new_chunk(window, now_ns);
      if (window.chunks.empty()) break;  // a budget below one chunk
    }
    TraceChunk& chunk = *window.chunks.back();
    const std::size_t n = std::min<std::size_t>(left, TraceChunk::kEvents - chunk.count);
    const std::size_t bytes = n * sizeof(proto::EventRecord);
    streamed |= copy_events(reinterpret_cast<std::byte*>(&chunk.events[chunk.count]), data, bytes);
    chunk.count += static_cast<std::uint32_t>(n);
    chunk.arrived_ns = now_ns;
    counters_.events_recorded += n;  // only what was stored: recorded = evicted + held
    data += bytes;
    left -= n;
  }
  // Before anything else this thread stores (a capture handed to the render thread, the
  // release of a reference to a chunk): the events are then as if stored plainly.
  if (streamed) fence_streamed_stores();
}

void FlightRecorder::mark(TraceMark mark) {
  if (budget_ == 0) return;
  ++counters_.marks_recorded;
  marks_.push_back(mark);
  counters_.bytes += kMarkCharge;
  if (counters_.bytes > budget_) evict_to(budget_);
}

void FlightRecorder::evict_front_mark() {
  marks_.pop_front();
  ++counters_.marks_evicted;
  counters_.bytes -= kMarkCharge;
}

void FlightRecorder::evict_front_chunk() {
  const ChunkOrder order = chunk_order_.front();
  chunk_order_.pop_front();
  release_front_chunk(order);
}

void FlightRecorder::release_front_chunk(const ChunkOrder& order) {
  TraceWindow& window = *order.window;
  std::shared_ptr<TraceChunk> chunk = std::move(window.chunks.front());
  window.chunks.pop_front();
  // Every chunk but the last of its window is full (record() starts one only when the
  // last is): the count of an older one is known without reading the chunk, not in cache.
  const std::uint32_t count = window.chunks.empty() ? chunk->count : TraceChunk::kEvents;
  assert(count == chunk->count);
  counters_.events_evicted += count;
  counters_.bytes -= sizeof(TraceChunk);
  if (spare_.size() >= kSpares) return;
  // Reused only when no capture holds it (see the header). A chunk started since the
  // last capture has been in no capture: its count of owners need not be read.
  if (order.serial > captured_through_) {
    spare_.push_back(std::move(chunk));
    return;
  }
  if (chunk.use_count() == 1) {
    // use_count() is a relaxed load; this pairs it with the release of the last other
    // owner (a capture let go on the render thread), whose reads then happen before
    // ingest writes the chunk again.
    std::atomic_thread_fence(std::memory_order_acquire);
    spare_.push_back(std::move(chunk));
  }
}

bool FlightRecorder::evict_oldest() {
  if (chunk_order_.empty() && marks_.empty()) return false;
  if (!marks_.empty() &&
      (chunk_order_.empty() || marks_.front().arrived_ns < chunk_order_.front().started_ns)) {
    evict_front_mark();
  } else {
    evict_front_chunk();
  }
  return true;
}

void FlightRecorder::evict_to(std::size_t budget) {
  while (counters_.bytes > budget && evict_oldest()) {
  }
  drop_empty_orphans();
}

void FlightRecorder::drop_empty_orphans() {
  if (orphans_.empty()) return;
  std::erase_if(orphans_, [this](const std::shared_ptr<TraceWindow>& w) {
    if (!w->chunks.empty()) return false;
    drop_window_charge(*w);
    return true;
  });
}

void FlightRecorder::tick(std::uint64_t now_ns) {
  const std::uint64_t horizon = config_.horizon_ns;
  const auto expired = [&](std::uint64_t arrived) {
    return now_ns > horizon && arrived < now_ns - horizon;
  };
  // A window's chunks arrive in order, so its expired ones are a prefix of its queue;
  // but a chunk started earlier may still be filling, so the expired ones need not be at
  // the front of chunk_order_: count them per window, then take them out of it.
  std::map<TraceWindow*, std::size_t> expired_chunks;
  const auto count_expired = [&](const std::shared_ptr<TraceWindow>& w) {
    if (!w) return;
    std::size_t n = 0;
    while (n < w->chunks.size() && expired(w->chunks[n]->arrived_ns)) ++n;
    if (n != 0) expired_chunks[w.get()] = n;
  };
  for (const auto& w : by_handle_) count_expired(w);
  for (const auto& w : orphans_) count_expired(w);
  if (!expired_chunks.empty()) {
    // Each window's entries in chunk_order_ are in the order of its queue: its first n
    // entries are its n expired chunks, released as they are taken out.
    std::size_t kept = 0;
    for (std::size_t i = 0; i < chunk_order_.size(); ++i) {
      const ChunkOrder order = chunk_order_[i];
      const auto it = expired_chunks.find(order.window);
      if (it != expired_chunks.end() && it->second != 0) {
        --it->second;
        release_front_chunk(order);
      } else {
        chunk_order_[kept++] = order;
      }
    }
    chunk_order_.resize(kept);
  }
  while (!marks_.empty() && expired(marks_.front().arrived_ns)) evict_front_mark();
  drop_empty_orphans();
}

void FlightRecorder::begin_capture() {
  ++captures_;
  budget_ = std::max(config_.budget_bytes, FlightRecorderConfig::kCaptureBudget);
  counters_.budget_bytes = budget_;
}

void FlightRecorder::end_capture() {
  if (captures_ == 0) return;
  if (--captures_ != 0) return;
  budget_ = config_.budget_bytes;
  counters_.budget_bytes = budget_;
  evict_to(budget_);
  if (budget_ == 0) spare_.clear();
}

std::shared_ptr<TraceCapture> FlightRecorder::capture(const std::set<std::int32_t>& pids,
                                                      std::uint64_t since_ns,
                                                      std::uint64_t now_ns) const {
  // Every chunk there is may now be held (a superset of those this capture takes).
  captured_through_ = chunk_serial_;
  auto out = std::make_shared<TraceCapture>();
  out->now_ns = now_ns;
  out->since_ns = since_ns;
  out->wall_offset_ns = wall_offset_ns();
  out->daemon_pid = static_cast<std::int32_t>(::getpid());
  out->host = host_name();
  out->counters = counters();
  const auto add = [&](const TraceWindow& w) {
    if (!pids.empty() && !pids.contains(w.key.pid)) return;
    if (w.chunks.empty()) return;
    TraceCapture::Process p;
    p.key = w.key;
    p.comm = w.comm;
    p.names = w.names;
    p.chunks.reserve(w.chunks.size());
    for (const auto& chunk : w.chunks) p.chunks.push_back({chunk, chunk->count});
    out->processes.push_back(std::move(p));
  };
  for (const auto& w : by_handle_) {
    if (w) add(*w);
  }
  for (const auto& w : orphans_) add(*w);
  std::sort(
      out->processes.begin(), out->processes.end(),
      [](const TraceCapture::Process& a, const TraceCapture::Process& b) { return a.key < b.key; });
  for (const TraceMark& m : marks_) {
    if (m.ts_ns < since_ns) continue;
    if (!pids.empty() && !pids.contains(m.sender.pid)) continue;
    out->marks.push_back(m);
  }
  return out;
}

FlightRecorderCounters FlightRecorder::counters() const {
  FlightRecorderCounters c = counters_;
  c.captures_active = captures_;
  return c;
}

}  // namespace steptrace::daemon
