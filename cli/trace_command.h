// `steptrace trace`: asks steptraced for a timeline (its `trace` text command) and saves
// the reply, a Chrome Trace Event Format JSON document that may be hundreds of MB, to a
// file or to standard output as it streams in, never holding it in memory.
//
// A file is written as FILE.partial (created exclusively, never through a symlink) and
// renamed to FILE only once the reply is a complete document; an error reply, a failed
// connection, a reply cut short, a write error, a reply past --max-mb or
// SIGINT/SIGTERM/SIGHUP removes it.
//
// Which processes: --pid, --job and --children are resolved here, not by the daemon: the
// CLI asks `report --json` (--job: `report --json --job ID`, proto/PROTOCOL.md section
// 10.4) which processes steptraced tracks, refuses a pid or job it does not (exit 1, no
// file, as `report --pid` does), adds the tracked descendants of each --pid found in
// /proc with --children, and then sends the plain `trace --pid N...` command.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <ctime>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cli/control_client.h"

namespace steptrace::cli {

// The CLI's exit statuses.
inline constexpr int kExitOk = 0;
inline constexpr int kExitFailure = 1;  // daemon unreachable, error reply, I/O failure
inline constexpr int kExitUsage = 2;

// The options of `steptrace trace`. main.cpp checks them against the daemon's grammar and
// bounds (proto/commands.h) before run_trace(), which passes --last and --for on as typed.
// Viewers struggle past this (a 98 MB trace closed speedscope's tab, issue 27).
inline constexpr std::uint64_t kDefaultMaxTraceMb = 50;

struct TraceRequest {
  std::vector<int> pids;  // --pid, each > 0
  std::string job;        // --job ID or UID:ID as typed, empty when not given
  bool children = false;  // --children: each --pid's descendants too
  std::string last;       // --last SECONDS as typed, empty when not given
  std::string for_s;      // --for SECONDS as typed, empty when not given
  std::string output;     // -o: empty for the default file name, "-" for standard output
  bool force = false;     // replace an existing FILE (and a stale FILE.partial)
  std::uint64_t max_mb = kDefaultMaxTraceMb;  // --max-mb: 0 for no bound
};

// The processes a `report --json` reply lists: their pids, in its order. nullopt when the
// reply is not a report.
std::optional<std::vector<int>> pids_of_report(std::string_view reply);

// The command sent: "trace [--pid N]... [--children] [--job [UID:]ID] [--last S]
// [--for S]" (pids deduplicated, in the order given).
std::string trace_command_line(const TraceRequest& request);

// steptrace-trace-HOST-YYYYmmdd-HHMMSS.json; bytes of `host` other than [A-Za-z0-9._-]
// become '_' (an empty host is "localhost").
std::string default_trace_file_name(std::string_view host, const std::tm& local_time);

// Follows a JSON document as it streams past, piece by piece in any split, to count the
// elements of its top-level "traceEvents" array and to tell whether it is complete: one
// object, closed, with such an array, followed by nothing but whitespace. It tracks
// strings, escapes and bracket nesting only; it is no validator.
class TraceDocumentScanner {
 public:
  void feed(std::string_view piece);

  std::uint64_t events() const { return events_; }
  bool complete() const;

 private:
  static constexpr std::size_t kMaxDepth = 512;
  static constexpr std::size_t kMaxKey = 16;

  std::vector<char> stack_;  // open '{' and '['
  bool started_ = false;     // the top-level object was opened
  bool closed_ = false;      // ... and closed
  bool bad_ = false;         // not a single object, mismatched brackets, too deep, trailing text
  bool in_string_ = false;
  bool escape_ = false;
  std::string key_;                  // the string being read at depth 1 (its first kMaxKey bytes)
  bool last_key_is_events_ = false;  // the last string closed at depth 1 was "traceEvents"
  bool in_events_ = false;           // inside the top-level "traceEvents" array
  bool saw_events_ = false;
  std::uint64_t events_ = 0;
};

// Runs `steptrace trace`; the exit status. Messages go to stderr.
int run_trace(const SocketPath& socket, const TraceRequest& request,
              std::chrono::milliseconds timeout);

}  // namespace steptrace::cli
