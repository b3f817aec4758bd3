// The Chrome Trace Event document of a TraceCapture. Event lines are written by hand
// (std::to_chars, no iostreams, no nlohmann): a capture can hold millions of events.
#include "daemon/report/trace_export.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <string_view>
#include <utility>

#include "daemon/state/ledger_state.h"
#include "proto/steps.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {
namespace {

constexpr std::uint8_t kFlagOpen = 1;               // no end in the capture: ends at now_ns
constexpr std::uint8_t kFlagClipped = 2;            // started before since_ns
constexpr std::uint8_t kFlagStartBeforeWindow = 4;  // no start in the capture
// Held spans written early when there are this many (a client sending only ends).
constexpr std::size_t kMaxHeld = 4096;

void append_uint(std::string& out, std::uint64_t value) {
  char buf[24];
  const auto result = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, result.ptr);
}

void append_int(std::string& out, std::int64_t value) {
  char buf[24];
  const auto result = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, result.ptr);
}

// Nanoseconds as microseconds with three decimals: 1234567 -> "1234.567".
void append_us(std::string& out, std::uint64_t ns) {
  char buf[32];
  auto result = std::to_chars(buf, buf + sizeof buf - 4, ns / 1000);
  const auto frac = static_cast<unsigned>(ns % 1000);
  char* p = result.ptr;
  *p++ = '.';
  *p++ = static_cast<char>('0' + frac / 100);
  *p++ = static_cast<char>('0' + frac / 10 % 10);
  *p++ = static_cast<char>('0' + frac % 10);
  out.append(buf, p);
}

// Length of the valid UTF-8 sequence of two or more bytes at s[i] (RFC 3629: no
// overlong forms, no surrogates, nothing past U+10FFFF); 0 when there is none.
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](std::size_t k, unsigned lo, unsigned hi) {
    return i + k < s.size() && byte(k) >= lo && byte(k) <= hi;
  };
  const unsigned c = byte(0);
  if (c >= 0xC2 && c <= 0xDF) return cont(1, 0x80, 0xBF) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const unsigned lo = c == 0xE0 ? 0xA0 : 0x80;
    const unsigned hi = c == 0xED ? 0x9F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const unsigned lo = c == 0xF0 ? 0x90 : 0x80;
    const unsigned hi = c == 0xF4 ? 0x8F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) && cont(3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

// A JSON string of client-controlled bytes: quotes, backslashes and control characters
// escaped, valid UTF-8 kept, every other byte '?'.
void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (c < 0x20 || c == 0x7F) {
      out.append("\\u00");
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
      ++i;
    } else if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (const std::size_t n = utf8_sequence(s, i); n != 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.push_back('?');
      ++i;
    }
  }
  out.push_back('"');
}

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

void append_flags(std::string& out, std::uint8_t flags) {
  if (flags == 0) return;
  out.append(",\"args\":{");
  bool first = true;
  const auto flag = [&](std::uint8_t bit, std::string_view name) {
    if ((flags & bit) == 0) return;
    if (!first) out.push_back(',');
    first = false;
    out.append(name);
  };
  flag(kFlagOpen, "\"open\":true");
  flag(kFlagClipped, "\"clipped\":true");
  flag(kFlagStartBeforeWindow, "\"start_before_window\":true");
  out.push_back('}');
}

std::uint64_t pair_key(std::uint32_t tid, std::uint32_t step) {
  return (std::uint64_t{tid} << 32) | step;
}

}  // namespace

TraceExport::TraceExport(std::shared_ptr<const TraceCapture> capture)
    : capture_(capture ? std::move(capture) : std::make_shared<const TraceCapture>()) {}

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
      phase_ = capture_->processes.empty() ? Phase::kMarks : Phase::kProcessBegin;
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
    case Phase::kHeld:
      write_held(out);
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
  const TraceCapture::Process& p = capture_->processes[process_];
  // The window starts at the process's earliest retained event (or since_ns).
  bool any = false;
  std::uint64_t first = 0;
  for (const TraceCapture::ChunkRef& ref : p.chunks) {
    if (!ref.chunk) continue;
    const std::uint32_t n = std::min<std::uint32_t>(ref.count, TraceChunk::kEvents);
    for (std::uint32_t i = 0; i < n; ++i) {
      const std::uint64_t ts = ref.chunk->events[i].timestamp_ns;
      if (!any || ts < first) first = ts;
      any = true;
    }
  }
  window_start_ns_ = std::max(first, capture_->since_ns);
  chunk_ = 0;
  index_ = 0;
  open_.clear();
  threads_.clear();
  names_.clear();
  held_.clear();
  pid_json_ = ",\"pid\":";
  append_int(pid_json_, p.key.pid);
  pid_json_.append(",\"tid\":");

  begin_event(out);
  out.append(R"({"ph":"M","name":"process_name")");
  out.append(pid_json_);
  out.append(R"(0,"args":{"name":)");
  std::string name = p.comm;
  if (!name.empty()) name.push_back(' ');
  name.push_back('[');
  append_int(name, p.key.pid);
  name.push_back(']');
  if (!p.job.empty()) name.append(" job ").append(p.job);
  if (p.rank != proto::kNoRank) {
    name.append(" rank ");
    append_int(name, p.rank);
  }
  if (!p.alive) name.append(" (exited)");
  append_json_string(out, name);
  out.append("}}");
  phase_ = Phase::kEvents;
}

void TraceExport::write_thread_name(std::string& out, std::uint32_t tid) {
  const std::int32_t pid = capture_->processes[process_].key.pid;
  begin_event(out);
  out.append(R"({"ph":"M","name":"thread_name")");
  out.append(pid_json_);
  append_uint(out, tid);
  out.append(R"(,"args":{"name":")");
  if (static_cast<std::int64_t>(tid) == pid) out.append("main ");
  out.append("thread ");
  append_uint(out, tid);
  out.append("\"}}");
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
  } else if (kind == proto::EventKind::kEnd) {
    auto& starts = open_[pair_key(e.thread_id, e.step)];
    if (starts.empty()) {
      span(out, e.thread_id, e.step, window_start_ns_, e.timestamp_ns, kFlagStartBeforeWindow);
    } else {
      const std::uint64_t start = starts.back();
      starts.pop_back();
      span(out, e.thread_id, e.step, start, e.timestamp_ns, 0);
    }
  }
}

// A span from `start` to `end`, shown from since_ns on. Spans starting at the window
// start (all the clipped ones and those without a start) and open ones are held and
// written longest first: viewers nest complete events with the same ts in file order.
void TraceExport::span(std::string& out, std::uint32_t tid, std::uint32_t step, std::uint64_t start,
                       std::uint64_t end, std::uint8_t flags) {
  const std::uint64_t since = capture_->since_ns;
  if (end < since) return;
  std::uint64_t ts = start;
  if (ts < since) {
    ts = since;
    flags |= kFlagClipped;
  }
  const std::uint64_t dur = end > ts ? end - ts : 0;
  if (ts != window_start_ns_ && (flags & (kFlagOpen | kFlagStartBeforeWindow)) == 0) {
    write_span(out, tid, step, ts, dur, flags);
    return;
  }
  held_.push_back({tid, step, ts, dur, flags});
  if (held_.size() >= kMaxHeld) {
    held_then_next_process_ = false;
    end_held_collection();
  }
}

void TraceExport::write_span(std::string& out, std::uint32_t tid, std::uint32_t step,
                             std::uint64_t ts, std::uint64_t dur, std::uint8_t flags) {
  begin_event(out);
  out.append(R"({"ph":"X","cat":"step","name":)");
  out.append(step_name_json(step));
  out.append(pid_json_);
  append_uint(out, tid);
  out.append(",\"ts\":");
  append_us(out, ts);
  out.append(",\"dur\":");
  append_us(out, dur);
  append_flags(out, flags);
  out.push_back('}');
}

void TraceExport::end_held_collection() {
  // Per thread by start, the longer (enclosing) span first.
  std::sort(held_.begin(), held_.end(), [](const Held& a, const Held& b) {
    if (a.tid != b.tid) return a.tid < b.tid;
    if (a.ts_ns != b.ts_ns) return a.ts_ns < b.ts_ns;
    if (a.dur_ns != b.dur_ns) return a.dur_ns > b.dur_ns;
    if (a.step != b.step) return a.step < b.step;
    return a.flags < b.flags;
  });
  held_index_ = 0;
  phase_ = Phase::kHeld;
}

void TraceExport::end_process() {
  // Spans still open end at capture time.
  for (const auto& [key, starts] : open_) {
    const auto tid = static_cast<std::uint32_t>(key >> 32);
    const auto step = static_cast<std::uint32_t>(key & 0xFFFFFFFFu);
    for (const std::uint64_t start : starts) {
      const std::uint64_t since = capture_->since_ns;
      const std::uint64_t end = capture_->now_ns;
      if (end < since) continue;
      std::uint8_t flags = kFlagOpen;
      std::uint64_t ts = start;
      if (ts < since) {
        ts = since;
        flags |= kFlagClipped;
      }
      held_.push_back({tid, step, ts, end > ts ? end - ts : 0, flags});
    }
  }
  open_.clear();
  held_then_next_process_ = true;
  end_held_collection();
}

void TraceExport::write_held(std::string& out) {
  if (held_index_ < held_.size()) {
    const Held& h = held_[held_index_++];
    write_span(out, h.tid, h.step, h.ts_ns, h.dur_ns, h.flags);
    return;
  }
  held_.clear();
  held_index_ = 0;
  if (!held_then_next_process_) {
    phase_ = Phase::kEvents;
    return;
  }
  ++process_;
  phase_ = process_ < capture_->processes.size() ? Phase::kProcessBegin : Phase::kMarks;
}

void TraceExport::next_mark(std::string& out) {
  const auto& marks = capture_->marks;
  while (mark_ < marks.size() && marks[mark_].ts_ns < capture_->since_ns) ++mark_;
  if (mark_ >= marks.size()) {
    phase_ = Phase::kFooter;
    return;
  }
  const TraceMark& m = marks[mark_];
  if (m.kind == TraceMark::Kind::kDropped) {
    const std::string_view cause = trace_drop_cause(m.cause);
    const bool by_daemon = m.cause == kDaemonDropOpenDepth || m.cause == kDaemonDropStateLimit;
    begin_event(out);
    out.append(R"({"ph":"i","s":"p","cat":"drops","name":"dropped: )");
    out.append(cause);
    out.append("\",\"pid\":");
    append_int(out, m.sender.pid);
    out.append(",\"tid\":");
    append_int(out, m.sender.pid);
    out.append(",\"ts\":");
    append_us(out, m.ts_ns);
    out.append(R"(,"args":{"cause":")");
    out.append(cause);
    out.append("\",\"events\":");
    append_uint(out, m.dropped);
    out.append(by_daemon ? R"(,"by":"daemon"}})" : R"(,"by":"client"}})");
    ++mark_;
    return;
  }
  if (m.kind == TraceMark::Kind::kLeaseExpired) {
    // On the holder's process: the moment its lease passed unrenewed.
    begin_event(out);
    out.append(R"({"ph":"i","s":"p","cat":"ledger","name":"lease expired","pid":)");
    append_int(out, m.sender.pid);
    out.append(",\"tid\":");
    append_int(out, m.sender.pid);
    out.append(",\"ts\":");
    append_us(out, m.ts_ns);
    out.append(R"(,"args":{"gpu":)");
    append_json_string(out, field(m.record.gpu_uuid));
    out.append(",\"reservation_id\":");
    append_uint(out, m.record.reservation_id);
    out.append(",\"bytes\":");
    append_uint(out, m.record.bytes);
    out.append(",\"lease_ms\":");
    append_uint(out, m.record.total_bytes);
    out.append(R"(,"by":"daemon"}})");
    ++mark_;
    return;
  }
  if (m.kind == TraceMark::Kind::kDevice) {
    // NVML's sample: the device's used bytes, then the findings by kind.
    if (name_gpu_process(out)) return;
    begin_event(out);
    std::string name = mark_part_ == 0 ? "VRAM used (device) " : "findings ";
    name.append(field(m.record.gpu_uuid));
    out.append(R"({"ph":"C","name":)");
    append_json_string(out, name);
    out.append(",\"pid\":");
    append_int(out, capture_->daemon_pid);
    out.append(",\"tid\":0,\"ts\":");
    append_us(out, m.ts_ns);
    if (mark_part_ == 0) {
      out.append(",\"args\":{\"bytes\":");
      append_uint(out, m.gpu_reserved_bytes);
      out.append("}}");
      mark_part_ = 1;
      return;
    }
    out.append(",\"args\":{");
    for (std::size_t k = 0; k < ledger::Finding::kKindCount; ++k) {
      if (k != 0) out.push_back(',');
      append_json_string(out, ledger::kFindingNames[k]);
      out.push_back(':');
      append_uint(out, m.findings[k]);
    }
    out.append("}}");
    mark_part_ = 0;
    ++mark_;
    return;
  }
  if (m.kind != TraceMark::Kind::kLedger) {
    ++mark_;
    return;
  }

  const proto::LedgerRecord& r = m.record;
  const std::string_view gpu = field(r.gpu_uuid);
  const bool sample = r.op == static_cast<std::uint8_t>(proto::LedgerOp::kVramSample);
  if (mark_part_ == 0) {
    begin_event(out);
    out.append(R"({"ph":"i","s":"t","cat":"ledger","name":")");
    out.append(ledger_op_name(r.op));
    out.append("\",\"pid\":");
    append_int(out, m.sender.pid);
    out.append(",\"tid\":");
    append_uint(out, r.thread_id);
    out.append(",\"ts\":");
    append_us(out, m.ts_ns);
    out.append(R"(,"args":{"gpu":)");
    append_json_string(out, gpu);
    switch (static_cast<proto::LedgerOp>(r.op)) {
      case proto::LedgerOp::kReserve:
      case proto::LedgerOp::kReserveLease:
        out.append(",\"reservation_id\":");
        append_uint(out, r.reservation_id);
        out.append(",\"bytes\":");
        append_uint(out, r.bytes);
        out.append(",\"task\":");
        append_json_string(out, field(r.task));
        if (r.op == static_cast<std::uint8_t>(proto::LedgerOp::kReserveLease)) {
          out.append(",\"lease_ms\":");
          append_uint(out, r.total_bytes);
        }
        break;
      case proto::LedgerOp::kRenew:
        out.append(",\"reservation_id\":");
        append_uint(out, r.reservation_id);
        out.append(",\"lease_ms\":");
        append_uint(out, r.total_bytes);
        break;
      case proto::LedgerOp::kRelease:
        out.append(",\"reservation_id\":");
        append_uint(out, r.reservation_id);
        break;
      case proto::LedgerOp::kCleanup:
        out.append(",\"reservation_id\":");
        append_uint(out, r.reservation_id);
        out.append(",\"holder_pid\":");
        append_uint(out, r.holder_pid);
        break;
      case proto::LedgerOp::kVramSample:
        out.append(",\"free_bytes\":");
        append_uint(out, r.bytes);
        out.append(",\"total_bytes\":");
        append_uint(out, r.total_bytes);
        break;
      default:
        out.append(",\"op\":");
        append_uint(out, r.op);
        break;
    }
    out.append(m.applied ? ",\"applied\":true}}" : ",\"applied\":false}}");
    if (m.applied) {
      mark_part_ = 1;
    } else {
      ++mark_;
    }
    return;
  }

  // Counters of an applied record, on the daemon's pseudo process.
  if (name_gpu_process(out)) return;
  begin_event(out);
  const bool reserved = mark_part_ == 1;
  out.append(R"({"ph":"C","name":)");
  std::string name = reserved ? "VRAM reserved " : "VRAM free ";
  name.append(gpu);
  append_json_string(out, name);
  out.append(",\"pid\":");
  append_int(out, capture_->daemon_pid);
  out.append(",\"tid\":0,\"ts\":");
  append_us(out, m.ts_ns);
  out.append(",\"args\":{\"bytes\":");
  append_uint(out, reserved ? m.gpu_reserved_bytes : m.gpu_free_bytes);
  out.append("}}");
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
  out.append(R"({"ph":"M","name":"process_name","pid":)");
  append_int(out, capture_->daemon_pid);
  out.append(R"(,"tid":0,"args":{"name":"steptraced: GPU memory"}})");
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
