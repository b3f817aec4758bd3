// JSON reports: `report --json` ("steptrace.report/v1"), `ledger --json` and
// `stats --json`, all read from a CollectorView's read model (state/read_model.h).
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <fstream>
#include <functional>
#include <string_view>

#include <nlohmann/json.hpp>

#include "daemon/report/ledger_report.h"
#include "daemon/report/report.h"
#include "daemon/state/collector.h"
#include "daemon/state/counter_table.h"
#include "proto/text_safety.h"

namespace steptrace::daemon {
namespace {

// {"buffer_full": n, "not_connected": n, "in_flight": n, "invalid": n, "daemon_crash": n,
// "refused": n}:
// the wire's cause names (PROTOCOL.md section 4.7), then the daemon's own (4.7c).
nlohmann::json drop_causes_json(
    const std::array<std::uint64_t, proto::kReportDropCauseCount>& counts) {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t i = 0; i < proto::kReportDropCauseCount; ++i)
    j[std::string(proto::kReportDropCauseNames[i])] = counts[i];
  return j;
}

std::uint64_t uptime_s(std::chrono::steady_clock::duration elapsed) {
  return static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, std::chrono::duration_cast<std::chrono::seconds>(elapsed).count()));
}

nlohmann::json step_json(const StepFigures& step) {
  const Histogram& h = step.hist();
  return {{"step", step.name},
          {"count", h.count()},
          {"total_ns", h.sum()},
          {"min_ns", h.min()},
          {"max_ns", h.max()},
          {"p50_ns", h.percentile(0.50)},
          {"p99_ns", h.percentile(0.99)},
          {"open", step.open},
          {"unmatched_ends", step.unmatched_ends},
          {"abandoned", step.abandoned},
          {"depth_dropped", step.depth_dropped},
          {"self_ns", step.self_ns}};
}

// A rank, or null when the process did not say.
nlohmann::json rank_json(std::uint32_t rank) {
  return rank == proto::kNoRank ? nlohmann::json(nullptr) : nlohmann::json(rank);
}

// Per thread, the innermost open span and the nesting depth.
nlohmann::json current_json(const std::vector<OpenSpanNow>& current) {
  nlohmann::json out = nlohmann::json::array();
  for (const OpenSpanNow& c : current) {
    out.push_back({{"thread", c.thread},
                   {"step", c.step},
                   {"open_for_ns", c.open_for_ns},
                   {"depth", c.depth}});
  }
  return out;
}

nlohmann::json process_json(const ProcessFigures& p, std::uint64_t now) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepFigures& step : p.steps) steps.push_back(step_json(step));
  nlohmann::json j = {
      {"pid", p.key.pid},
      {"start_time", p.key.start_time},
      {"uid", p.uid},
      {"gid", p.gid},
      {"comm", p.comm},
      {"client", p.client},
      {"library_version", p.library_version},
      {"job", p.job.empty() ? nlohmann::json(nullptr) : nlohmann::json(p.job)},
      {"rank", rank_json(p.rank)},
      {"local_rank", rank_json(p.local_rank)},
      {"world_size", p.world_size == 0 ? nlohmann::json(nullptr) : nlohmann::json(p.world_size)},
      {"alive", p.alive},
      {"connections", p.connections},
      {"events", p.events ? nlohmann::json(*p.events) : nlohmann::json(nullptr)},
      {"dropped", p.dropped},
      {"dropped_by_cause", drop_causes_json(p.dropped_by_cause)},
      {"unmatched_ends", p.unmatched_ends},
      {"abandoned", p.abandoned},
      {"ledger_refused", p.ledger_refused},
      {"steps", std::move(steps)},
      {"current", current_json(p.current)}};
  if (!p.alive) {
    j["exited_at_ns"] = p.exited_at_ns;
    j["exited_for_ns"] = now > p.exited_at_ns ? now - p.exited_at_ns : 0;
  }
  return j;
}

// Per step over the processes, with how many of them have the step.
nlohmann::json totals_json(const std::vector<StepFigures>& totals) {
  nlohmann::json out = nlohmann::json::array();
  for (const StepFigures& t : totals) {
    nlohmann::json j = step_json(t);
    j["processes"] = t.processes;
    out.push_back(std::move(j));
  }
  return out;
}

// Unix seconds, or null.
// Rank skew (PROTOCOL.md 10.4, jobs[].rank_skew): one rank's figures in one step.
nlohmann::json rank_figure_json(const RankStepFigure& f) {
  return {{"rank", f.rank}, {"spans", f.spans}, {"mean_ns", f.mean_ns}, {"ratio", f.ratio}};
}

nlohmann::json step_skew_json(const StepSkew& s) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const RankStepFigure& f : s.ranks) ranks.push_back(rank_figure_json(f));
  return {{"step", s.step},
          {"waiting", s.waiting},
          {"median_ns", s.median_ns},
          {"mad_ns", s.mad_ns},
          {"slowest", rank_figure_json(s.slowest)},
          {"fastest", rank_figure_json(s.fastest)},
          {"ranks", std::move(ranks)}};
}

nlohmann::json steps_skew_json(const std::vector<StepSkew>& steps) {
  nlohmann::json out = nlohmann::json::array();
  for (const StepSkew& s : steps) out.push_back(step_skew_json(s));
  return out;
}

// jobs[].rank_skew: null below two ranks.
nlohmann::json rank_skew_json(const JobFigures& group, const JobRankSkew& skew) {
  if (group.ranks.size() < 2) return nullptr;
  const auto seconds = [](std::uint64_t ns) { return static_cast<double>(ns) / 1e9; };
  return {{"run", steps_skew_json(skew.run)},
          {"window_s", skew.window_ns ? nlohmann::json(*skew.window_ns / 1'000'000'000)
                                      : nlohmann::json(nullptr)},
          {"window_covered_s",
           skew.window_ns ? nlohmann::json(seconds(skew.covered_ns)) : nlohmann::json(nullptr)},
          {"window", skew.window_ns ? steps_skew_json(skew.window) : nlohmann::json(nullptr)}};
}

// jobs[].stragglers: the window's first (what is slow now), then the run's; each with
// the live pids of that rank among the report's processes.
nlohmann::json stragglers_json(const JobFigures& group, const JobRankSkew& skew) {
  nlohmann::json out = nlohmann::json::array();
  const auto add = [&](const std::vector<StepSkew>& steps, const char* scope) {
    for (const StepSkew& s : steps) {
      if (!s.straggler) continue;
      nlohmann::json pids = nlohmann::json::array();
      for (const ProcessFigures* p : group.processes) {
        if (p->alive && p->rank == s.straggler->rank) pids.push_back(p->key.pid);
      }
      out.push_back({{"rank", s.straggler->rank},
                     {"step", s.step},
                     {"scope", scope},
                     {"waiting", s.waiting},
                     {"mean_ns", s.straggler->mean_ns},
                     {"median_ns", s.median_ns},
                     {"ratio", s.straggler->ratio},
                     {"spans", s.straggler->spans},
                     {"pids", std::move(pids)}});
    }
  };
  add(skew.window, "window");
  add(skew.run, "run");
  return out;
}

nlohmann::json unix_or_null(const std::optional<std::int64_t>& unix_s) {
  return unix_s ? nlohmann::json(*unix_s) : nlohmann::json(nullptr);
}

nlohmann::json error_or_null(const std::string& error) {
  return error.empty() ? nlohmann::json(nullptr) : nlohmann::json(error);
}

// The report's "durable": since when its totals may be incomplete (PROTOCOL.md 10.4).
nlohmann::json durable_json(const Durability& d) {
  const char* snapshots = !d.enabled ? "off" : d.failing_since ? "failing" : "ok";
  return {{"snapshots", snapshots},
          {"failing_since", unix_or_null(d.failing_since)},
          {"last_error", error_or_null(d.last_error)},
          {"started_empty_after", unix_or_null(d.started_empty_after)}};
}

std::uint64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  std::uint64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

// Everything the daemon accounts for holding, to compare with rss_bytes: the state's
// charge, the records' copies for views, the flight recorder, and replies not yet taken
// (text and binary sessions', and the metrics texts the HTTP listener holds).
std::uint64_t accounted_bytes(const DaemonCounters& c, const TableFigures& table) {
  return table.state_bytes_charged + table.view_copy_bytes + c.flight_recorder.bytes +
         c.reply_bytes_pending + c.http.reply_bytes;
}

// "rule": the 50% rule over `totals`, `job`'s or the flags' (overhead_rule.h).
nlohmann::json popper_json(const report::ReportOptions& options, const std::optional<JobRef>& job,
                           const std::vector<StepFigures>& totals) {
  const report::ChosenRule chosen = report::rule_for(options.rules, options.rule, job);
  return report::rule_json(chosen, report::evaluate(*chosen.rule, totals));
}

}  // namespace

// ---- `report --json`, a member at a time ------------------------------------------------
//
// The document is written piece by piece so that a report over a large table never holds
// a whole JSON document in memory (a DOM costs ~10x its text: 1,000 steps of 25
// processes are ~40 MiB of nodes for ~6 MiB of text, per render in flight). Each member of
// the top-level object gives its value, or for a big array its elements one at a time,
// as small JSON values; report_json() assembles them into one document, report_json_text()
// dumps each piece as it comes (the same bytes: compact, members in key order as
// nlohmann::json keeps them). A new top-level member is one more entry in
// kReportMembers.

namespace {

struct ReportContext {
  const CollectorView& view;
  const report::ReportOptions& options;
  std::uint64_t now = 0;
  std::vector<ProcessFigures> processes;
  std::optional<std::uint64_t> window_ns;
  std::optional<JobRef> job;  // the filter's
  bool by_pid = false;        // the filter names a pid
};

using Emit = std::function<void(nlohmann::json)>;

struct ReportMember {
  std::string_view key;
  bool array = false;  // emit() gives its elements, one call each; else its value, once
  void (*write)(const ReportContext& r, const Emit& emit);
};

void write_processes(const ReportContext& r, const Emit& emit) {
  for (const ProcessFigures& p : r.processes) emit(process_json(p, r.now));
}

void write_jobs(const ReportContext& r, const Emit& emit) {
  for (const JobFigures& group : r.view.jobs(r.processes)) {
    const JobRankSkew skew = r.view.rank_skew(group, r.window_ns);
    const std::vector<StepFigures> job_totals = r.view.totals(group.processes);
    emit({{"job", group.job.empty() ? nlohmann::json(nullptr) : nlohmann::json(group.job)},
          {"uid", group.uid},
          {"processes", group.processes.size()},
          {"live", group.live},
          {"ranks", group.ranks},
          {"world_size",
           group.world_size == 0 ? nlohmann::json(nullptr) : nlohmann::json(group.world_size)},
          {"totals", totals_json(job_totals)},
          {"rule", popper_json(r.options, JobRef{group.uid, group.job}, job_totals)},
          {"rank_skew", rank_skew_json(group, skew)},
          {"stragglers", stragglers_json(group, skew)}});
  }
}

void write_totals(const ReportContext& r, const Emit& emit) {
  for (nlohmann::json& t : totals_json(r.view.totals(r.processes))) emit(std::move(t));
}

// The whole report's rule as its text's (overhead_rule.h's table_rule_job).
void write_rule(const ReportContext& r, const Emit& emit) {
  emit(popper_json(r.options, report::table_rule_job(r.processes, r.by_pid, r.job),
                   r.view.totals(r.processes)));
}

void write_daemon(const ReportContext& r, const Emit& emit) {
  const DaemonCounters& c = r.view.counters();
  emit({{"events_received", c.events_received},
        {"events_dropped_by_clients", c.events_dropped_by_clients},
        {"events_dropped_by_cause", drop_causes_json(c.events_dropped_by_cause)},
        {"protocol_errors", c.protocol_errors_total()},
        {"clients_connected", c.connections_now},
        {"uptime_s", uptime_s(r.view.uptime())},
        {"durable", durable_json(c.durability)}});
}

// In key order (the order nlohmann::json's objects keep, so the text is the same).
constexpr std::array kReportMembers = {
    ReportMember{"daemon", false, write_daemon},
    ReportMember{"jobs", true, write_jobs},
    ReportMember{"ledger", false,
                 [](const ReportContext& r, const Emit& emit) {
                   emit(report::ledger_json(r.view.ledger(), r.now));
                 }},
    ReportMember{"processes", true, write_processes},
    ReportMember{"rule", false, write_rule},
    ReportMember{"schema", false,
                 [](const ReportContext&, const Emit& emit) { emit("steptrace.report/v1"); }},
    ReportMember{"totals", true, write_totals},
};
static_assert(std::ranges::is_sorted(kReportMembers, {}, &ReportMember::key));

ReportContext report_context(const CollectorView& view, const report::ReportFilter& filter,
                             const report::ReportOptions& options) {
  return {.view = view,
          .options = options,
          .now = view.now_ns(),
          .processes = view.processes(filter.pid, filter.job),
          .window_ns = options.window_s
                           ? std::optional<std::uint64_t>(*options.window_s * 1'000'000'000)
                           : std::nullopt,
          .job = filter.job,
          .by_pid = filter.pid.has_value()};
}

// One piece as a JSON reply carries it: invalid UTF-8 replaced, unsafe code points
// escaped (proto/text_safety.h). Pieces split the document between values, never inside
// a string, so escaping each is escaping the whole.
void append_piece(std::string& out, const nlohmann::json& piece) {
  out += proto::escape_unsafe_in_json(
      piece.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
}

}  // namespace

nlohmann::json report::report_json(const CollectorView& view, const ReportFilter& filter,
                                   const ReportOptions& options) {
  const ReportContext r = report_context(view, filter, options);
  nlohmann::json doc = nlohmann::json::object();
  for (const ReportMember& m : kReportMembers) {
    nlohmann::json& at = doc[std::string(m.key)];
    if (m.array) at = nlohmann::json::array();
    m.write(r, [&](nlohmann::json piece) {
      if (m.array)
        at.push_back(std::move(piece));
      else
        at = std::move(piece);
    });
  }
  return doc;
}

std::string report::report_json_text(const CollectorView& view, const ReportFilter& filter,
                                     const ReportOptions& options) {
  const ReportContext r = report_context(view, filter, options);
  std::string out = "{";
  for (const ReportMember& m : kReportMembers) {
    if (out.size() > 1) out += ',';
    out += '"';
    out += m.key;
    out += "\":";
    if (m.array) out += '[';
    bool first = true;
    m.write(r, [&](nlohmann::json piece) {
      if (m.array && !first) out += ',';
      first = false;
      append_piece(out, piece);
    });
    if (m.array) out += ']';
  }
  out += "}\n";
  return out;
}

nlohmann::json report::report_json(const CollectorView& view, std::optional<std::int32_t> pid) {
  return report_json(view, ReportFilter{pid, std::nullopt});
}

nlohmann::json report::ledger_json(const CollectorView& view) {
  return report::ledger_json(view.ledger(), view.now_ns());
}

nlohmann::json report::stats_json(const CollectorView& view) {
  const TableFigures table = view.table();
  nlohmann::json protocol_errors = view.counters().protocol_errors;
  nlohmann::json out = {
      {"events_dropped_by_cause", drop_causes_json(view.counters().events_dropped_by_cause)},
      {"protocol_errors",
       {{"total", view.counters().protocol_errors_total()},
        {"by_kind", std::move(protocol_errors)}}},
      {"http",
       {{"accepted", view.counters().http.accepted},
        {"refused", view.counters().http.refused},
        {"evicted", view.counters().http.evicted},
        {"header_timeouts", view.counters().http.header_timeouts},
        {"idle_closed", view.counters().http.idle_closed},
        {"write_timeouts", view.counters().http.write_timeouts},
        {"bad_requests", view.counters().http.bad_requests},
        {"responses", view.counters().http.responses}}},
      {"shared_rings",
       {{"mapped", view.counters().rings.mapped},
        {"bytes_mapped", view.counters().rings.bytes_mapped},
        {"attached", view.counters().rings.attached},
        {"refused", view.counters().rings.refused},
        {"events", view.counters().rings.events},
        {"records_refused", view.counters().rings.records_refused},
        {"bad_rings", view.counters().rings.bad_rings}}},
      {"processes",
       {{"tracked", table.tracked},
        {"live", table.live},
        {"exited", table.exited},
        {"connected", table.connected}}},
      {"custom_steps", table.custom_steps},
      {"limits_hit", view.counters().limits_hit},
      {"memory",
       {{"rss_bytes", rss_bytes()},
        {"state_bytes_estimate", table.state_bytes_estimate},
        {"state_bytes_charged", table.state_bytes_charged},
        {"view_copy_bytes", table.view_copy_bytes},
        {"http_reply_bytes", view.counters().http.reply_bytes},
        {"accounted_bytes", accounted_bytes(view.counters(), table)}}},
      {"flight_recorder",
       {{"bytes", view.counters().flight_recorder.bytes},
        {"budget_bytes", view.counters().flight_recorder.budget_bytes},
        {"events_recorded", view.counters().flight_recorder.events_recorded},
        {"events_evicted", view.counters().flight_recorder.events_evicted},
        {"marks_recorded", view.counters().flight_recorder.marks_recorded},
        {"marks_evicted", view.counters().flight_recorder.marks_evicted},
        {"captures_active", view.counters().flight_recorder.captures_active}}},
      {"nvml",
       {{"samples", view.counters().nvml.samples},
        {"sample_errors", view.counters().nvml.sample_errors},
        {"slow_samples", view.counters().nvml.slow_samples},
        {"devices", view.counters().nvml.devices}}},
      {"snapshots",
       {{"failing_since", unix_or_null(view.counters().durability.failing_since)},
        {"last_error", error_or_null(view.counters().durability.last_error)},
        {"last_written_unix", unix_or_null(view.counters().durability.last_written)}}},
      {"uptime_s", uptime_s(view.uptime())},
      {"ledger_anomalies", report::ledger_anomalies_json(view.ledger())}};
  for (const CounterRow& row : kCounterTable) {
    nlohmann::json& at = row.stats_group.empty() ? out : out[std::string(row.stats_group)];
    at[std::string(row.stats_key)] = view.counters().*row.field;
  }
  return out;
}

}  // namespace steptrace::daemon
