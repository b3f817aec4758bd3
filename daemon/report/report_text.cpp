// Text reports: `report` in the shape of the in-process tracer steptrace replaces (boxed
// title, Step | Count | Duration | % Time sorted by time, the Dr. Popper analysis), once
// for all processes and once per process, then the ledger; plus `ledger` and `stats` as
// text. Every client-chosen string (a process's comm, a custom step's name, and whatever
// stats shows) goes through proto::printable(), so none can put escape codes or line
// breaks on an operator's terminal.
#include <algorithm>
#include <array>
#include <span>

#include <nlohmann/json.hpp>

#include "daemon/report/ledger_report.h"
#include "daemon/report/report.h"
#include "daemon/report/report_format.h"
#include "daemon/state/collector.h"
#include "proto/printable.h"
#include "proto/steps.h"

namespace steptrace::daemon {
namespace {

using report::Align;
using report::Column;
using report::format_duration;

struct Row {
  std::string name;  // sanitised
  std::uint64_t count;
  std::uint64_t total_ns;
  std::uint64_t p50_ns;
  std::uint64_t p99_ns;
  std::uint64_t self_ns;
};

double percent_of(std::uint64_t part, std::uint64_t whole) {
  return whole > 0 ? static_cast<double>(part) / static_cast<double>(whole) * 100.0 : 0.0;
}

// The table and analysis for one set of step aggregates (everything after the title),
// the 50% rule's being `popper`.
std::string step_table(const std::vector<StepFigures>& totals, const report::ChosenRule& popper) {
  std::vector<Row> rows;
  std::uint64_t total_time = 0, total_self = 0;
  std::size_t name_width = 15;
  for (const StepFigures& t : totals) {
    const Histogram& h = t.hist();
    if (h.count() == 0) continue;
    rows.push_back({proto::printable(t.name), h.count(), h.sum(), h.percentile(0.50),
                    h.percentile(0.99), t.self_ns});
    total_time = saturating_add(total_time, h.sum());
    total_self = saturating_add(total_self, t.self_ns);
    name_width = std::max(name_width, report::display_width(rows.back().name));
  }
  if (rows.empty()) {
    return "No measurements recorded. Link libsteptrace into the trainer and wrap work in\n"
           "steptrace_start(step)/steptrace_end(step) (C) or steptrace::Span (C++); spans\n"
           "appear here once they end.\n";
  }
  std::stable_sort(rows.begin(), rows.end(),
                   [](const Row& a, const Row& b) { return a.total_ns > b.total_ns; });
  // The reference tracer's columns first (Step, Count, Duration, % Time), then ours.
  const std::array<Column, 8> columns = {
      Column{name_width}, Column{8},  Column{15}, Column{8, Align::kRight},
      Column{15},         Column{15}, Column{15}, Column{8, Align::kRight}};
  std::string out = "Total Measured Time: " + format_duration(total_time) + "\n";
  out += report::rule(columns);
  // Headers are left-aligned like the reference's `{:<8}`; the values under % Time are
  // right-aligned like its `{:>7.2}%`.
  const std::array<Column, 8> header = {Column{name_width}, Column{8},  Column{15}, Column{8},
                                        Column{15},         Column{15}, Column{15}, Column{8}};
  out += report::table_row(header,
                           {"Step", "Count", "Duration", "% Time", "p50", "p99", "Self", "% Self"});
  out += report::rule(columns);
  for (const Row& row : rows) {
    out += report::table_row(
        columns,
        {row.name, std::to_string(row.count), format_duration(row.total_ns),
         report::format_percent(percent_of(row.total_ns, total_time)), format_duration(row.p50_ns),
         format_duration(row.p99_ns), format_duration(row.self_ns),
         report::format_percent(percent_of(row.self_ns, total_self))});
  }
  out += report::rule(columns);
  if (total_self < total_time) {
    // Nested spans are counted in their own row and in their parent's Duration.
    out +=
        "Duration and % Time include nested spans (Total Measured Time counts them twice);\n"
        "Self leaves out the spans that ended inside them on the same thread.\n";
  }
  // Dr. Popper: compute against CPU overhead, the 50% rule (overhead_rule.h).
  out += report::rule_text(popper, report::evaluate(*popper.rule, totals));
  return out;
}

// " (buffer full N, not connected N, ...)" for the causes that are not 0.
std::string drop_causes_text(const ProcessFigures& rec) {
  std::string out;
  for (std::size_t i = 0; i < proto::kReportDropCauseCount; ++i) {
    if (rec.dropped_by_cause[i] == 0) continue;
    std::string name(proto::kReportDropCauseNames[i]);
    std::replace(name.begin(), name.end(), '_', ' ');
    out += (out.empty() ? " (" : ", ") + name + " " + std::to_string(rec.dropped_by_cause[i]);
  }
  return out.empty() ? out : out + ")";
}

// " · job J · rank R/W (local L)" for what the process's Identity said, or "".
std::string identity_text(const ProcessFigures& rec, bool with_job) {
  std::string out;
  if (with_job && !rec.job.empty()) out += " · job " + proto::printable(rec.job);
  if (rec.rank != proto::kNoRank) {
    out += " · rank " + std::to_string(rec.rank);
    if (rec.world_size != 0) out += "/" + std::to_string(rec.world_size);
  }
  if (rec.local_rank != proto::kNoRank) out += " (local " + std::to_string(rec.local_rank) + ")";
  return out;
}

std::string process_header(const ProcessFigures& rec, std::uint64_t now, bool with_job) {
  std::string state;
  if (rec.alive) {
    state = rec.connections > 0 ? "alive" : "alive (disconnected)";
  } else {
    // The daemon notices an exit when the last connection closes or on its liveness
    // tick, so this is an upper bound on how long ago the process ended.
    state = "exit noticed " + report::format_age(rec.exited_at_ns, now) + " ago";
  }
  return "── Process " + std::to_string(rec.key.pid) + " (" +
         (rec.comm.empty() ? std::string("?") : proto::printable(rec.comm)) + ")" +
         identity_text(rec, with_job) + " · " + state + " · dropped " +
         std::to_string(rec.dropped) + drop_causes_text(rec) + " · unmatched ends " +
         std::to_string(rec.unmatched_ends) + " · abandoned " + std::to_string(rec.abandoned) +
         " · open " + std::to_string(rec.open) +
         (rec.ledger_refused == 0
              ? ""
              : " · ledger records refused " + std::to_string(rec.ledger_refused) +
                    " (`steptrace stats`)") +
         "\n";
}

// `stats` as "a.b.c: value" lines; keys and string values sanitised (kinds are the
// daemon's names today, but a line of this text must never be a client's to write).
void flatten(const nlohmann::json& j, const std::string& prefix, std::string& out) {
  if (j.is_object()) {
    if (j.empty() && !prefix.empty()) out += prefix + ": (none)\n";
    for (const auto& [key, value] : j.items()) {
      const std::string name = proto::printable(key);
      flatten(value, prefix.empty() ? name : prefix + "." + name, out);
    }
    return;
  }
  out += prefix + ": " +
         (j.is_string() ? proto::printable(j.get<std::string>())
                        : j.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace)) +
         "\n";
}

// One line per reason the totals may be incomplete, or "" when the state is durable:
// snapshots failing now (a crash would lose what came since), and a snapshot that could
// not be used at start (what came before is missing).
std::string durability_warnings(const Durability& d) {
  std::string out;
  if (d.failing_since) {
    out += "warning: snapshots failing since " + report::format_unix_time(*d.failing_since) + " (" +
           proto::printable(d.last_error) +
           "): a daemon crash now loses what came since (counted as daemon_crash)\n";
  }
  if (d.started_empty_after) {
    out += "warning: started empty at " + report::format_unix_time(*d.started_empty_after) +
           " (the snapshot was unusable and moved aside): totals from before then are "
           "missing\n";
  }
  return out;
}

// "══ Job J (uid U) · 4 processes (3 live) · ranks 0-3 of 4" above a job's sections.
std::string job_header(const JobFigures& group) {
  const std::vector<std::uint32_t>& ranks = group.ranks;
  std::string out = group.job.empty() ? std::string("══ Processes without a job id")
                                      : "══ Job " + proto::printable(group.job);
  out += " (uid " + std::to_string(group.uid) + ") · " + std::to_string(group.processes.size()) +
         (group.processes.size() == 1 ? " process (" : " processes (") +
         std::to_string(group.live) + " live)";
  if (!ranks.empty()) {
    // Runs of consecutive ranks: "0-3, 6".
    std::string list;
    for (std::size_t i = 0; i < ranks.size();) {
      std::size_t j = i;
      while (j + 1 < ranks.size() && ranks[j + 1] <= ranks[j] + 1) ++j;
      list += (list.empty() ? "" : ", ") + std::to_string(ranks[i]) +
              (ranks[j] != ranks[i] ? "-" + std::to_string(ranks[j]) : "");
      i = j + 1;
    }
    out += " · ranks " + list;
    if (group.world_size != 0) out += " of " + std::to_string(group.world_size);
  }
  return out + "\n";
}

// "×1.32" for a ratio to the median.
std::string times(double ratio) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "\u00d7%.2f", ratio);
  return buf;
}

std::string mean_text(double ns) {
  return report::format_duration(static_cast<std::uint64_t>(std::max(0.0, ns)));
}

// One scope's rows: per step the median rank's mean span, the slowest and the fastest
// rank against it; then one line per straggler.
void skew_rows(const std::vector<StepSkew>& steps, std::string_view scope, std::string& out) {
  for (const StepSkew& s : steps) {
    out += "  " + report::pad_right(proto::printable(s.step, 24), 24) + " " +
           report::pad_left(std::to_string(s.ranks.size()), 5) + "  " +
           report::pad_left(mean_text(s.median_ns), 10) + "  " +
           report::pad_right(
               "rank " + std::to_string(s.slowest.rank) + " " + times(s.slowest.ratio), 16) +
           "  rank " + std::to_string(s.fastest.rank) + " " + times(s.fastest.ratio) +
           (s.waiting ? "  (waiting)" : "") + "\n";
  }
  for (const StepSkew& s : steps) {
    if (!s.straggler) continue;
    const RankStepFigure& r = *s.straggler;
    out += "  \u26a0 straggler (" + std::string(scope) + "): rank " + std::to_string(r.rank) +
           " in " + proto::printable(s.step, 32) + ": mean " + mean_text(r.mean_ns) + ", " +
           times(r.ratio) + " the median " + mean_text(s.median_ns) +
           (s.waiting ? " (waits least: the others wait for it)" : "") + "\n";
  }
}

// [Ranks]: a job's rank skew, run and window (empty below two ranks).
std::string ranks_section(const JobFigures& group, const JobRankSkew& skew) {
  if (group.ranks.size() < 2) return "";
  std::string out = "\n[Ranks] mean span per rank against the median over ranks\n";
  const std::string header = "  " + report::pad_right("Step", 24) + " " +
                             report::pad_left("Ranks", 5) + "  " + report::pad_left("Median", 10) +
                             "  " + report::pad_right("Slowest", 16) + "  Fastest\n";
  out += "Whole run:\n";
  if (skew.run.empty())
    out += "  (no step ended by two ranks yet)\n";
  else
    out += header;
  skew_rows(skew.run, "run", out);
  if (skew.window_ns) {
    out += "Last " + std::to_string(*skew.window_ns / 1'000'000'000) + " s";
    if (skew.covered_ns < *skew.window_ns) {
      out += " (samples cover " + std::to_string(skew.covered_ns / 1'000'000'000) + " s)";
    }
    out += ":\n";
    if (skew.window.empty())
      out += "  (no step ended by two ranks in the window)\n";
    else
      out += header;
    skew_rows(skew.window, "window", out);
  }
  return out;
}

}  // namespace

std::string report::report_text(const CollectorView& view, const ReportFilter& filter,
                                const ReportOptions& options) {
  const std::uint64_t now = view.now_ns();
  const auto processes = view.processes(filter.pid, filter.job);
  std::string title = "STEPTRACE REPORT";
  if (filter.pid) title += " (pid " + std::to_string(*filter.pid) + ")";
  // "job J (uid U)": a job is both, another uid may run one with the same id.
  const std::string job_name = filter.job ? "job " + proto::printable(filter.job->job, 32) +
                                                " (uid " + std::to_string(filter.job->uid) + ")"
                                          : std::string();
  if (filter.job) title += " (" + job_name + ")";
  const auto rule_of = [&options](const std::optional<JobRef>& job) {
    return report::rule_for(options.rules, options.rule, job);
  };
  std::string out = "\n" + report::boxed_title(title);
  const std::optional<std::uint64_t> window_ns =
      options.window_s ? std::optional<std::uint64_t>(*options.window_s * 1'000'000'000)
                       : std::nullopt;
  out += durability_warnings(view.counters().durability);
  if (processes.empty()) {
    if (filter.pid) {
      out += "No process with pid " + std::to_string(*filter.pid) + " is tracked";
      out += filter.job ? " in " + job_name + ".\n" : ".\n";
    } else if (filter.job) {
      out += "No process of " + job_name + " is tracked.\n";
    } else {
      out +=
          "No process has connected yet. Run a trainer linked with libsteptrace "
          "(STEPTRACE_SOCKET\nnames this daemon's socket) and spans will appear here.\n";
    }
  } else if (processes.size() == 1) {
    // One process (`report --pid N`, or only one there): its table once.
    const ProcessFigures& only = processes.front();
    out += process_header(only, now, true);
    out += step_table(view.totals(processes), rule_of(JobRef{only.uid, only.job}));
  } else {
    const auto groups = view.jobs(processes);
    const bool by_job = groups.size() > 1 || !groups.front().job.empty();
    out += "Processes: " + std::to_string(processes.size());
    if (by_job) out += " · jobs: " + std::to_string(groups.size());
    out += "\n";
    // The whole table's rule: the default; one job's (`--job`) or one pid's (`--pid`), the
    // job's (overhead_rule.h's table_rule_job).
    out +=
        step_table(view.totals(processes),
                   rule_of(report::table_rule_job(processes, filter.pid.has_value(), filter.job)));
    for (const JobFigures& group : groups) {
      const report::ChosenRule job_rule = rule_of(JobRef{group.uid, group.job});
      if (by_job) {
        out += "\n" + job_header(group);
        // A job of one process: its own section says it all.
        if (group.processes.size() > 1) out += step_table(view.totals(group.processes), job_rule);
        out += ranks_section(group, view.rank_skew(group, window_ns));
      }
      for (const ProcessFigures* rec : group.processes) {
        out += "\n" + process_header(*rec, now, false);
        out += step_table(view.totals(std::span<const ProcessFigures>(rec, 1)), job_rule);
      }
    }
  }
  out += "\n[VRAM Ledger]\n";
  out += report::ledger_text(view.ledger(), now);
  return out;
}

std::string report::report_text(const CollectorView& view, std::optional<std::int32_t> pid) {
  return report_text(view, ReportFilter{pid, std::nullopt});
}

std::string report::ledger_text(const CollectorView& view) {
  return report::ledger_text(view.ledger(), view.now_ns());
}

std::string report::stats_text(const CollectorView& view) {
  std::string out;
  flatten(stats_json(view), "", out);
  return out;
}

}  // namespace steptrace::daemon
