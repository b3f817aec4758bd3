// Tests of `steptrace trace`: its pieces (the document scanner, the command line, the
// default file name), the real binary's usage errors, its side of the exchange against a
// scripted stand-in for steptraced (error replies, slow, stalled and cut-short replies,
// the wait of --for), and the real binary against the real steptraced.
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "cli/trace_command.h"
#include "cli/trace_merge.h"
#include "daemon/serve/commands.h"
#include "tests/support/daemon_process.h"

namespace {

using nlohmann::json;
using steptrace::cli::TraceDocumentScanner;
using steptrace::testing::DaemonProcess;
using steptrace::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
using Clock = std::chrono::steady_clock;

namespace fs = std::filesystem;

// A small document in the daemon's layout: one event per line.
constexpr std::string_view kDocument =
    "{\"traceEvents\":[\n"
    "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":7,\"tid\":0,\"args\":{\"name\":\"a [7]\"}},\n"
    "{\"ph\":\"X\",\"cat\":\"step\",\"name\":\"Forward\",\"pid\":7,\"tid\":7,\"ts\":1,\"dur\":2,"
    "\"args\":{\"note\":\"{[\\\"}\"}},\n"
    "{\"ph\":\"i\",\"s\":\"t\",\"name\":\"reserve\",\"pid\":7,\"tid\":7,\"ts\":3}\n"
    "],\"displayTimeUnit\":\"ms\",\"otherData\":{\"wall_clock_offset_ns\":5,"
    "\"nested\":{\"a\":[{\"b\":1}]}}}\n";
constexpr std::uint64_t kDocumentEvents = 3;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename());
  std::sort(names.begin(), names.end());
  return names;
}

// ---------------------------------------------------------------------------------
// The pieces

TEST(TraceDocumentScanner, CountsTheEventsOfACompleteDocumentSplitAnywhere) {
  for (std::size_t split = 0; split <= kDocument.size(); ++split) {
    TraceDocumentScanner scanner;
    scanner.feed(kDocument.substr(0, split));
    scanner.feed(kDocument.substr(split));
    EXPECT_TRUE(scanner.complete()) << split;
    EXPECT_EQ(scanner.events(), kDocumentEvents) << split;
  }
  TraceDocumentScanner bytewise;
  for (char c : kDocument) bytewise.feed(std::string_view(&c, 1));
  EXPECT_TRUE(bytewise.complete());
  EXPECT_EQ(bytewise.events(), kDocumentEvents);
}

TEST(TraceDocumentScanner, ACutShortDocumentIsNotComplete) {
  for (std::size_t size = 0; size + 2 < kDocument.size(); ++size) {
    TraceDocumentScanner scanner;
    scanner.feed(kDocument.substr(0, size));
    EXPECT_FALSE(scanner.complete()) << size;
  }
}

TEST(TraceDocumentScanner, RefusesWhatIsNotOneTraceObject) {
  const auto complete = [](std::string_view text) {
    TraceDocumentScanner scanner;
    scanner.feed(text);
    return scanner.complete();
  };
  EXPECT_TRUE(complete("{\"traceEvents\":[]}\n"));
  EXPECT_TRUE(complete("  {\"traceEvents\" : [ ] }"));
  EXPECT_FALSE(complete("{\"events\":[]}\n"));           // no traceEvents
  EXPECT_FALSE(complete("[{\"traceEvents\":[]}]\n"));    // not an object
  EXPECT_FALSE(complete("{\"traceEvents\":[]}\n{}\n"));  // two documents
  EXPECT_FALSE(complete("{\"traceEvents\":[]}x"));       // trailing text
  EXPECT_FALSE(complete("{\"traceEvents\":[}]\n"));      // mismatched
  EXPECT_FALSE(complete("{\"traceEvents\":[]}}\n"));     // one close too many
  EXPECT_FALSE(complete("pong\n"));
  EXPECT_FALSE(complete(""));
  // Only the top-level array counts: not objects inside events, nor another key's array.
  TraceDocumentScanner nested;
  nested.feed(
      "{\"other\":[{},{}],\"traceEvents\":[{\"args\":{\"x\":{}}},{\"s\":\"{{\"}],"
      "\"otherData\":{\"traceEvents\":[{}]}}");
  EXPECT_TRUE(nested.complete());
  EXPECT_EQ(nested.events(), 2u);
}

TEST(TraceCommand, CommandLine) {
  steptrace::cli::TraceRequest request;
  EXPECT_EQ(steptrace::cli::trace_command_line(request), "trace");
  request.pids = {9, 7, 9};
  request.last = "2.5";
  EXPECT_EQ(steptrace::cli::trace_command_line(request), "trace --pid 9 --pid 7 --last 2.5");
  request.last.clear();
  request.for_s = "10";
  EXPECT_EQ(steptrace::cli::trace_command_line(request), "trace --pid 9 --pid 7 --for 10");
  // --children and --job are the daemon's to resolve (PROTOCOL.md 10.5).
  request.children = true;
  request.job = "1001:run7";
  EXPECT_EQ(steptrace::cli::trace_command_line(request),
            "trace --pid 9 --pid 7 --children --job 1001:run7 --for 10");
}

TEST(TraceCommand, DefaultFileName) {
  std::tm t{};
  t.tm_year = 2024 - 1900;
  t.tm_mon = 2;
  t.tm_mday = 5;
  t.tm_hour = 7;
  t.tm_min = 8;
  t.tm_sec = 9;
  EXPECT_EQ(steptrace::cli::default_trace_file_name("gpu-node-3.example", t),
            "steptrace-trace-gpu-node-3.example-20240305-070809.json");
  EXPECT_EQ(steptrace::cli::default_trace_file_name("a/b c", t),
            "steptrace-trace-a_b_c-20240305-070809.json");
  EXPECT_EQ(steptrace::cli::default_trace_file_name("", t),
            "steptrace-trace-localhost-20240305-070809.json");
}

// ---------------------------------------------------------------------------------
// The binary

struct Output {
  int status = -1;  // exit status, 128+signal, -1 on timeout
  std::string out;
  std::string err;
  double seconds = 0;
};

// fork/exec argv in `cwd`, with stdout and stderr captured in files of `logs`.
Output run_in(const TempDir& logs, const std::string& cwd, std::vector<std::string> argv,
              int timeout_ms = 60000) {
  static int counter = 0;
  const std::string base = logs.file("run" + std::to_string(++counter));
  const auto start = Clock::now();
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open((base + ".out").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open((base + ".err").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0 || ::chdir(cwd.c_str()) != 0) std::_Exit(126);
    ::dup2(out, STDOUT_FILENO);
    ::dup2(err, STDERR_FILENO);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    std::_Exit(127);
  }
  Output result;
  result.status = steptrace::testing::wait_process(pid, timeout_ms);
  if (result.status < 0) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  result.out = read_file(base + ".out");
  result.err = read_file(base + ".err");
  return result;
}

// The CLI with `--socket socket trace args...`, run in `cwd`.
class TraceCli {
 public:
  explicit TraceCli(std::string socket) : socket_(std::move(socket)) {}
  Output trace(const std::string& cwd, std::vector<std::string> args, int timeout_ms = 60000) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", socket_, "trace"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_in(logs_, cwd, argv, timeout_ms);
  }

 private:
  std::string socket_;
  TempDir logs_;
};

TEST(CliTraceUsage, BadFlagsExitTwoBeforeAskingTheDaemon) {
  TempDir out;
  TraceCli cli(out.file("absent.sock"));
  const std::vector<std::vector<std::string>> cases = {
      {"--last", "5", "--for", "5"},
      {"--pid", "0"},
      {"--pid", "-3"},
      {"--pid", "many"},
      {"--last", "-1"},
      {"--last", "0"},
      {"--last", "abc"},
      {"--last", "1e3"},
      {"--last", "86401"},
      {"--for", "3601"},
      {"--for", "0"},
      {"--pid", "1", "2"},
      {"-o"},
      {"-o", ""},
      {"--loud"},
  };
  for (const auto& args : cases) {
    const Output r = cli.trace(out.path(), args);
    std::string joined;
    for (const auto& a : args) joined += a + " ";
    EXPECT_EQ(r.status, 2) << joined << r.err;
    EXPECT_EQ(r.out, "") << joined;
    EXPECT_FALSE(r.err.empty()) << joined;
    EXPECT_THAT(r.err, Not(HasSubstr("cannot reach"))) << joined;  // refused before connecting
  }
  EXPECT_TRUE(files_in(out.path()).empty());

  const Output both = cli.trace(out.path(), {"--last", "5", "--for", "5"});
  EXPECT_THAT(both.err, HasSubstr("--last"));
  EXPECT_THAT(both.err, HasSubstr("--for"));
  const Output range = cli.trace(out.path(), {"--for", "3601"});
  EXPECT_THAT(range.err, HasSubstr("3600"));
  const Output last = cli.trace(out.path(), {"--last", "86401"});
  EXPECT_THAT(last.err, HasSubstr("86400"));

  std::vector<std::string> too_many;
  for (int pid = 1; pid <= 65; ++pid) {
    too_many.push_back("--pid");
    too_many.push_back(std::to_string(pid));
  }
  const Output many = cli.trace(out.path(), too_many);
  EXPECT_EQ(many.status, 2);
  EXPECT_THAT(many.err, HasSubstr("64"));
}

// The CLI and the daemon take the same option values (proto/commands.h): at each edge of
// the --pid, --last and --for bounds and grammars, a value is refused by both or by
// neither. The daemon's side is its command parser, as its command table calls it; the
// CLI's is the binary, which refuses bad usage with 2 before connecting and otherwise
// goes on to the (absent) daemon and exits 1.
TEST(CliAndDaemonAgree, OnEveryEdgeOfTheOptionBounds) {
  using steptrace::daemon::CommandError;
  struct Case {
    std::string command;  // trace, report or reset
    std::string option;
    std::string value;
    bool valid;  // as PROTOCOL.md section 10 says
  };
  std::vector<Case> cases;
  for (const char* command : {"trace", "report", "reset"}) {
    for (const auto& [value, valid] : std::vector<std::pair<std::string, bool>>{
             {"0", false},
             {"1", true},
             {"1073741825", true},  // past the CLI's old 2^30
             {"2147483647", true},
             {"2147483648", false},
             {"010", true},
             {"0x10", false},
             {"+5", false},
             {"-1", false},
             {"1.0", false},
         }) {
      cases.push_back({command, "--pid", value, valid});
    }
  }
  for (const auto& [value, valid] : std::vector<std::pair<std::string, bool>>{
           {"0", false},
           {"0.000", false},
           {"0.001", true},
           {"86400", true},  // the CLI had no upper bound
           {"86400.001", false},
           {"1e3", false},
           {".5", false},
           {"5.", false},
           {"00000000000000000001", true},    // 20 characters
           {"000000000000000000001", false},  // 21
       }) {
    cases.push_back({"trace", "--last", value, valid});
  }
  for (const auto& [value, valid] : std::vector<std::pair<std::string, bool>>{
           {"0", false},
           {"0.001", true},
           {"0.5", true},  // the CLI wanted >= 1
           {"1", true},
           {"3600", true},
           {"3600.001", false},
           {"1e1", false},
       }) {
    cases.push_back({"trace", "--for", value, valid});
  }

  TempDir out;
  TempDir logs;
  const std::string absent = out.file("absent.sock");
  for (const Case& c : cases) {
    const std::string what = c.command + " " + c.option + " " + c.value;
    const std::vector<std::string_view> words = {c.option, c.value};
    bool daemon_ok = false;
    if (c.command == "trace") {
      daemon_ok =
          !std::holds_alternative<CommandError>(steptrace::daemon::TraceRequest::parse(words));
    } else if (c.command == "report") {
      daemon_ok =
          !std::holds_alternative<CommandError>(steptrace::daemon::ReportRequest::parse(words));
    } else {
      daemon_ok =
          !std::holds_alternative<CommandError>(steptrace::daemon::ResetRequest::parse(words));
    }
    const Output r = run_in(logs, out.path(),
                            {STEPTRACE_CLI_BIN, "--socket", absent, c.command, c.option, c.value});
    EXPECT_TRUE(r.status == 1 || r.status == 2) << what << ": " << r.status << " " << r.err;
    const bool cli_ok = r.status == 1 && r.err.find("cannot reach") != std::string::npos;
    EXPECT_EQ(daemon_ok, c.valid) << what;
    EXPECT_EQ(cli_ok, c.valid) << what << ": " << r.err;
  }
  EXPECT_TRUE(files_in(out.path()).empty());
}

TEST(CliTraceUsage, AnExistingFileIsKeptWithoutForce) {
  TempDir out;
  TraceCli cli(out.file("absent.sock"));
  const std::string file = out.file("mine.json");
  std::ofstream(file) << "precious";
  const Output r = cli.trace(out.path(), {"-o", file});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr(file));
  EXPECT_THAT(r.err, HasSubstr("--force"));
  EXPECT_THAT(r.err, Not(HasSubstr("cannot reach")));  // refused before connecting
  EXPECT_EQ(read_file(file), "precious");
  EXPECT_EQ(files_in(out.path()), std::vector<std::string>{"mine.json"});

  // With --force it goes on, and asks the (absent) daemon: the file is untouched still.
  const Output forced = cli.trace(out.path(), {"-o", file, "--force"});
  EXPECT_EQ(forced.status, 1) << forced.err;
  EXPECT_THAT(forced.err, HasSubstr("cannot reach steptraced"));
  EXPECT_EQ(read_file(file), "precious");
  EXPECT_EQ(files_in(out.path()), std::vector<std::string>{"mine.json"});

  // A directory is never replaced.
  fs::create_directory(out.file("dir.json"));
  const Output dir = cli.trace(out.path(), {"-o", "dir.json", "--force"});
  EXPECT_EQ(dir.status, 2) << dir.err;
  EXPECT_THAT(dir.err, HasSubstr("directory"));
}

TEST(CliTraceUsage, AStalePartialFileIsNotTakenOver) {
  TempDir out;
  TraceCli cli(out.file("absent.sock"));
  std::ofstream(out.file("t.json.partial")) << "someone else's";
  const Output r = cli.trace(out.path(), {"-o", "t.json"});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_THAT(r.err, HasSubstr("t.json.partial"));
  EXPECT_EQ(read_file(out.file("t.json.partial")), "someone else's");
  // A symlink in its place is not followed either.
  fs::remove(out.file("t.json.partial"));
  fs::create_symlink(out.file("target"), out.file("t.json.partial"));
  const Output link = cli.trace(out.path(), {"-o", "t.json"});
  EXPECT_EQ(link.status, 2) << link.err;
  EXPECT_FALSE(fs::exists(out.file("target")));
}

TEST(CliTraceUsage, UnreachableDaemonExitsOneAndLeavesNothing) {
  TempDir out;
  const std::string socket = out.file("absent.sock");
  TraceCli cli(socket);
  const Output r = cli.trace(out.path(), {"--last", "2.5"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_THAT(r.err, HasSubstr(socket));
  EXPECT_THAT(r.err, HasSubstr("systemctl start steptraced.socket"));
  EXPECT_TRUE(files_in(out.path()).empty());
}

TEST(CliTraceUsage, HelpSaysWhatATraceIsAndHowToOpenIt) {
  TempDir out;
  TraceCli cli(out.file("absent.sock"));
  const Output r = cli.trace(out.path(), {"--help"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("flight recorder"));
  EXPECT_THAT(r.out, HasSubstr("steptrace-trace-HOST-YYYYmmdd-HHMMSS.json"));
  EXPECT_THAT(r.out, HasSubstr("https://ui.perfetto.dev"));
  EXPECT_THAT(r.out, HasSubstr("https://www.speedscope.app"));
  for (const char* option :
       {"--pid", "--job", "--children", "--max-mb", "--last", "--for", "-o", "--force", "merge"}) {
    EXPECT_THAT(r.out, HasSubstr(option)) << option;
  }
  const Output top = run_in(TempDir(), out.path(), {STEPTRACE_CLI_BIN, "--help"});
  EXPECT_THAT(top.out, HasSubstr("  trace "));
}

// ---------------------------------------------------------------------------------
// Against a scripted stand-in for steptraced: it accepts one connection, reads the
// command line and answers with `script`, each piece after its pause, then closes. It
// gives what the real daemon does not on demand: error replies, slow, stalled and
// cut-short replies. A `report ...` line before that (the CLI checking --pid) is answered
// with a report of pids 7, 10 and 12 on its own connection.

class ScriptedDaemon {
 public:
  struct Piece {
    int pause_ms = 0;
    std::string data;
  };

  ScriptedDaemon(std::string path, std::vector<Piece> script)
      : path_(std::move(path)), script_(std::move(script)) {
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path_.c_str(), sizeof addr.sun_path - 1);
    if (listen_fd_ < 0 ||
        ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
        ::listen(listen_fd_, 4) != 0) {
      ADD_FAILURE() << "cannot listen on " << path_ << ": " << std::strerror(errno);
      return;
    }
    thread_ = std::thread([this] { serve(); });
  }
  ~ScriptedDaemon() {
    stop_ = true;
    ::shutdown(listen_fd_, SHUT_RDWR);  // wakes accept()
    if (thread_.joinable()) thread_.join();
    ::close(listen_fd_);
  }
  ScriptedDaemon(const ScriptedDaemon&) = delete;
  ScriptedDaemon& operator=(const ScriptedDaemon&) = delete;

  std::string line() {
    std::lock_guard lock(mutex_);
    return line_;
  }

 private:
  void serve() {
    int fd = -1;
    std::string received;
    for (;;) {
      fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      received.clear();
      char buffer[4096];
      while (received.find('\n') == std::string::npos) {
        const ssize_t n = ::read(fd, buffer, sizeof buffer);
        if (n <= 0) break;
        received.append(buffer, static_cast<std::size_t>(n));
      }
      if (received.rfind("report", 0) != 0) break;
      const std::string report = R"({"processes":[{"pid":7},{"pid":10},{"pid":12}]})"
                                 "\n";
      ::send(fd, report.data(), report.size(), MSG_NOSIGNAL);
      ::close(fd);
    }
    {
      std::lock_guard lock(mutex_);
      line_ = received.substr(0, received.find('\n'));
    }
    for (const Piece& piece : script_) {
      const auto until = Clock::now() + std::chrono::milliseconds(piece.pause_ms);
      while (!stop_ && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      if (stop_ || ::send(fd, piece.data.data(), piece.data.size(), MSG_NOSIGNAL) < 0) break;
    }
    ::close(fd);
  }

  std::string path_;
  std::vector<Piece> script_;
  int listen_fd_ = -1;
  std::atomic<bool> stop_{false};
  std::mutex mutex_;
  std::string line_;
  std::thread thread_;
};

// The document cut into `parts` pieces, each sent after `pause_ms`.
std::vector<ScriptedDaemon::Piece> in_pieces(std::string_view doc, int parts, int pause_ms) {
  std::vector<ScriptedDaemon::Piece> pieces;
  const std::size_t size = (doc.size() + parts - 1) / parts;
  for (std::size_t at = 0; at < doc.size(); at += size) {
    pieces.push_back({pause_ms, std::string(doc.substr(at, size))});
  }
  return pieces;
}

class CliTraceScripted : public ::testing::Test {
 protected:
  std::string socket() const { return sockets_.file("s.sock"); }
  TempDir sockets_;
  TempDir out_;
  TraceCli cli_{sockets_.file("s.sock")};
};

TEST_F(CliTraceScripted, ErrorReplyExitsOneAndLeavesNoPartialFile) {
  ScriptedDaemon daemon(socket(), {{0, "error: bad --last '99'\n"}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--last", "99"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.err, "steptrace: steptraced answered: error: bad --last '99'\n");
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(daemon.line(), "trace --last 99");
  EXPECT_TRUE(files_in(out_.path()).empty());
}

TEST_F(CliTraceScripted, ErrorReplyInTinyPiecesToStdoutWritesNothing) {
  // "error:" split across reads is still recognised before anything is written.
  ScriptedDaemon daemon(socket(), {{0, "e"}, {50, "rr"}, {50, "or: busy\n"}});
  const Output r = cli_.trace(out_.path(), {"-o", "-"});
  EXPECT_EQ(r.status, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "steptrace: steptraced answered: error: busy\n");
}

// A pid goes to the daemon as it reads it: 010 is pid 10 (CLI11 alone would send 8).
TEST_F(CliTraceScripted, PidsAreSentInPlainDecimal) {
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument)}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--pid", "010", "--last", "0.5"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(daemon.line(), "trace --pid 10 --last 0.5");
}

// Issue 28: trace and report agree on unknown pids: exit 1, no file, no trace asked.
TEST_F(CliTraceScripted, UnknownPidExitsOneWithoutAFile) {
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument)}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--pid", "7", "--pid", "999999"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("tracks no process with pid 999999"));
  EXPECT_THAT(r.err, HasSubstr("nothing was written"));
  EXPECT_TRUE(files_in(out_.path()).empty());
  EXPECT_EQ(daemon.line(), "");  // the trace was never asked
}

// Past --max-mb the trace is refused and nothing is left behind.
TEST_F(CliTraceScripted, ATracePastMaxMbIsRefused) {
  std::string doc = "{\"traceEvents\":[\n";
  while (doc.size() < 1'500'000) {
    doc += R"({"ph":"X","cat":"step","name":"Forward","pid":7,"tid":7,"ts":1.000,"dur":2.000},)"
           "\n";
  }
  doc += R"({"ph":"X","cat":"step","name":"Forward","pid":7,"tid":7,"ts":1.000,"dur":2.000})"
         "\n],\"otherData\":{}}\n";
  {
    ScriptedDaemon daemon(socket(), in_pieces(doc, 8, 0));
    const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--max-mb", "1"});
    EXPECT_EQ(r.status, 1);
    EXPECT_THAT(r.err, HasSubstr("larger than 1 MB"));
    EXPECT_THAT(r.err, HasSubstr("--max-mb 0"));
    EXPECT_TRUE(files_in(out_.path()).empty());
  }
  ::unlink(socket().c_str());
  ScriptedDaemon daemon(socket(), in_pieces(doc, 8, 0));
  const Output r = cli_.trace(out_.path(), {"-o", "t.json"});  // the default: 50 MB
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(out_.file("t.json")), doc);
}

TEST_F(CliTraceScripted, WritesTheDocumentAndCountsItsEvents) {
  ScriptedDaemon daemon(socket(), in_pieces(kDocument, 4, 0));
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--pid", "7", "--pid", "12"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(daemon.line(), "trace --pid 7 --pid 12");
  EXPECT_EQ(read_file(out_.file("t.json")), kDocument);
  EXPECT_EQ(files_in(out_.path()), std::vector<std::string>{"t.json"});
  EXPECT_EQ(r.err, "wrote t.json (" + std::to_string(kDocument.size()) +
                       " bytes, 3 events); open it in https://ui.perfetto.dev (\"Open trace "
                       "file\") or https://www.speedscope.app\n");
  EXPECT_EQ(r.out, "");
  struct stat st {};
  ASSERT_EQ(::stat(out_.file("t.json").c_str(), &st), 0);
  const mode_t mask = ::umask(0);
  ::umask(mask);
  EXPECT_EQ(st.st_mode & 0777, 0644 & ~mask);
}

TEST_F(CliTraceScripted, DashWritesToStdout) {
  ScriptedDaemon daemon(socket(), in_pieces(kDocument, 3, 0));
  const Output r = cli_.trace(out_.path(), {"-o", "-"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(r.out, kDocument);
  EXPECT_THAT(r.err, StartsWith("wrote standard output ("));
  EXPECT_TRUE(files_in(out_.path()).empty());
}

TEST_F(CliTraceScripted, DefaultFileNameInTheCurrentDirectory) {
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument)}});
  const Output r = cli_.trace(out_.path(), {});
  ASSERT_EQ(r.status, 0) << r.err;
  const auto names = files_in(out_.path());
  ASSERT_EQ(names.size(), 1u);
  EXPECT_TRUE(std::regex_match(names[0],
                               std::regex(R"(steptrace-trace-[A-Za-z0-9._-]+-\d{8}-\d{6}\.json)")))
      << names[0];
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  if (std::string_view(host).find_first_not_of(
          "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") ==
      std::string_view::npos) {
    EXPECT_THAT(names[0], StartsWith(std::string("steptrace-trace-") + host + "-"));
  }
  EXPECT_THAT(r.err, StartsWith("wrote " + names[0] + " ("));
  EXPECT_EQ(read_file(out_.file(names[0])), kDocument);
}

TEST_F(CliTraceScripted, ForceReplacesAnExistingFile) {
  std::ofstream(out_.file("t.json")) << "old";
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument)}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--force"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(out_.file("t.json")), kDocument);
  EXPECT_EQ(files_in(out_.path()), std::vector<std::string>{"t.json"});
}

// --timeout bounds each wait, not the reply: one flowing for longer is fine.
TEST_F(CliTraceScripted, ASlowReplyLongerThanTheTimeoutIsFine) {
  ScriptedDaemon daemon(socket(), in_pieces(kDocument, 6, 300));
  // The global --timeout before the subcommand (the other tests give it after).
  const Output r =
      run_in(TempDir(), out_.path(),
             {STEPTRACE_CLI_BIN, "--socket", socket(), "--timeout", "1", "trace", "-o", "t.json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_GT(r.seconds, 1.5);  // longer than --timeout in all
  EXPECT_EQ(read_file(out_.file("t.json")), kDocument);
}

TEST_F(CliTraceScripted, AStallMidReplyTimesOutAndLeavesNothing) {
  const std::size_t half = kDocument.size() / 2;
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument.substr(0, half))},
                                   {5000, std::string(kDocument.substr(half))}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json", "--timeout", "0.5"});
  EXPECT_EQ(r.status, 1);
  EXPECT_LT(r.seconds, 4.0);
  EXPECT_THAT(r.err, HasSubstr("stopped sending"));
  EXPECT_THAT(r.err, HasSubstr("500 ms"));
  EXPECT_TRUE(files_in(out_.path()).empty());
}

TEST_F(CliTraceScripted, AReplyCutShortIsNotSaved) {
  ScriptedDaemon daemon(socket(), {{0, std::string(kDocument.substr(0, kDocument.size() / 2))}});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("not a complete"));
  EXPECT_TRUE(files_in(out_.path()).empty());
}

TEST_F(CliTraceScripted, NoAnswerIsAFailure) {
  ScriptedDaemon daemon(socket(), {});
  const Output r = cli_.trace(out_.path(), {"-o", "t.json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("without answering"));
  EXPECT_TRUE(files_in(out_.path()).empty());
}

// --for S: the daemon answers after S seconds; the first byte may take S + --timeout.
TEST_F(CliTraceScripted, ForWaitsItsSecondsBeforeTheTimeoutCounts) {
  ScriptedDaemon daemon(socket(), {{1400, std::string(kDocument)}});
  const Output r = cli_.trace(out_.path(), {"--for", "1", "--timeout", "0.6", "-o", "t.json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(daemon.line(), "trace --for 1");
  EXPECT_EQ(read_file(out_.file("t.json")), kDocument);

  // ... and no longer.
  ScriptedDaemon late(sockets_.file("s2.sock"), {{3000, std::string(kDocument)}});
  const Output timed_out = run_in(TempDir(), out_.path(),
                                  {STEPTRACE_CLI_BIN, "--socket", sockets_.file("s2.sock"), "trace",
                                   "--for", "1", "--timeout", "0.5", "-o", "v.json"});
  EXPECT_EQ(timed_out.status, 1);
  EXPECT_THAT(timed_out.err, HasSubstr("within 1500 ms"));
  EXPECT_FALSE(fs::exists(out_.file("v.json")));
  EXPECT_FALSE(fs::exists(out_.file("v.json.partial")));
}

TEST_F(CliTraceScripted, InterruptedRunRemovesItsPartialFile) {
  ScriptedDaemon daemon(socket(), {{0, "{\"traceEvents\":[\n"}, {20000, "]}\n"}});
  std::vector<std::string> argv{STEPTRACE_CLI_BIN,   "--socket",  socket(), "trace", "-o",
                                out_.file("t.json"), "--timeout", "30"};
  const pid_t pid = steptrace::testing::spawn_process(argv);
  ASSERT_GT(pid, 0);
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!fs::exists(out_.file("t.json.partial")) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(fs::exists(out_.file("t.json.partial")));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ::kill(pid, SIGINT);
  EXPECT_EQ(steptrace::testing::wait_or_kill(pid, 10000), 128 + SIGINT);
  EXPECT_TRUE(files_in(out_.path()).empty());
}

// ---------------------------------------------------------------------------------
// Against the real steptraced. The daemon's `trace` command may not exist yet: a daemon
// without it answers `error: unknown command 'trace'`, which the first test checks; the
// others are for the command as specified (proto/PROTOCOL.md, section 10).

class CliTraceLive : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(daemon_.start()) << daemon_.log(); }

  // Runs the C example against the daemon; its pid, 0 when it failed.
  int run_minimal_c(std::vector<std::string> env = {}) {
#ifdef MINIMAL_C_BIN
    const std::string out = logs_.file("minimal.out");
    env.push_back("STEPTRACE_SOCKET=" + daemon_.socket());
    const int status = steptrace::testing::run_process(
        {"/bin/sh", "-c", std::string("exec \"$0\" > ") + out, MINIMAL_C_BIN}, env);
    const std::string text = read_file(out);
    const auto pos = text.find("pid ");
    if (status != 0 || pos == std::string::npos) return 0;
    return std::atoi(text.c_str() + pos + 4);
#else
    (void)env;
    return 0;
#endif
  }

  // The trace document in `path`: parsed, with a traceEvents array.
  json trace_document(const std::string& text) {
    json doc = json::parse(text, nullptr, false);
    EXPECT_TRUE(doc.is_object()) << text.substr(0, 2000);
    if (!doc.is_object()) return json::object({{"traceEvents", json::array()}});
    EXPECT_TRUE(doc["traceEvents"].is_array());
    return doc;
  }

  TempDir logs_;
  TempDir out_;
  DaemonProcess daemon_{logs_.file("d.sock"), {"--state-dir", logs_.path()}};
  TraceCli cli_{logs_.file("d.sock")};
};

TEST_F(CliTraceLive, WritesATraceFileOfTheCExample) {
  const int pid = run_minimal_c();
  const Output r = cli_.trace(out_.path(), {"-o", "t.json"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(files_in(out_.path()), std::vector<std::string>{"t.json"});
  const std::string text = read_file(out_.file("t.json"));
  const json doc = trace_document(text);
  EXPECT_EQ(r.err, "wrote t.json (" + std::to_string(text.size()) + " bytes, " +
                       std::to_string(doc["traceEvents"].size()) +
                       " events); open it in https://ui.perfetto.dev (\"Open trace file\") or "
                       "https://www.speedscope.app\n");
#ifdef MINIMAL_C_BIN  // built with the examples: the C example's spans must be there
  ASSERT_GT(pid, 0);
  {
    EXPECT_THAT(text, HasSubstr("[" + std::to_string(pid) + "]"));  // its track, `comm [pid]`
    bool forward = false;
    for (const auto& e : doc["traceEvents"]) {
      forward = forward || (e.value("name", "") == "Forward" && e.value("pid", 0) == pid);
    }
    EXPECT_TRUE(forward) << text.substr(0, 4000);
  }
#endif
}

TEST_F(CliTraceLive, DashWritesTheDocumentToStdout) {
  run_minimal_c();
  const Output r = cli_.trace(out_.path(), {"-o", "-", "--last", "60"});
  ASSERT_EQ(r.status, 0) << r.err;
  EXPECT_THAT(r.err, StartsWith("wrote standard output ("));
  trace_document(r.out);
  EXPECT_TRUE(files_in(out_.path()).empty());
}

TEST_F(CliTraceLive, OnlyTheProcessesAsked) {
  const int first = run_minimal_c();
  const int second = run_minimal_c();
  if (first == 0 || second == 0) GTEST_SKIP() << "needs the C example (examples built)";
  const Output r = cli_.trace(out_.path(), {"-o", "-", "--pid", std::to_string(second)});
  ASSERT_EQ(r.status, 0) << r.err;
  const json doc = trace_document(r.out);
  bool seen_second = false;
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_NE(e.value("pid", 0), first) << e.dump();
    seen_second = seen_second || e.value("pid", 0) == second;
  }
  EXPECT_TRUE(seen_second);
}

// --for records on demand, even with the standing window off.
TEST(CliTraceLiveFor, RecordsForItsSecondsWithTheStandingWindowOff) {
  TempDir logs;
  TempDir out;
  const std::string config = logs.file("steptraced.json");
  std::ofstream(config) << "{\"flight_recorder_bytes\": 0}\n";
  DaemonProcess daemon(logs.file("d.sock"), {"--state-dir", logs.path(), "--config", config});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::vector<std::string> argv{
      STEPTRACE_CLI_BIN, "--socket", daemon.socket(), "trace", "--for", "2", "-o",
      out.file("t.json")};
  const auto start = Clock::now();
  const pid_t cli = steptrace::testing::spawn_process(argv);
  ASSERT_GT(cli, 0);
#ifdef MINIMAL_C_BIN
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const int c =
      steptrace::testing::run_process({MINIMAL_C_BIN}, {"STEPTRACE_SOCKET=" + daemon.socket()});
  EXPECT_EQ(c, 0);
#endif
  EXPECT_EQ(steptrace::testing::wait_or_kill(cli, 30000), 0);
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  const std::string text = read_file(out.file("t.json"));
  const json doc = json::parse(text, nullptr, false);
  ASSERT_TRUE(doc.is_object()) << text.substr(0, 2000);
  ASSERT_TRUE(doc["traceEvents"].is_array());
#ifdef MINIMAL_C_BIN
  bool forward = false;
  for (const auto& e : doc["traceEvents"]) forward = forward || e.value("name", "") == "Forward";
  EXPECT_TRUE(forward) << text.substr(0, 4000);
#endif
}

// --job: every process of the job, only those; an unknown job or pid: exit 1, no file.
TEST_F(CliTraceLive, JobTakesItsProcessesAndUnknownOnesFail) {
  const int first = run_minimal_c({"STEPTRACE_JOB=jobA", "RANK=0"});
  const int second = run_minimal_c({"STEPTRACE_JOB=jobA", "RANK=1"});
  const int other = run_minimal_c({"STEPTRACE_JOB=jobB"});
  if (first == 0 || second == 0 || other == 0) GTEST_SKIP() << "needs the C example";
  const Output r = cli_.trace(out_.path(), {"-o", "-", "--job", "jobA"});
  ASSERT_EQ(r.status, 0) << r.err;
  std::set<int> pids;
  const json doc = trace_document(r.out);
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("ph", "") == "X") pids.insert(e.value("pid", 0));
  }
  EXPECT_EQ(pids, (std::set<int>{first, second})) << r.out.substr(0, 3000);

  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--job", "nosuchjob"},
        {"--pid", "999999"},
        {"--pid", "999999", "--children"},  // the daemon finds none: an error, no file
        {"--job", std::to_string(::getuid() + 1) + ":jobA"}}) {
    const Output bad = cli_.trace(out_.path(), [&] {
      std::vector<std::string> a{"-o", "t.json"};
      a.insert(a.end(), args.begin(), args.end());
      return a;
    }());
    EXPECT_EQ(bad.status, 1) << args[1] << ": " << bad.err;
    EXPECT_THAT(bad.err, Not(HasSubstr("wrote"))) << args[1];
    EXPECT_TRUE(files_in(out_.path()).empty()) << args[1];
  }
}

TEST(CliTracePieces, PidsOfAReport) {
  EXPECT_EQ(steptrace::cli::pids_of_report(R"({"processes":[{"pid":3},{"pid":9,"x":1}]})"),
            (std::vector<int>{3, 9}));
  EXPECT_EQ(steptrace::cli::pids_of_report(R"({"processes":[]})"), std::vector<int>{});
  EXPECT_FALSE(steptrace::cli::pids_of_report("not json"));
  EXPECT_FALSE(steptrace::cli::pids_of_report(R"({"processes":[{"pid":"3"}]})"));
  EXPECT_FALSE(steptrace::cli::pids_of_report(R"([1,2])"));
}

// ---------------------------------------------------------------------------------
// trace merge

// A node's document as steptraced writes it: origin at `anchor` Unix ns; `spans` are
// (pid, name, ts ns, dur ns) on thread pid.
std::string node_document(
    const std::string& host, std::int64_t anchor,
    const std::vector<std::tuple<int, std::string, std::int64_t, std::int64_t>>& spans,
    const std::map<int, std::string>& names) {
  json events = json::array();
  for (const auto& [pid, name] : names) {
    events.push_back({{"ph", "M"},
                      {"cat", "__metadata"},
                      {"name", "process_name"},
                      {"pid", pid},
                      {"tid", 0},
                      {"ts", 0},
                      {"args", {{"name", name}}}});
  }
  for (const auto& [pid, name, ts, dur] : spans) {
    events.push_back({{"ph", "X"},
                      {"cat", "step"},
                      {"name", name},
                      {"pid", pid},
                      {"tid", pid},
                      {"ts", static_cast<double>(ts) / 1000.0},
                      {"dur", static_cast<double>(dur) / 1000.0}});
  }
  json doc = {{"traceEvents", events},
              {"otherData",
               {{"host", host},
                {"ts_origin_ns", 5000},
                {"wall_clock_offset_ns", anchor - 5000},
                {"ts_origin_unix_ns", anchor}}}};
  return doc.dump();
}

struct MergedSpan {
  std::string track;
  std::string name;
  std::int64_t ts;
  std::int64_t end;
};

std::vector<MergedSpan> merged_spans(const json& doc) {
  std::map<std::int64_t, std::string> tracks;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") tracks[e["pid"]] = e["args"]["name"];
  }
  std::vector<MergedSpan> out;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] != "X") continue;
    const double ts = e["ts"].get<double>();
    out.push_back({tracks[e["pid"]], e["name"], std::llround(ts * 1000),
                   std::llround((ts + e["dur"].get<double>()) * 1000)});
  }
  return out;
}

TEST(CliTraceMerge, JoinsNodesOnTheirWallClockAnchors) {
  const std::int64_t t0 = 1'700'000'000'000'000'000;
  const std::string a = node_document(
      "node1", t0,
      {{40, "Forward", 1000, 500}, {40, "Backward", 1500, 700}, {41, "Forward", 1000, 900}},
      {{40, "python3 [40] job j (uid 1000) rank 1"}, {41, "python3 [41] job j (uid 1000) rank 0"}});
  // node2's origin is 2 us later; its pid 40 is another process.
  const std::string b = node_document("node2", t0 + 2000, {{40, "Forward", 0, 300}},
                                      {{40, "python3 [40] job j (uid 1000) rank 2 (exited)"}});
  const auto merged = steptrace::cli::merge_traces({a, b}, {"a.json", "b.json"}, std::nullopt);
  ASSERT_EQ(merged.error, "");
  const json doc = json::parse(merged.document);
  EXPECT_EQ(doc["otherData"]["ts_origin_unix_ns"], t0 + 1000);  // the earliest event
  const auto spans = merged_spans(doc);
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[0].track, "node1 / rank 1 / python3 [40]");
  EXPECT_EQ(spans[0].ts, 0);
  EXPECT_EQ(spans[1].ts, spans[0].end);  // touching stays touching
  EXPECT_EQ(spans[2].track, "node1 / rank 0 / python3 [41]");
  EXPECT_EQ(spans[3].track, "node2 / rank 2 / python3 [40] (exited)");
  EXPECT_EQ(spans[3].ts, 1000);  // 2 us later, less node1's 1 us lead
  // Distinct pids per node, sorted by rank.
  std::map<std::string, std::int64_t> sort_of;
  std::map<std::int64_t, std::string> track_of;
  for (const auto& e : doc["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") track_of[e["pid"]] = e["args"]["name"];
  }
  for (const auto& e : doc["traceEvents"]) {
    if (e["name"] == "process_sort_index") sort_of[track_of[e["pid"]]] = e["args"]["sort_index"];
  }
  EXPECT_EQ(track_of.size(), 3u);
  EXPECT_EQ(sort_of["node1 / rank 0 / python3 [41]"], 0);
  EXPECT_EQ(sort_of["node2 / rank 2 / python3 [40] (exited)"], 2);
  for (const auto& e : doc["traceEvents"]) {
    EXPECT_TRUE(e.contains("cat") && e.contains("ts")) << e;
  }
}

TEST(CliTraceMerge, AlignStepMakesTheKthSpansStartTogether) {
  const std::int64_t t0 = 1'700'000'000'000'000'000;
  // node2's clock is 3 s off: its wall anchor says nothing useful.
  const std::string a = node_document(
      "node1", t0, {{40, "Forward", 100, 50}, {40, "Forward", 1000, 50}}, {{40, "p [40] rank 0"}});
  const std::string b = node_document("node2", t0 + 3'000'000'000,
                                      {{50, "Forward", 7000, 50}, {50, "Forward", 7400, 50}},
                                      {{50, "p [50] rank 1"}});
  ASSERT_TRUE(steptrace::cli::parse_align_step("Forward:2"));
  const auto merged = steptrace::cli::merge_traces({a, b}, {"a", "b"},
                                                   steptrace::cli::parse_align_step("Forward:2"));
  ASSERT_EQ(merged.error, "");
  const auto spans = merged_spans(json::parse(merged.document));
  ASSERT_EQ(spans.size(), 4u);
  EXPECT_EQ(spans[1].ts, spans[3].ts);  // the second Forward of each node
  EXPECT_EQ(spans[3].ts - spans[2].ts, 400);
  EXPECT_GE(std::min(spans[0].ts, spans[2].ts), 0);

  const auto missing = steptrace::cli::merge_traces({a, b}, {"a", "b"},
                                                    steptrace::cli::parse_align_step("Forward:3"));
  EXPECT_THAT(missing.error, HasSubstr("a has no span number 3 of step Forward"));
  EXPECT_FALSE(steptrace::cli::parse_align_step("Forward:0"));
  EXPECT_FALSE(steptrace::cli::parse_align_step(":2"));
  EXPECT_FALSE(steptrace::cli::parse_align_step("Forward:x"));
  EXPECT_EQ(steptrace::cli::parse_align_step("Forward")->index, 1u);
}

// --align-step counts the K-th span per rank, not over the file: two nodes of several
// ranks each whose clocks are 3 s apart (far more than the spans), their ranks' spans
// interleaved. Each node's align point is the median over its ranks of their K-th start,
// so a late rank (rank 4) does not move its node, a process with no rank counts as one,
// and a rank with fewer than K spans is left out.
// A process's comm and job id are its own to choose: "] rank 9" in them names no rank,
// the daemon's parts are read from the end of the name.
TEST(CliTraceMerge, ACommOrJobThatLooksLikeARankIsNotTakenForOne) {
  const std::int64_t t0 = 1'700'000'000'000'000'000;
  const std::string a = node_document(
      "node1", t0, {{40, "Forward", 100, 50}, {41, "Forward", 130, 50}, {42, "Forward", 160, 50}},
      {{40, "a] rank 9 [40] job j] rank 5 (uid 1000) rank 0"},
       {41, "[41] job [41] rank 8 (uid 7) rank 1 (exited)"},
       {42, "x rank 3 [42]"}});
  const auto merged = steptrace::cli::merge_traces({a}, {"a"}, std::nullopt);
  ASSERT_EQ(merged.error, "");
  std::set<std::string> tracks;
  for (const auto& span : merged_spans(json::parse(merged.document))) tracks.insert(span.track);
  EXPECT_EQ(tracks,
            (std::set<std::string>{"node1 / rank 0 / a] rank 9 [40]",
                                   "node1 / rank 1 / [41] (exited)", "node1 / x rank 3 [42]"}));
}

TEST(CliTraceMerge, AlignStepAlignsTheMedianRankOfEachNode) {
  const std::int64_t t0 = 1'700'000'000'000'000'000;
  const std::string a =
      node_document("node1", t0,
                    {{40, "Forward", 100, 50},
                     {41, "Forward", 130, 50},
                     {60, "Forward", 50, 50},
                     {40, "Forward", 1000, 50},
                     {41, "Forward", 1030, 50},
                     {60, "Forward", 950, 50},
                     {40, "Backward", 1100, 50}},
                    {{40, "p [40] rank 0"}, {41, "p [41] rank 1"}, {60, "tool [60]"}});
  // node2's clock is 3 s ahead and its times run from another origin.
  const std::string b = node_document(
      "node2", t0 + 3'000'000'000,
      {{50, "Forward", 7000, 50},
       {51, "Forward", 7020, 50},
       {52, "Forward", 7500, 50},
       {53, "Forward", 7010, 50},
       {50, "Forward", 7900, 50},
       {51, "Forward", 7920, 50},
       {52, "Forward", 8500, 50}},
      {{50, "p [50] rank 2"}, {51, "p [51] rank 3"}, {52, "p [52] rank 4"}, {53, "p [53] rank 5"}});
  const auto merged = steptrace::cli::merge_traces({a, b}, {"a", "b"},
                                                   steptrace::cli::parse_align_step("Forward:2"));
  ASSERT_EQ(merged.error, "");
  const json doc = json::parse(merged.document);
  std::map<std::string, std::vector<std::int64_t>> forward_of;  // track -> its Forward starts
  for (const auto& span : merged_spans(doc)) {
    if (span.name == "Forward") forward_of[span.track].push_back(span.ts);
  }
  for (auto& [track, starts] : forward_of) std::sort(starts.begin(), starts.end());
  // node1's second Forwards: 1000 (rank 0), 1030 (rank 1), 950 (no rank): median 1000.
  // node2's: 7900 (rank 2), 7920 (rank 3), 8500 (rank 4, late); rank 5 has one: 7920.
  const std::int64_t node1_point = forward_of.at("node1 / rank 0 / p [40]")[1];
  EXPECT_EQ(forward_of.at("node2 / rank 3 / p [51]")[1], node1_point);
  EXPECT_EQ(forward_of.at("node1 / rank 1 / p [41]")[1] - node1_point, 30);
  EXPECT_EQ(forward_of.at("node2 / rank 4 / p [52]")[1] - node1_point, 580);
  EXPECT_EQ(forward_of.at("node1 / tool [60]")[0], 0);  // the earliest event starts at 0
  EXPECT_EQ(doc["otherData"]["aligned_on"], "Forward:2");
  EXPECT_EQ(doc["otherData"]["nodes"][0]["align_ranks"], 3);
  EXPECT_EQ(doc["otherData"]["nodes"][1]["align_ranks"], 3);
  EXPECT_EQ(doc["otherData"]["nodes"][1]["shift_ns"].get<std::int64_t>() -
                doc["otherData"]["nodes"][0]["shift_ns"].get<std::int64_t>(),
            1000 - 7920);
  // The wall-clock anchors would have put node2 3 s later.
  const auto by_clock = steptrace::cli::merge_traces({a, b}, {"a", "b"}, std::nullopt);
  ASSERT_EQ(by_clock.error, "");
  EXPECT_GT(merged_spans(json::parse(by_clock.document)).back().ts, 3'000'000'000);

  // Per rank, not per file: node1 has 6 Forwards in all, but no rank has a third.
  const auto third = steptrace::cli::merge_traces({a, b}, {"a", "b"},
                                                  steptrace::cli::parse_align_step("Forward:3"));
  EXPECT_THAT(third.error, HasSubstr("a has no span number 3 of step Forward to align on in "
                                     "any rank"));
}

TEST(CliTraceMerge, BadInputsAreClearErrorsAndWriteNothing) {
  TempDir dir;
  std::ofstream(dir.file("good.json"))
      << node_document("n", 1'000'000'000, {{1, "Forward", 0, 1}}, {{1, "p [1]"}});
  std::ofstream(dir.file("bad.json")) << "{\"traceEvents\":[";
  std::ofstream(dir.file("noanchor.json")) << R"({"traceEvents":[]})";
  TempDir logs;
  const auto merge = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "trace", "merge"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_in(logs, dir.path(), argv);
  };
  Output r = merge({"good.json", "bad.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("bad.json is not valid JSON"));
  r = merge({"good.json", "noanchor.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 1);
  EXPECT_THAT(r.err, HasSubstr("noanchor.json has no wall-clock anchor"));
  r = merge({"good.json", "absent.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 2) << r.err;
  r = merge({"good.json"});
  EXPECT_EQ(r.status, 2) << r.err;
  r = merge({"good.json", "--align-step", "Forward:0", "-o", "out.json"});
  EXPECT_EQ(r.status, 2) << r.err;
  EXPECT_FALSE(fs::exists(dir.file("out.json")));
  EXPECT_FALSE(fs::exists(dir.file("out.json.partial")));
  r = merge({"good.json", "good.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 0) << r.err;
  const json doc = json::parse(read_file(dir.file("out.json")));
  EXPECT_EQ(merged_spans(doc).size(), 2u);
  EXPECT_EQ(merged_spans(doc)[1].track, "n #2 / p [1]");
  r = merge({"good.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 2) << "exists: " << r.err;
}

// Files a hostile user hands over: fields of the wrong type, a rank of 300,000 digits,
// JSON nested 200,000 deep, times past 64 bits. Each is a clear error (exit 1) with
// nothing written, never a crash.
TEST(CliTraceMerge, HostileFilesAreRefusedNotCrashedOn) {
  TempDir dir;
  std::ofstream(dir.file("good.json"))
      << node_document("n", 1'000'000'000, {{1, "Forward", 0, 1}}, {{1, "p [1]"}});
  const std::string anchor = R"("otherData":{"ts_origin_unix_ns":1000000000)";
  const std::map<std::string, std::string> files = {
      {"host.json", "{\"traceEvents\":[]," + anchor + ",\"host\":7}}"},
      {"name.json",
       "{\"traceEvents\":[{\"ph\":\"X\",\"pid\":1,\"tid\":1,\"ts\":1,\"dur\":1,"
       "\"name\":5}]," +
           anchor + "}}"},
      {"rank.json",
       "{\"traceEvents\":[{\"ph\":\"M\",\"pid\":1,\"ts\":0,\"name\":"
       "\"process_name\",\"args\":{\"name\":\"p [1] rank " +
           std::string(300'000, '9') + "\"}}]," + anchor + "}}"},
      {"deep.json",
       "{\"traceEvents\":[{\"ph\":\"X\",\"pid\":1,\"ts\":1,\"args\":" + std::string(200'000, '[') +
           std::string(200'000, ']') + "}]," + anchor + "}}"},
      {"huge.json",
       "{\"traceEvents\":[{\"ph\":\"X\",\"pid\":1,\"tid\":1,\"ts\":1e300,"
       "\"dur\":1,\"name\":\"Forward\"}]," +
           anchor + "}}"},
  };
  TempDir logs;
  for (const auto& [name, text] : files) {
    std::ofstream(dir.file(name)) << text;
    const Output r = run_in(logs, dir.path(),
                            {STEPTRACE_CLI_BIN, "trace", "merge", "good.json", name, "--align-step",
                             "Forward", "-o", "out.json"});
    // A file that is readable after all (a host that is no string is left out) merges;
    // anything else is refused. Never a signal, never a file from a refused input.
    EXPECT_TRUE(r.status == 0 || r.status == 1) << name << ": " << r.status << " " << r.err;
    if (r.status == 1) {
      EXPECT_THAT(r.err, HasSubstr(name)) << r.err;
      EXPECT_FALSE(fs::exists(dir.file("out.json"))) << name;
    }
    EXPECT_FALSE(fs::exists(dir.file("out.json.partial"))) << name;
    fs::remove(dir.file("out.json"));
  }
}

// What the streaming (SAX) reader must refuse as the whole-document parse did: each is
// exit 1 with the file named and a reason, nothing written.
TEST(CliTraceMerge, StreamingReaderRefusesWhatTheDocumentParseRefused) {
  TempDir dir;
  std::ofstream(dir.file("good.json"))
      << node_document("n", 1'000'000'000, {{1, "Forward", 0, 1}}, {{1, "p [1]"}});
  const std::string anchor = R"("otherData":{"ts_origin_unix_ns":1000000000})";
  const std::string event = R"({"ph":"X","pid":1,"tid":1,"ts":1,"dur":1,"name":"Forward"})";
  const std::vector<std::tuple<std::string, std::string, std::string>> files = {
      {"utf8.json", "{\"traceEvents\":[{\"ph\":\"X\",\"pid\":1,\"name\":\"\xff\xfe\"}]," + anchor,
       "is not valid JSON"},
      {"overflow.json", R"({"traceEvents":[{"ph":"X","pid":1,"ts":1e400}],)" + anchor,
       "is not valid JSON"},
      {"nan.json", R"({"traceEvents":[{"ph":"X","pid":1,"ts":NaN}],)" + anchor,
       "is not valid JSON"},
      {"ts.json", R"({"traceEvents":[{"ph":"X","pid":1,"ts":-1}],)" + anchor,
       "\"ts\" is not a time"},
      {"dur.json", R"({"traceEvents":[{"ph":"X","pid":1,"ts":1,"dur":"1"}],)" + anchor,
       "\"dur\" is not a duration"},
      {"bigpid.json", R"({"traceEvents":[{"ph":"X","pid":99999999999999999999}],)" + anchor,
       "no integer \"pid\""},
      {"scalar.json", R"({"traceEvents":[7],)" + anchor, "an event is not an object"},
      {"array.json", R"({"traceEvents":[[1,2]],)" + anchor, "an event is not an object"},
      {"noph.json", R"({"traceEvents":[{"pid":1}],)" + anchor, "an event is not an object"},
      {"root.json", "[" + event + "]", "is not a trace document"},
      {"events.json", R"({"traceEvents":{"a":1},)" + anchor, "is not a trace document"},
      {"twice.json", "{\"traceEvents\":[],\"traceEvents\":[" + event + "]," + anchor,
       "is not a trace document"},
      {"other.json", "{\"traceEvents\":[" + event + "],\"otherData\":[1]}",
       "\"otherData\" is not an object"},
      {"deepother.json",
       "{\"traceEvents\":[],\"otherData\":{\"a\":" + std::string(100'000, '[') +
           std::string(100'000, ']') + "}}",
       "nests deeper than 64 levels"},
      {"deepskipped.json",
       "{\"traceEvents\":[],\"x\":" + std::string(100'000, '[') + std::string(100'000, ']') + "," +
           anchor,
       "nests deeper than 64 levels"},
      {"trailing.json", "{\"traceEvents\":[]," + anchor + " {}", "is not valid JSON"},
      {"cut.json", "{\"traceEvents\":[" + event, "is not valid JSON"},
  };
  TempDir logs;
  for (const auto& [name, text, reason] : files) {
    std::ofstream(dir.file(name)) << text;
    const Output r =
        run_in(logs, dir.path(),
               {STEPTRACE_CLI_BIN, "trace", "merge", "good.json", name, "-o", "out.json"});
    EXPECT_EQ(r.status, 1) << name << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr(name)) << name;
    EXPECT_THAT(r.err, HasSubstr(reason)) << name;
    EXPECT_FALSE(fs::exists(dir.file("out.json"))) << name;
    EXPECT_FALSE(fs::exists(dir.file("out.json.partial"))) << name;
  }
  // Members a trace does not use are skipped, whatever they hold; the events still merge.
  std::ofstream(dir.file("extra.json"))
      << "{\"x\":[1,{\"y\":null}],\"traceEvents\":[" + event + "],\"z\":true," + anchor + "}";
  const Output r = run_in(logs, dir.path(),
                          {STEPTRACE_CLI_BIN, "trace", "merge", "extra.json", "-o", "out.json"});
  EXPECT_EQ(r.status, 0) << r.err;
  const json doc = json::parse(read_file(dir.file("out.json")));
  ASSERT_EQ(merged_spans(doc).size(), 1u);
  EXPECT_EQ(merged_spans(doc)[0].name, "Forward");
  EXPECT_EQ(merged_spans(doc)[0].track, "extra.json / [1]");
}

// --max-mb as `trace` has it (default 50): past it nothing is written, to FILE or to
// standard output; 0 lifts the bound.
TEST(CliTraceMerge, MaxMbRefusesABiggerMergeAndWritesNothing) {
  TempDir dir;
  std::vector<std::tuple<int, std::string, std::int64_t, std::int64_t>> spans;
  for (int i = 0; i < 15'000; ++i) spans.emplace_back(1, "Forward", i * 1000, 900);
  std::ofstream(dir.file("big.json"))
      << node_document("n", 1'000'000'000, spans, {{1, "p [1] rank 0"}});
  TempDir logs;
  const auto merge = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "trace", "merge", "big.json", "big.json"};
    argv.insert(argv.end(), args.begin(), args.end());
    return run_in(logs, dir.path(), argv);
  };
  Output r = merge({"--max-mb", "1", "-o", "out.json"});  // ~2.4 MB merged
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_THAT(r.err, HasSubstr("larger than 1 MB"));
  EXPECT_THAT(r.err, HasSubstr("--max-mb 0"));
  EXPECT_FALSE(fs::exists(dir.file("out.json")));
  EXPECT_FALSE(fs::exists(dir.file("out.json.partial")));
  r = merge({"--max-mb", "1", "-o", "-"});
  EXPECT_EQ(r.status, 1) << r.err;
  EXPECT_EQ(r.out, "");
  r = merge({"--max-mb", "0", "-o", "-"});
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_GT(r.out.size(), 2'000'000u);
  EXPECT_EQ(merged_spans(json::parse(r.out)).size(), 30'000u);
  const std::string to_stdout = r.out;
  r = merge({"-o", "out.json"});  // the default, 50 MB, lets it through
  EXPECT_EQ(r.status, 0) << r.err;
  EXPECT_EQ(read_file(dir.file("out.json")), to_stdout);
}

}  // namespace
