#include "daemon/serve/commands.h"
#include "daemon/report/report.h"

#include <steptrace/version.h>
#include <algorithm>
#include <charconv>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <variant>

#include "daemon/report/ledger_report.h"
#include "daemon/report/trace_export.h"
#include "daemon/serve/render_worker.h"
#include "daemon/serve/trace_selection.h"
#include "proto/codec.h"
#include "proto/commands.h"
#include "proto/printable.h"
#include "proto/rule_steps.h"
#include "proto/text_safety.h"

namespace steptrace::daemon {

// The trace replies alive, in all and per uid. Each one holds its capture's chunks
// (memory beyond the recorder's budget once they are evicted), so at most kMax exist at
// once, kMaxPerUid of one uid (so one tenant reading slowly cannot hold them all); a
// client that does not read is closed after timeouts.frame_s, which ends its reply.
// One per CommandTable; a reply may end on the render thread, hence the lock.
class TraceSlots {
 public:
  static constexpr int kMax = 8;
  static constexpr int kMaxPerUid = 2;
  // Why a new reply for `uid` may not start now, if it may not.
  std::optional<std::string> busy(std::uint32_t uid) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (count_ >= kMax) {
      return "error: busy: " + std::to_string(kMax) +
             " traces are being sent; retry when one is done\n";
    }
    const auto it = by_uid_.find(uid);
    if (it != by_uid_.end() && it->second >= kMaxPerUid) {
      return "error: busy: uid " + std::to_string(uid) + " has " + std::to_string(kMaxPerUid) +
             " traces being sent; read them, or retry when one is done\n";
    }
    return std::nullopt;
  }
  void take(std::uint32_t uid) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++by_uid_[uid];
    ++count_;
  }
  void give_back(std::uint32_t uid) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (--by_uid_[uid] == 0) by_uid_.erase(uid);
    --count_;
  }

  // `trace --for` replies waiting, per uid: each holds a connection for up to an hour, so
  // a uid may have `max` (limits.max_pending_traces_per_uid) at once. Why a new one may
  // not wait now, if it may not.
  std::optional<std::string> pending_busy(std::uint32_t uid, std::size_t max) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    const auto it = pending_by_uid_.find(uid);
    const std::size_t waiting = it == pending_by_uid_.end() ? 0 : it->second;
    if (waiting < max) return std::nullopt;
    return "error: busy: uid " + std::to_string(uid) + " has " + std::to_string(waiting) +
           " trace --for replies waiting (limits.max_pending_traces_per_uid=" +
           std::to_string(max) + "); close one, or retry when one is done\n";
  }
  void take_pending(std::uint32_t uid) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++pending_by_uid_[uid];
  }
  void give_back_pending(std::uint32_t uid) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (--pending_by_uid_[uid] == 0) pending_by_uid_.erase(uid);
  }

 private:
  mutable std::mutex mutex_;
  int count_ = 0;
  std::map<std::uint32_t, int> by_uid_;
  std::map<std::uint32_t, std::size_t> pending_by_uid_;
};

namespace {

using nlohmann::json;
using proto::parse_pid;
using proto::parse_seconds;
using syntax::Option;
using syntax::Problem;
using syntax::Syntax;

// Who may run a command: the table checks it once the words parsed, before the handler.
enum class Permission {
  kAnyone,
  kRootOrDaemonUid,  // may_reset(): commands that change state
};

// What a handler has besides its request.
struct Call {
  const CommandContext& context;
  const CommandTable& table;                       // version, help
  const std::shared_ptr<TraceSlots>& trace_slots;  // trace
};

// A command, declared once: its name, the words it takes (what the parser accepts and
// what its usage says), its line in `help`, who may run it and its handler.
template <typename Request>
struct Command {
  std::string_view name{};
  Syntax<Request> syntax{};
  std::string_view summary{};
  Permission permission = Permission::kAnyone;
  Reply (*run)(const Request&, const Call&) = nullptr;
};

template <typename Request>
Parsed<Request> parse_as(const Command<Request>& command, Args args) {
  return syntax::Parser<Request>(command.syntax, command.name).parse(args);
}

std::string json_line(const json& doc) {
  // Replace (not throw on) invalid UTF-8, e.g. from a process's comm; then the JSON
  // sanitiser: bidi controls and the like as \uXXXX, never raw (proto/text_safety.h).
  return proto::escape_unsafe_in_json(doc.dump(-1, ' ', false, json::error_handler_t::replace)) +
         "\n";
}

std::string text_reply(std::string text) {
  if (text.empty() || text.back() != '\n') text += '\n';
  return text;
}

std::vector<std::string_view> split_words(std::string_view line) {
  std::vector<std::string_view> words;
  std::size_t i = 0;
  while (i < line.size()) {
    while (i < line.size() && (line[i] == ' ' || line[i] == '\t' || line[i] == '\r')) ++i;
    const std::size_t start = i;
    while (i < line.size() && line[i] != ' ' && line[i] != '\t' && line[i] != '\r') ++i;
    if (i > start) words.push_back(line.substr(start, i - start));
  }
  return words;
}

// ---- options several commands take (their bounds are proto/commands.h's, the CLI's too)

// "1..2147483647"
std::string pid_range() {
  return std::to_string(proto::kMinPid) + ".." + std::to_string(proto::kMaxPid);
}

template <typename Request>
Option<Request> flag(std::string_view name, bool Request::*field) {
  return {name, "", [field](Request& r, std::optional<std::string_view>) -> Problem {
            r.*field = true;
            return std::nullopt;
          }};
}

// `--pid N` of report and reset (trace's may be repeated: take_trace_pid()). A bad value
// is echoed printable and cut, as every echoed word (PROTOCOL.md 10.2).
template <typename Request>
Option<Request> pid_option(std::optional<std::int32_t> Request::*field) {
  return {"--pid", "N", [field](Request& r, std::optional<std::string_view> value) -> Problem {
            if (!value) return "--pid needs a process id";
            const auto pid = parse_pid(*value);
            if (!pid) {
              return "--pid needs a process id in " + pid_range() + ", got '" +
                     proto::printable(*value, 64) + "'";
            }
            r.*field = pid;
            return std::nullopt;
          }};
}

// ---- ping -------------------------------------------------------------------------

Reply run_ping(const PingRequest&, const Call&) { return std::string("pong\n"); }

const Command<PingRequest>& ping_command() {
  static const Command<PingRequest> kCommand{
      .name = "ping", .summary = "answers pong", .run = run_ping};
  return kCommand;
}

// ---- report [--json] [--pid N] [--job [UID:]ID] [--window N] [--compute/--overhead S,...]

// `ID` or `UID:ID` (proto::parse_job_option: the grammar the CLI checks too), into a
// request's job and job_uid.
template <class Request>
Problem take_job_into(Request& r, std::optional<std::string_view> value) {
  const auto job = value ? proto::parse_job_option(*value) : std::nullopt;
  if (!job) {
    return "--job needs a job id of 1.." + std::to_string(proto::kMaxNameLength) +
           " printable characters, or UID:ID for another uid's" +
           (value && !value->empty() ? ", got '" + proto::printable(*value, 64) + "'"
                                     : std::string());
  }
  r.job = std::string(job->id);
  r.job_uid = job->uid;
  return std::nullopt;
}

// `--window N`: seconds, 1..kMaxWindowS (a day; the rank windows keep less, and say
// what they cover).
constexpr std::uint64_t kMaxWindowS = 86'400;
Problem take_window(ReportRequest& r, std::optional<std::string_view> value) {
  std::uint64_t s = 0;
  const std::string_view text = value.value_or("");
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), s);
  if (text.empty() || ec != std::errc() || ptr != text.data() + text.size() || s == 0 ||
      s > kMaxWindowS) {
    return "--window needs seconds in 1.." + std::to_string(kMaxWindowS) +
           (value ? ", got '" + proto::printable(*value, 64) + "'" : std::string());
  }
  r.window_s = s;
  return std::nullopt;
}

// `--compute STEP,...` / `--overhead STEP,...` (proto/rule_steps.h's grammar, the CLI's).
template <std::optional<std::vector<std::string>> ReportRequest::*kField>
Problem take_rule_steps(ReportRequest& r, std::optional<std::string_view> value) {
  const std::string name = kField == &ReportRequest::compute ? "--compute" : "--overhead";
  if (!value) return name + " needs STEP,STEP,... (step names)";
  auto steps = proto::parse_rule_steps(*value);
  if (auto* why = std::get_if<std::string>(&steps)) {
    return name + " " + *why + ", got '" + proto::printable(*value, 64) + "'";
  }
  r.*kField = std::move(std::get<std::vector<std::string>>(steps));
  return std::nullopt;
}

// The rule the flags ask for (a list not given is the config's default), or nullopt
// without them; the error reply when a step is in both lists.
std::variant<std::optional<report::OverheadRule>, std::string> flags_rule(
    const ReportRequest& r, const report::OverheadRules& rules) {
  if (!r.compute && !r.overhead) return std::nullopt;
  report::OverheadRule rule = rules.defaults;
  if (r.compute) rule.compute = *r.compute;
  if (r.overhead) rule.overhead = *r.overhead;
  if (auto both = proto::rule_steps_overlap(rule.compute, rule.overhead)) {
    return "error: report: step " + *both + " is in both " +
           (r.compute ? "--compute" : "the default compute steps") + " and " +
           (r.overhead ? "--overhead" : "the default overhead steps") +
           (r.compute && r.overhead ? "" : " (name the other list too)") + "\n";
  }
  return rule;
}

// "1001" or "1001, 1002 and 1003".
std::string uid_list(const std::vector<std::uint32_t>& uids) {
  std::string out;
  for (std::size_t i = 0; i < uids.size(); ++i) {
    if (i > 0) out += i + 1 == uids.size() ? " and " : ", ";
    out += std::to_string(uids[i]);
  }
  return out;
}

// "; uid 1002 has one: use --job 1002:x" for the uids (but `asked`) that run job `id`.
std::string job_hint(const std::vector<std::uint32_t>& runners, std::uint32_t asked,
                     const std::string& id) {
  std::vector<std::uint32_t> others;
  for (const std::uint32_t uid : runners) {
    if (uid != asked) others.push_back(uid);
  }
  if (others.empty()) return "";
  if (others.size() == 1) {
    const std::string uid = std::to_string(others[0]);
    return "; uid " + uid + " has one: use --job " + uid + ":" + id;
  }
  return "; uids " + uid_list(others) + " have one: use --job UID:" + id;
}

// The job `--job` names, or the error reply (PROTOCOL.md 10.3): UID:ID is that uid's
// job; ID the asking uid's. Root and the daemon's own uid, who run no trainers as a
// rule, also reach another uid's job by its bare ID as before jobs had uids, when
// exactly one uid runs one by that id; more than one is an error naming them.
std::variant<JobRef, std::string> resolve_job(const CollectorView& v, const ReportRequest& r,
                                              std::uint32_t caller, bool privileged) {
  const std::string& id = *r.job;
  const std::uint32_t uid = r.job_uid.value_or(caller);
  const std::vector<std::uint32_t> runners = v.uids_with_job(id);
  const auto runs = [&](std::uint32_t u) {
    return std::find(runners.begin(), runners.end(), u) != runners.end();
  };
  if (runs(uid)) return JobRef{uid, id};
  const std::string shown = proto::printable(id);
  if (!r.job_uid && privileged) {
    if (runners.size() == 1) return JobRef{runners[0], id};
    if (runners.empty()) return "error: report: no job '" + shown + "' for any uid\n";
    return "error: report: job '" + shown + "' is run by uids " + uid_list(runners) +
           ": name one with --job UID:" + shown + "\n";
  }
  return "error: report: no job '" + shown + "' for uid " + std::to_string(uid) +
         job_hint(runners, uid, shown) + "\n";
}

Reply run_report(const ReportRequest& r, const Call& call) {
  const std::uint32_t caller = call.context.peer_uid;
  const bool privileged = may_reset(caller, call.context.daemon_euid);
  report::ReportOptions options{r.window_s};
  if (call.context.overhead_rules != nullptr) options.rules = *call.context.overhead_rules;
  auto forced = flags_rule(r, options.rules);
  if (auto* error = std::get_if<std::string>(&forced)) return std::move(*error);
  options.rule = std::move(std::get<std::optional<report::OverheadRule>>(forced));
  return RenderJob(
      [r, caller, privileged, options = std::move(options)](const CollectorView& v) -> std::string {
        report::ReportFilter filter{r.pid, std::nullopt};
        if (r.job) {
          auto job = resolve_job(v, r, caller, privileged);
          if (auto* error = std::get_if<std::string>(&job)) return std::move(*error);
          filter.job = std::move(std::get<JobRef>(job));
        }
        return r.json ? report::report_json_text(v, filter, options)
                      : text_reply(report::report_text(v, filter, options));
      });
}

const Command<ReportRequest>& report_command() {
  static const Command<ReportRequest> kCommand{
      .name = "report",
      .syntax = {.groups = {{flag("--json", &ReportRequest::json)},
                            {pid_option(&ReportRequest::pid)},
                            {{"--job", "[UID:]ID", take_job_into<ReportRequest>}},
                            {{"--window", "N", take_window}},
                            {{"--compute", "STEP,...", take_rule_steps<&ReportRequest::compute>}},
                            {{"--overhead", "STEP,...",
                              take_rule_steps<&ReportRequest::overhead>}}}},
      .summary =
          "per-step timing for all processes (or one pid, or one job's: yours, or UID's), "
          "by job with rank skew (over the last N s too with --window), then the VRAM ledger; "
          "--compute/--overhead: the 50% rule's steps",
      .run = run_report,
  };
  return kCommand;
}

// ---- ledger [--json] | ledger cleanup GPU ID -----------------------------------------

Problem take_cleanup_gpu(LedgerRequest& r, std::string_view gpu) {
  if (gpu.size() > proto::kMaxNameLength || !proto::all_printable(gpu)) {
    return "a GPU UUID is 1.." + std::to_string(proto::kMaxNameLength) + " printable characters";
  }
  if (!r.cleanup) r.cleanup = LedgerRequest::Cleanup{};
  r.cleanup->gpu = std::string(gpu);
  return std::nullopt;
}

Problem take_cleanup_id(LedgerRequest& r, std::string_view text) {
  std::uint64_t id = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), id);
  if (ec != std::errc{} || ptr != text.data() + text.size()) {
    return "the reservation id must be an integer in 0..18446744073709551615, got '" +
           proto::printable(text, 64) + "'";
  }
  if (!r.cleanup) r.cleanup = LedgerRequest::Cleanup{};
  r.cleanup->id = id;
  return std::nullopt;
}

Reply run_ledger(const LedgerRequest& r, const Call& call) {
  if (r.cleanup) {
    static const PeerIdentity kNobody{{0, 0}, kNobodyUid, kNobodyGid, ""};
    const PeerIdentity& sender = call.context.peer ? *call.context.peer : kNobody;
    return report::cleanup_reply(
        call.context.collector.operator_cleanup(sender, r.cleanup->gpu, r.cleanup->id),
        r.cleanup->gpu, r.cleanup->id, sender.key.pid);
  }
  return RenderJob([r](const CollectorView& v) {
    return r.json ? json_line(report::ledger_json(v)) : text_reply(report::ledger_text(v));
  });
}

const Command<LedgerRequest>& ledger_command() {
  static const Command<LedgerRequest> kCommand{
      .name = "ledger",
      .syntax = {.groups = {{flag("--json", &LedgerRequest::json)}},
                 .forms = {{.word = "cleanup",
                            .words = {{"GPU", take_cleanup_gpu}, {"ID", take_cleanup_id}},
                            .wrong_count = "needs a GPU UUID and a reservation id"}}},
      .summary =
          "the VRAM ledger view per GPU; cleanup: remove a reservation (root, the "
          "holder's uid, or anyone once it is LEAKED or EXPIRED)",
      .run = run_ledger,
  };
  return kCommand;
}

// ---- stats [--json] ------------------------------------------------------------------

Reply run_stats(const StatsRequest& r, const Call&) {
  return RenderJob(
      [r](const CollectorView& v) {
        return r.json ? json_line(report::stats_json(v)) : text_reply(report::stats_text(v));
      },
      RenderLane::kFast);
}

const Command<StatsRequest>& stats_command() {
  static const Command<StatsRequest> kCommand{
      .name = "stats",
      .syntax = {.groups = {{flag("--json", &StatsRequest::json)}}},
      .summary = "the daemon's own counters",
      .run = run_stats,
  };
  return kCommand;
}

// ---- metrics -------------------------------------------------------------------------

Reply run_metrics(const MetricsRequest&, const Call&) {
  return RenderJob([](const CollectorView& v) { return text_reply(report::metrics_text(v)); },
                   RenderLane::kFast);
}

const Command<MetricsRequest>& metrics_command() {
  static const Command<MetricsRequest> kCommand{
      .name = "metrics",
      .summary = "Prometheus text exposition (format 0.0.4)",
      .run = run_metrics,
  };
  return kCommand;
}

// ---- reset [--pid N | --ledger | --gpu UUID] -----------------------------------------

Problem take_gpu(ResetRequest& r, std::optional<std::string_view> value) {
  if (!value) return "--gpu needs a GPU UUID";
  if (value->empty() || value->size() > proto::kMaxNameLength) {
    return "--gpu needs a GPU UUID of 1.." + std::to_string(proto::kMaxNameLength) + " characters";
  }
  r.gpu = std::string(*value);
  return std::nullopt;
}

Reply run_reset(const ResetRequest& r, const Call& call) {
  Collector& collector = call.context.collector;
  if (r.ledger || r.gpu) {
    const std::size_t n =
        collector.reset_ledger(r.gpu ? std::optional<std::string_view>(*r.gpu) : std::nullopt);
    if (r.gpu && n == 0) return "error: no GPU '" + proto::printable(*r.gpu) + "' in the ledger\n";
    return "ok: " + std::to_string(n) + (n == 1 ? " GPU" : " GPUs") + " cleared from the ledger\n";
  }
  if (collector.reset(r.pid) == 0 && r.pid) {
    return "error: no process with pid " + std::to_string(*r.pid) + "\n";
  }
  return std::string("ok\n");
}

const Command<ResetRequest>& reset_command() {
  static const Command<ResetRequest> kCommand{
      .name = "reset",
      .syntax = {.groups = {{pid_option(&ResetRequest::pid),
                             flag("--ledger", &ResetRequest::ledger),
                             {"--gpu", "UUID", take_gpu}}}},
      .summary =
          "clear the aggregates (all, or one pid's), or the VRAM ledger (all GPUs, or "
          "one); root or the daemon's uid only",
      .permission = Permission::kRootOrDaemonUid,
      .run = run_reset,
  };
  return kCommand;
}

// ---- trace [--pid N]... [--children] [--job [UID:]ID] [--last S | --for S] ------------

Problem take_trace_pid(TraceRequest& r, std::optional<std::string_view> value) {
  if (!value) return "--pid needs a process id";
  const auto pid = parse_pid(*value);
  if (!pid) {
    return "--pid needs a process id in " + pid_range() + ", got '" + proto::printable(*value, 64) +
           "'";
  }
  if (r.pids.size() >= proto::kMaxTracePids && !r.pids.contains(*pid)) {
    return "at most " + std::to_string(proto::kMaxTracePids) + " --pid options";
  }
  r.pids.insert(*pid);
  return std::nullopt;
}

Option<TraceRequest> seconds_option(std::string_view name, double max,
                                    std::optional<double> TraceRequest::*field) {
  return {name, "SECONDS",
          [name, max, field](TraceRequest& r, std::optional<std::string_view> value) -> Problem {
            const auto seconds = value ? parse_seconds(*value, max) : std::nullopt;
            if (!seconds) {
              return std::string(name) + " needs a number of seconds in (0, " +
                     std::to_string(static_cast<int>(max)) + "]" +
                     (value ? ", got '" + proto::printable(*value, 64) + "'" : std::string());
            }
            r.*field = seconds;
            return std::nullopt;
          }};
}

// The capture a trace renders, or the refusal (its error reply) instead of a document.
using TraceChoice = std::variant<std::shared_ptr<const TraceCapture>, TraceRefusal>;

// Renders a capture as the trace document, a piece per next(), holding a TraceSlots slot.
// `choose` (--children, --job) picks the capture's processes at the first next(): on the
// render thread, with the uid's slot held, since --children reads /proc. An error it gives
// is the whole reply, as when the io thread answered it (PROTOCOL.md 10.5); one past a
// bound is counted in limits_hit when the reply is handed over, back on the io thread.
class TraceReply final : public ReplyStream {
 public:
  TraceReply(std::function<TraceChoice()> choose, Collector& collector,
             std::shared_ptr<TraceSlots> slots, std::uint32_t uid)
      : choose_(std::move(choose)), collector_(collector), slots_(std::move(slots)), uid_(uid) {
    slots_->take(uid_);
  }
  ~TraceReply() override { slots_->give_back(uid_); }  // on the io or the render thread
  TraceReply(const TraceReply&) = delete;
  TraceReply& operator=(const TraceReply&) = delete;
  bool next(std::string& out) override {
    if (choose_) {
      TraceChoice choice = choose_();
      choose_ = nullptr;
      if (auto* refusal = std::get_if<TraceRefusal>(&choice)) {
        out += refusal->reply;
        refused_ = refusal->limit;  // read by finished(), after the piece's post to the io thread
        return false;
      }
      export_.emplace(std::get<std::shared_ptr<const TraceCapture>>(std::move(choice)));
    }
    return export_ && export_->next(out);
  }
  void finished() override {
    if (refused_) collector_.count_limit(*refused_);
  }

 private:
  std::function<TraceChoice()> choose_;
  std::optional<TraceExport> export_;
  Collector& collector_;
  std::optional<LimitKind> refused_;
  std::shared_ptr<TraceSlots> slots_;
  std::uint32_t uid_;
};

// Holds a `trace --for` capture open: recording goes on (with the capture budget when
// the standing window is off) until the reply is made or the connection goes. It also
// holds one of its uid's pending slots (TraceSlots::pending_busy) that long.
class CaptureHold {
 public:
  CaptureHold(Collector& collector, std::shared_ptr<TraceSlots> slots, std::uint32_t uid)
      : collector_(collector), slots_(std::move(slots)), uid_(uid) {
    collector_.recorder().begin_capture();
    slots_->take_pending(uid_);
  }
  ~CaptureHold() {
    slots_->give_back_pending(uid_);
    collector_.recorder().end_capture();
  }
  CaptureHold(const CaptureHold&) = delete;
  CaptureHold& operator=(const CaptureHold&) = delete;

 private:
  Collector& collector_;
  std::shared_ptr<TraceSlots> slots_;
  std::uint32_t uid_;
};

const Command<TraceRequest>& trace_command();

std::uint64_t seconds_ns(double s) { return static_cast<std::uint64_t>(s * 1e9); }

// The processes `r` takes from `all`, every window the recorder holds, or the error reply.
// --children and --job choose by ProcessKey, so a reused pid brings no earlier process
// along, and by (uid, job) with no bound on the number of processes (trace_selection.h);
// they answer an error rather than an empty trace when they take no process. On the render
// thread: --children reads /proc (bounded, the descendants' files only).
TraceChoice choose_processes(const TraceCapture& all, const TraceRequest& r, std::uint32_t caller,
                             bool privileged, const std::string& proc_root,
                             DescendantBounds bounds) {
  TraceSelection selection;
  std::vector<std::int32_t> roots;
  for (const std::int32_t pid : r.pids) {
    // With --children a live --pid is taken by its ProcessKey too: an earlier process
    // that had its pid is no more its family than its descendants' namesakes are.
    const auto self = r.children ? live_process(pid, proc_root) : std::nullopt;
    if (self) {
      selection.keys.insert(*self);
      roots.push_back(pid);
    } else {
      selection.pids.insert(pid);  // as --pid alone: every window of that pid
    }
  }
  if (!roots.empty()) {
    auto found = live_descendants(roots, proc_root, bounds);
    if (auto* refusal = std::get_if<TraceRefusal>(&found)) return std::move(*refusal);
    const auto& keys = std::get<std::vector<ProcessKey>>(found);
    selection.keys.insert(keys.begin(), keys.end());
  }
  if (r.job) {
    auto uid = trace_job_uid(all, *r.job, r.job_uid, caller, privileged);
    if (auto* error = std::get_if<std::string>(&uid)) return TraceRefusal{std::move(*error), {}};
    selection.job = JobRef{std::get<std::uint32_t>(uid), *r.job};
  }
  auto capture = select_processes(all, selection);
  if (r.children && capture->processes.empty()) {
    std::string pids;
    for (const std::int32_t pid : r.pids) pids += (pids.empty() ? "" : ", ") + std::to_string(pid);
    return TraceRefusal{"error: trace: no process with pid " + pids +
                            " nor any live process it forked is in the flight recorder's window\n",
                        {}};
  }
  return capture;
}

// Who asks for a trace, and where its --children looks (a copy: `trace --for` makes its
// reply after the command's context is gone).
struct TraceAsker {
  std::uint32_t uid = 0;
  bool privileged = false;
  std::string proc_root;
  DescendantBounds bounds;
};

// The reply to `r` from the recorder's window since `since`: --pid alone is the recorder's
// own filter; --children and --job capture every window here, on the io thread (the
// collector's), and choose from it on the render thread (choose_processes()).
Reply trace_reply(Collector& collector, const TraceRequest& r, std::uint64_t since,
                  const std::shared_ptr<TraceSlots>& slots, const TraceAsker& asker) {
  std::function<TraceChoice()> choose;
  if (!r.children && !r.job) {
    choose = [capture = collector.capture_trace(r.pids, since)]() -> TraceChoice {
      return capture;
    };
  } else {
    choose = [all = collector.capture_trace({}, since), r, asker]() -> TraceChoice {
      return choose_processes(*all, r, asker.uid, asker.privileged, asker.proc_root, asker.bounds);
    };
  }
  return std::shared_ptr<ReplyStream>(
      std::make_shared<TraceReply>(std::move(choose), collector, slots, asker.uid));
}

Reply run_trace(const TraceRequest& r, const Call& call) {
  Collector& collector = call.context.collector;
  const std::shared_ptr<TraceSlots>& slots = call.trace_slots;
  const std::uint32_t uid = call.context.peer_uid;
  const TraceAsker asker{uid, may_reset(uid, call.context.daemon_euid), call.context.proc_root,
                         call.context.descendant_bounds};
  const std::uint64_t now = collector.now_ns();
  if (r.children && r.pids.empty()) {
    return std::string("error: trace: --children needs --pid N (whose forked processes to take)") +
           " (usage: " + usage_of(trace_command().syntax, "trace") + ")\n";
  }
  if (auto busy = slots->busy(uid)) return *busy;
  if (!r.for_s) {
    const std::uint64_t since =
        r.last_s && seconds_ns(*r.last_s) < now ? now - seconds_ns(*r.last_s) : 0;
    return trace_reply(collector, r, since, slots, asker);
  }
  if (auto busy = slots->pending_busy(uid, call.context.max_pending_traces_per_uid)) {
    collector.count_limit(LimitKind::kMaxPendingTracesPerUid);
    return *busy;
  }
  auto hold = std::make_shared<CaptureHold>(collector, slots, uid);
  DeferredReply deferred;
  deferred.delay = std::chrono::milliseconds(static_cast<std::int64_t>(*r.for_s * 1000));
  deferred.make = [&collector, r, since = now, hold, slots, asker]() mutable -> Reply {
    if (auto busy = slots->busy(asker.uid)) return *busy;
    Reply reply = trace_reply(collector, r, since, slots, asker);
    hold.reset();  // the capture holds its chunks; recording may stop now
    return reply;
  };
  return deferred;
}

const Command<TraceRequest>& trace_command() {
  static const Command<TraceRequest> kCommand{
      .name = "trace",
      .syntax =
          {.groups = {{{"--pid", "N", take_trace_pid, /*repeatable=*/true}},
                      {flag("--children", &TraceRequest::children)},
                      {{"--job", "[UID:]ID", take_job_into<TraceRequest>}},
                      {seconds_option("--last", proto::kMaxTraceLastSeconds, &TraceRequest::last_s),
                       seconds_option("--for", proto::kMaxTraceForSeconds, &TraceRequest::for_s)}},
           .usage_in_every_error = true},
      .summary =
          "the flight recorder's recent events as a Chrome Trace Event document "
          "(Perfetto UI, speedscope): all processes, --pid's (and their live forked "
          "processes with --children), or a job's; --for records from now on",
      .run = run_trace,
  };
  return kCommand;
}

// ---- version, help -------------------------------------------------------------------

Reply run_version(const VersionRequest&, const Call& call) {
  return VersionResponse{STEPTRACE_VERSION_STRING, proto::kProtocolVersion, call.table.names()}
      .to_json_line();
}

const Command<VersionRequest>& version_command() {
  static const Command<VersionRequest> kCommand{
      .name = "version",
      .summary = "daemon version, protocol version and commands, as one JSON line",
      .run = run_version,
  };
  return kCommand;
}

Reply run_help(const HelpRequest&, const Call& call) { return call.table.help_text(); }

const Command<HelpRequest>& help_command() {
  static const Command<HelpRequest> kCommand{
      .name = "help", .summary = "this list", .run = run_help};
  return kCommand;
}

}  // namespace

Parsed<PingRequest> PingRequest::parse(Args args) { return parse_as(ping_command(), args); }
Parsed<ReportRequest> ReportRequest::parse(Args args) { return parse_as(report_command(), args); }
Parsed<LedgerRequest> LedgerRequest::parse(Args args) { return parse_as(ledger_command(), args); }
Parsed<StatsRequest> StatsRequest::parse(Args args) { return parse_as(stats_command(), args); }
Parsed<MetricsRequest> MetricsRequest::parse(Args args) {
  return parse_as(metrics_command(), args);
}
Parsed<ResetRequest> ResetRequest::parse(Args args) { return parse_as(reset_command(), args); }
Parsed<TraceRequest> TraceRequest::parse(Args args) { return parse_as(trace_command(), args); }
Parsed<VersionRequest> VersionRequest::parse(Args args) {
  return parse_as(version_command(), args);
}
Parsed<HelpRequest> HelpRequest::parse(Args args) { return parse_as(help_command(), args); }

std::string VersionResponse::to_json_line() const {
  return json_line(json{{"version", version}, {"protocol", protocol}, {"commands", commands}});
}

bool may_reset(std::uint32_t peer_uid, std::uint32_t daemon_euid) {
  return peer_uid == 0 || peer_uid == daemon_euid;
}

template <typename Spec>
void CommandTable::add(const Spec& command) {
  // `command` is a function's static: it outlives the table.
  Handler handler = [this, &command](Args args, const CommandContext& context) -> Reply {
    auto parsed = parse_as(command, args);
    if (auto* err = std::get_if<CommandError>(&parsed)) return "error: " + err->message + "\n";
    if (command.permission == Permission::kRootOrDaemonUid &&
        !may_reset(context.peer_uid, context.daemon_euid)) {
      return std::string("error: permission denied\n");
    }
    return command.run(std::get<0>(parsed), Call{context, *this, trace_slots_});
  };
  entries_.emplace(std::string(command.name),
                   Entry{syntax::full_usage(command.syntax, command.name),
                         std::string(command.summary), std::move(handler)});
}

CommandTable::CommandTable() : trace_slots_(std::make_shared<TraceSlots>()) {
  add(ping_command());
  add(report_command());
  add(ledger_command());
  add(stats_command());
  add(metrics_command());
  add(reset_command());
  add(trace_command());
  add(version_command());
  add(help_command());
}

std::vector<std::string> CommandTable::names() const {
  std::vector<std::string> out;
  for (const auto& [name, entry] : entries_) out.push_back(name);
  return out;
}

std::string CommandTable::help_text() const {
  std::string out = "steptraced commands (one per line):\n";
  for (const auto& [name, entry] : entries_) {
    out += "  " + entry.usage;
    out.append(entry.usage.size() < 28 ? 28 - entry.usage.size() : 1, ' ');
    out += entry.summary + "\n";
  }
  return out;
}

std::string CommandTable::execute(std::string_view line, const CommandContext& context) const {
  Reply reply = dispatch(line, context);
  if (reply.deferred) reply = reply.deferred->make();  // no waiting here
  if (reply.stream) {
    std::string out;
    while (reply.stream->next(out)) {
    }
    reply.stream->finished();
    return out;
  }
  if (!reply.render) return std::move(reply.text);
  return run_render_job(reply.render, *context.collector.freeze());
}

Reply CommandTable::dispatch(std::string_view line, const CommandContext& context) const {
  const auto words = split_words(line);
  if (words.empty()) return "error: empty command (try help)\n";
  auto it = entries_.find(words.front());
  if (it == entries_.end()) {
    return "error: unknown command '" + proto::printable(words.front(), 64) + "' (try help)\n";
  }
  try {
    return it->second.handler(Args(words).subspan(1), context);
  } catch (const std::exception& e) {
    // A report bug must not take the connection (or the daemon) down.
    return std::string("error: internal error: ") + e.what() + "\n";
  }
}

}  // namespace steptrace::daemon
