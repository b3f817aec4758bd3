// What the Collector's state really holds, in bytes, for the state budget
// (Limits::max_process_state_bytes, max_state_bytes): the one place that knows how big a
// record, a histogram, a thread or a name is once it sits in the heap. The admission
// policy (charge() / uncharge(), collector_ingest.cpp) only asks these functions what a
// change will cost and charges that before it makes the change.
//
// The estimate is the heap the state takes from glibc's malloc, not the objects' sizes:
//  - a malloc(n) takes a chunk of n + 8 bytes rounded up to 16, at least 32 (heap_block);
//  - a std::vector holds its capacity; the vectors of the state grow to the next power of
//    two, by hand (reserve) where the charge is taken from the size (a process's steps,
//    ids and names only grow, and a copy made for copy-on-write holds no more than its
//    original), or from the capacity itself where elements come and go (a thread's open
//    span stacks: ThreadSpans copies keep their capacities, collector_state.h);
//  - a std::string's characters are on the heap past its 15-character inline buffer;
//  - a node container costs one heap block per element (the node: its links and value)
//    plus, for std::unordered_map, its share of the bucket array (at most two pointers per
//    element: load factor at most 1, growth by about two).
// What is charged per piece:
//  - a process record (attach): the record in its shared_ptr block, its entry in the
//    table's key map and slot vector, and its built-in steps' aggregates;
//  - a custom step (register_step): its aggregate, id and name slots (their vectors'
//    growth), its name's characters, and the id table on the first one;
//  - a histogram chunk (the end of a span whose duration lands in a power of two that
//    step has not seen): 128 bytes of counters, the chunk vector growing by one;
//  - a thread (its first event): its record, index node and pointer; then each growth of
//    its per-step stack vector, of one step's stack of start timestamps, of its
//    nesting-depth array;
//  - the retired histograms and jobs (kept after a process is evicted, so counters never
//    go backwards): their nodes, names and chunks, on top of the processes' charges (they
//    are bounded by kMaxRetiredNames, max_jobs and RetiredJob::kMaxJobSteps, not refused).
// Not charged: a histogram's overflow entries (16 bytes per bucket past 2^32 spans), and
// the transient second copy of a record a view holds while ingest mutates it: that one is
// counted apart (ViewCopies, below), not against the budget, so that one tenant's render
// flood never refuses another tenant's spans.
//
// Freed state goes back to the heap, which glibc does not hand back to the kernel on its
// own unless it sits at the top: FreedMemory collects what was freed and calls
// malloc_trim(0) now and then, from the io thread's liveness tick and connection close.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "daemon/state/histogram.h"

namespace steptrace::daemon {

struct ProcessRecord;
struct ThreadSpans;
struct RetiredJob;
struct JobKey;

class FreedMemory;

namespace heap {

// glibc malloc on 64-bit targets: 8 bytes of size header, 16-byte alignment, 32-byte
// minimum chunk. (Past the mmap threshold a block is whole pages instead: within a page
// of this, which is noise at those sizes.)
inline constexpr std::size_t kMallocHeader = 8;
inline constexpr std::size_t kMallocAlign = 16;
inline constexpr std::size_t kMallocMinChunk = 32;
constexpr std::size_t heap_block(std::size_t n) {
  if (n == 0) return 0;
  return std::max(kMallocMinChunk, (n + kMallocHeader + kMallocAlign - 1) & ~(kMallocAlign - 1));
}
template <typename T>
constexpr std::size_t array_bytes(std::size_t capacity) {
  return heap_block(capacity * sizeof(T));
}

// libstdc++'s std::map node: colour and three links (32 bytes) before the value.
inline constexpr std::size_t kTreeNodeLinks = 32;
template <typename Value>
constexpr std::size_t tree_node_bytes() {
  return heap_block(kTreeNodeLinks + sizeof(Value));
}
// libstdc++'s std::unordered_map node for a key whose hash is not cached (an integer):
// one link before the value; plus the element's share of the bucket array.
template <typename Value>
constexpr std::size_t hash_node_bytes() {
  return heap_block(sizeof(void*) + sizeof(Value)) + 2 * sizeof(void*);
}

// libstdc++'s std::string keeps up to 15 characters inline.
inline constexpr std::size_t kInlineChars = 15;
constexpr std::size_t string_heap_bytes(std::size_t length) {
  return length <= kInlineChars ? 0 : heap_block(length + 1);
}

// The capacity a vector of the state grows to when it must hold `needed` elements.
constexpr std::size_t grown_capacity(std::size_t needed) {
  return needed == 0 ? 0 : std::bit_ceil(needed);
}
// Size-charged vectors (only grow): the bytes going from `size` to `size + more` elements.
template <typename T>
constexpr std::size_t size_growth_bytes(std::size_t size, std::size_t more = 1) {
  return array_bytes<T>(grown_capacity(size + more)) - array_bytes<T>(grown_capacity(size));
}
// Makes room for `needed` elements the way the charge assumed (grown_capacity).
template <typename T>
void reserve_grown(std::vector<T>& v, std::size_t needed) {
  if (needed > v.capacity()) v.reserve(grown_capacity(needed));
}
// Capacity-charged vectors: the bytes room for `needed` elements adds (0 while the
// capacity lasts), when it grows to `capacity`.
template <typename T>
std::size_t capacity_growth_bytes(const std::vector<T>& v, std::size_t needed,
                                  std::size_t capacity) {
  if (needed <= v.capacity()) return 0;
  return array_bytes<T>(capacity) - array_bytes<T>(v.capacity());
}
template <typename T>
std::size_t capacity_growth_bytes(const std::vector<T>& v, std::size_t needed) {
  return capacity_growth_bytes(v, needed, grown_capacity(needed));
}
// A thread's per-step stack vector: a thread that walks a process's 1,024 steps in order
// grows it a slot at a time, and doubling would leave up to half of 24 KiB reserved but
// never touched (so charged without being resident): a quarter more each time instead,
// in steps of 16 slots.
constexpr std::size_t slots_capacity(std::size_t capacity, std::size_t needed) {
  const std::size_t want = std::max(needed, capacity + capacity / 4);
  return (want + 15) / 16 * 16;
}

// A histogram's heap: its chunks (the vector grows by exactly one, histogram.cpp).
inline std::size_t histogram_heap_bytes(const Histogram& hist) {
  return heap_block(hist.chunks_in_use() * Histogram::kChunkBytes);
}
// What one more chunk costs `hist` (Histogram::needs_chunk said it needs one).
inline std::size_t histogram_chunk_bytes(const Histogram& hist) {
  const std::size_t n = hist.chunks_in_use();
  return heap_block((n + 1) * Histogram::kChunkBytes) - heap_block(n * Histogram::kChunkBytes);
}

// ---- records (charge.cpp) -------------------------------------------------------------
// A new process record, before any custom step, thread or span.
std::size_t record_base_bytes();
// Registering custom step `name` on `rec`; make_room_for_step then grows its vectors the
// way this assumed.
std::size_t custom_step_bytes(const ProcessRecord& rec, std::string_view name);
void make_room_for_step(ProcessRecord& rec);
// A new thread's record, index entry and pointer (before it holds any stack).
std::size_t new_thread_bytes();
// Room in `thread` for stacks up to `slot` (0 when it has it); make_room_for_slot grows
// it the way this assumed.
std::size_t stack_slots_bytes(const ThreadSpans& thread, std::size_t slot);
void make_room_for_slot(ThreadSpans& thread, std::size_t slot);
// What a thread holds now / a whole record holds now (its threads included): for a record
// built from a snapshot, charged at once.
std::size_t thread_bytes(const ThreadSpans& thread);
std::size_t record_bytes(const ProcessRecord& rec);
// What a clone copies (copy on write, collector_state.h): a thread's own block and
// stacks; a record without its threads' (it shares them).
std::size_t thread_heap_bytes(const ThreadSpans& thread);
std::size_t record_shell_bytes(const ProcessRecord& rec);
// A retired histogram's entry (RetiredHistograms: node, name, chunks) and a retired job's
// (RetiredJobs: node, job id, its steps' nodes and names).
std::size_t retired_histogram_bytes(std::string_view name, const Histogram& hist);
std::size_t retired_job_bytes(const JobKey& key, const RetiredJob& job);
std::size_t retired_job_step_bytes(std::string_view name);  // one of its steps
std::size_t retired_job_rank_bytes();  // one of its ranks (its steps: retired_job_step_bytes)

// Room for one more timestamp (a stack push, a depth entry): the growth's bytes, and the
// growth itself, the way it was charged.
inline std::size_t push_bytes(const std::vector<std::uint64_t>& v) {
  return capacity_growth_bytes(v, v.size() + 1);
}
inline void make_room_for_push(std::vector<std::uint64_t>& v) { reserve_grown(v, v.size() + 1); }

}  // namespace heap

// The records and threads views still hold that ingest has cloned since (copy on write):
// while a render runs, the first write to a record it shows clones the record (sharing
// its threads), the first write to one of its threads clones the thread, and the old ones
// live until every view holding them is released. Under a render flood (a view in a lane
// all the time) that is a second copy of every record and thread being written, up to a
// whole record each (a process's 16 MiB): the state's RSS beside its charge (stats
// memory.view_copy_bytes). io thread only; a view's copy of the state keeps the figure
// as it was when it was frozen, not the list.
class ViewCopies {
 public:
  // The copies whose views are gone are told to `freed` (the state's), so that their
  // heap goes back to the kernel with the rest (a flood frees a copy every few ms).
  explicit ViewCopies(FreedMemory* freed) : freed_(freed) {}
  // Made for a view (CollectorState's copy): forgets the copies whose views are gone
  // first, so that the view shows those still held.
  ViewCopies(const ViewCopies& other) : bytes_(other.sweep()) {}
  ViewCopies& operator=(const ViewCopies&) = delete;

  // `old`, `bytes` of the heap, is now held by views alone (its clone took its place).
  void held(std::weak_ptr<const void> old, std::size_t bytes) {
    if (held_.size() >= 2 * swept_size_ + 16) sweep();
    held_.push_back({std::move(old), bytes});
    bytes_ += bytes;
  }
  // Bytes of the copies still held (as of the last sweep, for a view's copy).
  std::size_t bytes() const { return bytes_; }
  // The same now: forgets the copies whose views are gone first (the state's own).
  std::size_t held_bytes() const { return sweep(); }

 private:
  struct Held {
    std::weak_ptr<const void> record;
    std::size_t bytes = 0;
  };
  std::size_t sweep() const;

  FreedMemory* freed_ = nullptr;  // none in a view's copy
  mutable std::vector<Held> held_;
  mutable std::size_t bytes_ = 0;
  mutable std::size_t swept_size_ = 0;
};

// What the copies may hold beside the charge before the render worker stops adding views
// (render_worker.h: while they are over it, a lane renders from the view another lane
// holds, or waits for it, rather than freeze a second one): an eighth of the charge, so
// that with the copies the state's heap stays within 25% of what is charged with room for
// the daemon's own, and at least kViewCopyFloorBytes (one whole record of a process at
// the default max_process_state_bytes), so that a small table is never held back.
inline constexpr std::size_t kViewCopyFloorBytes = std::size_t{16} << 20;
inline constexpr std::size_t kViewCopyChargeDivisor = 8;
constexpr std::size_t view_copy_bound(std::size_t charged) {
  return std::max(kViewCopyFloorBytes, charged / kViewCopyChargeDivisor);
}

// Big blocks straight from and back to the kernel: called once at start, before any
// thread. glibc serves a block of at least M_MMAP_THRESHOLD (128 KiB at first) with an
// mmap of its own, unmapped when freed; but the first such block freed raises the
// threshold to its size (up to 32 MiB) and the trim threshold to twice that. A daemon
// that renders a 13 MiB metrics text and 5 MiB reports then takes every later one from
// its arenas, where freed text sits until a trim (and the render threads' arenas keep up
// to 64 MiB free at their top): under a render flood, RSS tens of MiB above what the
// daemon holds. Fixed thresholds (kMmapThreshold, kTrimThreshold) keep replies, report
// pieces and big vectors in mappings of their own, returned when freed. No effect under
// an allocator other than glibc's (the sanitizers').
namespace heap {
inline constexpr std::size_t kMmapThreshold = std::size_t{256} << 10;
inline constexpr std::size_t kTrimThreshold = std::size_t{1} << 20;
// False when the allocator refused (not glibc's).
bool return_big_blocks_when_freed();
}  // namespace heap

// Freed state, handed back to the kernel in batches: malloc_trim(0) walks the heap (some
// milliseconds for a large one) and releases every free page, so it runs on the io thread
// at most once per kMinInterval, and only once kBatchBytes were freed or kMaxDelay passed
// since something was. Between trims the heap reuses what was freed.
class FreedMemory {
 public:
  static constexpr std::uint64_t kMinIntervalNs = 1'000'000'000;
  static constexpr std::uint64_t kMaxDelayNs = 30'000'000'000;
  static constexpr std::size_t kBatchBytes = 16u << 20;

  void freed(std::size_t bytes) { pending_ += bytes; }
  // Trims when due; true when it did.
  bool release_if_due(std::uint64_t now_ns);
  std::uint64_t trims() const { return trims_; }

 private:
  std::size_t pending_ = 0;  // freed since the last trim
  // When a check first saw pending_ nonzero (the free itself has no clock).
  std::uint64_t pending_since_ns_ = 0;
  bool pending_seen_ = false;
  std::uint64_t last_trim_ns_ = 0;
  std::uint64_t trims_ = 0;
};

}  // namespace steptrace::daemon
