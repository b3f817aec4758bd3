#include "daemon/serve/commands.h"
#include "daemon/report/report.h"

#include <steptrace/version.h>
#include <charconv>
#include <exception>
#include <nlohmann/json.hpp>

#include "daemon/serve/render_worker.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

// What options a command accepts, and what the words said.
struct OptionSpec {
  bool json = false;
  bool pid = false;
};
struct Options {
  bool json = false;
  std::optional<std::int32_t> pid;
};

std::string usage_of(std::string_view command, OptionSpec spec) {
  std::string usage(command);
  if (spec.json) usage += " [--json]";
  if (spec.pid) usage += " [--pid N]";
  return usage;
}

std::optional<std::int32_t> parse_pid(std::string_view text) {
  std::int64_t value = 0;
  const auto* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc{} || ptr != end) return std::nullopt;
  if (value < 1 || value > std::numeric_limits<std::int32_t>::max()) return std::nullopt;
  return static_cast<std::int32_t>(value);
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
    if (spec.pid && (word == "--pid" || word.starts_with("--pid="))) {
      if (options.pid) return CommandError{std::string(command) + ": --pid given twice"};
      std::string_view value;
      if (word == "--pid") {
        if (i + 1 >= args.size()) {
          return CommandError{std::string(command) + ": --pid needs a process id"};
        }
        value = args[++i];
      } else {
        value = word.substr(6);
      }
      auto pid = parse_pid(value);
      if (!pid) {
        return CommandError{std::string(command) +
                            ": --pid needs a process id in 1..2147483647, got '" +
                            std::string(value) + "'"};
      }
      options.pid = pid;
      continue;
    }
    return CommandError{std::string(command) + ": unexpected argument '" + std::string(word) +
                        "' (usage: " + usage_of(command, spec) + ")"};
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

}  // namespace

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
  auto parsed = parse_options("report", {.json = true, .pid = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  const auto& o = std::get<Options>(parsed);
  return ReportRequest{o.json, o.pid};
}
Parsed<LedgerRequest> LedgerRequest::parse(Args args) {
  auto parsed = parse_options("ledger", {.json = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return LedgerRequest{std::get<Options>(parsed).json};
}
Parsed<StatsRequest> StatsRequest::parse(Args args) {
  auto parsed = parse_options("stats", {.json = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return StatsRequest{std::get<Options>(parsed).json};
}
Parsed<ResetRequest> ResetRequest::parse(Args args) {
  auto parsed = parse_options("reset", {.pid = true}, args);
  if (auto* err = std::get_if<CommandError>(&parsed)) return *err;
  return ResetRequest{std::get<Options>(parsed).pid};
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

CommandTable::CommandTable() {
  add<PingRequest>("ping", "ping", "answers pong",
                   [](const PingRequest&, const CommandContext&) { return std::string("pong\n"); });
  add<ReportRequest>("report", "report [--json] [--pid N]",
                     "per-step timing for all processes (or one pid), then the VRAM ledger",
                     [](const ReportRequest& r, const CommandContext&) -> Reply {
                       return RenderJob([r](const CollectorView& v) {
                         return r.json ? json_line(report::report_json(v, r.pid))
                                       : text_reply(report::report_text(v, r.pid));
                       });
                     });
  add<LedgerRequest>("ledger", "ledger [--json]", "the VRAM ledger view per GPU",
                     [](const LedgerRequest& r, const CommandContext&) -> Reply {
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
  add<ResetRequest>("reset", "reset [--pid N]",
                    "clear the aggregates (all, or one pid's); root or the daemon's uid only",
                    [](const ResetRequest& r, const CommandContext& c) {
                      if (!may_reset(c.peer_uid, c.daemon_euid)) {
                        return std::string("error: permission denied\n");
                      }
                      if (c.collector.reset(r.pid) == 0 && r.pid) {
                        return "error: no process with pid " + std::to_string(*r.pid) + "\n";
                      }
                      return std::string("ok\n");
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
  if (!reply.render) return std::move(reply.text);
  return run_render_job(reply.render, *context.collector.freeze());
}

Reply CommandTable::dispatch(std::string_view line, const CommandContext& context) const {
  const auto words = split_words(line);
  if (words.empty()) return "error: empty command (try help)\n";
  auto it = entries_.find(words.front());
  if (it == entries_.end()) {
    std::string name(words.front().substr(0, 64));
    for (char& ch : name) {
      if (!proto::is_printable(ch)) ch = '?';
    }
    return "error: unknown command '" + name + "' (try help)\n";
  }
  try {
    return it->second.handler(Args(words).subspan(1), context);
  } catch (const std::exception& e) {
    // A report bug must not take the connection (or the daemon) down.
    return std::string("error: internal error: ") + e.what() + "\n";
  }
}

}  // namespace steptrace::daemon
