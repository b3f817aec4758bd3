#include "daemon/serve/commands.h"
#include "daemon/report/report.h"

#include <steptrace/version.h>
#include <algorithm>
#include <atomic>
#include <charconv>
#include <exception>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "daemon/report/ledger_report.h"
#include "daemon/report/trace_export.h"
#include "daemon/serve/render_worker.h"
#include "proto/codec.h"
#include "proto/commands.h"
#include "proto/printable.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using proto::parse_pid;
using proto::parse_seconds;

// The option bounds are proto/commands.h's, shared with the CLI (TraceRequest's are
// aliases of them).

// "--pid needs a process id in 1..2147483647"
std::string pid_range() {
  return std::to_string(proto::kMinPid) + ".." + std::to_string(proto::kMaxPid);
}

// What options a command accepts, and what the words said.
struct OptionSpec {
  bool json = false;
  bool pid = false;
  bool job = false;     // report: --job ID
  bool ledger = false;  // reset: --ledger, --gpu UUID
};
struct Options {
  bool json = false;
  std::optional<std::int32_t> pid;
  std::optional<std::string> job;
  bool ledger = false;
  std::optional<std::string> gpu;
};

std::string usage_of(std::string_view command, OptionSpec spec) {
  std::string usage(command);
  if (spec.json) usage += " [--json]";
  if (spec.ledger) return usage + " [--pid N | --ledger | --gpu UUID]";
  if (spec.pid) usage += " [--pid N]";
  if (spec.job) usage += " [--job ID]";
  return usage;
}

// The value of an option that takes one word ("--name V" or "--name=V"), advancing `i`
// past it; nullopt when the value is missing.
std::optional<std::string_view> option_value(std::string_view name, Args args, std::size_t& i) {
  const std::string_view word = args[i];
  if (word.size() > name.size()) return word.substr(name.size() + 1);  // "--name=V"
  if (i + 1 >= args.size()) return std::nullopt;
  return args[++i];
}

bool is_option(std::string_view word, std::string_view name) {
  return word == name ||
         (word.starts_with(name) && word.size() > name.size() && word[name.size()] == '=');
}

Parsed<Options> parse_options(std::string_view command, OptionSpec spec, Args args) {
  Options options;
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view word = args[i];
    if (spec.json && word == "--json") {
      if (options.json) return CommandError{std::string(command) + ": --json given twice"};
      options.json = true;
      continue;
    }
    if (spec.ledger && word == "--ledger") {
      if (options.ledger) return CommandError{std::string(command) + ": --ledger given twice"};
      options.ledger = true;
      continue;
    }
    if (spec.ledger && is_option(word, "--gpu")) {
      if (options.gpu) return CommandError{std::string(command) + ": --gpu given twice"};
      const auto value = option_value("--gpu", args, i);
      if (!value) return CommandError{std::string(command) + ": --gpu needs a GPU UUID"};
      if (value->empty() || value->size() > proto::kMaxNameLength) {
        return CommandError{std::string(command) + ": --gpu needs a GPU UUID of 1.." +
                            std::to_string(proto::kMaxNameLength) + " characters"};
      }
      options.gpu = std::string(*value);
      continue;
    }
    if (spec.job && is_option(word, "--job")) {
      if (options.job) return CommandError{std::string(command) + ": --job given twice"};
      const auto value = option_value("--job", args, i);
      // A job id as the wire carries it (PROTOCOL.md 4.7b).
      if (!value || value->empty() || value->size() > proto::kMaxNameLength ||
          !std::all_of(value->begin(), value->end(), proto::is_printable)) {
        return CommandError{std::string(command) + ": --job needs a job id of 1.." +
                            std::to_string(proto::kMaxNameLength) + " printable characters"};
      }
      options.job = std::string(*value);
      continue;
    }
    if (spec.pid && is_option(word, "--pid")) {
      if (options.pid) return CommandError{std::string(command) + ": --pid given twice"};
      const auto given = option_value("--pid", args, i);
      if (!given) return CommandError{std::string(command) + ": --pid needs a process id"};
      const std::string_view value = *given;
      auto pid = parse_pid(value);
      if (!pid) {
        return CommandError{std::string(command) + ": --pid needs a process id in " + pid_range() +
                            ", got '" + std::string(value) + "'"};
      }
      options.pid = pid;
      continue;
    }
    return CommandError{std::string(command) + ": unexpected argument '" +
                        proto::printable(word, 64) + "' (usage: " + usage_of(command, spec) + ")"};
  }
  return options;
}

std::string json_line(const json& doc) {
  // Replace (not throw on) invalid UTF-8, e.g. from a process's comm.
  return doc.dump(-1, ' ', false, json::error_handler_t::replace) + "\n";
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

template <typename Request>
Parsed<Request> no_arguments(std::string_view command, Args args) {
  auto parsed = parse_options(command, {}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return Request{};
}

constexpr const char* kTraceUsage = "trace [--pid N]... [--last SECONDS | --for SECONDS]";

}  // namespace

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

 private:
  mutable std::mutex mutex_;
  int count_ = 0;
  std::map<std::uint32_t, int> by_uid_;
};

namespace {

// Renders a capture as the trace document, a piece per next(), holding a TraceSlots slot.
class TraceReply final : public ReplyStream {
 public:
  TraceReply(std::shared_ptr<const TraceCapture> capture, std::shared_ptr<TraceSlots> slots,
             std::uint32_t uid)
      : export_(std::move(capture)), slots_(std::move(slots)), uid_(uid) {
    slots_->take(uid_);
  }
  ~TraceReply() override { slots_->give_back(uid_); }  // on the io or the render thread
  TraceReply(const TraceReply&) = delete;
  TraceReply& operator=(const TraceReply&) = delete;
  bool next(std::string& out) override { return export_.next(out); }

 private:
  TraceExport export_;
  std::shared_ptr<TraceSlots> slots_;
  std::uint32_t uid_;
};

// Holds a `trace --for` capture open: recording goes on (with the capture budget when
// the standing window is off) until the reply is made or the connection goes.
class CaptureHold {
 public:
  explicit CaptureHold(Collector& collector) : collector_(collector) {
    collector_.recorder().begin_capture();
  }
  ~CaptureHold() { collector_.recorder().end_capture(); }
  CaptureHold(const CaptureHold&) = delete;
  CaptureHold& operator=(const CaptureHold&) = delete;

 private:
  Collector& collector_;
};

std::uint64_t seconds_ns(double s) { return static_cast<std::uint64_t>(s * 1e9); }

Reply trace_reply(const TraceRequest& r, Collector& collector,
                  const std::shared_ptr<TraceSlots>& slots, std::uint32_t uid) {
  const std::uint64_t now = collector.now_ns();
  if (auto busy = slots->busy(uid)) return *busy;
  if (!r.for_s) {
    const std::uint64_t since =
        r.last_s && seconds_ns(*r.last_s) < now ? now - seconds_ns(*r.last_s) : 0;
    return std::shared_ptr<ReplyStream>(
        std::make_shared<TraceReply>(collector.capture_trace(r.pids, since), slots, uid));
  }
  auto hold = std::make_shared<CaptureHold>(collector);
  DeferredReply deferred;
  deferred.delay = std::chrono::milliseconds(static_cast<std::int64_t>(*r.for_s * 1000));
  deferred.make = [&collector, pids = r.pids, since = now, hold, slots, uid]() mutable -> Reply {
    if (auto busy = slots->busy(uid)) return *busy;
    auto capture = collector.capture_trace(pids, since);
    hold.reset();  // the capture holds its chunks; recording may stop now
    return std::shared_ptr<ReplyStream>(
        std::make_shared<TraceReply>(std::move(capture), slots, uid));
  };
  return deferred;
}

}  // namespace

Parsed<TraceRequest> TraceRequest::parse(Args args) {
  TraceRequest r;
  const auto bad = [](const std::string& what) {
    return CommandError{"trace: " + what + " (usage: " + kTraceUsage + ")"};
  };
  for (std::size_t i = 0; i < args.size(); ++i) {
    const std::string_view word = args[i];
    if (is_option(word, "--pid")) {
      const auto value = option_value("--pid", args, i);
      if (!value) return bad("--pid needs a process id");
      const auto pid = parse_pid(*value);
      if (!pid) {
        return bad("--pid needs a process id in " + pid_range() + ", got '" +
                   proto::printable(*value, 64) + "'");
      }
      if (r.pids.size() >= proto::kMaxTracePids && !r.pids.contains(*pid)) {
        return bad("at most " + std::to_string(proto::kMaxTracePids) + " --pid options");
      }
      r.pids.insert(*pid);
      continue;
    }
    for (const auto& [name, max, out] :
         {std::tuple{"--last", proto::kMaxTraceLastSeconds, &r.last_s},
          std::tuple{"--for", proto::kMaxTraceForSeconds, &r.for_s}}) {
      if (!is_option(word, name)) continue;
      if (out->has_value()) return bad(std::string(name) + " given twice");
      const auto value = option_value(name, args, i);
      const auto seconds = value ? parse_seconds(*value, max) : std::nullopt;
      if (!seconds) {
        return bad(std::string(name) + " needs a number of seconds in (0, " +
                   std::to_string(static_cast<int>(max)) + "]" +
                   (value ? ", got '" + proto::printable(*value, 64) + "'" : std::string()));
      }
      *out = seconds;
      break;
    }
    if (is_option(word, "--last") || is_option(word, "--for")) continue;
    return bad("unexpected argument '" + proto::printable(word, 64) + "'");
  }
  if (r.last_s && r.for_s) return bad("--last and --for exclude each other");
  return r;
}

Parsed<PingRequest> PingRequest::parse(Args args) {
  return no_arguments<PingRequest>("ping", args);
}
Parsed<MetricsRequest> MetricsRequest::parse(Args args) {
  return no_arguments<MetricsRequest>("metrics", args);
}
Parsed<VersionRequest> VersionRequest::parse(Args args) {
  return no_arguments<VersionRequest>("version", args);
}
Parsed<HelpRequest> HelpRequest::parse(Args args) {
  return no_arguments<HelpRequest>("help", args);
}

Parsed<ReportRequest> ReportRequest::parse(Args args) {
  auto parsed = parse_options("report", {.json = true, .pid = true, .job = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  const auto& o = std::get<Options>(parsed);
  return ReportRequest{o.json, o.pid, o.job};
}
Parsed<LedgerRequest> LedgerRequest::parse(Args args) {
  if (!args.empty() && args[0] == "cleanup") {
    constexpr std::string_view kUsage = " (usage: ledger cleanup GPU ID)";
    if (args.size() != 3) {
      return CommandError{"ledger cleanup: needs a GPU UUID and a reservation id" +
                          std::string(kUsage)};
    }
    const std::string_view gpu = args[1];
    if (gpu.size() > proto::kMaxNameLength || !proto::all_printable(gpu)) {
      return CommandError{"ledger cleanup: a GPU UUID is 1.." +
                          std::to_string(proto::kMaxNameLength) + " printable characters"};
    }
    std::uint64_t id = 0;
    const std::string_view text = args[2];
    const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), id);
    if (ec != std::errc{} || ptr != text.data() + text.size()) {
      return CommandError{
          "ledger cleanup: the reservation id must be an integer in "
          "0..18446744073709551615, got '" +
          proto::printable(text, 64) + "'"};
    }
    return LedgerRequest{false, LedgerRequest::Cleanup{std::string(gpu), id}};
  }
  auto parsed = parse_options("ledger", {.json = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return LedgerRequest{std::get<Options>(parsed).json, std::nullopt};
}
Parsed<StatsRequest> StatsRequest::parse(Args args) {
  auto parsed = parse_options("stats", {.json = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return StatsRequest{std::get<Options>(parsed).json};
}
Parsed<ResetRequest> ResetRequest::parse(Args args) {
  constexpr OptionSpec kSpec{.pid = true, .ledger = true};
  auto parsed = parse_options("reset", kSpec, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  auto& o = std::get<Options>(parsed);
  if (int{o.pid.has_value()} + int{o.ledger} + int{o.gpu.has_value()} > 1) {
    return CommandError{"reset: --pid, --ledger and --gpu exclude each other (usage: " +
                        usage_of("reset", kSpec) + ")"};
  }
  return ResetRequest{o.pid, o.ledger, std::move(o.gpu)};
}

std::string VersionResponse::to_json_line() const {
  return json_line(json{{"version", version}, {"protocol", protocol}, {"commands", commands}});
}

bool may_reset(std::uint32_t peer_uid, std::uint32_t daemon_euid) {
  return peer_uid == 0 || peer_uid == daemon_euid;
}

template <typename Request, typename Run>
void CommandTable::add(std::string name, std::string usage, std::string summary, Run run) {
  Handler handler = [run = std::move(run)](Args args, const CommandContext& context) -> Reply {
    Parsed<Request> parsed = Request::parse(args);
    if (auto* err = std::get_if<CommandError>(&parsed)) return "error: " + err->message + "\n";
    return run(std::get<Request>(parsed), context);
  };
  entries_.emplace(std::move(name),
                   Entry{std::move(usage), std::move(summary), std::move(handler)});
}

CommandTable::CommandTable() : trace_slots_(std::make_shared<TraceSlots>()) {
  add<PingRequest>("ping", "ping", "answers pong",
                   [](const PingRequest&, const CommandContext&) { return std::string("pong\n"); });
  add<ReportRequest>("report", "report [--json] [--pid N] [--job ID]",
                     "per-step timing for all processes (or one pid, or one job's), by job, "
                     "then the VRAM ledger",
                     [](const ReportRequest& r, const CommandContext&) -> Reply {
                       return RenderJob([r](const CollectorView& v) {
                         const report::ReportFilter filter{r.pid, r.job};
                         return r.json ? json_line(report::report_json(v, filter))
                                       : text_reply(report::report_text(v, filter));
                       });
                     });
  add<LedgerRequest>("ledger", "ledger [--json] | ledger cleanup GPU ID",
                     "the VRAM ledger view per GPU; cleanup: remove a reservation (root, the "
                     "holder's uid, or anyone once it is LEAKED or EXPIRED)",
                     [](const LedgerRequest& r, const CommandContext& c) -> Reply {
                       if (r.cleanup) {
                         static const PeerIdentity kNobody{{0, 0}, kNobodyUid, kNobodyGid, ""};
                         const PeerIdentity& sender = c.peer ? *c.peer : kNobody;
                         return report::cleanup_reply(
                             c.collector.operator_cleanup(sender, r.cleanup->gpu, r.cleanup->id),
                             r.cleanup->gpu, r.cleanup->id, sender.key.pid);
                       }
                       return RenderJob([r](const CollectorView& v) {
                         return r.json ? json_line(report::ledger_json(v))
                                       : text_reply(report::ledger_text(v));
                       });
                     });
  add<StatsRequest>("stats", "stats [--json]", "the daemon's own counters",
                    [](const StatsRequest& r, const CommandContext&) -> Reply {
                      return RenderJob([r](const CollectorView& v) {
                        return r.json ? json_line(report::stats_json(v))
                                      : text_reply(report::stats_text(v));
                      });
                    });
  add<MetricsRequest>("metrics", "metrics", "Prometheus text exposition (format 0.0.4)",
                      [](const MetricsRequest&, const CommandContext&) -> Reply {
                        return RenderJob([](const CollectorView& v) {
                          return text_reply(report::metrics_text(v));
                        });
                      });
  add<ResetRequest>(
      "reset", "reset [--pid N | --ledger | --gpu UUID]",
      "clear the aggregates (all, or one pid's), or the VRAM ledger (all GPUs, or one); root or "
      "the daemon's uid only",
      [](const ResetRequest& r, const CommandContext& c) {
        if (!may_reset(c.peer_uid, c.daemon_euid)) {
          return std::string("error: permission denied\n");
        }
        if (r.ledger || r.gpu) {
          const std::size_t n = c.collector.reset_ledger(
              r.gpu ? std::optional<std::string_view>(*r.gpu) : std::nullopt);
          if (r.gpu && n == 0) {
            return "error: no GPU '" + proto::printable(*r.gpu) + "' in the ledger\n";
          }
          return "ok: " + std::to_string(n) + (n == 1 ? " GPU" : " GPUs") +
                 " cleared from the ledger\n";
        }
        if (c.collector.reset(r.pid) == 0 && r.pid) {
          return "error: no process with pid " + std::to_string(*r.pid) + "\n";
        }
        return std::string("ok\n");
      });
  add<TraceRequest>("trace", kTraceUsage,
                    "the flight recorder's recent events as a Chrome Trace Event document "
                    "(Perfetto UI, chrome://tracing); --for records from now on",
                    [slots = trace_slots_](const TraceRequest& r, const CommandContext& c) {
                      return trace_reply(r, c.collector, slots, c.peer_uid);
                    });
  add<VersionRequest>(
      "version", "version", "daemon version, protocol version and commands, as one JSON line",
      [this](const VersionRequest&, const CommandContext&) {
        return VersionResponse{STEPTRACE_VERSION_STRING, proto::kProtocolVersion, names()}
            .to_json_line();
      });
  add<HelpRequest>("help", "help", "this list",
                   [this](const HelpRequest&, const CommandContext&) { return help_text(); });
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
