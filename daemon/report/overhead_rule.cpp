#include "daemon/report/overhead_rule.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include <nlohmann/json.hpp>

#include "daemon/report/report_format.h"
#include "daemon/state/saturating.h"
#include "proto/rule_steps.h"

namespace steptrace::daemon::report {
namespace {

std::string joined(const std::vector<std::string>& names, std::string_view between) {
  std::string out;
  for (std::size_t i = 0; i < names.size(); ++i) {
    if (i > 0) out += between;
    out += names[i];
  }
  return out;
}

std::uint64_t sum_of(const std::vector<std::string>& steps,
                     const std::vector<StepFigures>& totals) {
  std::uint64_t sum = 0;
  for (const StepFigures& t : totals) {
    if (std::find(steps.begin(), steps.end(), t.name) != steps.end()) {
      sum = saturating_add(sum, t.hist().sum());
    }
  }
  return sum;
}

const char* source_name(RuleSource source) {
  switch (source) {
    case RuleSource::kJob:
      return "job";
    case RuleSource::kFlags:
      return "flags";
    case RuleSource::kDefault:
      break;
  }
  return "default";
}

// Above half of compute + overhead in overhead: the approach is falsified.
bool falsified(const RuleFigures& f) { return f.overhead_pct && *f.overhead_pct > 50.0; }

// Why there is no verdict, in one line that names the rule's steps.
std::string no_compute_line(const OverheadRule& rule) {
  std::string out = "No " + joined(rule.compute, " or ") +
                    " spans, so no 50% verdict: the rule sets compute (" +
                    joined(rule.compute, " + ") + ") against CPU overhead (" +
                    joined(rule.overhead, " + ") + ").";
  if (std::find(rule.compute.begin(), rule.compute.end(), "Matmul") != rule.compute.end()) {
    out += " steptrace.torch.instrument(model, modules=True) records Linear layers as Matmul.";
  } else {
    out += " Name other steps with report --compute/--overhead or the config's overhead_rule.";
  }
  return out + "\n";
}

}  // namespace

OverheadRule default_overhead_rule() {
  OverheadRule rule;
  for (std::string_view s : proto::kDefaultComputeSteps) rule.compute.emplace_back(s);
  for (std::string_view s : proto::kDefaultOverheadSteps) rule.overhead.emplace_back(s);
  return rule;
}

ChosenRule rule_for(const OverheadRules& rules, const std::optional<OverheadRule>& forced,
                    const std::optional<JobRef>& job) {
  if (forced) return {&*forced, RuleSource::kFlags};
  if (job && !job->job.empty()) {
    if (auto it = rules.by_uid_job.find(*job); it != rules.by_uid_job.end()) {
      return {&it->second, RuleSource::kJob};
    }
    if (auto it = rules.by_job_id.find(job->job); it != rules.by_job_id.end()) {
      return {&it->second, RuleSource::kJob};
    }
  }
  return {&rules.defaults, RuleSource::kDefault};
}

std::optional<JobRef> table_rule_job(std::span<const ProcessFigures> processes, bool by_pid,
                                     const std::optional<JobRef>& filter_job) {
  if (filter_job) return filter_job;
  if (processes.empty() || (processes.size() > 1 && !by_pid)) return std::nullopt;
  // A pid's processes: at most one is live (the others exited before it was reused).
  const auto newest = std::max_element(
      processes.begin(), processes.end(), [](const ProcessFigures& a, const ProcessFigures& b) {
        return std::pair(a.alive, a.key.start_time) < std::pair(b.alive, b.key.start_time);
      });
  return JobRef{newest->uid, newest->job};
}

RuleFigures evaluate(const OverheadRule& rule, const std::vector<StepFigures>& totals) {
  RuleFigures f;
  f.compute_ns = sum_of(rule.compute, totals);
  f.overhead_ns = sum_of(rule.overhead, totals);
  if (f.compute_ns > 0) {
    // compute > 0, so the sum is too: never 0/0.
    f.overhead_pct = static_cast<double>(f.overhead_ns) /
                     static_cast<double>(saturating_add(f.compute_ns, f.overhead_ns)) * 100.0;
  }
  return f;
}

std::string rule_text(const ChosenRule& chosen, const RuleFigures& figures) {
  const OverheadRule& rule = *chosen.rule;
  std::string out = "\n[Dr. Popper Analysis]\n";
  // The reference's steps need no introduction; any others are named, and whence.
  if (rule != default_overhead_rule()) {
    out += "Rule (" +
           std::string(chosen.source == RuleSource::kFlags ? "--compute/--overhead"
                       : chosen.source == RuleSource::kJob ? "the job's config"
                                                           : "config") +
           "): compute " + joined(rule.compute, " + ") + ", overhead " +
           joined(rule.overhead, " + ") + "\n";
  }
  if (!figures.overhead_pct) return out + no_compute_line(rule);
  char pct[32];
  std::snprintf(pct, sizeof pct, "%.2f", *figures.overhead_pct);
  out += "CUDA Compute:   " + format_duration(figures.compute_ns) + "\n";
  out += "CPU Overhead:   " + format_duration(figures.overhead_ns) + " (" + pct + "%)\n";
  if (falsified(figures)) {
    out += "\n🔴 FALSIFICATION: Overhead > 50%. Kernel fusion required.\n";
  } else {
    out += "\n🟢 CORROBORATED: Compute dominates. Current approach viable.\n";
  }
  return out;
}

nlohmann::json rule_json(const ChosenRule& chosen, const RuleFigures& figures) {
  const char* verdict = !figures.overhead_pct ? "no_compute"
                        : falsified(figures)  ? "falsified"
                                              : "corroborated";
  return {{"compute_steps", chosen.rule->compute},
          {"overhead_steps", chosen.rule->overhead},
          {"source", source_name(chosen.source)},
          {"compute_ns", figures.compute_ns},
          {"overhead_ns", figures.overhead_ns},
          {"overhead_pct",
           figures.overhead_pct ? nlohmann::json(*figures.overhead_pct) : nlohmann::json(nullptr)},
          {"verdict", verdict}};
}

}  // namespace steptrace::daemon::report
