// The real steptraced on a temporary socket, driven by real processes: raw_client (the
// wire protocol through proto::Encoder, well-behaved or not), socat, and plain sockets
// for the text and HTTP interfaces.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>

#include "proto/wire_format.h"
#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

json command_json(const std::string& socket, const std::string& line) {
  const auto reply = command(socket, line);
  EXPECT_TRUE(reply.has_value()) << line;
  if (!reply) return json();
  EXPECT_EQ(reply->find('\n'), reply->size() - 1) << "JSON reply must be one line: " << *reply;
  return json::parse(*reply);
}

const json* find_process(const json& report, pid_t pid) {
  for (const auto& p : report["processes"]) {
    if (p["pid"] == pid) return &p;
  }
  return nullptr;
}

const json* find_step(const json& process, const std::string& name) {
  for (const auto& s : process["steps"]) {
    if (s["step"] == name) return &s;
  }
  return nullptr;
}

std::uint64_t protocol_errors(const json& stats, const std::string& kind) {
  const auto& by_kind = stats["protocol_errors"]["by_kind"];
  return by_kind.contains(kind) ? by_kind[kind].get<std::uint64_t>() : 0;
}

pid_t spawn_raw(const std::string& socket, std::vector<std::string> args) {
  std::vector<std::string> argv{RAW_CLIENT_BIN, socket};
  argv.insert(argv.end(), args.begin(), args.end());
  return spawn_process(argv);
}

// Runs a shell command line; its stdout and stderr go to `out`.
int run_shell(const std::string& line, std::string& out, const TempDir& dir) {
  const std::string file = dir.file("shell.out");
  const int status = run_process({"/bin/sh", "-c", line + " >" + file + " 2>&1"}, {}, 30000);
  out = read_file(file);
  return status;
}

class DaemonTest : public ::testing::Test {
 protected:
  std::string socket() const { return dir_.file("d.sock"); }
  std::string write_config(const std::string& text) {
    const std::string path = dir_.file("config.json");
    write_file(path, text);
    return path;
  }
  TempDir dir_;
};

// A config with short timeouts so timeout tests stay fast.
constexpr const char* kFastTimeouts = R"({"timeouts": {"handshake_s": 1, "frame_s": 1}})";

TEST_F(DaemonTest, CountsFromSeveralProcessesAndThreadsAreExact) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::vector<pid_t> pids;
  for (int i = 0; i < 3; ++i) {
    pids.push_back(
        spawn_raw(socket(), {"good", "--threads", "4", "--pairs", "50", "--dur", "1000", "--nest",
                             "--custom", "my_step", "--ledger", "--dropped", "5"}));
  }
  for (pid_t pid : pids) ASSERT_EQ(wait_process(pid, 30000), 0) << daemon.log();

  // They exited: the report says so within a liveness interval (500 ms; reports never
  // probe /proc themselves).
  json report;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (bool all_exited = false; !all_exited && std::chrono::steady_clock::now() < deadline;) {
    report = command_json(socket(), "report --json");
    all_exited = true;
    for (pid_t pid : pids) {
      const json* p = find_process(report, pid);
      all_exited = all_exited && p != nullptr && (*p)["alive"] == false;
    }
    if (!all_exited) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  for (pid_t pid : pids) {
    const json* p = find_process(report, pid);
    ASSERT_NE(p, nullptr) << report.dump();
    EXPECT_EQ((*p)["comm"], "raw_client");
    EXPECT_EQ((*p)["uid"], ::getuid());
    EXPECT_EQ((*p)["dropped"], 5);
    EXPECT_EQ((*p)["alive"], false);
    const json* forward = find_step(*p, "Forward");
    const json* matmul = find_step(*p, "Matmul");
    const json* custom = find_step(*p, "my_step");
    ASSERT_TRUE(forward && matmul && custom) << p->dump();
    EXPECT_EQ((*forward)["count"], 200);
    EXPECT_EQ((*forward)["total_ns"], 200 * 1000);
    EXPECT_EQ((*forward)["min_ns"], 1000);
    EXPECT_EQ((*forward)["max_ns"], 1000);
    EXPECT_EQ((*forward)["open"], 0);
    // Nested inside Forward, on the same threads: matched as a stack, not overwritten.
    EXPECT_EQ((*matmul)["count"], 200);
    EXPECT_EQ((*matmul)["min_ns"], 500);
    EXPECT_EQ((*matmul)["max_ns"], 500);
    EXPECT_EQ((*custom)["count"], 200);
    EXPECT_EQ((*custom)["total_ns"], 200 * 1000);
  }
  bool found_total = false;
  for (const auto& t : report["totals"]) {
    if (t["step"] == "Forward") {
      found_total = true;
      EXPECT_EQ(t["count"], 600);
      EXPECT_EQ(t["processes"], 3);
    }
  }
  EXPECT_TRUE(found_total);
  // Each process's ledger reservation (id = its pid) is in the view.
  std::size_t reservations = 0;
  for (const auto& gpu : report["ledger"]["gpus"]) {
    if (gpu["gpu"] != "GPU-raw") continue;
    for (const auto& r : gpu["reservations"]) {
      if (std::find(pids.begin(), pids.end(), r["pid"].get<pid_t>()) != pids.end()) {
        EXPECT_EQ(r["bytes"], 1000);
        EXPECT_EQ(r["id"], r["pid"]);
        ++reservations;
      }
    }
  }
  EXPECT_EQ(reservations, 3u) << report["ledger"].dump();
  EXPECT_EQ(report["daemon"]["events_received"], 3 * 4 * 50 * 6);
  EXPECT_EQ(report["daemon"]["events_dropped_by_clients"], 15);

  const json one = command_json(socket(), "report --json --pid " + std::to_string(pids[0]));
  ASSERT_EQ(one["processes"].size(), 1u);
  EXPECT_EQ(one["processes"][0]["pid"], pids[0]);

  const json stats = command_json(socket(), "stats --json");
  EXPECT_EQ(protocol_errors(stats, "bad_magic"), 0u);
  EXPECT_GE(stats["frames_received"].get<std::uint64_t>(), 3u * 5);
  EXPECT_GE(stats["connections"]["total"].get<std::uint64_t>(), 3u);
}

TEST_F(DaemonTest, BadAndSlowClientsDoNotDisturbAGoodOne) {
  DaemonProcess daemon(socket(), {"--config", write_config(kFastTimeouts)});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const pid_t good = spawn_raw(
      socket(), {"good", "--threads", "3", "--pairs", "3000", "--dur", "2000", "--hold-ms", "300"});
  std::vector<std::pair<std::string, pid_t>> bad;
  for (const char* mode : {"garbage", "oversize", "badversion", "badstep", "truncated", "silent"}) {
    bad.emplace_back(mode, spawn_raw(socket(), {mode}));
  }
  // One byte every 300 ms of a 24-byte frame: measured from the frame's start, the 1 s
  // frame timeout cuts it long before it completes.
  bad.emplace_back("slow", spawn_raw(socket(), {"slow", "--interval-ms", "300"}));
  for (auto& [mode, pid] : bad) EXPECT_EQ(wait_process(pid, 30000), 0) << mode << daemon.log();
  ASSERT_EQ(wait_process(good, 30000), 0) << daemon.log();

  const json report = command_json(socket(), "report --json");
  const json* p = find_process(report, good);
  ASSERT_NE(p, nullptr);
  const json* forward = find_step(*p, "Forward");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ((*forward)["count"], 9000);
  EXPECT_EQ((*forward)["total_ns"], 9000 * 2000);
  EXPECT_EQ((*forward)["open"], 0);

  const json stats = command_json(socket(), "stats --json");
  EXPECT_EQ(protocol_errors(stats, "bad_magic"), 1u) << stats.dump();
  EXPECT_EQ(protocol_errors(stats, "frame_too_large"), 1u);
  EXPECT_EQ(protocol_errors(stats, "unsupported_version"), 1u);
  EXPECT_EQ(protocol_errors(stats, "unregistered_step"), 1u);
  EXPECT_EQ(protocol_errors(stats, "truncated"), 1u);
  EXPECT_EQ(protocol_errors(stats, "timed_out"), 2u);  // silent + slow
  EXPECT_EQ(stats["protocol_errors"]["total"], 7);
  EXPECT_EQ(stats["connections"]["now"], 1) << stats.dump();  // this stats connection
  EXPECT_NE(daemon.log().find("bad_magic"), std::string::npos);
}

TEST_F(DaemonTest, ProtocolErrorLogIsRateLimited) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::vector<pid_t> pids;
  for (int i = 0; i < 15; ++i) pids.push_back(spawn_raw(socket(), {"garbage"}));
  for (pid_t pid : pids) EXPECT_EQ(wait_process(pid, 30000), 0);
  const json stats = command_json(socket(), "stats --json");
  EXPECT_EQ(protocol_errors(stats, "bad_magic"), 15u);  // every one counted...
  const std::string log = daemon.log();
  std::size_t lines = 0;
  for (auto pos = log.find("[bad_magic]"); pos != std::string::npos;
       pos = log.find("[bad_magic]", pos + 1)) {
    ++lines;
  }
  EXPECT_EQ(lines, 10u) << log;  // ...but at most 10 logged per 10 s
}

TEST_F(DaemonTest, SocatPingAndTextCommands) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::string out;
  ASSERT_EQ(run_shell("echo ping | socat - UNIX-CONNECT:" + socket(), out, dir_), 0) << out;
  EXPECT_EQ(out, "pong\n");
  // Several commands on one connection, answered in order; an unknown one gets an
  // error line and the connection stays usable.
  ASSERT_EQ(
      run_shell("printf 'ping\\nfrobnicate\\nping\\nversion\\n' | socat - UNIX-CONNECT:" + socket(),
                out, dir_),
      0);
  std::istringstream lines(out);
  std::string line;
  std::vector<std::string> got;
  while (std::getline(lines, line)) got.push_back(line);
  ASSERT_EQ(got.size(), 4u) << out;
  EXPECT_EQ(got[0], "pong");
  EXPECT_EQ(got[1].rfind("error: ", 0), 0u);
  EXPECT_NE(got[1].find("frobnicate"), std::string::npos);
  EXPECT_EQ(got[2], "pong");
  const json version = json::parse(got[3]);
  EXPECT_EQ(version["protocol"], steptrace::proto::kProtocolVersion);

  auto reply = command(socket(), "report --pid abc\nping");
  ASSERT_TRUE(reply);
  EXPECT_EQ(reply->rfind("error: ", 0), 0u) << *reply;
  EXPECT_NE(reply->find("\npong\n"), std::string::npos) << *reply;

  reply = command(socket(), "reset");
  ASSERT_TRUE(reply);
  EXPECT_EQ(*reply, "ok\n");  // we run as the daemon's uid
}

TEST_F(DaemonTest, RenderedRepliesKeepTheirPlaceAmongOtherReplies) {
  // report/stats/metrics/ledger render on another thread; lines sent in one write are
  // still answered one by one, in order, and EOF waits for the last reply.
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const auto reply = command(socket(),
                             "stats --json\nping\nmetrics\nping\nreport --json\nledger --json\n"
                             "version\nreport --pid nope\nping");
  ASSERT_TRUE(reply);
  std::istringstream lines(*reply);
  std::vector<std::string> got;
  std::string line;
  while (std::getline(lines, line)) {
    // metrics is many lines: keep only its first, then skip to the next reply.
    if (!got.empty() && got.back().rfind("# HELP", 0) == 0 && line != "pong") continue;
    got.push_back(line);
  }
  ASSERT_EQ(got.size(), 9u) << *reply;
  EXPECT_TRUE(json::parse(got[0]).contains("events_received")) << got[0];
  EXPECT_EQ(got[1], "pong");
  EXPECT_EQ(got[2].rfind("# HELP", 0), 0u) << got[2];
  EXPECT_EQ(got[3], "pong");
  EXPECT_EQ(json::parse(got[4])["schema"], "steptrace.report/v1");
  EXPECT_TRUE(json::parse(got[5]).contains("gpus")) << got[5];
  EXPECT_EQ(json::parse(got[6])["protocol"], steptrace::proto::kProtocolVersion);
  EXPECT_EQ(got[7].rfind("error: ", 0), 0u) << got[7];
  EXPECT_EQ(got[8], "pong");
}

TEST_F(DaemonTest, OverlongLineIsRefusedAndClosed) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const auto reply = command(socket(), std::string(5000, 'x'));
  ASSERT_TRUE(reply);
  EXPECT_EQ(*reply, "error: line too long\n");
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(DaemonTest, MaxConnectionsRejectsTheExtraOne) {
  DaemonProcess daemon(socket(),
                       {"--config", write_config(R"({"limits": {"max_connections": 2}})")});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::vector<int> held;
  for (int i = 0; i < 2; ++i) {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket().c_str(), sizeof addr.sun_path - 1);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    held.push_back(fd);
  }
  // The daemon counts a connection once it accepted it; wait for that.
  std::optional<std::string> reply;
  for (int i = 0; i < 100; ++i) {
    reply = command(socket(), "ping");
    if (reply && reply->rfind("error:", 0) == 0) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ASSERT_TRUE(reply);
  EXPECT_NE(reply->find("too many connections"), std::string::npos) << *reply;
  for (int fd : held) ::close(fd);
  for (int i = 0; i < 100; ++i) {
    reply = command(socket(), "ping");
    if (reply == "pong\n") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(reply, "pong\n");
  const json stats = command_json(socket(), "stats --json");
  EXPECT_GE(stats["connections"]["rejected"].get<std::uint64_t>(), 1u);
  EXPECT_GE(stats["limits_hit"]["max_connections"].get<std::uint64_t>(), 1u);
}

// A client that sends commands but never reads the replies: once the socket buffers are
// full the daemon stops reading it, and after timeouts.frame_s the connection is closed
// and counted as write_timeout. Other clients are served throughout.
TEST_F(DaemonTest, ClientThatNeverReadsItsRepliesIsClosedAndCounted) {
  DaemonProcess daemon(socket(), {"--config", write_config(kFastTimeouts)});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, socket().c_str(), sizeof addr.sun_path - 1);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  // `help` replies are much longer than the command: keep sending until the daemon stops
  // taking more (our send buffer is full because it stopped reading).
  const std::string line = "help\n";
  std::size_t sent = 0;
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < give_up) {
    const ssize_t n = ::send(fd, line.data(), line.size(), MSG_NOSIGNAL);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK) break;
    FAIL() << "send: " << std::strerror(errno);
  }
  EXPECT_GT(sent, line.size() * 100) << "the daemon should have read a good many commands first";
  // Served meanwhile, and the stalled client is closed within a few frame timeouts.
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
  std::uint64_t timeouts = 0;
  for (int i = 0; i < 100 && timeouts == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    timeouts = protocol_errors(command_json(socket(), "stats --json"), "write_timeout");
  }
  EXPECT_EQ(timeouts, 1u) << daemon.log();
  EXPECT_NE(daemon.log().find("did not read a reply within 1 s"), std::string::npos)
      << daemon.log();
  // What it had been sent is still readable, then end of stream: the daemon closed it.
  char buf[65536];
  bool eof = false;
  const auto read_until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (!eof && std::chrono::steady_clock::now() < read_until) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n == 0) eof = true;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != ECONNRESET) break;
    if (n < 0 && errno == ECONNRESET) eof = true;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ::close(fd);
  EXPECT_TRUE(eof) << "the daemon did not close the connection";
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(DaemonTest, SecondDaemonOnTheSameSocketRefusesToStart) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  std::string out;
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --socket " + socket(), out, dir_), 1);
  EXPECT_NE(out.find("already listening"), std::string::npos) << out;
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(DaemonTest, StaleSocketFileIsReplaced) {
  {
    const int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, socket().c_str(), sizeof addr.sun_path - 1);
    ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ::close(fd);  // the file stays, nobody listens: a crashed daemon's leftover
  }
  ASSERT_TRUE(fs::exists(socket()));
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
  EXPECT_NE(daemon.log().find("stale"), std::string::npos);
}

TEST_F(DaemonTest, SocketModeAndCleanExit) {
  DaemonProcess daemon(socket());
  ASSERT_TRUE(daemon.start()) << daemon.log();
  struct stat st {};
  ASSERT_EQ(::stat(socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0660u);
  EXPECT_EQ(daemon.stop(SIGTERM), 0);
  EXPECT_FALSE(fs::exists(socket()));  // removed on exit

  DaemonProcess strict(socket(), {"--config", write_config(R"({"socket_mode": "0600"})")});
  ASSERT_TRUE(strict.start()) << strict.log();
  ASSERT_EQ(::stat(socket().c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(strict.stop(SIGINT), 0);
}

TEST_F(DaemonTest, MissingSocketDirectoryIsAClearError) {
  std::string out;
  EXPECT_EQ(
      run_shell(std::string(STEPTRACED_BIN) + " --socket " + dir_.file("nope/d.sock"), out, dir_),
      1);
  EXPECT_NE(out.find("does not exist"), std::string::npos) << out;
}

TEST_F(DaemonTest, RestartWithTheSameStateDirGivesTheSameReport) {
  const std::string state = dir_.file("state");
  DaemonProcess daemon(socket(), {"--state-dir", state});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const pid_t a = spawn_raw(socket(), {"good", "--threads", "2", "--pairs", "20", "--nest"});
  const pid_t b = spawn_raw(socket(), {"good", "--pairs", "7", "--custom", "opt_step", "--ledger"});
  ASSERT_EQ(wait_process(a, 30000), 0);
  ASSERT_EQ(wait_process(b, 30000), 0);
  const json before = command_json(socket(), "report --json");
  ASSERT_NE(find_process(before, a), nullptr);
  ASSERT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
  EXPECT_TRUE(fs::exists(state + "/steptraced.snapshot.json"));

  DaemonProcess again(socket(), {"--state-dir", state});
  ASSERT_TRUE(again.start()) << again.log();
  const json after = command_json(socket(), "report --json");
  for (pid_t pid : {a, b}) {
    const json* p0 = find_process(before, pid);
    const json* p1 = find_process(after, pid);
    ASSERT_TRUE(p0 && p1) << after.dump();
    EXPECT_EQ((*p1)["steps"], (*p0)["steps"]);
    EXPECT_EQ((*p1)["start_time"], (*p0)["start_time"]);
    EXPECT_EQ((*p1)["alive"], false);
  }
  EXPECT_EQ(after["totals"], before["totals"]);
}

TEST_F(DaemonTest, SigtermAppliesWhatClientsAlreadySent) {
  const std::string state = dir_.file("state");
  DaemonProcess daemon(socket(), {"--state-dir", state});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  // While the daemon is stopped the client connects (backlog) and sends everything; the
  // bytes wait in the socket. SIGTERM must apply them before the snapshot.
  daemon.signal(SIGSTOP);
  const std::string sent = dir_.file("client-sent");
  const pid_t client =
      spawn_raw(socket(), {"good", "--threads", "2", "--pairs", "100", "--sent-file", sent});
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!fs::exists(sent) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(fs::exists(sent)) << "the client never finished writing its frames";
  ASSERT_EQ(daemon.stop(SIGTERM), 0) << daemon.log();
  wait_process(client, 30000);  // it may or may not have seen its FlushAck

  DaemonProcess again(socket(), {"--state-dir", state});
  ASSERT_TRUE(again.start()) << again.log();
  const json report = command_json(socket(), "report --json");
  const json* p = find_process(report, client);
  ASSERT_NE(p, nullptr) << report.dump() << daemon.log();
  const json* forward = find_step(*p, "Forward");
  ASSERT_NE(forward, nullptr);
  EXPECT_EQ((*forward)["count"], 200);
}

// State is made durable every snapshot_interval_s (default 1 s) while it changes, so a
// crash loses at most about that much; an idle daemon writes nothing.
TEST_F(DaemonTest, SnapshotsFollowChangesEverySecondAndStopWhileIdle) {
  const std::string state = dir_.file("state");
  DaemonProcess daemon(socket(), {"--state-dir", state});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  auto written = [&] { return command_json(socket(), "stats --json")["snapshots"]["written"]; };
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(written(), 0);  // nothing to keep yet
  const pid_t a = spawn_raw(socket(), {"good", "--pairs", "20"});
  ASSERT_EQ(wait_process(a, 30000), 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (written() == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(written(), 1);  // within about a second, without a SIGTERM
  EXPECT_TRUE(fs::exists(state + "/steptraced.snapshot.json"));
  // The liveness check marks the client exited (a change) within its interval; after
  // that the state stays the same and the count with it.
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const json settled = written();
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  EXPECT_EQ(written(), settled);
}

TEST_F(DaemonTest, CorruptSnapshotIsMovedAsideAndTheDaemonStarts) {
  const std::string state = dir_.file("state");
  fs::create_directories(state);
  write_file(state + "/steptraced.snapshot.json", "{ this is not json");
  DaemonProcess daemon(socket(), {"--state-dir", state});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  bool moved = false;
  for (const auto& entry : fs::directory_iterator(state)) {
    if (entry.path().filename().string().find(".corrupt-") != std::string::npos) moved = true;
  }
  EXPECT_TRUE(moved);
  EXPECT_FALSE(fs::exists(state + "/steptraced.snapshot.json"));
  EXPECT_NE(daemon.log().find("snapshot"), std::string::npos);
  const json stats = command_json(socket(), "stats --json");
  EXPECT_EQ(stats["snapshots"]["errors"], 1);
}

TEST_F(DaemonTest, BadConfigStopsStartUpNamingTheKey) {
  std::string out;
  const auto path = write_config(R"({"limits": {"max_open_depht": 3}})");
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --socket " + socket() + " --config " + path,
                      out, dir_),
            2);
  EXPECT_NE(out.find("limits.max_open_depht"), std::string::npos) << out;
  write_config(R"({"limits": {"max_open_depth": 0}})");
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --socket " + socket() + " --config " + path,
                      out, dir_),
            2);
  EXPECT_NE(out.find("config: limits.max_open_depth: must be an integer in 1..4096"),
            std::string::npos)
      << out;
  EXPECT_FALSE(fs::exists(socket()));
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --bogus", out, dir_), 2);
}

TEST_F(DaemonTest, HelpAndVersion) {
  std::string out;
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --help", out, dir_), 0);
  EXPECT_NE(out.find("--socket"), std::string::npos) << out;
  EXPECT_NE(out.find("--metrics-listen"), std::string::npos);
  EXPECT_NE(out.find("/run/steptrace/steptraced.sock"), std::string::npos);
  EXPECT_EQ(run_shell(std::string(STEPTRACED_BIN) + " --version", out, dir_), 0);
  EXPECT_NE(out.find("steptraced"), std::string::npos) << out;
}

// ---- HTTP ----------------------------------------------------------------------------

constexpr const char* kGetMetrics = "GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

// A TCP connection to 127.0.0.1:port, or -1.
int connect_tcp(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// Closes a descriptor when the test leaves the scope, also through a failed ASSERT.
struct ScopedFd {
  explicit ScopedFd(int fd) : fd(fd) {}
  ~ScopedFd() {
    if (fd >= 0) ::close(fd);
  }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  int fd;
};

// Reads from `fd` until the server closes (or 10 s of silence).
std::string read_until_close(int fd) {
  std::string reply;
  char buf[65536];
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 10000) <= 0) break;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    reply.append(buf, static_cast<std::size_t>(n));
  }
  return reply;
}

// Sends `request` to 127.0.0.1:port and reads until the server closes.
std::string http_exchange(int port, const std::string& request) {
  const int fd = connect_tcp(port);
  if (fd < 0) return "";
  ::send(fd, request.data(), request.size(), MSG_NOSIGNAL);
  std::string reply = read_until_close(fd);
  ::close(fd);
  return reply;
}

// The body of an HTTP response: what follows the blank line ("" without one).
std::string http_body(const std::string& reply) {
  const auto end = reply.find("\r\n\r\n");
  return end == std::string::npos ? std::string() : reply.substr(end + 4);
}

// `exposition` with the value of every sample of the named metric families replaced by
// "*": the lines stay (so a family missing from one side still shows), their values do not
// take part in a comparison.
std::string mask_values(const std::string& exposition, const std::set<std::string>& families) {
  std::istringstream in(exposition);
  std::string out;
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line[0] != '#' &&
        families.count(line.substr(0, line.find_first_of("{ "))) != 0) {
      line = line.substr(0, line.rfind(' ') + 1) + "*";
    }
    out += line + '\n';
  }
  return out;
}

// The lines only `a` has ("- line") and the lines only `b` has ("+ line"); "" when both
// hold the same lines. Keeps a failure message to the lines that matter.
std::string line_diff(const std::string& a, const std::string& b) {
  const auto lines = [](const std::string& text) {
    std::multiset<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.insert(line);
    return out;
  };
  const std::multiset<std::string> in_a = lines(a);
  const std::multiset<std::string> in_b = lines(b);
  std::vector<std::string> only_a;
  std::vector<std::string> only_b;
  std::set_difference(in_a.begin(), in_a.end(), in_b.begin(), in_b.end(),
                      std::back_inserter(only_a));
  std::set_difference(in_b.begin(), in_b.end(), in_a.begin(), in_a.end(),
                      std::back_inserter(only_b));
  std::string out;
  for (const auto& line : only_a) out += "- " + line + "\n";
  for (const auto& line : only_b) out += "+ " + line + "\n";
  return out;
}

// Waits until the daemon has applied the exit of client `pid` (its connection closed, the
// process marked exited); after that nothing changes its state unless a client acts.
bool wait_exited(const std::string& socket, pid_t pid) {
  for (int i = 0; i < 500; ++i) {
    const auto reply = command(socket, "report --json");
    if (reply) {
      const json report = json::parse(*reply, nullptr, false);
      const json* p = report.is_discarded() ? nullptr : find_process(report, pid);
      if (p != nullptr && (*p)["alive"] == false) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

TEST_F(DaemonTest, HttpMetricsEndpoint) {
  const int port = free_port();
  DaemonProcess daemon(socket(), {"--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const pid_t good = spawn_raw(socket(), {"good", "--pairs", "4"});
  ASSERT_EQ(wait_process(good, 30000), 0);

  ASSERT_TRUE(wait_exited(socket(), good)) << daemon.log();

  std::string reply = http_exchange(port, kGetMetrics);
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_NE(reply.find("text/plain; version=0.0.4; charset=utf-8"), std::string::npos);
  const std::string scrape = http_body(reply);
  EXPECT_NE(scrape.find("\nsteptrace_step_duration_seconds_count{step=\"Forward\"} 4\n"),
            std::string::npos)
      << reply;
  // The body is the same exposition the `metrics` command gives: the daemon is quiet (the
  // client's exit is applied, nobody sends), so the two agree line for line except for the
  // values of these families, which differ by design between the two fetches:
  // - steptrace_connections: open Unix-socket connections; the command is rendered while
  //   its own connection is open (1), the HTTP listener's TCP connections are not counted.
  // - steptrace_connections_accepted_total: the command's connection was accepted after
  //   the scrape.
  // - steptrace_commands_served_total: the command counts itself before it renders.
  // - steptrace_uptime_seconds: time passed between the two.
  // - steptrace_http_responses_total: the scrape's own response was written after it was
  //   rendered.
  // - process_*: the daemon's own CPU, memory and descriptors, read at each render.
  const std::set<std::string> varying = {"steptrace_connections",
                                         "steptrace_connections_accepted_total",
                                         "steptrace_commands_served_total",
                                         "steptrace_uptime_seconds",
                                         "steptrace_http_responses_total",
                                         "process_cpu_seconds_total",
                                         "process_resident_memory_bytes",
                                         "process_virtual_memory_bytes",
                                         "process_open_fds"};
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics);
  const std::string http_masked = mask_values(scrape, varying);
  const std::string command_masked = mask_values(*metrics, varying);
  const std::string diff = line_diff(http_masked, command_masked);
  EXPECT_TRUE(diff.empty()) << "HTTP body vs `metrics` reply (- only in HTTP, + only in the "
                               "reply):\n"
                            << diff;
  if (diff.empty()) {
    EXPECT_TRUE(http_masked == command_masked) << "same lines, other order";
  }

  reply = http_exchange(port, "HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_EQ(reply.find("# TYPE"), std::string::npos);

  reply = http_exchange(port, "GET /nope HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 404", 0), 0u) << reply;

  reply = http_exchange(
      port, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
  EXPECT_EQ(reply.rfind("HTTP/1.1 405", 0), 0u) << reply;
  EXPECT_NE(reply.find("Allow: GET, HEAD"), std::string::npos) << reply;

  reply = http_exchange(port,
                        "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n"
                        "Connection: close\r\n\r\n" +
                            std::string(100000, 'a'));
  EXPECT_EQ(reply.rfind("HTTP/1.1 413", 0), 0u) << reply;

  // Ingest still works after all that.
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(DaemonTest, HttpOversizedHeaderGets431) {
  const int port = free_port();
  DaemonProcess daemon(socket(), {"--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  const auto request = [](std::size_t padding) {
    return "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Padding: " + std::string(padding, 'a') +
           "\r\nConnection: close\r\n\r\n";
  };
  // The header limit is 8 KiB: 16 KiB of header is refused...
  std::string reply = http_exchange(port, request(16 * 1024));
  EXPECT_EQ(reply.rfind("HTTP/1.1 431", 0), 0u) << reply.substr(0, 200);
  EXPECT_NE(reply.find("request header too large"), std::string::npos) << reply.substr(0, 200);
  // ...while a header just under it is served.
  reply = http_exchange(port, request(7 * 1024));
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply.substr(0, 200);
  EXPECT_EQ(command(socket(), "ping"), "pong\n");
}

TEST_F(DaemonTest, IngestContinuesWhileAnHttpRequestIsHalfSent) {
  const int port = free_port();
  DaemonProcess daemon(socket(), {"--metrics-listen", "127.0.0.1:" + std::to_string(port)});
  ASSERT_TRUE(daemon.start()) << daemon.log();
  // A scraper that sent part of its request line and went quiet. The daemon waits for the
  // rest (up to its 5 s header timeout) on the thread that also serves ingest, so it
  // must wait asynchronously.
  const ScopedFd connection(connect_tcp(port));
  const int held = connection.fd;
  ASSERT_GE(held, 0);
  const std::string head = "GET /met";
  ASSERT_EQ(::send(held, head.data(), head.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(head.size()));
  EXPECT_EQ(command(socket(), "ping", 5000), "pong\n");

  // Well under the 5 s header timeout, so the held request is still pending throughout.
  const pid_t good = spawn_raw(socket(), {"good", "--threads", "2", "--pairs", "500"});
  ASSERT_EQ(wait_process(good, 8000), 0) << daemon.log();
  const json report = command_json(socket(), "report --json");
  const json* p = find_process(report, good);
  ASSERT_NE(p, nullptr) << report.dump();
  const json* forward = find_step(*p, "Forward");
  ASSERT_NE(forward, nullptr) << p->dump();
  EXPECT_EQ((*forward)["count"], 1000);
  EXPECT_EQ((*forward)["open"], 0);
  // Another scraper is served meanwhile too.
  std::string reply = http_exchange(port, kGetMetrics);
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_NE(reply.find("\nsteptrace_step_duration_seconds_count{step=\"Forward\"} 1000\n"),
            std::string::npos)
      << reply;

  // The half-sent request was pending all along (no reply, not closed), and completing it
  // now gets the metrics.
  pollfd pending{held, POLLIN, 0};
  EXPECT_EQ(::poll(&pending, 1, 0), 0) << "the daemon answered or closed the half-sent request";
  const std::string rest = "rics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
  ASSERT_EQ(::send(held, rest.data(), rest.size(), MSG_NOSIGNAL),
            static_cast<ssize_t>(rest.size()));
  reply = read_until_close(held);
  EXPECT_EQ(reply.rfind("HTTP/1.1 200", 0), 0u) << reply;
  EXPECT_NE(reply.find("\nsteptrace_step_duration_seconds_count{step=\"Forward\"} 1000\n"),
            std::string::npos)
      << reply;
}

}  // namespace
}  // namespace steptrace::testing
