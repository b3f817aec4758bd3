// The Chrome Trace Event document of a TraceCapture: which events, in what order. Every
// event is written by trace_export_json.h's write_event(), so all of them have one shape.
#include "daemon/report/trace_export.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <string_view>
#include <utility>

#include "daemon/report/trace_export_json.h"
#include "daemon/state/ledger_state.h"
#include "proto/steps.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {
namespace {

using trace_json::append_int;
using trace_json::append_json_string;
using trace_json::append_uint;
using trace_json::append_us;
using trace_json::dur_us;
using trace_json::DurEnd;
using trace_json::EventArgs;
using trace_json::TraceEvent;
using trace_json::write_event;

constexpr std::uint8_t kFlagOpen = 1;               // no end in the capture: ends at now_ns
constexpr std::uint8_t kFlagClipped = 2;            // started before since_ns
constexpr std::uint8_t kFlagStartBeforeWindow = 4;  // no start in the capture
constexpr std::uint8_t kArgFlags = kFlagOpen | kFlagClipped | kFlagStartBeforeWindow;
// Not an arg: the outermost of spans on a thread that end at the same nanosecond, whose
// "dur" must not end before the others' (write_dur_us()'s end_not_before).
constexpr std::uint8_t kFlagEndsWithOthers = 8;
// Held spans, or a thread's waiting ones, written early when there are this many (a
// client sending only ends, a span that never ends): past it, spans starting on the same
// nanosecond may be written child first.
constexpr std::size_t kMaxHeld = 4096;
// "cat" of the metadata and counter events (trace-model refuses events without one).
constexpr std::string_view kMetadataCat = "__metadata";
constexpr std::string_view kCounterCat = "vram";

// A NUL-padded wire field: up to its first NUL.
std::string_view field(const char (&chars)[proto::kNameField]) {
  return {chars, ::strnlen(chars, proto::kNameField)};
}

std::string_view ledger_op_name(std::uint8_t op) {
  switch (static_cast<proto::LedgerOp>(op)) {
    case proto::LedgerOp::kReserve:
      return "LedgerReserve";
    case proto::LedgerOp::kRelease:
      return "LedgerRelease";
    case proto::LedgerOp::kCleanup:
      return "LedgerCleanup";
    case proto::LedgerOp::kVramSample:
      return "VramSample";
    case proto::LedgerOp::kReserveLease:
      return "LedgerReserve";
    case proto::LedgerOp::kRenew:
      return "LedgerRenew";
  }
  return "LedgerOp";
}

// A counter ("C") on the daemon's "steptraced: GPU memory" pseudo process.
TraceEvent gpu_counter(std::string_view name, std::int32_t daemon_pid, std::uint64_t ts_ns) {
  return {.ph = 'C', .cat = kCounterCat, .name = name, .pid = daemon_pid, .tid = 0, .ts_ns = ts_ns};
}

// A span's args: what is unusual about it (kFlag*); none when `flags` is 0.
void add_flags(EventArgs& args, std::uint8_t flags) {
  if ((flags & kFlagOpen) != 0) args.add_bool("open", true);
  if ((flags & kFlagClipped) != 0) args.add_bool("clipped", true);
  if ((flags & kFlagStartBeforeWindow) != 0) args.add_bool("start_before_window", true);
}

// A ledger instant's args between "gpu" and "applied": what its op carries.
void add_ledger_args(EventArgs& args, const proto::LedgerRecord& r) {
  switch (static_cast<proto::LedgerOp>(r.op)) {
    case proto::LedgerOp::kReserve:
    case proto::LedgerOp::kReserveLease:
      args.add_uint("reservation_id", r.reservation_id)
          .add_uint("bytes", r.bytes)
          .add_string("task", field(r.task));
      if (r.op == static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease)) {
        args.add_uint("lease_ms", r.total_bytes);
      }
      return;
    case proto::LedgerOp::kRenew:
      args.add_uint("reservation_id", r.reservation_id).add_uint("lease_ms", r.total_bytes);
      return;
    case proto::LedgerOp::kRelease:
      args.add_uint("reservation_id", r.reservation_id);
      return;
    case proto::LedgerOp::kCleanup:
      args.add_uint("reservation_id", r.reservation_id).add_uint("holder_pid", r.holder_pid);
      return;
    case proto::LedgerOp::kVramSample:
      args.add_uint("free_bytes", r.bytes).add_uint("total_bytes", r.total_bytes);
      return;
  }
  args.add_uint("op", r.op);
}

std::uint64_t pair_key(std::uint32_t tid, std::uint32_t step) {
  return (std::uint64_t{tid} << 32) | step;
}

}  // namespace

TraceExport::TraceExport(std::shared_ptr<const TraceCapture> capture)
    : capture_(capture ? std::move(capture) : std::make_shared<const TraceCapture>()) {
  plan();
}

// One pass over the capture before the first byte: each process's window start, whether
// it shows anything (an event from since_ns on, or a span still open across it), and the
// origin, the earliest time the document shows (its ts 0).
void TraceExport::plan() {
  const TraceCapture& c = *capture_;
  const std::uint64_t since = c.since_ns;
  bool any_origin = false;
  const auto consider = [&](std::uint64_t ts) {
    if (!any_origin || ts < origin_ns_) origin_ns_ = ts;
    any_origin = true;
  };
  window_start_.assign(c.processes.size(), since);
  shown_.assign(c.processes.size(), false);
  for (std::size_t i = 0; i < c.processes.size(); ++i) {
    bool any = false;
    bool in_window = false;
    std::uint64_t first = 0;
    // Starts less ends per (thread, step): a span open across since_ns shows clipped.
    std::unordered_map<std::uint64_t, std::int64_t> open;
    for (const TraceCapture::ChunkRef& ref : c.processes[i].chunks) {
      if (!ref.chunk) continue;
      const std::uint32_t n = std::min<std::uint32_t>(ref.count, TraceChunk::kEvents);
      for (std::uint32_t k = 0; k < n; ++k) {
        const proto::EventRecord& e = ref.chunk->events[k];
        if (!any || e.timestamp_ns < first) first = e.timestamp_ns;
        any = true;
        if (e.timestamp_ns >= since) in_window = true;
        if (in_window) continue;
        auto& count = open[pair_key(e.thread_id, e.step)];
        if (e.kind == static_cast<std::uint8_t>(proto::EventKind::kStart)) {
          ++count;
        } else if (count > 0) {
          --count;
        }
      }
    }
    if (!in_window && c.now_ns >= since) {
      in_window =
          std::any_of(open.begin(), open.end(), [](const auto& kv) { return kv.second > 0; });
    }
    window_start_[i] = std::max(first, since);
    shown_[i] = any && in_window;
    if (shown_[i]) consider(window_start_[i]);
  }
  for (const TraceMark& m : c.marks) {
    if (m.ts_ns >= since) consider(m.ts_ns);
  }
  if (!any_origin) origin_ns_ = since;
}

bool TraceExport::next(std::string& out, std::size_t piece_bytes) {
  if (phase_ == Phase::kDone) return false;
  const std::size_t start = out.size();
  out.reserve(start + piece_bytes + 512);
  while (phase_ != Phase::kDone && out.size() - start < piece_bytes) step(out);
  return phase_ != Phase::kDone;
}

void TraceExport::step(std::string& out) {
  switch (phase_) {
    case Phase::kHeader:
      out.append("{\"traceEvents\":[\n");
      phase_ = Phase::kProcessBegin;
      return;
    case Phase::kProcessBegin:
      begin_process(out);
      return;
    case Phase::kEvents:
      next_event(out);
      return;
    case Phase::kProcessEnd:
      end_process();
      return;
    case Phase::kWriting:
      write_next_sorted(out);
      return;
    case Phase::kMarks:
      next_mark(out);
      return;
    case Phase::kFooter:
      write_footer(out);
      return;
    case Phase::kDone:
      return;
  }
}

void TraceExport::begin_event(std::string& out) {
  if (!first_event_) out.append(",\n");
  first_event_ = false;
}

void TraceExport::begin_process(std::string& out) {
  // Processes with nothing in the window are left out.
  while (process_ < capture_->processes.size() && !shown_[process_]) ++process_;
  if (process_ >= capture_->processes.size()) {
    phase_ = Phase::kMarks;
    return;
  }
  const TraceCapture::Process& p = capture_->processes[process_];
  // The window starts at the process's earliest retained event (or since_ns).
  window_start_ns_ = window_start_[process_];
  chunk_ = 0;
  index_ = 0;
  open_.clear();
  threads_.clear();
  depth_.clear();
  pending_.clear();
  names_.clear();
  held_.clear();
  held_total_ = 0;
  ending_in_lots_ = false;
  pid_ = p.key.pid;

  std::string name = p.comm;
  if (!name.empty()) name.push_back(' ');
  name.push_back('[');
  append_int(name, p.key.pid);
  name.push_back(']');
  // "job J (uid U)": another uid may run a job with the same id.
  if (!p.job.empty()) {
    name.append(" job ").append(p.job).append(" (uid ");
    append_int(name, p.uid);
    name.push_back(')');
  }
  if (p.rank != proto::kNoRank) {
    name.append(" rank ");
    append_int(name, p.rank);
  }
  if (!p.alive) name.append(" (exited)");
  begin_event(out);
  write_event(
      out,
      {.ph = 'M', .cat = kMetadataCat, .name = "process_name", .pid = pid_, .tid = 0, .ts_ns = 0},
      [&](EventArgs& args) { args.add_string("name", name); });
  phase_ = Phase::kEvents;
}

void TraceExport::write_thread_name(std::string& out, std::uint32_t tid) {
  std::string name = static_cast<std::int64_t>(tid) == pid_ ? "main thread " : "thread ";
  append_uint(name, tid);
  begin_event(out);
  write_event(
      out,
      {.ph = 'M', .cat = kMetadataCat, .name = "thread_name", .pid = pid_, .tid = tid, .ts_ns = 0},
      [&](EventArgs& args) { args.add_string("name", name); });
}

const std::string& TraceExport::step_name_json(std::uint32_t step) {
  auto it = names_.find(step);
  if (it != names_.end()) return it->second;
  std::string json;
  if (proto::is_builtin_step(step)) {
    append_json_string(json, proto::kBuiltinStepNames[step]);
  } else {
    const auto& names = capture_->processes[process_].names;
    const auto found = names ? names->find(step) : StepNames::const_iterator{};
    if (names && found != names->end()) {
      append_json_string(json, found->second);
    } else {
      json = "\"step ";
      append_uint(json, step);
      json.push_back('"');
    }
  }
  return names_.emplace(step, std::move(json)).first->second;
}

void TraceExport::next_event(std::string& out) {
  const TraceCapture::Process& p = capture_->processes[process_];
  if (chunk_ >= p.chunks.size()) {
    phase_ = Phase::kProcessEnd;
    return;
  }
  const TraceCapture::ChunkRef& ref = p.chunks[chunk_];
  const std::uint32_t n = ref.chunk ? std::min<std::uint32_t>(ref.count, TraceChunk::kEvents) : 0;
  if (index_ >= n) {
    ++chunk_;
    index_ = 0;
    return;
  }
  const proto::EventRecord& e = ref.chunk->events[index_];
  if (threads_.insert(e.thread_id).second) {
    write_thread_name(out, e.thread_id);  // the event itself on the next step
    return;
  }
  ++index_;
  const auto kind = static_cast<proto::EventKind>(e.kind);
  if (kind == proto::EventKind::kStart) {
    open_[pair_key(e.thread_id, e.step)].push_back(e.timestamp_ns);
    ++depth_[e.thread_id];
  } else if (kind == proto::EventKind::kEnd) {
    auto& starts = open_[pair_key(e.thread_id, e.step)];
    if (starts.empty()) {
      span(e.thread_id, e.step, window_start_ns_, e.timestamp_ns, kFlagStartBeforeWindow);
    } else {
      const std::uint64_t start = starts.back();
      starts.pop_back();
      --depth_[e.thread_id];
      span(e.thread_id, e.step, start, e.timestamp_ns, 0);
    }
    // The thread's outermost span ended: what waited on it is complete, write it.
    auto waiting = pending_.find(e.thread_id);
    if (waiting != pending_.end() && !waiting->second.empty() &&
        (depth_[e.thread_id] == 0 || waiting->second.size() >= kMaxHeld)) {
      if (depth_[e.thread_id] != 0) spans_written_early_ += waiting->second.size();
      write_sorted(waiting->second, Phase::kEvents);
    } else if (held_.size() >= kMaxHeld) {
      spans_written_early_ += held_.size();
      write_sorted(held_, Phase::kEvents);
    } else if (held_total_ >= kMaxHeldTotal) {
      write_all_held();
    }
  }
}

// A span from `start` to `end`, shown from since_ns on. Viewers nest complete events
// with the same ts in file order, and a span is known at its end, after those inside it:
// so a span waits on its thread until the outermost one ends, and spans starting at the
// window start (all the clipped ones and those without a start) and open ones are held
// to the process's end; each lot is written by start, longest first.
void TraceExport::span(std::uint32_t tid, std::uint32_t step, std::uint64_t start,
                       std::uint64_t end, std::uint8_t flags) {
  const std::uint64_t since = capture_->since_ns;
  if (end < since) return;
  std::uint64_t ts = start;
  if (ts < since) {
    ts = since;
    flags |= kFlagClipped;
  }
  const std::uint64_t dur = end > ts ? end - ts : 0;
  ++held_total_;
  max_held_ = std::max(max_held_, held_total_);
  if (ts != window_start_ns_ && (flags & (kFlagOpen | kFlagStartBeforeWindow)) == 0) {
    pending_[tid].push_back({tid, step, ts, dur, flags});
    return;
  }
  held_.push_back({tid, step, ts, dur, flags});
}

// Past kMaxHeldTotal spans waiting in all (many threads, each inside a long outer span):
// every waiting span of the process goes out now as one lot (by thread and start), so the
// exporter's memory is bounded by the capture's budget, not threads x kMaxHeld. Nothing
// is lost; the cost is the ordering at equal timestamps of those spans (counted).
void TraceExport::write_all_held() {
  std::vector<Held> lot = std::move(held_);
  held_.clear();
  for (auto& [tid, spans] : pending_) lot.insert(lot.end(), spans.begin(), spans.end());
  pending_.clear();  // frees each thread's vector (its capacity too)
  spans_written_early_ += lot.size();
  write_sorted(lot, Phase::kEvents);
}

void TraceExport::write_span(std::string& out, const Held& h) {
  // The first of spans ending together (the enclosing one) ends at or past their end;
  // each inside it, at or before the end the previous one was written with.
  DurEnd how{};
  if (h.ends_with != 0) {
    how.not_before = (h.flags & kFlagEndsWithOthers) != 0;
    how.cap = shared_ends_[h.ends_with - 1];
  }
  const std::uint64_t ts = rel(h.ts_ns);
  const TraceEvent e{.ph = 'X',
                     .cat = "step",
                     .name_json = step_name_json(h.step),
                     .pid = pid_,
                     .tid = h.tid,
                     .ts_ns = ts,
                     .dur_ns = h.dur_ns,
                     .dur_end = how};
  if (h.ends_with != 0) {
    bool exact = false;
    const double dur = dur_us(ts, h.dur_ns, how, exact);
    shared_ends_[h.ends_with - 1] = static_cast<double>(ts) / 1000.0 + dur;
  }
  begin_event(out);
  const std::uint8_t flags = h.flags;
  if ((flags & kArgFlags) == 0) {
    write_event(out, e);
  } else {
    write_event(out, e, [flags](EventArgs& args) { add_flags(args, flags); });
  }
}

void TraceExport::write_sorted(std::vector<Held>& spans, Phase then) {
  held_total_ -= std::min(held_total_, spans.size());
  writing_.swap(spans);
  std::vector<Held>().swap(spans);  // no capacity left behind on a thread that waits no more
  // Per thread by start, the longer (enclosing) span first.
  std::sort(writing_.begin(), writing_.end(), [](const Held& a, const Held& b) {
    if (a.tid != b.tid) return a.tid < b.tid;
    if (a.ts_ns != b.ts_ns) return a.ts_ns < b.ts_ns;
    if (a.dur_ns != b.dur_ns) return a.dur_ns > b.dur_ns;
    if (a.step != b.step) return a.step < b.step;
    return a.flags < b.flags;
  });
  mark_shared_ends();
  writing_index_ = 0;
  after_writing_ = then;
  phase_ = Phase::kWriting;
}

// The process's last spans: those still open end at capture time. With the held and
// waiting ones they go out as one lot when they fit kMaxHeldTotal; else in lots of at most
// that many, each sorted and counted early, so a client that sent only starts makes the
// exporter hold no more than that (its starts themselves are in open_ already).
void TraceExport::end_process() {
  std::vector<Held> lot = std::move(held_);
  held_.clear();
  for (auto& [tid, spans] : pending_) lot.insert(lot.end(), spans.begin(), spans.end());
  pending_.clear();
  take_open_spans(lot);
  if (lot.empty()) {
    ++process_;
    phase_ = Phase::kProcessBegin;
    return;
  }
  if (!open_.empty()) ending_in_lots_ = true;  // more lots follow this one
  if (ending_in_lots_) spans_written_early_ += lot.size();
  write_sorted(lot, Phase::kProcessEnd);
}

// Moves open spans into `lot` until it holds kMaxHeldTotal; leaves open_ without the keys
// it emptied, so the next lot starts where this one stopped.
void TraceExport::take_open_spans(std::vector<Held>& lot) {
  const std::uint64_t since = capture_->since_ns;
  const std::uint64_t end = capture_->now_ns;
  for (auto it = open_.begin(); it != open_.end();) {
    std::vector<std::uint64_t>& starts = it->second;
    const auto tid = static_cast<std::uint32_t>(it->first >> 32);
    const auto step = static_cast<std::uint32_t>(it->first & 0xFFFFFFFFu);
    while (!starts.empty() && lot.size() < kMaxHeldTotal) {
      std::uint64_t ts = starts.back();
      starts.pop_back();
      if (end < since) continue;
      std::uint8_t flags = kFlagOpen;
      if (ts < since) {
        ts = since;
        flags |= kFlagClipped;
      }
      lot.push_back({tid, step, ts, end > ts ? end - ts : 0, flags});
      ++held_total_;
    }
    if (!starts.empty()) break;  // the lot is full
    it = open_.erase(it);
  }
  max_held_ = std::max(max_held_, held_total_);
}

void TraceExport::mark_shared_ends() {
  // By (thread, end), then by place in writing_: the first of each lot starts first, so it
  // encloses the others.
  ends_.clear();
  ends_.reserve(writing_.size());
  for (std::size_t i = 0; i < writing_.size(); ++i) ends_.push_back(i);
  const auto end_of = [this](std::size_t i) {
    return std::pair{writing_[i].tid, writing_[i].ts_ns + writing_[i].dur_ns};
  };
  std::sort(ends_.begin(), ends_.end(), [&end_of](std::size_t a, std::size_t b) {
    return std::pair{end_of(a), a} < std::pair{end_of(b), b};
  });
  shared_ends_.clear();
  for (std::size_t i = 0; i + 1 < ends_.size(); ++i) {
    if (end_of(ends_[i]) != end_of(ends_[i + 1])) continue;
    writing_[ends_[i]].flags |= kFlagEndsWithOthers;
    shared_ends_.push_back(std::numeric_limits<double>::infinity());
    const auto lot = static_cast<std::uint32_t>(shared_ends_.size());
    writing_[ends_[i]].ends_with = lot;
    while (i + 1 < ends_.size() && end_of(ends_[i]) == end_of(ends_[i + 1])) {
      writing_[ends_[++i]].ends_with = lot;
    }
  }
}

void TraceExport::write_next_sorted(std::string& out) {
  if (writing_index_ < writing_.size()) {
    const Held& h = writing_[writing_index_++];
    write_span(out, h);
    return;
  }
  writing_.clear();
  writing_index_ = 0;
  phase_ = after_writing_;
}

void TraceExport::next_mark(std::string& out) {
  const auto& marks = capture_->marks;
  while (mark_ < marks.size() && marks[mark_].ts_ns < capture_->since_ns) ++mark_;
  if (mark_ >= marks.size()) {
    phase_ = Phase::kFooter;
    return;
  }
  // Each call writes one event; the marks of several events keep their place in
  // mark_part_, and the GPU process's name comes before its first counter.
  const TraceMark& m = marks[mark_];
  switch (m.kind) {
    case TraceMark::Kind::kDropped:
      write_drop(out, m);
      ++mark_;
      return;
    case TraceMark::Kind::kLeaseExpired:
      write_lease_expired(out, m);
      ++mark_;
      return;
    case TraceMark::Kind::kDevice:
      if (!name_gpu_process(out)) write_device_sample(out, m);
      return;
    case TraceMark::Kind::kLedger:
      if (mark_part_ == 0) {
        write_ledger_instant(out, m);
      } else if (!name_gpu_process(out)) {
        write_ledger_counter(out, m);
      }
      return;
  }
  ++mark_;  // a kind this version does not know
}

// On the sender's process: how many events were lost and why.
void TraceExport::write_drop(std::string& out, const TraceMark& m) {
  const std::string_view cause = trace_drop_cause(m.cause);
  // What the daemon lost or could not fold itself, against what the client reported.
  const bool by_daemon = m.cause == kDaemonDropOpenDepth || m.cause == kDaemonDropStateLimit ||
                         m.cause == proto::kDaemonCrashCause || m.cause == proto::kRefusedCause;
  const std::string name = "dropped: " + std::string(cause);
  begin_event(out);
  write_event(out,
              {.ph = 'i',
               .scope = 'p',
               .cat = "drops",
               .name = name,
               .pid = m.sender.pid,
               .tid = m.sender.pid,
               .ts_ns = rel(m.ts_ns)},
              [&](EventArgs& args) {
                args.add_string("cause", cause)
                    .add_uint("events", m.dropped)
                    .add_string("by", by_daemon ? "daemon" : "client");
              });
}

// On the holder's process: the moment its lease passed unrenewed.
void TraceExport::write_lease_expired(std::string& out, const TraceMark& m) {
  begin_event(out);
  write_event(out,
              {.ph = 'i',
               .scope = 'p',
               .cat = "ledger",
               .name = "lease expired",
               .pid = m.sender.pid,
               .tid = m.sender.pid,
               .ts_ns = rel(m.ts_ns)},
              [&](EventArgs& args) {
                args.add_string("gpu", field(m.record.gpu_uuid))
                    .add_uint("reservation_id", m.record.reservation_id)
                    .add_uint("bytes", m.record.bytes)
                    .add_uint("lease_ms", m.record.total_bytes)
                    .add_string("by", "daemon");
              });
}

// NVML's sample, two counters: the device's used bytes (part 0), then the findings by
// kind (part 1).
void TraceExport::write_device_sample(std::string& out, const TraceMark& m) {
  std::string name = mark_part_ == 0 ? "VRAM used (device) " : "findings ";
  name.append(field(m.record.gpu_uuid));
  const TraceEvent e = gpu_counter(name, capture_->daemon_pid, rel(m.ts_ns));
  begin_event(out);
  if (mark_part_ == 0) {
    write_event(out, e, [&](EventArgs& args) { args.add_uint("bytes", m.gpu_reserved_bytes); });
    mark_part_ = 1;
    return;
  }
  write_event(out, e, [&](EventArgs& args) {
    for (std::size_t k = 0; k < ledger::Finding::kKindCount; ++k) {
      args.add_uint(ledger::kFindingNames[k], m.findings[k]);
    }
  });
  mark_part_ = 0;
  ++mark_;
}

// A ledger record as sent, on the sender's thread; an applied one's counters follow.
void TraceExport::write_ledger_instant(std::string& out, const TraceMark& m) {
  const proto::LedgerRecord& r = m.record;
  begin_event(out);
  write_event(out,
              {.ph = 'i',
               .scope = 't',
               .cat = "ledger",
               .name = ledger_op_name(r.op),
               .pid = m.sender.pid,
               .tid = r.thread_id,
               .ts_ns = rel(m.ts_ns)},
              [&](EventArgs& args) {
                args.add_string("gpu", field(r.gpu_uuid));
                add_ledger_args(args, r);
                args.add_bool("applied", m.applied);
              });
  if (m.applied) {
    mark_part_ = 1;
  } else {
    ++mark_;
  }
}

// Counters of an applied record, on the daemon's pseudo process: the GPU's reserved
// bytes (part 1), then for a sample its free bytes (part 2).
void TraceExport::write_ledger_counter(std::string& out, const TraceMark& m) {
  const bool reserved = mark_part_ == 1;
  const bool sample = m.record.op == static_cast<std::uint8_t>(proto::LedgerOp::kVramSample);
  std::string name = reserved ? "VRAM reserved " : "VRAM free ";
  name.append(field(m.record.gpu_uuid));
  begin_event(out);
  write_event(out, gpu_counter(name, capture_->daemon_pid, rel(m.ts_ns)), [&](EventArgs& args) {
    args.add_uint("bytes", reserved ? m.gpu_reserved_bytes : m.gpu_free_bytes);
  });
  if (reserved && sample) {
    mark_part_ = 2;
  } else {
    mark_part_ = 0;
    ++mark_;
  }
}

bool TraceExport::name_gpu_process(std::string& out) {
  if (gpu_process_named_) return false;
  begin_event(out);
  write_event(out,
              {.ph = 'M',
               .cat = kMetadataCat,
               .name = "process_name",
               .pid = capture_->daemon_pid,
               .tid = 0,
               .ts_ns = 0},
              [](EventArgs& args) { args.add_string("name", "steptraced: GPU memory"); });
  gpu_process_named_ = true;
  return true;
}

void TraceExport::write_footer(std::string& out) {
  const TraceCapture& c = *capture_;
  out.append(first_event_ ? "]" : "\n]");
  out.append(R"(,"displayTimeUnit":"ms","otherData":{"clock":"CLOCK_MONOTONIC","host":)");
  append_json_string(out, c.host);
  out.append(",\"daemon_pid\":");
  append_int(out, c.daemon_pid);
  out.append(",\"wall_clock_offset_ns\":");
  append_int(out, c.wall_offset_ns);
  // The anchor: ts 0 on the monotonic clock and in Unix ns (what `trace merge` aligns on).
  out.append(",\"ts_origin_ns\":");
  append_uint(out, origin_ns_);
  out.append(",\"ts_origin_unix_ns\":");
  append_int(out, static_cast<std::int64_t>(origin_ns_) + c.wall_offset_ns);
  out.append(",\"captured_at_us\":");
  append_us(out, c.now_ns);
  out.append(",\"since_us\":");
  append_us(out, c.since_ns);
  out.append(",\"events_evicted\":");
  append_uint(out, c.counters.events_evicted);
  out.append(",\"marks_evicted\":");
  append_uint(out, c.counters.marks_evicted);
  out.append(",\"budget_bytes\":");
  append_uint(out, c.counters.budget_bytes);
  out.append(",\"spans_written_early\":");
  append_uint(out, spans_written_early_);
  out.append(R"(,"generator":"steptraced"}})");
  out.push_back('\n');
  phase_ = Phase::kDone;
}

std::string render_trace(std::shared_ptr<const TraceCapture> capture) {
  TraceExport exporter(std::move(capture));
  std::string out;
  while (exporter.next(out)) {
  }
  return out;
}

}  // namespace steptrace::daemon
