// The VRAM ledger view's state (daemon/state/ledger_view.h), shared by the files that
// read or write it whole: ledger_view.cpp (apply, attribution, reports) and the snapshot
// codec (daemon/persist/snapshot_codec.cpp: LedgerView::state() out, LedgerView::adopt()
// in). Not for use outside those.
//
// One Gpu per UUID (reservations by id, reserved total and high-water, last VRAM sample,
// operation counts, per-actor rows of ledger operations and ledger-step time, the uid
// that created it), plus per (process, thread) the GPU and timestamp of the last
// annotation, which attribute_span() uses to credit a ledger-step span to a GPU, plus
// per uid what it holds (the per-uid quotas' counts, derived: recount() rebuilds them).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

#include "daemon/state/types.h"

namespace steptrace::daemon::ledger {

enum Anomaly : std::size_t {
  kUnknownRelease,
  kUnknownCleanup,
  kDuplicateReservation,
  kZeroByteReserve,
  kGpuUuidTruncated,
  kTaskTruncated,
  kCleanupHolderMismatch,
  kMaxGpus,
  kMaxReservationsPerGpu,
  kReservedBytesOverflow,
  kBadVramSample,
  kBadRecord,
  kOvercommitted,
  kProcessRowsFull,
  kAttributionThreadsFull,
  kReleaseRefused,
  kCleanupRefused,
  kMaxGpusPerUid,
  kMaxReservationsPerUid,
  kAnomalyCount,
};

inline constexpr std::array<std::string_view, kAnomalyCount> kAnomalyNames = {
    "unknown_release",
    "unknown_cleanup",
    "duplicate_reservation",
    "zero_byte_reserve",
    "gpu_uuid_truncated",
    "task_truncated",
    "cleanup_holder_mismatch",
    "max_gpus",
    "max_reservations_per_gpu",
    "reserved_bytes_overflow",
    "bad_vram_sample",
    "bad_record",
    "overcommitted",
    "process_rows_full",
    "attribution_threads_full",
    "release_refused",
    "cleanup_refused",
    "max_gpus_per_uid",
    "max_reservations_per_uid",
};

enum Op : std::size_t { kOpReserve, kOpRelease, kOpCleanup, kOpVramSample, kOpCount };
inline constexpr std::array<std::string_view, kOpCount> kOpNames = {"reserve", "release", "cleanup",
                                                                    "vram_sample"};

struct Reservation {
  ProcessKey holder;
  // The holder's uid (SO_PEERCRED); kUnknownUid when restored from a snapshot written
  // before uids were kept. Who may release or clean the entry up depends on it.
  std::uint32_t uid = kUnknownUid;
  std::string comm;
  std::uint64_t bytes = 0;
  std::string task;
  std::uint64_t reserved_ns = 0;
  bool holder_alive = true;
};

struct StepTime {
  std::uint64_t count = 0;
  std::uint64_t total_ns = 0;
};

// One actor's ledger activity on one GPU.
struct ProcessRow {
  std::string comm;
  std::uint64_t reserves = 0;
  std::uint64_t releases = 0;
  std::uint64_t cleanups = 0;
  // Releases and cleanups it sent for this GPU that it was not allowed to make.
  std::uint64_t refused = 0;
  std::map<std::uint32_t, StepTime> steps;  // ledger step id -> time
};

struct VramSample {
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t at_ns = 0;
};

struct Gpu {
  std::map<std::uint64_t, Reservation> reservations;
  std::uint64_t reserved_bytes = 0;  // sum of the reservations' bytes
  std::uint64_t high_water_bytes = 0;
  std::optional<VramSample> sample;
  bool overcommitted = false;  // reserved_bytes > sample->total_bytes
  std::uint64_t overcommit_events = 0;
  std::array<std::uint64_t, kOpCount> operations{};
  std::map<ProcessKey, ProcessRow> processes;
  // Ledger-step time of all processes, kept when their rows are forgotten so that the
  // metrics counter never goes down.
  std::map<std::uint32_t, StepTime> steps;
  // The uid whose Reserve or VramSample created the entry (max_gpus_per_uid counts it
  // against that uid while it exists); kUnknownUid from an older snapshot.
  std::uint32_t creator_uid = kUnknownUid;

  std::size_t leaked() const {
    return static_cast<std::size_t>(
        std::count_if(reservations.begin(), reservations.end(),
                      [](const auto& entry) { return !entry.second.holder_alive; }));
  }
};

// The last annotation one (process, thread) recorded.
struct Mark {
  std::string gpu;
  std::uint64_t timestamp_ns = 0;
  std::string comm;
};

// What one uid has in the ledger: GPU entries it created, reservations it holds.
struct UidUsage {
  std::size_t gpus = 0;
  std::size_t reservations = 0;
};

struct State {
  std::map<std::string, Gpu, std::less<>> gpus;
  std::map<ProcessKey, std::map<std::uint32_t, Mark>> marks;
  std::array<std::uint64_t, kAnomalyCount> anomalies{};
  // Derived from `gpus` (creator_uid, reservations' uid), kUnknownUid never counted; a
  // uid with nothing is not kept.
  std::map<std::uint32_t, UidUsage> uids;

  void count(Anomaly kind) { ++anomalies[kind]; }

  UidUsage usage(std::uint32_t uid) const {
    const auto it = uids.find(uid);
    return it == uids.end() ? UidUsage{} : it->second;
  }
  // Adds `gpus` GPU entries and `reservations` reservations (each may be -1) to `uid`.
  void charge(std::uint32_t uid, int gpus, int reservations) {
    if (uid == kUnknownUid) return;
    UidUsage& u = uids[uid];
    u.gpus = static_cast<std::size_t>(static_cast<std::ptrdiff_t>(u.gpus) + gpus);
    u.reservations =
        static_cast<std::size_t>(static_cast<std::ptrdiff_t>(u.reservations) + reservations);
    if (u.gpus == 0 && u.reservations == 0) uids.erase(uid);
  }
  // Rebuilds `uids` from `gpus` (after a restore or a reset).
  void recount() {
    uids.clear();
    for (const auto& [uuid, gpu] : gpus) {
      charge(gpu.creator_uid, 1, 0);
      for (const auto& [id, r] : gpu.reservations) charge(r.uid, 0, 1);
    }
  }

  // The actor's row on `gpu`; nullptr (counted) when the GPU already keeps a row for as
  // many processes as the collector may hold.
  ProcessRow* row(Gpu& gpu, const ProcessKey& key, const std::string& comm, std::size_t max_rows) {
    auto it = gpu.processes.find(key);
    if (it == gpu.processes.end()) {
      if (gpu.processes.size() >= max_rows) {
        count(kProcessRowsFull);
        return nullptr;
      }
      it = gpu.processes.emplace(key, ProcessRow{}).first;
    }
    it->second.comm = comm;
    return &it->second;
  }

  // Over-commitment is counted on the transition into it, not on every record.
  void update_overcommit(Gpu& gpu) {
    const bool now = gpu.sample && gpu.reserved_bytes > gpu.sample->total_bytes;
    if (now && !gpu.overcommitted) {
      ++gpu.overcommit_events;
      count(kOvercommitted);
    }
    gpu.overcommitted = now;
  }
};

// The JSON of a GPU's ledger rows that the `ledger --json` report and the snapshot both
// write (defined in ledger_view.cpp): [{"step", "count", "total_ns"}, ...],
// [{"pid", "start_time", "comm", "reserves", "releases", "cleanups", "refused", "steps"},
// ...] and
// {"reserve": n, "release": n, "cleanup": n, "vram_sample": n}.
nlohmann::json steps_json(const std::map<std::uint32_t, StepTime>& steps);
nlohmann::json processes_json(const Gpu& gpu);
nlohmann::json operations_json(const Gpu& gpu);

}  // namespace steptrace::daemon::ledger
