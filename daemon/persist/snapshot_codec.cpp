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
#include "daemon/persist/snapshot_sections.h"
#include "daemon/state/collector.h"
#include "daemon/state/collector_state.h"
#include "daemon/state/counter_table.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/ledger_view.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using snapshot_detail::error_text;
using snapshot_detail::kNameRule;
using snapshot_detail::ledger_json;
using snapshot_detail::read_histogram;
using snapshot_detail::read_ledger;
using snapshot_detail::read_process_key;

constexpr std::uint64_t kSnapshotVersion = 1;
// No build keeps more processes than the config allows (limits.max_processes).
constexpr std::size_t kMaxProcesses = 1'000'000;
constexpr std::size_t kMaxCounterNames = 256;  // per map of counters by kind
constexpr std::size_t kMaxCounterName = 64;

// /proc/PID/comm is any bytes a process chose (escape codes too; written as JSON escapes,
// invalid UTF-8 as U+FFFD): kept as they are, every text output sanitises it. A printable
// rule here would make one such process's name reject the whole snapshot.
constexpr StringRule kCommRule{0, 64, /*printable=*/false};
constexpr StringRule kClientRule{0, proto::kProcessNameField - 1};
constexpr StringRule kLibraryVersionRule{0, proto::kLibraryVersionField - 1};
constexpr StringRule kJobRule{0, proto::kMaxNameLength};  // a job id (may be "")

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

}  // namespace

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
