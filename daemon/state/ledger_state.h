// The VRAM ledger view's state (daemon/state/ledger_view.h) as plain values: written by
// ledger_view.cpp (apply, attribution), read whole by the renderers (a CollectorView's
// ledger(), daemon/report/ledger_report.h) and by the snapshot codec
// (daemon/persist/snapshot_sections.cpp: LedgerView::state() out, LedgerView::adopt() in,
// also as a StateImage's ledger). Only LedgerView changes it.
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
#include <vector>

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
  // Leases (protocol version 3): a Renew of an unknown reservation, one refused (not the
  // holder's side), a lease outside 1 ms .. 7 days; and a lease that passed unrenewed
  // (counted when the view marks it EXPIRED; nothing is refused).
  kUnknownRenew,
  kRenewRefused,
  kBadLease,
  kLeaseExpired,
  // A uid at max_ledger_rows_per_uid on a GPU needed a row (the record is applied).
  kMaxLedgerRowsPerUid,
  // Sanity of the shared view (refused): a Reserve larger than the GPU's known total; a
  // VramSample whose total contradicts NVML's or the one another uid established.
  kReservationOverTotal,
  kVramTotalMismatch,
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
    "unknown_renew",
    "renew_refused",
    "bad_lease",
    "lease_expired",
    "max_ledger_rows_per_uid",
    "reservation_over_total",
    "vram_total_mismatch",
};

// How far a VramSample's total may be from the GPU's known total (NVML's, else the one a
// client established) before it contradicts it, in percent of the known total; also the
// slack over a client-established total a single Reserve may have. Two clients of one
// GPU report the same total, and a client's total (cudaMemGetInfo) is within a few percent
// of NVML's (memory the driver keeps); a distortion worth refusing is far off.
inline constexpr std::uint64_t kTotalTolerancePct = 10;

// kTotalTolerancePct of `known` (no overflow).
constexpr std::uint64_t total_slack(std::uint64_t known) {
  return known / 100 * kTotalTolerancePct + known % 100 * kTotalTolerancePct / 100;
}
// `total` contradicts `known`: it differs by more than kTotalTolerancePct of `known`.
constexpr bool total_contradicts(std::uint64_t total, std::uint64_t known) {
  return (total > known ? total - known : known - total) > total_slack(known);
}

// Applied operations per GPU; a ReserveLease counts as a reserve.
enum Op : std::size_t { kOpReserve, kOpRelease, kOpCleanup, kOpVramSample, kOpRenew, kOpCount };
inline constexpr std::array<std::string_view, kOpCount> kOpNames = {"reserve", "release", "cleanup",
                                                                    "vram_sample", "renew"};

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
  // A lease (ReserveLease, Renew): its length (0: none) and when it passes unrenewed
  // (monotonic); `expired` once the view saw it pass (expire_leases), until a renewal.
  std::uint64_t lease_ms = 0;
  std::uint64_t lease_deadline_ns = 0;
  bool expired = false;
  // Device truth (NVML): when the holder was last seen using memory on this GPU (0:
  // never since the reservation or the daemon's start). Not kept in snapshots.
  std::uint64_t last_used_ns = 0;
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
  std::uint64_t renews = 0;
  // Releases, cleanups and renewals it sent for this GPU that it was not allowed to make,
  // once it had a row (a refused record never makes one).
  std::uint64_t refused = 0;
  std::map<std::uint32_t, StepTime> steps;  // ledger step id -> time
  // The actor's uid (max_ledger_rows_per_uid); kUnknownUid when restored from a snapshot
  // that did not keep it (LedgerView::adopt then gives it a reservation holder's uid).
  std::uint32_t uid = kUnknownUid;
  // When the liveness check first saw the actor's process gone (monotonic; 0: alive, or
  // not seen gone yet); the row goes max_ledger_row_age_s after. Kept in snapshots, so
  // the ageing continues across a restart (one of a former boot ages from the restore).
  std::uint64_t exited_ns = 0;
};

struct VramSample {
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t at_ns = 0;
};

// What the device itself reports (NVML, sampled by daemon/serve/gpu_sampler.h).
struct DeviceProcess {
  std::uint32_t pid = 0;
  std::optional<std::uint64_t> used_bytes;  // nullopt: the driver would not say
  // /proc/PID exists in the daemon's pid namespace; false: gone, or in another
  // container's namespace (NVML reports host pids) — the daemon cannot tell which.
  bool visible = true;
};
struct Device {
  std::string name;
  std::uint64_t total_bytes = 0;
  std::uint64_t used_bytes = 0;
  std::uint64_t free_bytes = 0;
  std::uint64_t at_ns = 0;
  bool processes_known = false;
  std::vector<DeviceProcess> processes;
};

// Thresholds of the device findings (config: nvml_over_tolerance_pct, nvml_idle_s).
struct DeviceRules {
  std::uint32_t over_tolerance_pct = 10;
  std::uint64_t idle_ns = 300'000'000'000ULL;
};

// A disagreement between what processes declared and what the device reports.
struct Finding {
  enum Kind : std::uint8_t { kUndeclared, kOver, kIdle, kGhost, kKindCount };
  Kind kind;
  std::uint32_t pid = 0;
  std::uint64_t used_bytes = 0;      // on the device (0 for IDLE)
  std::uint64_t reserved_bytes = 0;  // its reservations on the GPU
  std::uint64_t reservation_id = 0;  // IDLE: which one
};
inline constexpr std::array<std::string_view, Finding::kKindCount> kFindingNames = {
    "UNDECLARED", "OVER", "IDLE", "GHOST"};

struct Gpu {
  std::map<std::uint64_t, Reservation> reservations;
  std::uint64_t reserved_bytes = 0;  // sum of the reservations' bytes
  std::uint64_t high_water_bytes = 0;
  std::optional<VramSample> sample;
  bool overcommitted = false;  // reserved_bytes > the device's total, else the sample's
  // The total NVML reported in its last sample of this GPU (not kept in snapshots).
  std::optional<std::uint64_t> device_total;
  // The total clients established (without NVML the GPU's known total): the first
  // applied VramSample's, changed only by a later sample of the same uid, of root, or one
  // NVML confirmed; a sample of another uid contradicting it is refused. Kept in
  // snapshots with its uid; a GPU restored from one that did not keep them takes its
  // sample's total, owned by no uid (kUnknownUid).
  std::optional<std::uint64_t> client_total;
  std::uint32_t client_total_uid = kUnknownUid;
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
  // Leases that passed unrenewed while their holder lives (a dead holder's is a leak).
  std::size_t expired() const {
    return static_cast<std::size_t>(std::count_if(
        reservations.begin(), reservations.end(),
        [](const auto& entry) { return entry.second.holder_alive && entry.second.expired; }));
  }
};

// The last annotation one (process, thread) recorded.
struct Mark {
  std::string gpu;
  std::uint64_t timestamp_ns = 0;
  std::string comm;
  std::uint32_t uid = kUnknownUid;
};

// What one uid has in the ledger: GPU entries it created, reservations it holds.
struct UidUsage {
  std::size_t gpus = 0;
  std::size_t reservations = 0;
};

struct State {
  std::map<std::string, Gpu, std::less<>> gpus;
  // NVML's view, by UUID (empty without NVML); the last sample's error, if any.
  std::map<std::string, Device, std::less<>> devices;
  std::string device_error;
  DeviceRules rules;
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

  // The actor's row on `gpu`, made if need be; nullptr (counted) when there is no room.
  // A uid at limits.max_ledger_rows_per_uid on the GPU gives up its row whose process
  // exited first, else gets none; a GPU with limits.max_processes rows gives up the row of
  // any uid whose process exited first, else refuses: rows of exited processes never
  // crowd out live ones.
  ProcessRow* row(Gpu& gpu, const ProcessKey& key, const std::string& comm, std::uint32_t uid,
                  const Limits& limits, DaemonCounters& counters) {
    auto it = gpu.processes.find(key);
    if (it == gpu.processes.end()) {
      if (!make_room(gpu, uid, limits, counters)) return nullptr;
      it = gpu.processes.emplace(key, ProcessRow{}).first;
      it->second.uid = uid;
    }
    it->second.comm = comm;
    it->second.exited_ns = 0;  // it sent something: alive
    return &it->second;
  }
  // The actor's row on `gpu` if it has one (a refused record makes none).
  static ProcessRow* existing_row(Gpu& gpu, const ProcessKey& key) {
    const auto it = gpu.processes.find(key);
    return it == gpu.processes.end() ? nullptr : &it->second;
  }

  // Over-commitment is counted on the transition into it, not on every record.
  // Judged against the device's total (NVML) when it reports the GPU, else the client's.
  void update_overcommit(Gpu& gpu) {
    const std::optional<std::uint64_t> total =
        gpu.device_total ? gpu.device_total
                         : (gpu.sample ? std::optional(gpu.sample->total_bytes) : std::nullopt);
    const bool now = total && gpu.reserved_bytes > *total;
    if (now && !gpu.overcommitted) {
      ++gpu.overcommit_events;
      count(kOvercommitted);
    }
    gpu.overcommitted = now;
  }

 private:
  // Room for one more row of `uid` on `gpu` (row()); false (counted) when there is none.
  bool make_room(Gpu& gpu, std::uint32_t uid, const Limits& limits, DaemonCounters& counters) {
    if (uid != kUnknownUid) {
      const auto mine = [uid](const ProcessRow& r) { return r.uid == uid; };
      const auto n = static_cast<std::size_t>(
          std::count_if(gpu.processes.begin(), gpu.processes.end(),
                        [&mine](const auto& entry) { return mine(entry.second); }));
      if (n >= limits.max_ledger_rows_per_uid) {
        count(kMaxLedgerRowsPerUid);
        counters.hit(LimitKind::kMaxLedgerRowsPerUid);
        if (!erase_first_exited(gpu, mine)) return false;
      }
    }
    if (gpu.processes.size() < limits.max_processes) return true;
    if (erase_first_exited(gpu, [](const ProcessRow&) { return true; })) return true;
    count(kProcessRowsFull);
    return false;
  }
  // Erases the row, among those `which` accepts, whose process was seen exited first.
  template <typename Which>
  static bool erase_first_exited(Gpu& gpu, const Which& which) {
    auto first = gpu.processes.end();
    for (auto it = gpu.processes.begin(); it != gpu.processes.end(); ++it) {
      const ProcessRow& r = it->second;
      if (r.exited_ns == 0 || !which(r)) continue;
      if (first == gpu.processes.end() || r.exited_ns < first->second.exited_ns) first = it;
    }
    if (first == gpu.processes.end()) return false;
    gpu.processes.erase(first);
    return true;
  }
};

// The findings on GPU `uuid` (ledger_view.cpp): every device process against the
// reservations of the same pid, every reservation of a live holder against the device.
// None without a device sample of that GPU.
std::vector<Finding> device_findings(const State& state, std::string_view uuid,
                                     std::uint64_t now_ns);

}  // namespace steptrace::daemon::ledger
