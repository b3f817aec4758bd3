// The daemon's renderers: every report, stats and metrics text is a function of a frozen
// CollectorView (daemon/state/collector.h), so it runs on the render thread while ingest
// goes on (daemon/serve/render_worker.h), and reads nothing else.
//
// Data flow: a command's RenderJob (daemon/serve/commands.cpp), the HTTP scrape or a test
// calls Collector::freeze() -> one of these -> text or JSON. The ledger's own renderers
// are in ledger_report.h; the number, size and table formats they share in
// report_format.h. Schemas: proto/PROTOCOL.md section 10.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "daemon/report/overhead_rule.h"
#include "daemon/state/read_model.h"

namespace steptrace::daemon {

class CollectorView;

namespace report {

// `report --json`: each process object also carries "current" (per thread the innermost
// open span and how long it has been open, what the CLI's `top` shows), plus
// "unmatched_ends" and "abandoned" per step; "jobs" groups the processes by (uid, job
// id) with per-job totals. Schema: proto/PROTOCOL.md section 10.4.
// Which processes a report covers: all, one pid's, one job's (a uid's processes that sent
// one job id, never another uid's that sent the same), or both.
struct ReportFilter {
  std::optional<std::int32_t> pid;
  std::optional<JobRef> job;
};
// What else a report shows: rank skew over the last `window_s` seconds too (`report
// --window N`; the run's is always there), and its thresholds. The 50% rule of each
// section (overhead_rule.h): `rule` (`report --compute/--overhead`) for all when set;
// else a job's section and its processes' (and a `--job` or `--pid` report's) the
// job's in `rules`, the whole table's the default.
struct ReportOptions {
  std::optional<std::uint64_t> window_s;
  OverheadRules rules{};
  std::optional<OverheadRule> rule{};
};
nlohmann::json report_json(const CollectorView& view, const ReportFilter& filter,
                           const ReportOptions& options = {});
// The same document as the reply line a client gets (compact, invalid UTF-8 replaced,
// unsafe code points escaped as proto/text_safety.h says, then '\n'), written a piece at
// a time: a render never holds the whole document as JSON values (report_json.cpp).
std::string report_json_text(const CollectorView& view, const ReportFilter& filter,
                             const ReportOptions& options = {});
std::string report_text(const CollectorView& view, const ReportFilter& filter,
                        const ReportOptions& options = {});
// All processes or one pid's.
nlohmann::json report_json(const CollectorView& view, std::optional<std::int32_t> pid);
std::string report_text(const CollectorView& view, std::optional<std::int32_t> pid);
nlohmann::json ledger_json(const CollectorView& view);
std::string ledger_text(const CollectorView& view);
nlohmann::json stats_json(const CollectorView& view);
std::string stats_text(const CollectorView& view);
// Prometheus text exposition format 0.0.4.
std::string metrics_text(const CollectorView& view);
// steptrace_build_info and the daemon's process_* metrics (RSS, CPU, fds, start time),
// appended to `out` (metrics_text calls it).
void append_process_metrics(const CollectorView& view, std::string& out);

}  // namespace report
}  // namespace steptrace::daemon
