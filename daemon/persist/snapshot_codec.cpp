// The snapshot codec (snapshot_codec.h): the whole "steptrace.snapshot/v1" document,
// its processes, retired histograms and jobs and its counters, to and from a StateImage
// (daemon/state/state_image.h). The ledger and histogram sections are in
// snapshot_sections.cpp.
#include "daemon/persist/snapshot_codec.h"

#include <algorithm>
#include <array>
#include <limits>
#include <map>
#include <set>
#include <utility>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/persist/snapshot.h"
#include "daemon/persist/snapshot_sections.h"
#include "daemon/state/collector.h"
#include "daemon/state/counter_table.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/state_image.h"

namespace steptrace::daemon {
// The records' own encoders and readers are shared with the version-2 file
// (snapshot_records.cpp, through snapshot_sections.h).
namespace snapshot_detail {

using nlohmann::json;

constexpr std::uint64_t kSnapshotVersion = 1;
// No build keeps more processes than the config allows (limits.max_processes).
constexpr std::size_t kMaxProcesses = 1'000'000;
// The most open spans a snapshot may hold per process, as the limits' ranges allow them
// (limit_table.h); Collector::adopt applies the daemon's own (they may be lower).
constexpr std::size_t kMaxOpenThreads = 65536;  // max_threads_per_process
constexpr std::size_t kMaxOpenDepth = 4096;     // max_open_depth
constexpr std::size_t kMaxCounterNames = 256;   // per map of counters by kind
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
// (version 1 wrote the first four; daemon_crash and refused are optional, absent in older
// files).
constexpr std::array<std::string_view, proto::kReportDropCauseCount> kDropCauseKeys = {
    "buffer_full", "not_connected", "in_flight", "invalid", "daemon_crash", "refused"};
using DropCounts = std::array<std::uint64_t, proto::kReportDropCauseCount>;

// ---- encode ------------------------------------------------------------------------------

json drop_causes_json(const DropCounts& counts) {
  json j = json::object();
  for (std::size_t i = 0; i < kDropCauseKeys.size(); ++i)
    j[std::string(kDropCauseKeys[i])] = counts[i];
  return j;
}

// A process's open spans: [{"tid", "child_ns": [...], "stacks": [{"id", "starts": [...]}]}].
json open_json(const std::vector<OpenThreadImage>& threads) {
  json out = json::array();
  for (const OpenThreadImage& t : threads) {
    json stacks = json::array();
    for (const OpenStackImage& s : t.stacks) stacks.push_back({{"id", s.id}, {"starts", s.starts}});
    out.push_back({{"tid", t.tid}, {"child_ns", t.child_ns}, {"stacks", std::move(stacks)}});
  }
  return out;
}

json step_json(const StepImage& step) {
  return {{"id", step.id},
          {"name", step.name},  // for a human reading the file; not read back
          {"unmatched_ends", step.unmatched_ends},
          {"abandoned", step.abandoned},
          {"depth_dropped", step.depth_dropped},
          {"self_ns", step.self_ns},
          {"histogram", encode_histogram(step.hist)}};
}

json retired_json(const std::string& step, const Histogram& hist) {
  return {{"step", step}, {"histogram", encode_histogram(hist)}};
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

json process_json(const ProcessImage& p) {
  json custom = json::array();
  for (const CustomStepImage& step : p.custom_steps) {
    custom.push_back({{"id", step.id}, {"name", step.name}});
  }
  json steps = json::array();
  for (const StepImage& step : p.steps) steps.push_back(step_json(step));
  json out = {{"pid", p.peer.key.pid},
              {"start_time", p.peer.key.start_time},
              {"uid", p.peer.uid},
              {"gid", p.peer.gid},
              {"comm", p.peer.comm},
              {"client", p.client},
              {"library_version", p.library_version},
              {"alive", p.alive},
              {"exited_at_ns", p.exited_at_ns},
              {"exit_order", p.exit_order},
              {"dropped", p.dropped},
              {"dropped_by_cause", drop_causes_json(p.dropped_by_cause)},
              {"custom_steps", std::move(custom)},
              {"steps", std::move(steps)}};
  // The Identity's fields, when the process sent them (absent: not known).
  if (p.events) out["events"] = *p.events;  // absent: restored from a file without it
  if (p.ledger_refused != 0) out["ledger_refused"] = p.ledger_refused;  // absent: none
  // The socket-batch cursor (protocol version 7): absent while the process sent none.
  if (p.batch_sequence != 0) {
    out["batch_sequence"] = p.batch_sequence;
    out["batch_next"] = p.batch_next;
  }
  if (!p.open.empty()) out["open"] = open_json(p.open);
  if (!p.job.empty()) out["job"] = p.job;
  if (p.rank != proto::kNoRank) out["rank"] = p.rank;
  if (p.local_rank != proto::kNoRank) out["local_rank"] = p.local_rank;
  if (p.world_size != 0) out["world_size"] = p.world_size;
  return out;
}

json retired_job_json(const RetiredJobImage& job) {
  const auto steps_json = [](const auto& steps) {
    json out = json::array();
    for (const auto& [name, t] : steps) {
      out.push_back(
          {{"step", name}, {"count", t.count}, {"total_ns", t.total_ns}, {"self_ns", t.self_ns}});
    }
    return out;
  };
  json out = {{"uid", job.uid},
              {"job", job.job},
              {"processes", job.processes},
              {"dropped", job.dropped},
              {"retired_order", job.retired_order},
              {"steps", steps_json(job.steps)}};
  // Per rank, only for a job whose evicted processes sent one: a file without ranks is
  // the same bytes as before them.
  if (!job.ranks.empty()) {
    json ranks = json::array();
    for (const auto& [rank, steps] : job.ranks) {
      ranks.push_back({{"rank", rank}, {"steps", steps_json(steps)}});
    }
    out["ranks"] = std::move(ranks);
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
  for (std::size_t i = proto::kDropCauseCount; i < proto::kReportDropCauseCount; ++i) {
    causes->optional_unsigned(kDropCauseKeys[i], out[i]);
  }
  return causes->finish();
}

// A process's custom steps, by id: the names it registered.
using Registered = std::map<std::uint32_t, std::string>;

bool read_step(JsonObject s, const Registered& registered, std::set<std::uint32_t>& seen,
               StepImage& out) {
  if (!s.get_unsigned("id", out.id)) return false;
  if (proto::is_builtin_step(out.id)) {
    out.name = proto::kBuiltinStepNames[out.id];
  } else if (const auto it = registered.find(out.id); it != registered.end()) {
    out.name = it->second;
  } else {
    return s.fail_at("id",
                     "step " + std::to_string(out.id) + " is neither built-in nor registered");
  }
  if (!seen.insert(out.id).second) {
    return s.fail_at("id", "step " + std::to_string(out.id) + " appears twice");
  }
  s.ignore("name");  // written for a human; the id says which step it is
  s.get_unsigned("unmatched_ends", out.unmatched_ends);
  s.get_unsigned("abandoned", out.abandoned);
  s.get_unsigned("depth_dropped", out.depth_dropped);
  s.optional_unsigned("self_ns", out.self_ns);  // written since protocol version 4
  if (!read_histogram(s.object("histogram"), out.hist)) return false;
  if (out.self_ns > out.hist.sum()) return s.fail_at("self_ns", "more than the step's total");
  return s.finish();
}

// One thread's open spans ("open", written since issue 25): each stack's step id known to
// the process once, starts in order, one child_ns per open span.
bool read_open_thread(JsonObject t, const Registered& registered, OpenThreadImage& out) {
  if (!t.get_unsigned("tid", out.tid)) return false;
  JsonArray child = t.array("child_ns", 1, kMaxOpenDepth);
  out.child_ns.resize(child.size());
  for (std::size_t i = 0; i < child.size(); ++i) {
    if (!child.get_unsigned(i, out.child_ns[i])) return false;
  }
  JsonArray stacks = t.array("stacks", 1, kMaxOpenDepth);
  std::set<std::uint32_t> seen;
  std::size_t open = 0;
  for (std::size_t i = 0; i < stacks.size(); ++i) {
    JsonObject s = stacks.object(i);
    OpenStackImage stack;
    if (!s.get_unsigned("id", stack.id)) return false;
    if (!proto::is_builtin_step(stack.id) && !registered.contains(stack.id)) {
      return s.fail_at("id",
                       "step " + std::to_string(stack.id) + " is neither built-in nor registered");
    }
    if (!seen.insert(stack.id).second) {
      return s.fail_at("id", "step " + std::to_string(stack.id) + " appears twice");
    }
    JsonArray starts = s.array("starts", 1, kMaxOpenDepth);
    stack.starts.resize(starts.size());
    for (std::size_t k = 0; k < starts.size(); ++k) {
      if (!starts.get_unsigned(k, stack.starts[k])) return false;
    }
    if (!s.finish()) return false;
    open += stack.starts.size();
    out.stacks.push_back(std::move(stack));
  }
  if (!t.ok()) return false;
  if (open != out.child_ns.size()) {
    return t.fail_at("child_ns",
                     "must hold one entry per open span (" + std::to_string(open) + ")");
  }
  return t.finish();
}

// A process's threads with open spans, each thread id once.
bool read_open(JsonObject& p, const Registered& registered, ProcessImage& out) {
  if (!p.has("open")) return true;  // none, or a file of a build that abandoned them
  JsonArray threads = p.array("open", kMaxOpenThreads);
  std::set<std::uint32_t> tids;
  for (std::size_t i = 0; i < threads.size(); ++i) {
    out.open.emplace_back();
    if (!read_open_thread(threads.object(i), registered, out.open.back())) return false;
    if (!tids.insert(out.open.back().tid).second) {
      return threads.fail_at(i, "thread " + std::to_string(out.open.back().tid) + " appears twice");
    }
  }
  return threads.ok();
}

// "custom_steps" and then "steps" of a process (its steps name registered ids only).
bool read_process_steps(JsonObject& p, ProcessImage& out) {
  JsonArray custom = p.array("custom_steps", proto::kMaxCustomSteps);
  Registered registered;
  for (std::size_t i = 0; i < custom.size(); ++i) {
    JsonObject c = custom.object(i);
    CustomStepImage step;
    if (!c.get_unsigned("id", step.id, proto::kFirstCustomStep,
                        proto::kFirstCustomStep + proto::kMaxCustomSteps - 1) ||
        !c.get_string("name", step.name, kNameRule) || !c.finish()) {
      return false;
    }
    if (!registered.emplace(step.id, step.name).second) {
      return c.fail_at("id", "step " + std::to_string(step.id) + " registered twice");
    }
    out.custom_steps.push_back(std::move(step));
  }
  JsonArray steps = p.array("steps", proto::kBuiltinStepCount + out.custom_steps.size());
  std::set<std::uint32_t> seen;
  for (std::size_t i = 0; i < steps.size(); ++i) {
    out.steps.emplace_back();
    if (!read_step(steps.object(i), registered, seen, out.steps.back())) return false;
  }
  return steps.ok() && read_open(p, registered, out);
}

bool read_process(JsonObject p, ProcessImage& out) {
  read_process_key(p, out.peer.key);
  p.get_unsigned("uid", out.peer.uid);
  p.get_unsigned("gid", out.peer.gid);
  p.get_string("comm", out.peer.comm, kCommRule);
  p.get_string("client", out.client, kClientRule);
  p.get_string("library_version", out.library_version, kLibraryVersionRule);
  p.get_bool("alive", out.alive);
  p.get_unsigned("exited_at_ns", out.exited_at_ns);
  p.get_unsigned("exit_order", out.exit_order);
  p.get_unsigned("dropped", out.dropped);
  if (!read_drop_causes(p.optional_object("dropped_by_cause"), out.dropped_by_cause)) return false;
  // Absent in files of builds that did not count a process's events (then unknown).
  constexpr std::uint64_t kAbsent = std::numeric_limits<std::uint64_t>::max();
  std::uint64_t events = kAbsent;
  p.optional_unsigned("events", events, 0, kAbsent - 1);
  if (events != kAbsent) out.events = events;
  p.optional_unsigned("ledger_refused", out.ledger_refused, 0, kAbsent);
  p.optional_unsigned("batch_sequence", out.batch_sequence, 1, kAbsent);
  p.optional_unsigned("batch_next", out.batch_next, 1, std::numeric_limits<std::uint32_t>::max());
  if ((out.batch_sequence != 0) != (out.batch_next != 0)) {
    return p.fail_at("batch_next", "a batch cursor needs both batch_sequence and batch_next");
  }
  p.optional_string("job", out.job, kJobRule);
  p.optional_unsigned("world_size", out.world_size, 1, proto::kNoRank - 1);
  const std::uint64_t max_rank = out.world_size != 0 ? out.world_size - 1 : proto::kNoRank - 1;
  p.optional_unsigned("rank", out.rank, 0, max_rank);
  p.optional_unsigned("local_rank", out.local_rank, 0, max_rank);
  if (!p.ok()) return false;
  if (!out.alive && out.exit_order == 0) {
    return p.fail_at("exit_order", "an exited process needs one (nonzero)");
  }
  return read_process_steps(p, out) && p.finish();
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

// Each process record on its own reader: one that breaks a rule, or repeats a process
// already read, is left out with its reason (in `skipped`) and the others are restored.
bool read_processes(JsonObject& top, const json& doc, std::vector<ProcessImage>& out,
                    std::vector<std::string>& skipped) {
  JsonArray processes = top.array("processes", kMaxProcesses);
  if (!processes.ok()) return false;
  const json& list = doc.at("processes");  // an array: checked just above
  std::set<ProcessKey> keys;
  for (std::size_t i = 0; i < processes.size(); ++i) {
    const std::string path = "processes[" + std::to_string(i) + "]";
    JsonReader one;
    ProcessImage p;
    if (!read_process(one.object(list[i], path), p)) {
      skipped.push_back(error_text(one));
      continue;
    }
    const ProcessKey& key = p.peer.key;
    if (!keys.insert(key).second) {
      skipped.push_back(path + ": process " + std::to_string(key.pid) + " (start_time " +
                        std::to_string(key.start_time) + ") appears twice");
      continue;
    }
    out.push_back(std::move(p));
  }
  return true;
}

bool read_retired_entry(JsonObject entry, std::map<std::string, Histogram, std::less<>>& out) {
  std::string name;
  Histogram histogram;
  if (!entry.get_string("step", name, kNameRule) ||
      !read_histogram(entry.object("histogram"), histogram) || !entry.finish()) {
    return false;
  }
  if (!out.try_emplace(name, std::move(histogram)).second) {
    return entry.fail_at("step", "\"" + name + "\" appears twice");
  }
  return true;
}

// Optional, as it has always been to the reader.
bool read_retired(JsonObject& top, const ImageBounds& bounds,
                  std::map<std::string, Histogram, std::less<>>& out) {
  if (!top.has("retired")) return true;
  JsonArray retired = top.array("retired", bounds.retired_names);
  for (std::size_t i = 0; i < retired.size(); ++i) {
    if (!read_retired_entry(retired.object(i), out)) return false;
  }
  return true;
}

// A retired job's steps ([{"step", "count", "total_ns", "self_ns"}, ...]) into `out`.
bool read_job_steps(JsonArray steps, std::map<std::string, JobStepImage, std::less<>>& out) {
  for (std::size_t k = 0; k < steps.size(); ++k) {
    JsonObject st = steps.object(k);
    std::string name;
    JobStepImage t;
    if (!st.get_string("step", name, kNameRule) || !st.get_unsigned("count", t.count) ||
        !st.get_unsigned("total_ns", t.total_ns) || !st.get_unsigned("self_ns", t.self_ns) ||
        !st.finish()) {
      return false;
    }
    if (t.self_ns > t.total_ns) return st.fail_at("self_ns", "more than total_ns");
    if (!out.try_emplace(name, t).second) {
      return st.fail_at("step", "\"" + name + "\" appears twice");
    }
  }
  return steps.ok();
}

bool read_retired_job(JsonObject j, const ImageBounds& bounds, RetiredJobImage& out) {
  j.get_unsigned("uid", out.uid);
  j.get_string("job", out.job, kJobRule);
  j.get_unsigned("processes", out.processes, 1);
  j.get_unsigned("dropped", out.dropped);
  j.get_unsigned("retired_order", out.retired_order, 1);
  if (!read_job_steps(j.array("steps", bounds.job_steps), out.steps)) return false;
  // Per rank (optional: files before them have none, and a job without ranks writes none).
  if (j.has("ranks")) {
    JsonArray ranks = j.array("ranks", bounds.job_ranks);
    std::size_t names = 0;
    for (std::size_t k = 0; k < ranks.size(); ++k) {
      JsonObject r = ranks.object(k);
      std::uint32_t rank = 0;
      if (!r.get_unsigned("rank", rank, 0, proto::kNoRank - 1)) return false;
      if (out.ranks.contains(rank)) {
        return r.fail_at("rank", "rank " + std::to_string(rank) + " appears twice");
      }
      auto& steps = out.ranks[rank];
      if (!read_job_steps(r.array("steps", bounds.job_steps), steps) || !r.finish()) return false;
      names += steps.size();
      if (names > bounds.job_rank_steps) {
        return r.fail_at("steps", "the ranks hold more than " +
                                      std::to_string(bounds.job_rank_steps) + " step names");
      }
    }
    if (!ranks.ok()) return false;
  }
  return j.finish();
}

// What evicted processes left to their jobs (optional: written since protocol version 4).
bool read_retired_jobs(JsonObject& top, const ImageBounds& bounds,
                       std::vector<RetiredJobImage>& out) {
  if (!top.has("retired_jobs")) return true;
  JsonArray jobs = top.array("retired_jobs", bounds.retired_jobs);
  std::set<std::pair<std::uint32_t, std::string>> keys;
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    RetiredJobImage job;
    if (!read_retired_job(jobs.object(i), bounds, job)) return false;
    if (!keys.emplace(job.uid, job.job).second) {
      return jobs.fail_at(
          i, "job \"" + job.job + "\" of uid " + std::to_string(job.uid) + " appears twice");
    }
    out.push_back(std::move(job));
  }
  return jobs.ok();
}

bool read_snapshot(JsonReader& reader, const json& doc, const Limits& limits, StateImage& out) {
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
  const ImageBounds bounds = image_bounds(limits);
  if (!read_processes(top, doc, out.processes, out.skipped) ||
      !read_retired(top, bounds, out.retired) ||
      !read_retired_jobs(top, bounds, out.retired_jobs) ||
      !read_counters(top.object("counters"), out.counters) ||
      !read_ledger(top.object("ledger"), limits, out.ledger)) {
    return false;
  }
  return top.finish();
}

}  // namespace snapshot_detail

using nlohmann::json;

json encode_snapshot(const StateImage& image) {
  namespace d = snapshot_detail;
  json processes = json::array();
  for (const ProcessImage& p : image.processes) processes.push_back(d::process_json(p));
  json retired = json::array();
  for (const auto& [name, hist] : image.retired) retired.push_back(d::retired_json(name, hist));
  json retired_jobs = json::array();
  for (const RetiredJobImage& job : image.retired_jobs) {
    retired_jobs.push_back(d::retired_job_json(job));
  }
  return {{"schema", kSnapshotSchema},
          {"version", d::kSnapshotVersion},
          {"written_at_ns", image.taken_at_ns},
          {"processes", std::move(processes)},
          {"retired", std::move(retired)},
          {"retired_jobs", std::move(retired_jobs)},
          {"counters", d::counters_json(image.counters)},
          {"ledger", d::ledger_json(image.ledger)}};
}

json encode_snapshot(const CollectorView& view) { return encode_snapshot(view.image()); }

std::optional<StateImage> decode_snapshot(const json& doc, const Limits& limits,
                                          std::string& error) {
  JsonReader reader;
  StateImage out;
  if (!snapshot_detail::read_snapshot(reader, doc, limits, out)) {
    error = snapshot_detail::error_text(reader);
    return std::nullopt;
  }
  return out;
}

std::error_code restore_from_snapshot(Collector& collector, const json& doc) {
  std::string error;
  auto image = decode_snapshot(doc, collector.limits(), error);
  if (!image) {
    // The caller gets the code; the reason goes to the log.
    spdlog::warn("snapshot rejected: {}", error);
    return make_error_code(errc::bad_snapshot);
  }
  return adopt_snapshot(collector, std::move(*image));
}

std::size_t snapshot_max_array_elements(const Limits& limits) {
  const ImageBounds bounds = image_bounds(limits);
  return std::max<std::size_t>({limits.max_processes, limits.max_reservations_per_gpu,
                                limits.max_gpus, bounds.retired_names, bounds.retired_jobs,
                                bounds.job_steps, Histogram::kBuckets,
                                proto::kMaxCustomSteps + proto::kBuiltinStepCount,
                                limits.max_threads_per_process, limits.max_open_depth});
}

}  // namespace steptrace::daemon
