// The daemon's VRAM ledger view (daemon/state/ledger_view.h); its state is in
// ledger_state.h, its snapshot form in daemon/persist/snapshot_codec.cpp.
//
// Every record is credited to the actor (the process of the connection that sent it).
// Records that break a rule are counted per anomaly kind and change nothing else, over-long
// (client-truncated) strings included; the one exception, as the protocol says, is a cleanup naming
// another holder (the ledger removed the entry, so the view does too).
//
// Permissions (the actor's uid from SO_PEERCRED): a Release only by the holder process, a
// process of the holder's uid, or root; a Cleanup of a live holder's entry only by those
// (anyone may clean up a dead holder's). A refused one changes nothing but its anomaly
// count and the actor's `refused` count on that GPU. Quotas per uid: GPU entries it
// created (max_gpus_per_uid), reservations it holds (max_reservations_per_uid).
#include "daemon/state/ledger_view.h"

#include <algorithm>
#include <array>
#include <cinttypes>
#include <cstdio>
#include <limits>
#include <optional>
#include <string_view>
#include <utility>
#include <vector>

#include "daemon/state/ledger_state.h"
#include "daemon/state/saturating.h"
#include "proto/printable.h"

namespace steptrace::daemon {
namespace {

// Longest process name kept; /proc comm is at most 15 bytes, the hello's name 23.
constexpr std::size_t kMaxComm = proto::kMaxNameLength;

// Strings the view is keyed by or shows (a GPU UUID, a task) are refused, not sanitised,
// when they hold a byte that is not printable ASCII: two UUIDs that differ only in such
// bytes must not fold into one GPU.
bool valid_text(std::string_view text, bool allow_empty) {
  if (text.size() > proto::kMaxNameLength) return false;
  if (text.empty() && !allow_empty) return false;
  return proto::all_printable(text);
}

// When a lease of `lease_ms` taken at `from_ns` passes (saturating).
std::uint64_t lease_deadline(std::uint64_t from_ns, std::uint64_t lease_ms) {
  const std::uint64_t ns = lease_ms * 1'000'000;  // lease_ms <= kMaxLeaseMs: no overflow
  return from_ns > std::numeric_limits<std::uint64_t>::max() - ns
             ? std::numeric_limits<std::uint64_t>::max()
             : from_ns + ns;
}

}  // namespace

using namespace ledger;  // this file implements the view over that state

LedgerView::LedgerView(const Limits& limits, DaemonCounters& counters)
    : limits_(limits), counters_(counters), state_(std::make_shared<ledger::State>()) {}
LedgerView::LedgerView(const LedgerView& other) = default;
LedgerView::~LedgerView() = default;

ledger::State& LedgerView::write_state() {
  ++changes_;
  if (state_.use_count() > 1) state_ = std::make_shared<ledger::State>(*state_);
  return *state_;
}

void LedgerView::adopt(ledger::State state, std::uint64_t now_ns) {
  // Attribution marks belong to spans in progress; those ended with the daemon.
  state.marks.clear();
  // A holder could not renew while no daemon ran: its renewals may still be queued in
  // its library. Every lease not expired runs at least one more lease from now before the
  // view may call it expired; one expired before the restart stays expired.
  for (auto& [uuid, gpu] : state.gpus) {
    // A snapshot that did not keep the established total: the one the view showed
    // before the restart stays established, owned by no uid.
    if (gpu.sample && !gpu.client_total) gpu.client_total = gpu.sample->total_bytes;
    for (auto& [id, r] : gpu.reservations) {
      if (r.lease_ms != 0 && !r.expired) {
        r.lease_deadline_ns = std::max(r.lease_deadline_ns, lease_deadline(now_ns, r.lease_ms));
      }
    }
    // An exit time past now is a former boot's (the monotonic clock restarted): the row
    // ages from now, at most one max_ledger_row_age_s late, rather than never.
    for (auto& [key, row] : gpu.processes) {
      if (row.exited_ns > now_ns) row.exited_ns = std::max<std::uint64_t>(now_ns, 1);  // 0: alive
    }
  }
  // A snapshot that did not keep a row's uid (max_ledger_rows_per_uid): a row whose
  // process holds a reservation takes the holder's; the others count against no uid
  // (they make no more rows, and age out once their process is seen gone).
  std::map<ProcessKey, std::uint32_t> holders;
  for (const auto& [uuid, gpu] : state.gpus) {
    for (const auto& [id, r] : gpu.reservations) holders.emplace(r.holder, r.uid);
  }
  for (auto& [uuid, gpu] : state.gpus) {
    for (auto& [key, row] : gpu.processes) {
      if (const auto h = holders.find(key); row.uid == kUnknownUid && h != holders.end()) {
        row.uid = h->second;
      }
    }
  }
  state.recount();
  state_ = std::make_shared<ledger::State>(std::move(state));
}

namespace {

// One ledger record being applied: validated, its actor's name sanitised, its time
// clamped to now. Each op is one function; each returns whether the thread's attribution
// mark should be set (false: the record was dropped outright).
class Apply {
 public:
  Apply(State& s, const Limits& limits, DaemonCounters& counters, const LedgerActor& actor,
        const proto::LedgerRecord& record, std::string_view uuid, std::string_view task,
        std::uint64_t now_ns)
      : s_(s),
        limits_(limits),
        counters_(counters),
        actor_(actor),
        record_(record),
        uuid_(uuid),
        task_(task),
        comm_(proto::printable(actor.comm, kMaxComm)),
        at_ns_(std::min(record.timestamp_ns, now_ns)) {
    const auto it = s_.gpus.find(uuid);
    gpu_ = it == s_.gpus.end() ? nullptr : &it->second;
  }

  bool reserve(bool leased) {
    if (leased && !valid_lease()) return true;
    if (record_.bytes == 0) {
      s_.count(kZeroByteReserve);
      return true;
    }
    if (gpu_ != nullptr && gpu_->reservations.contains(record_.reservation_id)) {
      s_.count(kDuplicateReservation);
      return true;
    }
    if (over_known_total(record_.bytes)) {
      s_.count(kReservationOverTotal);
      return false;  // dropped: a GPU never holds it, so no tenant's view shows it
    }
    if ((gpu_ != nullptr ? gpu_->reservations.size() : 0) >= limits_.max_reservations_per_gpu) {
      limit_hit(kMaxReservationsPerGpu, LimitKind::kMaxReservationsPerGpu);
      return false;  // dropped: not even the attribution mark
    }
    if (s_.usage(actor_.uid).reservations >= limits_.max_reservations_per_uid) {
      limit_hit(kMaxReservationsPerUid, LimitKind::kMaxReservationsPerUid);
      return false;
    }
    if (gpu_ != nullptr &&
        record_.bytes > std::numeric_limits<std::uint64_t>::max() - gpu_->reserved_bytes) {
      s_.count(kReservedBytesOverflow);
      return true;
    }
    if (!ensure_gpu()) return false;
    Reservation& r = gpu_->reservations
                         .emplace(record_.reservation_id,
                                  Reservation{actor_.key, actor_.uid, comm_, record_.bytes,
                                              std::string(task_), at_ns_, true})
                         .first->second;
    if (leased) set_lease(r);
    s_.charge(actor_.uid, 0, 1);
    gpu_->reserved_bytes += record_.bytes;
    gpu_->high_water_bytes = std::max(gpu_->high_water_bytes, gpu_->reserved_bytes);
    count_op(kOpReserve);
    if (ProcessRow* row = my_row()) ++row->reserves;
    s_.update_overcommit(*gpu_);
    return true;
  }

  // A release by the holder, or a cleanup of someone else's (dead holder's) reservation.
  bool remove(bool cleanup) {
    if (gpu_ == nullptr || !gpu_->reservations.contains(record_.reservation_id)) {
      s_.count(cleanup ? kUnknownCleanup : kUnknownRelease);
      return true;
    }
    const auto entry = gpu_->reservations.find(record_.reservation_id);
    // The holder's own side (the process, its uid, root) may do either; anyone else only
    // a cleanup of a holder known dead or of an expired lease.
    const Reservation& r = entry->second;
    if (!holder_side(r) && (!cleanup || (r.holder_alive && !r.expired))) {
      return refuse(cleanup ? kCleanupRefused : kReleaseRefused);
    }
    if (cleanup && static_cast<std::int64_t>(record_.holder_pid) != entry->second.holder.pid) {
      s_.count(kCleanupHolderMismatch);  // the ledger removed it anyway; so do we
    }
    s_.charge(entry->second.uid, 0, -1);
    gpu_->reserved_bytes -= entry->second.bytes;
    gpu_->reservations.erase(entry);
    count_op(cleanup ? kOpCleanup : kOpRelease);
    if (ProcessRow* row = my_row()) ++(cleanup ? row->cleanups : row->releases);
    s_.update_overcommit(*gpu_);
    return true;
  }

  bool sample() {
    if (record_.total_bytes == 0 || record_.bytes > record_.total_bytes) {
      s_.count(kBadVramSample);
      return true;
    }
    // NVML's total judges it when the device reports the GPU; else the total a client
    // established, unless the sender is the uid that established it, or root.
    const std::optional<std::uint64_t> device = device_total();
    const bool contradicts = device
                                 ? total_contradicts(record_.total_bytes, *device)
                                 : gpu_ != nullptr && gpu_->client_total && actor_.uid != 0 &&
                                       actor_.uid != gpu_->client_total_uid &&
                                       total_contradicts(record_.total_bytes, *gpu_->client_total);
    if (contradicts) {
      s_.count(kVramTotalMismatch);
      return false;
    }
    if (!ensure_gpu()) return false;
    if (device || !gpu_->client_total || actor_.uid == 0 || actor_.uid == gpu_->client_total_uid) {
      gpu_->client_total = record_.total_bytes;
      gpu_->client_total_uid = actor_.uid;
    }
    // Samples from several processes may arrive out of order: keep the newest.
    if (!gpu_->sample || at_ns_ >= gpu_->sample->at_ns) {
      gpu_->sample = VramSample{record_.bytes, record_.total_bytes, at_ns_};
    }
    count_op(kOpVramSample);
    s_.update_overcommit(*gpu_);
    return true;
  }

  // The holder's side (as for a release) renews a lease, gives one to a reservation
  // without, or revives an expired one.
  bool renew() {
    if (gpu_ == nullptr || !gpu_->reservations.contains(record_.reservation_id)) {
      s_.count(kUnknownRenew);
      return true;
    }
    Reservation& r = gpu_->reservations.find(record_.reservation_id)->second;
    if (!holder_side(r)) return refuse(kRenewRefused);
    if (!valid_lease()) return true;
    set_lease(r);
    count_op(kOpRenew);
    if (ProcessRow* row = my_row()) ++row->renews;
    return true;
  }

  // Whether the view changed (an operation was counted on the GPU).
  bool applied() const { return applied_; }

  // Remembers where this thread last was, for the ledger-step span that will enclose it.
  // Only for GPUs the view knows, so attribution never creates one.
  void mark() {
    if (gpu_ == nullptr) return;
    // Bounded like the collector's tables; forget_process() frees a process's entry.
    if (!s_.marks.contains(actor_.key) && s_.marks.size() >= limits_.max_processes) {
      s_.count(kAttributionThreadsFull);
      return;
    }
    auto& threads = s_.marks[actor_.key];
    auto it = threads.find(record_.thread_id);
    if (it == threads.end()) {
      if (threads.size() >= limits_.max_threads_per_process) {
        s_.count(kAttributionThreadsFull);
        if (threads.empty()) s_.marks.erase(actor_.key);
        return;
      }
      it = threads.emplace(record_.thread_id, Mark{}).first;
    }
    it->second = Mark{std::string(uuid_), record_.timestamp_ns, comm_, actor_.uid};
  }

 private:
  // NVML's total of this GPU when the device reports it.
  std::optional<std::uint64_t> device_total() const {
    if (gpu_ != nullptr && gpu_->device_total) return gpu_->device_total;
    if (const auto d = s_.devices.find(uuid_); d != s_.devices.end()) return d->second.total_bytes;
    return std::nullopt;
  }
  // A single reservation larger than the GPU: NVML's total, else the established client
  // total and its slack (a client's total may be a little under the device's). Without
  // either, nothing is known to judge by.
  bool over_known_total(std::uint64_t bytes) const {
    if (const auto device = device_total()) return bytes > *device;
    if (gpu_ == nullptr || !gpu_->client_total) return false;
    return bytes > saturating_add(*gpu_->client_total, total_slack(*gpu_->client_total));
  }
  bool valid_lease() {
    if (record_.total_bytes == 0 || record_.total_bytes > proto::kMaxLeaseMs) {
      s_.count(kBadLease);
      return false;
    }
    return true;
  }
  void set_lease(Reservation& r) const {
    r.lease_ms = record_.total_bytes;
    r.lease_deadline_ns = lease_deadline(at_ns_, r.lease_ms);
    r.expired = false;
  }
  void count_op(Op op) {
    ++gpu_->operations[op];
    applied_ = true;
  }
  // Counted as `kind`, and in the actor's `refused` on this GPU when it has a row there
  // already; nothing else changes, not even the attribution mark. A refused record makes
  // no row: callers that are only ever refused (a CLI's `ledger cleanup` of another uid's
  // live entry, thousands of times) must not fill the GPU's table.
  bool refuse(Anomaly kind) {
    s_.count(kind);
    if (ProcessRow* row = State::existing_row(*gpu_, actor_.key)) ++row->refused;
    return false;
  }
  ProcessRow* my_row() { return s_.row(*gpu_, actor_.key, comm_, actor_.uid, limits_, counters_); }
  bool holder_side(const Reservation& r) const {
    return actor_.key == r.holder || actor_.uid == 0 ||
           (r.uid != kUnknownUid && actor_.uid == r.uid);
  }
  // A limit is both a ledger anomaly (per GPU view) and a daemon limit hit.
  void limit_hit(Anomaly kind, LimitKind limit) {
    s_.count(kind);
    counters_.hit(limit);
  }
  // Creates the GPU on its first reserve or sample, charged to the actor's uid; false
  // (counted) past max_gpus or the uid's max_gpus_per_uid.
  bool ensure_gpu() {
    if (gpu_ != nullptr) return true;
    if (s_.gpus.size() >= limits_.max_gpus) {
      limit_hit(kMaxGpus, LimitKind::kMaxGpus);
      return false;
    }
    if (s_.usage(actor_.uid).gpus >= limits_.max_gpus_per_uid) {
      limit_hit(kMaxGpusPerUid, LimitKind::kMaxGpusPerUid);
      return false;
    }
    gpu_ = &s_.gpus.emplace(std::string(uuid_), Gpu{}).first->second;
    // A GPU the device sampler already reports: its total judges over-commitment now.
    if (const auto d = s_.devices.find(uuid_); d != s_.devices.end()) {
      gpu_->device_total = d->second.total_bytes;
    }
    gpu_->creator_uid = actor_.uid;
    s_.charge(actor_.uid, 1, 0);
    return true;
  }

  State& s_;
  const Limits& limits_;
  DaemonCounters& counters_;
  const LedgerActor& actor_;
  const proto::LedgerRecord& record_;
  std::string_view uuid_;
  std::string_view task_;
  std::string comm_;
  std::uint64_t at_ns_;
  Gpu* gpu_ = nullptr;
  bool applied_ = false;
};

}  // namespace

bool LedgerView::apply(const LedgerActor& actor, const proto::LedgerRecord& record,
                       std::uint64_t now_ns) {
  State& s = write_state();
  // The client cut an over-long string: the cut value is not what the caller meant (two
  // long UUIDs could merge into one GPU), so the record is counted and refused.
  const bool uuid_cut = (record.flags & proto::kLedgerGpuUuidTruncated) != 0;
  const bool task_cut = (record.flags & proto::kLedgerTaskTruncated) != 0;
  if (uuid_cut) s.count(kGpuUuidTruncated);
  if (task_cut) s.count(kTaskTruncated);
  if (uuid_cut || task_cut) return false;

  // The decoder has validated the record already; the view is keyed by these strings,
  // so it refuses bad ones itself too rather than trusting every caller.
  const std::string_view uuid = proto::field_view(record.gpu_uuid);
  const std::string_view task = proto::field_view(record.task);
  if (!valid_text(uuid, false) || !valid_text(task, true)) {
    s.count(kBadRecord);
    return false;
  }
  Apply op(s, limits_, counters_, actor, record, uuid, task, now_ns);
  bool attributable = false;
  switch (static_cast<proto::LedgerOp>(record.op)) {
    case proto::LedgerOp::kReserve:
    case proto::LedgerOp::kReserveLease:
      attributable =
          op.reserve(record.op == static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease));
      break;
    case proto::LedgerOp::kRenew:
      attributable = op.renew();
      break;
    case proto::LedgerOp::kRelease:
      attributable = op.remove(/*cleanup=*/false);
      break;
    case proto::LedgerOp::kCleanup:
      attributable = op.remove(/*cleanup=*/true);
      break;
    case proto::LedgerOp::kVramSample:
      attributable = op.sample();
      break;
    default:
      s.count(kBadRecord);
      return false;
  }
  if (attributable) op.mark();
  return op.applied();
}

std::size_t LedgerView::expire_leases(std::uint64_t now_ns, std::vector<ExpiredLease>* expired) {
  const auto passed = [now_ns](const Reservation& r) {
    return r.lease_ms != 0 && !r.expired && r.holder_alive && now_ns >= r.lease_deadline_ns;
  };
  // Clones a shared state only when a lease passed.
  bool any = false;
  for (const auto& [uuid, gpu] : state_->gpus) {
    for (const auto& [id, r] : gpu.reservations) any = any || passed(r);
  }
  if (!any) return 0;
  State& s = write_state();
  std::size_t n = 0;
  for (auto& [uuid, gpu] : s.gpus) {
    for (auto& [id, r] : gpu.reservations) {
      if (!passed(r)) continue;
      r.expired = true;
      s.count(kLeaseExpired);
      ++n;
      if (expired != nullptr) expired->push_back({uuid, id, r});
    }
  }
  return n;
}

void LedgerView::attribute_span(const ProcessKey& process, std::uint32_t thread_id,
                                std::uint32_t step, std::uint64_t start_ns, std::uint64_t end_ns) {
  if (!proto::is_ledger_step(step) || end_ns < start_ns) return;
  {
    // Decide on the shared state first: only a span that changes something clones it.
    const State& cs = *state_;
    const auto threads = cs.marks.find(process);
    if (threads == cs.marks.end()) return;
    const auto mark = threads->second.find(thread_id);
    if (mark == threads->second.end()) return;
    const Mark& m = mark->second;
    if (m.timestamp_ns < start_ns || m.timestamp_ns > end_ns) return;
    if (!cs.gpus.contains(m.gpu)) return;
  }
  State& s = write_state();
  const Mark& m = s.marks.find(process)->second.find(thread_id)->second;
  const auto gpu = s.gpus.find(m.gpu);
  StepTime& all = gpu->second.steps[step];
  ++all.count;
  // Saturating: the timestamps are the client's (saturating.h).
  all.total_ns = saturating_add(all.total_ns, end_ns - start_ns);
  ProcessRow* row = s.row(gpu->second, process, m.comm, m.uid, limits_, counters_);
  if (row == nullptr) return;
  StepTime& time = row->steps[step];
  ++time.count;
  time.total_ns = saturating_add(time.total_ns, end_ns - start_ns);
}

std::size_t LedgerView::age_rows(const std::function<bool(const ProcessKey&)>& alive,
                                 std::uint64_t now_ns) {
  constexpr std::uint64_t kNsPerS = 1'000'000'000;
  const std::uint64_t max_age_ns =
      limits_.max_ledger_row_age_s > std::numeric_limits<std::uint64_t>::max() / kNsPerS
          ? std::numeric_limits<std::uint64_t>::max()
          : limits_.max_ledger_row_age_s * kNsPerS;
  const auto old = [&](const ProcessRow& r) {
    return r.exited_ns != 0 && now_ns - std::min(now_ns, r.exited_ns) >= max_age_ns;
  };
  // Asks once per process believed alive (a process seen exited is never asked again),
  // and clones a shared state only when a row changes.
  std::map<ProcessKey, bool> answers;
  bool changed = false;
  for (const auto& [uuid, gpu] : state_->gpus) {
    for (const auto& [key, row] : gpu.processes) {
      if (row.exited_ns == 0) {
        auto answer = answers.find(key);
        if (answer == answers.end()) answer = answers.emplace(key, alive(key)).first;
        changed = changed || !answer->second;
      }
      changed = changed || old(row);
    }
  }
  if (!changed) return 0;
  std::size_t n = 0;
  for (auto& [uuid, gpu] : write_state().gpus) {
    for (auto it = gpu.processes.begin(); it != gpu.processes.end();) {
      ProcessRow& row = it->second;
      if (row.exited_ns == 0 && !answers.at(it->first)) {
        row.exited_ns = std::max<std::uint64_t>(now_ns, 1);  // 0 means alive
      }
      if (old(row)) {
        it = gpu.processes.erase(it);
        ++n;
      } else {
        ++it;
      }
    }
  }
  return n;
}

void LedgerView::check_holders(const std::function<bool(const ProcessKey&)>& alive) {
  // Asks once per reservation, and clones a shared state only when an answer changed.
  std::vector<bool> answers;
  bool changed = false;
  for (const auto& [uuid, gpu] : state_->gpus) {
    for (const auto& [id, reservation] : gpu.reservations) {
      answers.push_back(alive(reservation.holder));
      changed = changed || answers.back() != reservation.holder_alive;
    }
  }
  if (!changed) return;
  std::size_t i = 0;
  for (auto& [uuid, gpu] : write_state().gpus) {
    for (auto& [id, reservation] : gpu.reservations) reservation.holder_alive = answers[i++];
  }
}

std::size_t LedgerView::reset(std::optional<std::string_view> gpu) {
  if (gpu && !state_->gpus.contains(*gpu)) return 0;  // nothing to clone for
  State& s = write_state();
  std::size_t n = 0;
  if (!gpu) {
    n = s.gpus.size();
    s.gpus.clear();
  } else {
    s.gpus.erase(s.gpus.find(*gpu));
    n = 1;
  }
  // Marks naming a dropped GPU would credit a later span to a GPU of the same UUID
  // created afresh; the GPUs' charges to their uids go with them.
  for (auto it = s.marks.begin(); it != s.marks.end();) {
    std::erase_if(it->second,
                  [&s](const auto& entry) { return !s.gpus.contains(entry.second.gpu); });
    it = it->second.empty() ? s.marks.erase(it) : std::next(it);
  }
  s.recount();
  return n;
}

void LedgerView::forget_process(const ProcessKey& process) {
  // Its per-GPU rows go too, so memory stays bounded by the collector's process table;
  // reservations it holds stay (they still hold VRAM until a release or cleanup).
  State& s = write_state();
  s.marks.erase(process);
  for (auto& [uuid, gpu] : s.gpus) gpu.processes.erase(process);
}

}  // namespace steptrace::daemon

namespace steptrace::daemon {

void LedgerView::set_device_rules(const ledger::DeviceRules& rules) { write_state().rules = rules; }

void LedgerView::apply_devices(std::map<std::string, ledger::Device, std::less<>> devices,
                               std::string error, std::uint64_t now_ns) {
  ledger::State& state = write_state();
  state.devices = std::move(devices);
  state.device_error = std::move(error);
  for (auto& [uuid, gpu] : state.gpus) {
    const auto device = state.devices.find(uuid);
    // A GPU missing from a sample that had errors (a failed call, not a removed device)
    // keeps its last total, so over-commitment does not flap with transient errors.
    if (device != state.devices.end()) {
      gpu.device_total = device->second.total_bytes;
    } else if (state.device_error.empty()) {
      gpu.device_total.reset();
    }
    state.update_overcommit(gpu);
    if (device == state.devices.end() || !device->second.processes_known) continue;
    for (auto& [id, r] : gpu.reservations) {
      for (const ledger::DeviceProcess& p : device->second.processes) {
        // Listed with its memory hidden (NVML_VALUE_NOT_AVAILABLE) counts as using it.
        if (static_cast<std::int32_t>(p.pid) == r.holder.pid &&
            (!p.used_bytes || *p.used_bytes > 0)) {
          r.last_used_ns = now_ns;
        }
      }
    }
  }
}

std::vector<ledger::Finding> ledger::device_findings(const State& state, std::string_view uuid,
                                                     std::uint64_t now_ns) {
  std::vector<Finding> out;
  const auto device = state.devices.find(uuid);
  if (device == state.devices.end() || !device->second.processes_known) return out;
  const auto gpu_it = state.gpus.find(uuid);
  const Gpu* gpu = gpu_it == state.gpus.end() ? nullptr : &gpu_it->second;
  // What each pid reserved on this GPU (a pid, not a (pid, start time): NVML knows pids).
  std::map<std::int32_t, std::uint64_t> reserved;
  if (gpu != nullptr) {
    for (const auto& [id, r] : gpu->reservations) reserved[r.holder.pid] += r.bytes;
  }
  std::map<std::int32_t, std::uint64_t> used;
  for (const DeviceProcess& p : device->second.processes) {
    const auto pid = static_cast<std::int32_t>(p.pid);
    const std::uint64_t bytes = p.used_bytes.value_or(0);
    // Hidden memory (nullopt) still means the process is on the device (not IDLE).
    used[pid] += p.used_bytes ? bytes : 1;
    if (!p.visible) {
      out.push_back({Finding::kGhost, p.pid, bytes, reserved.contains(pid) ? reserved[pid] : 0, 0});
      continue;
    }
    const auto r = reserved.find(pid);
    if (r == reserved.end()) {
      if (bytes > 0) out.push_back({Finding::kUndeclared, p.pid, bytes, 0, 0});
      continue;
    }
    // Over the reservation by more than the tolerance (saturating: no wrap to a small bound).
    const std::uint64_t pct = state.rules.over_tolerance_pct;
    std::uint64_t extra = 0;
    std::uint64_t allowed = 0;
    if (__builtin_mul_overflow(r->second / 100, pct, &extra) ||
        __builtin_add_overflow(extra, r->second % 100 * pct / 100, &extra) ||
        __builtin_add_overflow(r->second, extra, &allowed)) {
      allowed = std::numeric_limits<std::uint64_t>::max();
    }
    if (p.used_bytes && bytes > allowed)
      out.push_back({Finding::kOver, p.pid, bytes, r->second, 0});
  }
  if (gpu != nullptr) {
    for (const auto& [id, r] : gpu->reservations) {
      if (!r.holder_alive) continue;  // a leak, reported as such
      if (used[r.holder.pid] > 0) continue;
      const std::uint64_t since = std::max(r.reserved_ns, r.last_used_ns);
      if (now_ns > since && now_ns - since >= state.rules.idle_ns) {
        out.push_back({Finding::kIdle, static_cast<std::uint32_t>(r.holder.pid), 0, r.bytes, id});
      }
    }
  }
  return out;
}

}  // namespace steptrace::daemon
