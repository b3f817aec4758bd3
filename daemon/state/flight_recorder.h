// The flight recorder: a bounded window of recent raw events, per process, beside the
// aggregates (issue "timeline"). The Collector feeds it on the io thread as it applies
// events, ledger records and drop reports; the `trace` command captures it (capture())
// and daemon/report/trace_export.h turns the capture into a Chrome Trace Event document
// on the render thread, piece by piece.
//
// Layout: each process has a TraceWindow (pid, start time, comm, custom step names) and a
// queue of TraceChunks: 4 KiB blocks of the wire's own 16-byte EventRecords, appended in
// arrival order (one copy per batch). Ledger records and drop reports are TraceMarks in
// one queue for all processes. Every chunk and mark is charged to one byte budget
// (flight_recorder_bytes); past it, and past the time horizon, the oldest go first
// (chunks in the order they were started, marks in arrival order, whichever is older),
// counted as evicted. Windows of exited processes stay until their chunks are evicted.
//
// Sharing with the render thread: a capture holds shared_ptrs to the chunks and the
// count of events each held at capture time. Ingest only appends past that count and
// never reuses a chunk a capture still holds, so the render thread reads what no one
// writes. Captures are made on the io thread. A chunk started after the last capture was
// made cannot be held by one (its serial, kept in chunk_order_, says so): it is reused
// without looking at its shared_ptr's count, which would be a cache miss per chunk. An
// older chunk is reused only when use_count() == 1, followed by an acquire fence that
// pairs with the release of the render thread's last reference, so its reads of the chunk
// happen before ingest writes it again.
//
// Cost: once the budget is full, ingest copies each batch into the chunk just evicted,
// the oldest, which is never in cache. Its whole cache lines are written with
// non-temporal stores (no read of the old line first, no line of the aggregates pushed
// out of cache for it), and record() ends with a store fence, so what follows sees them
// as ordinary stores. Eviction reads chunk_order_ and the window's queue, not the chunk
// itself (every chunk but the last of its window is full, so its count is known), and
// fetches ahead what the next eviction and the next chunk's first and last lines need.
//
// Custom step names are charged to the budget like the rest, but they stay while their
// window does (a live process's window is never evicted). So that processes with many
// custom steps cannot take the whole budget, the names of all windows together are held
// to 1 / kNameShare of it (the standing budget, or kCaptureBudget when it is off); a name
// past that is not kept, and the export shows that step by its id ("step 300").
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "daemon/state/types.h"
#include "proto/codec.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {

struct FlightRecorderConfig {
  std::size_t budget_bytes = 32u << 20;           // 0: the standing window is off
  std::uint64_t horizon_ns = 300'000'000'000ULL;  // events older than this go
  // Budget of a `trace --for` capture while the standing window is off.
  static constexpr std::size_t kCaptureBudget = 32u << 20;
  // Custom step names of all windows together are kept up to budget / kNameShare
  // (budget_bytes, or kCaptureBudget when it is 0); past it a name is not kept.
  static constexpr std::size_t kNameShare = 2;
};

struct TraceChunk {
  static constexpr std::size_t kEvents = 255;  // 4 KiB with the header
  std::uint64_t started_ns = 0;                // daemon clock when its first event arrived
  std::uint64_t arrived_ns = 0;                // daemon clock when its last event arrived
  // events[0..count) are written; ingest only appends past it (a capture keeps the count
  // it saw, ChunkRef::count, and reads no further).
  std::uint32_t count = 0;
  proto::EventRecord events[kEvents];
};

using StepNames = std::map<std::uint32_t, std::string>;  // custom step id -> name

// One process's window.
struct TraceWindow {
  ProcessKey key;
  std::string comm;                        // /proc/PID/comm at attach (unsanitised)
  std::shared_ptr<const StepNames> names;  // its custom steps (shared with captures)
  std::deque<std::shared_ptr<TraceChunk>> chunks;
};

// A ledger record, a drop report, an NVML sample of one GPU, or a lease the daemon marked
// EXPIRED (one queue for all processes).
struct TraceMark {
  enum class Kind : std::uint8_t { kLedger, kDropped, kDevice, kLeaseExpired };
  Kind kind = Kind::kLedger;
  std::uint64_t ts_ns = 0;       // ledger: the record's timestamp; drops: daemon clock
  std::uint64_t arrived_ns = 0;  // daemon clock (eviction)
  ProcessKey sender;
  // kLedger: the record as sent, whether the view applied it, and the GPU's reserved
  // bytes and last sampled free bytes after it (free_bytes 0 when never sampled).
  proto::LedgerRecord record{};
  bool applied = false;
  std::uint64_t gpu_reserved_bytes = 0;
  std::uint64_t gpu_free_bytes = 0;
  std::uint64_t gpu_total_bytes = 0;
  // kDropped: how many more events the client reported lost, or the daemon could not
  // fold, and why (trace_drop_cause()).
  std::uint8_t cause = 0;
  std::uint64_t dropped = 0;
  // kDevice (ts_ns: the sample's time): record.gpu_uuid names the GPU; gpu_total_bytes,
  // gpu_free_bytes and gpu_reserved_bytes hold the device's total, free and used bytes;
  // the findings of each kind (ledger::Finding::Kind order) at that sample.
  // kLeaseExpired (ts_ns: when the lease passed; sender: the holder): record.gpu_uuid,
  // reservation_id, bytes and total_bytes (the lease, ms) of the reservation.
  std::array<std::uint32_t, 4> findings{};
};

// TraceMark::cause: proto::DropCause (the client's report), proto::kDaemonCrashCause
// (counted at a Delivered frame), proto::kRefusedCause (spans past max_span_ns, stamped
// with the first one's end), kDropNoCause (a version-1 report), or one of these (the
// daemon's own, stamped with the first lost event's timestamp).
inline constexpr std::uint8_t kDropNoCause = 0x7f;
inline constexpr std::uint8_t kDaemonDropOpenDepth = 0x80;   // starts past max_open_depth
inline constexpr std::uint8_t kDaemonDropStateLimit = 0x81;  // a thread or slot past limits
// "buffer_full", ..., "unknown" (version 1), "max_open_depth", "state_limits".
std::string_view trace_drop_cause(std::uint8_t cause);

// A window frozen for export: read on the render thread, nothing in it changes.
struct TraceCapture {
  struct ChunkRef {
    std::shared_ptr<const TraceChunk> chunk;
    std::uint32_t count = 0;  // events of it to read
  };
  struct Process {
    ProcessKey key;
    std::string comm;
    bool alive = true;
    std::uint32_t uid = 0;                // from the table at capture: a job is (uid, job)
    std::string job;                      // likewise ("" none)
    std::uint32_t rank = proto::kNoRank;  // likewise
    std::shared_ptr<const StepNames> names;
    std::vector<ChunkRef> chunks;  // oldest first
  };
  std::uint64_t now_ns = 0;         // CLOCK_MONOTONIC at capture: open spans end here
  std::uint64_t since_ns = 0;       // events stamped before it are left out (--last)
  std::int64_t wall_offset_ns = 0;  // CLOCK_REALTIME - CLOCK_MONOTONIC at capture
  std::int32_t daemon_pid = 0;
  std::string host;
  FlightRecorderCounters counters;
  std::vector<Process> processes;  // by (pid, start time)
  std::vector<TraceMark> marks;    // arrival order
};

class FlightRecorder {
 public:
  explicit FlightRecorder(FlightRecorderConfig config = {});

  // Recording happens while the standing window is on or a capture is active.
  bool on() const { return budget_ != 0; }

  // ---- ingest (io thread) ----------------------------------------------------------
  // A process took table slot `handle` (a new attach): its window starts. A window
  // that slot had before stays, orphaned, until its chunks are evicted.
  // The same process again (a reconnect): nothing changes.
  void begin_process(std::uint32_t handle, const PeerIdentity& peer);
  void register_step(std::uint32_t handle, std::uint32_t id, const std::string& name);
  // Applied events, in the order they were applied; `now_ns`: the daemon clock.
  void record(std::uint32_t handle, proto::EventSpan events, std::uint64_t now_ns);
  void mark(TraceMark mark);
  // Evicts what is past the horizon (the liveness tick calls it).
  void tick(std::uint64_t now_ns);

  // ---- captures --------------------------------------------------------------------
  // `trace --for`: record from now on (with kCaptureBudget when the standing window is
  // off) until end_capture().
  void begin_capture();
  void end_capture();
  // The window now: all processes, or those whose pid is in `pids`; events and marks
  // stamped before `since_ns` left out.
  std::shared_ptr<TraceCapture> capture(const std::set<std::int32_t>& pids, std::uint64_t since_ns,
                                        std::uint64_t now_ns) const;

  FlightRecorderCounters counters() const;
  const FlightRecorderConfig& config() const { return config_; }

 private:
  void new_chunk(TraceWindow& window, std::uint64_t now_ns);
  void prefetch_next_eviction() const;
  void evict_to(std::size_t budget);
  bool evict_oldest();
  void evict_front_chunk();
  // The order chunks were started in, with what eviction needs of each, so that it does
  // not read the (cold) chunk itself.
  struct ChunkOrder {
    TraceWindow* window = nullptr;
    const TraceChunk* chunk = nullptr;  // window->chunks' entry for it (to prefetch)
    std::uint64_t started_ns = 0;       // TraceChunk::started_ns
    std::uint64_t serial = 0;           // chunk_serial_ when it was started
  };
  void release_front_chunk(const ChunkOrder& order);  // taken out of chunk_order_ already
  void evict_front_mark();
  void drop_empty_orphans();
  void drop_window_charge(const TraceWindow& window);

  FlightRecorderConfig config_;
  std::size_t budget_ = 0;  // in force: config's, or kCaptureBudget during a capture
  std::size_t captures_ = 0;
  std::vector<std::shared_ptr<TraceWindow>> by_handle_;  // by ProcessHandle
  std::vector<std::shared_ptr<TraceWindow>> orphans_;    // slot reused, chunks remain
  std::deque<ChunkOrder> chunk_order_;                   // every chunk, oldest first
  std::uint64_t chunk_serial_ = 0;                       // chunks started so far
  // chunk_serial_ at the last capture: chunks with a larger serial are held by none.
  mutable std::uint64_t captured_through_ = 0;
  std::size_t names_bytes_ = 0;  // charged for the custom step names of all windows
  std::size_t names_cap_ = 0;    // budget / kNameShare
  std::deque<TraceMark> marks_;
  std::vector<std::shared_ptr<TraceChunk>> spare_;  // evicted chunks no capture holds
  FlightRecorderCounters counters_;
};

}  // namespace steptrace::daemon
