// The 50% rule ("Dr. Popper"): a report's compute steps set against its CPU-overhead
// steps; more than half of their sum in overhead falsifies the approach. The reference
// asks it of Matmul against Transpose + Alloc; a trainer with other steps (a PyTorch
// model's Forward, Backward, DataLoader) names its own, per job in the daemon's config
// ("overhead_rule", config/README.md) or per report (`report --compute A,B --overhead
// C`; proto/rule_steps.h has the lists' grammar).
//
// Data flow: Config (serve/config.h) holds an OverheadRules -> each report's RenderJob
// copies it into ReportOptions with the flags' rule, if any -> the text and JSON
// renderers pick the rule of each section (rule_for) and evaluate() it over the
// section's step totals -> rule_text() / rule_json(). No NaN: without compute there is
// no ratio, and the text says so in one line that names the steps.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "daemon/state/read_model.h"

namespace steptrace::daemon::report {

struct OverheadRule {
  std::vector<std::string> compute;
  std::vector<std::string> overhead;
  bool operator==(const OverheadRule&) const = default;
};

// Matmul against Transpose + Alloc.
OverheadRule default_overhead_rule();

// The config's rules: the default, and per job. A job is (uid, job id): the key "UID:ID"
// is that uid's job, "ID" a job with that id of any uid; "UID:ID" wins.
struct OverheadRules {
  OverheadRule defaults = default_overhead_rule();
  std::map<JobRef, OverheadRule> by_uid_job;      // "UID:ID"
  std::map<std::string, OverheadRule> by_job_id;  // "ID"
};

// Where a section's rule came from (the JSON's "source").
enum class RuleSource : std::uint8_t { kDefault, kJob, kFlags };

struct ChosenRule {
  const OverheadRule* rule;
  RuleSource source;
};

// The rule of a section: `forced` (the report's flags) when set, else the job's (`job`
// nullopt or an empty id: the default).
ChosenRule rule_for(const OverheadRules& rules, const std::optional<OverheadRule>& forced,
                    const std::optional<JobRef>& job);

// The job whose rule a report's whole table uses (`job` in rule_for; config/README.md
// "The 50% rule"): a `--job` report's job (`filter_job`); else a table of one process,
// its job; else a `--pid` report (`by_pid`) whose pid was reused by several processes,
// the live one's job, or when none is live the job of the one that started last (all
// one job: that job); else none (the table of all processes: the default).
std::optional<JobRef> table_rule_job(std::span<const ProcessFigures> processes, bool by_pid,
                                     const std::optional<JobRef>& filter_job);

struct RuleFigures {
  std::uint64_t compute_ns = 0;
  std::uint64_t overhead_ns = 0;
  // overhead / (compute + overhead) * 100; nullopt without compute.
  std::optional<double> overhead_pct;
};

// Sums each list's steps over `totals` (merged by name, a name counted once).
RuleFigures evaluate(const OverheadRule& rule, const std::vector<StepFigures>& totals);

// "[Dr. Popper Analysis]" and what follows, for the text report.
std::string rule_text(const ChosenRule& chosen, const RuleFigures& figures);
// {"compute_steps", "overhead_steps", "source", "compute_ns", "overhead_ns",
//  "overhead_pct" (null without compute), "verdict"} (PROTOCOL.md 10.4).
nlohmann::json rule_json(const ChosenRule& chosen, const RuleFigures& figures);

}  // namespace steptrace::daemon::report
