// `metrics`: the Prometheus text exposition format 0.0.4, for the node's Prometheus
// (socket command or the optional HTTP listener). Base units (seconds, bytes), counters
// end in _total, every family has # HELP and # TYPE, label values are escaped.
//
// steptrace_step_duration_seconds sums every process the daemon knows plus the ones it
// already evicted (CollectorView::step_histograms), with no pid label, so a
// cluster-wide Prometheus can sum it across nodes and it never goes backwards unless
// reset. Per-process series exist only for live processes, so exited pids do not pile
// up as stale series. Everything is read from the view's read model (state/read_model.h).
#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/report/ledger_report.h"
#include "daemon/report/report.h"
#include "daemon/report/report_format.h"
#include "daemon/state/collector.h"
#include "daemon/state/counter_table.h"
#include "proto/errc.h"

namespace steptrace::daemon {
namespace {

using report::MetricFamily;
using report::with_known_kinds;

// The "le" label of each bucket: the bound in seconds, shortest round-trip form
// ("2.5e-06", "0.001"), then "+Inf".
const std::array<std::string, Histogram::kPromBuckets>& le_labels() {
  static const auto kLabels = [] {
    std::array<std::string, Histogram::kPromBuckets> labels;
    for (std::size_t i = 0; i < Histogram::kPromBoundsNs.size(); ++i) {
      labels[i] = report::format_double(static_cast<double>(Histogram::kPromBoundsNs[i]) / 1e9);
    }
    labels.back() = "+Inf";
    return labels;
  }();
  return kLabels;
}

double seconds(std::uint64_t ns) { return static_cast<double>(ns) / 1e9; }

// Step names with a series of their own in steptrace_step_duration_seconds (built-in
// steps included); the others share the "(other)" series.
constexpr std::size_t kMaxStepSeries = 4096;
constexpr std::string_view kOtherStep = "(other)";

// A job's series: per step, what its processes in the table and its evicted ones ended.
struct JobSeries {
  struct Step {
    std::uint64_t count = 0;
    std::uint64_t total_ns = 0;
    std::uint64_t self_ns = 0;
  };
  std::string job;
  std::string uid;
  std::map<std::string, Step, std::less<>> steps;
  std::uint64_t live = 0, exited = 0, dropped = 0;

  // Past the names the state keeps for evicted processes, the rest of a job's steps
  // share the "(other)" series.
  void add(std::string_view name, std::uint64_t count, std::uint64_t total, std::uint64_t self) {
    auto it = steps.find(name);
    if (it == steps.end()) {
      it = steps
               .try_emplace(
                   std::string(steps.size() < RetiredJobFigures::kMaxSteps ? name : kOtherStep))
               .first;
    }
    it->second.count = saturating_add(it->second.count, count);
    it->second.total_ns = saturating_add(it->second.total_ns, total);
    it->second.self_ns = saturating_add(it->second.self_ns, self);
  }
};

// What its evicted processes left first, then its processes in the table.
JobSeries job_series(const JobFigures& group) {
  JobSeries j{group.job, std::to_string(group.uid), {}, 0, 0, 0};
  if (group.retired) {
    for (const RetiredStepTotals& t : group.retired->steps)
      j.add(t.name, t.count, t.total_ns, t.self_ns);
    j.exited += group.retired->processes;
    j.dropped = saturating_add(j.dropped, group.retired->dropped);
  }
  for (const ProcessFigures* p : group.processes) {
    (p->alive ? j.live : j.exited) += 1;
    j.dropped = saturating_add(j.dropped, p->dropped);
    for (const StepFigures& step : p->steps) {
      const Histogram& h = step.hist();
      if (h.count() != 0) j.add(step.name, h.count(), h.sum(), step.self_ns);
    }
  }
  return j;
}

// Per job (uid, job id), the totals of its processes in the table plus what its evicted
// ones left (JobFigures::retired), so the counters keep counting after a short job's
// processes exit and leave. Jobs are bounded by max_jobs (retired) and by the process
// table (live); their step names by RetiredJobFigures::kMaxSteps.
void append_job_metrics(const CollectorView& view, std::span<const ProcessFigures> all,
                        std::string& out) {
  std::vector<JobSeries> jobs;
  for (const JobFigures& group : view.jobs_and_retired(all)) jobs.push_back(job_series(group));
  const auto per_step = [&](std::string_view name, std::string_view help, auto&& value) {
    MetricFamily f(out, name, "counter", help);
    for (const JobSeries& j : jobs) {
      for (const auto& [step, t] : j.steps)
        f.sample({{"job_id", j.job}, {"uid", j.uid}, {"step", step}}, value(t));
    }
  };
  using Step = JobSeries::Step;
  per_step("steptrace_job_step_seconds_total",
           "Total time of ended spans per job and step, exited processes included.",
           [](const Step& t) { return seconds(t.total_ns); });
  per_step("steptrace_job_step_self_seconds_total",
           "Self time (nested spans left out) per job and step, exited processes included.",
           [](const Step& t) { return seconds(t.self_ns); });
  per_step("steptrace_job_step_spans_total",
           "Ended spans per job and step, exited processes included.",
           [](const Step& t) { return t.count; });
  MetricFamily f_procs(out, "steptrace_job_processes", "gauge",
                       "Processes of a job, live and exited (evicted ones included).");
  for (const JobSeries& j : jobs) {
    f_procs.sample({{"job_id", j.job}, {"uid", j.uid}, {"state", "live"}}, j.live);
    f_procs.sample({{"job_id", j.job}, {"uid", j.uid}, {"state", "exited"}}, j.exited);
  }
  MetricFamily f_dropped(out, "steptrace_job_dropped_events_total", "counter",
                         "Events the processes of a job could not deliver, exited ones included.");
  for (const JobSeries& j : jobs) f_dropped.sample({{"job_id", j.job}, {"uid", j.uid}}, j.dropped);
}

// Per job and rank (the processes that sent one): per step, its processes in the table
// (live and exited: a rank restarted is a new pid with the same rank) plus what its
// evicted ones left, with no pid label, so a rank's series keep counting across its
// restarts. Bounded by max_jobs (retired) and the process table (live); per job by
// RetiredJob::kMaxJobRanks ranks kept after eviction and kMaxSteps step names per rank.
void append_job_rank_metrics(const CollectorView& view, std::span<const ProcessFigures> all,
                             std::string& out) {
  struct RankSeries {
    std::string job;
    std::string uid;
    std::string rank;
    std::map<std::string, JobSeries::Step, std::less<>> steps;
  };
  std::vector<RankSeries> series;
  for (const JobFigures& group : view.jobs_and_retired(all)) {
    std::map<std::uint32_t, JobSeries> by_rank;
    if (group.retired) {
      for (const RetiredRankFigures& r : group.retired->ranks) {
        for (const RetiredStepTotals& t : r.steps)
          by_rank[r.rank].add(t.name, t.count, t.total_ns, t.self_ns);
      }
    }
    for (const ProcessFigures* p : group.processes) {
      if (p->rank == proto::kNoRank) continue;
      JobSeries& j = by_rank[p->rank];
      for (const StepFigures& step : p->steps) {
        const Histogram& h = step.hist();
        if (h.count() != 0) j.add(step.name, h.count(), h.sum(), step.self_ns);
      }
    }
    for (auto& [rank, j] : by_rank) {
      series.push_back(
          {group.job, std::to_string(group.uid), std::to_string(rank), std::move(j.steps)});
    }
  }
  const auto per_step = [&](std::string_view name, std::string_view help, auto&& value) {
    MetricFamily f(out, name, "counter", help);
    for (const RankSeries& r : series) {
      for (const auto& [step, t] : r.steps)
        f.sample({{"job_id", r.job}, {"uid", r.uid}, {"rank", r.rank}, {"step", step}}, value(t));
    }
  };
  using Step = JobSeries::Step;
  per_step("steptrace_job_rank_step_seconds_total",
           "Total time of ended spans per job, rank and step, over the rank's restarts "
           "(no pid label).",
           [](const Step& t) { return seconds(t.total_ns); });
  per_step("steptrace_job_rank_step_spans_total",
           "Ended spans per job, rank and step, over the rank's restarts (no pid label).",
           [](const Step& t) { return t.count; });
  // The steps this daemon reads the other way round in rank skew (is_waiting_step():
  // WaitPoll and config's rank_skew.waiting_steps, at most 64), so that the Prometheus
  // rules join on them instead of guessing from step names: one series per name.
  const RankSkewRules& rules = view.rank_skew_rules();
  std::set<std::string, std::less<>> waiting{"WaitPoll"};
  waiting.insert(rules.waiting_steps.begin(), rules.waiting_steps.end());
  MetricFamily info(out, "steptrace_waiting_step_info", "gauge",
                    "1 per step this daemon reads as waiting in rank skew (WaitPoll and "
                    "rank_skew.waiting_steps): the rank that waits least is the suspect.");
  for (const std::string& step : waiting) info.sample({{"step", step}}, std::uint64_t{1});
}

// steptrace_step_duration_seconds: per step, every process of this node, the evicted ones
// included.
void append_step_histograms(const CollectorView& view, std::string& out) {
  std::map<std::string, Histogram, std::less<>> by_step;
  for (const proto::BuiltinStep& step : proto::kBuiltinSteps) {
    by_step.try_emplace(std::string(step.name));
  }
  // Custom step names are chosen by clients: past kMaxStepSeries names, the rest are
  // merged into "(other)", so the family's cardinality stays bounded whatever they send.
  for (const StepHistogram& step : view.step_histograms()) {
    auto it = by_step.find(step.name);
    if (it == by_step.end()) {
      it =
          by_step.try_emplace(by_step.size() < kMaxStepSeries ? step.name : std::string(kOtherStep))
              .first;
    }
    it->second.merge(step.hist);
  }
  MetricFamily f(out, "steptrace_step_duration_seconds", "histogram",
                 "Duration of ended spans per step, summed over all processes of this node.");
  for (const auto& [name, h] : by_step) {
    std::uint64_t cumulative = 0;
    const auto& le = le_labels();
    for (std::size_t b = 0; b < Histogram::kPromBuckets; ++b) {
      cumulative += h.prom_buckets()[b];
      f.sample({{"step", name}, {"le", le[b]}}, cumulative, "_bucket");
    }
    f.sample({{"step", name}}, seconds(h.sum()), "_sum");
    f.sample({{"step", name}}, h.count(), "_count");
  }
}

// Per live process: per step, then its drops. One pass per family, straight into `out`:
// with thousands of (process, step) pairs the text runs to megabytes, and building it in
// pieces and concatenating them cost more than the formatting (a scrape holds the io
// thread while it renders).
void append_live_process_metrics(std::span<const ProcessFigures> all, std::string& out) {
  struct Live {
    const ProcessFigures* p;
    std::string pid;
    std::string uid;   // next to job_id: a job is (uid, job id)
    std::string rank;  // "" when not known: the label is left out
  };
  std::vector<Live> live;
  std::size_t pairs = 0;
  for (const ProcessFigures& p : all) {
    if (!p.alive) continue;
    live.push_back({&p, std::to_string(p.key.pid), std::to_string(p.uid),
                    p.rank == proto::kNoRank ? std::string() : std::to_string(p.rank)});
    pairs += p.steps.size();
  }
  // About 120 bytes a sample, five families per (process, step).
  out.reserve(out.size() + pairs * 5 * 120 + live.size() * 120 + 64 * 1024);
  // `value(step)` gives the sample; its type (counts or seconds) picks the format.
  auto per_step = [&](std::string_view name, std::string_view type, std::string_view help,
                      auto&& value) {
    MetricFamily f(out, name, type, help);
    for (const Live& l : live) {
      for (const StepFigures& step : l.p->steps) {
        f.sample({{"pid", l.pid},
                  {"comm", l.p->comm},
                  {"job_id", l.p->job},
                  {"uid", l.uid},
                  {"rank", l.rank},
                  {"step", step.name}},
                 value(step));
      }
    }
  };
  per_step("steptrace_process_step_seconds_total", "counter",
           "Total time of ended spans per live process and step.",
           [](const StepFigures& s) { return seconds(s.hist().sum()); });
  per_step("steptrace_process_step_spans_total", "counter",
           "Ended spans per live process and step.",
           [](const StepFigures& s) { return s.hist().count(); });
  per_step("steptrace_process_open_spans", "gauge", "Spans open now per live process and step.",
           [](const StepFigures& s) { return s.open; });
  per_step("steptrace_process_unmatched_ends_total", "counter",
           "Span ends without a start per live process and step.",
           [](const StepFigures& s) { return s.unmatched_ends; });
  per_step("steptrace_process_abandoned_spans_total", "counter",
           "Spans left open when the process's connections closed.",
           [](const StepFigures& s) { return s.abandoned; });
  MetricFamily f_dropped(out, "steptrace_process_dropped_events_total", "counter",
                         "Events a live process reported it could not deliver.");
  for (const Live& l : live) {
    f_dropped.sample({{"pid", l.pid},
                      {"comm", l.p->comm},
                      {"job_id", l.p->job},
                      {"uid", l.uid},
                      {"rank", l.rank}},
                     l.p->dropped);
  }
  MetricFamily f_cause(out, "steptrace_process_dropped_events_by_cause_total", "counter",
                       "Events a live process could not deliver, by cause (clients of "
                       "protocol version 2; buffer_full means the daemon fell behind).");
  for (const Live& l : live) {
    for (std::size_t i = 0; i < proto::kReportDropCauseCount; ++i) {
      f_cause.sample({{"pid", l.pid},
                      {"comm", l.p->comm},
                      {"job_id", l.p->job},
                      {"uid", l.uid},
                      {"rank", l.rank},
                      {"cause", proto::kReportDropCauseNames[i]}},
                     l.p->dropped_by_cause[i]);
    }
  }
}

// The plain counters of one group (state/counter_table.h), in table order.
void append_counter_group(const DaemonCounters& c, MetricGroup group, std::string& out) {
  for (const CounterRow& row : kCounterTable) {
    if (row.metric_group == group) {
      MetricFamily(out, row.metric, row.metric_type, row.help).sample({}, c.*row.field);
    }
  }
}

// What clients sent and what they could not, and the connections closed for errors.
void append_ingest_metrics(const DaemonCounters& c, std::string& out) {
  append_counter_group(c, MetricGroup::kIngest, out);
  {
    MetricFamily f(out, "steptrace_events_dropped_by_clients_by_cause_total", "counter",
                   "Events clients could not deliver, by cause (protocol version 2 clients).");
    for (std::size_t i = 0; i < proto::kReportDropCauseCount; ++i)
      f.sample({{"cause", std::string(proto::kReportDropCauseNames[i])}},
               c.events_dropped_by_cause[i]);
  }
  // The kinds of protocol error (proto/errc.h, and those sessions count that are not
  // errcs) are always exported, zero until seen; any other kind counted is exported too.
  std::vector<std::string_view> kinds(kSessionErrorKinds.begin(), kSessionErrorKinds.end());
  for (const ErrcInfo& e : kErrcTable) {
    if (e.protocol_error) kinds.push_back(e.name);
  }
  const auto errors = with_known_kinds(kinds, c.protocol_errors);
  MetricFamily f(out, "steptrace_protocol_errors_total", "counter",
                 "Connections closed for a protocol error, by kind.");
  for (const auto& [kind, n] : errors) f.sample({{"kind", kind}}, n);
}

// The HTTP listener's connections and responses.
void append_http_metrics(const HttpCounters& h, std::string& out) {
  MetricFamily f(out, "steptrace_http_connections_total", "counter",
                 "Connections to this HTTP listener, by what became of them.");
  f.sample({{"outcome", "accepted"}}, h.accepted);
  f.sample({{"outcome", "refused"}}, h.refused);
  f.sample({{"outcome", "evicted"}}, h.evicted);
  f.sample({{"outcome", "header_timeout"}}, h.header_timeouts);
  f.sample({{"outcome", "idle_closed"}}, h.idle_closed);
  f.sample({{"outcome", "write_timeout"}}, h.write_timeouts);
  f.sample({{"outcome", "bad_request"}}, h.bad_requests);
  MetricFamily(out, "steptrace_http_responses_total", "counter", "HTTP responses written in full.")
      .sample({}, h.responses);
}

// Client connections, the /proc probe, and the text commands.
void append_connection_metrics(const DaemonCounters& c, std::string& out) {
  append_counter_group(c, MetricGroup::kConnections, out);
}

// Shared-memory rings.
void append_ring_metrics(const RingCounters& r, std::string& out) {
  MetricFamily(out, "steptrace_shared_rings", "gauge",
               "Client rings in shared memory the daemon maps now.")
      .sample({}, r.mapped);
  MetricFamily(out, "steptrace_shared_ring_bytes", "gauge",
               "Bytes of those rings' slots (what the ring budgets count).")
      .sample({}, r.bytes_mapped);
  MetricFamily(out, "steptrace_shared_ring_events_total", "counter",
               "Events read from shared-memory rings.")
      .sample({}, r.events);
  MetricFamily(out, "steptrace_shared_rings_refused_total", "counter",
               "Rings a client offered that the daemon refused (a limit, or not a sealed "
               "memfd of the right size); their events go on the socket.")
      .sample({}, r.refused);
  MetricFamily(out, "steptrace_shared_ring_records_refused_total", "counter",
               "Ring records skipped as invalid (counted as the process's drops, cause "
               "invalid).")
      .sample({}, r.records_refused);
}

// The flight recorder (`trace`) and NVML's sampling.
void append_recorder_and_nvml_metrics(const DaemonCounters& c, std::string& out) {
  const FlightRecorderCounters& r = c.flight_recorder;
  MetricFamily(out, "steptrace_flight_recorder_bytes", "gauge",
               "Bytes the flight recorder holds for `trace` (its budget: "
               "steptrace_flight_recorder_budget_bytes).")
      .sample({}, static_cast<std::uint64_t>(r.bytes));
  MetricFamily(out, "steptrace_flight_recorder_budget_bytes", "gauge",
               "The flight recorder's budget in force (0: off).")
      .sample({}, static_cast<std::uint64_t>(r.budget_bytes));
  {
    MetricFamily f(out, "steptrace_flight_recorder_events_total", "counter",
                   "Raw events the flight recorder kept, and those it evicted (budget, horizon).");
    f.sample({{"outcome", "recorded"}}, r.events_recorded);
    f.sample({{"outcome", "evicted"}}, r.events_evicted);
  }
  const NvmlCounters& n = c.nvml;
  MetricFamily(out, "steptrace_nvml_samples_total", "counter",
               "NVML device samples applied (0 when NVML is off or absent).")
      .sample({}, n.samples);
  MetricFamily(out, "steptrace_nvml_sample_errors_total", "counter",
               "NVML device samples in which a call failed (stats nvml.sample_errors).")
      .sample({}, n.sample_errors);
  MetricFamily(out, "steptrace_nvml_slow_samples_total", "counter",
               "NVML device samples that took longer than nvml_interval_ms.")
      .sample({}, n.slow_samples);
}

// The process table, the limits hit, the snapshots, and the uptime.
void append_state_metrics(const CollectorView& view, std::string& out) {
  const DaemonCounters& c = view.counters();
  {
    const TableFigures table = view.table();
    MetricFamily f(out, "steptrace_processes", "gauge", "Processes tracked, by state.");
    f.sample({{"state", "live"}}, table.live);
    f.sample({{"state", "exited"}}, table.exited);
  }
  {
    // Every limit (state/types.h), at zero until hit.
    const auto limits = with_known_kinds(kLimitNames, c.limits_hit);
    MetricFamily f(out, "steptrace_limit_hits_total", "counter",
                   "Times a limit (configured, or a fixed bound such as trace --children's) "
                   "refused or dropped something, by limit.");
    for (const auto& [name, n] : limits) f.sample({{"limit", name}}, n);
  }
  append_counter_group(c, MetricGroup::kSnapshots, out);
  MetricFamily(out, "steptrace_snapshot_last_success_timestamp_seconds", "gauge",
               "Unix time of the last good snapshot write, or of the restore at start; 0 "
               "before either (and without a state directory).")
      .sample({}, static_cast<std::uint64_t>(
                      std::max<std::int64_t>(0, c.durability.last_written.value_or(0))));
  MetricFamily(out, "steptrace_snapshot_failing", "gauge",
               "1 while snapshot writes fail (since the first failure until one succeeds): a "
               "daemon crash now loses what came since, counted as daemon_crash; else 0.")
      .sample({}, std::uint64_t{c.durability.failing_since ? 1u : 0u});
  MetricFamily(out, "steptrace_uptime_seconds", "gauge", "Seconds since the daemon started.")
      .sample({}, std::chrono::duration<double>(view.uptime()).count());
}

}  // namespace

std::string report::metrics_text(const CollectorView& view) {
  const DaemonCounters& c = view.counters();
  const std::vector<ProcessFigures> processes = view.processes();
  std::string out;
  out.reserve(16 * 1024);
  append_step_histograms(view, out);
  append_live_process_metrics(processes, out);
  append_job_metrics(view, processes, out);
  append_job_rank_metrics(view, processes, out);
  append_ingest_metrics(c, out);
  append_http_metrics(c.http, out);
  append_connection_metrics(c, out);
  append_ring_metrics(c.rings, out);
  append_recorder_and_nvml_metrics(c, out);
  append_state_metrics(view, out);
  report::append_ledger_metrics(view.ledger(), out);
  report::append_process_metrics(view, out);
  return out;
}

}  // namespace steptrace::daemon
