// steptrace: the command-line client of steptraced.
//
// Each subcommand is one of the daemon's text commands: the CLI resolves the socket path
// (--socket, else $STEPTRACE_SOCKET, else the default), sends the command over one Unix
// stream connection (cli/control_client.h) and prints the reply. `top` polls
// `report --json` and renders it (cli/top_view.h): with a terminal on both ends as an
// interactive screen (raw keys, SIGWINCH, the terminal restored on every way out),
// else as plain frames; `trace` streams the daemon's timeline
// to a file (cli/trace_command.h). `help` and no subcommand at all list the subcommands.
//
// Exit status, the same for every subcommand: 0 success; 1 a daemon or lookup failure
// (the daemon could not be reached, answered `error: ...`, or does not track the pid
// asked for); 2 bad usage (unknown subcommand, flag or argument). Standard output that
// goes away (`steptrace top | head -3`) ends the command quietly with 0: SIGPIPE is
// ignored and EPIPE on standard output is taken as the end of the reader.
//
// ANSI sequences (colour, clearing the screen: only `top` emits any) go to a terminal
// only, and never when NO_COLOR is set to a non-empty value or TERM is `dumb`.
#include <fcntl.h>
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <steptrace/version.h>
#include <sys/ioctl.h>
#include <termios.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <variant>
#include <vector>

#include "cli/control_client.h"
#include "cli/top_request.h"
#include "cli/top_terminal.h"
#include "cli/top_view.h"
#include "cli/trace_command.h"
#include "cli/trace_merge.h"
#include "proto/commands.h"
#include "proto/printable.h"
#include "proto/rule_steps.h"
#include "proto/text_safety.h"
#include "proto/wire_format.h"

namespace {

using steptrace::cli::CommandFailure;
using steptrace::cli::CommandResult;
using steptrace::cli::kDaemonAnswered;
using steptrace::cli::kExitFailure;
using steptrace::cli::kExitOk;
using steptrace::cli::kExitUsage;
using steptrace::cli::SocketPath;

constexpr const char* kDescription =
    "steptrace - ask steptraced, the steptrace trace collector, what ML training processes on "
    "this machine are doing.\n"
    "Trainers linked with libsteptrace send their span timings (Forward, Backward, Matmul, ...) "
    "and VRAM-ledger annotations to the steptraced daemon; this tool queries it over its Unix "
    "socket.";

constexpr const char* kExitStatus =
    "Exit status: 0 ok, 1 daemon unreachable, unknown pid or error reply, 2 bad usage.\n";

// The footer of `steptrace --help`.
std::string main_footer() {
  return std::string("Socket: --socket PATH, else $STEPTRACE_SOCKET, else ") +
         steptrace::proto::kDefaultSocketPath +
         ".\nIf the daemon is not running: systemctl start steptraced.socket\n"
         "Exit status: 0 ok, 1 daemon unreachable, unknown pid or error reply, 2 bad usage.\n"
         "Run `steptrace help SUBCOMMAND` (or `steptrace SUBCOMMAND --help`) for a subcommand's "
         "options.\n";
}

constexpr const char* kReportFooter =
    "Text: the shape of the in-process tracer steptrace replaces (per step: count, duration,\n"
    "share of the time, sorted by time; the compute-versus-overhead analysis), for all\n"
    "processes, per job (trainers started with a job id: STEPTRACE_JOB, TORCHELASTIC_RUN_ID\n"
    "or SLURM_JOB_ID, and RANK/LOCAL_RANK/WORLD_SIZE) and per process, followed by the VRAM\n"
    "ledger per GPU. Duration includes nested spans; Self leaves them out. --json: one line,\n"
    "schema steptrace.report/v1 (proto/PROTOCOL.md, section 10.4).\n"
    "A job is a uid's processes that sent one job id: --job ID is your uid's job, --job\n"
    "UID:ID that uid's (an ID that itself starts with digits and ':' needs its UID: prefix).\n"
    "Root and the daemon's own user also reach another uid's job by its bare ID when only\n"
    "one uid runs a job by that id. --pid N or a job that matches no tracked process exits\n"
    "1 (for a job, the daemon names the uids that run one by that id).\n"
    "The 50% rule sets compute steps against CPU-overhead steps (Matmul against\n"
    "Transpose + Alloc unless the daemon's config says otherwise for the job: its\n"
    "overhead_rule); --compute and --overhead name others for this report (a list not given\n"
    "is the config's default; a step may not be in both). --json carries it as \"rule\".\n";

constexpr const char* kResetFooter =
    "Without options: the per-step aggregates of every process; --pid N: of that process\n"
    "only (exit 1 when the daemon tracks no such pid). --ledger: every GPU of the VRAM\n"
    "ledger view (reservations, per-process rows, samples); --gpu UUID: that GPU only.\n"
    "The daemon's counters stay. Allowed for root and the daemon's own user only.\n";

constexpr const char* kTopFooter =
    "On a terminal: a screen like htop's that fits the terminal and follows its size: a\n"
    "header that stays, one line per live process, busiest first (pid, uid, job, rank with\n"
    "! on a straggler of its job, comm, traced time, busiest step, what it does now; a\n"
    "process polling for VRAM shows WAITING FOR VRAM), the rest summarised in one line, then\n"
    "the VRAM ledger per GPU. Refreshed every --interval seconds (or --iterations N times).\n"
    "Keys: q quit (Ctrl-C too; exit 0, at once, even while a refresh waits for the daemon),\n"
    "t/n/p sort by time/name/pid, j next job, a all jobs, space refresh now, Ctrl-Z suspend\n"
    "(fg resumes).\n"
    "--once: one screen and exit, for scripts (as wide as the terminal, or unlimited when\n"
    "piped; no escape codes unless on a terminal); Ctrl-C ends it like any command (130).\n"
    "Piped without --once: a detailed frame per refresh (each thread's open span, each\n"
    "step's totals) as plain text; when the reader goes away (steptrace top | head -3) it\n"
    "ends at once. NO_COLOR or TERM=dumb: no escape codes at all (the screens follow each\n"
    "other, keys still work).\n";

constexpr const char* kVersionFooter =
    "Human-readable: the CLI's version, and the daemon's version and protocol when it\n"
    "answers. --json: {\"cli\": {\"version\": ...}, \"socket\": PATH, \"daemon\": the daemon's\n"
    "`version` reply, or null when it cannot be reached}. Exit status 1 when the daemon\n"
    "cannot be reached (the CLI's version is printed all the same).\n";

constexpr const char* kTraceFooter =
    "A trace is the timeline behind `steptrace report`: every span each thread recorded\n"
    "(Forward, Backward, Matmul, ...) with its start and end, the VRAM-ledger operations and\n"
    "per-GPU VRAM counters, and the events processes reported dropped. It comes from the\n"
    "daemon's flight recorder, which keeps the last seconds of raw events of each process\n"
    "(flight_recorder_bytes and flight_recorder_seconds in its config). Without --for you get\n"
    "that window as it is now (--last S: only its last S seconds); --for S records from now\n"
    "for S seconds, even when the standing window is off, and then saves that.\n"
    "\n"
    "Output: steptrace-trace-HOST-YYYYmmdd-HHMMSS.json in the current directory (local time\n"
    "when you ran the command), written as FILE.partial and renamed once complete; -o FILE\n"
    "chooses the file, -o - writes to standard output. An existing FILE is kept unless --force.\n"
    "--timeout bounds each wait for more of the reply; with --for S the first byte may take\n"
    "S seconds more.\n"
    "\n"
    "Which processes: all of them; --pid PID (repeat it), with --children the processes each\n"
    "one forked that still run (its workers); --job ID (yours) or UID:ID, every rank and\n"
    "worker of the job on this node, exited ones too while the window holds their events\n"
    "(steptraced chooses them). A pid or job steptraced does not track is an error (exit 1,\n"
    "no file).\n"
    "Processes with nothing in the window are left out. A trace past --max-mb (default 50)\n"
    "is refused, not written: viewers struggle past it; narrow it or pass --max-mb 0.\n"
    "\n"
    "Open it in https://ui.perfetto.dev (\"Open trace file\") or https://www.speedscope.app\n"
    "(current Chromium no longer opens chrome://tracing): a track per process, named\n"
    "`comm [pid]`, and per thread, with the spans as slices named after their steps. Times\n"
    "are since the trace's start; otherData.ts_origin_unix_ns says when that was.\n"
    "`steptrace trace merge` joins the files of several nodes into one timeline.\n"
    "\n"
    "Examples:\n"
    "  steptrace trace                                    everything in the window now\n"
    "  steptrace trace --pid 4242 --last 10 -o step.json  one process, the last 10 s\n"
    "  steptrace trace --pid 4242 --children              a trainer and its workers\n"
    "  steptrace trace --job run7 -o node3.json           every rank of job run7 here\n"
    "  steptrace trace --for 30                           record the next 30 s\n"
    "\n"
    "Exit status: 0 written, 1 daemon unreachable, error reply, unknown pid or job, trace\n"
    "past --max-mb or write failure, 2 bad usage or FILE exists.\n";

constexpr const char* kTraceMergeFooter =
    "Joins `steptrace trace` files of several nodes (one per node, e.g. --job ID on each)\n"
    "into one timeline. Files are aligned on their wall-clock anchors\n"
    "(otherData.ts_origin_unix_ns). When the nodes' clocks differ by more than the spans,\n"
    "--align-step NAME[:K] aligns on step NAME instead: in each file, every rank (every\n"
    "process that has no rank) has its K-th span of NAME (from 1, default 1, counted over\n"
    "that rank's processes); the median of those starts over the file's ranks (the lower\n"
    "middle one for an even count) is the file's align point, and each file is shifted as\n"
    "a whole so that its align point meets the first file's. Ranks with fewer than K spans\n"
    "are left out of the median; a file where no rank has K is an error.\n"
    "Tracks are named `node / rank N / comm [pid]`, ranks in order. Files are read as a\n"
    "stream: memory is about the inputs' size. A merged trace past --max-mb (default 50)\n"
    "is refused, not written, as `trace` does; pass --max-mb 0 to write it all.\n"
    "\n"
    "Examples:\n"
    "  steptrace trace merge node1.json node2.json -o job.json\n"
    "  steptrace trace merge node*.json --align-step Forward:10 -o job.json\n"
    "\n"
    "Exit status: 0 written, 1 unreadable or invalid file, or past --max-mb (nothing\n"
    "written), 2 bad usage or FILE exists.\n";

struct Options {
  std::string socket_flag;
  double timeout_s = 10.0;
  bool json = false;
  int pid = 0;
  double interval_s = 1.0;
  int iterations = 0;
  bool ledger = false;                       // reset --ledger
  std::string gpu;                           // reset --gpu UUID, ledger cleanup GPU
  std::string reservation;                   // ledger cleanup GPU ID
  std::vector<std::string> help_topic;       // help SUBCOMMAND [SUBCOMMAND...]
  std::string job;                           // report --job ID, top --job ID
  bool once = false;                         // top --once
  std::string sort = "time";                 // top --sort
  int window_s = 0;                          // report --window N (0: not asked)
  std::string compute;                       // report --compute STEP,...
  std::string overhead;                      // report --overhead STEP,...
  int top_window_s = 60;                     // top --window N (0: the whole run only)
  steptrace::cli::TraceRequest trace;        // trace's options
  steptrace::cli::MergeRequest trace_merge;  // trace merge's
};

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(std::llround(seconds * 1000.0)));
}

void write_line(std::FILE* out, const std::string& text) {
  std::fputs(text.c_str(), out);
  if (text.empty() || text.back() != '\n') std::fputc('\n', out);
  std::fflush(out);
}

// ---- standard output ---------------------------------------------------------------

enum class Written { kOk, kReaderGone, kFailed };

// Writes `text` to standard output and flushes it. kReaderGone when the reader went away
// (EPIPE: SIGPIPE is ignored), kFailed (with a message on stderr) for any other error.
Written write_stdout(std::string_view text) {
  errno = 0;
  const bool ok =
      (text.empty() || std::fwrite(text.data(), 1, text.size(), stdout) == text.size()) &&
      std::fflush(stdout) == 0;
  if (ok) return Written::kOk;
  const int error = errno;
  if (error == EPIPE) return Written::kReaderGone;
  write_line(stderr, std::string("steptrace: cannot write to standard output: ") +
                         (error != 0 ? std::strerror(error) : "write error"));
  return Written::kFailed;
}

// The exit status for what write_stdout() returned: the end of the reader is no error.
int exit_status(Written written) { return written == Written::kFailed ? kExitFailure : kExitOk; }

// Whether ANSI sequences may go to standard output: a terminal, NO_COLOR unset or empty
// (https://no-color.org), and a TERM other than `dumb`.
bool use_ansi() {
  if (::isatty(STDOUT_FILENO) != 1) return false;
  const char* no_color = std::getenv("NO_COLOR");
  if (no_color != nullptr && *no_color != '\0') return false;
  const char* term = std::getenv("TERM");
  return term == nullptr || std::string_view(term) != "dumb";
}

// top's signals (SIGINT, SIGTERM, SIGHUP, SIGQUIT: quit; SIGWINCH: redraw) set these and write a
// byte to the wake pipe, so a poll() that waits for a key or the next refresh returns at
// once instead of racing the flag.
volatile std::sig_atomic_t g_top_quit = 0;
volatile std::sig_atomic_t g_top_resized = 0;
volatile std::sig_atomic_t g_top_suspend = 0;  // Ctrl-Z: give the terminal back, then stop
int g_wake_read = -1;
int g_wake_write = -1;

extern "C" void on_top_signal(int signal_number) {
  if (signal_number == SIGWINCH) {
    g_top_resized = 1;
  } else if (signal_number == SIGTSTP) {
    g_top_suspend = 1;
  } else {
    g_top_quit = 1;
  }
  const int saved = errno;
  if (g_wake_write >= 0) {
    const char byte = 0;
    [[maybe_unused]] const ssize_t n = ::write(g_wake_write, &byte, 1);
  }
  errno = saved;
}

// Installs the handlers above (once): Ctrl-C ends `top` with status 0, like q, after the
// terminal is restored, instead of killing it with 130.
void catch_top_signals() {
  if (g_wake_read >= 0) return;
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0) {
    g_wake_read = fds[0];
    g_wake_write = fds[1];
  }
  struct sigaction action {};
  action.sa_handler = on_top_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = 0;  // no SA_RESTART: poll() returns EINTR
  // SIGQUIT (Ctrl-\) too: its default, a core dump, would leave the terminal raw.
  for (const int signal_number : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGWINCH}) {
    ::sigaction(signal_number, &action, nullptr);
  }
}

void drain_wake_pipe() {
  char buffer[64];
  while (g_wake_read >= 0 && ::read(g_wake_read, buffer, sizeof buffer) > 0) {
  }
}

// Sleeps until `deadline`, or returns false as soon as standard output reports an error or
// hang-up (a pipe whose reader exited reports POLLERR), so `top | head` ends at once even
// with a long interval, or a quitting signal comes. Terminals, files and /dev/null never
// report either.
bool sleep_unless_reader_gone(std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (g_top_quit != 0) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) return true;
    // stdout: no events asked, only POLLERR, POLLHUP, POLLNVAL come back.
    pollfd fds[2] = {{STDOUT_FILENO, 0, 0}, {g_wake_read, POLLIN, 0}};
    const int wait_ms =
        static_cast<int>(std::min<long long>(left.count() + 1, std::numeric_limits<int>::max()));
    const int n = ::poll(fds, g_wake_read >= 0 ? 2 : 1, wait_ms);
    if (n < 0 && errno == EINTR) continue;
    if (n > 0 && (fds[0].revents & (POLLERR | POLLHUP)) != 0) return false;
    if (n > 0 && (fds[1].revents & POLLIN) != 0) {
      drain_wake_pipe();
      continue;
    }
    if (n != 0) {  // POLLNVAL or a failed poll: sleep without watching
      std::this_thread::sleep_until(deadline);
      return true;
    }
  }
}

// ---- subcommand list ---------------------------------------------------------------

// "  name    description" for every subcommand, in the order they were added.
std::string subcommand_list(const CLI::App& app) {
  const auto subs = app.get_subcommands([](const CLI::App*) { return true; });
  std::size_t width = 0;
  for (const CLI::App* sub : subs) width = std::max(width, sub->get_name().size());
  std::string out;
  for (const CLI::App* sub : subs) {
    out += fmt::format("  {:<{}}  {}\n", sub->get_name(), width, sub->get_description());
  }
  return out;
}

// What `steptrace help` prints, and `steptrace` alone (to stderr, as a usage error).
std::string usage_overview(const CLI::App& app) {
  return "Usage: steptrace [--socket PATH] [--timeout SECONDS] SUBCOMMAND [OPTIONS]\n"
         "Ask steptraced, the steptrace trace collector, what the training processes on\n"
         "this machine are doing.\n\nSubcommands:\n" +
         subcommand_list(app) +
         "\nRun `steptrace help SUBCOMMAND...` for a subcommand's options, `steptrace --help`\n"
         "for the global ones: --socket PATH (default $STEPTRACE_SOCKET, else\n" +
         steptrace::proto::kDefaultSocketPath + "), --timeout SECONDS (default 10).\n" +
         kExitStatus;
}

int run_help(const CLI::App& app, const std::vector<std::string>& topic) {
  if (topic.empty()) return exit_status(write_stdout(usage_overview(app)));
  // `help ledger cleanup`: each word a subcommand of the one before.
  const CLI::App* at = &app;
  std::string path = "steptrace";
  for (const std::string& word : topic) {
    const CLI::App* next = nullptr;
    for (const CLI::App* sub : at->get_subcommands([](const CLI::App*) { return true; })) {
      if (sub->get_name() == word) next = sub;
    }
    if (next == nullptr) {
      if (at == &app) {
        std::fprintf(stderr, "steptrace: help: no subcommand '%s'; the subcommands are:\n%s",
                     word.c_str(), subcommand_list(app).c_str());
      } else {
        std::fprintf(stderr, "steptrace: help: `%s` has no subcommand '%s'; see `%s --help`\n",
                     path.c_str(), word.c_str(), path.c_str());
      }
      return kExitUsage;
    }
    path += " " + word;
    at = next;
  }
  return exit_status(write_stdout(at->help(path.substr(0, path.rfind(' ')))));
}

// ---- one command -------------------------------------------------------------------

// --last / --for: a SECONDS word the daemon takes for an option bounded by `max`
// (proto/commands.h: its grammar, in (0, max]).
CLI::Validator seconds_check(double max) {
  return CLI::Validator(
      [=](const std::string& text) -> std::string {
        if (steptrace::proto::parse_seconds(text, max)) return "";
        if (!steptrace::proto::parse_seconds(text)) {
          return fmt::format(
              "'{}' is not a number of seconds (digits with an optional fraction, at most {} "
              "characters: 30, 2.5)",
              text, steptrace::proto::kMaxSecondsText);
        }
        return fmt::format("{} s: must be more than 0 and at most {:g} s", text, max);
      },
      "");
}

// --pid: a pid as the daemon reads it (proto/commands.h: decimal, in [1, 2^31-1]),
// passed on in its plain decimal spelling (CLI11 alone would read 010 as octal 8).
CLI::Validator pid_check() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        const auto pid = steptrace::proto::parse_pid(text);
        if (!pid) {
          return fmt::format("'{}' is not a pid (a process id: decimal, {} to {})", text,
                             steptrace::proto::kMinPid, steptrace::proto::kMaxPid);
        }
        text = std::to_string(*pid);
        return "";
      },
      fmt::format("INT in [{} - {}]", steptrace::proto::kMinPid, steptrace::proto::kMaxPid));
}

// A number of seconds in [min, max] (--timeout, --interval), said the way the user wrote
// it when it is not one; CLI11's own range check says "Value abc not in range".
CLI::Validator seconds_range(double min, double max) {
  return CLI::Validator(
      [=](const std::string& text) -> std::string {
        double value = 0;
        std::size_t used = 0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !std::isfinite(value)) {
          return fmt::format("'{}' is not a number of seconds (e.g. 2 or 0.5)", text);
        }
        if (value < min || value > max) {
          return fmt::format("{} s is out of range: from {:g} to {:g} s", text, min, max);
        }
        return "";
      },
      fmt::format("[{:g} - {:g}]", min, max));
}

// `report --window N`'s bound (the daemon's, daemon/serve/commands.cpp: a day).
constexpr long long kMaxWindowS = 86400;

// A whole count in [0, max] (--iterations, --window; 0 means "not asked" for report's).
CLI::Validator count_range(long long max) {
  return CLI::Validator(
      [=](const std::string& text) -> std::string {
        long long value = -1;
        std::size_t used = 0;
        try {
          value = std::stoll(text, &used, 10);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size()) {
          return fmt::format("'{}' is not a whole number", text);
        }
        if (value < 0 || value > max) return fmt::format("{} is out of range: 0 to {}", text, max);
        return "";
      },
      fmt::format("[0 - {}]", max));
}

// The daemon's reply to `line`, or nullopt after saying on stderr why there is none
// (unreachable, no answer, or an `error:` reply).
std::optional<std::string> ask(const SocketPath& socket, const std::string& line,
                               std::chrono::milliseconds timeout) {
  auto result = steptrace::cli::run_command(socket.path, line, timeout);
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    write_line(stderr, steptrace::cli::describe_failure(*failure, socket, line, timeout));
    return std::nullopt;
  }
  std::string& reply = std::get<std::string>(result);
  if (reply.empty()) {
    write_line(stderr, "steptrace: steptraced at " + socket.path +
                           " closed the connection without answering `" + line + "`");
    return std::nullopt;
  }
  if (reply.rfind("error:", 0) == 0) {
    write_line(stderr, kDaemonAnswered + reply);
    return std::nullopt;
  }
  return std::move(reply);
}

int print_reply(std::string reply) {
  if (reply.empty() || reply.back() != '\n') reply += '\n';
  return exit_status(write_stdout(reply));
}

// Runs one command and prints its reply; returns the exit status.
int run_and_print(const SocketPath& socket, const std::string& line,
                  std::chrono::milliseconds timeout) {
  auto reply = ask(socket, line, timeout);
  return reply ? print_reply(std::move(*reply)) : kExitFailure;
}

// `report [--json] [--pid N] [--job [UID:]ID]`. The daemon answers a pid it does not
// track with an empty report, a job it cannot find with an error; for the CLI both are a
// failed lookup (exit 1), whichever form was asked for.
int run_report_filtered(const SocketPath& socket, int pid, const std::string& job, int window_s,
                        const std::string& rule_args, bool json,
                        std::chrono::milliseconds timeout) {
  std::string args = rule_args;
  if (pid > 0) args += " --pid " + std::to_string(pid);
  if (!job.empty()) args += " --job " + job;
  if (window_s > 0) args += " --window " + std::to_string(window_s);
  const std::string json_line = "report --json" + args;
  auto reply = ask(socket, json_line, timeout);
  if (!reply) return kExitFailure;
  const nlohmann::json report = nlohmann::json::parse(*reply, nullptr, /*allow_exceptions=*/false);
  const nlohmann::json* processes = nullptr;
  if (report.is_object()) {
    const auto it = report.find("processes");
    if (it != report.end() && it->is_array()) processes = &*it;
  }
  if (processes == nullptr) {
    write_line(stderr, "steptrace: steptraced at " + socket.path + " answered `" + json_line +
                           "` with something that is not a report");
    return kExitFailure;
  }
  if (processes->empty()) {
    std::string what = pid > 0 ? "no process with pid " + std::to_string(pid) : "no process";
    if (!job.empty()) what += " of job " + job;
    write_line(stderr, fmt::format("steptrace: steptraced at {} tracks {} "
                                   "(`steptrace report` lists those it does)",
                                   socket.path, what));
    return kExitFailure;
  }
  if (json) return print_reply(std::move(*reply));
  return run_and_print(socket, "report" + args, timeout);
}

int run_version(const SocketPath& socket, bool json, std::chrono::milliseconds timeout) {
  auto result = steptrace::cli::run_command(socket.path, "version", timeout);
  std::string problem;  // why there is no daemon version
  nlohmann::json daemon;
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    problem = steptrace::cli::describe_failure(*failure, socket, "version", timeout);
  } else {
    const std::string& reply = std::get<std::string>(result);
    if (reply.rfind("error:", 0) == 0) {
      problem = "steptrace: steptraced at " + socket.path + " answered `version` with " +
                reply.substr(0, reply.find('\n'));
    } else {
      daemon = nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
      if (!daemon.is_object()) {
        problem = "steptrace: steptraced at " + socket.path +
                  " answered `version` with something that is not a JSON object";
      }
    }
  }
  if (!problem.empty()) daemon = nullptr;

  std::string out;
  if (json) {
    const nlohmann::json doc = {{"cli", {{"version", STEPTRACE_VERSION_STRING}}},
                                {"socket", socket.path},
                                {"daemon", daemon}};
    // The daemon's strings come back as they were parsed: the JSON sanitiser again, so a
    // \u202e the daemon escaped is not written raw here.
    out = steptrace::proto::escape_unsafe_in_json(doc.dump()) + "\n";
  } else {
    out = "steptrace " STEPTRACE_VERSION_STRING " (CLI)";
    if (daemon.is_object()) {
      const auto field = [&](const char* key) {
        const auto it = daemon.find(key);
        if (it == daemon.end()) return std::string("?");
        return steptrace::proto::printable(it->is_string() ? it->get<std::string>() : it->dump());
      };
      out += "; steptraced " + field("version") + ", protocol " + field("protocol") + ", at " +
             socket.path;
    }
    out += "\n";
  }
  const Written written = write_stdout(out);
  if (!problem.empty()) {
    write_line(stderr, problem);
    return kExitFailure;
  }
  return exit_status(written);
}

// ---- top -----------------------------------------------------------------------------

std::string wall_clock() {
  const std::time_t now = std::time(nullptr);
  std::tm local{};
  localtime_r(&now, &local);
  return fmt::format("{:%H:%M:%S}", local);
}

// One refresh of `top`: the rendered screen, or an error line.
struct Frame {
  std::string text;
  bool ok = false;
};

// `report --json` as top asks it: with --job, the daemon picks the job (its rules for
// ID and UID:ID), and says so when there is none.
std::string top_report_line(const Options& options) {
  std::string line = "report --json";
  if (!options.job.empty()) line += " --job " + options.job;
  if (options.top_window_s > 0) line += " --window " + std::to_string(options.top_window_s);
  return line;
}

// The daemon's reply to `line` read as top's report, or the line that says why there is
// none (printable: it goes on the screen as it is).
std::variant<nlohmann::json, std::string> report_of(CommandResult result, const SocketPath& socket,
                                                    const std::string& line,
                                                    std::chrono::milliseconds timeout) {
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    return steptrace::cli::describe_failure(*failure, socket, line, timeout);
  }
  std::string& reply = std::get<std::string>(result);
  if (reply.rfind("error:", 0) == 0) {
    while (!reply.empty() && reply.back() == '\n') reply.pop_back();
    return kDaemonAnswered + steptrace::proto::printable(reply);
  }
  nlohmann::json report = nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (report.is_discarded() || !report.is_object()) {
    return "steptrace: steptraced at " + socket.path + " answered `" + line +
           "` with something that is not a JSON object";
  }
  return report;
}

// The daemon's report for top, or the line that says why there is none (blocking: for
// `top --once`, which a signal ends the default way).
std::variant<nlohmann::json, std::string> fetch_report(const SocketPath& socket,
                                                       const Options& options) {
  const std::string line = top_report_line(options);
  const auto timeout = to_ms(options.timeout_s);
  return report_of(steptrace::cli::run_command(socket.path, line, timeout), socket, line, timeout);
}

// fetch_report(), but nullopt as soon as a quitting signal comes (the wake pipe says so)
// instead of after the reply or the timeout: a stopped daemon does not hold Ctrl-C up.
std::optional<std::variant<nlohmann::json, std::string>> fetch_report_unless_quit(
    const SocketPath& socket, const Options& options) {
  const std::string line = top_report_line(options);
  const auto timeout = to_ms(options.timeout_s);
  steptrace::cli::PendingCommand pending(socket.path, line, timeout);
  while (!pending.done()) {
    if (g_top_quit != 0) return std::nullopt;
    pollfd fds[2] = {pending.poll_entry(), {g_wake_read, POLLIN, 0}};
    if (::poll(fds, 2, pending.poll_timeout_ms()) > 0 && (fds[1].revents & POLLIN) != 0) {
      drain_wake_pipe();
    }
    pending.advance();
  }
  if (g_top_quit != 0) return std::nullopt;
  return report_of(pending.take_result(), socket, line, timeout);
}

// nullopt: a quitting signal came first.
std::optional<Frame> top_frame(const SocketPath& socket, const Options& options, bool color) {
  auto fetching = fetch_report_unless_quit(socket, options);
  if (!fetching) return std::nullopt;
  auto& fetched = *fetching;
  if (auto* problem = std::get_if<std::string>(&fetched)) {
    return Frame{std::move(*problem), false};
  }
  steptrace::cli::TopStyle style;
  style.color = color;
  style.note = fmt::format("{}, every {:g} s, {}", wall_clock(), options.interval_s, socket.path);
  return Frame{steptrace::cli::render_top(std::get<nlohmann::json>(fetched), style), true};
}

// The terminal's size, or 0x0 when standard output is none (or does not say).
std::pair<std::size_t, std::size_t> terminal_size() {
  winsize size{};
  if (::ioctl(STDOUT_FILENO, TIOCGWINSZ, &size) != 0) return {0, 0};
  return {size.ws_col, size.ws_row};
}

steptrace::cli::TopSort parse_sort(const std::string& name) {
  if (name == "name") return steptrace::cli::TopSort::kName;
  if (name == "pid") return steptrace::cli::TopSort::kPid;
  return steptrace::cli::TopSort::kTime;
}

constexpr const char* kTopKeys =
    "q quit  t/n/p sort by time/name/pid  j next job  a all jobs  space refresh";

// `top --once`: one screen, for scripts: as wide as the terminal when it is one, every
// process and GPU; escape sequences only where use_ansi() allows them.
int run_top_once(const SocketPath& socket, const Options& options) {
  auto fetched = fetch_report(socket, options);
  if (const auto* problem = std::get_if<std::string>(&fetched)) {
    write_line(stderr, *problem);
    return kExitFailure;
  }
  steptrace::cli::TopScreen screen;
  screen.width = ::isatty(STDOUT_FILENO) == 1 ? terminal_size().first : 0;
  screen.sort = parse_sort(options.sort);
  screen.color = use_ansi();
  screen.note = fmt::format("{}, {}", wall_clock(), socket.path);
  std::string text;
  for (const std::string& line :
       steptrace::cli::render_top_screen(std::get<nlohmann::json>(fetched), screen)) {
    text += line + "\n";
  }
  return exit_status(write_stdout(text));
}

// `top` with a terminal on both ends: a screen that fits the terminal, redrawn in place
// at every refresh, on every key and on every resize; q, Ctrl-C (or SIGTERM, SIGHUP)
// end it with status 0. Without escape sequences (NO_COLOR, TERM=dumb) the screens
// follow each other as plain text, still fitted and still driven by the keys.
//
// One poll() waits for everything at once: the keys, the signals (the wake pipe), the
// refresh under way (PendingCommand: its socket and deadline) or the next one's time. So
// q and Ctrl-C quit at once while the daemon is slow to answer (stopped, or a big
// table), and the keys and resizes redraw the last report meanwhile. The terminal is
// in top's modes from the start (TerminalSession: keys at once, restored on every way
// out); the alternate screen only from the first report on, so that a first refresh
// that fails says why on the terminal the user sees (exit 1, like every subcommand).
int run_top_interactive(const SocketPath& socket, const Options& options, bool ansi) {
  steptrace::cli::TerminalSession session(STDIN_FILENO, stdout, ansi);
  // Only while the session lasts: elsewhere Ctrl-Z stops top the default way.
  struct sigaction suspend_action {};
  suspend_action.sa_handler = on_top_signal;
  sigemptyset(&suspend_action.sa_mask);
  ::sigaction(SIGTSTP, &suspend_action, nullptr);
  struct RestoreSuspend {
    ~RestoreSuspend() { ::signal(SIGTSTP, SIG_DFL); }
  } restore_suspend;

  std::optional<nlohmann::json> report;  // the last one received
  std::string problem;                   // the last refresh's failure, shown until one succeeds
  steptrace::cli::TopScreen screen;
  screen.sort = parse_sort(options.sort);
  screen.color = ansi;
  screen.keys = kTopKeys;
  int refreshes = 0;
  const std::string line = top_report_line(options);
  const auto timeout = to_ms(options.timeout_s);

  const auto draw = [&]() {
    session.show();
    const auto [width, height] = terminal_size();
    screen.width = width;
    screen.height = height;
    screen.note = problem.empty() ? fmt::format("{}, every {:g} s, {}", wall_clock(),
                                                options.interval_s, socket.path)
                                  : "retrying: " + problem;
    const std::vector<std::string> lines = steptrace::cli::render_top_screen(*report, screen);
    std::string text = ansi ? "\x1b[H" : "\n";
    for (std::size_t i = 0; i < lines.size(); ++i) {
      text += lines[i];
      // No line break after the last row: it would scroll the screen by one.
      if (ansi) text += i + 1 < lines.size() ? "\x1b[K\r\n" : "\x1b[K";
      if (!ansi) text += "\n";
    }
    if (ansi) text += "\x1b[J";  // rows below the last line, from a taller screen before
    return write_stdout(text);
  };

  std::optional<steptrace::cli::PendingCommand> pending;
  pending.emplace(socket.path, line, timeout);
  auto next = std::chrono::steady_clock::now();  // the next refresh, once this one is in
  bool redraw = false;
  for (;;) {
    if (g_top_quit != 0) return kExitOk;
    if (g_top_suspend != 0) {
      g_top_suspend = 0;
      session.suspend();
      redraw = true;  // the terminal may have been resized meanwhile, or drawn over
    }
    if (g_top_resized != 0) {
      g_top_resized = 0;
      redraw = true;
    }
    if (pending && pending->done()) {
      auto fetched = report_of(pending->take_result(), socket, line, timeout);
      pending.reset();
      ++refreshes;
      if (auto* fresh = std::get_if<nlohmann::json>(&fetched)) {
        report = std::move(*fresh);
        problem.clear();
      } else if (!report) {
        // Nothing to show yet: fail like every other subcommand, on the main screen.
        write_line(stderr, std::get<std::string>(fetched));
        return kExitFailure;
      } else {
        problem = std::get<std::string>(fetched);
      }
      next = std::chrono::steady_clock::now() + to_ms(options.interval_s);
      redraw = true;
    }
    if (redraw && report) {
      redraw = false;
      const Written written = draw();
      if (written != Written::kOk) return exit_status(written);
    }
    int wait_ms = 0;
    if (pending) {
      wait_ms = pending->poll_timeout_ms();
    } else {
      const auto left =
          std::chrono::ceil<std::chrono::milliseconds>(next - std::chrono::steady_clock::now());
      if (left.count() <= 0) {
        if (options.iterations > 0 && refreshes >= options.iterations) return kExitOk;
        pending.emplace(socket.path, line, timeout);
        continue;
      }
      wait_ms = static_cast<int>(std::min<long long>(left.count(), 60'000));
    }
    pollfd fds[3] = {{STDIN_FILENO, POLLIN, 0},
                     {g_wake_read, POLLIN, 0},
                     pending ? pending->poll_entry() : pollfd{-1, 0, 0}};
    const int n = ::poll(fds, 3, wait_ms);
    if (pending) pending->advance();  // its socket, its deadline
    if (n <= 0) continue;             // EINTR (a signal, seen at the top), or the time
    if ((fds[1].revents & POLLIN) != 0) drain_wake_pipe();
    if ((fds[0].revents & (POLLHUP | POLLERR | POLLNVAL)) != 0 && (fds[0].revents & POLLIN) == 0) {
      return kExitOk;  // the terminal is gone
    }
    if ((fds[0].revents & POLLIN) == 0) continue;
    char keys[64];
    const ssize_t got = ::read(STDIN_FILENO, keys, sizeof keys);
    if (got == 0) return kExitOk;  // end of input
    for (ssize_t i = 0; i < got; ++i) {
      switch (keys[i]) {
        case 27:  // an escape sequence (a function or arrow key, F2 is ESC O Q): not keys
          i = got;
          break;
        case 'q':
        case 'Q':
        case 3:  // Ctrl-C with ISIG off (some terminals' raw mode)
          return kExitOk;
        case 't':
          screen.sort = steptrace::cli::TopSort::kTime;
          break;
        case 'n':
          screen.sort = steptrace::cli::TopSort::kName;
          break;
        case 'p':
          screen.sort = steptrace::cli::TopSort::kPid;
          break;
        case 'j': {
          if (!report) continue;
          // all -> each job in turn -> all
          const std::vector<std::string> jobs = steptrace::cli::top_jobs(*report);
          const auto at = std::find(jobs.begin(), jobs.end(), screen.job);
          if (screen.job.empty()) {
            screen.job = jobs.empty() ? "" : jobs.front();
          } else if (at == jobs.end() || at + 1 == jobs.end()) {
            screen.job.clear();
          } else {
            screen.job = *(at + 1);
          }
          break;
        }
        case 'a':
          screen.job.clear();
          break;
        case ' ':
        case 'r':
          next = std::chrono::steady_clock::now();  // now, or when the one under way is in
          break;
        default:
          continue;  // other keys (arrows' escape sequences too) do nothing
      }
      redraw = true;
    }
  }
}

// top as it runs on a terminal or into a pipe, until q, a signal, --iterations or the
// reader's end. `top --once` is not this: see run_top().
int run_top_watching(const SocketPath& socket, const Options& options) {
  catch_top_signals();
  const bool ansi = use_ansi();
  if (::isatty(STDIN_FILENO) == 1 && ::isatty(STDOUT_FILENO) == 1) {
    return run_top_interactive(socket, options, ansi);
  }
  const auto interval = to_ms(options.interval_s);
  auto next = std::chrono::steady_clock::now();
  bool last_ok = false;
  for (int i = 0; options.iterations == 0 || i < options.iterations; ++i) {
    if (i > 0 && !sleep_unless_reader_gone(next)) return kExitOk;
    next = std::chrono::steady_clock::now() + interval;
    std::optional<Frame> fetched = top_frame(socket, options, ansi);
    if (!fetched) return kExitOk;  // Ctrl-C (or SIGTERM...) during the refresh
    Frame& frame = *fetched;
    if (!frame.ok && i == 0) {
      // Nothing to show yet: fail the way every other subcommand does.
      write_line(stderr, frame.text);
      return kExitFailure;
    }
    if (!frame.ok) frame.text += " (retrying)\n";
    last_ok = frame.ok;
    std::string screen;
    if (ansi) {
      screen = "\x1b[H\x1b[2J";  // home, clear screen
    } else if (i > 0) {
      screen = "\n";  // frames stay readable when piped or logged
    }
    screen += frame.text;
    const Written written = write_stdout(screen);
    if (written != Written::kOk) return exit_status(written);
  }
  return last_ok ? kExitOk : kExitFailure;
}

// `top --once` keeps the default signals: Ctrl-C ends it at once, even while the daemon
// is slow to answer, with the status of any interrupted command (130, by SIGINT; nothing
// printed). The watching top catches them to quit cleanly with 0. An exception is caught
// here so that the stack unwinds on its way out (one that no handler catches may end the
// program without unwinding), and with it TerminalSession, which restores the terminal.
int run_top(const SocketPath& socket, const Options& options) {
  try {
    if (options.once) return run_top_once(socket, options);
    return run_top_watching(socket, options);
  } catch (const std::exception& e) {
    write_line(stderr, std::string("steptrace: top: ") + e.what());
    return kExitFailure;
  }
}

// ---- the command line --------------------------------------------------------------
//
// Each subcommand is registered by its add_*() below (its options, their checks and its
// help), which also says how it runs; main() parses and runs the one given.

// What running a subcommand needs besides its own options.
struct Invocation {
  const CLI::App& app;
  const Options& options;
  const SocketPath& socket;
  std::chrono::milliseconds timeout;
};

struct Subcommand {
  CLI::App* app = nullptr;
  std::function<int(const Invocation&)> run;
};

// --socket, --timeout and --version, which come before or after the subcommand.
void add_global_options(CLI::App& app, Options& options) {
  app.footer(main_footer());
  app.fallthrough();  // global options may come after the subcommand too
  app.require_subcommand(1);
  app.set_version_flag("--version", "steptrace " STEPTRACE_VERSION_STRING,
                       "Print the CLI's version");
  app.add_option("--socket", options.socket_flag,
                 std::string("steptraced's socket (default: $STEPTRACE_SOCKET, else ") +
                     steptrace::proto::kDefaultSocketPath + ")")
      ->type_name("PATH");
  app.add_option("--timeout", options.timeout_s, "Seconds to wait for the daemon's reply")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(seconds_range(0.01, 3600.0));
}

// A subcommand that sends one fixed command, with " --json" when `json` is set.
Subcommand simple(CLI::App* sub, std::string command, const bool* json = nullptr) {
  return {sub, [command = std::move(command), json](const Invocation& in) {
            return run_and_print(
                in.socket, json != nullptr && *json ? command + " --json" : command, in.timeout);
          }};
}

Subcommand add_ping(CLI::App& app) {
  return simple(app.add_subcommand("ping", "Check that steptraced answers (prints pong)"), "ping");
}

// report --job [UID:]ID: what the daemon takes (proto/commands.h's grammar).
CLI::Validator job_id_check() {
  return CLI::Validator(
      [](const std::string& value) -> std::string {
        if (steptrace::proto::parse_job_option(value)) return {};
        return "a job is ID (yours) or UID:ID (that uid's); an ID has 1.." +
               std::to_string(steptrace::proto::kMaxNameLength) +
               " printable ASCII characters without spaces";
      },
      "[UID:]ID");
}

// " --compute A,B --overhead C" for report's rule options (proto/rule_steps.h's grammar,
// the daemon's), or why one is bad. Checked here, not by CLI11, so that a bad list is one
// line and exit 1 like the daemon's refusal of a list it cannot use (a step in both its
// default list and the other flag's).
std::variant<std::string, std::string> rule_args(const Options& o, bool compute_given,
                                                 bool overhead_given) {
  std::string args;
  std::vector<std::string> lists[2];
  const std::pair<const char*, const std::string*> flags[2] = {{"--compute", &o.compute},
                                                               {"--overhead", &o.overhead}};
  const bool given[2] = {compute_given, overhead_given};
  for (int i = 0; i < 2; ++i) {
    const auto& [name, text] = flags[i];
    if (!given[i]) continue;
    auto steps = steptrace::proto::parse_rule_steps(*text);
    if (const auto* why = std::get_if<std::string>(&steps)) {
      return std::variant<std::string, std::string>(
          std::in_place_index<1>, fmt::format("steptrace: report: {} {}: {}", name,
                                              steptrace::proto::printable(*text, 64), *why));
    }
    lists[i] = std::get<std::vector<std::string>>(steps);
    args += fmt::format(" {} {}", name, *text);
  }
  if (auto both = steptrace::proto::rule_steps_overlap(lists[0], lists[1])) {
    return std::variant<std::string, std::string>(
        std::in_place_index<1>,
        fmt::format("steptrace: report: step {} is in both --compute and --overhead", *both));
  }
  return std::variant<std::string, std::string>(std::in_place_index<0>, args);
}

Subcommand add_report(CLI::App& app, Options& options) {
  auto* report = app.add_subcommand(
      "report", "Time per step, for all processes and each one, then the VRAM ledger");
  report->footer(kReportFooter);
  report->add_flag("--json", options.json, "Machine-readable report (steptrace.report/v1)");
  report->add_option("--pid", options.pid, "Only this process")
      ->type_name("PID")
      ->transform(pid_check());
  report
      ->add_option("--job", options.job,
                   "Only the processes of your job with this id (STEPTRACE_JOB, "
                   "TORCHELASTIC_RUN_ID or SLURM_JOB_ID of the trainers); UID:ID: that uid's")
      ->type_name("[UID:]ID")
      ->check(job_id_check());
  report
      ->add_option("--window", options.window_s,
                   "Rank skew over the last N seconds too, beside the whole run (1..86400)")
      ->type_name("N")
      ->check(count_range(kMaxWindowS));
  auto* compute =
      report
          ->add_option("--compute", options.compute,
                       "The 50% rule's compute steps for this report, by name (default: the "
                       "daemon's config, Matmul)")
          ->type_name("STEP,...");
  auto* overhead =
      report
          ->add_option("--overhead", options.overhead,
                       "The 50% rule's CPU-overhead steps for this report (default: the daemon's "
                       "config, Transpose,Alloc)")
          ->type_name("STEP,...");
  return {report, [compute, overhead](const Invocation& in) {
            const Options& o = in.options;
            const auto rule = rule_args(o, compute->count() > 0, overhead->count() > 0);
            if (rule.index() == 1) {
              write_line(stderr, std::get<1>(rule));
              return kExitFailure;
            }
            const std::string& rule_words = std::get<0>(rule);
            if (o.pid > 0 || !o.job.empty()) {
              return run_report_filtered(in.socket, o.pid, o.job, o.window_s, rule_words, o.json,
                                         in.timeout);
            }
            std::string line = o.json ? "report --json" : "report";
            if (o.window_s > 0) line += " --window " + std::to_string(o.window_s);
            line += rule_words;
            return run_and_print(in.socket, line, in.timeout);
          }};
}

// `ledger cleanup GPU ID`.
int run_ledger_cleanup(const Invocation& in) {
  const Options& o = in.options;
  if (o.json) {
    std::fprintf(stderr, "steptrace: ledger cleanup: --json does not apply\n");
    return kExitUsage;
  }
  // One word each: the daemon refuses the rest by name.
  for (const std::string* word : {&o.gpu, &o.reservation}) {
    if (word->empty() || word->find_first_of(" \t\r\n") != std::string::npos) {
      std::fprintf(stderr, "steptrace: ledger cleanup: GPU and ID have no blanks\n");
      return kExitUsage;
    }
  }
  return run_and_print(in.socket, "ledger cleanup " + o.gpu + " " + o.reservation, in.timeout);
}

Subcommand add_ledger(CLI::App& app, Options& options) {
  auto* ledger =
      app.add_subcommand("ledger", "Who holds VRAM on each GPU; leaked reservations are marked");
  ledger->add_flag("--json", options.json, "As JSON");
  auto* cleanup = ledger->add_subcommand(
      "cleanup",
      "Remove a reservation, credited to you: root, the holder's uid, or anyone once it is "
      "LEAKED or EXPIRED");
  cleanup->add_option("GPU", options.gpu, "The GPU's UUID, as `steptrace ledger` shows it")
      ->required();
  cleanup->add_option("ID", options.reservation, "The reservation id")->required();
  return {ledger, [ledger, cleanup](const Invocation& in) {
            if (ledger->got_subcommand(cleanup)) return run_ledger_cleanup(in);
            return run_and_print(in.socket, in.options.json ? "ledger --json" : "ledger",
                                 in.timeout);
          }};
}

Subcommand add_stats(CLI::App& app, Options& options) {
  auto* stats = app.add_subcommand(
      "stats", "The daemon's own counters: events, connections, errors, limits hit");
  stats->add_flag("--json", options.json, "As JSON");
  return simple(stats, "stats", &options.json);
}

Subcommand add_metrics(CLI::App& app) {
  return simple(
      app.add_subcommand("metrics", "Everything in the Prometheus text exposition format"),
      "metrics");
}

Subcommand add_reset(CLI::App& app, Options& options) {
  auto* reset = app.add_subcommand(
      "reset", "Clear step aggregates or the VRAM ledger view (root or the daemon's user)");
  reset->footer(kResetFooter);
  auto* pid = reset->add_option("--pid", options.pid, "Only this process's aggregates")
                  ->type_name("PID")
                  ->transform(pid_check());
  auto* ledger = reset->add_flag(
      "--ledger", options.ledger,
      "Clear every GPU of the ledger view (reservations, rows, samples), not the aggregates");
  auto* gpu = reset->add_option("--gpu", options.gpu, "Clear this GPU from the ledger view")
                  ->type_name("UUID");
  pid->excludes(ledger)->excludes(gpu);
  ledger->excludes(gpu);
  return {reset, [gpu](const Invocation& in) {
            const Options& o = in.options;
            if (o.ledger) return run_and_print(in.socket, "reset --ledger", in.timeout);
            if (gpu->count() > 0) {
              // One word on the command line: the daemon refuses an empty or spaced one by name.
              if (o.gpu.empty() || o.gpu.find_first_of(" \t\r\n") != std::string::npos) {
                std::fprintf(stderr,
                             "steptrace: reset --gpu: a GPU UUID has no blanks and is not empty\n");
                return kExitUsage;
              }
              return run_and_print(in.socket, "reset --gpu " + o.gpu, in.timeout);
            }
            const std::string pid_arg = o.pid > 0 ? " --pid " + std::to_string(o.pid) : "";
            return run_and_print(in.socket, "reset" + pid_arg, in.timeout);
          }};
}

Subcommand add_version(CLI::App& app, Options& options) {
  auto* version = app.add_subcommand("version", "Versions of this CLI and of the running daemon");
  version->footer(kVersionFooter);
  version->add_flag("--json", options.json, "As JSON");
  return {version,
          [](const Invocation& in) { return run_version(in.socket, in.options.json, in.timeout); }};
}

Subcommand add_top(CLI::App& app, Options& options) {
  auto* top = app.add_subcommand(
      "top", "Live view: what each process does now, who waits for VRAM, the ledger");
  top->footer(kTopFooter);
  top->add_option("--interval", options.interval_s, "Seconds between refreshes")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(seconds_range(0.05, 3600.0));
  top->add_option("--iterations", options.iterations, "Exit after N refreshes (0: run until ^C)")
      ->type_name("N")
      ->capture_default_str()
      ->check(count_range(1 << 30));
  top->add_flag("--once", options.once,
                "Print one screen and exit (for scripts: no escape codes unless on a terminal)");
  top->add_option("--sort", options.sort, "Order of the processes: time (busiest first), name, pid")
      ->type_name("KEY")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](const std::string& key) -> std::string {
            if (key == "time" || key == "name" || key == "pid") return "";
            return "'" + key + "' is not a sort key: time, name or pid";
          },
          "{time,name,pid}"));
  top->add_option("--job", options.job,
                  "Only the processes of your job with this id; UID:ID: that uid's")
      ->type_name("[UID:]ID")
      ->check(job_id_check());
  top->add_option("--window", options.top_window_s,
                  "Stragglers over the last N seconds (0: over the whole run only)")
      ->type_name("N")
      ->capture_default_str()
      ->check(count_range(kMaxWindowS));
  return {top, [](const Invocation& in) { return run_top(in.socket, in.options); }};
}

// `trace`: what CLI11 cannot check, then the trace itself; or `trace merge`.
int run_trace_subcommand(const Invocation& in, const CLI::Option& output, const CLI::App& merge) {
  if (merge.parsed()) return steptrace::cli::run_trace_merge(in.options.trace_merge);
  const steptrace::cli::TraceRequest& request = in.options.trace;
  if (request.children && request.pids.empty()) {
    std::fprintf(stderr,
                 "steptrace: trace: --children takes the workers of each --pid along; "
                 "name one with --pid\n");
    return kExitUsage;
  }
  if (request.pids.size() > steptrace::proto::kMaxTracePids) {
    std::fprintf(stderr, "steptrace: trace: at most %zu --pid options, not %zu\n",
                 steptrace::proto::kMaxTracePids, request.pids.size());
    return kExitUsage;
  }
  if (request.output.empty() && output.count() > 0) {
    std::fprintf(stderr, "steptrace: trace: -o wants a file name, or - for standard output\n");
    return kExitUsage;
  }
  return steptrace::cli::run_trace(in.socket, request, in.timeout);
}

Subcommand add_trace(CLI::App& app, Options& options) {
  steptrace::cli::TraceRequest& request = options.trace;
  auto* trace = app.add_subcommand(
      "trace", "Save a timeline (Chrome trace JSON) for ui.perfetto.dev or speedscope");
  trace->footer(kTraceFooter);
  trace
      ->add_option("--pid", request.pids,
                   "Only this process (repeat for more, at most " +
                       std::to_string(steptrace::proto::kMaxTracePids) + ")")
      ->type_name("PID")
      ->transform(pid_check())
      ->allow_extra_args(false);
  trace
      ->add_option("--job", request.job,
                   "Every process of job ID (yours) or UID:ID on this node, ranks and workers")
      ->type_name("[UID:]ID")
      ->check(CLI::Validator(
          [](const std::string& value) -> std::string {
            if (steptrace::proto::parse_job_option(value)) return {};
            return "'" + value + "' is not a job id (ID or UID:ID)";
          },
          ""));
  trace->add_flag("--children", request.children,
                  "With --pid: the processes it forked (its workers) too");
  trace
      ->add_option("--max-mb", request.max_mb,
                   "Refuse a trace larger than this many MB (0: no bound); viewers struggle "
                   "past it")
      ->type_name("MB")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 30));
  auto* last =
      trace
          ->add_option(
              "--last", request.last,
              fmt::format("Only the last SECONDS of the window (e.g. 30 or 2.5; at most {:g})",
                          steptrace::proto::kMaxTraceLastSeconds))
          ->type_name("SECONDS")
          ->check(seconds_check(steptrace::proto::kMaxTraceLastSeconds));
  auto* for_s =
      trace
          ->add_option(
              "--for", request.for_s,
              fmt::format("Record from now for SECONDS (at most {:g}), then save that capture",
                          steptrace::proto::kMaxTraceForSeconds))
          ->type_name("SECONDS")
          ->check(seconds_check(steptrace::proto::kMaxTraceForSeconds));
  last->excludes(for_s);
  auto* output = trace
                     ->add_option("-o,--output", request.output,
                                  "Write to FILE (- for standard output) instead of "
                                  "steptrace-trace-HOST-YYYYmmdd-HHMMSS.json")
                     ->type_name("FILE");
  trace->add_flag("--force", request.force, "Replace FILE if it exists");

  steptrace::cli::MergeRequest& merge_request = options.trace_merge;
  auto* merge = trace->add_subcommand(
      "merge",
      "Join the traces of several nodes into one timeline: merge A.json B.json -o JOB.json");
  merge->footer(kTraceMergeFooter);
  merge->add_option("files", merge_request.inputs, "The nodes' trace files")
      ->type_name("FILE")
      ->required()
      ->check(CLI::ExistingFile);
  merge->add_option("-o,--output", merge_request.output, "The merged file (- for standard output)")
      ->type_name("FILE")
      ->required();
  merge
      ->add_option("--align-step", merge_request.align_step,
                   "Align the files on step NAME instead of their wall clocks: the median "
                   "over each file's ranks of their K-th span's start (K from 1)")
      ->type_name("NAME[:K]");
  merge
      ->add_option("--max-mb", merge_request.max_mb,
                   "Refuse a merged trace larger than this many MB (0: no bound); viewers "
                   "struggle past it")
      ->type_name("MB")
      ->capture_default_str()
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 30));
  merge->add_flag("--force", merge_request.force, "Replace FILE if it exists");
  return {trace, [output, merge](const Invocation& in) {
            return run_trace_subcommand(in, *output, *merge);
          }};
}

Subcommand add_help(CLI::App& app, Options& options) {
  auto* help =
      app.add_subcommand("help", "This list, or one subcommand's options: help SUBCOMMAND");
  help->add_option("subcommand", options.help_topic,
                   "The subcommand to describe (with its own: help ledger cleanup)")
      ->type_name("SUBCOMMAND");
  return {help, [](const Invocation& in) { return run_help(in.app, in.options.help_topic); }};
}

// Every subcommand, in the order `steptrace help` lists them. One line each there; the
// details go in each one's footer.
std::vector<Subcommand> add_subcommands(CLI::App& app, Options& options) {
  std::vector<Subcommand> all;
  all.push_back(add_ping(app));
  all.push_back(add_report(app, options));
  all.push_back(add_ledger(app, options));
  all.push_back(add_stats(app, options));
  all.push_back(add_metrics(app));
  all.push_back(add_reset(app, options));
  all.push_back(add_version(app, options));
  all.push_back(add_top(app, options));
  all.push_back(add_trace(app, options));
  all.push_back(add_help(app, options));
  return all;
}

// Parses the command line; an exit status when there is nothing to run (--help,
// --version, bad usage: said on stdout or stderr), nullopt to run the subcommand given.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr && app.get_subcommands().empty()) {
      if (app.remaining_size() == 0) {
        // No subcommand at all: the list, as a usage error.
        std::fputs(usage_overview(app).c_str(), stderr);
        return kExitUsage;
      }
      // CLI11 would say "a subcommand is required" for a misspelt one, or for an unknown
      // option before the subcommand; name it instead.
      const std::string word = app.remaining().front();
      std::fprintf(stderr,
                   "steptrace: unknown %s '%s'; run `steptrace help` for the subcommands, "
                   "`steptrace --help` for the global options\n",
                   word.rfind('-', 0) == 0 ? "option" : "subcommand", word.c_str());
      return kExitUsage;
    }
    const int code = app.exit(e);  // prints help/version to stdout, errors to stderr
    return code == 0 ? kExitOk : kExitUsage;
  }
  return std::nullopt;
}

}  // namespace

int main(int argc, char** argv) {
  // A daemon that goes away mid-reply must give an error, not kill us with SIGPIPE; a
  // reader of our output that goes away shows as EPIPE (see write_stdout).
  ::signal(SIGPIPE, SIG_IGN);

  Options options;
  CLI::App app{kDescription, "steptrace"};
  add_global_options(app, options);
  const std::vector<Subcommand> subcommands = add_subcommands(app, options);
  if (const std::optional<int> status = parse_command_line(app, argc, argv)) return *status;

  const SocketPath socket = steptrace::cli::resolve_socket_path(options.socket_flag);
  const Invocation invocation{app, options, socket, to_ms(options.timeout_s)};
  for (const Subcommand& sub : subcommands) {
    if (app.got_subcommand(sub.app)) return sub.run(invocation);
  }
  return kExitUsage;  // unreachable: require_subcommand(1)
}
