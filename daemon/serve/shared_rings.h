// The rings one client connection handed the daemon in shared memory (protocol version
// 5, proto/shm_ring.h, PROTOCOL.md section 11): mapping them, reading them into the
// Collector, and the drop counts in their headers.
//
// Data flow: the Session receives a memfd with the bytes of a RingAttach frame
// (SCM_RIGHTS); ClientStream hands both to attach(), which checks the descriptor (a
// memfd sealed against shrinking, exactly the size the frame states), the connection's,
// the process's, the uid's and the daemon's budgets, and maps its header page; the
// descriptor stays open (counted in limits.max_rings) because the slots are read with
// pread, never through a mapping: a hole the producer never wrote then reads as zeros
// without the daemon committing a page for it. drain() copies each ring's published
// records out, validates the copies, converts their ticks with the latest ClockSync,
// folds them with Collector::events and then frees the slots (a release store of the
// ring's tail). It
// runs on the server's ring timer, before a Flush is answered, before a text command is
// answered, for one thread up to a ledger record's stamp, and a last time when the
// connection closes (the process may be dead: its rings are all that is left of it).
//
// Untrusted: the producer may rewrite anything in the mapping at any time. The reader
// keeps its own tail, reads head once per pass and checks 0 <= head - tail <= capacity
// (else the ring is dropped from the set and counted as bad_ring), and never reads a
// record twice. A bad record (kind, reserved byte, step id, thread id) is skipped and
// counted as refused (Drained::refused, which the caller hands to the Collector: the
// process's drop cause `refused`, PROTOCOL.md 11.3); an event of a custom step not yet
// registered waits in the ring until the step's RegisterStep arrives (the library sends
// it within a round), or is refused in the last pass; one whose registration a limit
// refused is handed to the Collector, which counts it as refused (PROTOCOL.md 4.4). The file
// cannot shrink (F_SEAL_SHRINK), so the header's mapping never faults and a pread of the
// slots is never short.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "daemon/serve/config.h"
#include "daemon/state/collector.h"
#include "proto/shm_ring.h"

namespace steptrace::daemon {

// What every connection's rings share: the rings and slot bytes held per uid and in all.
struct RingBudget {
  std::map<std::uint32_t, std::uint64_t> bytes_by_uid;
  std::map<std::uint32_t, std::uint64_t> rings_by_uid;
  std::uint64_t bytes = 0;  // mapped now, all connections
  std::uint64_t rings = 0;  // mapped now
};

class SharedRings {
 public:
  // Why a drain() runs. kLive: records of a custom step not registered yet wait in the
  // ring. kFinal, the last pass of a connection the process ended: they are refused (no
  // registration will come) and every ring is let go. kHandOver, the last pass of a
  // connection the daemon ends while the process is still connected (a graceful stop):
  // every ring is let go with such records left in it, from the first one on, for the
  // next daemon, to which the library registers its steps again.
  enum class Pass : std::uint8_t { kLive, kFinal, kHandOver };

  SharedRings(const ServerLimits& limits, RingBudget& budget, std::uint32_t uid);
  ~SharedRings();  // unmaps every ring, returns its bytes
  SharedRings(const SharedRings&) = delete;
  SharedRings& operator=(const SharedRings&) = delete;

  // Maps `fd` (always closed here; -1: the frame came without one) as the ring `attach`
  // names. The answer for the RingAck; a refusal is counted by the caller.
  // `limit`: which bound refused it (kRefusedLimit).
  proto::RingStatus attach(const proto::RingAttach& attach, int fd,
                           std::optional<LimitKind>& limit);
  void set_clock(const proto::ClockSync& clock) { clock_ = clock; }
  // The process registered a custom step: rings waiting for one are read again.
  void step_registered() { ++registrations_; }

  struct Drained {
    std::uint64_t events = 0;     // folded into the collector
    std::uint64_t refused = 0;    // records skipped (Collector::refused_records)
    std::uint64_t bad_rings = 0;  // rings dropped for a head out of range
  };
  // Folds what every ring published. `thread` / `until_ns`: only that thread's ring, and
  // only records stamped at or before until_ns (a ledger record's place among them).
  Drained drain(Collector& collector, ProcessHandle process, Pass pass,
                std::optional<std::uint32_t> thread = std::nullopt,
                std::uint64_t until_ns = UINT64_MAX);

  // The drop counts the rings' producers wrote (rings unmapped since included): what the
  // library leaves out of its DroppedByCause frames on a version-5 connection.
  proto::DroppedByCause drops() const;
  std::size_t size() const { return rings_.size(); }
  std::uint64_t bytes() const { return bytes_; }  // slot bytes charged

 private:
  struct Ring {
    std::uint32_t ring_id = 0;
    std::uint32_t thread_id = 0;  // 0: a spare ring no thread has claimed yet (version 8)
    std::uint64_t capacity = 0;
    proto::RingHeader* header = nullptr;  // the first kRingHeaderBytes, mapped
    int fd = -1;                          // the memfd, owned: the slots are read from it
    std::size_t charged = 0;              // bytes counted against the budgets (the slots)
    std::uint64_t tail = 0;               // ours: never read back from the mapping
    std::uint64_t dropped_full = 0;
    std::uint64_t dropped_unconnected = 0;
    // Stopped at an event of an unregistered custom step when registrations_ had this
    // value: not read again (not even copied) until another step is registered.
    std::uint64_t waiting_since = UINT64_MAX;
  };
  // Reads the header's drop counters (never backwards).
  static void read_drops(Ring& ring);
  // A spare ring (attached for thread 0): takes the thread id its claiming thread wrote
  // into the header, once it is there (0 until then).
  static void learn_thread(Ring& ring);
  void unmap(std::size_t index);  // keeps its drop counts
  // Adds `rings` and `bytes` (negative: returns them) to this uid's share of the budget.
  void charge_uid(std::int64_t rings, std::int64_t bytes);
  // One ring's pass; false when its head was out of range.
  bool drain_ring(Ring& ring, Collector& collector, ProcessHandle process, Pass pass,
                  std::uint64_t until_ns, Drained& out);

  const ServerLimits& limits_;
  RingBudget& budget_;
  std::uint32_t uid_;
  std::vector<Ring> rings_;
  std::uint64_t bytes_ = 0;
  proto::ClockSync clock_{};
  std::uint64_t retired_full_ = 0;  // drop counts of rings unmapped
  std::uint64_t retired_unconnected_ = 0;
  std::uint64_t registrations_ = 0;
  std::vector<proto::EventRecord> copy_;  // one chunk copied out of a ring
};

}  // namespace steptrace::daemon
