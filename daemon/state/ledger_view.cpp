// The daemon's VRAM ledger view (daemon/state/ledger_view.h).
//
// State is one Gpu per UUID (reservations by id, reserved total and high-water, last VRAM
// sample, operation counts, per-actor rows of ledger operations and ledger-step time),
// plus per (process, thread) the GPU and timestamp of the last annotation, which
// attribute_span() uses to credit a ledger-step span to a GPU. Every record is credited
// to the actor (the process of the connection that sent it). Records that break a rule
// are counted per anomaly kind and change nothing else, over-long (client-truncated)
// strings included; the one exception, as the protocol says, is a cleanup naming another
// holder (the ledger removed the entry, so the view does too).
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

#include <nlohmann/json.hpp>

#include "daemon/report/report_format.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

constexpr std::int64_t kSnapshotVersion = 1;
// Longest process name kept; /proc comm is at most 15 bytes, the hello's name 23.
constexpr std::size_t kMaxComm = proto::kMaxNameLength;

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
  kAnomalyCount,
};

constexpr std::array<std::string_view, kAnomalyCount> kAnomalyNames = {
    "unknown_release",         "unknown_cleanup",    "duplicate_reservation",
    "zero_byte_reserve",       "gpu_uuid_truncated", "task_truncated",
    "cleanup_holder_mismatch", "max_gpus",           "max_reservations_per_gpu",
    "reserved_bytes_overflow", "bad_vram_sample",    "bad_record",
    "overcommitted",           "process_rows_full",  "attribution_threads_full",
};

enum Op : std::size_t { kOpReserve, kOpRelease, kOpCleanup, kOpVramSample, kOpCount };
constexpr std::array<std::string_view, kOpCount> kOpNames = {"reserve", "release", "cleanup",
                                                             "vram_sample"};

struct Reservation {
  ProcessKey holder;
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
  std::map<std::uint32_t, StepTime> steps;  // ledger step id -> time
};

struct VramSample {
  std::uint64_t free_bytes = 0;
  std::uint64_t total_bytes = 0;
  std::uint64_t at_ns = 0;
};

struct Gpu {
  std::map<std::uint64_t, Reservation> reservations;
  std::uint64_t reserved_bytes = 0;
  std::uint64_t high_water_bytes = 0;
  std::optional<VramSample> sample;
  bool overcommitted = false;
  std::uint64_t overcommit_events = 0;
  std::array<std::uint64_t, kOpCount> operations{};
  std::map<ProcessKey, ProcessRow> processes;
  // Ledger-step time of all processes, kept when their rows are forgotten so that the
  // metrics counter never goes down.
  std::map<std::uint32_t, StepTime> steps;

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

std::string sanitize_comm(std::string_view comm) {
  std::string out(comm.substr(0, kMaxComm));
  for (char& c : out) {
    if (!proto::is_printable(c)) c = '?';
  }
  return out;
}

json steps_json(const std::map<std::uint32_t, StepTime>& steps) {
  json out = json::array();
  for (const auto& [step, time] : steps) {
    out.push_back({{"step", proto::kBuiltinStepNames[step]},
                   {"count", time.count},
                   {"total_ns", time.total_ns}});
  }
  return out;
}

// Per-process ledger rows of one GPU, as both the report and the snapshot write them.
json processes_json(const Gpu& gpu) {
  json processes = json::array();
  for (const auto& [key, row] : gpu.processes) {
    processes.push_back({{"pid", key.pid},
                         {"start_time", key.start_time},
                         {"comm", row.comm},
                         {"reserves", row.reserves},
                         {"releases", row.releases},
                         {"cleanups", row.cleanups},
                         {"steps", steps_json(row.steps)}});
  }
  return processes;
}

json operations_json(const Gpu& gpu) {
  json operations = json::object();
  for (std::size_t op = 0; op < kOpCount; ++op) {
    operations[std::string(kOpNames[op])] = gpu.operations[op];
  }
  return operations;
}

bool valid_text(std::string_view text, bool allow_empty) {
  if (text.size() > proto::kMaxNameLength) return false;
  if (text.empty() && !allow_empty) return false;
  return std::all_of(text.begin(), text.end(), proto::is_printable);
}

std::optional<std::uint32_t> ledger_step_id(std::string_view name) {
  for (std::uint32_t step = 0; step < proto::kBuiltinStepCount; ++step) {
    if (proto::is_ledger_step(step) && proto::kBuiltinStepNames[step] == name) return step;
  }
  return std::nullopt;
}

double seconds_between(std::uint64_t from_ns, std::uint64_t to_ns) {
  return to_ns > from_ns ? static_cast<double>(to_ns - from_ns) / 1e9 : 0.0;
}

// ---- text (sizes, durations and escaping come from daemon/report/report_format.h) -----------

// An age: 4.20s, 3m 07s, 2h 05m, 3d 04h.
std::string format_age(std::uint64_t from_ns, std::uint64_t now_ns) {
  const std::uint64_t ns = now_ns > from_ns ? now_ns - from_ns : 0;
  const std::uint64_t s = ns / 1'000'000'000;
  char buf[64];
  if (s < 60) {
    std::snprintf(buf, sizeof buf, "%.2fs", static_cast<double>(ns) / 1e9);
  } else if (s < 3600) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "m %02" PRIu64 "s", s / 60, s % 60);
  } else if (s < 86400) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "h %02" PRIu64 "m", s / 3600, s % 3600 / 60);
  } else {
    std::snprintf(buf, sizeof buf, "%" PRIu64 "d %02" PRIu64 "h", s / 86400, s % 86400 / 3600);
  }
  return buf;
}

// Left-aligned columns joined with " | " (as the other reports' tables), widths by
// display width since durations carry "µ"; each row prefixed by `indent`, no trailing
// blanks.
void append_table(std::string& out, std::string_view indent,
                  const std::vector<std::vector<std::string>>& rows) {
  std::vector<std::size_t> widths;
  for (const auto& row : rows) {
    widths.resize(std::max(widths.size(), row.size()));
    for (std::size_t i = 0; i < row.size(); ++i) {
      widths[i] = std::max(widths[i], report::display_width(row[i]));
    }
  }
  for (const auto& row : rows) {
    std::string line(indent);
    for (std::size_t i = 0; i < row.size(); ++i) {
      if (i > 0) line += " | ";
      line += i + 1 < row.size() ? report::pad_right(row[i], widths[i]) : row[i];
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  }
}

// ---- snapshot parsing: no exceptions, every field checked ------------------------------

bool has_exactly(const json& object, std::initializer_list<std::string_view> keys) {
  if (!object.is_object() || object.size() != keys.size()) return false;
  return std::all_of(keys.begin(), keys.end(),
                     [&](std::string_view key) { return object.contains(key); });
}

bool read_u64(const json& object, std::string_view key, std::uint64_t& out) {
  const auto it = object.find(key);
  if (it == object.end()) return false;
  if (it->is_number_unsigned()) {
    out = it->get<std::uint64_t>();
    return true;
  }
  if (it->is_number_integer() && it->get<std::int64_t>() >= 0) {
    out = static_cast<std::uint64_t>(it->get<std::int64_t>());
    return true;
  }
  return false;
}

bool read_string(const json& object, std::string_view key, bool allow_empty, std::string& out) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_string()) return false;
  const auto& text = it->get_ref<const std::string&>();
  if (!valid_text(text, allow_empty)) return false;
  out = text;
  return true;
}

bool read_bool(const json& object, std::string_view key, bool& out) {
  const auto it = object.find(key);
  if (it == object.end() || !it->is_boolean()) return false;
  out = it->get<bool>();
  return true;
}

bool read_process_key(const json& object, ProcessKey& out) {
  std::uint64_t pid = 0;
  if (!read_u64(object, "pid", pid) || pid == 0 ||
      pid > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max())) {
    return false;
  }
  out.pid = static_cast<std::int32_t>(pid);
  return read_u64(object, "start_time", out.start_time);
}

bool read_steps(const json& steps, std::map<std::uint32_t, StepTime>& out) {
  if (!steps.is_array()) return false;
  for (const json& st : steps) {
    if (!has_exactly(st, {"step", "count", "total_ns"}) || !st["step"].is_string()) return false;
    const auto step = ledger_step_id(st["step"].get_ref<const std::string&>());
    StepTime time;
    if (!step || out.contains(*step) || !read_u64(st, "count", time.count) ||
        !read_u64(st, "total_ns", time.total_ns)) {
      return false;
    }
    out.emplace(*step, time);
  }
  return true;
}

}  // namespace

struct LedgerView::State {
  std::map<std::string, Gpu, std::less<>> gpus;
  std::map<ProcessKey, std::map<std::uint32_t, Mark>> marks;
  std::array<std::uint64_t, kAnomalyCount> anomalies{};

  void count(Anomaly kind) { ++anomalies[kind]; }

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

LedgerView::LedgerView(const Limits& limits, DaemonCounters& counters)
    : limits_(limits), counters_(counters), state_(std::make_shared<State>()) {}
LedgerView::LedgerView(const LedgerView& other) = default;
LedgerView::~LedgerView() = default;

LedgerView::State& LedgerView::write_state() {
  if (state_.use_count() > 1) state_ = std::make_shared<State>(*state_);
  return *state_;
}

void LedgerView::apply(const LedgerActor& actor, const proto::LedgerRecord& record,
                       std::uint64_t now_ns) {
  State& s = write_state();
  // The client cut an over-long string: the cut value is not what the caller meant (two
  // long UUIDs could merge into one GPU), so the record is counted and refused.
  const bool uuid_cut = (record.flags & proto::kLedgerGpuUuidTruncated) != 0;
  const bool task_cut = (record.flags & proto::kLedgerTaskTruncated) != 0;
  if (uuid_cut) s.count(kGpuUuidTruncated);
  if (task_cut) s.count(kTaskTruncated);
  if (uuid_cut || task_cut) return;

  // The decoder has validated the record already; the view is keyed by these strings,
  // so it refuses bad ones itself too rather than trusting every caller.
  const std::string_view uuid = proto::field_view(record.gpu_uuid);
  const std::string_view task = proto::field_view(record.task);
  if (!valid_text(uuid, false) || !valid_text(task, true)) {
    s.count(kBadRecord);
    return;
  }
  const std::string comm = sanitize_comm(actor.comm);
  const std::uint64_t at_ns = std::min(record.timestamp_ns, now_ns);

  auto it = s.gpus.find(uuid);
  Gpu* gpu = it == s.gpus.end() ? nullptr : &it->second;
  auto limit_hit = [&](Anomaly kind) {
    s.count(kind);
    ++counters_.limits_hit[std::string(kAnomalyNames[kind])];
  };
  // Creates the GPU on its first reserve or sample; false (counted) past max_gpus.
  auto ensure_gpu = [&]() {
    if (gpu != nullptr) return true;
    if (s.gpus.size() >= limits_.max_gpus) {
      limit_hit(kMaxGpus);
      return false;
    }
    gpu = &s.gpus.emplace(std::string(uuid), Gpu{}).first->second;
    return true;
  };

  switch (static_cast<proto::LedgerOp>(record.op)) {
    case proto::LedgerOp::kReserve: {
      if (record.bytes == 0) {
        s.count(kZeroByteReserve);
        break;
      }
      if (gpu != nullptr && gpu->reservations.contains(record.reservation_id)) {
        s.count(kDuplicateReservation);
        break;
      }
      if ((gpu != nullptr ? gpu->reservations.size() : 0) >= limits_.max_reservations_per_gpu) {
        limit_hit(kMaxReservationsPerGpu);
        return;  // dropped: not even the attribution mark
      }
      if (gpu != nullptr &&
          record.bytes > std::numeric_limits<std::uint64_t>::max() - gpu->reserved_bytes) {
        s.count(kReservedBytesOverflow);
        break;
      }
      if (!ensure_gpu()) return;
      gpu->reservations.emplace(record.reservation_id, Reservation{actor.key, comm, record.bytes,
                                                                   std::string(task), at_ns, true});
      gpu->reserved_bytes += record.bytes;
      gpu->high_water_bytes = std::max(gpu->high_water_bytes, gpu->reserved_bytes);
      ++gpu->operations[kOpReserve];
      if (ProcessRow* row = s.row(*gpu, actor.key, comm, limits_.max_processes)) ++row->reserves;
      s.update_overcommit(*gpu);
      break;
    }
    case proto::LedgerOp::kRelease:
    case proto::LedgerOp::kCleanup: {
      const bool cleanup = record.op == static_cast<std::uint8_t>(proto::LedgerOp::kCleanup);
      if (gpu == nullptr || !gpu->reservations.contains(record.reservation_id)) {
        s.count(cleanup ? kUnknownCleanup : kUnknownRelease);
        break;
      }
      const auto entry = gpu->reservations.find(record.reservation_id);
      if (cleanup && static_cast<std::int64_t>(record.holder_pid) != entry->second.holder.pid) {
        s.count(kCleanupHolderMismatch);  // the ledger removed it anyway; so do we
      }
      gpu->reserved_bytes -= entry->second.bytes;
      gpu->reservations.erase(entry);
      ++gpu->operations[cleanup ? kOpCleanup : kOpRelease];
      if (ProcessRow* row = s.row(*gpu, actor.key, comm, limits_.max_processes)) {
        ++(cleanup ? row->cleanups : row->releases);
      }
      s.update_overcommit(*gpu);
      break;
    }
    case proto::LedgerOp::kVramSample: {
      if (record.total_bytes == 0 || record.bytes > record.total_bytes) {
        s.count(kBadVramSample);
        break;
      }
      if (!ensure_gpu()) return;
      // Samples from several processes may arrive out of order: keep the newest.
      if (!gpu->sample || at_ns >= gpu->sample->at_ns) {
        gpu->sample = VramSample{record.bytes, record.total_bytes, at_ns};
      }
      ++gpu->operations[kOpVramSample];
      s.update_overcommit(*gpu);
      break;
    }
    default:
      s.count(kBadRecord);
      return;
  }

  // Remember where this thread last was, for the ledger-step span that will enclose it.
  // Only for GPUs the view knows, so attribution never creates one.
  if (gpu == nullptr) return;
  // Bounded like the collector's tables; forget_process() frees a process's entry.
  if (!s.marks.contains(actor.key) && s.marks.size() >= limits_.max_processes) {
    s.count(kAttributionThreadsFull);
    return;
  }
  auto& threads = s.marks[actor.key];
  auto mark = threads.find(record.thread_id);
  if (mark == threads.end()) {
    if (threads.size() >= limits_.max_threads_per_process) {
      s.count(kAttributionThreadsFull);
      if (threads.empty()) s.marks.erase(actor.key);
      return;
    }
    mark = threads.emplace(record.thread_id, Mark{}).first;
  }
  mark->second = Mark{std::string(uuid), record.timestamp_ns, comm};
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
  all.total_ns += end_ns - start_ns;
  ProcessRow* row = s.row(gpu->second, process, m.comm, limits_.max_processes);
  if (row == nullptr) return;
  StepTime& time = row->steps[step];
  ++time.count;
  time.total_ns += end_ns - start_ns;
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

void LedgerView::forget_process(const ProcessKey& process) {
  // Its per-GPU rows go too, so memory stays bounded by the collector's process table;
  // reservations it holds stay (they still hold VRAM until a release or cleanup).
  State& s = write_state();
  s.marks.erase(process);
  for (auto& [uuid, gpu] : s.gpus) gpu.processes.erase(process);
}

nlohmann::json LedgerView::to_json(std::uint64_t now_ns) const {
  json gpus = json::array();
  for (const auto& [uuid, gpu] : state_->gpus) {
    json reservations = json::array();
    for (const auto& [id, r] : gpu.reservations) {
      reservations.push_back({{"id", id},
                              {"pid", r.holder.pid},
                              {"start_time", r.holder.start_time},
                              {"comm", r.comm},
                              {"bytes", r.bytes},
                              {"task", r.task},
                              {"holder_alive", r.holder_alive},
                              {"age_s", seconds_between(r.reserved_ns, now_ns)}});
    }
    json processes = processes_json(gpu);
    json operations = operations_json(gpu);
    // Without a sample, total/free/available are unknown: null rather than a false 0.
    json g = {{"gpu", uuid},
              {"total_bytes", nullptr},
              {"free_bytes", nullptr},
              {"reserved_bytes", gpu.reserved_bytes},
              {"available_bytes", nullptr},
              {"high_water_bytes", gpu.high_water_bytes},
              {"sample_age_s", nullptr},
              {"overcommitted", gpu.overcommitted},
              {"overcommit_events", gpu.overcommit_events},
              {"leaked_reservations", gpu.leaked()},
              {"operations", std::move(operations)},
              {"steps", steps_json(gpu.steps)},
              {"reservations", std::move(reservations)},
              {"processes", std::move(processes)}};
    if (gpu.sample) {
      g["total_bytes"] = gpu.sample->total_bytes;
      g["free_bytes"] = gpu.sample->free_bytes;
      // Signed: negative when over-committed.
      const std::uint64_t total = gpu.sample->total_bytes;
      if (total >= gpu.reserved_bytes) {
        g["available_bytes"] = total - gpu.reserved_bytes;
      } else {
        constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
        g["available_bytes"] =
            -static_cast<std::int64_t>(std::min(gpu.reserved_bytes - total, kMax));
      }
      g["sample_age_s"] = seconds_between(gpu.sample->at_ns, now_ns);
    }
    gpus.push_back(std::move(g));
  }
  return json{{"gpus", std::move(gpus)}};
}

std::string LedgerView::to_text(std::uint64_t now_ns) const {
  const auto& gpus = state_->gpus;
  if (gpus.empty()) return "VRAM ledger: empty (no GPU annotated yet)\n";
  std::string out;
  for (const auto& [uuid, gpu] : gpus) {
    if (!out.empty()) out += '\n';
    out += "GPU " + uuid + "\n";
    std::string line = "  total ";
    if (gpu.sample) {
      line += report::format_bytes(gpu.sample->total_bytes) + "   free " +
              report::format_bytes(gpu.sample->free_bytes) + " (sampled " +
              format_age(gpu.sample->at_ns, now_ns) + " ago)";
    } else {
      line += "unknown   free unknown (no VRAM sample)";
    }
    line += "   reserved " + report::format_bytes(gpu.reserved_bytes) + " (high-water " +
            report::format_bytes(gpu.high_water_bytes) + ")   available ";
    if (!gpu.sample) {
      line += "unknown";
    } else if (gpu.overcommitted) {
      line += "none (-" + report::format_bytes(gpu.reserved_bytes - gpu.sample->total_bytes) + ")";
    } else {
      line += report::format_bytes(gpu.sample->total_bytes - gpu.reserved_bytes);
    }
    out += line + "\n";
    if (gpu.overcommitted) {
      out += "  OVERCOMMITTED: " + report::format_bytes(gpu.reserved_bytes) + " reserved exceeds " +
             report::format_bytes(gpu.sample->total_bytes) + " total\n";
    }

    const std::size_t leaked = gpu.leaked();
    out += "  Reservations: " + std::to_string(gpu.reservations.size());
    if (leaked != 0) out += " (" + std::to_string(leaked) + " leaked)";
    out += "\n";
    if (!gpu.reservations.empty()) {
      std::vector<std::vector<std::string>> rows = {
          {"ID", "PID", "Process", "Task", "Size", "Age", "Holder"}};
      for (const auto& [id, r] : gpu.reservations) {
        rows.push_back({std::to_string(id), std::to_string(r.holder.pid), r.comm,
                        r.task.empty() ? "-" : r.task, report::format_bytes(r.bytes),
                        format_age(r.reserved_ns, now_ns), r.holder_alive ? "alive" : "LEAKED"});
      }
      append_table(out, "    ", rows);
    }

    if (!gpu.processes.empty()) {
      out += "  Ledger activity per process:\n";
      std::vector<std::vector<std::string>> rows = {
          {"PID", "Process", "Reserves", "Releases", "Cleanups", "Step", "Count", "Time"}};
      for (const auto& [key, row] : gpu.processes) {
        std::vector<std::string> head = {std::to_string(key.pid), row.comm,
                                         std::to_string(row.reserves), std::to_string(row.releases),
                                         std::to_string(row.cleanups)};
        if (row.steps.empty()) {
          head.push_back("-");
          rows.push_back(std::move(head));
          continue;
        }
        bool first = true;
        for (const auto& [step, time] : row.steps) {
          std::vector<std::string> cells =
              first ? head : std::vector<std::string>{"", "", "", "", ""};
          cells.insert(cells.end(),
                       {std::string(proto::kBuiltinStepNames[step]), std::to_string(time.count),
                        report::format_duration(time.total_ns)});
          rows.push_back(std::move(cells));
          first = false;
        }
      }
      append_table(out, "    ", rows);
    }
  }
  return out;
}

void LedgerView::append_metrics(std::string& out) const {
  using report::MetricFamily;
  const auto& gpus = state_->gpus;
  struct Gauge {
    std::string_view name;
    std::string_view help;
    std::optional<std::uint64_t> (*value)(const Gpu&);
  };
  static constexpr Gauge kGauges[] = {
      {"steptrace_gpu_reserved_bytes", "Bytes reserved in the VRAM ledger.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.reserved_bytes; }},
      {"steptrace_gpu_reserved_high_water_bytes", "Highest reserved bytes seen in the VRAM ledger.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.high_water_bytes; }},
      {"steptrace_gpu_free_bytes", "Free VRAM bytes at the last sample.",
       [](const Gpu& g) -> std::optional<std::uint64_t> {
         if (!g.sample) return std::nullopt;
         return g.sample->free_bytes;
       }},
      {"steptrace_gpu_total_bytes", "Total VRAM bytes at the last sample.",
       [](const Gpu& g) -> std::optional<std::uint64_t> {
         if (!g.sample) return std::nullopt;
         return g.sample->total_bytes;
       }},
      {"steptrace_gpu_reservations", "Reservations held in the VRAM ledger.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.reservations.size(); }},
      {"steptrace_gpu_leaked_reservations",
       "Reservations whose holder exited without releasing them.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.leaked(); }},
      {"steptrace_gpu_overcommitted", "1 when reserved bytes exceed the sampled total.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.overcommitted ? 1 : 0; }},
  };
  for (const Gauge& gauge : kGauges) {
    MetricFamily family(out, gauge.name, "gauge", gauge.help);
    for (const auto& [uuid, gpu] : gpus) {
      if (const auto value = gauge.value(gpu)) family.sample({{"gpu", uuid}}, *value);
    }
  }
  {
    MetricFamily family(out, "steptrace_ledger_operations_total", "counter",
                        "VRAM ledger operations applied, by GPU and op.");
    for (const auto& [uuid, gpu] : gpus) {
      for (std::size_t op = 0; op < kOpCount; ++op) {
        family.sample({{"gpu", uuid}, {"op", kOpNames[op]}}, gpu.operations[op]);
      }
    }
  }
  {
    MetricFamily seconds(out, "steptrace_ledger_step_seconds_total", "counter",
                         "Time in ledger-step spans attributed to the GPU, by step.");
    for (const auto& [uuid, gpu] : gpus) {
      for (const auto& [step, time] : gpu.steps) {
        seconds.sample({{"gpu", uuid}, {"step", proto::kBuiltinStepNames[step]}},
                       static_cast<double>(time.total_ns) / 1e9);
      }
    }
  }
  {
    MetricFamily spans(out, "steptrace_ledger_step_spans_total", "counter",
                       "Ledger-step spans attributed to the GPU, by step.");
    for (const auto& [uuid, gpu] : gpus) {
      for (const auto& [step, time] : gpu.steps) {
        spans.sample({{"gpu", uuid}, {"step", proto::kBuiltinStepNames[step]}}, time.count);
      }
    }
  }
  MetricFamily anomalies(out, "steptrace_ledger_anomalies_total", "counter",
                         "VRAM ledger anomalies, by kind.");
  for (std::size_t kind = 0; kind < kAnomalyCount; ++kind) {
    anomalies.sample({{"kind", kAnomalyNames[kind]}}, state_->anomalies[kind]);
  }
}

nlohmann::json LedgerView::anomalies_json() const {
  json out = json::object();
  for (std::size_t kind = 0; kind < kAnomalyCount; ++kind) {
    out[std::string(kAnomalyNames[kind])] = state_->anomalies[kind];
  }
  return out;
}

nlohmann::json LedgerView::snapshot() const {
  json gpus = json::array();
  for (const auto& [uuid, gpu] : state_->gpus) {
    json reservations = json::array();
    for (const auto& [id, r] : gpu.reservations) {
      reservations.push_back({{"id", id},
                              {"pid", r.holder.pid},
                              {"start_time", r.holder.start_time},
                              {"comm", r.comm},
                              {"bytes", r.bytes},
                              {"task", r.task},
                              {"reserved_ns", r.reserved_ns},
                              {"holder_alive", r.holder_alive}});
    }
    json processes = processes_json(gpu);
    json operations = operations_json(gpu);
    json sample = nullptr;
    if (gpu.sample) {
      sample = {{"free_bytes", gpu.sample->free_bytes},
                {"total_bytes", gpu.sample->total_bytes},
                {"at_ns", gpu.sample->at_ns}};
    }
    gpus.push_back({{"gpu", uuid},
                    {"high_water_bytes", gpu.high_water_bytes},
                    {"sample", std::move(sample)},
                    {"overcommit_events", gpu.overcommit_events},
                    {"operations", std::move(operations)},
                    {"steps", steps_json(gpu.steps)},
                    {"reservations", std::move(reservations)},
                    {"processes", std::move(processes)}});
  }
  return json{
      {"version", kSnapshotVersion}, {"gpus", std::move(gpus)}, {"anomalies", anomalies_json()}};
}

std::error_code LedgerView::restore(const nlohmann::json& doc) {
  const std::error_code bad = make_error_code(errc::bad_config);
  if (!has_exactly(doc, {"version", "gpus", "anomalies"})) return bad;
  if (!doc["version"].is_number_integer() ||
      doc["version"].get<std::int64_t>() != kSnapshotVersion) {
    return bad;
  }
  const json& gpus = doc["gpus"];
  if (!gpus.is_array() || gpus.size() > limits_.max_gpus) return bad;

  auto next = std::make_unique<State>();
  for (const json& g : gpus) {
    if (!has_exactly(g, {"gpu", "high_water_bytes", "sample", "overcommit_events", "operations",
                         "steps", "reservations", "processes"})) {
      return bad;
    }
    std::string uuid;
    if (!read_string(g, "gpu", false, uuid) || next->gpus.contains(uuid)) return bad;
    Gpu gpu;
    if (!read_u64(g, "high_water_bytes", gpu.high_water_bytes) ||
        !read_u64(g, "overcommit_events", gpu.overcommit_events)) {
      return bad;
    }
    const json& sample = g["sample"];
    if (!sample.is_null()) {
      VramSample v;
      if (!has_exactly(sample, {"free_bytes", "total_bytes", "at_ns"}) ||
          !read_u64(sample, "free_bytes", v.free_bytes) ||
          !read_u64(sample, "total_bytes", v.total_bytes) || !read_u64(sample, "at_ns", v.at_ns) ||
          v.total_bytes == 0 || v.free_bytes > v.total_bytes) {
        return bad;
      }
      gpu.sample = v;
    }
    const json& operations = g["operations"];
    if (!operations.is_object() || operations.size() != kOpCount) return bad;
    for (std::size_t op = 0; op < kOpCount; ++op) {
      if (!read_u64(operations, kOpNames[op], gpu.operations[op])) return bad;
    }

    if (!read_steps(g["steps"], gpu.steps)) return bad;

    const json& reservations = g["reservations"];
    if (!reservations.is_array() || reservations.size() > limits_.max_reservations_per_gpu) {
      return bad;
    }
    for (const json& r : reservations) {
      if (!has_exactly(r, {"id", "pid", "start_time", "comm", "bytes", "task", "reserved_ns",
                           "holder_alive"})) {
        return bad;
      }
      std::uint64_t id = 0;
      Reservation res;
      if (!read_u64(r, "id", id) || gpu.reservations.contains(id) ||
          !read_process_key(r, res.holder) || !read_string(r, "comm", true, res.comm) ||
          !read_u64(r, "bytes", res.bytes) || res.bytes == 0 ||
          !read_string(r, "task", true, res.task) || !read_u64(r, "reserved_ns", res.reserved_ns) ||
          !read_bool(r, "holder_alive", res.holder_alive)) {
        return bad;
      }
      if (res.bytes > std::numeric_limits<std::uint64_t>::max() - gpu.reserved_bytes) return bad;
      gpu.reserved_bytes += res.bytes;
      gpu.reservations.emplace(id, std::move(res));
    }
    if (gpu.high_water_bytes < gpu.reserved_bytes) return bad;
    gpu.overcommitted = gpu.sample && gpu.reserved_bytes > gpu.sample->total_bytes;

    const json& processes = g["processes"];
    if (!processes.is_array() || processes.size() > limits_.max_processes) return bad;
    for (const json& p : processes) {
      if (!has_exactly(
              p, {"pid", "start_time", "comm", "reserves", "releases", "cleanups", "steps"})) {
        return bad;
      }
      ProcessKey key;
      ProcessRow row;
      if (!read_process_key(p, key) || gpu.processes.contains(key) ||
          !read_string(p, "comm", true, row.comm) || !read_u64(p, "reserves", row.reserves) ||
          !read_u64(p, "releases", row.releases) || !read_u64(p, "cleanups", row.cleanups)) {
        return bad;
      }
      if (!read_steps(p["steps"], row.steps)) return bad;
      gpu.processes.emplace(key, std::move(row));
    }
    next->gpus.emplace(std::move(uuid), std::move(gpu));
  }

  const json& anomalies = doc["anomalies"];
  if (!anomalies.is_object()) return bad;
  for (const auto& [name, value] : anomalies.items()) {
    const auto kind = std::find(kAnomalyNames.begin(), kAnomalyNames.end(), name);
    if (kind == kAnomalyNames.end()) return bad;
    if (!read_u64(anomalies, name,
                  next->anomalies[static_cast<std::size_t>(kind - kAnomalyNames.begin())])) {
      return bad;
    }
  }

  state_ = std::move(next);
  return {};
}

}  // namespace steptrace::daemon
