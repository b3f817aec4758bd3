// The snapshot's sections that stand on their own (daemon/persist/snapshot_codec.h: the
// "ledger" section and each "histogram"), and the pieces of the reader that the whole
// document shares with them (snapshot_sections.h).
#include "daemon/persist/snapshot_sections.h"

#include <array>
#include <limits>
#include <map>
#include <utility>

#include <nlohmann/json.hpp>

#include "daemon/persist/snapshot_codec.h"
#include "daemon/state/ledger_view.h"

namespace steptrace::daemon {
namespace snapshot_detail {
namespace {

using nlohmann::json;

constexpr std::uint64_t kLedgerVersion = 1;
constexpr std::uint64_t kMaxPid = std::numeric_limits<std::int32_t>::max();
constexpr StringRule kLedgerTextRule{0, proto::kMaxNameLength};  // comm, task

// ---- the ledger section --------------------------------------------------------------------

// A GPU's ledger rows as a snapshot keeps them: the same shape as `ledger --json`'s
// (version 1 wrote them with the report's functions), but written here, so a report
// field renamed changes no snapshot.
constexpr std::array<std::string_view, ledger::kOpCount> kOpKeys = {"reserve", "release", "cleanup",
                                                                    "vram_sample", "renew"};

json ledger_steps_json(const std::map<std::uint32_t, ledger::StepTime>& steps) {
  json out = json::array();
  for (const auto& [step, time] : steps) {
    out.push_back({{"step", proto::kBuiltinStepNames[step]},
                   {"count", time.count},
                   {"total_ns", time.total_ns}});
  }
  return out;
}

json ledger_processes_json(const ledger::Gpu& gpu) {
  json processes = json::array();
  for (const auto& [key, row] : gpu.processes) {
    processes.push_back({{"pid", key.pid},
                         {"start_time", key.start_time},
                         {"comm", row.comm},
                         {"reserves", row.reserves},
                         {"releases", row.releases},
                         {"cleanups", row.cleanups},
                         {"renews", row.renews},
                         {"refused", row.refused},
                         {"uid", row.uid},
                         {"exited_ns", row.exited_ns},
                         {"steps", ledger_steps_json(row.steps)}});
  }
  return processes;
}

json ledger_operations_json(const ledger::Gpu& gpu) {
  json operations = json::object();
  for (std::size_t op = 0; op < kOpKeys.size(); ++op) {
    operations[std::string(kOpKeys[op])] = gpu.operations[op];
  }
  return operations;
}

}  // namespace

json ledger_json(const ledger::State& state) {
  json gpus = json::array();
  for (const auto& [uuid, gpu] : state.gpus) {
    json reservations = json::array();
    for (const auto& [id, r] : gpu.reservations) {
      reservations.push_back({{"id", id},
                              {"pid", r.holder.pid},
                              {"start_time", r.holder.start_time},
                              {"uid", r.uid},
                              {"comm", r.comm},
                              {"bytes", r.bytes},
                              {"task", r.task},
                              {"reserved_ns", r.reserved_ns},
                              {"holder_alive", r.holder_alive},
                              {"lease_ms", r.lease_ms},
                              {"lease_deadline_ns", r.lease_deadline_ns},
                              {"expired", r.expired}});
    }
    json sample = nullptr;
    if (gpu.sample) {
      sample = {{"free_bytes", gpu.sample->free_bytes},
                {"total_bytes", gpu.sample->total_bytes},
                {"at_ns", gpu.sample->at_ns}};
    }
    gpus.push_back({{"gpu", uuid},
                    {"creator_uid", gpu.creator_uid},
                    {"high_water_bytes", gpu.high_water_bytes},
                    {"sample", std::move(sample)},
                    {"client_total_bytes", gpu.client_total.value_or(0)},
                    {"client_total_uid", gpu.client_total_uid},
                    {"overcommit_events", gpu.overcommit_events},
                    {"operations", ledger_operations_json(gpu)},
                    {"steps", ledger_steps_json(gpu.steps)},
                    {"reservations", std::move(reservations)},
                    {"processes", ledger_processes_json(gpu)}});
  }
  json anomalies = json::object();
  for (std::size_t kind = 0; kind < ledger::kAnomalyCount; ++kind) {
    anomalies[std::string(ledger::kAnomalyNames[kind])] = state.anomalies[kind];
  }
  return json{{"version", kLedgerVersion}, {"gpus", std::move(gpus)}, {"anomalies", anomalies}};
}

namespace {

// [{"step": a ledger step's name, "count", "total_ns"}, ...], each step at most once.
bool read_ledger_steps(JsonArray steps, std::map<std::uint32_t, ledger::StepTime>& out) {
  for (std::size_t i = 0; i < steps.size(); ++i) {
    JsonObject s = steps.object(i);
    std::string name;
    if (!s.get_string("step", name, kNameRule)) return false;
    std::optional<std::uint32_t> step;
    for (std::uint32_t id = 0; id < proto::kBuiltinStepCount; ++id) {
      if (proto::is_ledger_step(id) && proto::kBuiltinStepNames[id] == name) step = id;
    }
    if (!step) return s.fail_at("step", "\"" + name + "\" is not a ledger step");
    if (out.contains(*step)) return s.fail_at("step", "\"" + name + "\" appears twice");
    ledger::StepTime time;
    s.get_unsigned("count", time.count);
    s.get_unsigned("total_ns", time.total_ns);
    if (!s.finish()) return false;
    out.emplace(*step, time);
  }
  return steps.ok();
}

bool read_reservation(JsonObject r, ledger::Gpu& gpu) {
  std::uint64_t id = 0;
  if (!r.get_unsigned("id", id)) return false;
  if (gpu.reservations.contains(id)) {
    return r.fail_at("id", "reservation " + std::to_string(id) + " appears twice");
  }
  ledger::Reservation res;
  read_process_key(r, res.holder);
  // Snapshots before uids were kept: kUnknownUid, which no actor has, so only the holder
  // process itself or root may release the entry (anyone once the holder is dead).
  r.optional_unsigned("uid", res.uid);
  r.get_string("comm", res.comm, kLedgerTextRule);
  r.get_unsigned("bytes", res.bytes, 1);
  r.get_string("task", res.task, kLedgerTextRule);
  r.get_unsigned("reserved_ns", res.reserved_ns);
  r.get_bool("holder_alive", res.holder_alive);
  // Leases (snapshots before them: none).
  r.optional_unsigned("lease_ms", res.lease_ms, 0, proto::kMaxLeaseMs);
  r.optional_unsigned("lease_deadline_ns", res.lease_deadline_ns);
  r.optional_bool("expired", res.expired);
  if (!r.finish()) return false;
  if (res.lease_ms == 0 && (res.expired || res.lease_deadline_ns != 0)) {
    return r.fail_at("lease_ms", "0 (no lease) with a lease deadline or expired");
  }
  if (res.bytes > std::numeric_limits<std::uint64_t>::max() - gpu.reserved_bytes) {
    return r.fail_at("bytes", "the GPU's reservations add up to more than 2^64-1 bytes");
  }
  gpu.reserved_bytes += res.bytes;
  gpu.reservations.emplace(id, std::move(res));
  return true;
}

bool read_ledger_row(JsonObject p, ledger::Gpu& gpu) {
  ProcessKey key;
  if (!read_process_key(p, key)) return false;
  if (gpu.processes.contains(key)) {
    return p.fail_at("pid", "process " + std::to_string(key.pid) + " appears twice");
  }
  ledger::ProcessRow row;
  p.get_string("comm", row.comm, kLedgerTextRule);
  p.get_unsigned("reserves", row.reserves);
  p.get_unsigned("releases", row.releases);
  p.get_unsigned("cleanups", row.cleanups);
  p.optional_unsigned("refused", row.refused);  // 0 in snapshots before permissions
  p.optional_unsigned("renews", row.renews);    // 0 in snapshots before leases
  // Snapshots before rows kept them: the uid of a reservation the process holds, else
  // none (LedgerView::adopt), and alive until the first liveness check.
  p.optional_unsigned("uid", row.uid);
  p.optional_unsigned("exited_ns", row.exited_ns);
  if (!read_ledger_steps(p.array("steps", proto::kBuiltinStepCount), row.steps) || !p.finish()) {
    return false;
  }
  gpu.processes.emplace(key, std::move(row));
  return true;
}

bool read_gpu(JsonObject g, const Limits& limits, ledger::State& out) {
  std::string uuid;
  if (!g.get_string("gpu", uuid, kNameRule)) return false;
  if (out.gpus.contains(uuid)) return g.fail_at("gpu", "\"" + uuid + "\" appears twice");
  ledger::Gpu gpu;
  g.optional_unsigned("creator_uid", gpu.creator_uid);  // older snapshots: charged to no uid
  g.get_unsigned("high_water_bytes", gpu.high_water_bytes);
  g.get_unsigned("overcommit_events", gpu.overcommit_events);
  if (!g.is_null("sample")) {
    JsonObject s = g.object("sample");
    ledger::VramSample v;
    s.get_unsigned("free_bytes", v.free_bytes);
    s.get_unsigned("total_bytes", v.total_bytes, 1);
    s.get_unsigned("at_ns", v.at_ns);
    if (!s.finish()) return false;
    if (v.free_bytes > v.total_bytes) return s.fail_at("free_bytes", "exceeds total_bytes");
    gpu.sample = v;
  }
  // The total clients established and its uid (snapshots before them: the sample's
  // total, owned by no uid, LedgerView::adopt). 0: none established.
  std::uint64_t client_total = 0;
  g.optional_unsigned("client_total_bytes", client_total);
  g.optional_unsigned("client_total_uid", gpu.client_total_uid);
  if (client_total != 0) {
    gpu.client_total = client_total;
  } else if (gpu.client_total_uid != kUnknownUid) {
    return g.fail_at("client_total_uid", "a uid without a client_total_bytes");
  }
  JsonObject operations = g.object("operations");
  for (std::size_t op = 0; op < ledger::kOpCount; ++op) {
    if (op == ledger::kOpRenew) {
      operations.optional_unsigned(kOpKeys[op], gpu.operations[op]);  // since leases
    } else {
      operations.get_unsigned(kOpKeys[op], gpu.operations[op]);
    }
  }
  if (!operations.finish() ||
      !read_ledger_steps(g.array("steps", proto::kBuiltinStepCount), gpu.steps)) {
    return false;
  }
  JsonArray reservations = g.array("reservations", limits.max_reservations_per_gpu);
  for (std::size_t i = 0; i < reservations.size(); ++i) {
    if (!read_reservation(reservations.object(i), gpu)) return false;
  }
  if (!reservations.ok()) return false;
  if (gpu.high_water_bytes < gpu.reserved_bytes) {
    return g.fail_at("high_water_bytes", "is below the bytes the reservations hold");
  }
  gpu.overcommitted = gpu.sample && gpu.reserved_bytes > gpu.sample->total_bytes;
  JsonArray processes = g.array("processes", limits.max_processes);
  for (std::size_t i = 0; i < processes.size(); ++i) {
    if (!read_ledger_row(processes.object(i), gpu)) return false;
  }
  if (!g.finish()) return false;
  out.gpus.emplace(std::move(uuid), std::move(gpu));
  return true;
}

}  // namespace

bool read_ledger(JsonObject l, const Limits& limits, ledger::State& out) {
  std::uint64_t version = 0;
  if (!l.get_unsigned("version", version)) return false;
  if (version != kLedgerVersion) {
    return l.fail_at("version",
                     "ledger version " + std::to_string(version) + " is not one this build reads");
  }
  JsonArray gpus = l.array("gpus", limits.max_gpus);
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    if (!read_gpu(gpus.object(i), limits, out)) return false;
  }
  // Kinds a later build added are missing from older snapshots: zero.
  JsonObject anomalies = l.object("anomalies");
  for (std::size_t kind = 0; kind < ledger::kAnomalyCount; ++kind) {
    anomalies.optional_unsigned(ledger::kAnomalyNames[kind], out.anomalies[kind]);
  }
  if (!anomalies.finish()) return false;
  return l.finish();
}

bool read_process_key(JsonObject& o, ProcessKey& out) {
  std::uint32_t pid = 0;
  if (!o.get_unsigned("pid", pid, 1, kMaxPid)) return false;
  out.pid = static_cast<std::int32_t>(pid);
  return o.get_unsigned("start_time", out.start_time);
}

bool read_histogram(JsonObject h, Histogram& out) {
  Histogram::Parts parts;
  h.get_unsigned("count", parts.count);
  h.get_unsigned("sum_ns", parts.sum);
  h.get_unsigned("min_ns", parts.min);
  h.get_unsigned("max_ns", parts.max);
  JsonArray buckets = h.array("buckets", Histogram::kBuckets);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    JsonArray bucket = buckets.array(i, 2, 2);  // [index, count]
    unsigned index = 0;
    std::uint64_t n = 0;
    if (!bucket.get_unsigned(0, index, 0, Histogram::kBuckets - 1) ||
        !bucket.get_unsigned(1, n, 1)) {
      return false;
    }
    parts.buckets.emplace_back(index, n);
  }
  JsonArray prom = h.array("prom", Histogram::kPromBuckets, Histogram::kPromBuckets);
  for (std::size_t i = 0; i < prom.size(); ++i) prom.get_unsigned(i, parts.prom[i]);
  if (!h.finish()) return false;
  std::string reason;
  auto histogram = Histogram::from_parts(parts, reason);
  if (!histogram) return h.fail(reason);
  out = std::move(*histogram);
  return true;
}

std::string error_text(const JsonReader& reader) {
  return reader.error() ? reader.error()->message() : std::string("malformed document");
}

}  // namespace snapshot_detail

using nlohmann::json;
using snapshot_detail::error_text;
using snapshot_detail::ledger_json;
using snapshot_detail::read_histogram;
using snapshot_detail::read_ledger;

json encode_histogram(const Histogram& histogram) {
  const Histogram::Parts p = histogram.parts();
  json buckets = json::array();
  for (const auto& [index, n] : p.buckets) buckets.push_back({index, n});
  return {{"count", p.count}, {"sum_ns", p.sum},    {"min_ns", p.min},
          {"max_ns", p.max},  {"buckets", buckets}, {"prom", p.prom}};
}

std::optional<Histogram> decode_histogram(const json& doc, std::string& error) {
  JsonReader reader;
  Histogram out;
  if (!read_histogram(reader.object(doc), out)) {
    error = error_text(reader);
    return std::nullopt;
  }
  return out;
}

json encode_ledger(const LedgerView& ledger) { return ledger_json(ledger.state()); }

std::optional<ledger::State> decode_ledger(const json& doc, const Limits& limits,
                                           std::string& error) {
  JsonReader reader;
  ledger::State out;
  if (!read_ledger(reader.object(doc), limits, out)) {
    error = error_text(reader);
    return std::nullopt;
  }
  return out;
}

}  // namespace steptrace::daemon
