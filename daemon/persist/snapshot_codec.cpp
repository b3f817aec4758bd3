#include "daemon/persist/snapshot_codec.h"

#include <array>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/persist/snapshot.h"
#include "daemon/state/collector.h"
#include "daemon/state/collector_state.h"
#include "daemon/state/counter_table.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/ledger_view.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

constexpr std::uint64_t kSnapshotVersion = 1;
constexpr std::uint64_t kLedgerVersion = 1;
// No build keeps more processes than the config allows (limits.max_processes).
constexpr std::size_t kMaxProcesses = 1'000'000;
constexpr std::size_t kMaxCounterNames = 256;  // per map of counters by kind
constexpr std::size_t kMaxCounterName = 64;
constexpr std::uint64_t kMaxPid = std::numeric_limits<std::int32_t>::max();

// /proc/PID/comm is any bytes a process chose (escape codes too; written as JSON escapes,
// invalid UTF-8 as U+FFFD): kept as they are, every text output sanitises it. A printable
// rule here would make one such process's name reject the whole snapshot.
constexpr StringRule kCommRule{0, 64, /*printable=*/false};
constexpr StringRule kClientRule{0, proto::kProcessNameField - 1};
constexpr StringRule kLibraryVersionRule{0, proto::kLibraryVersionField - 1};
constexpr StringRule kNameRule{1, proto::kMaxNameLength};        // step names, GPU UUIDs
constexpr StringRule kLedgerTextRule{0, proto::kMaxNameLength};  // comm, task
constexpr StringRule kJobRule{0, proto::kMaxNameLength};         // a job id (may be "")

// The snapshot's own keys for the drop causes, by proto::DropCause: a format of its own,
// so that renaming a cause in a report or on the wire cannot change what a snapshot says
// (version 1 wrote these).
constexpr std::array<std::string_view, proto::kDropCauseCount> kDropCauseKeys = {
    "buffer_full", "not_connected", "in_flight", "invalid"};

// ---- encode ------------------------------------------------------------------------------

json drop_causes_json(const DropCounts& counts) {
  json j = json::object();
  for (std::size_t i = 0; i < kDropCauseKeys.size(); ++i)
    j[std::string(kDropCauseKeys[i])] = counts[i];
  return j;
}

json step_agg_json(const StepAgg& agg) {
  return {{"unmatched_ends", agg.unmatched_ends},
          {"abandoned", agg.abandoned},
          {"depth_dropped", agg.depth_dropped},
          {"self_ns", agg.self_ns},
          {"histogram", encode_histogram(agg.hist)}};
}

json counters_json(const DaemonCounters& c) {
  json out = {{"events_dropped_by_cause", drop_causes_json(c.events_dropped_by_cause)},
              {"protocol_errors", c.protocol_errors},
              {"limits_hit", c.limits_hit}};
  for (const CounterRow& row : kCounterTable) {
    if (row.kept != Kept::kNo) out[std::string(row.snapshot_key)] = c.*row.field;
  }
  return out;
}

json process_json(const ProcessRecord& rec) {
  json custom = json::array();
  for (std::size_t i = 0; i < rec.custom_ids.size(); ++i) {
    custom.push_back({{"id", rec.custom_ids[i]}, {"name", rec.custom_names[i]}});
  }
  // Open spans cannot survive: whoever restores this has no connection to end them.
  const auto open = rec.open_per_slot();
  json steps = json::array();
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    StepAgg agg = rec.steps[slot];
    agg.abandoned += open[slot];
    if (!agg.has_data()) continue;
    json s = step_agg_json(agg);
    s["id"] = rec.step_id(slot);
    s["name"] = rec.step_name(slot);  // for a human reading the file; not read back
    steps.push_back(std::move(s));
  }
  json out = {{"pid", rec.key().pid},
              {"start_time", rec.key().start_time},
              {"uid", rec.peer.uid},
              {"gid", rec.peer.gid},
              {"comm", rec.peer.comm},
              {"client", rec.client_name},
              {"library_version", rec.library_version},
              {"alive", rec.alive},
              {"exited_at_ns", rec.exited_at_ns},
              {"exit_order", rec.exit_order},
              {"dropped", rec.dropped},
              {"dropped_by_cause", drop_causes_json(rec.dropped_by_cause)},
              {"custom_steps", std::move(custom)},
              {"steps", std::move(steps)}};
  // The Identity's fields, when the process sent them (absent: not known).
  if (!rec.job.empty()) out["job"] = rec.job;
  if (rec.rank != proto::kNoRank) out["rank"] = rec.rank;
  if (rec.local_rank != proto::kNoRank) out["local_rank"] = rec.local_rank;
  if (rec.world_size != 0) out["world_size"] = rec.world_size;
  return out;
}

json retired_jobs_json(const RetiredJobs& jobs) {
  json out = json::array();
  for (const auto& [key, job] : jobs) {
    json steps = json::array();
    for (const auto& [name, t] : job.steps) {
      steps.push_back(
          {{"step", name}, {"count", t.count}, {"total_ns", t.total_ns}, {"self_ns", t.self_ns}});
    }
    out.push_back({{"uid", key.uid},
                   {"job", key.job},
                   {"processes", job.processes},
                   {"dropped", job.dropped},
                   {"retired_order", job.retired_order},
                   {"steps", std::move(steps)}});
  }
  return out;
}

// ---- decode: each returns false with the reader's error set ---------------------------

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

// An object of the drop cause names. Snapshots from before causes existed have none:
// `out` stays zeros.
bool read_drop_causes(std::optional<JsonObject> causes, DropCounts& out) {
  if (!causes) return true;
  for (std::size_t i = 0; i < proto::kDropCauseCount; ++i) {
    causes->get_unsigned(kDropCauseKeys[i], out[i]);
  }
  return causes->finish();
}

bool read_step(JsonObject s, ProcessRecord& rec, std::vector<bool>& seen) {
  std::uint32_t id = 0;
  if (!s.get_unsigned("id", id)) return false;
  std::size_t slot = 0;
  if (proto::is_builtin_step(id)) {
    slot = id;
  } else if (proto::is_custom_step(id) && rec.custom_slot &&
             (*rec.custom_slot)[id - proto::kFirstCustomStep] != 0) {
    slot = (*rec.custom_slot)[id - proto::kFirstCustomStep];
  } else {
    return s.fail_at("id", "step " + std::to_string(id) + " is neither built-in nor registered");
  }
  if (seen[slot]) return s.fail_at("id", "step " + std::to_string(id) + " appears twice");
  seen[slot] = true;
  s.ignore("name");  // written for a human; the id says which step it is
  StepAgg& agg = rec.steps[slot];
  s.get_unsigned("unmatched_ends", agg.unmatched_ends);
  s.get_unsigned("abandoned", agg.abandoned);
  s.get_unsigned("depth_dropped", agg.depth_dropped);
  s.optional_unsigned("self_ns", agg.self_ns);  // written since protocol version 4
  if (!read_histogram(s.object("histogram"), agg.hist)) return false;
  if (agg.self_ns > agg.hist.sum()) return s.fail_at("self_ns", "more than the step's total");
  return s.finish();
}

bool read_process(JsonObject p, ProcessRecord& rec) {
  read_process_key(p, rec.peer.key);
  p.get_unsigned("uid", rec.peer.uid);
  p.get_unsigned("gid", rec.peer.gid);
  p.get_string("comm", rec.peer.comm, kCommRule);
  p.get_string("client", rec.client_name, kClientRule);
  p.get_string("library_version", rec.library_version, kLibraryVersionRule);
  p.get_bool("alive", rec.alive);
  p.get_unsigned("exited_at_ns", rec.exited_at_ns);
  p.get_unsigned("exit_order", rec.exit_order);
  p.get_unsigned("dropped", rec.dropped);
  if (!read_drop_causes(p.optional_object("dropped_by_cause"), rec.dropped_by_cause)) return false;
  p.optional_string("job", rec.job, kJobRule);
  p.optional_unsigned("world_size", rec.world_size, 1, proto::kNoRank - 1);
  const std::uint64_t max_rank = rec.world_size != 0 ? rec.world_size - 1 : proto::kNoRank - 1;
  p.optional_unsigned("rank", rec.rank, 0, max_rank);
  p.optional_unsigned("local_rank", rec.local_rank, 0, max_rank);
  if (!p.ok()) return false;
  if (!rec.alive && rec.exit_order == 0) {
    return p.fail_at("exit_order", "an exited process needs one (nonzero)");
  }

  JsonArray custom = p.array("custom_steps", proto::kMaxCustomSteps);
  for (std::size_t i = 0; i < custom.size(); ++i) {
    JsonObject c = custom.object(i);
    std::uint32_t id = 0;
    std::string name;
    if (!c.get_unsigned("id", id, proto::kFirstCustomStep,
                        proto::kFirstCustomStep + proto::kMaxCustomSteps - 1) ||
        !c.get_string("name", name, kNameRule) || !c.finish()) {
      return false;
    }
    if (!rec.custom_slot) {
      rec.custom_slot = std::make_unique<std::array<std::uint16_t, proto::kMaxCustomSteps>>();
      rec.custom_slot->fill(0);
    }
    auto& slot = (*rec.custom_slot)[id - proto::kFirstCustomStep];
    if (slot != 0) return c.fail_at("id", "step " + std::to_string(id) + " registered twice");
    slot = static_cast<std::uint16_t>(rec.steps.size());
    rec.steps.emplace_back();
    rec.custom_ids.push_back(id);
    rec.custom_names.push_back(std::move(name));
  }
  JsonArray steps = p.array("steps", rec.steps.size());
  std::vector<bool> seen(rec.steps.size(), false);
  for (std::size_t i = 0; i < steps.size(); ++i) {
    if (!read_step(steps.object(i), rec, seen)) return false;
  }
  return p.finish();
}

bool read_counter_map(JsonObject m, std::map<std::string, std::uint64_t>& out) {
  if (m.size() > kMaxCounterNames) {
    return m.fail("must be an object of at most " + std::to_string(kMaxCounterNames) + " counters");
  }
  for (const std::string_view name : m.keys()) {
    if (name.empty() || name.size() > kMaxCounterName) {
      return m.fail_at(name,
                       "a counter's name must be 1.." + std::to_string(kMaxCounterName) + " bytes");
    }
    std::uint64_t value = 0;
    if (!m.get_unsigned(name, value)) return false;
    out[std::string(name)] = value;
  }
  return m.finish();
}

bool read_counters(JsonObject c, DaemonCounters& out) {
  for (const CounterRow& row : kCounterTable) {
    // Added later (Kept::kLater): a snapshot of an older daemon has none.
    if (row.kept == Kept::kSinceV1) c.get_unsigned(row.snapshot_key, out.*row.field);
    if (row.kept == Kept::kLater) c.optional_unsigned(row.snapshot_key, out.*row.field);
  }
  if (!read_drop_causes(c.optional_object("events_dropped_by_cause"),
                        out.events_dropped_by_cause)) {
    return false;
  }
  if (!read_counter_map(c.object("protocol_errors"), out.protocol_errors) ||
      !read_counter_map(c.object("limits_hit"), out.limits_hit)) {
    return false;
  }
  return c.finish();
}

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

// ---- the whole document ----------------------------------------------------------------

// What evicted processes left to their jobs (optional: written since protocol version 4).
bool read_retired_jobs(JsonObject& top, const Limits& limits, RetiredJobs& out) {
  JsonArray jobs = top.array("retired_jobs", max_retired_jobs(limits));
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    JsonObject j = jobs.object(i);
    JobKey key;
    RetiredJob job;
    j.get_unsigned("uid", key.uid);
    j.get_string("job", key.job, kJobRule);
    j.get_unsigned("processes", job.processes, 1);
    j.get_unsigned("dropped", job.dropped);
    j.get_unsigned("retired_order", job.retired_order, 1);
    JsonArray steps = j.array("steps", RetiredJob::kMaxJobSteps + 1);
    for (std::size_t k = 0; k < steps.size(); ++k) {
      JsonObject st = steps.object(k);
      std::string name;
      JobStepTotals t;
      if (!st.get_string("step", name, kNameRule) || !st.get_unsigned("count", t.count) ||
          !st.get_unsigned("total_ns", t.total_ns) || !st.get_unsigned("self_ns", t.self_ns) ||
          !st.finish()) {
        return false;
      }
      if (t.self_ns > t.total_ns) return st.fail_at("self_ns", "more than total_ns");
      if (!job.steps.try_emplace(name, t).second) {
        return st.fail_at("step", "\"" + name + "\" appears twice");
      }
    }
    if (!steps.ok() || !j.finish()) return false;
    if (!out.try_emplace(key, std::move(job)).second) {
      return jobs.fail_at(
          i, "job \"" + key.job + "\" of uid " + std::to_string(key.uid) + " appears twice");
    }
  }
  return jobs.ok();
}

bool read_snapshot(JsonReader& reader, const json& doc, const Limits& limits, RestoredState& out) {
  if (!has_snapshot_schema(doc)) {
    return reader.fail("", std::string("not a ") + kSnapshotSchema + " document");
  }
  JsonObject top = reader.object(doc);
  top.ignore("schema");         // checked above
  top.ignore("written_at_ns");  // for a human reading the file
  std::uint64_t version = 0;
  if (!top.get_unsigned("version", version)) return false;
  if (version != kSnapshotVersion) {
    return top.fail_at(
        "version", "snapshot version " + std::to_string(version) + " is not one this build reads");
  }

  JsonArray processes = top.array("processes", kMaxProcesses);
  std::set<ProcessKey> keys;
  for (std::size_t i = 0; i < processes.size(); ++i) {
    auto rec = std::make_shared<ProcessRecord>();
    if (!read_process(processes.object(i), *rec)) return false;
    if (!keys.insert(rec->key()).second) {
      return processes.fail_at(i, "process " + std::to_string(rec->key().pid) + " (start_time " +
                                      std::to_string(rec->key().start_time) + ") appears twice");
    }
    out.processes.push_back(std::move(rec));
  }
  if (!processes.ok()) return false;

  // Optional, as it has always been to the reader.
  if (top.has("retired")) {
    JsonArray retired = top.array("retired", CollectorState::kMaxRetiredNames + 1);
    for (std::size_t i = 0; i < retired.size(); ++i) {
      JsonObject entry = retired.object(i);
      std::string name;
      Histogram histogram;
      if (!entry.get_string("step", name, kNameRule) ||
          !read_histogram(entry.object("histogram"), histogram) || !entry.finish()) {
        return false;
      }
      if (!out.retired.try_emplace(name, std::move(histogram)).second) {
        return entry.fail_at("step", "\"" + name + "\" appears twice");
      }
    }
  }
  if (top.has("retired_jobs") && !read_retired_jobs(top, limits, out.retired_jobs)) return false;
  if (!read_counters(top.object("counters"), out.counters) ||
      !read_ledger(top.object("ledger"), limits, out.ledger)) {
    return false;
  }
  return top.finish();
}

std::string error_text(const JsonReader& reader) {
  return reader.error() ? reader.error()->message() : std::string("malformed document");
}

}  // namespace

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

json encode_snapshot(const CollectorView& view) {
  const CollectorState& state = view.state();
  json processes = json::array();
  for (const auto& [key, handle] : state.by_key)
    processes.push_back(process_json(*state.slots[handle]));
  json retired = json::array();
  for (const auto& [name, hist] : *state.retired) {
    retired.push_back({{"step", name}, {"histogram", encode_histogram(hist)}});
  }
  return {{"schema", kSnapshotSchema},
          {"version", kSnapshotVersion},
          {"written_at_ns", view.now_ns()},
          {"processes", std::move(processes)},
          {"retired", std::move(retired)},
          {"retired_jobs", retired_jobs_json(*state.retired_jobs)},
          {"counters", counters_json(view.counters())},
          {"ledger", ledger_json(state.ledger.state())}};
}

std::optional<RestoredState> decode_snapshot(const json& doc, const Limits& limits,
                                             std::string& error) {
  JsonReader reader;
  RestoredState out;
  if (!read_snapshot(reader, doc, limits, out)) {
    error = error_text(reader);
    return std::nullopt;
  }
  return out;
}

std::error_code restore_from_snapshot(Collector& collector, const json& doc) {
  std::string error;
  auto restored = decode_snapshot(doc, collector.limits(), error);
  if (!restored) {
    // The caller gets the code; the reason goes to the log.
    spdlog::warn("snapshot rejected: {}", error);
    return make_error_code(errc::bad_snapshot);
  }
  return collector.adopt(std::move(*restored));
}

std::size_t snapshot_max_array_elements(const Limits& limits) {
  return std::max<std::size_t>(
      {limits.max_processes, limits.max_reservations_per_gpu, limits.max_gpus,
       CollectorState::kMaxRetiredNames + 1, max_retired_jobs(limits), RetiredJob::kMaxJobSteps + 1,
       Histogram::kBuckets, proto::kMaxCustomSteps + proto::kBuiltinStepCount});
}

}  // namespace steptrace::daemon
