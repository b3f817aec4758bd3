// The text commands steptraced answers on its socket (one per line, each answered in
// order; see proto/PROTOCOL.md section 10).
//
// Data flow: Session reads a line -> CommandTable::dispatch(line, context) splits it into
// words and looks the first word up in the table. Each command is declared once
// (commands.cpp): its name, the words it takes (command_syntax.h: what the parser accepts
// and the usage `help` and every "(usage: ...)" error show), its summary, who may run it
// and its handler. The table parses the remaining words into the command's typed request
// struct (a bad word is an `error: ...` reply naming it), checks who asks, then runs the
// handler against the Collector, which returns the reply: text at once, or (reports,
// ledger, stats, metrics) a RenderJob that the session hands to the RenderWorker
// (daemon/serve/render_worker.h), so rendering never holds the io thread.
// Every reply is text ending in '\n'; JSON replies are one line. A bad command never
// closes the connection.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "daemon/report/overhead_rule.h"
#include "daemon/serve/command_syntax.h"
#include "daemon/serve/render_job.h"
#include "daemon/serve/trace_selection.h"
#include "daemon/state/collector.h"
#include "proto/commands.h"

namespace steptrace::daemon {

// Who asks, and whom: the peer's uid comes from SO_PEERCRED.
struct CommandContext {
  Collector& collector;
  std::uint32_t peer_uid = 0;
  std::uint32_t daemon_euid = 0;
  // The peer process (pid 0 when unknown): `ledger cleanup` credits it.
  const PeerIdentity* peer = nullptr;
  // `trace --for` replies the peer's uid may have waiting (limits.max_pending_traces_per_uid).
  std::size_t max_pending_traces_per_uid = 4;
  // The config's 50% rules (`report`); nullptr: the built-in default only.
  const report::OverheadRules* overhead_rules = nullptr;
  // Where `trace --children` reads the processes, and how many at most
  // (trace_selection.h); tests point them at a stand-in /proc with small bounds.
  std::string proc_root = "/proc";
  DescendantBounds descendant_bounds{};
};

// A reply too big to be one string (`trace`): rendered a piece at a time on the render
// thread; the session asks for the next piece once the client has read the last one,
// so it costs the daemon one piece per connection however big the reply.
class ReplyStream {
 public:
  virtual ~ReplyStream() = default;
  // Appends the next piece to `out`; false once that piece ends the reply.
  virtual bool next(std::string& out) = 0;
  // On the io thread, once the piece that ended the reply was handed to its connection:
  // what the reply counts (a trace refused past a bound) goes to the Collector here,
  // never from the render thread next() ran on. Not called when the connection closed
  // first.
  virtual void finished() {}
};

struct Reply;
// A reply that is made later (`trace --for`): after `delay`, `make` gives the reply.
// What `make` holds (the capture, the uid's pending slot) is released when it is
// destroyed: after the reply is made, or at once when the connection closes first.
struct DeferredReply {
  std::chrono::milliseconds delay{0};
  std::function<Reply()> make;
};

// A command's answer: `text` now; or, when `render` is set, what to render from a view;
// or a `stream` of pieces; or a `deferred` reply.
struct Reply {
  Reply(std::string t) : text(std::move(t)) {}      // NOLINT(google-explicit-constructor)
  Reply(const char* t) : text(t) {}                 // NOLINT(google-explicit-constructor)
  Reply(RenderJob job) : render(std::move(job)) {}  // NOLINT(google-explicit-constructor)
  Reply(std::shared_ptr<ReplyStream> s) : stream(std::move(s)) {}  // NOLINT
  Reply(DeferredReply d) : deferred(std::move(d)) {}               // NOLINT
  std::string text;
  RenderJob render;
  std::shared_ptr<ReplyStream> stream;
  std::optional<DeferredReply> deferred;
};

// ---- typed requests, one per command --------------------------------------------
struct PingRequest {
  static Parsed<PingRequest> parse(Args args);
};
// `report [--json] [--pid N] [--job ID | --job UID:ID]`: a job is (uid, job id); without
// a uid, `--job` names the asking uid's job (run_report resolves it, PROTOCOL.md 10.3).
struct ReportRequest {
  bool json = false;
  std::optional<std::int32_t> pid;
  std::optional<std::string> job;
  std::optional<std::uint32_t> job_uid;   // --job UID:ID
  std::optional<std::uint64_t> window_s;  // --window N: rank skew over the last N s too
  // --compute STEP,... / --overhead STEP,...: the 50% rule's steps for this report.
  std::optional<std::vector<std::string>> compute;
  std::optional<std::vector<std::string>> overhead;
  static Parsed<ReportRequest> parse(Args args);
};
struct LedgerRequest {
  bool json = false;
  // `ledger cleanup GPU ID`: an operator removes a reservation (section 4.6's rules).
  struct Cleanup {
    std::string gpu;
    std::uint64_t id = 0;
  };
  std::optional<Cleanup> cleanup;
  static Parsed<LedgerRequest> parse(Args args);
};
struct StatsRequest {
  bool json = false;
  static Parsed<StatsRequest> parse(Args args);
};
struct MetricsRequest {
  static Parsed<MetricsRequest> parse(Args args);
};
// `reset [--pid N]` clears step aggregates; `reset --ledger` every GPU of the ledger
// view, `reset --gpu UUID` one (at most one of the three options).
struct ResetRequest {
  std::optional<std::int32_t> pid;
  bool ledger = false;
  std::optional<std::string> gpu;
  static Parsed<ResetRequest> parse(Args args);
};
// `trace [--pid N]... [--last SECONDS | --for SECONDS]`: the flight recorder's window as
// a Chrome Trace Event document (daemon/report/trace_export.h).
struct TraceRequest {
  // The bounds the CLI checks too (proto/commands.h).
  static constexpr std::size_t kMaxPids = proto::kMaxTracePids;
  static constexpr double kMaxLastS = proto::kMaxTraceLastSeconds;
  static constexpr double kMaxForS = proto::kMaxTraceForSeconds;
  std::set<std::int32_t> pids;
  bool children = false;                 // --children: each --pid's live descendants too
  std::optional<std::string> job;        // --job ID or UID:ID
  std::optional<std::uint32_t> job_uid;  // UID of UID:ID
  std::optional<double> last_s;
  std::optional<double> for_s;
  static Parsed<TraceRequest> parse(Args args);
};
struct VersionRequest {
  static Parsed<VersionRequest> parse(Args args);
};
struct HelpRequest {
  static Parsed<HelpRequest> parse(Args args);
};

// The reply of `version`: {"version": ..., "protocol": 1, "commands": [...]}.
struct VersionResponse {
  std::string version;
  std::uint32_t protocol = 0;
  std::vector<std::string> commands;
  std::string to_json_line() const;
};

// Only root or the daemon's own effective uid may change state (`reset`: the table checks
// it before the handler runs).
bool may_reset(std::uint32_t peer_uid, std::uint32_t daemon_euid);

class TraceSlots;

class CommandTable {
 public:
  CommandTable();  // registers every command
  // Its handlers hold `this` (version, help).
  CommandTable(const CommandTable&) = delete;
  CommandTable& operator=(const CommandTable&) = delete;

  // Answers one line (without its '\n'); the reply (text, or the text its job renders)
  // ends with '\n'. Counts commands_served.
  Reply dispatch(std::string_view line, const CommandContext& context) const;
  // dispatch(), with a render job run at once on this thread over a fresh view, a
  // stream's pieces joined and a deferred reply made at once (tests).
  std::string execute(std::string_view line, const CommandContext& context) const;
  std::vector<std::string> names() const;
  // The reply of `help`: every command's usage and summary, one per line.
  std::string help_text() const;

 private:
  using Handler = std::function<Reply(Args, const CommandContext&)>;
  struct Entry {
    std::string usage;
    std::string summary;
    Handler handler;  // parse the words, check who asks, run the command
  };
  // Registers a command declared in commands.cpp (a static, so it outlives the table).
  template <typename Command>
  void add(const Command& command);

  std::map<std::string, Entry, std::less<>> entries_;
  // The trace replies alive (commands.cpp): this table's, not the process's.
  std::shared_ptr<TraceSlots> trace_slots_;
};

}  // namespace steptrace::daemon
