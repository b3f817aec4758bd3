// steptrace wire format: the records a client sends to steptraced and back.
//
// A binary connection is: one Hello (48 bytes, first byte kMagic[0] = 0xF7, which is
// not printable ASCII, so the daemon can tell it from a text command), then frames.
// A frame is an 8-byte FrameHeader followed by `size` payload bytes. Every record is
// fixed-size, little-endian, with its size asserted below; strings are NUL-padded
// fixed arrays. proto/PROTOCOL.md is the byte-exact spec; this header is its code.
// Nothing here allocates, throws or does I/O.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "proto/steps.h"

namespace steptrace::proto {

static_assert(std::endian::native == std::endian::little,
              "the wire format is little-endian and records are copied as laid out in memory");

inline constexpr std::uint8_t kMagic[4] = {0xF7, 'S', 'T', 'P'};
// The version this code speaks; a daemon also accepts hellos of kMinProtocolVersion..
// kProtocolVersion (version 2 added the DroppedByCause frame, version 3 the ledger ops
// ReserveLease and Renew, version 4 the Identity frame, version 5 the shared rings,
// version 6 the Delivered frame, version 7 the Batch frame, version 8 spare rings,
// nothing else).
inline constexpr std::uint16_t kProtocolVersion = 8;
inline constexpr std::uint16_t kLeaseProtocolVersion = 3;
inline constexpr std::uint16_t kIdentityProtocolVersion = 4;
// Rings in shared memory (RingAttach, ClockSync, RingAck; proto/shm_ring.h).
inline constexpr std::uint16_t kShmProtocolVersion = 5;
// The Delivered frame: what earlier daemons took, so a restarted one counts what died
// with a crashed one.
inline constexpr std::uint16_t kDeliveredProtocolVersion = 6;
// The Batch frame: socket batches numbered per process, so that a client resends what a
// daemon did not acknowledge and the daemon skips what it already applied.
inline constexpr std::uint16_t kBatchProtocolVersion = 7;
// Spare rings: a RingAttach may name thread 0, a ring offered before any thread records
// into it; the thread that claims it writes its id into the ring's header before its
// first record (proto/shm_ring.h), so no new thread's events wait for an offer.
inline constexpr std::uint16_t kSpareRingProtocolVersion = 8;
inline constexpr std::uint16_t kMinProtocolVersion = 1;

// Hard limits that every decoder enforces.
inline constexpr std::uint32_t kMaxFramePayload = 256 * 1024;  // bytes after the header
inline constexpr std::size_t kNameField = 64;                  // step name, GPU UUID, task
inline constexpr std::size_t kMaxNameLength = kNameField - 1;  // a NUL must fit
inline constexpr std::size_t kProcessNameField = 24;
inline constexpr std::size_t kLibraryVersionField = 16;
inline constexpr std::size_t kErrorMessageField = 120;

// Step ids: the built-in steps are 0..kBuiltinStepCount-1 (proto/steps.h, same ids as
// the C ABI's enum); custom steps registered by name use
// [kFirstCustomStep, kFirstCustomStep + kMaxCustomSteps).
inline constexpr std::uint32_t kFirstCustomStep = 256;
inline constexpr std::uint32_t kMaxCustomSteps = 1024;
static_assert(kBuiltinStepCount <= kFirstCustomStep);
static_assert(
    [] {
      for (const BuiltinStep& s : kBuiltinSteps) {
        if (s.name.size() > kMaxNameLength) return false;
      }
      return true;
    }(),
    "a built-in step name must fit a name field");

constexpr bool is_custom_step(std::uint32_t step) {
  return step >= kFirstCustomStep && step < kFirstCustomStep + kMaxCustomSteps;
}
constexpr bool is_valid_step(std::uint32_t step) {
  return is_builtin_step(step) || is_custom_step(step);
}

struct Hello {
  std::uint8_t magic[4];
  std::uint16_t version;
  std::uint16_t flags;  // must be 0
  char library_version[kLibraryVersionField];
  char process_name[kProcessNameField];
};
static_assert(sizeof(Hello) == 48);

enum class FrameType : std::uint16_t {
  // client -> daemon
  kEvents = 1,          // payload: N x EventRecord, N >= 1
  kRegisterStep = 2,    // payload: RegisterStep
  kLedger = 3,          // payload: LedgerRecord
  kDropped = 4,         // payload: DroppedReport
  kFlush = 5,           // payload: FlushRequest
  kDroppedByCause = 6,  // payload: DroppedByCause (protocol version 2 and later)
  kIdentity = 7,        // payload: Identity (protocol version 4 and later), at most once
  kRingAttach = 8,      // payload: RingAttach + one memfd (SCM_RIGHTS) (version 5 and later)
  kClockSync = 9,       // payload: ClockSync (version 5 and later)
  kDelivered = 10,      // payload: Delivered (version 6 and later), at most once, first
  kBatch = 11,          // payload: Batch (version 7 and later)
  // daemon -> client
  kFlushAck = 0x81,  // payload: FlushAck
  kError = 0x82,     // payload: ErrorReport; the daemon closes the connection after it
  kRingAck = 0x83,   // payload: RingAck (version 5 and later)
};

struct FrameHeader {
  std::uint32_t size;      // payload bytes, <= kMaxFramePayload
  std::uint16_t type;      // FrameType
  std::uint16_t reserved;  // must be 0
};
static_assert(sizeof(FrameHeader) == 8);

enum class EventKind : std::uint8_t { kStart = 1, kEnd = 2 };

struct EventRecord {
  std::uint64_t timestamp_ns;  // CLOCK_MONOTONIC nanoseconds
  std::uint32_t thread_id;     // the client's kernel thread id
  std::uint16_t step;          // a valid step id
  std::uint8_t kind;           // EventKind
  std::uint8_t reserved;       // must be 0
};
static_assert(sizeof(EventRecord) == 16);

inline constexpr std::uint32_t kMaxEventsPerFrame = kMaxFramePayload / sizeof(EventRecord);

struct RegisterStep {
  std::uint32_t step;      // a custom step id
  std::uint32_t reserved;  // must be 0
  char name[kNameField];   // 1..63 printable chars, NUL-padded
};
static_assert(sizeof(RegisterStep) == 72);

enum class LedgerOp : std::uint8_t {
  kReserve = 1,     // reservation_id, bytes, task
  kRelease = 2,     // reservation_id
  kCleanup = 3,     // reservation_id, holder_pid (the dead holder whose entry was removed)
  kVramSample = 4,  // bytes = free bytes, total_bytes
  // Protocol version 3 (on an earlier version's stream: bad_ledger_op).
  kReserveLease = 5,  // reservation_id, bytes, task, lease_ms (in the total_bytes field)
  kRenew = 6,         // reservation_id, lease_ms (in the total_bytes field)
};

// A lease runs 1 ms .. 7 days; the daemon refuses others (ledger anomaly bad_lease).
inline constexpr std::uint64_t kMaxLeaseMs = 7ULL * 24 * 3600 * 1000;

// The newest ledger op a stream of protocol version `version` may carry.
constexpr LedgerOp last_ledger_op(std::uint16_t version) {
  return version >= kLeaseProtocolVersion ? LedgerOp::kRenew : LedgerOp::kVramSample;
}

// Set by the client when it had to cut a string to fit its field (an anomaly the
// daemon counts; it refuses the record).
enum LedgerFlag : std::uint8_t {
  kLedgerGpuUuidTruncated = 1,
  kLedgerTaskTruncated = 2,
  kLedgerKnownFlags = kLedgerGpuUuidTruncated | kLedgerTaskTruncated,
};

struct LedgerRecord {
  std::uint64_t timestamp_ns;
  std::uint64_t reservation_id;
  std::uint64_t bytes;
  std::uint64_t total_bytes;  // VramSample: total bytes; ReserveLease, Renew: lease_ms
  std::uint32_t thread_id;
  std::uint32_t holder_pid;
  std::uint8_t op;            // LedgerOp
  std::uint8_t flags;         // LedgerFlag bits; others must be 0
  std::uint8_t reserved[6];   // must be 0
  char gpu_uuid[kNameField];  // 1..63 printable chars
  char task[kNameField];      // 0..63 printable chars
};
static_assert(sizeof(LedgerRecord) == 176);

struct DroppedReport {
  std::uint64_t total_dropped;  // cumulative for the process; the daemon keeps the maximum
};
static_assert(sizeof(DroppedReport) == 8);

// Why a client could not deliver events (protocol version 2): each count is cumulative
// for the process, like DroppedReport; their sum is the process's total.
enum class DropCause : std::uint8_t {
  kBufferFull = 0,    // a thread's buffer was full while connected: the daemon fell behind
  kNotConnected = 1,  // no daemon connection (absent, stopped, restarting, after shutdown)
  kInFlight = 2,      // written to a connection that broke before the daemon read them
  kInvalid = 3,       // refused by the library: unknown step id, unusable ledger call
};
inline constexpr std::size_t kDropCauseCount = 4;
inline constexpr std::string_view kDropCauseNames[kDropCauseCount] = {
    "buffer_full", "not_connected", "in_flight", "invalid"};

struct DroppedByCause {
  std::uint64_t count[kDropCauseCount];  // indexed by DropCause
};
static_assert(sizeof(DroppedByCause) == 32);

// The causes a daemon reports per process (PROTOCOL.md 10.4): the client's, then its own
// daemon_crash: events the process delivered to a daemon that died before it made them
// durable (Delivered, protocol version 6), counted by the daemon that follows it; and
// refused: the start and end of each span the daemon took and did not keep (a duration
// past its limits.max_span_ns), counted when the end arrived.
inline constexpr std::size_t kDaemonCrashCause = kDropCauseCount;
inline constexpr std::size_t kRefusedCause = kDropCauseCount + 1;
inline constexpr std::size_t kReportDropCauseCount = kDropCauseCount + 2;
inline constexpr std::string_view kReportDropCauseNames[kReportDropCauseCount] = {
    "buffer_full", "not_connected", "in_flight", "invalid", "daemon_crash", "refused"};

// Version 6: the events of this process that daemons took before this connection (read
// from its shared rings, or in Events frames a FlushAck acknowledged), cumulative since it
// started. Sent at most once per connection, before any Events or RingAttach frame; the
// daemon compares it with what it counted for the process (section 4.7c).
struct Delivered {
  std::uint64_t events;
};
static_assert(sizeof(Delivered) == 8);

// Version 7: the next `frames` frames of the connection are batch `sequence` of the
// process (numbered from 1, increasing across its connections; a resent batch keeps its
// number). Inside a batch only Events, RegisterStep, Ledger, Dropped, DroppedByCause and
// Flush frames may come. The daemon applies each frame of a batch at most once per
// process, its position (sequence, index) kept with the process's totals (and in the
// snapshot): frames at or before the last applied position are skipped, a Flush among
// them still answered (section 4.7d).
struct Batch {
  std::uint64_t sequence;  // >= 1
  std::uint32_t frames;    // >= 1
  std::uint32_t reserved;  // must be 0
};
static_assert(sizeof(Batch) == 16);

// Which job and rank the process belongs to (protocol version 4), from its environment
// (STEPTRACE_JOB, TORCHELASTIC_RUN_ID, SLURM_JOB_ID; RANK, LOCAL_RANK, WORLD_SIZE).
// At most one per connection; a process without either sends none.
inline constexpr std::uint32_t kNoRank = 0xFFFFFFFF;  // rank / local_rank not known
struct Identity {
  char job[kNameField];      // 0..63 printable chars; empty: no job id
  std::uint32_t rank;        // kNoRank, or < world_size when world_size is not 0
  std::uint32_t local_rank;  // kNoRank, or < world_size when world_size is not 0
  std::uint32_t world_size;  // 0: not known
  std::uint32_t reserved;    // must be 0
};
static_assert(sizeof(Identity) == 80);

// A thread's event ring in shared memory (proto/shm_ring.h for the layout). The frame's
// first byte travels with exactly one file descriptor (SCM_RIGHTS): a memfd sealed
// against shrinking, of exactly kRingHeaderBytes + capacity * 16 bytes.
struct RingAttach {
  std::uint32_t ring_id;    // the library's name for the ring, echoed in RingAck
  std::uint32_t thread_id;  // the ring's one producer thread; version 8: 0, a spare ring
  std::uint64_t capacity;   // records: a power of two, kMinShmRingRecords..kMaxShmRingRecords
};
static_assert(sizeof(RingAttach) == 16);

// How ring timestamps (raw ticks) become CLOCK_MONOTONIC ns:
//   ns = anchor_ns + ((ticks - anchor_ticks) * scale) >> 32   (signed difference)
// scale 0: the ticks already are CLOCK_MONOTONIC ns. The latest one sent applies to
// every ring record the daemon reads after it (also after the process died).
struct ClockSync {
  std::uint64_t anchor_ticks;
  std::uint64_t anchor_ns;
  std::uint64_t scale;  // ns per tick, fixed point with 32 fraction bits; < 2^42
};
static_assert(sizeof(ClockSync) == 24);
inline constexpr std::uint64_t kMaxClockScale = std::uint64_t{1} << 42;  // 1024 ns per tick

enum class RingStatus : std::uint32_t {
  kMapped = 0,        // the daemon reads the ring from now on
  kRefusedLimit = 1,  // over limits.max_ring_bytes_per_process / _per_uid / max_rings_per_process
  kRefusedFd = 2,     // no descriptor, not a sealed memfd, wrong size, cannot be mapped
};
inline constexpr std::uint32_t kLastRingStatus = 2;

struct RingAck {
  std::uint32_t ring_id;  // of the RingAttach answered
  std::uint32_t status;   // RingStatus
};
static_assert(sizeof(RingAck) == 8);

struct FlushRequest {
  std::uint64_t sequence;
};
static_assert(sizeof(FlushRequest) == 8);

struct FlushAck {
  std::uint64_t sequence;  // echoes the FlushRequest once every earlier frame is applied
};
static_assert(sizeof(FlushAck) == 8);

enum class ErrorCode : std::uint32_t {
  kProtocol = 1,  // a malformed frame; message says which rule
  kUnsupportedVersion = 2,
  kLimit = 3,  // a configured limit was hit (connections, custom steps, ...)
};

struct ErrorReport {
  std::uint32_t code;  // ErrorCode
  std::uint32_t reserved;
  char message[kErrorMessageField];  // NUL-padded, printable
};
static_assert(sizeof(ErrorReport) == 128);

// Fixed payload size of each non-event frame type; 0 for kEvents and unknown types.
constexpr std::uint32_t fixed_payload_size(FrameType type) {
  switch (type) {
    case FrameType::kRegisterStep:
      return sizeof(RegisterStep);
    case FrameType::kLedger:
      return sizeof(LedgerRecord);
    case FrameType::kDropped:
      return sizeof(DroppedReport);
    case FrameType::kFlush:
      return sizeof(FlushRequest);
    case FrameType::kDroppedByCause:
      return sizeof(DroppedByCause);
    case FrameType::kIdentity:
      return sizeof(Identity);
    case FrameType::kRingAttach:
      return sizeof(RingAttach);
    case FrameType::kClockSync:
      return sizeof(ClockSync);
    case FrameType::kDelivered:
      return sizeof(Delivered);
    case FrameType::kBatch:
      return sizeof(Batch);
    case FrameType::kRingAck:
      return sizeof(RingAck);
    case FrameType::kFlushAck:
      return sizeof(FlushAck);
    case FrameType::kError:
      return sizeof(ErrorReport);
    case FrameType::kEvents:
      return 0;
  }
  return 0;
}

}  // namespace steptrace::proto
