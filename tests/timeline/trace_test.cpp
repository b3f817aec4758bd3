// The flight recorder and `trace` end to end (proto/PROTOCOL.md 10.5): the real
// steptraced on a temporary socket, real client processes (trace_client, linked with
// libsteptrace, fork/exec) that write down what they recorded and when, and the Chrome
// Trace Event documents `trace` answers, compared with those records.
//
// Timing: a client reads CLOCK_MONOTONIC right before and right after each call; the
// library stamps events with the TSC converted to CLOCK_MONOTONIC (or with
// CLOCK_MONOTONIC itself), so a span's ts must lie in the client's window, give or take
// kToleranceNs. Sized for a loaded 2-core machine, also under AddressSanitizer: no
// assertion on how fast anything is, only on what arrives.
#include <signal.h>
#include <time.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

// How far a timestamp may be outside the client's before/after reads (TSC conversion).
constexpr std::int64_t kToleranceNs = 200'000;
constexpr int kTraceTimeoutMs = 120'000;
constexpr int kClientTimeoutMs = 120'000;
// What trace_client --ledger records (trace_client.cpp).
constexpr std::uint64_t kReservationId = 7;
constexpr std::uint64_t kReserveBytes = 123'456'789;
constexpr std::uint64_t kFreeBytes = 1'000'000'000;
constexpr std::uint64_t kTotalBytes = 2'000'000'000;
constexpr const char* kGpu = "GPU-7f3e2a10-trace-test";
constexpr const char* kCustomStep = "MyCustomStep";
constexpr std::uint64_t kCaptureBudget = 32u << 20;

std::int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000LL + ts.tv_nsec;
}

// ---- what a client wrote down (trace_client.cpp) -----------------------------------

struct ClientSpan {
  long long tid = 0;
  long long parent = -1;  // index in ClientRecord::spans, -1 for a top-level span
  std::string name;
  std::int64_t before_start = 0;
  std::int64_t after_start = 0;
  std::int64_t before_end = 0;
  std::int64_t after_end = 0;
};

struct ClientLedger {
  std::string op;
  long long tid = 0;
  std::int64_t before = 0;
  std::int64_t after = 0;
};

struct ClientRecord {
  std::map<std::string, std::string> values;  // pid, comm, connect_rc, flush_rc, ...
  std::vector<ClientSpan> spans;
  std::optional<ClientSpan> first;
  std::optional<ClientSpan> last;
  std::optional<ClientSpan> open;  // before_end/after_end unset
  std::vector<ClientLedger> ledger;

  long long num(const std::string& key) const {
    const auto it = values.find(key);
    return it == values.end() ? -999 : std::stoll(it->second);
  }
  int pid() const { return static_cast<int>(num("pid")); }
  std::string comm() const { return values.contains("comm") ? values.at("comm") : ""; }
};

std::optional<ClientRecord> read_record(const std::string& path) {
  std::ifstream in(path);
  if (!in) return std::nullopt;
  ClientRecord r;
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "span") {
      ClientSpan s;
      words >> s.tid >> s.parent >> s.name >> s.before_start >> s.after_start >> s.before_end >>
          s.after_end;
      r.spans.push_back(s);
    } else if (kind == "first" || kind == "last") {
      ClientSpan s;
      words >> s.tid >> s.name >> s.before_start >> s.after_start >> s.before_end >> s.after_end;
      (kind == "first" ? r.first : r.last) = s;
    } else if (kind == "open") {
      ClientSpan s;
      words >> s.tid >> s.name >> s.before_start >> s.after_start;
      r.open = s;
    } else if (kind == "ledger") {
      ClientLedger l;
      words >> l.op >> l.tid >> l.before >> l.after;
      r.ledger.push_back(l);
    } else if (!kind.empty()) {
      std::string rest;
      std::getline(words >> std::ws, rest);
      r.values[kind] = rest;
    }
  }
  return r;
}

// ---- the trace document ------------------------------------------------------------

// ts / dur (microseconds, three decimals) as nanoseconds.
std::int64_t ns_of(const json& us) { return std::llround(us.get<double>() * 1000.0); }

// An event's monotonic time: its ts is since otherData.ts_origin_ns (issue 27).
std::int64_t at_ns(const json& doc, const json& e) {
  return ns_of(e.at("ts")) + doc.at("otherData").at("ts_origin_ns").get<std::int64_t>();
}

struct TraceSpan {
  int pid = 0;
  long long tid = 0;
  std::string name;
  std::int64_t ts = 0;  // ns
  std::int64_t dur = 0;
  bool open = false;
  bool start_before_window = false;
  bool clipped = false;
  std::int64_t end() const { return ts + dur; }
};

std::vector<TraceSpan> spans_of(const json& doc, std::optional<int> pid = std::nullopt) {
  std::vector<TraceSpan> out;
  for (const json& e : doc.at("traceEvents")) {
    if (e.value("ph", "") != "X") continue;
    TraceSpan s;
    s.pid = e.at("pid").get<int>();
    if (pid && s.pid != *pid) continue;
    s.tid = e.at("tid").get<long long>();
    s.name = e.at("name").get<std::string>();
    s.ts = at_ns(doc, e);
    s.dur = ns_of(e.at("dur"));
    if (e.contains("args")) {
      const json& a = e.at("args");
      s.open = a.value("open", false);
      s.start_before_window = a.value("start_before_window", false);
      s.clipped = a.value("clipped", false);
    }
    out.push_back(s);
  }
  return out;
}

// Events with "ph" == ph (and "name" == name unless empty).
std::vector<json> events_of(const json& doc, const std::string& ph, const std::string& name = "") {
  std::vector<json> out;
  for (const json& e : doc.at("traceEvents")) {
    if (e.value("ph", "") == ph && (name.empty() || e.value("name", "") == name)) out.push_back(e);
  }
  return out;
}

// pid -> the process_name metadata's name.
std::map<int, std::string> process_names(const json& doc) {
  std::map<int, std::string> out;
  for (const json& e : events_of(doc, "M", "process_name")) {
    out[e.at("pid").get<int>()] = e.at("args").at("name").get<std::string>();
  }
  return out;
}

// The layout PROTOCOL.md 10.5 promises: the header line, one event object per line
// (each but the last followed by ','), then the closing line with otherData.
void expect_layout(const std::string& text) {
  ASSERT_GE(text.size(), 2u);
  EXPECT_EQ(text.back(), '\n');
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_GE(lines.size(), 2u);
  EXPECT_EQ(lines.front(), R"({"traceEvents":[)");
  EXPECT_EQ(lines.back().rfind(R"(],"displayTimeUnit":"ms","otherData":{)", 0), 0u) << lines.back();
  for (std::size_t i = 1; i + 1 < lines.size(); ++i) {
    std::string line = lines[i];
    const bool last = i + 2 == lines.size();
    if (!last) {
      ASSERT_FALSE(line.empty());
      EXPECT_EQ(line.back(), ',') << "line " << i << ": " << line;
      line.pop_back();
    }
    const json e = json::parse(line, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << "line " << i << " is not one JSON value: " << line;
    EXPECT_TRUE(e.is_object() && e.contains("ph")) << line;
  }
}

// Every span the client recorded is in `trace` exactly once: per (tid, name), the
// trace's spans of the client's pid, by ts, pair one to one with the client's, by
// start, each starting and ending within the client's reads (give or take
// kToleranceNs), and the trace has no other span on those threads. Returns the trace
// span of each client span (empty after a failure).
std::vector<TraceSpan> match_spans(const ClientRecord& client,
                                   const std::vector<TraceSpan>& trace) {
  using Key = std::pair<long long, std::string>;
  std::map<Key, std::vector<std::size_t>> mine;  // indices into client.spans
  std::map<Key, std::vector<TraceSpan>> theirs;
  std::set<long long> tids;
  for (std::size_t i = 0; i < client.spans.size(); ++i) {
    mine[{client.spans[i].tid, client.spans[i].name}].push_back(i);
    tids.insert(client.spans[i].tid);
  }
  for (const TraceSpan& s : trace) {
    if (s.pid == client.pid() && tids.contains(s.tid)) theirs[{s.tid, s.name}].push_back(s);
  }
  std::vector<TraceSpan> out(client.spans.size());
  bool ok = true;
  for (const auto& [key, trace_spans] : theirs) {
    if (!mine.contains(key)) {
      ADD_FAILURE() << trace_spans.size() << " spans " << key.second << " on thread " << key.first
                    << " in the trace that the client never recorded";
      ok = false;
    }
  }
  for (auto& [key, indices] : mine) {
    std::sort(indices.begin(), indices.end(), [&](std::size_t a, std::size_t b) {
      return client.spans[a].before_start < client.spans[b].before_start;
    });
    std::vector<TraceSpan> got = theirs[key];
    std::sort(got.begin(), got.end(),
              [](const TraceSpan& a, const TraceSpan& b) { return a.ts < b.ts; });
    if (got.size() != indices.size()) {
      ADD_FAILURE() << "thread " << key.first << ", step " << key.second << ": the client recorded "
                    << indices.size() << " spans, the trace has " << got.size();
      ok = false;
      continue;
    }
    for (std::size_t k = 0; k < indices.size(); ++k) {
      const ClientSpan& c = client.spans[indices[k]];
      const TraceSpan& t = got[k];
      const bool start_ok =
          t.ts >= c.before_start - kToleranceNs && t.ts <= c.after_start + kToleranceNs;
      const bool end_ok =
          t.end() >= c.before_end - kToleranceNs && t.end() <= c.after_end + kToleranceNs;
      if (!start_ok || !end_ok || t.open || t.start_before_window || t.clipped) {
        ADD_FAILURE() << "thread " << key.first << ", " << key.second << " #" << k << ": trace ts "
                      << t.ts << " end " << t.end() << " (open " << t.open
                      << ", start_before_window " << t.start_before_window << ") vs client start ["
                      << c.before_start << ", " << c.after_start << "] end [" << c.before_end
                      << ", " << c.after_end << "]";
        ok = false;
      }
      out[indices[k]] = t;
    }
  }
  if (!ok) return {};
  return out;
}

// VmRSS of `pid` in bytes, -1 when unreadable.
long long rss_bytes(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return -1;
}

// ---- the fixture -------------------------------------------------------------------

class TraceTest : public ::testing::Test {
 protected:
  void TearDown() override {
    for (pid_t pid : clients_) ::kill(pid, SIGKILL);
    for (pid_t pid : clients_) wait_or_kill(pid, 10000);
  }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string file(const std::string& name) const { return dir_.file(name); }

  // Starts steptraced, with a config file holding `config_json` when it is not empty.
  void start_daemon(const std::string& config_json = "") {
    std::vector<std::string> args;
    if (!config_json.empty()) {
      const std::string path = file("steptraced.json");
      std::ofstream(path) << config_json << "\n";
      args = {"--config", path};
    }
    daemon_ = std::make_unique<DaemonProcess>(socket(), args);
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }

  std::vector<std::string> client_argv(const std::string& out,
                                       const std::vector<std::string>& args) const {
    std::vector<std::string> argv{STEPTRACE_TRACE_CLIENT, "--socket", socket(), "--out", out};
    argv.insert(argv.end(), args.begin(), args.end());
    return argv;
  }

  // Starts trace_client (killed at the end of the test) and waits for its record.
  std::pair<pid_t, ClientRecord> spawn_client(const std::string& name,
                                              const std::vector<std::string>& args,
                                              const std::vector<std::string>& env = {}) {
    const std::string out = file(name);
    const pid_t pid = spawn_process(client_argv(out, args), env);
    EXPECT_GT(pid, 0);
    if (pid <= 0) return {pid, {}};
    clients_.push_back(pid);
    return {pid, wait_record(out, pid)};
  }

  // Runs trace_client to its exit and returns its record.
  ClientRecord run_client(const std::string& name, const std::vector<std::string>& args,
                          const std::vector<std::string>& env = {}) {
    const std::string out = file(name);
    EXPECT_EQ(run_process(client_argv(out, args), env, kClientTimeoutMs), 0) << name;
    auto record = read_record(out);
    EXPECT_TRUE(record.has_value()) << name << " wrote no record";
    if (record) expect_delivered(*record);
    return record.value_or(ClientRecord{});
  }

  ClientRecord wait_record(const std::string& out, pid_t pid) {
    const auto deadline = Clock::now() + std::chrono::milliseconds(kClientTimeoutMs);
    while (!std::filesystem::exists(out) && Clock::now() < deadline) {
      if (::kill(pid, 0) != 0) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    auto record = read_record(out);
    EXPECT_TRUE(record.has_value()) << out << ": the client wrote no record";
    if (record) expect_delivered(*record);
    return record.value_or(ClientRecord{});
  }

  // The client connected, flushed and dropped nothing: the daemon has it all.
  static void expect_delivered(const ClientRecord& r) {
    EXPECT_EQ(r.num("connect_rc"), 0);
    EXPECT_EQ(r.num("flush_rc"), 0);
    EXPECT_EQ(r.num("dropped"), 0);
  }

  // The reply to `line` (a trace command), parsed; null after a failure.
  json trace(const std::string& line = "trace", std::string* text = nullptr) {
    const auto reply = command(socket(), line, kTraceTimeoutMs);
    EXPECT_TRUE(reply.has_value()) << line << ": no reply";
    if (!reply) return nullptr;
    EXPECT_EQ(reply->rfind(R"({"traceEvents":[)", 0), 0u) << line << ": " << reply->substr(0, 300);
    json doc = json::parse(*reply, nullptr, false);
    EXPECT_FALSE(doc.is_discarded())
        << line << ": not JSON: " << reply->substr(0, 300) << " ... "
        << reply->substr(reply->size() > 300 ? reply->size() - 300 : 0);
    if (doc.is_discarded() || !doc.is_object() || !doc.contains("traceEvents")) return nullptr;
    if (text) *text = *reply;
    return doc;
  }

  json json_command(const std::string& line) {
    const auto reply = command(socket(), line, 60000);
    EXPECT_TRUE(reply.has_value()) << line;
    if (!reply) return nullptr;
    json doc = json::parse(*reply, nullptr, false);
    EXPECT_FALSE(doc.is_discarded()) << line << ": " << reply->substr(0, 300);
    return doc.is_discarded() ? json(nullptr) : doc;
  }

  json recorder_stats() {
    const json stats = json_command("stats --json");
    if (!stats.is_object() || !stats.contains("flight_recorder")) {
      ADD_FAILURE() << "stats --json has no flight_recorder: " << stats.dump().substr(0, 300);
      return json::object();
    }
    return stats.at("flight_recorder");
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<pid_t> clients_;
};

std::string process_name(const ClientRecord& r) {
  return r.comm() + " [" + std::to_string(r.pid()) + "]";
}

// 1. Round trip: 4 threads of Forward > Matmul > Attention > a custom step, and ledger
// records on the main thread, from a live client: all of it is in the trace, exactly,
// nested, on named tracks.
TEST_F(TraceTest, RoundTripNestedSpansLedgerAndTracks) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const auto [pid, client] =
      spawn_client("client", {"--threads", "4", "--spans", "50", "--depth", "3", "--custom",
                              kCustomStep, "--ledger", kGpu, "--hold-ms", "120000"});
  ASSERT_EQ(client.spans.size(), 4u * 50 * 4 + 1);  // + the main thread's Alloc
  ASSERT_EQ(client.ledger.size(), 3u);

  std::string text;
  const json doc = trace("trace", &text);
  ASSERT_TRUE(doc.is_object());
  expect_layout(text);
  EXPECT_EQ(doc.at("displayTimeUnit"), "ms");
  const json& other = doc.at("otherData");
  EXPECT_EQ(other.at("clock"), "CLOCK_MONOTONIC");
  EXPECT_EQ(other.at("daemon_pid").get<int>(), daemon_->pid());
  EXPECT_EQ(other.at("generator"), "steptraced");
  EXPECT_EQ(other.at("events_evicted").get<long long>(), 0);

  // Spans: each exactly once, within the client's reads, nested as recorded.
  const auto trace_spans = spans_of(doc, client.pid());
  EXPECT_EQ(trace_spans.size(), client.spans.size());
  const auto matched = match_spans(client, trace_spans);
  ASSERT_EQ(matched.size(), client.spans.size());
  int nested = 0;
  for (std::size_t i = 0; i < client.spans.size(); ++i) {
    const long long parent = client.spans[i].parent;
    if (parent < 0) continue;
    const TraceSpan& child = matched[i];
    const TraceSpan& outer = matched[static_cast<std::size_t>(parent)];
    EXPECT_EQ(child.tid, outer.tid);
    EXPECT_GE(child.ts, outer.ts) << child.name << " starts before its " << outer.name;
    EXPECT_LE(child.end(), outer.end()) << child.name << " ends after its " << outer.name;
    ++nested;
  }
  EXPECT_EQ(nested, 4 * 50 * 3);
  EXPECT_FALSE(events_of(doc, "X", kCustomStep).empty()) << "no span of the custom step";

  // Tracks: the process is `comm [pid]`, each thread "thread T" / "main thread T".
  const auto names = process_names(doc);
  ASSERT_TRUE(names.contains(client.pid()));
  EXPECT_EQ(names.at(client.pid()), process_name(client));
  std::map<long long, std::string> thread_names;
  for (const json& e : events_of(doc, "M", "thread_name")) {
    if (e.at("pid").get<int>() != client.pid()) continue;
    const auto tid = e.at("tid").get<long long>();
    EXPECT_FALSE(thread_names.contains(tid)) << "thread " << tid << " named twice";
    thread_names[tid] = e.at("args").at("name").get<std::string>();
  }
  std::set<long long> tids;
  for (const ClientSpan& s : client.spans) tids.insert(s.tid);
  EXPECT_EQ(tids.size(), 5u);  // 4 workers and the main thread
  EXPECT_TRUE(tids.contains(client.pid()));
  for (const long long tid : tids) {
    ASSERT_TRUE(thread_names.contains(tid)) << "thread " << tid << " has no name";
    EXPECT_EQ(thread_names.at(tid),
              (tid == client.pid() ? "main thread " : "thread ") + std::to_string(tid));
  }

  // Ledger records: instants on the sender's thread, within the client's reads.
  const std::map<std::string, std::string> ops{
      {"reserve", "LedgerReserve"}, {"sample", "VramSample"}, {"release", "LedgerRelease"}};
  for (const ClientLedger& l : client.ledger) {
    const auto instants = events_of(doc, "i", ops.at(l.op));
    ASSERT_EQ(instants.size(), 1u) << ops.at(l.op);
    const json& e = instants.front();
    EXPECT_EQ(e.at("pid").get<int>(), client.pid());
    EXPECT_EQ(e.at("tid").get<long long>(), l.tid);
    EXPECT_EQ(e.at("cat"), "ledger");
    EXPECT_EQ(e.at("s"), "t");
    const std::int64_t ts = at_ns(doc, e);
    EXPECT_GE(ts, l.before - kToleranceNs) << l.op;
    EXPECT_LE(ts, l.after + kToleranceNs) << l.op;
    const json& args = e.at("args");
    EXPECT_EQ(args.at("gpu"), kGpu);
    EXPECT_EQ(args.at("applied"), true) << l.op;
    if (l.op == "reserve") {
      EXPECT_EQ(args.at("reservation_id").get<std::uint64_t>(), kReservationId);
      EXPECT_EQ(args.at("bytes").get<std::uint64_t>(), kReserveBytes);
      EXPECT_EQ(args.at("task"), "t");
    } else if (l.op == "sample") {
      EXPECT_EQ(args.at("free_bytes").get<std::uint64_t>(), kFreeBytes);
      EXPECT_EQ(args.at("total_bytes").get<std::uint64_t>(), kTotalBytes);
    } else {
      EXPECT_EQ(args.at("reservation_id").get<std::uint64_t>(), kReservationId);
    }
  }

  // GPU counters, on the daemon's pseudo process: reserved after each record, free after
  // the sample.
  EXPECT_EQ(names.count(daemon_->pid()), 1u);
  if (names.contains(daemon_->pid())) {
    EXPECT_EQ(names.at(daemon_->pid()), "steptraced: GPU memory");
  }
  std::vector<std::uint64_t> reserved;
  for (const json& e : events_of(doc, "C", std::string("VRAM reserved ") + kGpu)) {
    EXPECT_EQ(e.at("pid").get<int>(), daemon_->pid());
    reserved.push_back(e.at("args").at("bytes").get<std::uint64_t>());
  }
  EXPECT_EQ(reserved, (std::vector<std::uint64_t>{kReserveBytes, kReserveBytes, 0}));
  std::vector<std::uint64_t> free_bytes;
  for (const json& e : events_of(doc, "C", std::string("VRAM free ") + kGpu)) {
    EXPECT_EQ(e.at("pid").get<int>(), daemon_->pid());
    free_bytes.push_back(e.at("args").at("bytes").get<std::uint64_t>());
  }
  EXPECT_EQ(free_bytes, (std::vector<std::uint64_t>{kFreeBytes}));
}

// 2. A span a live client left open ends at the capture, marked open.
TEST_F(TraceTest, OpenSpanEndsAtCaptureTime) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const auto [pid, client] = spawn_client("client", {"--threads", "1", "--spans", "5", "--depth",
                                                     "2", "--open", "--hold-ms", "120000"});
  ASSERT_TRUE(client.open.has_value());

  const std::int64_t before = monotonic_ns();
  const json doc = trace();
  const std::int64_t after = monotonic_ns();
  ASSERT_TRUE(doc.is_object());
  const std::int64_t captured = ns_of(doc.at("otherData").at("captured_at_us"));
  EXPECT_GE(captured, before);
  EXPECT_LE(captured, after);

  const auto spans = spans_of(doc, client.pid());
  std::vector<TraceSpan> open;
  for (const TraceSpan& s : spans) {
    if (s.open) open.push_back(s);
  }
  ASSERT_EQ(open.size(), 1u) << "open spans in the trace";
  const TraceSpan& s = open.front();
  EXPECT_EQ(s.name, "Backward");
  EXPECT_EQ(s.tid, client.open->tid);
  EXPECT_GE(s.ts, client.open->before_start - kToleranceNs);
  EXPECT_LE(s.ts, client.open->after_start + kToleranceNs);
  EXPECT_NEAR(static_cast<double>(s.end()), static_cast<double>(captured), 1000.0)
      << "the open span does not end at the capture";
  // The completed ones are all there, none of them open.
  EXPECT_EQ(match_spans(client, spans).size(), client.spans.size());
  EXPECT_EQ(spans.size(), client.spans.size() + 1);
}

// 3. An exited process's spans stay in the window, its track marked "(exited)".
TEST_F(TraceTest, ExitedProcessSpansRemain) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const ClientRecord client =
      run_client("client", {"--threads", "2", "--spans", "20", "--depth", "3"});
  ASSERT_GT(client.pid(), 0);
  const std::string exited = process_name(client) + " (exited)";

  json doc;
  const auto deadline = Clock::now() + std::chrono::seconds(30);
  for (;;) {
    doc = trace();
    ASSERT_TRUE(doc.is_object());
    const auto names = process_names(doc);
    ASSERT_TRUE(names.contains(client.pid())) << "the exited client's track is gone";
    if (names.at(client.pid()) == exited) break;
    ASSERT_LT(Clock::now(), deadline) << "still named '" << names.at(client.pid()) << "'";
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const json stats = json_command("stats --json");
  ASSERT_TRUE(stats.is_object());
  EXPECT_GE(stats.at("processes").at("exited").get<long long>(), 1);

  const auto spans = spans_of(doc, client.pid());
  EXPECT_EQ(spans.size(), client.spans.size());
  EXPECT_EQ(match_spans(client, spans).size(), client.spans.size());
}

// 4. A 1 MiB budget and a client sending ~2 M events: the recorder stays within the
// budget, evicts the oldest, accounts for every event, and keeps the newest spans.
TEST_F(TraceTest, BudgetKeepsNewestAndAccountsForEveryEvent) {
  constexpr std::uint64_t kBudget = 1u << 20;
  constexpr long long kSpans = 1'000'000;
  ASSERT_NO_FATAL_FAILURE(start_daemon(R"({"flight_recorder_bytes": 1048576})"));
  // 16 MiB per-thread buffer: the 400,000 events between two of its flushes fit even if
  // its flusher does not run meanwhile.
  const ClientRecord client = run_client("client", {"--bulk", "--spans", std::to_string(kSpans)},
                                         {"STEPTRACE_BUFFER_BYTES=16M"});
  ASSERT_TRUE(client.first && client.last);
  EXPECT_EQ(client.num("recorded_spans"), kSpans + 2);

  const json fr = recorder_stats();
  ASSERT_TRUE(fr.contains("bytes"));
  EXPECT_EQ(fr.at("budget_bytes").get<std::uint64_t>(), kBudget);
  EXPECT_LE(fr.at("bytes").get<std::uint64_t>(), kBudget);
  EXPECT_GT(fr.at("events_evicted").get<std::uint64_t>(), 0u);
  EXPECT_EQ(fr.at("events_recorded").get<long long>(), 2 * (kSpans + 2));

  const json doc = trace();
  ASSERT_TRUE(doc.is_object());
  EXPECT_EQ(doc.at("otherData").at("budget_bytes").get<std::uint64_t>(), kBudget);
  const auto evicted = doc.at("otherData").at("events_evicted").get<long long>();
  EXPECT_EQ(evicted, fr.at("events_evicted").get<long long>());

  // Retained events: a span is its start and its end, one whose start was evicted only
  // its end.
  long long retained = 0;
  long long cut = 0;
  const auto spans = spans_of(doc, client.pid());
  for (const TraceSpan& s : spans) {
    EXPECT_FALSE(s.open);
    EXPECT_FALSE(s.clipped);
    if (s.start_before_window) ++cut;
    retained += s.start_before_window ? 1 : 2;
  }
  EXPECT_LE(cut, 1);
  EXPECT_GT(retained, 0);
  EXPECT_EQ(fr.at("events_recorded").get<long long>(), evicted + retained)
      << "evicted " << evicted << " + in the trace " << retained;

  // The newest spans: the last one is there, the first is not, nothing older than what
  // is kept.
  int last_found = 0;
  for (const TraceSpan& s : spans) {
    EXPECT_NE(s.name, "Forward") << "the first span survived";
    EXPECT_GT(s.ts, client.first->after_end);
    if (s.name == "Backward") {
      ++last_found;
      EXPECT_EQ(s.tid, client.last->tid);
      EXPECT_GE(s.ts, client.last->before_start - kToleranceNs);
      EXPECT_LE(s.ts, client.last->after_start + kToleranceNs);
      EXPECT_LE(s.end(), client.last->after_end + kToleranceNs);
    }
  }
  EXPECT_EQ(last_found, 1) << "the last span is not in the trace";

  const long long rss = rss_bytes(daemon_->pid());
  std::cerr << "daemon VmRSS " << (rss >> 20) << " MiB\n";
  EXPECT_GT(rss, 0);
  EXPECT_LT(rss, 200LL << 20) << "the daemon's VmRSS";
}

// 5. With the standing window off, `trace --for 2` records what happens during it, and
// only that; a plain `trace` holds nothing before or after.
TEST_F(TraceTest, ForRecordsWithWindowOff) {
  ASSERT_NO_FATAL_FAILURE(start_daemon(R"({"flight_recorder_bytes": 0})"));
  const ClientRecord before = run_client("before", {"--threads", "1", "--spans", "10"});
  EXPECT_EQ(recorder_stats().value("budget_bytes", -1LL), 0);
  {
    const json doc = trace();
    ASSERT_TRUE(doc.is_object());
    EXPECT_TRUE(spans_of(doc).empty()) << "spans in the trace with the window off";
  }

  std::optional<std::string> reply;
  std::int64_t replied_at = 0;
  std::thread waiter([&] {
    reply = command(socket(), "trace --for 2", kTraceTimeoutMs);
    replied_at = monotonic_ns();
  });
  // Wait until the capture runs, then run a client within its 2 s.
  bool active = false;
  const auto deadline = Clock::now() + std::chrono::seconds(10);
  while (!active && Clock::now() < deadline) {
    const json fr = recorder_stats();
    active = fr.value("captures_active", 0) == 1;
    if (active) {
      EXPECT_EQ(fr.value("budget_bytes", 0ULL), kCaptureBudget);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  }
  EXPECT_TRUE(active) << "trace --for never showed as an active capture";
  const ClientRecord during =
      run_client("during", {"--threads", "2", "--spans", "10", "--depth", "3"});
  const std::int64_t client_done = monotonic_ns();
  waiter.join();
  ASSERT_TRUE(reply.has_value()) << "trace --for 2: no reply";
  EXPECT_LT(client_done, replied_at) << "the client took longer than the capture (slow machine?)";

  const json doc = json::parse(*reply, nullptr, false);
  ASSERT_FALSE(doc.is_discarded()) << reply->substr(0, 300);
  const auto spans = spans_of(doc);
  EXPECT_TRUE(spans_of(doc, before.pid()).empty()) << "spans from before the capture";
  EXPECT_EQ(spans.size(), during.spans.size());
  EXPECT_EQ(match_spans(during, spans_of(doc, during.pid())).size(), during.spans.size());

  const json fr = recorder_stats();
  EXPECT_EQ(fr.value("captures_active", -1), 0);
  EXPECT_EQ(fr.value("budget_bytes", -1LL), 0);
  const json after = trace();
  ASSERT_TRUE(after.is_object());
  EXPECT_TRUE(spans_of(after).empty()) << "spans in the trace once the capture ended";
}

// Counts the lines of a trace document and checks its layout without parsing it whole
// (it may be hundreds of MB): the header, one event object per line, the footer.
// Of the spans: those not named Transpose, and those with "start_before_window" or
// "open" (one thread recording one step: at most one of each, at the window's ends).
struct TraceScan {
  long long spans = 0;
  long long other_names = 0;
  long long start_before_window = 0;
  long long open = 0;
  bool complete = false;
};
TraceScan scan_trace(const std::string& text) {
  TraceScan scan;
  std::size_t pos = 0;
  std::size_t line_no = 0;
  bool footer = false;
  bool events_ok = true;
  while (pos < text.size()) {
    std::size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    const std::string_view line(text.data() + pos, end - pos);
    if (line_no == 0) {
      if (line != R"({"traceEvents":[)") return scan;
    } else if (line.starts_with(R"(],"displayTimeUnit":"ms","otherData":{)")) {
      footer = end + 1 == text.size() && line.ends_with("}}");
    } else if (footer || !line.starts_with(R"({"ph":")") ||
               !(line.ends_with("},") || line.ends_with("}"))) {
      events_ok = false;
    } else if (line.starts_with(R"({"ph":"X")")) {
      ++scan.spans;
      if (line.find(R"("name":"Transpose")") == std::string_view::npos) ++scan.other_names;
      if (line.find(R"("start_before_window":true)") != std::string_view::npos) {
        ++scan.start_before_window;
      }
      if (line.find(R"("open":true)") != std::string_view::npos) ++scan.open;
    }
    ++line_no;
    pos = end + 1;
  }
  scan.complete = footer && events_ok;
  return scan;
}

// 6. Traces exported again and again while a trainer records ~1 M spans/s: each is a
// whole document, and the aggregates lose nothing.
TEST_F(TraceTest, ExportRacingBusyTrainerLosesNothing) {
  // A 4 MiB window (about 130,000 spans, 13 MB of JSON per trace): traces stay quick
  // under ASan, and the recorder evicts blocks that captures being sent still hold.
  ASSERT_NO_FATAL_FAILURE(start_daemon(R"({"flight_recorder_bytes": 4194304})"));
  const std::string out = file("busy");
  // A 32 MiB buffer (1 M spans, about a second of recording) so that a trainer thread
  // or flusher descheduled on a loaded 2-core machine drops nothing either.
  const pid_t pid =
      spawn_process(client_argv(out, {"--fast-ms", "2000"}), {"STEPTRACE_BUFFER_BYTES=32M"});
  ASSERT_GT(pid, 0);
  clients_.push_back(pid);

  int traces = 0;
  int with_spans = 0;
  long long most_spans = 0;
  std::size_t most_bytes = 0;
  bool exited = false;
  int status = -1;
  const auto deadline = Clock::now() + std::chrono::seconds(120);
  // Until the client has exited and at least 5 traces held its spans (the first ones,
  // before it connects, are empty).
  while ((with_spans < 5 || !exited) && Clock::now() < deadline) {
    const auto reply = command(socket(), "trace", kTraceTimeoutMs);
    ASSERT_TRUE(reply.has_value()) << "trace " << traces << ": no reply";
    const TraceScan scan = scan_trace(*reply);
    EXPECT_TRUE(scan.complete) << "trace " << traces << " (" << reply->size()
                               << " bytes) is not a whole document: " << reply->substr(0, 200)
                               << " ... "
                               << reply->substr(reply->size() > 200 ? reply->size() - 200 : 0);
    EXPECT_EQ(scan.other_names, 0) << "trace " << traces;
    EXPECT_LE(scan.start_before_window, 1) << "trace " << traces << ": ends without a start";
    EXPECT_LE(scan.open, 1) << "trace " << traces << ": starts without an end";
    ++traces;
    if (scan.spans > 0) ++with_spans;
    most_spans = std::max(most_spans, scan.spans);
    most_bytes = std::max(most_bytes, reply->size());
    if (!exited && (status = wait_process(pid, 0)) >= 0) exited = true;
  }
  if (!exited) status = wait_or_kill(pid, kClientTimeoutMs);
  clients_.clear();
  ASSERT_EQ(status, 0) << "the busy client";
  std::cerr << traces << " traces, " << with_spans << " with spans, up to " << most_spans
            << " spans (" << most_bytes << " bytes) each\n";
  EXPECT_GE(with_spans, 5);

  const auto record = read_record(out);
  ASSERT_TRUE(record.has_value());
  expect_delivered(*record);
  const long long recorded = record->num("recorded_spans");
  std::cerr << "the client recorded " << recorded << " spans\n";
  EXPECT_GT(recorded, 0);

  const json report = json_command("report --json --pid " + std::to_string(record->pid()));
  ASSERT_TRUE(report.is_object());
  ASSERT_EQ(report.at("processes").size(), 1u);
  const json& p = report.at("processes").at(0);
  EXPECT_EQ(p.at("dropped").get<long long>(), 0);
  long long count = -1;
  for (const json& s : p.at("steps")) {
    if (s.at("step") == "Transpose") count = s.at("count").get<long long>();
  }
  EXPECT_EQ(count, recorded) << "spans in the aggregates vs. recorded";
}

// 7. `trace --pid A` holds A's track only (and the GPU pseudo process at most).
TEST_F(TraceTest, PidFilterKeepsOneProcess) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const auto [pid_a, a] =
      spawn_client("a", {"--threads", "2", "--spans", "10", "--depth", "2", "--hold-ms", "120000"});
  const auto [pid_b, b] =
      spawn_client("b", {"--threads", "1", "--spans", "10", "--depth", "3", "--hold-ms", "120000"});
  ASSERT_GT(a.pid(), 0);
  ASSERT_GT(b.pid(), 0);

  for (const ClientRecord* mine : {&a, &b}) {
    const ClientRecord& other = mine == &a ? b : a;
    const json doc = trace("trace --pid " + std::to_string(mine->pid()));
    ASSERT_TRUE(doc.is_object());
    const auto names = process_names(doc);
    ASSERT_TRUE(names.contains(mine->pid()));
    EXPECT_EQ(names.at(mine->pid()), process_name(*mine));
    EXPECT_FALSE(names.contains(other.pid()));
    for (const json& e : doc.at("traceEvents")) {
      const int pid = e.at("pid").get<int>();
      EXPECT_TRUE(pid == mine->pid() || pid == daemon_->pid()) << e.dump();
    }
    const auto spans = spans_of(doc);
    EXPECT_EQ(spans.size(), mine->spans.size());
    EXPECT_EQ(match_spans(*mine, spans).size(), mine->spans.size());
  }

  const json both =
      trace("trace --pid " + std::to_string(a.pid()) + " --pid " + std::to_string(b.pid()));
  ASSERT_TRUE(both.is_object());
  EXPECT_EQ(spans_of(both).size(), a.spans.size() + b.spans.size());
  const json none = trace("trace --pid 2147483646");
  ASSERT_TRUE(none.is_object());
  EXPECT_TRUE(process_names(none).empty());
  EXPECT_TRUE(spans_of(none).empty());
}

// 8. Bad requests get one error line each, and the connection goes on.
TEST_F(TraceTest, BadRequestsGetOneErrorLine) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const std::vector<std::string> bad{"trace --last 0", "trace --last abc", "trace --for 5000",
                                     "trace --last 1 --for 1", "trace --pid 0"};
  std::string all;
  for (const std::string& line : bad) {
    const auto reply = command(socket(), line + "\nping");
    ASSERT_TRUE(reply.has_value()) << line;
    const std::size_t nl = reply->find('\n');
    ASSERT_NE(nl, std::string::npos) << line << ": " << *reply;
    EXPECT_EQ(reply->rfind("error: trace: ", 0), 0u) << line << ": " << *reply;
    EXPECT_EQ(reply->substr(nl + 1), "pong\n") << line << ": " << *reply;
    all += line + "\n";
  }
  const auto reply = command(socket(), all + "ping");
  ASSERT_TRUE(reply.has_value());
  std::istringstream lines(*reply);
  std::vector<std::string> got;
  for (std::string line; std::getline(lines, line);) got.push_back(line);
  ASSERT_EQ(got.size(), bad.size() + 1) << *reply;
  for (std::size_t i = 0; i < bad.size(); ++i) {
    EXPECT_EQ(got[i].rfind("error: trace: ", 0), 0u) << bad[i] << ": " << got[i];
  }
  EXPECT_EQ(got.back(), "pong");
  EXPECT_EQ(recorder_stats().value("captures_active", -1), 0);
}

// A trace whose choice of processes fails on the render thread, after its uid's trace
// slot was taken (--job of no process, --children of no live process, the same after a
// --for), gives the slot back with its error: a uid has 2, and after three times that
// many such errors, on connections of their own and pipelined on one, its traces are
// answered and no capture is left open.
TEST_F(TraceTest, SelectionsRefusedOnTheRenderThreadGiveTheSlotBack) {
  ASSERT_NO_FATAL_FAILURE(start_daemon());
  const std::vector<std::string> refused{"trace --job nosuch", "trace --pid 999999 --children",
                                         "trace --job nosuch --for 0.05"};
  std::string all;
  for (int round = 0; round < 2; ++round) {
    for (const std::string& line : refused) {
      const auto reply = command(socket(), line, kTraceTimeoutMs);
      ASSERT_TRUE(reply.has_value()) << line;
      EXPECT_EQ(reply->rfind("error: trace: ", 0), 0u) << line << ": " << *reply;
      EXPECT_EQ(reply->find('\n'), reply->size() - 1) << line << ": " << *reply;
      all += line + "\n";
    }
  }
  const auto reply = command(socket(), all + "trace", kTraceTimeoutMs);
  ASSERT_TRUE(reply.has_value());
  std::istringstream lines(*reply);
  std::string line;
  for (std::size_t i = 0; i < 2 * refused.size(); ++i) {
    ASSERT_TRUE(std::getline(lines, line)) << *reply;
    EXPECT_EQ(line.rfind("error: trace: ", 0), 0u) << i << ": " << line;
  }
  ASSERT_TRUE(std::getline(lines, line)) << *reply;
  EXPECT_EQ(line.rfind(R"({"traceEvents":[)", 0), 0u) << line;
  EXPECT_TRUE(trace("trace").is_object());
  EXPECT_EQ(recorder_stats().value("captures_active", -1), 0);
}

}  // namespace
}  // namespace steptrace::testing
