// JSON reports: `report --json` ("steptrace.report/v1"), `ledger --json` and
// `stats --json`, all read from the Collector's state.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>

#include <nlohmann/json.hpp>

#include "daemon/report/ledger_report.h"
#include "daemon/report/report.h"
#include "daemon/state/collector.h"
#include "daemon/state/collector_state.h"
#include "daemon/state/counter_table.h"

namespace steptrace::daemon {
namespace {

// {"buffer_full": n, "not_connected": n, "in_flight": n, "invalid": n}: the wire's cause
// names (PROTOCOL.md section 4.7).
nlohmann::json drop_causes_json(const DropCounts& counts) {
  nlohmann::json j = nlohmann::json::object();
  for (std::size_t i = 0; i < proto::kDropCauseCount; ++i)
    j[std::string(proto::kDropCauseNames[i])] = counts[i];
  return j;
}

std::uint64_t uptime_s(std::chrono::steady_clock::duration elapsed) {
  return static_cast<std::uint64_t>(
      std::max<std::int64_t>(0, std::chrono::duration_cast<std::chrono::seconds>(elapsed).count()));
}

nlohmann::json step_json(std::string_view name, const StepAgg& agg, std::uint64_t open) {
  const Histogram& h = agg.hist;
  return {{"step", name},
          {"count", h.count()},
          {"total_ns", h.sum()},
          {"min_ns", h.min()},
          {"max_ns", h.max()},
          {"p50_ns", h.percentile(0.50)},
          {"p99_ns", h.percentile(0.99)},
          {"open", open},
          {"unmatched_ends", agg.unmatched_ends},
          {"abandoned", agg.abandoned},
          {"depth_dropped", agg.depth_dropped},
          {"self_ns", agg.self_ns}};
}

// A rank, or null when the process did not say.
nlohmann::json rank_json(std::uint32_t rank) {
  return rank == proto::kNoRank ? nlohmann::json(nullptr) : nlohmann::json(rank);
}

// Per thread, the innermost open span (the latest start still open) and the nesting
// depth: what `steptrace top` shows, e.g. a trainer stuck in WaitPoll.
nlohmann::json current_json(const ProcessRecord& rec, std::uint64_t now) {
  std::vector<const ThreadSpans*> threads;
  for (const auto& t : rec.threads) {
    if (t->open != 0) threads.push_back(t.get());
  }
  std::sort(threads.begin(), threads.end(),
            [](const ThreadSpans* a, const ThreadSpans* b) { return a->tid < b->tid; });
  nlohmann::json out = nlohmann::json::array();
  for (const ThreadSpans* t : threads) {
    std::size_t best_slot = 0;
    std::uint64_t best_start = 0;
    bool found = false;
    for (std::size_t slot = 0; slot < t->stacks.size(); ++slot) {
      if (t->stacks[slot].empty()) continue;
      const std::uint64_t start = t->stacks[slot].back();
      if (!found || start >= best_start) {
        best_slot = slot;
        best_start = start;
        found = true;
      }
    }
    if (!found) continue;
    out.push_back({{"thread", t->tid},
                   {"step", rec.step_name(best_slot)},
                   {"open_for_ns", now > best_start ? now - best_start : 0},
                   {"depth", t->open}});
  }
  return out;
}

nlohmann::json process_json(const ProcessRecord& rec, std::uint64_t now) {
  const auto open = rec.open_per_slot();
  nlohmann::json steps = nlohmann::json::array();
  std::uint64_t unmatched = 0, abandoned = 0;
  for (std::size_t slot = 0; slot < rec.steps.size(); ++slot) {
    const StepAgg& agg = rec.steps[slot];
    unmatched += agg.unmatched_ends;
    abandoned += agg.abandoned;
    if (!agg.has_data() && open[slot] == 0) continue;
    steps.push_back(step_json(rec.step_name(slot), agg, open[slot]));
  }
  nlohmann::json j = {{"pid", rec.key().pid},
                      {"start_time", rec.key().start_time},
                      {"uid", rec.peer.uid},
                      {"gid", rec.peer.gid},
                      {"comm", rec.peer.comm},
                      {"client", rec.client_name},
                      {"library_version", rec.library_version},
                      {"job", rec.job.empty() ? nlohmann::json(nullptr) : nlohmann::json(rec.job)},
                      {"rank", rank_json(rec.rank)},
                      {"local_rank", rank_json(rec.local_rank)},
                      {"world_size", rec.world_size == 0 ? nlohmann::json(nullptr)
                                                         : nlohmann::json(rec.world_size)},
                      {"alive", rec.alive},
                      {"connections", rec.connections},
                      {"dropped", rec.dropped},
                      {"dropped_by_cause", drop_causes_json(rec.dropped_by_cause)},
                      {"unmatched_ends", unmatched},
                      {"abandoned", abandoned},
                      {"steps", std::move(steps)},
                      {"current", current_json(rec, now)}};
  if (!rec.alive) {
    j["exited_at_ns"] = rec.exited_at_ns;
    j["exited_for_ns"] = now > rec.exited_at_ns ? now - rec.exited_at_ns : 0;
  }
  return j;
}

// Per step over `processes`, with how many of them have the step.
nlohmann::json totals_json(const std::vector<const ProcessRecord*>& processes) {
  nlohmann::json totals = nlohmann::json::array();
  for (const NamedTotals& t : totals_by_name(processes)) {
    nlohmann::json j = step_json(t.name, t.agg, t.open);
    j["processes"] = t.processes;
    totals.push_back(std::move(j));
  }
  return totals;
}

std::uint64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  std::uint64_t size = 0, resident = 0;
  if (!(in >> size >> resident)) return 0;
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

}  // namespace

nlohmann::json report::report_json(const CollectorView& view, const ReportFilter& filter) {
  const std::uint64_t now = view.now_ns();
  const auto processes = select_processes(view.state(), filter.pid, filter.job);
  nlohmann::json procs = nlohmann::json::array();
  for (const ProcessRecord* rec : processes) procs.push_back(process_json(*rec, now));
  nlohmann::json jobs = nlohmann::json::array();
  for (const JobGroup& group : group_by_job(view.state(), processes, false)) {
    jobs.push_back(
        {{"job", group.key.job.empty() ? nlohmann::json(nullptr) : nlohmann::json(group.key.job)},
         {"uid", group.key.uid},
         {"processes", group.processes.size()},
         {"live", group.live},
         {"ranks", group.ranks},
         {"world_size",
          group.world_size == 0 ? nlohmann::json(nullptr) : nlohmann::json(group.world_size)},
         {"totals", totals_json(group.processes)}});
  }
  return {{"schema", "steptrace.report/v1"},
          {"processes", std::move(procs)},
          {"totals", totals_json(processes)},
          {"jobs", std::move(jobs)},
          {"ledger", report::ledger_json(view.state().ledger.state(), now)},
          {"daemon",
           {{"events_received", view.counters().events_received},
            {"events_dropped_by_clients", view.counters().events_dropped_by_clients},
            {"events_dropped_by_cause", drop_causes_json(view.counters().events_dropped_by_cause)},
            {"protocol_errors", view.counters().protocol_errors_total()},
            {"clients_connected", view.counters().connections_now},
            {"uptime_s", uptime_s(view.uptime())}}}};
}

nlohmann::json report::report_json(const CollectorView& view, std::optional<std::int32_t> pid) {
  return report_json(view, ReportFilter{pid, std::nullopt});
}

nlohmann::json report::ledger_json(const CollectorView& view) {
  return report::ledger_json(view.state().ledger.state(), view.now_ns());
}

nlohmann::json report::stats_json(const CollectorView& view) {
  const CollectorState& state = view.state();
  std::size_t state_bytes = sizeof(CollectorState) +
                            state.slots.capacity() * sizeof(state.slots[0]) +
                            state.by_key.size() * 64;
  std::uint64_t live = 0, connected = 0, custom_steps = 0;
  for (const auto& slot : state.slots) {
    if (!slot) continue;
    state_bytes += slot->memory_bytes();
    live += slot->alive ? 1 : 0;
    connected += slot->connections > 0 ? 1 : 0;
    custom_steps += slot->custom_ids.size();
  }
  for (const auto& [name, hist] : *state.retired)
    state_bytes += name.capacity() + hist.memory_bytes() + 48;
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
       {{"tracked", state.by_key.size()},
        {"live", live},
        {"exited", state.exited},
        {"connected", connected}}},
      {"custom_steps", custom_steps},
      {"limits_hit", view.counters().limits_hit},
      {"memory",
       {{"rss_bytes", rss_bytes()},
        {"state_bytes_estimate", state_bytes},
        {"state_bytes_charged", state.charged}}},
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
      {"uptime_s", uptime_s(view.uptime())},
      {"ledger_anomalies", report::ledger_anomalies_json(state.ledger.state())}};
  for (const CounterRow& row : kCounterTable) {
    nlohmann::json& at = row.stats_group.empty() ? out : out[std::string(row.stats_group)];
    at[std::string(row.stats_key)] = view.counters().*row.field;
  }
  return out;
}

}  // namespace steptrace::daemon
