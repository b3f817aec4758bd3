// Collector ingest: events (the hot path, layout in collector_state.h), custom step
// registration, the clients' drop reports, and the state budget (charge / uncharge).
#include "daemon/state/collector.h"

#include <algorithm>
#include <memory>
#include <optional>
#include <set>
#include <utility>

#include "daemon/state/collector_state.h"

namespace steptrace::daemon {

// ---- the state budget (collector_state.h) -----------------------------------------------

void charge_uid(CollectorState& state, std::uint32_t uid, std::size_t bytes) {
  if (bytes != 0) state.charged_by_uid[uid] += bytes;
}

void uncharge_uid(CollectorState& state, std::uint32_t uid, std::size_t bytes) {
  const auto it = state.charged_by_uid.find(uid);
  if (it == state.charged_by_uid.end()) return;
  it->second -= std::min(bytes, it->second);
  if (it->second == 0) state.charged_by_uid.erase(it);  // no longer holds state
}

namespace {

// At least what one reclaim takes back, as a part of max_state_bytes: so that the next
// charges after it need no reclaim each.
constexpr std::size_t kReclaimDivisor = 64;

// Whether `uid` may add `bytes` to max_state_bytes, under the share rule of
// collector_state.h (reclaiming from others when it is within its share and the budget
// is full). Not on the hot path: only a new thread, stack slot or custom step charges.
bool admit_state(CollectorState& state, std::uint32_t uid, std::size_t bytes, const Limits& limits,
                 DaemonCounters& counters) {
  const bool privileged = uid == 0 || uid == state.own_uid;
  const std::size_t budget =
      privileged ? limits.max_state_bytes
                 : limits.max_state_bytes - limits.max_state_bytes / kPrivilegedReserveDivisor;
  if (state.charged + bytes <= budget) return true;
  const auto held = state.charged_by_uid.find(uid);
  const std::size_t own = held == state.charged_by_uid.end() ? 0 : held->second;
  const std::size_t holders =
      state.charged_by_uid.size() + (held == state.charged_by_uid.end() ? 1 : 0);
  // Of what this uid may charge (the reserve left out for the unprivileged): two
  // unprivileged uids at their shares fill exactly what they may use together.
  const std::size_t share = budget / holders;
  if (own + bytes > share) return false;  // at its share: others may want theirs
  std::set<std::uint32_t> exhausted;      // over their share, with nothing left to take
  while (state.charged + bytes > budget) {
    std::optional<std::uint32_t> victim;
    std::size_t furthest = 0;
    for (const auto& [other, held_bytes] : state.charged_by_uid) {
      if (other == uid || held_bytes <= share || exhausted.contains(other)) continue;
      if (held_bytes - share > furthest) {
        furthest = held_bytes - share;
        victim = other;
      }
    }
    if (!victim) return false;  // no one over their share (the reserve, or rounding)
    // What is missing, or a 64th of the budget; never more than the victim holds beyond
    // its share.
    const std::size_t wanted = std::min(
        furthest,
        std::max(state.charged + bytes - budget, limits.max_state_bytes / kReclaimDivisor));
    if (reclaim_state(state, *victim, wanted, counters) == 0) exhausted.insert(*victim);
  }
  return true;
}

}  // namespace

bool charge(CollectorState& state, ProcessRecord& rec, std::size_t bytes, const Limits& limits,
            DaemonCounters& counters) {
  if (rec.charged + bytes > limits.max_process_state_bytes) {
    counters.hit(LimitKind::kMaxProcessStateBytes);
    return false;
  }
  if (!admit_state(state, rec.peer.uid, bytes, limits, counters)) {
    counters.hit(LimitKind::kMaxStateBytes);
    return false;
  }
  rec.charged += bytes;
  state.charged += bytes;
  charge_uid(state, rec.peer.uid, bytes);
  return true;
}

void uncharge(CollectorState& state, ProcessRecord& rec, std::size_t bytes) {
  bytes = std::min({bytes, rec.charged, state.charged});
  rec.charged -= bytes;
  state.charged -= bytes;
  uncharge_uid(state, rec.peer.uid, bytes);
  state.freed_memory.freed(bytes);
}

namespace {

using proto::kBuiltinStepCount;

ThreadSpans* find_thread(CollectorState& state, ProcessRecord& rec, std::uint32_t tid,
                         const Limits& limits, DaemonCounters& counters) {
  if (const auto it = rec.thread_index.find(tid); it != rec.thread_index.end()) {
    rec.last_tid = tid;
    rec.last_thread = &state.write_thread(rec, it->second);
    return rec.last_thread;
  }
  if (rec.threads.size() >= limits.max_threads_per_process) {
    // Threads with nothing open hold no state worth keeping: drop them first.
    std::erase_if(rec.threads, [&](const auto& t) {
      if (t->open != 0) return false;
      uncharge(state, rec, t->charged);
      state.drop_thread(t);
      return true;
    });
    rec.thread_index.clear();
    for (std::uint32_t i = 0; i < rec.threads.size(); ++i)
      rec.thread_index[rec.threads[i]->tid] = i;
    rec.last_thread = nullptr;
    rec.last_tid = 0;
    if (rec.threads.size() >= limits.max_threads_per_process) {
      counters.hit(LimitKind::kMaxThreadsPerProcess);
      return nullptr;
    }
  }
  // Its record and index entry; its stacks are charged as they grow.
  const std::size_t cost = heap::new_thread_bytes();
  if (!charge(state, rec, cost, limits, counters)) return nullptr;
  auto thread = std::make_shared<ThreadSpans>();  // non-const: see ProcessRecord::threads
  thread->tid = tid;
  thread->charged = cost;
  rec.thread_index.emplace(tid, static_cast<std::uint32_t>(rec.threads.size()));
  rec.threads.push_back(thread);
  rec.last_tid = tid;
  rec.last_thread = thread.get();
  return rec.last_thread;
}

// ---- the pieces of Collector::events ---------------------------------------------------
// The hot path: each piece is forced inline so the loop compiles as one function (no
// call, no spill of the batch's locals), as it did written out in one body.

// What one batch could not fold: starts dropped past max_open_depth, events whose
// thread or stack slot the limits refused and spans past max_span_ns, each with the
// first one's timestamp (for the flight recorder's drop marks).
struct BatchLosses {
  std::uint64_t depth_hits = 0;
  std::uint64_t state_lost = 0;
  std::uint64_t spans_refused = 0;
  std::uint64_t first_depth_ts = 0;
  std::uint64_t first_state_ts = 0;
  std::uint64_t first_refused_ts = 0;

  [[gnu::always_inline]] void lose_state(std::uint64_t ts) {
    if (state_lost++ == 0) first_state_ts = ts;
  }
  [[gnu::always_inline]] void hit_depth(std::uint64_t ts) {
    if (depth_hits++ == 0) first_depth_ts = ts;
  }
  [[gnu::always_inline]] void refuse_span(std::uint64_t ts) {
    if (spans_refused++ == 0) first_refused_ts = ts;
  }
};

// The slot of custom step `step`; 0, with `error` set, when its id is out of range or the
// process never registered it.
[[gnu::always_inline]] inline std::uint32_t custom_slot_of(const ProcessRecord& rec,
                                                           std::uint32_t step,
                                                           std::error_code& error) {
  const std::uint32_t index = step - proto::kFirstCustomStep;
  if (index >= proto::kMaxCustomSteps) {
    error = make_error_code(errc::bad_step_id);
    return 0;
  }
  const std::uint32_t slot = rec.custom_slot ? (*rec.custom_slot)[index] : 0;
  if (slot == 0) error = make_error_code(errc::unregistered_step);
  return slot;
}

// Whether custom step `step` is one whose registration a limit refused.
inline bool refused_step(const ProcessRecord& rec, std::uint32_t step) {
  const std::uint32_t index = step - proto::kFirstCustomStep;
  return rec.refused_custom && index < proto::kMaxCustomSteps && rec.refused_custom->test(index);
}

// A thread's stacks reach only as far as the highest step slot it used: room up to
// `slot`, charged to the state budget (false: refused by it).
[[gnu::always_inline]] inline bool grow_stacks(CollectorState& state, ProcessRecord& rec,
                                               ThreadSpans& thread, std::uint32_t slot,
                                               const Limits& limits, DaemonCounters& counters) {
  const std::size_t cost = heap::stack_slots_bytes(thread, slot);
  if (!charge(state, rec, cost, limits, counters)) return false;
  thread.charged += cost;
  heap::make_room_for_slot(thread, slot);
  return true;
}

// The state budget as ingest's hot path sees it: the rare branches that allocate charge
// through it (a timestamp stack's or depth array's growth, a histogram's chunk).
struct Budget {
  CollectorState& state;
  const Limits& limits;
  DaemonCounters& counters;

  // Room for one more timestamp in `v`, one of `thread`'s vectors, charged to the thread.
  [[gnu::noinline]] bool grow(ProcessRecord& rec, ThreadSpans& thread,
                              std::vector<std::uint64_t>& v) {
    const std::size_t cost = heap::push_bytes(v);
    if (!charge(state, rec, cost, limits, counters)) return false;
    thread.charged += cost;
    heap::make_room_for_push(v);
    return true;
  }
  // A chunk for `hist`, charged to the process.
  [[gnu::noinline]] bool chunk(ProcessRecord& rec, const Histogram& hist) {
    return charge(state, rec, heap::histogram_chunk_bytes(hist), limits, counters);
  }
};

// A start: pushes its timestamp on `stack`, the thread's stack for `slot`.
[[gnu::always_inline]] inline void open_span(Budget& budget, ProcessRecord& rec,
                                             ThreadSpans& thread, std::vector<std::uint64_t>& stack,
                                             std::uint32_t slot, std::uint64_t ts,
                                             std::size_t max_depth, BatchLosses& losses) {
  // Bounded per thread over all its steps, so a thread's open spans cost at most
  // max_open_depth timestamps however many steps it nests.
  if (thread.open >= max_depth) [[unlikely]] {
    ++rec.steps[slot].depth_dropped;
    losses.hit_depth(ts);
    return;
  }
  if (stack.size() == stack.capacity() || thread.child_ns.size() <= thread.open) [[unlikely]] {
    // Growth, charged first (at most max_open_depth depth entries).
    if ((stack.size() == stack.capacity() && !budget.grow(rec, thread, stack)) ||
        (thread.child_ns.size() <= thread.open && !budget.grow(rec, thread, thread.child_ns))) {
      losses.lose_state(ts);
      return;
    }
    if (thread.child_ns.size() <= thread.open) thread.child_ns.resize(thread.open + 1);
  }
  stack.push_back(ts);
  thread.child_ns[thread.open] = 0;
  ++thread.open;
}

// An end: pops the innermost open span of `stack`, the thread's stack for `slot`, into
// the step's aggregate (and a ledger step's into the ledger view); a span longer than
// `max_span_ns` goes into nothing and is counted in `losses`, as is one whose histogram
// chunk the state budget refused.
[[gnu::always_inline]] inline void close_span(Budget& budget, LedgerView& ledger,
                                              ProcessRecord& rec, ThreadSpans& thread,
                                              std::vector<std::uint64_t>& stack, std::uint32_t slot,
                                              const proto::EventRecord& e,
                                              std::uint64_t max_span_ns, BatchLosses& losses) {
  if (stack.empty()) [[unlikely]] {
    ++rec.steps[slot].unmatched_ends;
    return;
  }
  const std::uint64_t start = stack.back();
  stack.pop_back();
  --thread.open;
  // One monotonic clock on the client; a backwards pair can only be a broken
  // client, and counts as zero rather than wrapping.
  const std::uint64_t duration = e.timestamp_ns > start ? e.timestamp_ns - start : 0;
  if (duration > max_span_ns) [[unlikely]] {
    losses.refuse_span(e.timestamp_ns);
    return;
  }
  StepAgg& agg = rec.steps[slot];
  if (agg.hist.needs_chunk(duration)) [[unlikely]] {
    if (!budget.chunk(rec, agg.hist)) {
      losses.lose_state(e.timestamp_ns);
      return;
    }
  }
  agg.hist.record(duration);
  // Self time: its duration less what ended one level deeper while it was open (the
  // depth is the thread's, so it is exact when the thread's spans nest).
  const std::uint32_t depth = thread.open;
  // Saturating: a client's durations must not wrap its totals (saturating.h).
  agg.self_ns = saturating_add(agg.self_ns, duration - std::min(duration, thread.child_ns[depth]));
  if (depth > 0) thread.child_ns[depth - 1] = saturating_add(thread.child_ns[depth - 1], duration);
  if (proto::is_ledger_step(slot)) [[unlikely]] {
    ledger.attribute_span(rec.key(), e.thread_id, slot, start, e.timestamp_ns);
  }
}

}  // namespace

// ---- Collector: ingest ------------------------------------------------------------------

bool Collector::step_known(ProcessHandle process, std::uint32_t step) const {
  if (step < kBuiltinStepCount) return proto::is_builtin_step(step);
  if (!proto::is_custom_step(step) || process >= state_->slots.size()) return false;
  const ProcessRecord* rec = state_->slots[process].get();
  if (rec == nullptr) return false;
  // A step whose registration a limit refused is settled too: events() refuses and
  // counts its events, so a ring must not wait for a registration that will not come.
  return (rec->custom_slot && (*rec->custom_slot)[step - proto::kFirstCustomStep] != 0) ||
         refused_step(*rec, step);
}

std::error_code Collector::events(ProcessHandle process, proto::EventSpan events) {
  if (process >= state_->slots.size() || !state_->slots[process]) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  ProcessRecord* rec = &state_->write(process);
  counters_.events_received += events.size();

  const std::size_t max_depth = limits_.max_open_depth;
  const std::uint64_t max_span_ns = limits_.max_span_ns;
  LedgerView& ledger = state_->ledger;  // loaded once, not at every end event
  const std::size_t n = events.size();
  BatchLosses losses;
  Budget budget{*state_, limits_, counters_};
  std::error_code result;
  std::size_t applied = n;  // events before a bad one are kept
  for (std::size_t i = 0; i < n; ++i) {
    const proto::EventRecord e = events[i];
    std::uint32_t slot = e.step;
    if (slot >= kBuiltinStepCount) [[unlikely]] {
      slot = custom_slot_of(*rec, slot, result);
      if (slot == 0) {
        if (refused_step(*rec, e.step)) {  // a limit refused its registration: counted
          result = {};
          losses.lose_state(e.timestamp_ns);
          continue;
        }
        applied = i;
        break;
      }
    }
    ThreadSpans* thread = rec->last_thread;
    if (e.thread_id != rec->last_tid || thread == nullptr) [[unlikely]] {
      thread = find_thread(*state_, *rec, e.thread_id, limits_, counters_);
      if (thread == nullptr) {
        losses.lose_state(e.timestamp_ns);
        continue;
      }
    }
    if (slot >= thread->stacks.size()) [[unlikely]] {
      if (!grow_stacks(*state_, *rec, *thread, slot, limits_, counters_)) {
        losses.lose_state(e.timestamp_ns);
        continue;
      }
    }
    std::vector<std::uint64_t>& stack = thread->stacks[slot];
    if (e.kind == static_cast<std::uint8_t>(proto::EventKind::kStart)) {
      open_span(budget, *rec, *thread, stack, slot, e.timestamp_ns, max_depth, losses);
    } else if (e.kind == static_cast<std::uint8_t>(proto::EventKind::kEnd)) {
      close_span(budget, ledger, *rec, *thread, stack, slot, e, max_span_ns, losses);
    } else {
      result = make_error_code(errc::bad_event_kind);
      applied = i;
      break;
    }
  }
  rec->events += applied;
  if (losses.spans_refused != 0) [[unlikely]]
    refuse_spans(*rec, losses.spans_refused);
  // Events whose thread or stack slot the state budget refused were taken (a ring's
  // tail, a FlushAck) and folded into nothing: the process's `refused` drops, so the
  // client's count and the report show them (the limit hits were counted by charge()).
  if (losses.state_lost != 0) [[unlikely]]
    refuse_events(*rec, losses.state_lost);
  if (losses.depth_hits != 0) counters_.hit(LimitKind::kMaxOpenDepth, losses.depth_hits);
  if (recorder_.on()) [[likely]] {
    const std::uint64_t now = env_.monotonic_now_ns();
    recorder_.record(process, events.first(applied), now);
    // What the daemon could not fold shows where it happened (the events themselves are
    // in the window: the aggregates, not the timeline, miss them).
    if (losses.depth_hits != 0) {
      mark_drop(rec->key(), kDaemonDropOpenDepth, losses.depth_hits, losses.first_depth_ts);
    }
    if (losses.state_lost != 0) {
      mark_drop(rec->key(), kDaemonDropStateLimit, losses.state_lost, losses.first_state_ts);
    }
    if (losses.spans_refused != 0) {
      mark_drop(rec->key(), static_cast<std::uint8_t>(proto::kRefusedCause),
                2 * losses.spans_refused, losses.first_refused_ts);
    }
  }
  return result;
}

std::error_code Collector::register_step(ProcessHandle process, const proto::RegisterStep& step) {
  if (process >= state_->slots.size() || !state_->slots[process]) {
    return std::make_error_code(std::errc::invalid_argument);
  }
  ProcessRecord& rec = state_->write(process);
  if (!proto::is_custom_step(step.step)) return make_error_code(errc::bad_step_id);
  if (!proto::valid_field(step.name, false)) return make_error_code(errc::bad_string);
  const std::string_view name = proto::field_view(step.name);
  const std::uint32_t index = step.step - proto::kFirstCustomStep;
  if (rec.custom_slot && (*rec.custom_slot)[index] != 0) {
    return rec.step_name((*rec.custom_slot)[index]) == name ? std::error_code{}
                                                            : make_error_code(errc::bad_string);
  }
  // Refused by a limit: the step's events are refused and counted as they come
  // (refused_custom), so the client's own count and the report show them; the
  // connection, and every other step, go on. Asked again (the next connection), it is
  // tried again: the budget may have room by then.
  const auto refuse = [&](LimitKind limit) {
    if (limit == LimitKind::kMaxCustomSteps) counters_.hit(limit);  // charge() counts its own
    if (!rec.refused_custom)
      rec.refused_custom = std::make_unique<std::bitset<proto::kMaxCustomSteps>>();
    rec.refused_custom->set(index);
    return std::error_code{};
  };
  if (rec.custom_ids.size() >= limits_.max_custom_steps) return refuse(LimitKind::kMaxCustomSteps);
  const std::size_t cost = heap::custom_step_bytes(rec, name);
  if (!charge(*state_, rec, cost, limits_, counters_)) return refuse(LimitKind::kMaxStateBytes);
  if (rec.refused_custom) rec.refused_custom->reset(index);
  heap::make_room_for_step(rec);
  if (!rec.custom_slot) {
    rec.custom_slot = std::make_unique<std::array<std::uint16_t, proto::kMaxCustomSteps>>();
    rec.custom_slot->fill(0);
  }
  (*rec.custom_slot)[index] = static_cast<std::uint16_t>(rec.steps.size());
  rec.steps.emplace_back();
  rec.custom_ids.push_back(step.step);
  rec.custom_names.emplace_back(name);
  recorder_.register_step(process, step.step, std::string(name));
  return {};
}

namespace {

// What the daemon counted for a process itself (daemon_crash, refused): on top of what
// the client reports, which does not know them.
std::uint64_t daemon_drops(const ProcessRecord& rec) {
  return saturating_add(rec.dropped_by_cause[proto::kDaemonCrashCause],
                        rec.dropped_by_cause[proto::kRefusedCause]);
}

}  // namespace

void Collector::refuse_spans(ProcessRecord& rec, std::uint64_t spans) {
  counters_.hit(LimitKind::kMaxSpanNs, spans);
  refuse_events(rec, 2 * spans);
}

void Collector::refuse_events(ProcessRecord& rec, std::uint64_t lost) {
  // They were taken (a ring's tail, a FlushAck) and are not in any step: out of
  // `events`, counted as refused, so that events + dropped is still what the client sent
  // (and a Delivered frame does not take them for a crash's loss).
  rec.events -= std::min(rec.events, lost);
  count_refused(rec, lost);
}

void Collector::count_refused(ProcessRecord& rec, std::uint64_t records) {
  std::uint64_t& refused = rec.dropped_by_cause[proto::kRefusedCause];
  refused = saturating_add(refused, records);
  std::uint64_t& total = counters_.events_dropped_by_cause[proto::kRefusedCause];
  total = saturating_add(total, records);
  raise_dropped(rec, saturating_add(rec.dropped, records));
}

void Collector::refused_records(ProcessHandle process, std::uint64_t records) {
  if (process >= state_->slots.size() || !state_->slots[process] || records == 0) return;
  ProcessRecord& rec = state_->write(process);
  count_refused(rec, records);
  mark_drop(rec.key(), static_cast<std::uint8_t>(proto::kRefusedCause), records);
}

void Collector::dropped(ProcessHandle process, std::uint64_t total_dropped) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  // A version-1 report: no cause. What the daemon counted itself comes on top.
  const std::uint64_t more = raise_dropped(rec, saturating_add(total_dropped, daemon_drops(rec)));
  if (more != 0) mark_drop(rec.key(), kDropNoCause, more);
}

std::uint64_t Collector::raise_dropped(ProcessRecord& rec, std::uint64_t total_dropped) {
  // Reports are cumulative and may arrive out of order across reconnects: keep the max.
  if (total_dropped <= rec.dropped) return 0;
  const std::uint64_t more = total_dropped - rec.dropped;
  // Saturating: one process's huge report must not wrap the daemon's total (which would
  // make its Prometheus counter go down).
  counters_.events_dropped_by_clients = saturating_add(counters_.events_dropped_by_clients, more);
  rec.dropped = total_dropped;
  return more;
}

void Collector::mark_drop(const ProcessKey& sender, std::uint8_t cause, std::uint64_t more,
                          std::optional<std::uint64_t> ts_ns) {
  if (!recorder_.on()) return;
  TraceMark mark;
  mark.kind = TraceMark::Kind::kDropped;
  mark.arrived_ns = env_.monotonic_now_ns();
  mark.ts_ns = ts_ns.value_or(mark.arrived_ns);
  mark.sender = sender;
  mark.cause = cause;
  mark.dropped = more;
  recorder_.mark(mark);
}

void Collector::dropped_by_cause(ProcessHandle process, const proto::DroppedByCause& causes) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < proto::kDropCauseCount; ++i) {
    if (causes.count[i] > rec.dropped_by_cause[i]) {
      const std::uint64_t more = causes.count[i] - rec.dropped_by_cause[i];
      counters_.events_dropped_by_cause[i] =
          saturating_add(counters_.events_dropped_by_cause[i], more);
      rec.dropped_by_cause[i] = causes.count[i];
      mark_drop(rec.key(), static_cast<std::uint8_t>(i), more);
    }
    // Saturating: a hostile client's counts must not wrap the total.
    total = saturating_add(total, rec.dropped_by_cause[i]);
  }
  raise_dropped(rec, saturating_add(total, daemon_drops(rec)));
}

void Collector::delivered(ProcessHandle process, std::uint64_t delivered) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  ProcessRecord& rec = state_->write(process);
  // A process restored from a snapshot that did not count its events: nothing to compare.
  if (!rec.events_known) return;
  // Both are cumulative for the process, and a daemon counts an event (folded, or
  // refused) before it lets the process know it took it (a ring's tail, a FlushAck): what
  // earlier daemons took beyond what this one has died with them. Counted once: the
  // maximum seen.
  const std::uint64_t taken =
      saturating_add(rec.events, rec.dropped_by_cause[proto::kRefusedCause]);
  // Kept for resent_events_skipped(): what this daemon has may hold batches the process
  // sends again (version 7) because no daemon acknowledged them, so not in `delivered`.
  rec.hello_delivered = delivered;
  rec.hello_taken = taken;
  rec.resent_skipped = 0;
  rec.hello_known = true;
  raise_crash(rec, delivered > taken ? delivered - taken : 0);
}

void Collector::raise_crash(ProcessRecord& rec, std::uint64_t lost) {
  std::uint64_t& crash = rec.dropped_by_cause[proto::kDaemonCrashCause];
  if (lost <= crash) return;
  const std::uint64_t more = lost - crash;
  crash = lost;
  std::uint64_t& total = counters_.events_dropped_by_cause[proto::kDaemonCrashCause];
  total = saturating_add(total, more);
  raise_dropped(rec, saturating_add(rec.dropped, more));
  mark_drop(rec.key(), static_cast<std::uint8_t>(proto::kDaemonCrashCause), more);
}

void Collector::resent_events_skipped(ProcessHandle process, std::uint64_t events) {
  if (process >= state_->slots.size() || !state_->slots[process]) return;
  if (!state_->slots[process]->hello_known) return;
  ProcessRecord& rec = state_->write(process);
  // Events of a batch sent again that this daemon already has (from its snapshot, or an
  // earlier connection): in what it had at the hello, not in what the process said it
  // delivered. So the hello's comparison under-counted a crash's loss by them (when a
  // dead daemon took later events it did not keep, e.g. from a ring): count the rest now.
  rec.resent_skipped = saturating_add(rec.resent_skipped, events);
  const std::uint64_t seen = saturating_add(rec.hello_delivered, rec.resent_skipped);
  raise_crash(rec, seen > rec.hello_taken ? seen - rec.hello_taken : 0);
}

bool Collector::batch_frame(ProcessHandle process, std::uint64_t sequence, std::uint32_t index) {
  if (process >= state_->slots.size() || !state_->slots[process]) return true;
  const ProcessRecord& now = *state_->slots[process];
  // Batches are numbered per process and applied in order: a position before the cursor
  // was applied (and is in the totals, or was lost with them in a crash and counted by
  // Delivered), whichever connection brought it.
  if (sequence < now.batch_sequence || (sequence == now.batch_sequence && index < now.batch_next)) {
    ++counters_.frames_resent_skipped;
    return false;
  }
  ProcessRecord& rec = state_->write(process);
  rec.batch_sequence = sequence;
  rec.batch_next = index + 1;
  return true;
}

}  // namespace steptrace::daemon
