// Integration tests of the steptrace CLI: the real binary (fork/exec) against the real
// steptraced on a temporary socket, with sim_trainer and the C example as real traced
// processes.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <termios.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/daemon_process.h"

namespace {

using nlohmann::json;
using steptrace::testing::DaemonProcess;
using steptrace::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::MatchesRegex;
using ::testing::Not;
using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kGiB = 1024ULL * 1024 * 1024;

struct Output {
  int status = -1;  // exit status, 128+signal, -1 on timeout
  std::string out;
  std::string err;
};

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// In a forked child: sets (NAME=VALUE) or unsets (NAME) the variables of `env`, then
// execs argv; never returns (127 when exec fails).
[[noreturn]] void exec_child(std::vector<std::string>& argv, const std::vector<std::string>& env) {
  // The CLI starts with the signals a shell gives a foreground command, whatever the
  // test runner's were (a runner started in the background may ignore SIGINT).
  ::signal(SIGINT, SIG_DFL);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (const auto& e : env) {
    const auto eq = e.find('=');
    if (eq == std::string::npos) {
      ::unsetenv(e.c_str());
    } else {
      ::setenv(e.substr(0, eq).c_str(), e.substr(eq + 1).c_str(), 1);
    }
  }
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  ::execv(args[0], args.data());
  std::_Exit(127);
}

// fork/exec argv with stdout and stderr captured in files of `dir`; `env` entries
// ("NAME=value", or "NAME" alone to unset) adjust this process's environment.
Output run(const TempDir& dir, std::vector<std::string> argv,
           const std::vector<std::string>& env = {}, int timeout_ms = 60000) {
  static int counter = 0;
  const std::string base = dir.file("run" + std::to_string(++counter));
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open((base + ".out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open((base + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0) std::_Exit(126);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    exec_child(argv, env);
  }
  Output result;
  result.status = steptrace::testing::wait_process(pid, timeout_ms);
  if (result.status < 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  result.out = read_file(base + ".out");
  result.err = read_file(base + ".err");
  return result;
}

// fork/exec argv with standard output on `out_fd` and standard error in `err_path`; the
// child's pid (or -1).
pid_t spawn_with_stdout(std::vector<std::string> argv, int out_fd, const std::string& err_path,
                        const std::vector<std::string>& env = {}) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (err < 0 || ::dup2(out_fd, STDOUT_FILENO) < 0) std::_Exit(126);
    ::dup2(err, STDERR_FILENO);
    exec_child(argv, env);
  }
  return pid;
}

// Like run(), but standard output is a new pseudo-terminal, so the CLI sees a terminal
// (isatty); `out` is what the terminal received (line ends as "\r\n").
Output run_on_terminal(const TempDir& dir, std::vector<std::string> argv,
                       const std::vector<std::string>& env = {}, int timeout_ms = 20000) {
  static int counter = 0;
  const std::string err_path = dir.file("tty" + std::to_string(++counter) + ".err");
  Output result;
  const int master = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (master < 0 || ::grantpt(master) != 0 || ::unlockpt(master) != 0) return result;
  // The test keeps a descriptor of the terminal open itself, so the master stays
  // readable (no EIO) until everything the child wrote has been read.
  const int slave = ::open(::ptsname(master), O_RDWR | O_NOCTTY | O_CLOEXEC);
  if (slave < 0) {
    ::close(master);
    return result;
  }
  const pid_t pid = spawn_with_stdout(std::move(argv), slave, err_path, env);
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  bool exited = false;
  for (;;) {
    pollfd in{master, POLLIN, 0};
    if (::poll(&in, 1, 50) > 0 && (in.revents & POLLIN) != 0) {
      char buffer[4096];
      const ssize_t n = ::read(master, buffer, sizeof buffer);
      if (n > 0) {
        result.out.append(buffer, static_cast<std::size_t>(n));
        continue;
      }
    }
    if (exited) break;  // exited, and nothing more to read
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      exited = true;
      result.status = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    } else if (Clock::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
      break;
    }
  }
  ::close(slave);
  ::close(master);
  result.err = read_file(err_path);
  return result;
}

std::size_t count_lines(const std::string& text) {
  std::size_t n = 0;
  for (char c : text) n += c == '\n';
  return n;
}

// ---------------------------------------------------------------------------------
// Without a daemon

TEST(CliNoDaemon, UnreachableSocketExitsOneNamingThePath) {
  TempDir dir;
  const std::string socket = dir.file("absent.sock");
  const Output r = run(dir, {STEPTRACE_CLI_BIN, "--socket", socket, "ping"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr(socket));
  EXPECT_THAT(r.err, HasSubstr("no such file"));
  EXPECT_THAT(r.err, HasSubstr("systemctl start steptraced.socket"));
  EXPECT_EQ(count_lines(r.err), 1u) << r.err;
}

// A --socket that is no socket at all is named as such, not as "Connection refused"
// (what connect() says for a regular file and a directory alike).
TEST(CliNoDaemon, ASocketPathThatIsNoSocketIsNamedForWhatItIs) {
  TempDir dir;
  const std::string file = dir.file("plain-file");
  { std::ofstream(file) << "not a socket\n"; }
  const std::vector<std::pair<std::string, std::string>> cases = {
      {file, "not a socket (" + file + " is a regular file)"},
      {dir.path(), "not a socket (" + dir.path() + " is a directory)"},
      {dir.file("missing.sock"), "no such file"},
      {file + "/below.sock", "no such file"},
  };
  for (const auto& [path, said] : cases) {
    const Output r = run(dir, {STEPTRACE_CLI_BIN, "--socket", path, "ping"});
    EXPECT_EQ(r.status, 1) << path;
    EXPECT_THAT(r.err, HasSubstr(said)) << path;
    EXPECT_THAT(r.err, Not(HasSubstr("Connection refused"))) << path;
    EXPECT_EQ(count_lines(r.err), 1u) << r.err;
  }
}

// Bad values are named by what they should have been, not by CLI11's "Value abc not in
// range".
TEST(CliNoDaemon, BadValuesSayWhatIsWrong) {
  TempDir dir;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"report", "--pid", "abc"}, "'abc' is not a pid"},
      {{"reset", "--pid", "-3"}, "'-3' is not a pid"},
      {{"top", "--interval", "abc"}, "'abc' is not a number of seconds"},
      {{"top", "--interval", "0"}, "out of range"},
      {{"top", "--iterations", "lots"}, "'lots' is not a whole number"},
      {{"report", "--window", "1m"}, "'1m' is not a whole number"},
      {{"report", "--window", "86401"}, "out of range"},
      {{"top", "--window", "-1"}, "out of range"},
      {{"--timeout", "soon", "ping"}, "'soon' is not a number of seconds"},
  };
  for (const auto& [args, said] : cases) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    const Output r = run(dir, argv);
    EXPECT_EQ(r.status, 2) << args.front();
    EXPECT_THAT(r.err, HasSubstr(said)) << r.err;
    EXPECT_THAT(r.err, Not(HasSubstr("not in range"))) << r.err;
  }
}

TEST(CliNoDaemon, SocketPathComesFromTheEnvironmentWithoutFlag) {
  TempDir dir;
  const std::string socket = dir.file("from-env.sock");
  const Output r =
      run(dir, {STEPTRACE_CLI_BIN, "report", "--json"}, {"STEPTRACE_SOCKET=" + socket});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr(socket));
  EXPECT_THAT(r.err, HasSubstr("STEPTRACE_SOCKET"));
}

// With neither --socket nor STEPTRACE_SOCKET the CLI tries the default path, and says
// so when nothing answers there. A machine with steptraced on that path would answer:
// the test is skipped there rather than passed on another premise.
TEST(CliNoDaemon, DefaultSocketWhenNothingElseIsSet) {
  const std::string socket = "/run/steptrace/steptraced.sock";  // STEPTRACE_DEFAULT_SOCKET
  if (::access(socket.c_str(), F_OK) == 0) {
    GTEST_SKIP() << socket << " exists: a daemon may answer there";
  }
  TempDir dir;
  const Output r = run(dir, {STEPTRACE_CLI_BIN, "stats"}, {"STEPTRACE_SOCKET"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr(socket + " (the default)"));
}

TEST(CliNoDaemon, BadUsageExitsTwo) {
  TempDir dir;
  const Output none = run(dir, {STEPTRACE_CLI_BIN});
  EXPECT_EQ(none.status, 2);
  EXPECT_THAT(none.err, HasSubstr("--help"));

  const Output unknown = run(dir, {STEPTRACE_CLI_BIN, "frobnicate"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_THAT(unknown.err, HasSubstr("frobnicate"));

  const Output bad_pid = run(dir, {STEPTRACE_CLI_BIN, "report", "--pid", "many"});
  EXPECT_EQ(bad_pid.status, 2);
  const Output bad_option = run(dir, {STEPTRACE_CLI_BIN, "ping", "--loud"});
  EXPECT_EQ(bad_option.status, 2);
  const Output bad_interval = run(dir, {STEPTRACE_CLI_BIN, "top", "--interval", "-1"});
  EXPECT_EQ(bad_interval.status, 2);
}

TEST(CliNoDaemon, HelpDescribesEverySubcommand) {
  TempDir dir;
  const Output r = run(dir, {STEPTRACE_CLI_BIN, "--help"});
  EXPECT_EQ(r.status, 0);
  EXPECT_THAT(r.out, HasSubstr("steptraced"));
  for (const char* sub :
       {"ping", "report", "ledger", "stats", "metrics", "reset", "version", "top"}) {
    EXPECT_THAT(r.out, HasSubstr(std::string("  ") + sub + " ")) << sub;
  }
  EXPECT_THAT(r.out, HasSubstr("STEPTRACE_SOCKET"));
}

// Every subcommand, in the order `steptrace help` lists them.
const std::vector<std::string> kSubcommands = {"ping",  "report",  "ledger", "stats", "metrics",
                                               "reset", "version", "top",    "trace", "help"};

// Issue 28: `steptraced --help` named neither top nor trace.
TEST(CliNoDaemon, DaemonHelpNamesEveryCommandOfTheCli) {
  TempDir dir;
  const Output r = run(dir, {STEPTRACED_BIN, "--help"});
  EXPECT_EQ(r.status, 0) << r.err;
  for (const std::string& sub : kSubcommands) {
    EXPECT_THAT(r.out, HasSubstr(" " + sub + " ")) << sub << " in\n" << r.out;
  }
  EXPECT_THAT(r.out, HasSubstr("steptrace help COMMAND"));
}

TEST(CliNoDaemon, WithoutArgumentsListsTheSubcommandsAndExitsTwo) {
  TempDir dir;
  const Output r = run(dir, {STEPTRACE_CLI_BIN});
  EXPECT_EQ(r.status, 2);
  EXPECT_EQ(r.out, "");  // a usage error: the list goes to stderr
  for (const auto& sub : kSubcommands) {
    // One line each: the name, then its one-line description.
    EXPECT_THAT(r.err, MatchesRegex("(.*\n)?  " + sub + " +[A-Z][^\n]+\n.*")) << sub;
  }
  EXPECT_THAT(r.err, HasSubstr("steptrace help SUBCOMMAND"));
  EXPECT_THAT(r.err, HasSubstr("Exit status: 0 ok, 1 "));

  // Global options without a subcommand are no subcommand either.
  const Output only_globals = run(dir, {STEPTRACE_CLI_BIN, "--timeout", "3"});
  EXPECT_EQ(only_globals.status, 2);
  EXPECT_EQ(only_globals.err, r.err);
}

TEST(CliNoDaemon, HelpListsTheSubcommandsAndExitsZero) {
  TempDir dir;
  const Output help = run(dir, {STEPTRACE_CLI_BIN, "help"});
  EXPECT_EQ(help.status, 0) << help.err;
  EXPECT_EQ(help.err, "");
  const Output none = run(dir, {STEPTRACE_CLI_BIN});
  EXPECT_EQ(help.out, none.err);  // the same list, on stdout
  // Subcommands are listed in order, each on one line.
  std::size_t at = 0;
  for (const auto& sub : kSubcommands) {
    const auto pos = help.out.find("\n  " + sub + " ", at);
    ASSERT_NE(pos, std::string::npos) << sub << " after byte " << at << ":\n" << help.out;
    at = pos + 1;
  }
}

TEST(CliNoDaemon, HelpOfOneSubcommandPrintsItsOptions) {
  TempDir dir;
  const Output trace = run(dir, {STEPTRACE_CLI_BIN, "help", "trace"});
  EXPECT_EQ(trace.status, 0) << trace.err;
  EXPECT_THAT(trace.out, HasSubstr("Usage: steptrace trace [OPTIONS]"));
  for (const char* flag : {"--pid", "--last", "--for", "-o,--output", "--force"}) {
    EXPECT_THAT(trace.out, HasSubstr(flag)) << flag;
  }
  // The same text as `steptrace trace --help`.
  EXPECT_EQ(trace.out, run(dir, {STEPTRACE_CLI_BIN, "trace", "--help"}).out);

  const Output top = run(dir, {STEPTRACE_CLI_BIN, "help", "top"});
  EXPECT_EQ(top.status, 0);
  EXPECT_THAT(top.out, HasSubstr("Usage: steptrace top"));
  EXPECT_THAT(top.out, HasSubstr("--interval"));
  EXPECT_THAT(top.out, HasSubstr("--iterations"));
  EXPECT_THAT(top.out, Not(HasSubstr("--pid")));

  const Output version = run(dir, {STEPTRACE_CLI_BIN, "help", "version"});
  EXPECT_EQ(version.status, 0);
  EXPECT_THAT(version.out, HasSubstr("--json"));

  const Output unknown = run(dir, {STEPTRACE_CLI_BIN, "help", "frobnicate"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_EQ(unknown.out, "");
  EXPECT_THAT(unknown.err, HasSubstr("'frobnicate'"));
  EXPECT_THAT(unknown.err, HasSubstr("  report "));
}

TEST(CliNoDaemon, HelpOfANestedSubcommandPrintsItsOwnOptions) {
  TempDir dir;
  const Output cleanup = run(dir, {STEPTRACE_CLI_BIN, "help", "ledger", "cleanup"});
  EXPECT_EQ(cleanup.status, 0) << cleanup.err;
  EXPECT_THAT(cleanup.out, HasSubstr("Usage: steptrace ledger cleanup"));
  EXPECT_THAT(cleanup.out, HasSubstr("GPU"));
  EXPECT_EQ(cleanup.out, run(dir, {STEPTRACE_CLI_BIN, "ledger", "cleanup", "--help"}).out);
  // `help ledger` is the ledger's own, which names cleanup.
  const Output ledger = run(dir, {STEPTRACE_CLI_BIN, "help", "ledger"});
  EXPECT_EQ(ledger.status, 0);
  EXPECT_THAT(ledger.out, HasSubstr("cleanup"));

  const Output unknown = run(dir, {STEPTRACE_CLI_BIN, "help", "ledger", "frobnicate"});
  EXPECT_EQ(unknown.status, 2);
  EXPECT_EQ(unknown.out, "");
  EXPECT_THAT(unknown.err, HasSubstr("`steptrace ledger` has no subcommand 'frobnicate'"));
}

TEST(CliNoDaemon, UnknownFlagExitsTwoNamingIt) {
  TempDir dir;
  for (const std::vector<std::string>& args : {std::vector<std::string>{"--bogus"},
                                               {"--bogus", "ping"},
                                               {"report", "--bogus"},
                                               {"top", "--bogus"},
                                               {"version", "--bogus"},
                                               {"trace", "--bogus"}}) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN};
    argv.insert(argv.end(), args.begin(), args.end());
    const Output r = run(dir, argv);
    EXPECT_EQ(r.status, 2) << args.front() << " " << args.back() << ": " << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr("--bogus"));
    EXPECT_THAT(r.err, Not(HasSubstr("cannot reach")));  // refused before connecting
  }
}

// Every subcommand that asks the daemon fails the same way when there is none.
TEST(CliNoDaemon, EverySubcommandExitsOneWhenTheDaemonIsUnreachable) {
  TempDir dir;
  const std::string socket = dir.file("absent.sock");
  for (const std::vector<std::string>& args : {std::vector<std::string>{"ping"},
                                               {"report"},
                                               {"report", "--json"},
                                               {"report", "--pid", "42"},
                                               {"ledger"},
                                               {"stats", "--json"},
                                               {"metrics"},
                                               {"reset"},
                                               {"top", "--iterations", "1"},
                                               {"trace", "-o", "-"}}) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", socket};
    argv.insert(argv.end(), args.begin(), args.end());
    const Output r = run(dir, argv);
    EXPECT_EQ(r.status, 1) << args.front() << ": " << r.err;
    EXPECT_EQ(r.out, "") << args.front();
    EXPECT_THAT(r.err, HasSubstr("cannot reach steptraced at " + socket)) << args.front();
  }
}

TEST(CliNoDaemon, VersionWithoutDaemonPrintsTheCliVersionAndExitsOne) {
  TempDir dir;
  const std::string socket = dir.file("absent.sock");
  const Output r = run(dir, {STEPTRACE_CLI_BIN, "--socket", socket, "version"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.out, MatchesRegex("steptrace [0-9][^ ]* \\(CLI\\)\n"));
  EXPECT_THAT(r.err, HasSubstr("cannot reach steptraced at " + socket));

  const Output j = run(dir, {STEPTRACE_CLI_BIN, "--socket", socket, "version", "--json"});
  EXPECT_EQ(j.status, 1);
  const json doc = json::parse(j.out, nullptr, false);
  ASSERT_TRUE(doc.is_object()) << j.out;
  EXPECT_TRUE(doc["cli"]["version"].is_string());
  EXPECT_TRUE(doc["daemon"].is_null());
  EXPECT_EQ(doc.value("socket", ""), socket);
}

// ---------------------------------------------------------------------------------
// Against a live daemon

class CliLive : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.start()) << daemon_.log(); }

  Output cli(std::vector<std::string> args) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", daemon_.socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    return run(dir_, argv);
  }

  json cli_json(std::vector<std::string> args) {
    const Output r = cli(std::move(args));
    EXPECT_EQ(r.status, 0) << r.err;
    json doc = json::parse(r.out, nullptr, false);
    EXPECT_TRUE(doc.is_object()) << r.out;
    // An empty object keeps the caller's lookups well-defined after a recorded failure.
    return doc.is_object() ? doc : json::object();
  }

  TempDir dir_;
  DaemonProcess daemon_{dir_.file("d.sock"), {"--state-dir", dir_.path()}};
};

TEST_F(CliLive, PingPrintsPong) {
  const Output r = cli({"ping"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "pong\n");
  EXPECT_EQ(r.err, "");
}

TEST_F(CliLive, SocketFromTheEnvironment) {
  const Output r = run(dir_, {STEPTRACE_CLI_BIN, "ping"}, {"STEPTRACE_SOCKET=" + daemon_.socket()});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, "pong\n");
}

TEST_F(CliLive, ReportLedgerStatsMetricsAnswer) {
  const Output report = cli({"report"});
  EXPECT_EQ(report.status, 0) << report.err;
  EXPECT_FALSE(report.out.empty());

  const json report_json = cli_json({"report", "--json"});
  ASSERT_TRUE(report_json.is_object());
  EXPECT_EQ(report_json.value("schema", ""), "steptrace.report/v1");
  EXPECT_TRUE(report_json["processes"].is_array());
  // --window goes to the daemon as its `report --window N` (which refuses what it does
  // not know: an answer is the daemon taking it).
  const Output windowed = cli({"report", "--window", "30"});
  EXPECT_EQ(windowed.status, 0) << windowed.err;
  EXPECT_EQ(cli_json({"report", "--json", "--window", "30"}).value("schema", ""),
            "steptrace.report/v1");

  const Output ledger = cli({"ledger"});
  EXPECT_EQ(ledger.status, 0) << ledger.err;
  EXPECT_FALSE(ledger.out.empty());
  const json ledger_json = cli_json({"ledger", "--json"});
  ASSERT_TRUE(ledger_json.is_object());
  EXPECT_TRUE(ledger_json["gpus"].is_array());

  const Output stats = cli({"stats"});
  EXPECT_EQ(stats.status, 0) << stats.err;
  EXPECT_FALSE(stats.out.empty());
  EXPECT_TRUE(cli_json({"stats", "--json"}).is_object());

  const Output metrics = cli({"metrics"});
  EXPECT_EQ(metrics.status, 0) << metrics.err;
  EXPECT_THAT(metrics.out, HasSubstr("# TYPE "));
}

TEST_F(CliLive, VersionShowsTheCliAndTheDaemonOnOneLine) {
  const Output r = cli({"version"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.err, "");
  // "steptrace 0.1.0 (CLI); steptraced 0.1.0, protocol 2, at /tmp/.../d.sock"
  EXPECT_THAT(r.out, MatchesRegex("steptrace [0-9][^ ]* \\(CLI\\); steptraced [0-9][^ ]*, "
                                  "protocol [0-9]+, at " +
                                  daemon_.socket() + "\n"));

  const json doc = cli_json({"version", "--json"});
  ASSERT_TRUE(doc.contains("cli") && doc.contains("daemon")) << doc.dump();
  EXPECT_EQ(doc["cli"].value("version", "cli"), doc["daemon"].value("version", "daemon"));
  EXPECT_TRUE(doc["daemon"]["protocol"].is_number_integer()) << doc.dump();
  EXPECT_EQ(doc.value("socket", ""), daemon_.socket());
  EXPECT_THAT(r.out, HasSubstr("protocol " + doc["daemon"]["protocol"].dump() + ","));
}

// The daemon answers `report --pid N` of a pid it does not track with an empty report;
// the CLI makes that a failed lookup, as `reset --pid N` (an error reply) is.
TEST_F(CliLive, UnknownPidExitsOne) {
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"report", "--pid", "999999"},
        {"report", "--json", "--pid", "999999"},
        {"reset", "--pid", "999999"}}) {
    const Output r = cli(args);
    EXPECT_EQ(r.status, 1) << args.front() << " " << args[1] << ": " << r.out << r.err;
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr("999999"));
  }
  // A daemon error reply is a failure too: `reset --gpu` of a GPU the view does not have.
  const Output gpu = cli({"reset", "--gpu", "GPU-none"});
  EXPECT_EQ(gpu.status, 1) << gpu.out << gpu.err;
  EXPECT_THAT(gpu.err, HasSubstr("error:"));
}

// `ledger cleanup GPU ID`: an operator clears a leaked reservation; the cleanup is
// credited to the CLI's process; an unknown one, a bad id and a live one of another uid
// are refused with exit 1 (2 for usage).
TEST_F(CliLive, LedgerCleanupClearsALeakAndIsCreditedToTheCaller) {
  const std::string gpu = "GPU-cli-cleanup";
  // The worker reserves and exits holding it: a leak once the daemon notices the exit.
  const Output worker = run(dir_, {STEPTRACE_LEDGER_WORKER, daemon_.socket(), "reserve", gpu, "5",
                                   std::to_string(kGiB), "leaky"});
  ASSERT_EQ(worker.status, 0) << worker.out << worker.err;
  bool leaked = false;
  for (int i = 0; i < 200 && !leaked; ++i) {
    const json now = cli_json({"ledger", "--json"});
    for (const auto& g : now["gpus"]) {
      for (const auto& r : g["reservations"]) leaked = leaked || r.value("state", "") == "LEAKED";
    }
    if (!leaked) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  ASSERT_TRUE(leaked) << cli({"ledger"}).out << worker.out << worker.err;

  const Output unknown = cli({"ledger", "cleanup", gpu, "6"});
  EXPECT_EQ(unknown.status, 1) << unknown.out << unknown.err;
  EXPECT_THAT(
      unknown.err,
      HasSubstr(
          "steptrace: steptraced answered: error: no reservation 6 on GPU 'GPU-cli-cleanup'"));
  const Output bad_id = cli({"ledger", "cleanup", gpu, "five"});
  EXPECT_EQ(bad_id.status, 1) << bad_id.out << bad_id.err;
  EXPECT_THAT(bad_id.err, HasSubstr("reservation id must be an integer"));
  const Output usage = cli({"ledger", "cleanup", gpu});
  EXPECT_EQ(usage.status, 2) << usage.out << usage.err;

  const Output ok = cli({"ledger", "cleanup", gpu, "5"});
  EXPECT_EQ(ok.status, 0) << ok.out << ok.err;
  EXPECT_THAT(ok.out, HasSubstr("ok: reservation 5 on GPU 'GPU-cli-cleanup' (LEAKED"));
  const json ledger = cli_json({"ledger", "--json"});
  ASSERT_EQ(ledger["gpus"].size(), 1u) << ledger.dump();
  const json& g = ledger["gpus"][0];
  EXPECT_TRUE(g["reservations"].empty()) << g.dump();
  EXPECT_EQ(g["operations"]["cleanup"], 1) << g.dump();
  // Credited to the CLI process that asked (not the dead holder).
  std::uint64_t credited = 0;
  for (const auto& p : g["processes"]) credited += p.value("cleanups", std::uint64_t{0});
  EXPECT_EQ(credited, 1u) << g.dump();
}

TEST_F(CliLive, ReportOfOneProcessAfterTheCExample) {
  const Output c = run(dir_, {MINIMAL_C_BIN}, {"STEPTRACE_SOCKET=" + daemon_.socket()});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  // "minimal: pid N, ..."
  const auto pos = c.out.find("pid ");
  ASSERT_NE(pos, std::string::npos) << c.out;
  const int pid = std::atoi(c.out.c_str() + pos + 4);
  ASSERT_GT(pid, 0);

  const json report = cli_json({"report", "--json", "--pid", std::to_string(pid)});
  ASSERT_TRUE(report.is_object());
  ASSERT_EQ(report["processes"].size(), 1u) << report.dump();
  const json& proc = report["processes"][0];
  EXPECT_EQ(proc.value("pid", 0), pid);
  std::map<std::string, std::uint64_t> counts;
  for (const auto& s : proc["steps"]) counts[s.value("step", "")] = s.value("count", 0ULL);
  EXPECT_EQ(counts["Forward"], 5u);
  EXPECT_EQ(counts["Backward"], 5u);
  EXPECT_EQ(counts["Matmul"], 10u);
  EXPECT_EQ(counts["Checkpoint"], 1u);

  const Output text = cli({"report", "--pid", std::to_string(pid)});
  EXPECT_EQ(text.status, 0);
  EXPECT_THAT(text.out, HasSubstr("Forward"));
}

// `report --compute STEP,... --overhead STEP,...`: the 50% rule of the trainer's own
// steps, in text and JSON; a bad list is one line on stderr and exit 1.
TEST_F(CliLive, ReportComputeAndOverheadNameTheRulesSteps) {
  const Output c = run(dir_, {MINIMAL_C_BIN}, {"STEPTRACE_SOCKET=" + daemon_.socket()});
  ASSERT_EQ(c.status, 0) << c.out << c.err;
  const auto pos = c.out.find("pid ");
  ASSERT_NE(pos, std::string::npos) << c.out;
  const std::string pid = std::to_string(std::atoi(c.out.c_str() + pos + 4));

  json report = cli_json({"report", "--json", "--pid", pid, "--compute", "Forward,Backward",
                          "--overhead", "Checkpoint"});
  const json& rule = report["rule"];
  EXPECT_EQ(rule["source"], "flags") << report.dump();
  EXPECT_EQ(rule["compute_steps"], json::parse(R"(["Forward", "Backward"])"));
  EXPECT_EQ(rule["overhead_steps"], json::parse(R"(["Checkpoint"])"));
  EXPECT_GT(rule.value("compute_ns", 0ULL), 0u);
  EXPECT_NE(rule["verdict"], "no_compute");
  // No compute among these steps: a verdict of its own, no NaN.
  report = cli_json({"report", "--json", "--compute", "NoSuchStep"});
  EXPECT_EQ(report["rule"]["verdict"], "no_compute");
  EXPECT_TRUE(report["rule"]["overhead_pct"].is_null());

  const Output text = cli({"report", "--pid", pid, "--compute=Forward", "--overhead=Matmul"});
  EXPECT_EQ(text.status, 0) << text.err;
  EXPECT_THAT(text.out, HasSubstr("Rule (--compute/--overhead): compute Forward, overhead Matmul\n"
                                  "CUDA Compute:   "));
  const Output none = cli({"report", "--compute", "NoSuchStep"});
  EXPECT_EQ(none.status, 0) << none.err;
  EXPECT_THAT(none.out, HasSubstr("No NoSuchStep spans, so no 50% verdict"));
  EXPECT_THAT(none.out, Not(HasSubstr("nan")));

  const std::vector<std::pair<std::vector<std::string>, std::string>> bad = {
      {{"report", "--compute", "A,,B"},
       "steptrace: report: --compute A,,B: has an empty step name (STEP,STEP,...)\n"},
      {{"report", "--overhead", ""}, "steptrace: report: --overhead : needs at least one step\n"},
      {{"report", "--json", "--compute", "X", "--overhead", "Y,X"},
       "steptrace: report: step X is in both --compute and --overhead\n"},
      {{"report", "--pid", pid, "--compute", "A,A"},
       "steptrace: report: --compute A,A: names A twice\n"},
  };
  for (const auto& [args, said] : bad) {
    const Output r = cli(args);
    EXPECT_EQ(r.status, 1) << args.back();
    EXPECT_EQ(r.err, said);
    EXPECT_EQ(r.out, "");
  }
  // The daemon's refusal (its default overhead holds Alloc): exit 1, one line naming it.
  const Output refused = cli({"report", "--compute", "Alloc"});
  EXPECT_EQ(refused.status, 1);
  EXPECT_THAT(refused.err, HasSubstr("step Alloc is in both --compute and the default overhead "
                                     "steps"));
  EXPECT_EQ(std::count(refused.err.begin(), refused.err.end(), '\n'), 1) << refused.err;
}

#ifdef PYTHON3_BIN
TEST_F(CliLive, ReportOfThePythonExample) {
  std::vector<std::string> env = {"STEPTRACE_SOCKET=" + daemon_.socket(),
                                  std::string("STEPTRACE_LIBRARY=") + STEPTRACE_LIBRARY_FILE};
  if (std::string_view(STEPTRACE_LIBASAN).size() > 0) {
    env.push_back(std::string("LD_PRELOAD=") + STEPTRACE_LIBASAN);
    env.push_back("ASAN_OPTIONS=detect_leaks=0");  // the interpreter's own allocations
  }
  const Output py = run(dir_, {PYTHON3_BIN, MINIMAL_PY}, env);
  ASSERT_EQ(py.status, 0) << py.out << py.err;
  const auto pos = py.out.find("pid ");
  ASSERT_NE(pos, std::string::npos) << py.out;
  const int pid = std::atoi(py.out.c_str() + pos + 4);
  ASSERT_GT(pid, 0);
  const json report = cli_json({"report", "--json", "--pid", std::to_string(pid)});
  ASSERT_EQ(report["processes"].size(), 1u) << report.dump();
  std::map<std::string, std::uint64_t> counts;
  for (const auto& s : report["processes"][0]["steps"]) {
    counts[s.value("step", "")] = s.value("count", 0ULL);
  }
  EXPECT_EQ(counts["Forward"], 5u);
  EXPECT_EQ(counts["Matmul"], 10u);
  EXPECT_EQ(counts["Tokenize"], 5u);  // the decorated function, a custom step
  EXPECT_EQ(counts["LedgerReserve"], 1u);
  EXPECT_EQ(counts["LedgerRelease"], 1u);
}
#endif

// Kills the given processes on scope exit, so a failing test leaves nothing behind.
struct Reaper {
  std::vector<pid_t> pids;
  ~Reaper() {
    for (pid_t p : pids) ::kill(p, SIGKILL);
    for (pid_t p : pids) ::waitpid(p, nullptr, WNOHANG);
  }
};

TEST_F(CliLive, TopShowsLiveProcessesAndWhoWaitsForVram) {
  // Two workers, room for one: the second waits for VRAM the whole time the first trains.
  const pid_t trainer = steptrace::testing::spawn_process(
      {SIM_TRAINER_BIN, "--workers", "2", "--steps", "1000000000", "--ledger", dir_.file("ledger"),
       "--vram-total", std::to_string(8 * kGiB), "--reserve", std::to_string(5 * kGiB), "--poll-ms",
       "50", "--max-wait-ms", "60000"},
      {"STEPTRACE_SOCKET=" + daemon_.socket()});
  ASSERT_GT(trainer, 0);
  Reaper reaper{{trainer}};

  // Wait (bounded) until both workers are known to the daemon and one is in WaitPoll.
  std::string top_out;
  std::set<int> worker_pids;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  bool seen = false;
  while (!seen && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(::waitpid(trainer, nullptr, WNOHANG), 0) << "sim_trainer exited early";
    const Output top = cli({"top", "--iterations", "1"});
    ASSERT_EQ(top.status, 0) << top.err;
    top_out = top.out;
    const json report = cli_json({"report", "--json"});
    worker_pids.clear();
    for (const auto& p : report["processes"]) {
      if (p.value("comm", "").rfind("sim-worker-", 0) == 0 && p.value("alive", false)) {
        worker_pids.insert(p.value("pid", 0));
      }
    }
    seen = worker_pids.size() == 2 && top_out.find("WAITING FOR VRAM") != std::string::npos;
  }
  for (int p : worker_pids) reaper.pids.push_back(p);
  ASSERT_TRUE(seen) << top_out;
  for (int p : worker_pids) EXPECT_THAT(top_out, HasSubstr("PID " + std::to_string(p))) << top_out;
  EXPECT_THAT(top_out, HasSubstr("sim-worker-0"));
  EXPECT_THAT(top_out, HasSubstr("sim-worker-1"));
  EXPECT_THAT(top_out, HasSubstr("in WaitPoll"));
  EXPECT_THAT(top_out, HasSubstr("GPU GPU-"));
  EXPECT_THAT(top_out, Not(HasSubstr("\x1b[")));  // not a terminal: no ANSI codes
}

TEST_F(CliLive, TopIterationsRefreshesThatManyTimes) {
  const Output r = cli({"top", "--iterations", "3", "--interval", "0.05"});
  EXPECT_EQ(r.status, 0) << r.err;
  std::size_t frames = 0;
  for (auto pos = r.out.find("steptrace top"); pos != std::string::npos;
       pos = r.out.find("steptrace top", pos + 1)) {
    ++frames;
  }
  EXPECT_EQ(frames, 3u) << r.out;
}

// `steptrace top | head -3`: once the reader is gone, top ends (status 0) instead of
// refreshing into a broken pipe forever. A pipe with no reader from the start: the first
// write fails with EPIPE.
TEST_F(CliLive, TopEndsAtOnceWithoutAReader) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  ::close(fds[0]);
  const auto start = Clock::now();
  const pid_t pid = spawn_with_stdout(
      {STEPTRACE_CLI_BIN, "--socket", daemon_.socket(), "top", "--interval", "0.1"}, fds[1],
      dir_.file("top-noreader.err"));
  ::close(fds[1]);
  ASSERT_GT(pid, 0);
  const int status = steptrace::testing::wait_or_kill(pid, 5000);
  EXPECT_EQ(status, 0) << read_file(dir_.file("top-noreader.err"));
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(5));
  EXPECT_EQ(read_file(dir_.file("top-noreader.err")), "");
}

// The reader goes away while top sleeps between refreshes (an hour here): top notices
// at once, not at its next refresh.
TEST_F(CliLive, TopEndsAtOnceWhenTheReaderGoesAwayBetweenRefreshes) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_CLOEXEC), 0);
  const pid_t pid = spawn_with_stdout(
      {STEPTRACE_CLI_BIN, "--socket", daemon_.socket(), "top", "--interval", "3600"}, fds[1],
      dir_.file("top-head.err"));
  ::close(fds[1]);
  ASSERT_GT(pid, 0);
  Reaper reaper{{pid}};
  // Like `head -3`: read the first lines of the first frame, then close.
  std::string got;
  while (count_lines(got) < 3) {
    pollfd in{fds[0], POLLIN, 0};
    ASSERT_GT(::poll(&in, 1, 10000), 0) << "no frame within 10 s: " << got;
    char buffer[256];
    const ssize_t n = ::read(fds[0], buffer, sizeof buffer);
    ASSERT_GT(n, 0) << got;
    got.append(buffer, static_cast<std::size_t>(n));
  }
  EXPECT_THAT(got, HasSubstr("steptrace top"));
  ::close(fds[0]);
  const auto closed = Clock::now();
  const int status = steptrace::testing::wait_or_kill(pid, 5000);
  reaper.pids.clear();
  EXPECT_EQ(status, 0) << read_file(dir_.file("top-head.err"));
  EXPECT_LT(Clock::now() - closed, std::chrono::seconds(5));
}

// `top --once`, for scripts: one screen, no escape byte when piped, exit 0; a job the
// daemon does not know fails like report's (exit 1); a bad sort key is bad usage.
TEST_F(CliLive, TopOncePrintsOneScreenForScripts) {
  const Output once = cli({"top", "--once"});
  EXPECT_EQ(once.status, 0) << once.err;
  EXPECT_EQ(once.out.find('\x1b'), std::string::npos) << once.out;
  EXPECT_EQ(once.out.rfind("steptrace top", 0), 0u) << once.out;
  EXPECT_EQ(once.out.find("steptrace top", 1), std::string::npos) << "one screen only";
  EXPECT_THAT(once.out, HasSubstr("PID"));
  EXPECT_THAT(once.out, HasSubstr("sort: time; job: all"));
  EXPECT_THAT(once.out, Not(HasSubstr("q quit")));  // no keys to press

  const Output by_name = cli({"top", "--once", "--sort", "name"});
  EXPECT_EQ(by_name.status, 0) << by_name.err;
  EXPECT_THAT(by_name.out, HasSubstr("sort: name"));

  const Output no_job = cli({"top", "--once", "--job", "no-such-job"});
  EXPECT_EQ(no_job.status, 1) << no_job.out;
  EXPECT_THAT(no_job.err, HasSubstr("no-such-job"));

  const Output bad_sort = cli({"top", "--once", "--sort", "size"});
  EXPECT_EQ(bad_sort.status, 2);
  EXPECT_THAT(bad_sort.err, HasSubstr("'size' is not a sort key"));
}

// ---- top on a terminal it drives (stdin and stdout a pseudo-terminal) ----------------

// A pseudo-terminal of `columns` x `rows` with `argv` running on it as the session's
// controlling terminal (so the kernel sends it SIGWINCH on a resize and SIGINT for a
// typed Ctrl-C), and everything it wrote so far.
class TerminalRun {
 public:
  TerminalRun(std::vector<std::string> argv, unsigned short columns, unsigned short rows) {
    master_ = ::posix_openpt(O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (master_ < 0 || ::grantpt(master_) != 0 || ::unlockpt(master_) != 0) return;
    resize(columns, rows);
    const std::string slave_path = ::ptsname(master_);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setsid();
      const int slave = ::open(slave_path.c_str(), O_RDWR);  // becomes the controlling tty
      if (slave < 0) std::_Exit(126);
      ::ioctl(slave, TIOCSCTTY, 0);
      for (const int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) ::dup2(slave, fd);
      exec_child(argv, {"TERM=xterm", "NO_COLOR"});
    }
  }
  ~TerminalRun() {
    if (pid_ > 0 && status_ < 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (master_ >= 0) ::close(master_);
  }
  TerminalRun(const TerminalRun&) = delete;
  TerminalRun& operator=(const TerminalRun&) = delete;

  bool started() const { return pid_ > 0; }
  void resize(unsigned short columns, unsigned short rows) {
    winsize size{};
    size.ws_col = columns;
    size.ws_row = rows;
    ::ioctl(master_, TIOCSWINSZ, &size);
  }
  void type(const std::string& keys) {
    [[maybe_unused]] const ssize_t n = ::write(master_, keys.data(), keys.size());
  }
  // Reads until `done(output)` holds or `timeout` passes; whether it held.
  bool read_until(const std::function<bool(const std::string&)>& done,
                  std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
    const auto deadline = Clock::now() + timeout;
    while (!done(out_)) {
      if (Clock::now() >= deadline) return false;
      pollfd in{master_, POLLIN, 0};
      if (::poll(&in, 1, 50) > 0 && (in.revents & POLLIN) != 0) {
        char buffer[4096];
        const ssize_t n = ::read(master_, buffer, sizeof buffer);
        if (n > 0) out_.append(buffer, static_cast<std::size_t>(n));
      }
    }
    return true;
  }
  // The exit status once it exits (reading what it writes meanwhile), or -1.
  int wait_exit(std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    read_until(
        [&](const std::string&) {
          int status = 0;
          if (::waitpid(pid_, &status, WNOHANG) != pid_) return false;
          status_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
          return true;
        },
        timeout);
    read_until([](const std::string&) { return false; }, std::chrono::milliseconds(100));
    return status_;
  }
  const std::string& output() const { return out_; }
  pid_t pid() const { return pid_; }
  // The terminal as a shell wants it back: lines edited and echoed (the master reports
  // the slave's modes).
  bool cooked() const {
    termios modes{};
    return ::tcgetattr(master_, &modes) == 0 && (modes.c_lflag & ICANON) != 0 &&
           (modes.c_lflag & ECHO) != 0;
  }

 private:
  int master_ = -1;
  pid_t pid_ = -1;
  int status_ = -1;
  std::string out_;
};

// The complete screens in `raw` (each starts with the cursor sent home, ESC [ H, and is
// followed by another; the last one may still be on its way), as lines of text without
// escape sequences.
std::vector<std::vector<std::string>> screens_of(const std::string& raw) {
  std::vector<std::vector<std::string>> screens;
  std::size_t at = raw.find("\x1b[H");
  while (at != std::string::npos) {
    const std::size_t next = raw.find("\x1b[H", at + 3);
    const std::string body = raw.substr(at + 3, next == std::string::npos ? next : next - at - 3);
    std::vector<std::string> lines(1);
    for (std::size_t i = 0; i < body.size(); ++i) {
      if (body[i] == '\x1b' && i + 1 < body.size() && body[i + 1] == '[') {
        i += 2;  // a CSI sequence: parameters, then one final byte in @..~
        while (i < body.size() && (body[i] < '@' || body[i] > '~')) ++i;
      } else if (body[i] == '\n') {
        lines.emplace_back();
      } else if (body[i] != '\r') {
        lines.back() += body[i];
      }
    }
    if (next != std::string::npos) screens.push_back(std::move(lines));
    at = next;
  }
  return screens;
}

std::size_t text_columns(const std::string& line) {
  std::size_t n = 0;
  for (const char c : line) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80 ? 1 : 0;
  return n;
}

// Issue 28: at 70x18 the header scrolled away and lines wrapped, q did nothing and Ctrl-C
// exited 130. Now: a header that stays, no line wider than the terminal at 70x18 and at
// 160x50 (a resize redraws at once), q and Ctrl-C end it with 0 and give the terminal
// back (alternate screen left, cursor shown).
TEST_F(CliLive, TopOnATerminalFitsItFollowsResizesAndQuitsWithQOrCtrlC) {
  const pid_t trainer = steptrace::testing::spawn_process(
      {SIM_TRAINER_BIN, "--workers", "2", "--steps", "1000000000", "--ledger", dir_.file("ledger"),
       "--vram-total", std::to_string(8 * kGiB), "--reserve", std::to_string(5 * kGiB), "--poll-ms",
       "50", "--max-wait-ms", "60000"},
      {"STEPTRACE_SOCKET=" + daemon_.socket(), "STEPTRACE_JOB=pty-job", "RANK=1", "WORLD_SIZE=2"});
  ASSERT_GT(trainer, 0);
  Reaper reaper{{trainer}};
  const auto workers_known = [&] {
    const json report = cli_json({"report", "--json"});
    std::size_t n = 0;
    for (const auto& p : report["processes"]) {
      if (p.value("comm", "").rfind("sim-worker-", 0) == 0 && p.value("alive", false)) {
        reaper.pids.push_back(p.value("pid", 0));
        ++n;
      }
    }
    return n >= 2;
  };
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!workers_known() && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }

  for (const std::string quit : {"q", "\x03"}) {
    TerminalRun top({STEPTRACE_CLI_BIN, "--socket", daemon_.socket(), "top", "--interval", "0.2"},
                    70, 18);
    ASSERT_TRUE(top.started());
    const auto fitted = [](const std::vector<std::string>& screen, std::size_t width) {
      return std::all_of(screen.begin(), screen.end(),
                         [&](const std::string& line) { return text_columns(line) <= width; });
    };
    // Two screens at 70x18 with the workers on them.
    ASSERT_TRUE(top.read_until([](const std::string& out) {
      const auto screens = screens_of(out);
      return screens.size() >= 2 && out.find("pty-job") != std::string::npos;
    })) << top.output();
    EXPECT_THAT(top.output(), HasSubstr("\x1b[?1049h"));  // the alternate screen
    for (const auto& screen : screens_of(top.output())) {
      ASSERT_LE(screen.size(), 18u);
      EXPECT_TRUE(fitted(screen, 70)) << top.output();
      EXPECT_THAT(screen.front(), HasSubstr("steptrace top"));
      EXPECT_THAT(screen.back(), HasSubstr("q quit"));
    }
    const std::string small = screens_of(top.output()).back()[4];
    EXPECT_THAT(small, HasSubstr("pty-job")) << top.output();
    EXPECT_THAT(small, HasSubstr("1/2")) << top.output();

    // Resized: the next screen is as wide as the new terminal allows, and wider columns
    // (UID, BUSIEST STEP) come back.
    const std::size_t before = top.output().size();
    top.resize(160, 50);
    ASSERT_TRUE(top.read_until([&](const std::string& out) {
      const auto wide = out.find("BUSIEST STEP", before);
      return wide != std::string::npos && out.find("\x1b[H", wide) != std::string::npos;
    })) << top.output();
    const auto wide = screens_of(top.output().substr(before));
    ASSERT_FALSE(wide.empty());
    for (const auto& screen : wide) {
      EXPECT_LE(screen.size(), 50u);
      EXPECT_TRUE(fitted(screen, 160));
      EXPECT_THAT(screen.front(), HasSubstr("steptrace top"));
    }

    top.type(quit);
    EXPECT_EQ(top.wait_exit(), 0) << (quit == "q" ? "q" : "Ctrl-C") << ": " << top.output();
    const std::string& out = top.output();
    const auto left = out.rfind("\x1b[?1049l");
    ASSERT_NE(left, std::string::npos) << "the alternate screen was not left";
    EXPECT_NE(out.find("\x1b[?25h", out.rfind("\x1b[?25l")), std::string::npos)
        << "the cursor was not shown again";
  }
}

// Whether `top` gave its terminal back: cooked mode, and (when it entered it) the
// alternate screen left and the cursor shown after it was last hidden.
void expect_terminal_restored(const TerminalRun& top) {
  EXPECT_TRUE(top.cooked()) << "the terminal was left in raw mode";
  const std::string& out = top.output();
  if (out.find("\x1b[?1049h") == std::string::npos) return;
  EXPECT_NE(out.rfind("\x1b[?1049l"), std::string::npos) << "the alternate screen was not left";
  EXPECT_GT(out.rfind("\x1b[?1049l"), out.rfind("\x1b[?1049h"));
  EXPECT_NE(out.find("\x1b[?25h", out.rfind("\x1b[?25l")), std::string::npos)
      << "the cursor was not shown again";
}

// SIGCONT for a stopped daemon, however the test ends.
struct Resume {
  pid_t pid;
  ~Resume() { ::kill(pid, SIGCONT); }
};

// Issue 28's follow-up: q and Ctrl-C were ignored while a refresh waited for the
// daemon's reply (a stopped daemon: until --timeout). Now they quit at once, with 0 and
// the terminal back. The bound is generous for CI; the refresh would wait 60 s.
TEST_F(CliLive, TopQuitsAtOnceWhileARefreshWaitsForTheDaemon) {
  for (const std::string quit : {"q", "\x03"}) {
    TerminalRun top({STEPTRACE_CLI_BIN, "--socket", daemon_.socket(), "--timeout", "60", "top",
                     "--interval", "0.2"},
                    80, 24);
    ASSERT_TRUE(top.started());
    ASSERT_TRUE(top.read_until([](const std::string& out) { return !screens_of(out).empty(); }))
        << top.output();
    ASSERT_EQ(::kill(daemon_.pid(), SIGSTOP), 0);
    Resume resume{daemon_.pid()};
    // The next refresh (every 0.2 s) is under way and cannot be answered.
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    const auto typed = Clock::now();
    top.type(quit);
    EXPECT_EQ(top.wait_exit(std::chrono::seconds(5)), 0)
        << (quit == "q" ? "q" : "Ctrl-C") << ": " << top.output();
    EXPECT_LT(Clock::now() - typed, std::chrono::seconds(5));
    expect_terminal_restored(top);
  }
}

// `top --once` keeps the default signals: Ctrl-C ends it at once even while the daemon
// cannot answer, like any interrupted command (130, by SIGINT). The watching top without
// a terminal (piped) quits with 0 as on a terminal.
TEST_F(CliLive, TopEndsAtOnceOnCtrlCWhileTheDaemonIsStopped) {
  ASSERT_EQ(::kill(daemon_.pid(), SIGSTOP), 0);
  Resume resume{daemon_.pid()};
  for (const bool once : {true, false}) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", daemon_.socket(),
                                  "--timeout",       "60",       "top"};
    if (once) argv.emplace_back("--once");
    const int out = ::open(dir_.file(once ? "once.out" : "piped.out").c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    ASSERT_GE(out, 0);
    const pid_t pid = spawn_with_stdout(argv, out, dir_.file("top.err"));
    ::close(out);
    ASSERT_GT(pid, 0);
    // Waiting for the reply: connected to the stopped daemon, and (the watching top) its
    // SIGINT caught; on a loaded machine that may take a while after exec.
    const auto ready = [pid, once] {
      if (!once) {
        std::ifstream status("/proc/" + std::to_string(pid) + "/status");
        std::string line;
        bool caught = false;
        while (std::getline(status, line)) {
          if (line.rfind("SigCgt:", 0) == 0) {
            caught = (std::stoull(line.substr(7), nullptr, 16) & (1ULL << (SIGINT - 1))) != 0;
          }
        }
        if (!caught) return false;
      }
      const std::string fds = "/proc/" + std::to_string(pid) + "/fd";
      std::error_code error;
      for (const auto& fd : std::filesystem::directory_iterator(fds, error)) {
        if (std::filesystem::read_symlink(fd.path(), error).string().rfind("socket:", 0) == 0) {
          return true;
        }
      }
      return false;
    };
    const auto deadline = Clock::now() + std::chrono::seconds(20);
    while (!ready() && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ASSERT_TRUE(ready()) << (once ? "--once" : "piped") << ": never connected to the daemon";
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // its request sent
    const auto sent = Clock::now();
    ::kill(pid, SIGINT);
    const int status = steptrace::testing::wait_or_kill(pid, 5000);
    EXPECT_EQ(status, once ? 128 + SIGINT : 0) << (once ? "--once" : "piped");
    EXPECT_LT(Clock::now() - sent, std::chrono::seconds(5));
  }
}

// A stand-in for the daemon on a Unix socket: answers the n-th connection (from 0) with
// reply(n) once it has the request line, then closes it.
class ScriptedDaemon {
 public:
  ScriptedDaemon(std::string path, std::function<std::string(int)> reply)
      : path_(std::move(path)), reply_(std::move(reply)) {
    listener_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof address.sun_path - 1);
    if (::pipe(stop_) != 0 ||
        ::bind(listener_, reinterpret_cast<const sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listener_, 8) != 0) {
      return;
    }
    thread_ = std::thread([this] {
      for (int n = 0;; ++n) {
        pollfd fds[2] = {{listener_, POLLIN, 0}, {stop_[0], POLLIN, 0}};
        if (::poll(fds, 2, -1) <= 0 || (fds[1].revents & POLLIN) != 0) return;
        const int fd = ::accept(listener_, nullptr, nullptr);
        if (fd < 0) continue;
        char c = 0;
        while (::read(fd, &c, 1) == 1 && c != '\n') {
        }
        const std::string reply = reply_(n);
        [[maybe_unused]] const ssize_t w = ::write(fd, reply.data(), reply.size());
        ::close(fd);
      }
    });
  }
  ~ScriptedDaemon() {
    [[maybe_unused]] const ssize_t n = ::write(stop_[1], "x", 1);
    if (thread_.joinable()) thread_.join();
    for (const int fd : {stop_[0], stop_[1], listener_}) {
      if (fd >= 0) ::close(fd);
    }
    ::unlink(path_.c_str());
  }
  ScriptedDaemon(const ScriptedDaemon&) = delete;
  ScriptedDaemon& operator=(const ScriptedDaemon&) = delete;

 private:
  std::string path_;
  std::function<std::string(int)> reply_;
  int listener_ = -1;
  int stop_[2] = {-1, -1};
  std::thread thread_;
};

// A daemon that closes mid-reply or answers garbage: top says so and keeps the last
// screen ("retrying: ..."), quits on q with 0; a first reply that is garbage fails like
// every subcommand (exit 1, the error on the main screen). The terminal is back in
// every case.
TEST(CliScripted, TopOnABrokenDaemonRestoresTheTerminal) {
  TempDir dir;
  const std::string report = R"({"processes": [], "gpus": []})";
  const std::string socket = dir.file("fake.sock");
  {
    ScriptedDaemon daemon(socket, [&](int n) {
      if (n == 0) return report;
      if (n % 3 == 1) return report.substr(0, 10);                  // closed mid-reply
      if (n % 3 == 2) return std::string("error: \x1b[2Jwiped\n");  // an escape in an error
      return std::string("\x01\xff garbage");
    });
    TerminalRun top({STEPTRACE_CLI_BIN, "--socket", socket, "top", "--interval", "0.05"}, 80, 24);
    ASSERT_TRUE(top.started());
    ASSERT_TRUE(top.read_until([](const std::string& out) {
      return out.find("retrying: ") != std::string::npos && out.find("wiped") != std::string::npos;
    })) << top.output();
    EXPECT_EQ(top.output().find("\x1b[2J"), std::string::npos) << "the garbage reached the screen";
    top.type("q");
    EXPECT_EQ(top.wait_exit(std::chrono::seconds(5)), 0) << top.output();
    expect_terminal_restored(top);
  }
  {
    ScriptedDaemon daemon(socket, [](int) { return std::string("garbage"); });
    TerminalRun top({STEPTRACE_CLI_BIN, "--socket", socket, "top"}, 80, 24);
    ASSERT_TRUE(top.started());
    EXPECT_EQ(top.wait_exit(std::chrono::seconds(10)), 1) << top.output();
    EXPECT_THAT(top.output(), HasSubstr("not a JSON object"));
    EXPECT_EQ(top.output().find("\x1b[?1049h"), std::string::npos) << top.output();
    expect_terminal_restored(top);
  }
}

// On a terminal top highlights and redraws with ANSI sequences; NO_COLOR (any non-empty
// value) and TERM=dumb turn every escape sequence off.
TEST_F(CliLive, NoColorMeansNoEscapeByteEvenOnATerminal) {
  const std::vector<std::string> top = {STEPTRACE_CLI_BIN, "--socket", daemon_.socket(), "top",
                                        "--iterations",    "2",        "--interval",     "0.05"};
  const Output colour = run_on_terminal(dir_, top, {"TERM=xterm", "NO_COLOR"});
  EXPECT_EQ(colour.status, 0) << colour.err;
  EXPECT_THAT(colour.out, HasSubstr("\x1b[")) << "not a terminal?";  // the test's premise

  const Output empty_no_color = run_on_terminal(dir_, top, {"TERM=xterm", "NO_COLOR="});
  EXPECT_THAT(empty_no_color.out, HasSubstr("\x1b[")) << "an empty NO_COLOR counts as unset";

  for (const std::vector<std::string>& env :
       {std::vector<std::string>{"TERM=xterm", "NO_COLOR=1"}, {"TERM=dumb", "NO_COLOR"}}) {
    const Output plain = run_on_terminal(dir_, top, env);
    EXPECT_EQ(plain.status, 0) << env[0] << " " << env[1] << ": " << plain.err;
    EXPECT_THAT(plain.out, HasSubstr("steptrace top")) << env[0] << " " << env[1];
    EXPECT_EQ(plain.out.find('\x1b'), std::string::npos) << env[0] << " " << env[1];
  }
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"report"}, {"ledger"}, {"version"}, {"help"}}) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", daemon_.socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    const Output r = run_on_terminal(dir_, argv, {"TERM=xterm", "NO_COLOR=1"});
    EXPECT_EQ(r.status, 0) << args.front() << ": " << r.err;
    EXPECT_EQ(r.out.find('\x1b'), std::string::npos) << args.front();
  }
}

TEST_F(CliLive, SimTrainerKillOneLeaksThenIsCleanedUpByAnother) {
  constexpr int kSteps = 12;
  const std::string summary_path = dir_.file("summary.json");
  const pid_t trainer =
      steptrace::testing::spawn_process({"/bin/sh",
                                         "-c",
                                         std::string("exec \"$0\" \"$@\" > ") + summary_path,
                                         SIM_TRAINER_BIN,
                                         "--workers",
                                         "3",
                                         "--steps",
                                         std::to_string(kSteps),
                                         "--dim",
                                         "16",
                                         "--kill-one",
                                         "--json",
                                         "--ledger",
                                         dir_.file("ledger"),
                                         "--vram-total",
                                         std::to_string(8 * kGiB),
                                         "--reserve",
                                         std::to_string(5 * kGiB),
                                         "--pause-after-kill-ms",
                                         "1500"},
                                        {"STEPTRACE_SOCKET=" + daemon_.socket()});
  ASSERT_GT(trainer, 0);
  Reaper reaper{{trainer}};

  // While the others have not started yet, the killed worker's reservation is a leak.
  std::optional<std::int64_t> leaked_pid;
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  while (!leaked_pid && Clock::now() < deadline) {
    const json ledger = cli_json({"ledger", "--json"});
    for (const auto& gpu : ledger["gpus"]) {
      for (const auto& r : gpu["reservations"]) {
        if (!r.value("holder_alive", true)) leaked_pid = r.value("pid", std::int64_t{0});
      }
    }
    if (!leaked_pid) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  const Output leaked_text = cli({"ledger"});
  EXPECT_THAT(leaked_text.out, HasSubstr("LEAKED"));

  const int status = steptrace::testing::wait_process(trainer, 60000);
  reaper.pids.clear();
  const json summary = json::parse(read_file(summary_path), nullptr, false);
  ASSERT_EQ(status, 0) << read_file(summary_path);
  ASSERT_TRUE(summary.is_object());
  ASSERT_TRUE(leaked_pid.has_value()) << "the daemon never showed the killed worker's leak";

  std::int64_t killed_pid = 0;
  std::set<std::int64_t> survivors;
  std::set<std::int64_t> cleaners;
  for (const auto& w : summary["workers"]) {
    if (w.value("killed", false)) {
      killed_pid = w.value("pid", std::int64_t{0});
    } else {
      survivors.insert(w.value("pid", std::int64_t{0}));
      EXPECT_EQ(w.value("steps", 0), kSteps);
    }
    if (!w["cleaned"].empty()) cleaners.insert(w.value("pid", std::int64_t{0}));
  }
  if (!summary["janitor_cleaned"].empty())
    cleaners.insert(summary.value("janitor_pid", std::int64_t{0}));
  EXPECT_EQ(*leaked_pid, killed_pid);
  EXPECT_EQ(survivors.size(), 2u);
  ASSERT_EQ(cleaners.size(), 1u) << summary.dump();

  // Every surviving worker's steps reached the daemon, exactly.
  const json report = cli_json({"report", "--json"});
  std::set<std::int64_t> reported;
  for (const auto& p : report["processes"]) {
    const auto pid = p.value("pid", std::int64_t{0});
    if (!survivors.count(pid)) continue;
    reported.insert(pid);
    std::map<std::string, std::uint64_t> counts;
    for (const auto& s : p["steps"]) counts[s.value("step", "")] = s.value("count", 0ULL);
    EXPECT_EQ(counts["Forward"], static_cast<std::uint64_t>(kSteps)) << pid;
    EXPECT_EQ(counts["Backward"], static_cast<std::uint64_t>(kSteps)) << pid;
    EXPECT_EQ(counts["Matmul"], 4u * kSteps) << pid;
    EXPECT_EQ(counts["LedgerReserve"], 1u) << pid;
    EXPECT_EQ(counts["LedgerRelease"], 1u) << pid;
  }
  EXPECT_EQ(reported, survivors);

  // The cleanup is credited to the cleaner, not the killed worker; nothing is held.
  const json ledger = cli_json({"ledger", "--json"});
  ASSERT_EQ(ledger["gpus"].size(), 1u) << ledger.dump();
  const json& gpu = ledger["gpus"][0];
  EXPECT_TRUE(gpu["reservations"].empty()) << gpu.dump();
  EXPECT_EQ(gpu.value("reserved_bytes", std::uint64_t{1}), 0u);
  std::set<std::int64_t> credited;
  for (const auto& p : gpu["processes"]) {
    if (p.value("cleanups", 0) > 0) credited.insert(p.value("pid", std::int64_t{0}));
  }
  EXPECT_EQ(credited, cleaners);
  EXPECT_FALSE(credited.count(killed_pid));
}

TEST_F(CliLive, SimTrainerFailsClearlyWithoutTheDaemon) {
  ASSERT_EQ(daemon_.stop(), 0);
  const Output r = run(dir_,
                       {SIM_TRAINER_BIN, "--workers", "1", "--steps", "2", "--dim", "8", "--ledger",
                        dir_.file("ledger")},
                       {"STEPTRACE_SOCKET=" + daemon_.socket()});
  EXPECT_EQ(r.status, 1) << r.out << r.err;
  EXPECT_THAT(r.out, HasSubstr("FAILED"));
}

}  // namespace
