#include "daemon/state/flight_recorder.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <ctime>
#include <utility>

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
  if (cause < proto::kDropCauseCount) return proto::kDropCauseNames[cause];
  if (cause == kDaemonDropOpenDepth) return "max_open_depth";
  if (cause == kDaemonDropStateLimit) return "state_limits";
  return "unknown";
}

FlightRecorder::FlightRecorder(FlightRecorderConfig config)
    : config_(config), budget_(config.budget_bytes) {
  counters_.budget_bytes = budget_;
}

void FlightRecorder::begin_process(std::uint32_t handle, const PeerIdentity& peer) {
  if (handle >= by_handle_.size()) by_handle_.resize(handle + 1);
  auto& slot = by_handle_[handle];
  if (slot && slot->key == peer.key) return;
  if (slot) {
    if (slot->chunks.empty()) {
      counters_.bytes -= window_charge(*slot);
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
  // Copy on write: a capture may be reading the names on the render thread.
  auto names = std::make_shared<StepNames>(*window.names);
  names->emplace(id, name);
  window.names = std::move(names);
  counters_.bytes += kNameCharge;
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
  window.chunks.push_back(std::move(chunk));
  chunk_order_.push_back(&window);
  counters_.bytes += sizeof(TraceChunk);
  if (counters_.bytes > budget_) evict_to(budget_);
}

void FlightRecorder::record(std::uint32_t handle, proto::EventSpan events, std::uint64_t now_ns) {
  if (budget_ == 0 || events.empty() || handle >= by_handle_.size() || !by_handle_[handle]) {
    return;
  }
  TraceWindow& window = *by_handle_[handle];
  const std::byte* data = events.data();
  std::size_t left = events.size();
  while (left != 0) {
    if (window.chunks.empty() || window.chunks.back()->count == TraceChunk::kEvents) {
      new_chunk(window, now_ns);
      if (window.chunks.empty()) return;  // a budget below one chunk
    }
    TraceChunk& chunk = *window.chunks.back();
    const std::size_t n = std::min<std::size_t>(left, TraceChunk::kEvents - chunk.count);
    std::memcpy(&chunk.events[chunk.count], data, n * sizeof(proto::EventRecord));
    chunk.count += static_cast<std::uint32_t>(n);
    chunk.arrived_ns = now_ns;
    counters_.events_recorded += n;  // only what was stored: recorded = evicted + held
    data += n * sizeof(proto::EventRecord);
    left -= n;
  }
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
  TraceWindow* window = chunk_order_.front();
  chunk_order_.pop_front();
  release_front_chunk(*window);
}

void FlightRecorder::release_front_chunk(TraceWindow& window) {
  std::shared_ptr<TraceChunk> chunk = std::move(window.chunks.front());
  window.chunks.pop_front();
  counters_.events_evicted += chunk->count;
  counters_.bytes -= sizeof(TraceChunk);
  // Reused only when no capture holds it (see the header); a few spares are enough.
  if (chunk.use_count() == 1 && spare_.size() < 64) spare_.push_back(std::move(chunk));
}

bool FlightRecorder::evict_oldest() {
  if (chunk_order_.empty() && marks_.empty()) return false;
  if (!marks_.empty() &&
      (chunk_order_.empty() ||
       marks_.front().arrived_ns < chunk_order_.front()->chunks.front()->started_ns)) {
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
  std::erase_if(orphans_, [this](const std::shared_ptr<TraceWindow>& w) {
    if (!w->chunks.empty()) return false;
    counters_.bytes -= window_charge(*w);
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
    std::map<TraceWindow*, std::size_t> skip = expired_chunks;
    std::erase_if(chunk_order_, [&](TraceWindow* w) {
      const auto it = skip.find(w);
      if (it == skip.end() || it->second == 0) return false;
      --it->second;
      return true;
    });
    for (const auto& [window, n] : expired_chunks) {
      for (std::size_t i = 0; i < n; ++i) release_front_chunk(*window);
    }
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
