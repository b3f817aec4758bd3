// Collector and the VRAM ledger (daemon/state/ledger_view.h): ledger records, an
// operator's cleanup and reset, a holder's liveness checked before a cleanup decides,
// and NVML's device truth (daemon/serve/gpu_sampler.h).
#include "daemon/state/collector.h"

#include <map>
#include <string>
#include <utility>

#include "daemon/state/collector_state.h"

namespace steptrace::daemon {

// ---- Collector: ledger ------------------------------------------------------------------

void Collector::ledger(ProcessHandle process, const proto::LedgerRecord& record) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  if (record.op == static_cast<std::uint8_t>(proto::LedgerOp::kCleanup)) refresh_holder(record);
  const ProcessRecord& rec = *state_->slots[process];
  const std::uint64_t now = env_.monotonic_now_ns();
  const bool applied =
      state_->ledger.apply(LedgerActor{rec.key(), rec.peer.comm, rec.peer.uid}, record, now);
  if (!applied) {
    ProcessRecord& w = state_->write(process);
    w.ledger_refused = saturating_add(w.ledger_refused, 1);
  }
  if (!recorder_.on()) return;
  TraceMark mark;
  mark.kind = TraceMark::Kind::kLedger;
  mark.ts_ns = record.timestamp_ns;
  mark.arrived_ns = now;
  mark.sender = rec.key();
  mark.record = record;
  mark.applied = applied;
  const auto& gpus = state_->ledger.state().gpus;
  if (const auto gpu = gpus.find(proto::field_view(record.gpu_uuid)); gpu != gpus.end()) {
    mark.gpu_reserved_bytes = gpu->second.reserved_bytes;
    if (gpu->second.sample) {
      mark.gpu_free_bytes = gpu->second.sample->free_bytes;
      mark.gpu_total_bytes = gpu->second.sample->total_bytes;
    }
  }
  recorder_.mark(mark);
}

// A cleanup by another uid is allowed only of a dead holder (ledger_view.h): a holder
// that died since the last tick must be known dead before the view decides. One probe,
// at most once per holder per tick, and only of a disconnected holder believed alive.
void Collector::refresh_holder(const proto::LedgerRecord& record) {
  State& state = *state_;
  const auto& gpus = state.ledger.state().gpus;
  const auto gpu = gpus.find(proto::field_view(record.gpu_uuid));
  if (gpu == gpus.end()) return;
  const auto reservation = gpu->second.reservations.find(record.reservation_id);
  if (reservation == gpu->second.reservations.end() || !reservation->second.holder_alive) return;
  const ProcessKey holder = reservation->second.holder;
  const auto tracked = state.by_key.find(holder);
  if (tracked != state.by_key.end() && state.slots[tracked->second]->connections > 0) return;
  if (!holders_probed_.insert(holder).second) return;
  if (probe_liveness(env_, holder, counters_) != Liveness::kDead) return;
  if (tracked != state.by_key.end()) {
    mark_exited(state, state.write(tracked->second), env_.monotonic_now_ns());
  } else {
    state.holders_stale = true;
  }
  check_ledger_holders(state, env_, counters_);
}

// The ledger's activity rows of processes gone age out (LedgerView::age_rows): the table
// answers for the processes it has, one /proc probe per tick for another still believed
// alive (a text command's peer, a process restored or evicted), none for one seen gone.
void Collector::age_ledger_rows() {
  State& state = *state_;
  state.ledger.age_rows(
      [&](const ProcessKey& key) {
        const auto it = state.by_key.find(key);
        if (it != state.by_key.end()) return state.slots[it->second]->alive;
        // Unknown (the probe failed): alive, asked again next tick.
        return probe_liveness(env_, key, counters_) != Liveness::kDead;
      },
      env_.monotonic_now_ns());
}

CleanupOutcome Collector::operator_cleanup(const PeerIdentity& peer, std::string_view gpu,
                                           std::uint64_t id) {
  using Result = CleanupOutcome::Result;
  CleanupOutcome out;
  const auto& gpus = state_->ledger.state().gpus;
  const auto g = gpus.find(gpu);
  if (g == gpus.end() || !g->second.reservations.contains(id)) return out;  // kNoReservation
  proto::LedgerRecord record{};
  record.op = static_cast<std::uint8_t>(proto::LedgerOp::kCleanup);
  record.timestamp_ns = env_.monotonic_now_ns();
  record.reservation_id = id;
  record.holder_pid = static_cast<std::uint32_t>(g->second.reservations.at(id).holder.pid);
  if (!proto::set_field(record.gpu_uuid, gpu)) {
    out.result = Result::kBadGpu;
    return out;
  }
  refresh_holder(record);  // a holder that died since the last tick counts as dead
  const auto& r = state_->ledger.state().gpus.find(gpu)->second.reservations.at(id);
  out.holder_pid = r.holder.pid;
  out.holder_uid = r.uid;
  out.holder = !r.holder_alive ? CleanupOutcome::Holder::kLeaked
               : r.expired     ? CleanupOutcome::Holder::kExpired
                               : CleanupOutcome::Holder::kAlive;
  out.result =
      state_->ledger.apply(LedgerActor{peer.key, peer.comm, peer.uid}, record, record.timestamp_ns)
          ? Result::kCleaned
          : Result::kDenied;
  return out;
}

std::size_t Collector::reset_ledger(std::optional<std::string_view> gpu) {
  return state_->ledger.reset(gpu);
}

// ---- Collector: device truth ------------------------------------------------------------

void Collector::apply_devices(std::map<std::string, ledger::Device, std::less<>> devices,
                              std::string error, std::uint64_t now_ns, std::uint64_t slow_samples) {
  NvmlCounters& c = counters_.nvml;
  ++c.samples;
  if (!error.empty()) ++c.sample_errors;
  c.slow_samples = slow_samples;
  c.devices = devices.size();
  state_->ledger.apply_devices(std::move(devices), std::move(error), now_ns);
  if (!recorder_.on()) return;
  // Each GPU's sample and findings, as counter tracks of the trace.
  const ledger::State& ledger = state_->ledger.state();
  for (const auto& [uuid, device] : ledger.devices) {
    TraceMark mark;
    mark.kind = TraceMark::Kind::kDevice;
    mark.ts_ns = now_ns;
    mark.arrived_ns = now_ns;
    if (!proto::set_field(mark.record.gpu_uuid, uuid)) continue;
    mark.gpu_total_bytes = device.total_bytes;
    mark.gpu_free_bytes = device.free_bytes;
    mark.gpu_reserved_bytes = device.used_bytes;
    for (const ledger::Finding& f : ledger::device_findings(ledger, uuid, now_ns)) {
      ++mark.findings[f.kind];
    }
    recorder_.mark(mark);
  }
}

void Collector::set_device_rules(const ledger::DeviceRules& rules) {
  state_->ledger.set_device_rules(rules);
}

}  // namespace steptrace::daemon
