#include "cli/trace_command.h"

#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <variant>

#include "proto/commands.h"

namespace steptrace::cli {
namespace {

constexpr std::string_view kErrorPrefix = "error:";
constexpr std::size_t kMaxErrorText = 4096;  // an error reply is one line; keep that much
constexpr const char* kOpenHint =
    "open it in https://ui.perfetto.dev (\"Open trace file\") or https://www.speedscope.app";

void say(const std::string& text) {
  std::fputs(text.c_str(), stderr);
  if (text.empty() || text.back() != '\n') std::fputc('\n', stderr);
  std::fflush(stderr);
}

std::string errno_text(int error) { return std::strerror(error); }

// ---- removal of FILE.partial on a fatal signal ------------------------------------

char g_partial_path[PATH_MAX];
volatile sig_atomic_t g_partial_armed = 0;

extern "C" void remove_partial_and_die(int sig) {
  if (g_partial_armed != 0) ::unlink(g_partial_path);
  ::signal(sig, SIG_DFL);
  ::raise(sig);
}

void arm_partial_cleanup(const std::string& path) {
  if (path.size() >= sizeof g_partial_path) return;  // cannot arm: left behind on a signal
  std::memcpy(g_partial_path, path.c_str(), path.size() + 1);
  g_partial_armed = 1;
  struct sigaction action {};
  action.sa_handler = remove_partial_and_die;
  sigemptyset(&action.sa_mask);
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &action, nullptr);
}

void disarm_partial_cleanup() { g_partial_armed = 0; }

// ---- the output -------------------------------------------------------------------

// Standard output, or FILE written as FILE.partial and renamed when complete. The
// destructor removes a partial file that was not committed.
class TraceOutput {
 public:
  TraceOutput() = default;
  TraceOutput(const TraceOutput&) = delete;
  TraceOutput& operator=(const TraceOutput&) = delete;
  ~TraceOutput() { discard(); }

  // Standard output.
  void open_stdout() { fd_ = STDOUT_FILENO; }

  // FILE.partial, after checking FILE. The exit status (kExitOk, or kExitUsage with the
  // reason printed).
  int open_file(const std::string& path, bool force) {
    const std::string partial = path + ".partial";
    struct stat st {};
    if (::lstat(path.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) {
        say("steptrace: " + path + " is a directory; name a file with -o");
        return kExitUsage;
      }
      if (!force) {
        say("steptrace: " + path +
            " already exists; choose another file with -o, or pass --force to replace it");
        return kExitUsage;
      }
    }
    constexpr int kFlags = O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC;
    fd_ = ::open(partial.c_str(), kFlags, 0644);
    if (fd_ < 0 && errno == EEXIST && force) {
      ::unlink(partial.c_str());  // a stale one of an interrupted run
      fd_ = ::open(partial.c_str(), kFlags, 0644);
    }
    if (fd_ < 0 && errno == EEXIST) {
      say("steptrace: " + partial +
          " already exists: another `steptrace trace` is writing it, or one was interrupted; "
          "remove it, choose another file with -o, or pass --force");
      return kExitUsage;
    }
    if (fd_ < 0) {
      say("steptrace: cannot create " + partial + ": " + errno_text(errno) +
          "; choose another file with -o (or -o - for standard output)");
      return kExitUsage;
    }
    // Only now is FILE.partial ours to remove.
    path_ = path;
    partial_ = partial;
    arm_partial_cleanup(partial_);
    return kExitOk;
  }

  bool is_file() const { return !path_.empty(); }
  const std::string& path() const { return path_; }
  const std::string& partial() const { return partial_; }
  std::string name() const { return is_file() ? path_ : "standard output"; }
  int error() const { return error_; }

  bool write(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error_ = n < 0 ? errno : EIO;
        return false;
      }
      data.remove_prefix(static_cast<std::size_t>(n));
    }
    return true;
  }

  // Makes FILE.partial FILE. False with the reason printed; the partial file is then
  // kept only when it is complete and only FILE's appearance stopped the rename.
  bool commit(bool force) {
    if (!is_file()) return true;
    const int synced = ::fsync(fd_) == 0 ? 0 : errno;
    const int closed = ::close(fd_) == 0 ? 0 : errno;
    fd_ = -1;
    if (synced != 0 || closed != 0) {
      const int error = synced != 0 ? synced : closed;
      say("steptrace: cannot write " + partial_ + ": " + errno_text(error));
      return false;
    }
    int rc = 0;
    if (force) {
      rc = ::rename(partial_.c_str(), path_.c_str());
    } else {
      rc = ::renameat2(AT_FDCWD, partial_.c_str(), AT_FDCWD, path_.c_str(), RENAME_NOREPLACE);
      if (rc != 0 && (errno == EINVAL || errno == ENOSYS)) {
        // No RENAME_NOREPLACE on this file system: a hard link fails as well if FILE exists.
        rc = ::link(partial_.c_str(), path_.c_str());
        if (rc == 0) ::unlink(partial_.c_str());
      }
    }
    if (rc != 0 && errno == EEXIST) {
      disarm_partial_cleanup();
      partial_.clear();  // keep it: it holds the whole trace
      say("steptrace: " + path_ + " appeared while the trace was being written; the trace is in " +
          path_ + ".partial (or pass --force to replace " + path_ + ")");
      return false;
    }
    if (rc != 0) {
      say("steptrace: cannot rename " + partial_ + " to " + path_ + ": " + errno_text(errno));
      return false;
    }
    disarm_partial_cleanup();
    partial_.clear();
    return true;
  }

  // Closes and removes FILE.partial (nothing for standard output or after commit()).
  void discard() {
    if (fd_ >= 0 && fd_ != STDOUT_FILENO) ::close(fd_);
    fd_ = -1;
    if (!partial_.empty()) {
      ::unlink(partial_.c_str());
      disarm_partial_cleanup();
      partial_.clear();
    }
  }

 private:
  int fd_ = -1;
  std::string path_;     // FILE; empty for standard output
  std::string partial_;  // FILE.partial while it is ours to remove
  int error_ = 0;
};

// Sorts the reply into an error line (kept in memory, bounded) or a document (written
// to the output and scanned as it passes).
class ReplyReader {
 public:
  // `max_bytes`: a document longer than this stops the reading (0: no bound).
  ReplyReader(TraceOutput& output, std::uint64_t max_bytes)
      : output_(output), max_bytes_(max_bytes) {}

  bool feed(std::string_view piece) {
    if (kind_ == Kind::kUnknown) {
      head_.append(piece);
      if (head_.size() < kErrorPrefix.size() &&
          kErrorPrefix.substr(0, head_.size()) == std::string_view(head_)) {
        return true;  // could still be "error:"
      }
      piece = head_;
      kind_ = head_.rfind(kErrorPrefix, 0) == 0 ? Kind::kError : Kind::kDocument;
      if (kind_ == Kind::kError) {
        error_.assign(head_, 0, kMaxErrorText);
        return true;
      }
      const bool ok = write(piece);
      head_.clear();
      return ok;
    }
    if (kind_ == Kind::kError) {
      if (error_.size() < kMaxErrorText)
        error_.append(piece.substr(0, kMaxErrorText - error_.size()));
      return true;
    }
    return write(piece);
  }

  // At the end of the reply: a head too short to tell is a (broken) document.
  void finish() {
    if (kind_ == Kind::kUnknown && !head_.empty()) {
      kind_ = Kind::kDocument;
      write(head_);
    }
  }

  bool is_error() const { return kind_ == Kind::kError; }
  std::string error_line() const {
    std::string line = error_.substr(0, error_.find('\n'));
    if (!line.empty() && line.back() == '\r') line.pop_back();
    return line;
  }
  const TraceDocumentScanner& scanner() const { return scanner_; }
  std::uint64_t written() const { return written_; }
  bool too_big() const { return too_big_; }

 private:
  enum class Kind { kUnknown, kError, kDocument };

  bool write(std::string_view piece) {
    if (max_bytes_ != 0 && written_ + piece.size() > max_bytes_) {
      too_big_ = true;
      return false;
    }
    scanner_.feed(piece);
    if (!output_.write(piece)) return false;
    written_ += piece.size();
    return true;
  }

  TraceOutput& output_;
  Kind kind_ = Kind::kUnknown;
  std::string head_;
  std::string error_;
  TraceDocumentScanner scanner_;
  std::uint64_t written_ = 0;
  std::uint64_t max_bytes_ = 0;
  bool too_big_ = false;
};

// ---- which processes -------------------------------------------------------------

// The pids of the `report --json` reply to `line`; nullopt with the reason said.
std::optional<std::vector<int>> ask_report(const SocketPath& socket, const std::string& line,
                                           std::chrono::milliseconds timeout) {
  CommandResult result = run_command(socket.path, line, timeout);
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    say(describe_failure(*failure, socket, line, timeout));
    return std::nullopt;
  }
  const std::string& reply = std::get<std::string>(result);
  if (reply.rfind(kErrorPrefix, 0) == 0) {
    say(std::string(kDaemonAnswered) + reply.substr(0, reply.find('\n')));
    return std::nullopt;
  }
  auto pids = pids_of_report(reply);
  if (!pids) {
    say("steptrace: steptraced at " + socket.path + " answered `" + line +
        "` with something that is not a report");
  }
  return pids;
}

// Checks that the daemon tracks each --pid (issue 28: an unknown pid is exit 1 and no
// file, as report says). --job and --children are the daemon's to resolve (PROTOCOL.md
// 10.5, "Which processes"): it answers an error when they take nothing. kExitOk, or the
// exit status with the reason said (nothing is written then).
int check_pids(const SocketPath& socket, const TraceRequest& request,
               std::chrono::milliseconds timeout) {
  const auto all = ask_report(socket, "report --json", timeout);
  if (!all) return kExitFailure;
  const std::set<int> known(all->begin(), all->end());
  for (const int pid : request.pids) {
    if (known.count(pid) == 0) {
      say("steptrace: steptraced at " + socket.path + " tracks no process with pid " +
          std::to_string(pid) + " (`steptrace report` lists those it does); nothing was written");
      return kExitFailure;
    }
  }
  return kExitOk;
}

// An error reply of a daemon older than --job and --children (they are additive).
bool older_daemon_refused(const std::string& error_line) {
  return error_line.find("unexpected argument '--job'") != std::string::npos ||
         error_line.find("unexpected argument '--children'") != std::string::npos;
}

std::string host_name() {
  char buffer[HOST_NAME_MAX + 1] = {};
  if (::gethostname(buffer, sizeof buffer - 1) != 0) return "";
  return buffer;
}

}  // namespace

std::string trace_command_line(const TraceRequest& request) {
  std::string line = "trace";
  std::set<int> seen;
  for (int pid : request.pids) {
    if (seen.insert(pid).second) line += " --pid " + std::to_string(pid);
  }
  if (request.children) line += " --children";
  if (!request.job.empty()) line += " --job " + request.job;
  if (!request.last.empty()) line += " --last " + request.last;
  if (!request.for_s.empty()) line += " --for " + request.for_s;
  return line;
}

std::optional<std::vector<int>> pids_of_report(std::string_view reply) {
  const nlohmann::json doc = nlohmann::json::parse(reply, nullptr, false);
  if (!doc.is_object()) return std::nullopt;
  const auto processes = doc.find("processes");
  if (processes == doc.end() || !processes->is_array()) return std::nullopt;
  std::vector<int> pids;
  for (const nlohmann::json& p : *processes) {
    const auto pid = p.is_object() ? p.find("pid") : p.end();
    if (pid == p.end() || !pid->is_number_integer()) return std::nullopt;
    pids.push_back(pid->get<int>());
  }
  return pids;
}

std::string default_trace_file_name(std::string_view host, const std::tm& local_time) {
  std::string safe;
  for (char c : host) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '.' || c == '_' || c == '-';
    safe += keep ? c : '_';
  }
  if (safe.empty()) safe = "localhost";
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y%m%d-%H%M%S", &local_time);
  return "steptrace-trace-" + safe + "-" + stamp + ".json";
}

void TraceDocumentScanner::feed(std::string_view piece) {
  for (const char c : piece) {
    if (in_string_) {
      if (escape_) {
        escape_ = false;
      } else if (c == '\\') {
        escape_ = true;
        // No key with an escape is taken for "traceEvents".
        if (stack_.size() == 1 && key_.size() <= kMaxKey) key_ += c;
      } else if (c == '"') {
        in_string_ = false;
        if (stack_.size() == 1) last_key_is_events_ = key_ == "traceEvents";
      } else if (stack_.size() == 1 && key_.size() <= kMaxKey) {
        key_ += c;
      }
      continue;
    }
    switch (c) {
      case ' ':
      case '\t':
      case '\r':
      case '\n':
        break;
      case '"':
        if (stack_.empty()) bad_ = true;
        in_string_ = true;
        key_.clear();
        break;
      case '{':
      case '[':
        if (stack_.empty() && (started_ || c != '{')) bad_ = true;
        if (stack_.size() >= kMaxDepth) {
          bad_ = true;
          break;
        }
        started_ = true;
        if (stack_.size() == 1 && c == '[' && last_key_is_events_ && !saw_events_) {
          in_events_ = true;
          saw_events_ = true;
        } else if (stack_.size() == 2 && in_events_ && c == '{') {
          ++events_;
        }
        stack_.push_back(c);
        break;
      case '}':
      case ']':
        if (stack_.empty() || stack_.back() != (c == '}' ? '{' : '[')) {
          bad_ = true;
          break;
        }
        stack_.pop_back();
        if (stack_.size() == 1) in_events_ = false;
        if (stack_.empty()) closed_ = true;
        break;
      default:
        if (stack_.empty()) bad_ = true;  // text outside the object
        break;
    }
  }
}

bool TraceDocumentScanner::complete() const {
  return closed_ && !bad_ && !in_string_ && saw_events_;
}

int run_trace(const SocketPath& socket, const TraceRequest& asked,
              std::chrono::milliseconds timeout) {
  const TraceRequest& request = asked;
  // --children: a --pid that is an untraced launcher (torchrun) of traced workers is
  // fine; the daemon says when it finds nothing.
  if (!request.pids.empty() && !request.children) {
    if (const int status = check_pids(socket, request, timeout); status != kExitOk) return status;
  }
  const std::string line = trace_command_line(request);
  TraceOutput output;
  if (request.output == "-") {
    output.open_stdout();
  } else {
    std::string path = request.output;
    if (path.empty()) {
      const std::time_t now = std::time(nullptr);
      std::tm local{};
      localtime_r(&now, &local);
      path = default_trace_file_name(host_name(), local);
    }
    if (const int status = output.open_file(path, request.force); status != kExitOk) {
      return status;
    }
  }

  // --for S: the daemon records for S seconds before it answers.
  std::chrono::milliseconds first_byte = timeout;
  if (!request.for_s.empty()) {
    const double seconds = proto::parse_seconds(request.for_s).value_or(0.0);
    first_byte += std::chrono::milliseconds(static_cast<long long>(std::ceil(seconds * 1000.0)));
  }

  ReplyReader reader(output, request.max_mb * 1'000'000);
  const ReplySink sink = [&reader](std::string_view piece) { return reader.feed(piece); };
  const StreamResult result = run_command_to(socket.path, line, timeout, sink, first_byte);
  if (const auto* failure = std::get_if<CommandFailure>(&result)) {
    if (reader.too_big()) {
      say("steptrace: the trace is larger than " + std::to_string(request.max_mb) +
          " MB, which viewers struggle with (a 98 MB one closed speedscope's tab); " +
          (output.is_file() ? std::string("nothing was written")
                            : std::string("what was written to standard output is incomplete")) +
          ". Narrow it (--last SECONDS, --pid, --job) or pass --max-mb 0 to write it all");
      return kExitFailure;
    }
    if (failure->error == std::errc::operation_canceled) {
      say("steptrace: cannot write " + (output.is_file() ? output.partial() : output.name()) +
          ": " + errno_text(output.error()));
    } else {
      say(describe_failure(*failure, socket, line, timeout));
    }
    return kExitFailure;  // ~TraceOutput removes the partial file
  }
  reader.finish();
  const std::uint64_t received = std::get<std::uint64_t>(result);
  if (received == 0) {
    say("steptrace: steptraced at " + socket.path + " closed the connection without answering `" +
        line + "`");
    return kExitFailure;
  }
  if (reader.is_error()) {
    say(std::string(kDaemonAnswered) + reader.error_line());
    if (older_daemon_refused(reader.error_line())) {
      say("steptrace: that steptraced is older than this steptrace (it does not take trace "
          "--job or --children): update it, or name the processes with --pid");
    }
    return kExitFailure;
  }
  if (!reader.scanner().complete()) {
    say("steptrace: the reply of steptraced at " + socket.path + " to `" + line + "` (" +
        std::to_string(received) + " bytes) is not a complete Chrome trace document; " +
        (output.is_file() ? std::string("nothing was written")
                          : std::string("what was written to standard output is incomplete")));
    return kExitFailure;
  }
  if (!output.commit(request.force)) return kExitFailure;

  const std::uint64_t events = reader.scanner().events();
  std::string summary = "wrote " + output.name() + " (" + std::to_string(reader.written()) +
                        " bytes, " + std::to_string(events) + (events == 1 ? " event" : " events") +
                        "); " + kOpenHint;
  if (events == 0) {
    summary += request.pids.empty()
                   ? "\nsteptrace: the trace has no events: no traced process sent any in the "
                     "window (the standing window is off when the daemon's "
                     "flight_recorder_bytes is 0; --for SECONDS records on demand)"
                   : "\nsteptrace: the trace has no events: none of the processes asked for "
                     "(--pid, --job) has any in the window";
  }
  say(summary);
  return kExitOk;
}

}  // namespace steptrace::cli
