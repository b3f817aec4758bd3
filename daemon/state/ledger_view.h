// The daemon's live view of the VRAM ledger that trainers share, per GPU (by UUID).
//
// Fed by the ledger annotations of the C ABI (proto::LedgerRecord: reserve, release,
// cleanup, VRAM sample), each credited to the process whose connection sent it (the
// actor). Ledger-step spans (LedgerReserve .. LedgerRelease) are attributed to the GPU
// named by the last annotation the same thread recorded inside the span. Holders whose
// process died without releasing are flagged (holder_alive = false, a leak) until a
// release or a cleanup removes them. A reservation may carry a lease (protocol version
// 3): unrenewed past it while its holder lives, it is EXPIRED (expire_leases, on the
// liveness tick), and anyone may clean it up, as a dead holder's. Anomalies are counted
// per kind, never fatal.
// Each reservation keeps its holder's uid: a Release is applied only when sent by the
// holder process, a process of the holder's uid or root, a Cleanup of a live holder's
// entry likewise (anyone may clean up a dead holder's); refusals are anomalies
// (release_refused, cleanup_refused) credited to the actor's per-GPU row. Per-uid quotas:
// Limits::max_gpus_per_uid (GPU entries a uid created) and max_reservations_per_uid.
// A refused record makes no per-GPU row; rows are capped per uid and GPU
// (max_ledger_rows_per_uid) and rows of processes seen exited age out (age_rows) and make
// room first. Sanity: a Reserve larger than the GPU's known total (NVML's, else the one
// clients established) and a VramSample whose total contradicts it are refused
// (reservation_over_total, vram_total_mismatch; ledger_state.h kTotalTolerancePct).
// Owned by the Collector; single-threaded like it. Its state is ledger::State
// (ledger_state.h); the snapshot codec (daemon/persist/snapshot_codec.h) writes it from
// state() and restores it through adopt().
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/state/ledger_state.h"
#include "daemon/state/types.h"

namespace steptrace::daemon {

// The process that sent an annotation, as the collector knows it.
struct LedgerActor {
  ProcessKey key;
  std::string comm;
  // The peer's uid (SO_PEERCRED); nobody when unknown. Decides what the actor may release
  // or clean up, and which per-uid quotas its records count against.
  std::uint32_t uid = kNobodyUid;
};

class LedgerView {
 public:
  LedgerView(const Limits& limits, DaemonCounters& counters);
  // Shares `other`'s state copy-on-write (for CollectorView): whichever side mutates
  // first clones it. Renders of a copy read only the state, never the counters.
  LedgerView(const LedgerView& other);
  LedgerView& operator=(const LedgerView&) = delete;
  ~LedgerView();

  // Whether the view applied it (false: refused or counted as an anomaly only).
  bool apply(const LedgerActor& actor, const proto::LedgerRecord& record, std::uint64_t now_ns);

  // A ledger-step span of (process, thread) ended: credit its duration to the GPU the
  // thread annotated inside [start_ns, end_ns], if any.
  void attribute_span(const ProcessKey& process, std::uint32_t thread_id, std::uint32_t step,
                      std::uint64_t start_ns, std::uint64_t end_ns);

  // Marks EXPIRED every live holder's lease whose deadline passed unrenewed by `now_ns`,
  // counting each (anomaly lease_expired); returns how many. The liveness tick calls it.
  // Each one marked, when `expired` is given (for the flight recorder).
  struct ExpiredLease {
    std::string gpu;
    std::uint64_t id = 0;
    ledger::Reservation reservation;
  };
  std::size_t expire_leases(std::uint64_t now_ns, std::vector<ExpiredLease>* expired = nullptr);
  // Ages the per-GPU activity rows (the liveness tick calls it): a row whose process
  // `alive(key)` says is gone is marked exited at `now_ns`, and goes
  // limits.max_ledger_row_age_s later; until then, it is the first to make room for
  // another row (ledger::State::row). Returns how many rows went.
  std::size_t age_rows(const std::function<bool(const ProcessKey&)>& alive, std::uint64_t now_ns);
  // Re-evaluates holder_alive of every reservation with `alive(key)`.
  void check_holders(const std::function<bool(const ProcessKey&)>& alive);
  // The process record is dropped from the collector: forget per-thread attribution state
  // (reservations it holds stay, since they still hold VRAM).
  void forget_process(const ProcessKey& process);
  // Root's `reset --ledger` (every GPU) or `reset --gpu UUID` (one): the GPUs go with
  // their reservations, rows, samples and attribution marks, and stop counting against
  // the uids that created or held them; anomaly counts stay (metrics never go down).
  // Returns how many GPUs were dropped (0 for a UUID the view does not have).
  std::size_t reset(std::optional<std::string_view> gpu);

  // NVML's sample of every device (`devices` by UUID; `error`: what failed, "" if none):
  // replaces the previous, and notes which reservations' holders use memory now.
  void apply_devices(std::map<std::string, ledger::Device, std::less<>> devices, std::string error,
                     std::uint64_t now_ns);
  void set_device_rules(const ledger::DeviceRules& rules);

  // ---- hand-over to the renderers (daemon/report/ledger_report.h) and the snapshot codec
  const ledger::State& state() const { return *state_; }
  std::uint64_t changes() const { return changes_; }  // grows with every change of state()
  // Replaces the state with a restored one, validated by the codec (attribution marks
  // are dropped: the spans they were for ended with the daemon that wrote the snapshot).
  // Leases not expired then run at least one more lease from `now_ns`.
  void adopt(ledger::State state, std::uint64_t now_ns);

 private:
  ledger::State& write_state();  // clones a state a copy still shares
  std::uint64_t changes_ = 0;    // write_state() calls: Collector::generation()

  const Limits& limits_;
  DaemonCounters& counters_;
  std::shared_ptr<ledger::State> state_;
};

}  // namespace steptrace::daemon
