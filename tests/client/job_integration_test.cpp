// Jobs and ranks end to end: real trainer processes (trainer_main.cpp)
// started with STEPTRACE_JOB / TORCHELASTIC_RUN_ID / SLURM_* / RANK / LOCAL_RANK /
// WORLD_SIZE in their environment (the library reads them at load), the real steptraced
// on a temporary socket, and what `report`, `report --json`, `report --job`, `metrics`
// and the steptrace CLI say about them.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"

extern char** environ;

namespace steptrace::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using Clock = std::chrono::steady_clock;
using Env = std::map<std::string, std::string>;
using nlohmann::json;

constexpr long long kMs = 1'000'000;

// What decides a process's identity, plus STEPTRACE_QUIET and STEPTRACE_DISABLE: never
// inherited from the test's own environment (a CI job may run under Slurm or torchrun),
// only set by a test.
constexpr const char* kIdentityVariables[] = {
    "STEPTRACE_JOB", "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",     "RANK",
    "SLURM_PROCID",  "LOCAL_RANK",          "SLURM_LOCALID",    "WORLD_SIZE",
    "SLURM_NTASKS",  "STEPTRACE_QUIET",     "STEPTRACE_DISABLE"};

// fork/exec `argv` with this process's environment less kIdentityVariables, plus `env`;
// stdout / stderr to files when given.
pid_t spawn(const std::vector<std::string>& argv, const Env& env,
            const std::string& stdout_path = {}, const std::string& stderr_path = {}) {
  std::vector<std::string> envs;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry = *e;
    const std::string name = entry.substr(0, entry.find('='));
    const bool identity = std::any_of(std::begin(kIdentityVariables), std::end(kIdentityVariables),
                                      [&](const char* v) { return name == v; });
    if (!identity && env.count(name) == 0) envs.push_back(entry);
  }
  for (const auto& [name, value] : env) envs.push_back(name + "=" + value);
  std::vector<std::string> args = argv;
  std::vector<char*> a, e;
  for (auto& s : args) a.push_back(s.data());
  a.push_back(nullptr);
  for (auto& s : envs) e.push_back(s.data());
  e.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    const auto redirect = [](const std::string& path, int fd) {
      if (path.empty()) return;
      const int f = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      if (f < 0) std::_Exit(126);
      ::dup2(f, fd);
    };
    redirect(stdout_path, STDOUT_FILENO);
    redirect(stderr_path, STDERR_FILENO);
    ::execve(a[0], a.data(), e.data());
    std::_Exit(127);
  }
  return pid;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::map<std::string, long long> read_values(const std::string& path) {
  std::ifstream in(path);
  std::map<std::string, long long> v;
  std::string key;
  long long value;
  while (in >> key >> value) v[key] = value;
  return v;
}

bool wait_until(const std::function<bool()>& done, int timeout_ms = 20000) {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    if (done()) return true;
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

// The step object named `step` in a "steps" or "totals" array; null when absent.
json step_of(const json& steps, const std::string& step) {
  for (const auto& s : steps) {
    if (s.at("step") == step) return s;
  }
  return nullptr;
}

long long field(const json& steps, const std::string& step, const std::string& name) {
  const json s = step_of(steps, step);
  return s.is_null() ? -1 : s.at(name).get<long long>();
}

// The process object of `pid`; null when absent.
json process_of(const json& report, long long pid) {
  for (const auto& p : report.at("processes")) {
    if (p.at("pid").get<long long>() == pid) return p;
  }
  return nullptr;
}

// The "jobs" entry for `job` (nullptr: the processes without a job id); null when absent.
json job_of(const json& report, const json& job) {
  for (const auto& j : report.at("jobs")) {
    if (j.at("job") == job) return j;
  }
  return nullptr;
}

// ---- Prometheus text ----------------------------------------------------------------------

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

std::vector<Sample> parse_metrics(const std::string& text) {
  std::vector<Sample> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    Sample s;
    std::size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ') ++i;
    s.name = line.substr(0, i);
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        const std::size_t eq = line.find('=', i);
        if (eq == std::string::npos || eq + 1 >= line.size() || line[eq + 1] != '"') break;
        const std::string key = line.substr(i, eq - i);
        std::string value;
        std::size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value += line[j] == 'n' ? '\n' : line[j];
          } else {
            value += line[j];
          }
        }
        s.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      ++i;  // '}'
    }
    while (i < line.size() && line[i] == ' ') ++i;
    s.value = std::strtod(line.c_str() + i, nullptr);
    out.push_back(std::move(s));
  }
  return out;
}

// The value of the sample of `name` with exactly `labels`; nullopt when there is none.
std::optional<double> metric(const std::vector<Sample>& samples, const std::string& name,
                             const std::map<std::string, std::string>& labels) {
  for (const Sample& s : samples) {
    if (s.name == name && s.labels == labels) return s.value;
  }
  return std::nullopt;
}

// The samples of `name` whose labels include `labels`.
std::vector<Sample> samples_with(const std::vector<Sample>& samples, const std::string& name,
                                 const std::map<std::string, std::string>& labels) {
  std::vector<Sample> out;
  for (const Sample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [k, v] : labels) {
      const auto it = s.labels.find(k);
      match = match && it != s.labels.end() && it->second == v;
    }
    if (match) out.push_back(s);
  }
  return out;
}

// ---- text report ----------------------------------------------------------------------------

// The "── Process PID (...)" header line of `pid`; "" when absent.
std::string process_header(const std::string& text, long long pid) {
  const std::string start = "── Process " + std::to_string(pid) + " (";
  const std::size_t at = text.find(start);
  if (at == std::string::npos) return {};
  return text.substr(at, text.find('\n', at) - at);
}

// How many lines are the step table's header ("Step | Count | ... | Self | % Self").
int table_headers(const std::string& text) {
  int n = 0;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("Step ", 0) == 0 && line.find("| Self") != std::string::npos &&
        line.find("| % Self") != std::string::npos) {
      ++n;
    }
  }
  return n;
}

// The section of `text` from the line starting with `header` up to the next job header
// ("══ ") or the ledger; "" when the header is absent.
std::string job_section(const std::string& text, const std::string& header) {
  const std::size_t at = text.find("\n" + header);
  if (at == std::string::npos) return {};
  std::size_t end = text.find("\n══ ", at + 1);
  if (end == std::string::npos) end = text.find("[VRAM Ledger]", at);
  return text.substr(at + 1, end == std::string::npos ? std::string::npos : end - at - 1);
}

class JobIntegration : public ::testing::Test {
 protected:
  void SetUp() override {
    std::vector<std::string> args;
    if (!config().empty()) {
      const std::string path = dir_.file("steptraced.json");
      std::ofstream(path) << config();
      args = {"--config", path};
    }
    daemon_ = std::make_unique<DaemonProcess>(socket(), args);
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  void TearDown() override {
    for (const auto& [name, pid] : holders_) {
      release(name);
      wait_or_kill(pid, 20000);
    }
  }
  virtual std::string config() const { return {}; }

  std::string socket() const { return dir_.file("d.sock"); }
  std::string out(const std::string& name) const { return dir_.file(name + ".out"); }

  // A trainer "hold" process: kSpans Forward spans with a Matmul inside each, flushed;
  // alive and connected until release(name).
  static constexpr int kSpans = 200;
  pid_t hold(const std::string& name, const Env& env) {
    const pid_t pid = spawn({STEPTRACE_TEST_TRAINER, "hold", socket(), out(name),
                             std::to_string(kSpans), dir_.file(name + ".release")},
                            env, {}, dir_.file(name + ".err"));
    if (pid > 0) holders_[name] = pid;
    return pid;
  }
  void release(const std::string& name) { std::ofstream(dir_.file(name + ".release")) << "go\n"; }
  // Releases a hold process and waits for its exit status.
  int release_and_wait(const std::string& name) {
    release(name);
    const auto it = holders_.find(name);
    if (it == holders_.end()) return -1;
    const int status = wait_or_kill(it->second, 30000);
    holders_.erase(it);
    return status;
  }

  // The out file of `name` once written (its pid, dropped); fails the test past 30 s.
  std::map<std::string, long long> wait_out(const std::string& name) {
    std::map<std::string, long long> v;
    if (!wait_until(
            [&] {
              v = read_values(out(name));
              return v.count("pid") != 0;
            },
            30000)) {
      ADD_FAILURE() << "no out file from " << name
                    << "; stderr: " << read_file(dir_.file(name + ".err"));
    }
    return v;
  }
  long long pid_of(const std::string& name) {
    const auto v = wait_out(name);
    const auto it = v.find("pid");
    return it == v.end() ? -1 : it->second;
  }

  // steptrace_test_trainer "basic" (N Forward + N Tokenize spans, flushed, exit), run to
  // its end with `env`; stderr kept in NAME.err. Its pid, -1 when it failed.
  long long run_basic(const std::string& name, const Env& env, int spans = 100) {
    const pid_t pid =
        spawn({STEPTRACE_TEST_TRAINER, "basic", socket(), out(name), std::to_string(spans)}, env,
              {}, dir_.file(name + ".err"));
    const int status = wait_or_kill(pid, 60000);
    EXPECT_EQ(status, 0) << name << ": " << read_file(dir_.file(name + ".err"));
    return status == 0 ? pid_of(name) : -1;
  }

  std::string err_of(const std::string& name) const { return read_file(dir_.file(name + ".err")); }

  json report_json(const std::string& args = {}) {
    const auto reply = command(socket(), "report --json" + args);
    EXPECT_TRUE(reply.has_value()) << "report --json" << args;
    if (!reply) return json::object({{"processes", json::array()}, {"jobs", json::array()}});
    json doc = json::parse(*reply, nullptr, false);
    EXPECT_FALSE(doc.is_discarded()) << *reply;
    if (doc.is_discarded()) {
      return json::object({{"processes", json::array()}, {"jobs", json::array()}});
    }
    return doc;
  }
  std::string text(const std::string& line) {
    const auto reply = command(socket(), line);
    EXPECT_TRUE(reply.has_value()) << line;
    return reply.value_or("");
  }
  std::vector<Sample> metrics() { return parse_metrics(text("metrics")); }

  struct CliResult {
    int status = -1;
    std::string out, err;
  };
  CliResult cli(const std::vector<std::string>& args) {
    std::vector<std::string> argv{STEPTRACE_CLI_BIN, "--socket", socket()};
    argv.insert(argv.end(), args.begin(), args.end());
    const std::string o = dir_.file("cli.out"), e = dir_.file("cli.err");
    CliResult r;
    r.status = wait_or_kill(spawn(argv, {}, o, e), 30000);
    r.out = read_file(o);
    r.err = read_file(e);
    return r;
  }

  const std::string uid_ = std::to_string(::getuid());
  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::map<std::string, pid_t> holders_;
};

Env job_env(const std::string& job, int rank, int local_rank, int world_size) {
  return {{"STEPTRACE_JOB", job},
          {"RANK", std::to_string(rank)},
          {"LOCAL_RANK", std::to_string(local_rank)},
          {"WORLD_SIZE", std::to_string(world_size)}};
}

// Two jobs of two ranks each and one process without a job id, all live: each process
// object says its job and ranks, "jobs" groups them with per-job totals, and the text
// report has a section per job with its processes under it. One rank then exits.
TEST_F(JobIntegration, TwoJobsOfTwoRanksAndAJoblessProcess) {
  ASSERT_GT(hold("a0", job_env("job-a", 0, 0, 2)), 0);
  ASSERT_GT(hold("a1", job_env("job-a", 1, 1, 2)), 0);
  ASSERT_GT(hold("b0", job_env("job-b", 0, 0, 2)), 0);
  ASSERT_GT(hold("b1", job_env("job-b", 1, 0, 2)), 0);  // rank 1 on another node
  ASSERT_GT(hold("solo", {}), 0);
  std::map<std::string, long long> pid;
  for (const char* name : {"a0", "a1", "b0", "b1", "solo"}) {
    pid[name] = pid_of(name);
    ASSERT_GT(pid[name], 0) << name;
  }

  // ---- report --json: process objects ----
  const json report = report_json();
  ASSERT_EQ(report.at("processes").size(), 5u) << report.dump(1);
  struct Expect {
    const char* name;
    json job, rank, local_rank, world_size;
  };
  for (const Expect& x : {Expect{"a0", "job-a", 0, 0, 2}, Expect{"a1", "job-a", 1, 1, 2},
                          Expect{"b0", "job-b", 0, 0, 2}, Expect{"b1", "job-b", 1, 0, 2},
                          Expect{"solo", nullptr, nullptr, nullptr, nullptr}}) {
    SCOPED_TRACE(x.name);
    const json p = process_of(report, pid[x.name]);
    ASSERT_TRUE(p.is_object()) << report.dump(1);
    EXPECT_EQ(p.at("job"), x.job);
    EXPECT_EQ(p.at("rank"), x.rank);
    EXPECT_EQ(p.at("local_rank"), x.local_rank);
    EXPECT_EQ(p.at("world_size"), x.world_size);
    EXPECT_EQ(field(p.at("steps"), "Forward", "count"), kSpans);
    EXPECT_EQ(field(p.at("steps"), "Matmul", "count"), kSpans);
  }

  // ---- report --json: jobs ----
  const json& jobs = report.at("jobs");
  ASSERT_EQ(jobs.size(), 3u) << jobs.dump(1);
  for (const char* name : {"job-a", "job-b"}) {
    SCOPED_TRACE(name);
    const json j = job_of(report, name);
    ASSERT_TRUE(j.is_object()) << jobs.dump(1);
    EXPECT_EQ(j.at("uid"), ::getuid());
    EXPECT_EQ(j.at("processes"), 2);
    EXPECT_EQ(j.at("live"), 2);
    EXPECT_EQ(j.at("ranks"), json::array({0, 1}));
    EXPECT_EQ(j.at("world_size"), 2);
    const json& totals = j.at("totals");
    EXPECT_EQ(field(totals, "Forward", "count"), 2 * kSpans);
    EXPECT_EQ(field(totals, "Matmul", "count"), 2 * kSpans);
    EXPECT_EQ(field(totals, "Forward", "processes"), 2);
    ASSERT_TRUE(step_of(totals, "Forward").contains("self_ns")) << totals.dump(1);
    // Each Forward holds one Matmul: its self time is what is left of it.
    EXPECT_EQ(field(totals, "Forward", "self_ns"),
              field(totals, "Forward", "total_ns") - field(totals, "Matmul", "total_ns"));
    EXPECT_EQ(field(totals, "Matmul", "self_ns"), field(totals, "Matmul", "total_ns"));
  }
  const json none = job_of(report, nullptr);
  ASSERT_TRUE(none.is_object()) << jobs.dump(1);
  EXPECT_EQ(none.at("uid"), ::getuid());
  EXPECT_EQ(none.at("processes"), 1);
  EXPECT_EQ(none.at("live"), 1);
  EXPECT_EQ(none.at("ranks"), json::array());
  EXPECT_TRUE(none.at("world_size").is_null());
  EXPECT_EQ(field(none.at("totals"), "Forward", "count"), kSpans);
  EXPECT_EQ(field(report.at("totals"), "Forward", "count"), 5 * kSpans);

  // ---- text report: a section per job, its processes under it ----
  const std::string all = text("report");
  EXPECT_THAT(all, HasSubstr("Processes: 5 · jobs: 3\n"));
  const std::string a_header =
      "══ Job job-a (uid " + uid_ + ") · 2 processes (2 live) · ranks 0-1 of 2";
  const std::string b_header =
      "══ Job job-b (uid " + uid_ + ") · 2 processes (2 live) · ranks 0-1 of 2";
  const std::string none_header =
      "══ Processes without a job id (uid " + uid_ + ") · 1 process (1 live)";
  const std::string a = job_section(all, a_header);
  const std::string b = job_section(all, b_header);
  const std::string solo = job_section(all, none_header);
  ASSERT_FALSE(a.empty()) << all;
  ASSERT_FALSE(b.empty()) << all;
  ASSERT_FALSE(solo.empty()) << all;
  EXPECT_THAT(process_header(a, pid["a0"]), HasSubstr(") · rank 0/2 (local 0) · alive")) << a;
  EXPECT_THAT(process_header(a, pid["a1"]), HasSubstr(") · rank 1/2 (local 1) · alive")) << a;
  EXPECT_THAT(process_header(b, pid["b0"]), HasSubstr(") · rank 0/2 (local 0) · alive")) << b;
  EXPECT_THAT(process_header(b, pid["b1"]), HasSubstr(") · rank 1/2 (local 0) · alive")) << b;
  EXPECT_THAT(process_header(solo, pid["solo"]), HasSubstr(") · alive ·")) << solo;
  EXPECT_THAT(process_header(solo, pid["solo"]), Not(HasSubstr("rank"))) << solo;
  for (const char* other : {"b0", "b1", "solo"}) EXPECT_EQ(process_header(a, pid[other]), "") << a;
  for (const char* other : {"a0", "a1", "solo"}) EXPECT_EQ(process_header(b, pid[other]), "") << b;
  for (const char* other : {"a0", "a1", "b0", "b1"}) {
    EXPECT_EQ(process_header(solo, pid[other]), "") << solo;
  }
  // All processes, each job of two, each process: seven tables.
  EXPECT_EQ(table_headers(all), 1 + 2 + 5) << all;

  // ---- one rank exits ----
  ASSERT_EQ(release_and_wait("a1"), 0) << err_of("a1");
  ASSERT_TRUE(wait_until([&] {
    const json p = process_of(report_json(), pid["a1"]);
    return p.is_object() && !p.at("alive").get<bool>();
  })) << report_json().dump(1);
  const json after = report_json();
  const json a_after = job_of(after, "job-a");
  ASSERT_TRUE(a_after.is_object()) << after.dump(1);
  EXPECT_EQ(a_after.at("processes"), 2);
  EXPECT_EQ(a_after.at("live"), 1);
  EXPECT_EQ(a_after.at("ranks"), json::array({0, 1}));
  EXPECT_EQ(field(a_after.at("totals"), "Forward", "count"), 2 * kSpans);
  EXPECT_EQ(process_of(after, pid["a1"]).at("rank"), 1);  // kept after the exit
  const std::string text_after = text("report");
  const std::string a_exited = job_section(
      text_after, "══ Job job-a (uid " + uid_ + ") · 2 processes (1 live) · ranks 0-1 of 2");
  ASSERT_FALSE(a_exited.empty()) << text_after;
  const std::string exited_header = process_header(a_exited, pid["a1"]);
  EXPECT_THAT(exited_header, HasSubstr(") · rank 1/2 (local 1) · exit noticed ")) << a_exited;
  EXPECT_THAT(exited_header, HasSubstr(" ago ·")) << a_exited;
  EXPECT_THAT(process_header(a_exited, pid["a0"]), HasSubstr(" · alive")) << a_exited;
}

// `report --job ID` (text and JSON, through the daemon and the CLI) covers that job's
// processes only; one process is printed once, with its job in the header; a job nobody
// has is an error, and exit 1 from the CLI. (Jobs of two uids with one id:
// tests/hostile/jobs_test.cpp.)
TEST_F(JobIntegration, ReportJobShowsOneJob) {
  ASSERT_GT(hold("a0", job_env("job-a", 0, 0, 2)), 0);
  ASSERT_GT(hold("a1", job_env("job-a", 1, 1, 2)), 0);
  ASSERT_GT(hold("b0", job_env("job-b", 0, 0, 1)), 0);
  ASSERT_GT(hold("solo", {}), 0);
  std::map<std::string, long long> pid;
  for (const char* name : {"a0", "a1", "b0", "solo"}) {
    pid[name] = pid_of(name);
    ASSERT_GT(pid[name], 0) << name;
  }

  // JSON.
  const json a = report_json(" --job job-a");
  std::set<long long> pids;
  for (const auto& p : a.at("processes")) pids.insert(p.at("pid").get<long long>());
  EXPECT_EQ(pids, (std::set<long long>{pid["a0"], pid["a1"]})) << a.dump(1);
  ASSERT_EQ(a.at("jobs").size(), 1u) << a.dump(1);
  EXPECT_EQ(a.at("jobs")[0].at("job"), "job-a");
  EXPECT_EQ(a.at("jobs")[0].at("processes"), 2);
  EXPECT_EQ(field(a.at("totals"), "Forward", "count"), 2 * kSpans);

  // Text, two processes of one job.
  const std::string a_text = text("report --job job-a");
  EXPECT_THAT(a_text, HasSubstr("(job job-a (uid " + uid_ + "))")) << a_text;
  EXPECT_THAT(a_text, HasSubstr("══ Job job-a (uid " + uid_ + ") · 2 processes (2 live)"))
      << a_text;
  EXPECT_THAT(process_header(a_text, pid["a0"]), HasSubstr("rank 0/2 (local 0)")) << a_text;
  EXPECT_THAT(process_header(a_text, pid["a1"]), HasSubstr("rank 1/2 (local 1)")) << a_text;
  EXPECT_EQ(process_header(a_text, pid["b0"]), "") << a_text;
  EXPECT_EQ(process_header(a_text, pid["solo"]), "") << a_text;
  EXPECT_THAT(a_text, Not(HasSubstr("job-b"))) << a_text;

  // Text, a job of one process: its header names the job, its table is printed once.
  const std::string b_text = text("report --job job-b");
  EXPECT_THAT(process_header(b_text, pid["b0"]),
              HasSubstr(") · job job-b · rank 0/1 (local 0) · alive"))
      << b_text;
  EXPECT_EQ(table_headers(b_text), 1) << b_text;
  EXPECT_EQ(process_header(b_text, pid["a0"]), "") << b_text;

  // report --pid N: one table too, the job in the header.
  const std::string pid_text = text("report --pid " + std::to_string(pid["a1"]));
  EXPECT_EQ(table_headers(pid_text), 1) << pid_text;
  EXPECT_THAT(process_header(pid_text, pid["a1"]),
              HasSubstr(") · job job-a · rank 1/2 (local 1) · alive"))
      << pid_text;
  const std::string solo_text = text("report --pid " + std::to_string(pid["solo"]));
  EXPECT_EQ(table_headers(solo_text), 1) << solo_text;
  EXPECT_THAT(process_header(solo_text, pid["solo"]), Not(HasSubstr(" · job "))) << solo_text;

  // Both filters: the process must be of the job.
  EXPECT_EQ(
      report_json(" --pid " + std::to_string(pid["a0"]) + " --job job-a").at("processes").size(),
      1u);
  EXPECT_EQ(
      report_json(" --pid " + std::to_string(pid["a0"]) + " --job job-b").at("processes").size(),
      0u);
  EXPECT_THAT(text("report --pid " + std::to_string(pid["a0"]) + " --job job-b"),
              HasSubstr("No process with pid " + std::to_string(pid["a0"]) +
                        " is tracked in job job-b (uid " + uid_ + ")."));
  // A job id the wire could not carry is refused.
  EXPECT_THAT(text("report --job " + std::string(64, 'x')), HasSubstr("--job needs a job id"));

  // A job nobody has: an error (the test's uid is the daemon's, which may name any uid's
  // job by its bare id, so it is told no uid has one).
  EXPECT_EQ(text("report --json --job nope"), "error: report: no job 'nope' for any uid\n");
  EXPECT_EQ(text("report --job nope"), "error: report: no job 'nope' for any uid\n");
  // Its own job by UID:ID too.
  EXPECT_EQ(report_json(" --job " + uid_ + ":job-a").at("processes").size(), 2u);

  // The CLI.
  const CliResult ok = cli({"report", "--job", "job-a"});
  EXPECT_EQ(ok.status, 0) << ok.err;
  EXPECT_NE(process_header(ok.out, pid["a0"]), "") << ok.out;
  EXPECT_NE(process_header(ok.out, pid["a1"]), "") << ok.out;
  EXPECT_EQ(process_header(ok.out, pid["b0"]), "") << ok.out;
  const CliResult ok_json = cli({"report", "--json", "--job", "job-b"});
  EXPECT_EQ(ok_json.status, 0) << ok_json.err;
  const json b_doc = json::parse(ok_json.out, nullptr, false);
  ASSERT_FALSE(b_doc.is_discarded()) << ok_json.out;
  ASSERT_EQ(b_doc.at("processes").size(), 1u) << ok_json.out;
  EXPECT_EQ(b_doc.at("processes")[0].at("pid"), pid["b0"]);
  EXPECT_EQ(b_doc.at("processes")[0].at("job"), "job-b");

  const CliResult missing = cli({"report", "--job", "nope"});
  EXPECT_EQ(missing.status, 1) << missing.out << missing.err;
  EXPECT_THAT(missing.err, HasSubstr("no job 'nope'")) << missing.err;
  const CliResult missing_json = cli({"report", "--json", "--job", "nope"});
  EXPECT_EQ(missing_json.status, 1) << missing_json.out << missing_json.err;
  const CliResult mismatch = cli({"report", "--pid", std::to_string(pid["a0"]), "--job", "job-b"});
  EXPECT_EQ(mismatch.status, 1) << mismatch.out << mismatch.err;
}

// Which variable names the job: TORCHELASTIC_RUN_ID alone, STEPTRACE_JOB over SLURM_JOB_ID,
// SLURM's own; a job id past 63 characters is cut. Run with steptrace_test_trainer.
TEST_F(JobIntegration, EnvironmentVariablesNameTheJob) {
  const std::string long_id(80, 'L');
  const long long te = run_basic("te", {{"TORCHELASTIC_RUN_ID", "te-run-7"},
                                        {"RANK", "3"},
                                        {"LOCAL_RANK", "1"},
                                        {"WORLD_SIZE", "4"}});
  const long long mine = run_basic("mine", {{"STEPTRACE_JOB", "mine"},
                                            {"TORCHELASTIC_RUN_ID", "te-other"},
                                            {"SLURM_JOB_ID", "999"},
                                            {"SLURM_PROCID", "1"},
                                            {"SLURM_NTASKS", "2"}});
  const long long slurm = run_basic("slurm", {{"SLURM_JOB_ID", "31337"},
                                              {"SLURM_PROCID", "0"},
                                              {"SLURM_LOCALID", "0"},
                                              {"SLURM_NTASKS", "2"}});
  const long long empty = run_basic("empty", {{"STEPTRACE_JOB", ""}, {"SLURM_JOB_ID", "42"}});
  const long long cut = run_basic("long", {{"STEPTRACE_JOB", long_id}});
  const long long tab = run_basic("tab", {{"STEPTRACE_JOB", "tab\there"}});
  for (long long p : {te, mine, slurm, empty, cut, tab}) ASSERT_GT(p, 0);

  const json report = report_json();
  struct Expect {
    long long pid;
    json job, rank, local_rank, world_size;
  };
  for (const Expect& x :
       {Expect{te, "te-run-7", 3, 1, 4}, Expect{mine, "mine", 1, nullptr, 2},
        Expect{slurm, "31337", 0, 0, 2}, Expect{empty, "42", nullptr, nullptr, nullptr},
        Expect{cut, long_id.substr(0, 63), nullptr, nullptr, nullptr},
        Expect{tab, "tab?here", nullptr, nullptr, nullptr}}) {
    SCOPED_TRACE(x.job.dump());
    const json p = process_of(report, x.pid);
    ASSERT_TRUE(p.is_object()) << report.dump(1);
    EXPECT_EQ(p.at("job"), x.job);
    EXPECT_EQ(p.at("rank"), x.rank);
    EXPECT_EQ(p.at("local_rank"), x.local_rank);
    EXPECT_EQ(p.at("world_size"), x.world_size);
    EXPECT_EQ(field(p.at("steps"), "Forward", "count"), 100);
  }
  for (const char* name : {"te", "mine", "slurm", "empty", "long", "tab"}) {
    EXPECT_THAT(err_of(name), Not(HasSubstr("steptrace:"))) << name;
  }
  // --job finds a process by the job id it was given under torchrun.
  const json te_only = report_json(" --job te-run-7");
  ASSERT_EQ(te_only.at("processes").size(), 1u) << te_only.dump(1);
  EXPECT_EQ(te_only.at("processes")[0].at("pid"), te);
  EXPECT_EQ(text("report --json --job te-other"), "error: report: no job 'te-other' for any uid\n");
  EXPECT_EQ(text("report --json --job 999"), "error: report: no job '999' for any uid\n");
}

// A rank that is not a number, or not below the world size, is said on stderr and not
// sent (the rest of the identity is); STEPTRACE_QUIET=1 keeps stderr quiet.
TEST_F(JobIntegration, BadRankIsSaidOnStderrAndNotSent) {
  const long long bad =
      run_basic("bad", {{"STEPTRACE_JOB", "jbad"}, {"RANK", "abc"}, {"WORLD_SIZE", "2"}});
  const long long quiet = run_basic(
      "quiet",
      {{"STEPTRACE_JOB", "jbad"}, {"RANK", "abc"}, {"WORLD_SIZE", "2"}, {"STEPTRACE_QUIET", "1"}});
  const long long outside =
      run_basic("outside", {{"STEPTRACE_JOB", "jbad"}, {"RANK", "5"}, {"WORLD_SIZE", "2"}});
  const long long good =
      run_basic("good", {{"STEPTRACE_JOB", "jbad"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}});
  for (long long p : {bad, quiet, outside, good}) ASSERT_GT(p, 0);

  EXPECT_THAT(err_of("bad"), HasSubstr("steptrace: RANK='abc'")) << err_of("bad");
  EXPECT_THAT(err_of("quiet"), Not(HasSubstr("steptrace"))) << err_of("quiet");
  EXPECT_THAT(err_of("outside"), HasSubstr("steptrace: rank 5 is not below the world size 2"))
      << err_of("outside");
  EXPECT_THAT(err_of("good"), Not(HasSubstr("steptrace:"))) << err_of("good");

  const json report = report_json(" --job jbad");
  ASSERT_EQ(report.at("processes").size(), 4u) << report.dump(1);
  for (long long p : {bad, quiet, outside}) {
    const json proc = process_of(report, p);
    ASSERT_TRUE(proc.is_object()) << report.dump(1);
    EXPECT_EQ(proc.at("job"), "jbad");
    EXPECT_TRUE(proc.at("rank").is_null()) << proc.dump();
    EXPECT_EQ(proc.at("world_size"), 2);
  }
  EXPECT_EQ(process_of(report, good).at("rank"), 1);
  ASSERT_EQ(report.at("jobs").size(), 1u);
  EXPECT_EQ(report.at("jobs")[0].at("ranks"), json::array({1}));
  EXPECT_EQ(report.at("jobs")[0].at("processes"), 4);
}

// Each connection's hello is followed by the identity: a daemon restarted under a running
// trainer (steptrace_test_trainer "restart") learns its job and rank on the reconnect.
TEST_F(JobIntegration, IdentityIsSentAgainAfterTheDaemonRestarts) {
  const pid_t pid = spawn({STEPTRACE_TEST_TRAINER, "restart", socket(), out("r"), "300"},
                          job_env("job-r", 1, 1, 2), {}, dir_.file("r.err"));
  // However the test ends, the trainer is told to finish and is reaped.
  struct Finish {
    std::string go;
    pid_t pid;
    ~Finish() {
      if (pid <= 0) return;  // reaped already
      std::ofstream(go) << "go\n";
      wait_or_kill(pid, 20000);
    }
  } finish{out("r") + ".go", pid};
  ASSERT_TRUE(
      wait_until([&] { return read_values(out("r") + ".phase1").count("pid") != 0; }, 30000))
      << err_of("r");
  const long long trainer_pid = read_values(out("r") + ".phase1").at("pid");
  // The first daemon knows it (the trainer keeps sending spans meanwhile).
  ASSERT_TRUE(wait_until([&] {
    const json p = process_of(report_json(), trainer_pid);
    return p.is_object() && p.at("job") == "job-r";
  })) << report_json().dump(1);
  daemon_->stop(SIGKILL);
  daemon_ = std::make_unique<DaemonProcess>(socket());
  ASSERT_TRUE(daemon_->start()) << daemon_->log();
  std::ofstream(out("r") + ".go") << "go\n";
  const int status = wait_process(pid, 60000);
  if (status >= 0) finish.pid = -1;
  ASSERT_EQ(status, 0) << err_of("r");
  const json p = process_of(report_json(), trainer_pid);
  ASSERT_TRUE(p.is_object()) << report_json().dump(1);
  EXPECT_GT(field(p.at("steps"), "Transfer", "count"), 0);  // it did reconnect
  EXPECT_EQ(p.at("job"), "job-r");
  EXPECT_EQ(p.at("rank"), 1);
  EXPECT_EQ(p.at("local_rank"), 1);
  EXPECT_EQ(p.at("world_size"), 2);
}

// Self time: a span's duration less that of the spans that ended directly inside it.
TEST_F(JobIntegration, SelfTimeOfNestedSpans) {
  // Forward { 20 ms; Matmul { 10 ms }; 5 ms } x 4: exact sums, and lower bounds from the
  // sleeps (a sleep never ends early; a loaded machine only makes it longer).
  constexpr int kRounds = 4;
  const pid_t sleeper = spawn({STEPTRACE_TEST_TRAINER, "nested_same", socket(), out("sleep"),
                               std::to_string(kRounds), "10", "20", "5", "matmul"},
                              {{"STEPTRACE_JOB", "self-sleep"}}, {}, dir_.file("sleep.err"));
  ASSERT_EQ(wait_or_kill(sleeper, 60000), 0) << err_of("sleep");
  EXPECT_EQ(wait_out("sleep")["dropped"], 0);
  // Forward { Attention { Matmul; Matmul } } x 1000 (steptrace_test_trainer "nested").
  const pid_t deep = spawn({STEPTRACE_TEST_TRAINER, "nested", socket(), out("deep"), "1000"},
                           {{"STEPTRACE_JOB", "self-deep"}}, {}, dir_.file("deep.err"));
  ASSERT_EQ(wait_or_kill(deep, 60000), 0) << err_of("deep");

  const json report = report_json();
  const json s = process_of(report, pid_of("sleep"));
  ASSERT_TRUE(s.is_object()) << report.dump(1);
  const json& steps = s.at("steps");
  const long long forward = field(steps, "Forward", "total_ns");
  const long long forward_self = field(steps, "Forward", "self_ns");
  const long long matmul = field(steps, "Matmul", "total_ns");
  EXPECT_EQ(field(steps, "Forward", "count"), kRounds);
  EXPECT_EQ(field(steps, "Matmul", "count"), kRounds);
  EXPECT_GE(matmul, kRounds * 10 * kMs);
  EXPECT_EQ(field(steps, "Matmul", "self_ns"), matmul);  // nothing inside it
  EXPECT_EQ(forward_self, forward - matmul);
  EXPECT_GE(forward_self, kRounds * (20 + 5) * kMs);
  EXPECT_GE(forward, kRounds * (20 + 10 + 5) * kMs);

  // The job's totals and the per-job counters say the same.
  const json job = job_of(report, "self-sleep");
  ASSERT_TRUE(job.is_object()) << report.dump(1);
  EXPECT_EQ(field(job.at("totals"), "Forward", "self_ns"), forward_self);
  EXPECT_EQ(field(job.at("totals"), "Matmul", "self_ns"), matmul);
  const auto m = metrics();
  const std::map<std::string, std::string> forward_labels{
      {"job_id", "self-sleep"}, {"uid", uid_}, {"step", "Forward"}};
  const auto self_seconds = metric(m, "steptrace_job_step_self_seconds_total", forward_labels);
  ASSERT_TRUE(self_seconds.has_value());
  EXPECT_DOUBLE_EQ(*self_seconds, static_cast<double>(forward_self) / 1e9);
  const auto seconds = metric(m, "steptrace_job_step_seconds_total", forward_labels);
  ASSERT_TRUE(seconds.has_value());
  EXPECT_DOUBLE_EQ(*seconds, static_cast<double>(forward) / 1e9);

  // The text report has the Self columns and says that Duration counts nested spans.
  const std::string t = text("report --job self-sleep");
  EXPECT_EQ(table_headers(t), 1) << t;
  EXPECT_THAT(t, HasSubstr("Duration and % Time include nested spans")) << t;

  // Three levels: each level's self time is its time less the level below.
  const json d = process_of(report, pid_of("deep"));
  ASSERT_TRUE(d.is_object()) << report.dump(1);
  const json& ds = d.at("steps");
  EXPECT_EQ(field(ds, "Forward", "count"), 1000);
  EXPECT_EQ(field(ds, "Attention", "count"), 1000);
  EXPECT_EQ(field(ds, "Matmul", "count"), 2000);
  EXPECT_EQ(field(ds, "Forward", "self_ns"),
            field(ds, "Forward", "total_ns") - field(ds, "Attention", "total_ns"));
  EXPECT_EQ(field(ds, "Attention", "self_ns"),
            field(ds, "Attention", "total_ns") - field(ds, "Matmul", "total_ns"));
  EXPECT_EQ(field(ds, "Matmul", "self_ns"), field(ds, "Matmul", "total_ns"));
}

// Per-process metric families carry job_id and rank.
TEST_F(JobIntegration, ProcessMetricsCarryJobAndRank) {
  ASSERT_GT(hold("r1", job_env("job-m", 1, 0, 2)), 0);
  ASSERT_GT(hold("solo", {}), 0);
  const long long r1 = pid_of("r1"), solo = pid_of("solo");
  ASSERT_GT(r1, 0);
  ASSERT_GT(solo, 0);
  const auto m = metrics();
  const auto r1_forward = samples_with(m, "steptrace_process_step_seconds_total",
                                       {{"pid", std::to_string(r1)}, {"step", "Forward"}});
  ASSERT_EQ(r1_forward.size(), 1u);
  EXPECT_EQ(r1_forward[0].labels.at("job_id"), "job-m");
  EXPECT_EQ(r1_forward[0].labels.at("uid"), uid_);  // a job is (uid, job id)
  EXPECT_EQ(r1_forward[0].labels.at("rank"), "1");
  EXPECT_GT(r1_forward[0].value, 0);
  const auto solo_forward = samples_with(m, "steptrace_process_step_seconds_total",
                                         {{"pid", std::to_string(solo)}, {"step", "Forward"}});
  ASSERT_EQ(solo_forward.size(), 1u);
  EXPECT_EQ(solo_forward[0].labels.count("job_id"), 0u);
  EXPECT_EQ(solo_forward[0].labels.count("rank"), 0u);
  const auto r1_dropped = samples_with(m, "steptrace_process_dropped_events_total",
                                       {{"pid", std::to_string(r1)}, {"job_id", "job-m"}});
  ASSERT_EQ(r1_dropped.size(), 1u);
  EXPECT_EQ(r1_dropped[0].labels.at("rank"), "1");
  EXPECT_EQ(r1_dropped[0].value, 0);
}

// Per-job counters keep their values after the job's processes exit and are evicted
// from the table (max_exited_processes 0: an exited process is forgotten at once).
class JobCountersAfterEviction : public JobIntegration {
 protected:
  std::string config() const override { return R"({"limits": {"max_exited_processes": 0}})"; }
};

TEST_F(JobCountersAfterEviction, KeepCountingAfterTheProcessesLeave) {
  ASSERT_GT(hold("m0", job_env("jm", 0, 0, 2)), 0);
  ASSERT_GT(hold("m1", job_env("jm", 1, 1, 2)), 0);
  ASSERT_GT(hold("solo", {}), 0);
  const long long m0 = pid_of("m0"), m1 = pid_of("m1");
  ASSERT_GT(m0, 0);
  ASSERT_GT(m1, 0);
  ASSERT_GT(pid_of("solo"), 0);

  const auto step_labels = [&](const char* step) {
    return std::map<std::string, std::string>{{"job_id", "jm"}, {"uid", uid_}, {"step", step}};
  };
  const std::map<std::string, std::string> jm{{"job_id", "jm"}, {"uid", uid_}};
  const auto state = [&](const char* s) {
    return std::map<std::string, std::string>{{"job_id", "jm"}, {"uid", uid_}, {"state", s}};
  };

  // While they live.
  const auto live = metrics();
  EXPECT_EQ(metric(live, "steptrace_job_step_spans_total", step_labels("Forward")), 2 * kSpans);
  EXPECT_EQ(metric(live, "steptrace_job_step_spans_total", step_labels("Matmul")), 2 * kSpans);
  const auto seconds = metric(live, "steptrace_job_step_seconds_total", step_labels("Forward"));
  const auto self = metric(live, "steptrace_job_step_self_seconds_total", step_labels("Forward"));
  const auto matmul_self =
      metric(live, "steptrace_job_step_self_seconds_total", step_labels("Matmul"));
  ASSERT_TRUE(seconds && self && matmul_self);
  EXPECT_GT(*seconds, 0);
  EXPECT_LE(*self, *seconds);
  EXPECT_EQ(metric(live, "steptrace_job_processes", state("live")), 2);
  EXPECT_EQ(metric(live, "steptrace_job_processes", state("exited")), 0);
  EXPECT_EQ(metric(live, "steptrace_job_dropped_events_total", jm), 0);
  // The processes without a job id are a job of their own, without a job_id label.
  EXPECT_EQ(metric(live, "steptrace_job_processes", {{"uid", uid_}, {"state", "live"}}), 1);
  EXPECT_EQ(metric(live, "steptrace_job_step_spans_total", {{"uid", uid_}, {"step", "Forward"}}),
            kSpans);
  // The daemon's own.
  EXPECT_EQ(samples_with(live, "steptrace_build_info", {}).size(), 1u);
  const auto rss = metric(live, "process_resident_memory_bytes", {});
  ASSERT_TRUE(rss.has_value());
  EXPECT_GT(*rss, 0);
  const auto fds = metric(live, "process_open_fds", {});
  ASSERT_TRUE(fds.has_value());
  EXPECT_GT(*fds, 0);

  // They exit, and leave the table.
  ASSERT_EQ(release_and_wait("m0"), 0) << err_of("m0");
  ASSERT_EQ(release_and_wait("m1"), 0) << err_of("m1");
  // (A job with no process in the table is no job `report --job` can show: an error.)
  ASSERT_TRUE(wait_until([&] {
    return text("report --json --job jm") == "error: report: no job 'jm' for any uid\n";
  })) << report_json().dump(1);
  const auto gone = metrics();
  EXPECT_TRUE(
      samples_with(gone, "steptrace_process_step_seconds_total", {{"job_id", "jm"}}).empty());
  EXPECT_EQ(metric(gone, "steptrace_job_step_spans_total", step_labels("Forward")), 2 * kSpans);
  EXPECT_EQ(metric(gone, "steptrace_job_step_spans_total", step_labels("Matmul")), 2 * kSpans);
  EXPECT_EQ(metric(gone, "steptrace_job_step_seconds_total", step_labels("Forward")), *seconds);
  EXPECT_EQ(metric(gone, "steptrace_job_step_self_seconds_total", step_labels("Forward")), *self);
  EXPECT_EQ(metric(gone, "steptrace_job_step_self_seconds_total", step_labels("Matmul")),
            *matmul_self);
  EXPECT_EQ(metric(gone, "steptrace_job_processes", state("live")), 0);
  EXPECT_EQ(metric(gone, "steptrace_job_processes", state("exited")), 2);
  EXPECT_EQ(metric(gone, "steptrace_job_dropped_events_total", jm), 0);
  // The job-less process is untouched.
  EXPECT_EQ(metric(gone, "steptrace_job_processes", {{"uid", uid_}, {"state", "live"}}), 1);

  // The CLI: the job has no process left in the table.
  const CliResult r = cli({"report", "--job", "jm"});
  EXPECT_EQ(r.status, 1) << r.out << r.err;

  // A new rank of the same job adds to the same counters.
  ASSERT_GT(hold("m0b", job_env("jm", 0, 0, 2)), 0);
  ASSERT_GT(pid_of("m0b"), 0);
  const auto again = metrics();
  EXPECT_EQ(metric(again, "steptrace_job_step_spans_total", step_labels("Forward")), 3 * kSpans);
  EXPECT_EQ(metric(again, "steptrace_job_processes", state("live")), 1);
  EXPECT_EQ(metric(again, "steptrace_job_processes", state("exited")), 2);
}

}  // namespace
}  // namespace steptrace::testing
