// steptrace: the command-line client of steptraced.
//
// Each subcommand is one of the daemon's text commands: the CLI resolves the socket path
// (--socket, else $STEPTRACE_SOCKET, else the default), sends the command over one Unix
// stream connection (cli/control_client.h) and prints the reply. `top` polls
// `report --json` and renders it (cli/top_view.h); `trace` streams the daemon's timeline
// to a file (cli/trace_command.h). Exit status: 0 success, 1 the daemon could not be
// reached or answered with an error, 2 bad usage.
#include <fmt/chrono.h>
#include <fmt/format.h>
#include <signal.h>
#include <steptrace/steptrace.h>
#include <steptrace/version.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <variant>

#include "cli/control_client.h"
#include "cli/top_view.h"
#include "cli/trace_command.h"

namespace {

using steptrace::cli::CommandFailure;
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

constexpr const char* kFooter =
    "Socket: --socket PATH, else $STEPTRACE_SOCKET, else " STEPTRACE_DEFAULT_SOCKET
    ".\nIf the daemon is not running: systemctl start steptraced.socket\n"
    "Exit status: 0 ok, 1 daemon unreachable or answered an error, 2 bad usage.\n"
    "Run `steptrace SUBCOMMAND --help` for a subcommand's options.\n";

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
    "Open it in https://ui.perfetto.dev (\"Open trace file\"), chrome://tracing (\"Load\") or\n"
    "Speedscope (https://www.speedscope.app): a track per process, named `comm [pid]`, and\n"
    "per thread, with the spans as slices named after their steps.\n"
    "\n"
    "Examples:\n"
    "  steptrace trace                                    everything in the window now\n"
    "  steptrace trace --pid 4242 --last 10 -o step.json  one process, the last 10 s\n"
    "  steptrace trace --for 30                           record the next 30 s\n"
    "\n"
    "Exit status: 0 written, 1 daemon unreachable, error reply or write failure, 2 bad usage\n"
    "or FILE exists.\n";

struct Options {
  std::string socket_flag;
  double timeout_s = 10.0;
  bool json = false;
  int pid = 0;
  double interval_s = 1.0;
  int iterations = 0;
  bool ledger = false;  // reset --ledger
  std::string gpu;      // reset --gpu UUID
};

std::chrono::milliseconds to_ms(double seconds) {
  return std::chrono::milliseconds(static_cast<long long>(std::llround(seconds * 1000.0)));
}

void write_line(std::FILE* out, const std::string& text) {
  std::fputs(text.c_str(), out);
  if (text.empty() || text.back() != '\n') std::fputc('\n', out);
  std::fflush(out);
}

// --last / --for: a number of seconds the daemon's grammar takes, in (min, max] or, with
// `min_inclusive`, [min, max].
CLI::Validator seconds_check(double min, bool min_inclusive, double max) {
  return CLI::Validator(
      [=](const std::string& text) -> std::string {
        const auto value = steptrace::cli::parse_seconds(text);
        if (!value) {
          return "'" + text +
                 "' is not a number of seconds (digits with an optional fraction: 30, 2.5)";
        }
        const bool above_min = min_inclusive ? *value >= min : *value > min;
        if (above_min && *value <= max) return "";
        if (max == std::numeric_limits<double>::infinity()) {
          return fmt::format("{} s: must be more than {:g} s", text, min);
        }
        return fmt::format("{} s: must be from {:g} to {:g} s", text, min, max);
      },
      "");
}

// Runs one command and prints its reply; returns the exit status.
int run_and_print(const SocketPath& socket, const std::string& line,
                  std::chrono::milliseconds timeout) {
  auto result = steptrace::cli::run_command(socket.path, line, timeout);
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    write_line(stderr, steptrace::cli::describe_failure(*failure, socket, line, timeout));
    return kExitFailure;
  }
  const std::string& reply = std::get<std::string>(result);
  if (reply.empty()) {
    write_line(stderr, "steptrace: steptraced at " + socket.path +
                           " closed the connection without answering `" + line + "`");
    return kExitFailure;
  }
  if (reply.rfind("error:", 0) == 0) {
    write_line(stderr, reply);
    return kExitFailure;
  }
  std::fputs(reply.c_str(), stdout);
  if (reply.back() != '\n') std::fputc('\n', stdout);
  return std::fflush(stdout) == 0 ? kExitOk : kExitFailure;
}

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

Frame top_frame(const SocketPath& socket, const Options& options, bool color) {
  const std::string line = "report --json";
  const auto timeout = to_ms(options.timeout_s);
  auto result = steptrace::cli::run_command(socket.path, line, timeout);
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    return {steptrace::cli::describe_failure(*failure, socket, line, timeout), false};
  }
  const std::string& reply = std::get<std::string>(result);
  if (reply.rfind("error:", 0) == 0) return {"steptrace: steptraced answered: " + reply, false};
  const nlohmann::json report = nlohmann::json::parse(reply, nullptr, /*allow_exceptions=*/false);
  if (report.is_discarded() || !report.is_object()) {
    return {"steptrace: steptraced at " + socket.path +
                " answered `report --json` with something that is not a JSON object",
            false};
  }
  steptrace::cli::TopStyle style;
  style.color = color;
  style.note = fmt::format("{}, every {:g} s, {}", wall_clock(), options.interval_s, socket.path);
  return {steptrace::cli::render_top(report, style), true};
}

int run_top(const SocketPath& socket, const Options& options) {
  const bool tty = ::isatty(STDOUT_FILENO) == 1;
  const auto interval = to_ms(options.interval_s);
  auto next = std::chrono::steady_clock::now();
  bool last_ok = false;
  for (int i = 0; options.iterations == 0 || i < options.iterations; ++i) {
    if (i > 0) std::this_thread::sleep_until(next);
    next = std::chrono::steady_clock::now() + interval;
    Frame frame = top_frame(socket, options, tty);
    if (!frame.ok && i == 0) {
      // Nothing to show yet: fail the way every other subcommand does.
      write_line(stderr, frame.text);
      return kExitFailure;
    }
    if (!frame.ok) frame.text += " (retrying)\n";
    last_ok = frame.ok;
    if (tty) {
      std::fputs("\x1b[H\x1b[2J", stdout);  // home, clear screen
    } else if (i > 0) {
      std::fputs("\n", stdout);  // frames stay readable when piped or logged
    }
    std::fputs(frame.text.c_str(), stdout);
    std::fflush(stdout);
  }
  return last_ok ? kExitOk : kExitFailure;
}

}  // namespace

int main(int argc, char** argv) {
  // A daemon that goes away mid-reply must give an error, not kill us with SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);

  Options options;
  CLI::App app{kDescription, "steptrace"};
  app.footer(kFooter);
  app.fallthrough();  // global options may come after the subcommand too
  app.require_subcommand(1);
  app.set_version_flag("--version", "steptrace " STEPTRACE_VERSION_STRING,
                       "Print the CLI's version");
  app.add_option("--socket", options.socket_flag,
                 "steptraced's socket (default: $STEPTRACE_SOCKET, else " STEPTRACE_DEFAULT_SOCKET
                 ")")
      ->type_name("PATH");
  app.add_option("--timeout", options.timeout_s, "Seconds to wait for the daemon's reply")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(CLI::Range(0.01, 3600.0));

  auto* ping = app.add_subcommand("ping", "Check that steptraced answers (prints pong)");
  auto* report = app.add_subcommand(
      "report", "Time per step for all processes and for each one, then the VRAM ledger");
  report->add_flag("--json", options.json, "Machine-readable report (steptrace.report/v1)");
  report->add_option("--pid", options.pid, "Only this process")
      ->type_name("PID")
      ->check(CLI::Range(1, 1 << 30));
  auto* ledger =
      app.add_subcommand("ledger", "Who holds VRAM on each GPU; leaked reservations are marked");
  ledger->add_flag("--json", options.json, "As JSON");
  auto* stats = app.add_subcommand(
      "stats", "The daemon's own counters: events, connections, protocol errors, limits hit");
  stats->add_flag("--json", options.json, "As JSON");
  auto* metrics =
      app.add_subcommand("metrics", "Everything in the Prometheus text exposition format");
  auto* reset = app.add_subcommand(
      "reset",
      "Clear the step aggregates (all, or one process's), or the VRAM ledger view (--ledger: "
      "every GPU, --gpu: one); root or the daemon's user only");
  auto* reset_pid = reset->add_option("--pid", options.pid, "Only this process's aggregates")
                        ->type_name("PID")
                        ->check(CLI::Range(1, 1 << 30));
  auto* reset_ledger = reset->add_flag(
      "--ledger", options.ledger,
      "Clear every GPU of the ledger view (reservations, rows, samples), not the aggregates");
  auto* reset_gpu = reset->add_option("--gpu", options.gpu, "Clear this GPU from the ledger view")
                        ->type_name("UUID");
  reset_pid->excludes(reset_ledger)->excludes(reset_gpu);
  reset_ledger->excludes(reset_gpu);
  auto* version = app.add_subcommand("version", "Versions of this CLI and of the running daemon");
  auto* top = app.add_subcommand(
      "top",
      "Live view: what each process is doing right now (WAITING FOR VRAM stands out), its step "
      "totals, and the VRAM ledger");
  top->add_option("--interval", options.interval_s, "Seconds between refreshes")
      ->type_name("SECONDS")
      ->capture_default_str()
      ->check(CLI::Range(0.05, 3600.0));
  top->add_option("--iterations", options.iterations, "Exit after N refreshes (0: run until ^C)")
      ->type_name("N")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 30));
  steptrace::cli::TraceRequest trace_request;
  auto* trace = app.add_subcommand(
      "trace",
      "Save a timeline (Chrome trace JSON) of recent spans, VRAM-ledger operations and drops, "
      "for https://ui.perfetto.dev or chrome://tracing");
  trace->footer(kTraceFooter);
  trace
      ->add_option("--pid", trace_request.pids,
                   "Only this process (repeat for more, at most " +
                       std::to_string(steptrace::cli::kMaxTracePids) + ")")
      ->type_name("PID")
      ->check(CLI::Range(1, 1 << 30))
      ->allow_extra_args(false);
  auto* trace_last =
      trace
          ->add_option("--last", trace_request.last,
                       "Only the last SECONDS of the window (e.g. 30 or 2.5)")
          ->type_name("SECONDS")
          ->check(seconds_check(0.0, false, std::numeric_limits<double>::infinity()));
  auto* trace_for =
      trace
          ->add_option("--for", trace_request.for_s,
                       "Record from now for SECONDS (1 to 3600), then save that capture")
          ->type_name("SECONDS")
          ->check(
              seconds_check(steptrace::cli::kMinForSeconds, true, steptrace::cli::kMaxForSeconds));
  trace_last->excludes(trace_for);
  trace
      ->add_option("-o,--output", trace_request.output,
                   "Write to FILE (- for standard output) instead of "
                   "steptrace-trace-HOST-YYYYmmdd-HHMMSS.json")
      ->type_name("FILE");
  trace->add_flag("--force", trace_request.force, "Replace FILE if it exists");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (dynamic_cast<const CLI::RequiredError*>(&e) != nullptr && app.remaining_size() > 0 &&
        app.remaining().front().rfind('-', 0) != 0) {
      // CLI11 would say "a subcommand is required" for a misspelt one; name it instead.
      std::fprintf(stderr,
                   "steptrace: unknown subcommand '%s'\nRun with --help for more information.\n",
                   app.remaining().front().c_str());
      return kExitUsage;
    }
    const int code = app.exit(e);  // prints help/version to stdout, errors to stderr
    return code == 0 ? kExitOk : kExitUsage;
  }

  const SocketPath socket = steptrace::cli::resolve_socket_path(options.socket_flag);
  const auto timeout = to_ms(options.timeout_s);
  const std::string pid_arg = options.pid > 0 ? " --pid " + std::to_string(options.pid) : "";
  const std::string json_arg = options.json ? " --json" : "";

  if (app.got_subcommand(ping)) return run_and_print(socket, "ping", timeout);
  if (app.got_subcommand(report))
    return run_and_print(socket, "report" + json_arg + pid_arg, timeout);
  if (app.got_subcommand(ledger)) return run_and_print(socket, "ledger" + json_arg, timeout);
  if (app.got_subcommand(stats)) return run_and_print(socket, "stats" + json_arg, timeout);
  if (app.got_subcommand(metrics)) return run_and_print(socket, "metrics", timeout);
  if (app.got_subcommand(reset)) {
    if (options.ledger) return run_and_print(socket, "reset --ledger", timeout);
    if (reset_gpu->count() > 0) {
      // One word on the command line: the daemon refuses an empty or spaced one by name.
      if (options.gpu.empty() || options.gpu.find_first_of(" \t\r\n") != std::string::npos) {
        std::fprintf(stderr, "steptrace: reset --gpu: a GPU UUID has no blanks and is not empty\n");
        return kExitUsage;
      }
      return run_and_print(socket, "reset --gpu " + options.gpu, timeout);
    }
    return run_and_print(socket, "reset" + pid_arg, timeout);
  }
  if (app.got_subcommand(version)) {
    std::printf("steptrace %s (CLI)\n", STEPTRACE_VERSION_STRING);
    std::fflush(stdout);
    return run_and_print(socket, "version", timeout);
  }
  if (app.got_subcommand(top)) return run_top(socket, options);
  if (app.got_subcommand(trace)) {
    if (trace_request.pids.size() > steptrace::cli::kMaxTracePids) {
      std::fprintf(stderr, "steptrace: trace: at most %zu --pid options, not %zu\n",
                   steptrace::cli::kMaxTracePids, trace_request.pids.size());
      return kExitUsage;
    }
    if (trace_request.output.empty() && trace->get_option("--output")->count() > 0) {
      std::fprintf(stderr, "steptrace: trace: -o wants a file name, or - for standard output\n");
      return kExitUsage;
    }
    return steptrace::cli::run_trace(socket, trace_request, timeout);
  }
  return kExitUsage;  // unreachable: require_subcommand(1)
}
