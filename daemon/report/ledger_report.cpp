// The VRAM ledger's renderers: `ledger`, `ledger --json`, its Prometheus families and
// the anomaly counts of `stats`, as functions of a ledger state (ledger_state.h) that a
// CollectorView holds frozen, so they run on the render thread.
#include "daemon/report/ledger_report.h"

#include <algorithm>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/report/report_format.h"
#include "daemon/state/collector.h"
#include "daemon/state/ledger_state.h"
#include "proto/printable.h"

namespace steptrace::daemon::report {
namespace {

using nlohmann::json;
using namespace ledger;

// A GPU's ledger rows in `ledger --json`: [{"step", "count", "total_ns"}, ...],
// [{"pid", "start_time", "uid", "comm", "reserves", "releases", "cleanups", "renews",
// "refused", "steps", "exited", "exited_ago_s"}, ...] and {"reserve": n, "release": n, "cleanup":
// n, "vram_sample": n, "renew": n}. The snapshot writes its own (persist/snapshot_codec.cpp).
json steps_json(const std::map<std::uint32_t, StepTime>& steps) {
  json out = json::array();
  for (const auto& [step, time] : steps) {
    out.push_back({{"step", proto::kBuiltinStepNames[step]},
                   {"count", time.count},
                   {"total_ns", time.total_ns}});
  }
  return out;
}

// A uid for the JSON documents: null when unknown (restored from an older snapshot).
json uid_json(std::uint32_t uid) { return uid == kUnknownUid ? json(nullptr) : json(uid); }

double seconds_between(std::uint64_t from_ns, std::uint64_t to_ns) {
  return to_ns > from_ns ? static_cast<double>(to_ns - from_ns) / 1e9 : 0.0;
}

json processes_json(const Gpu& gpu, std::uint64_t now_ns) {
  json processes = json::array();
  for (const auto& [key, row] : gpu.processes) {
    processes.push_back(
        {{"pid", key.pid},
         {"start_time", key.start_time},
         {"uid", uid_json(row.uid)},
         {"comm", row.comm},
         {"reserves", row.reserves},
         {"releases", row.releases},
         {"cleanups", row.cleanups},
         {"renews", row.renews},
         {"refused", row.refused},
         {"steps", steps_json(row.steps)},
         {"exited", row.exited_ns != 0},
         {"exited_ago_s",
          row.exited_ns == 0 ? json(nullptr) : json(seconds_between(row.exited_ns, now_ns))}});
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

// A reservation's state in every output: LEAKED (holder dead), EXPIRED (its lease passed
// unrenewed while the holder lives), else alive.
const char* reservation_state(const Reservation& r) {
  if (!r.holder_alive) return "LEAKED";
  return r.expired ? "EXPIRED" : "alive";
}

// The lease column: "-" without one, "12.00s left of 30.00s", "passed (30.00s)".
std::string lease_text(const Reservation& r, std::uint64_t now_ns) {
  if (r.lease_ms == 0) return "-";
  const std::uint64_t len_ns = r.lease_ms * 1'000'000;
  if (r.expired || now_ns >= r.lease_deadline_ns) return "passed (" + format_age(0, len_ns) + ")";
  return format_age(now_ns, r.lease_deadline_ns) + " left of " + format_age(0, len_ns);
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
      widths[i] = std::max(widths[i], display_width(row[i]));
    }
  }
  for (const auto& row : rows) {
    std::string line(indent);
    for (std::size_t i = 0; i < row.size(); ++i) {
      if (i > 0) line += " | ";
      line += i + 1 < row.size() ? pad_right(row[i], widths[i]) : row[i];
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  }
}

}  // namespace

// Every GPU the ledger or the device knows, in UUID order; a device-only GPU with an
// empty ledger entry.
std::vector<std::pair<std::string_view, const ledger::Gpu*>> all_gpus(const ledger::State& state) {
  static const ledger::Gpu kEmpty;
  std::vector<std::pair<std::string_view, const ledger::Gpu*>> out;
  for (const auto& [uuid, gpu] : state.gpus) out.emplace_back(uuid, &gpu);
  for (const auto& [uuid, device] : state.devices) {
    if (!state.gpus.contains(uuid)) out.emplace_back(uuid, &kEmpty);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Total and free bytes, and where they come from: the device (NVML) when it reported
// this GPU, else the last VramSample a client sent.
struct Capacity {
  std::uint64_t total = 0;
  std::uint64_t free = 0;
  std::uint64_t at_ns = 0;
  const char* source = "device";
};
std::optional<Capacity> capacity(const ledger::State& state, std::string_view uuid,
                                 const ledger::Gpu& gpu) {
  if (const auto d = state.devices.find(uuid); d != state.devices.end()) {
    return Capacity{d->second.total_bytes, d->second.free_bytes, d->second.at_ns, "device"};
  }
  if (gpu.sample) {
    return Capacity{gpu.sample->total_bytes, gpu.sample->free_bytes, gpu.sample->at_ns, "client"};
  }
  return std::nullopt;
}

json findings_json(const std::vector<ledger::Finding>& findings) {
  json out = json::array();
  for (const ledger::Finding& f : findings) {
    json j = {{"kind", ledger::kFindingNames[f.kind]},
              {"pid", f.pid},
              {"used_bytes", f.used_bytes},
              {"reserved_bytes", f.reserved_bytes}};
    if (f.kind == ledger::Finding::kIdle) j["reservation_id"] = f.reservation_id;
    if (f.kind == ledger::Finding::kGhost) {
      j["note"] = "pid not visible to the daemon: exited, or in another pid namespace (container)";
    }
    out.push_back(std::move(j));
  }
  return out;
}

json device_json(const ledger::Device& d, std::uint64_t now_ns) {
  json processes = json::array();
  for (const ledger::DeviceProcess& p : d.processes) {
    processes.push_back({{"pid", p.pid},
                         {"used_bytes", p.used_bytes ? json(*p.used_bytes) : json(nullptr)},
                         {"visible", p.visible}});
  }
  return {{"name", d.name},
          {"total_bytes", d.total_bytes},
          {"used_bytes", d.used_bytes},
          {"free_bytes", d.free_bytes},
          {"sample_age_s", seconds_between(d.at_ns, now_ns)},
          {"processes_known", d.processes_known},
          {"processes", std::move(processes)}};
}

nlohmann::json ledger_json(const ledger::State& state, std::uint64_t now_ns) {
  json gpus = json::array();
  for (const auto& [uuid, gpu_ptr] : all_gpus(state)) {
    const ledger::Gpu& gpu = *gpu_ptr;
    json reservations = json::array();
    for (const auto& [id, r] : gpu.reservations) {
      reservations.push_back(
          {{"id", id},
           {"pid", r.holder.pid},
           {"start_time", r.holder.start_time},
           {"uid", uid_json(r.uid)},
           {"comm", r.comm},
           {"bytes", r.bytes},
           {"task", r.task},
           {"holder_alive", r.holder_alive},
           {"age_s", seconds_between(r.reserved_ns, now_ns)},
           {"lease_ms", r.lease_ms == 0 ? json(nullptr) : json(r.lease_ms)},
           {"lease_left_s",
            r.lease_ms == 0 ? json(nullptr) : json(seconds_between(now_ns, r.lease_deadline_ns))},
           {"expired", r.expired},
           {"state", reservation_state(r)}});
    }
    json processes = processes_json(gpu, now_ns);
    json operations = operations_json(gpu);
    // Without a sample, total/free/available are unknown: null rather than a false 0.
    json g = {{"gpu", uuid},
              {"creator_uid", uid_json(gpu.creator_uid)},
              {"total_bytes", nullptr},
              {"free_bytes", nullptr},
              {"reserved_bytes", gpu.reserved_bytes},
              {"available_bytes", nullptr},
              {"high_water_bytes", gpu.high_water_bytes},
              {"sample_age_s", nullptr},
              {"overcommitted", gpu.overcommitted},
              {"overcommit_events", gpu.overcommit_events},
              {"leaked_reservations", gpu.leaked()},
              {"expired_reservations", gpu.expired()},
              {"operations", std::move(operations)},
              {"steps", steps_json(gpu.steps)},
              {"reservations", std::move(reservations)},
              {"processes", std::move(processes)}};
    g["capacity_source"] = nullptr;
    g["device"] = nullptr;
    if (const auto d = state.devices.find(uuid); d != state.devices.end()) {
      g["device"] = device_json(d->second, now_ns);
    }
    g["findings"] = findings_json(ledger::device_findings(state, uuid, now_ns));
    if (const auto cap = capacity(state, uuid, gpu)) {
      g["capacity_source"] = cap->source;
      g["total_bytes"] = cap->total;
      g["free_bytes"] = cap->free;
      // Signed: negative when over-committed.
      const std::uint64_t total = cap->total;
      if (total >= gpu.reserved_bytes) {
        g["available_bytes"] = total - gpu.reserved_bytes;
      } else {
        constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
        g["available_bytes"] =
            -static_cast<std::int64_t>(std::min(gpu.reserved_bytes - total, kMax));
      }
      g["sample_age_s"] = seconds_between(cap->at_ns, now_ns);
    }
    gpus.push_back(std::move(g));
  }
  json out = {{"gpus", std::move(gpus)}};
  if (!state.device_error.empty()) out["device_error"] = state.device_error;
  return out;
}

namespace {

// One line of a finding under its GPU's device line, e.g. "  OVER: pid 12 uses ...".
std::string finding_text(const ledger::Finding& f) {
  std::string line =
      "  " + std::string(ledger::kFindingNames[f.kind]) + ": pid " + std::to_string(f.pid) + " ";
  switch (f.kind) {
    case ledger::Finding::kUndeclared:
      line += "uses " + format_bytes(f.used_bytes) + " with no reservation on this GPU";
      break;
    case ledger::Finding::kOver:
      line += "uses " + format_bytes(f.used_bytes) + ", reserved " + format_bytes(f.reserved_bytes);
      break;
    case ledger::Finding::kIdle:
      line += "holds reservation " + std::to_string(f.reservation_id) + " (" +
              format_bytes(f.reserved_bytes) + ") and uses no memory on it";
      break;
    default:
      line += "uses " + format_bytes(f.used_bytes) +
              " but is not visible here (exited, or in another container)";
      break;
  }
  return line + "\n";
}

// What NVML says of the GPU, and where the declarations disagree with it.
void append_device_text(std::string& out, const ledger::State& state, std::string_view uuid,
                        const ledger::Device& dev, std::uint64_t now_ns) {
  out += "  device " + proto::printable(dev.name) + ": used " + format_bytes(dev.used_bytes) +
         " of " + format_bytes(dev.total_bytes) + "   free " + format_bytes(dev.free_bytes) +
         " (NVML, sampled " + format_age(dev.at_ns, now_ns) + " ago)\n";
  for (const ledger::Finding& f : ledger::device_findings(state, uuid, now_ns)) {
    out += finding_text(f);
  }
}

// "  total ... free ... reserved ... available ...", and the OVERCOMMITTED line.
void append_capacity_text(std::string& out, const ledger::State& state, std::string_view uuid,
                          const ledger::Gpu& gpu, std::uint64_t now_ns) {
  std::string line = "  total ";
  const auto cap = capacity(state, uuid, gpu);
  if (cap) {
    line += format_bytes(cap->total) + "   free " + format_bytes(cap->free) + " (" +
            (std::string_view(cap->source) == "device" ? "NVML, " : "") + "sampled " +
            format_age(cap->at_ns, now_ns) + " ago)";
  } else {
    line += "unknown   free unknown (no VRAM sample)";
  }
  line += "   reserved " + format_bytes(gpu.reserved_bytes) + " (high-water " +
          format_bytes(gpu.high_water_bytes) + ")   available ";
  if (!cap) {
    line += "unknown";
  } else if (gpu.reserved_bytes > cap->total) {
    line += "none (-" + format_bytes(gpu.reserved_bytes - cap->total) + ")";
  } else {
    line += format_bytes(cap->total - gpu.reserved_bytes);
  }
  out += line + "\n";
  if (gpu.overcommitted && cap) {
    out += "  OVERCOMMITTED: " + format_bytes(gpu.reserved_bytes) + " reserved exceeds " +
           format_bytes(cap->total) + " total\n";
  }
}

// "  Reservations: n (k leaked, m expired)" and their table.
void append_reservations_text(std::string& out, const ledger::Gpu& gpu, std::uint64_t now_ns) {
  const std::size_t leaked = gpu.leaked();
  const std::size_t expired = gpu.expired();
  out += "  Reservations: " + std::to_string(gpu.reservations.size());
  if (leaked != 0 && expired != 0) {
    out += " (" + std::to_string(leaked) + " leaked, " + std::to_string(expired) + " expired)";
  } else if (leaked != 0 || expired != 0) {
    out += " (" + std::to_string(leaked + expired) + (leaked != 0 ? " leaked)" : " expired)");
  }
  out += "\n";
  if (gpu.reservations.empty()) return;
  std::vector<std::vector<std::string>> rows = {
      {"ID", "PID", "Process", "Task", "Size", "Age", "Lease", "Holder"}};
  for (const auto& [id, r] : gpu.reservations) {
    rows.push_back({std::to_string(id), std::to_string(r.holder.pid), proto::printable(r.comm),
                    r.task.empty() ? "-" : proto::printable(r.task), format_bytes(r.bytes),
                    format_age(r.reserved_ns, now_ns), lease_text(r, now_ns),
                    reservation_state(r)});
  }
  append_table(out, "    ", rows);
}

// "  Ledger activity per process:": each process's operations, then one row per ledger
// step it spent time in.
void append_activity_text(std::string& out, const ledger::Gpu& gpu) {
  if (gpu.processes.empty()) return;
  out += "  Ledger activity per process:\n";
  std::vector<std::vector<std::string>> rows = {
      {"PID", "Process", "Reserves", "Releases", "Cleanups", "Refused", "Step", "Count", "Time"}};
  for (const auto& [key, row] : gpu.processes) {
    std::vector<std::string> head = {std::to_string(key.pid),      proto::printable(row.comm),
                                     std::to_string(row.reserves), std::to_string(row.releases),
                                     std::to_string(row.cleanups), std::to_string(row.refused)};
    if (row.steps.empty()) {
      head.push_back("-");
      rows.push_back(std::move(head));
      continue;
    }
    bool first = true;
    for (const auto& [step, time] : row.steps) {
      std::vector<std::string> cells =
          first ? head : std::vector<std::string>{"", "", "", "", "", ""};
      cells.insert(cells.end(), {std::string(proto::kBuiltinStepNames[step]),
                                 std::to_string(time.count), format_duration(time.total_ns)});
      rows.push_back(std::move(cells));
      first = false;
    }
  }
  append_table(out, "    ", rows);
}

}  // namespace

std::string ledger_text(const ledger::State& state, std::uint64_t now_ns) {
  const auto gpus = all_gpus(state);
  if (gpus.empty()) {
    return "VRAM ledger: empty (no GPU annotated yet)\n" +
           (state.device_error.empty() ? std::string()
                                       : "NVML: " + proto::printable(state.device_error) + "\n");
  }
  std::string out;
  if (!state.device_error.empty()) out += "NVML: " + proto::printable(state.device_error) + "\n\n";
  for (const auto& [uuid, gpu_ptr] : gpus) {
    const ledger::Gpu& gpu = *gpu_ptr;
    if (!out.empty()) out += '\n';
    // The view refuses UUIDs, tasks and names that are not printable ASCII, but a text
    // report sanitises every client-chosen string itself rather than rely on that.
    out += "GPU " + proto::printable(uuid) + "\n";
    if (const auto d = state.devices.find(uuid); d != state.devices.end()) {
      append_device_text(out, state, uuid, d->second, now_ns);
    }
    append_capacity_text(out, state, uuid, gpu, now_ns);
    append_reservations_text(out, gpu, now_ns);
    append_activity_text(out, gpu);
  }
  return out;
}

namespace {

// Per GPU of the ledger: reserved bytes and their high water, the last client sample,
// the reservations and the over-commit flag.
void append_gpu_gauges(const ledger::State& state, std::string& out) {
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
      {"steptrace_gpu_expired_reservations",
       "Reservations whose lease passed unrenewed while their holder lives.",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.expired(); }},
      {"steptrace_gpu_overcommitted",
       "1 when reserved bytes exceed the total (NVML's, else the last client sample's).",
       [](const Gpu& g) -> std::optional<std::uint64_t> { return g.overcommitted ? 1 : 0; }},
  };
  for (const Gauge& gauge : kGauges) {
    MetricFamily family(out, gauge.name, "gauge", gauge.help);
    for (const auto& [uuid, gpu] : state.gpus) {
      if (const auto value = gauge.value(gpu)) family.sample({{"gpu", uuid}}, *value);
    }
  }
}

// Per GPU: the ledger operations applied, and the time and spans of the ledger steps
// attributed to it.
void append_ledger_activity_metrics(const ledger::State& state, std::string& out) {
  const auto& gpus = state.gpus;
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
  MetricFamily spans(out, "steptrace_ledger_step_spans_total", "counter",
                     "Ledger-step spans attributed to the GPU, by step.");
  for (const auto& [uuid, gpu] : gpus) {
    for (const auto& [step, time] : gpu.steps) {
      spans.sample({{"gpu", uuid}, {"step", proto::kBuiltinStepNames[step]}}, time.count);
    }
  }
}

// What NVML reports, labelled gpu_uuid like DCGM exporter's UUID label (a join is
// `... * on(gpu_uuid) group_left label_replace(DCGM_FI_DEV_FB_USED, "gpu_uuid", "$1",
// "UUID", "(.*)")`), and the findings against it; absent without NVML.
void append_device_metrics(const ledger::State& state, std::string& out) {
  struct DeviceGauge {
    std::string_view name;
    std::string_view help;
    std::uint64_t ledger::Device::*field;
  };
  static constexpr DeviceGauge kDeviceGauges[] = {
      {"steptrace_gpu_device_total_bytes", "Total VRAM as NVML reports it.",
       &ledger::Device::total_bytes},
      {"steptrace_gpu_device_used_bytes", "Used VRAM as NVML reports it.",
       &ledger::Device::used_bytes},
      {"steptrace_gpu_device_free_bytes", "Free VRAM as NVML reports it.",
       &ledger::Device::free_bytes},
  };
  for (const DeviceGauge& gauge : kDeviceGauges) {
    MetricFamily family(out, gauge.name, "gauge", gauge.help);
    for (const auto& [uuid, device] : state.devices) {
      family.sample({{"gpu_uuid", uuid}}, device.*gauge.field);
    }
  }
  MetricFamily findings(out, "steptrace_gpu_findings", "gauge",
                        "Declared versus actual VRAM disagreements now, by GPU and kind: "
                        "UNDECLARED, OVER, IDLE, GHOST (0 for each kind of every sampled GPU).");
  for (const auto& [uuid, device] : state.devices) {
    std::array<std::uint64_t, ledger::Finding::kKindCount> counts{};
    // The metrics render has no clock of its own: IDLE is judged at the sample's time.
    for (const ledger::Finding& f : ledger::device_findings(state, uuid, device.at_ns)) {
      ++counts[f.kind];
    }
    for (std::size_t k = 0; k < counts.size(); ++k) {
      findings.sample({{"gpu_uuid", uuid}, {"kind", ledger::kFindingNames[k]}}, counts[k]);
    }
  }
}

}  // namespace

void append_ledger_metrics(const ledger::State& state, std::string& out) {
  append_gpu_gauges(state, out);
  append_ledger_activity_metrics(state, out);
  append_device_metrics(state, out);
  MetricFamily anomalies(out, "steptrace_ledger_anomalies_total", "counter",
                         "VRAM ledger anomalies, by kind.");
  for (std::size_t kind = 0; kind < kAnomalyCount; ++kind) {
    anomalies.sample({{"kind", kAnomalyNames[kind]}}, state.anomalies[kind]);
  }
}

nlohmann::json ledger_anomalies_json(const ledger::State& state) {
  json out = json::object();
  for (std::size_t kind = 0; kind < kAnomalyCount; ++kind) {
    out[std::string(kAnomalyNames[kind])] = state.anomalies[kind];
  }
  return out;
}

std::string cleanup_reply(const CleanupOutcome& outcome, std::string_view gpu, std::uint64_t id,
                          std::int32_t sender_pid) {
  using Result = CleanupOutcome::Result;
  const std::string where =
      "reservation " + std::to_string(id) + " on GPU '" + proto::printable(gpu) + "'";
  const std::string holder =
      "pid " + std::to_string(outcome.holder_pid) +
      (outcome.holder_uid == kUnknownUid ? "" : ", uid " + std::to_string(outcome.holder_uid));
  switch (outcome.result) {
    case Result::kNoReservation:
      return "error: no " + where + "\n";
    case Result::kBadGpu:
      return "error: bad GPU UUID\n";
    case Result::kDenied:
      return "error: permission denied: " + where + " is held by " + holder +
             ", alive and not expired; only root, its holder's uid or the holder may clean it "
             "up (counted as cleanup_refused)\n";
    case Result::kCleaned:
      break;
  }
  const char* state = outcome.holder == CleanupOutcome::Holder::kLeaked    ? "LEAKED"
                      : outcome.holder == CleanupOutcome::Holder::kExpired ? "EXPIRED"
                                                                           : "alive";
  return "ok: " + where + " (" + state + ", held by " + holder + ") cleaned up, credited to pid " +
         std::to_string(sender_pid) + "\n";
}

}  // namespace steptrace::daemon::report
