// The command table: typed parsing of the words, unknown commands and bad arguments
// answered with one `error:` line, the permission rule of `reset`, one-line JSON.
#include "daemon/serve/commands.h"

#include <gtest/gtest.h>

#include <steptrace/version.h>
#include <nlohmann/json.hpp>

#include "tests/daemon/daemon_test_util.h"
#include "tests/daemon/serve/fake_proc.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;

class CommandsTest : public ::testing::Test {
 protected:
  CommandsTest() : collector_(Limits{}, test::alive_env()) {}

  std::string run(std::string_view line, std::uint32_t uid = 1000,
                  const PeerIdentity* peer = nullptr) {
    const CommandContext context{collector_, uid, /*daemon_euid=*/1000, peer};
    return table_.execute(line, context);
  }

  // Attaches process `pid` of `uid` named `comm` to the collector.
  ProcessHandle attach(std::int32_t pid, std::string comm = "t", std::uint32_t uid = 1000) {
    PeerIdentity peer;
    peer.key = {pid, 77};
    peer.uid = uid;
    peer.comm = std::move(comm);
    ProcessHandle handle = 0;
    EXPECT_FALSE(collector_.attach(peer, handle));
    return handle;
  }

  // Feeds one process (of `uid`, in job `job` unless it is empty) with `pairs` Forward
  // spans of 100 ns.
  void ingest(std::int32_t pid, int pairs, std::uint32_t uid = 1000, std::string_view job = {}) {
    const ProcessHandle handle = attach(pid, "t", uid);
    if (!job.empty()) {
      proto::Identity identity{};
      ASSERT_TRUE(proto::set_field(identity.job, job));
      identity.rank = proto::kNoRank;
      identity.local_rank = proto::kNoRank;
      collector_.identity(handle, identity);
    }
    std::vector<proto::EventRecord> events;
    for (int i = 0; i < pairs; ++i) {
      const std::uint64_t ts = 1000 + static_cast<std::uint64_t>(i) * 1000;
      events.push_back({ts, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kStart), 0});
      events.push_back({ts + 100, 1, 0, static_cast<std::uint8_t>(proto::EventKind::kEnd), 0});
    }
    proto::Decoder decoder(proto::Side::kDaemon);
    std::vector<std::byte> buf(64 * 1024);
    proto::Encoder encoder(buf);
    encoder.hello("t", "t");
    encoder.events(events);
    decoder.feed(encoder.bytes());
    auto hello = decoder.next();
    ASSERT_TRUE(hello.message);
    auto batch = decoder.next();
    ASSERT_TRUE(batch.message);
    ASSERT_FALSE(collector_.events(handle, std::get<proto::EventSpan>(*batch.message)));
  }

  std::uint64_t forward_count(const json& report, std::int32_t pid) {
    for (const auto& p : report["processes"]) {
      if (p["pid"] != pid) continue;
      for (const auto& s : p["steps"]) {
        if (s["step"] == "Forward") return s["count"].get<std::uint64_t>();
      }
      return 0;
    }
    return 0;
  }

  // Sends one Reserve of `gpu` as process `pid` (uid 1000).
  void reserve(std::int32_t pid, std::string_view gpu, std::uint64_t id) {
    const ProcessHandle handle = attach(pid);
    proto::LedgerRecord r{};
    r.op = static_cast<std::uint8_t>(proto::LedgerOp::kReserve);
    r.reservation_id = id;
    r.bytes = 4096;
    r.thread_id = 1;
    ASSERT_TRUE(proto::set_field(r.gpu_uuid, gpu));
    collector_.ledger(handle, r);
  }
  std::vector<std::string> gpus() {
    std::vector<std::string> out;
    const json ledger = json::parse(run("ledger --json"));
    for (const auto& g : ledger["gpus"]) out.push_back(g["gpu"]);
    return out;
  }

  Collector collector_;
  CommandTable table_;
};

bool is_error_line(const std::string& reply) {
  return reply.rfind("error: ", 0) == 0 && reply.back() == '\n' &&
         reply.find('\n') == reply.size() - 1;
}

// Issue 26, item 10: every JSON reply goes through the JSON sanitiser, so a comm with
// U+202E RLO and U+200B ZWSP is written as \u202e and \u200b (the same string to a JSON
// reader, never raw bytes), while 日本語 stays as it is.
TEST_F(CommandsTest, JsonRepliesEscapeBidiControls) {
  const std::string comm = "ev\xE2\x80\xAEil\xE2\x80\x8B日本語";
  attach(4242, comm);
  const std::string reply = run("report --json");
  EXPECT_EQ(reply.find("\xE2\x80\xAE"), std::string::npos) << reply;
  EXPECT_EQ(reply.find("\xE2\x80\x8B"), std::string::npos) << reply;
  EXPECT_NE(reply.find(R"("comm":"ev\u202eil\u200b日本語")"), std::string::npos) << reply;
  EXPECT_EQ(json::parse(reply)["processes"][0]["comm"], comm);
  // The text report: the terminal's sanitiser, printable ASCII only.
  const std::string text = run("report");
  EXPECT_EQ(text.find("\xE2\x80\xAE"), std::string::npos) << text;
  EXPECT_NE(text.find("(ev???il" + std::string(12, '?') + ")"), std::string::npos) << text;
}

TEST_F(CommandsTest, PingAnswersPong) { EXPECT_EQ(run("ping"), "pong\n"); }

TEST_F(CommandsTest, UnknownCommandIsOneErrorLineNamingIt) {
  const auto reply = run("frobnicate now");
  EXPECT_TRUE(is_error_line(reply)) << reply;
  EXPECT_NE(reply.find("frobnicate"), std::string::npos);
  // The table stays usable.
  EXPECT_EQ(run("ping"), "pong\n");
}

TEST_F(CommandsTest, BadArgumentsAreNamed) {
  for (const char* line : {"report --pid",
                           "report --pid abc",
                           "report --pid 0",
                           "report --pid -4",
                           "report --pid 99999999999",
                           "report --pdi 3",
                           "ledger --pid 3",
                           "stats extra",
                           "ping now",
                           "reset --json",
                           "report --json --json",
                           "report --pid 3 --pid 4",
                           "reset --gpu",
                           "reset --ledger --ledger",
                           "reset --gpu A --gpu B",
                           "reset --ledger --gpu A",
                           "reset --pid 3 --ledger",
                           "reset --gpu A --pid 3",
                           "ledger --ledger",
                           "report --gpu A",
                           "reset --gpu=",
                           "reset --ledger=1"}) {
    const auto reply = run(line);
    EXPECT_TRUE(is_error_line(reply)) << line << " -> " << reply;
  }
  EXPECT_NE(run("report --pid abc").find("'abc'"), std::string::npos);
  EXPECT_NE(run("report --pdi 3").find("'--pdi'"), std::string::npos);
  EXPECT_EQ(run("reset --ledger --gpu A"),
            "error: reset: --pid, --ledger and --gpu exclude each other (usage: reset [--pid N | "
            "--ledger | --gpu UUID])\n");
  EXPECT_EQ(run("reset --gpu"), "error: reset: --gpu needs a GPU UUID\n");
  EXPECT_EQ(run("reset --gpu " + std::string(64, 'g')),
            "error: reset: --gpu needs a GPU UUID of 1..63 characters\n");
  // A word echoed back in an error is printable, whatever the client sent.
  EXPECT_EQ(run("report --x\x1b[2J"),
            "error: report: unexpected argument '--x?[2J' (usage: report [--json] [--pid N] [--job "
            "[UID:]ID] [--window N] [--compute STEP,...] [--overhead STEP,...])\n");
  EXPECT_EQ(run("report --pid 1\x1b[2J"),
            "error: report: --pid needs a process id in 1..2147483647, got '1?[2J'\n");
  EXPECT_EQ(run("reset --pid \x1b]0;x\x07"),
            "error: reset: --pid needs a process id in 1..2147483647, got '?]0;x?'\n");
}

// The exact text of `help` and of every kind of argument error: the usage each names is
// the one help shows (for `ledger`, of the form it was parsing), whatever the command.
TEST_F(CommandsTest, HelpAndArgumentErrorsSayTheSameUsage) {
  EXPECT_EQ(run("help"),
            "steptraced commands (one per line):\n"
            "  help                        this list\n"
            "  ledger [--json] | ledger cleanup GPU ID the VRAM ledger view per GPU; cleanup: "
            "remove a reservation (root, the holder's uid, or anyone once it is LEAKED or "
            "EXPIRED)\n"
            "  metrics                     Prometheus text exposition (format 0.0.4)\n"
            "  ping                        answers pong\n"
            "  report [--json] [--pid N] [--job [UID:]ID] [--window N] [--compute STEP,...] "
            "[--overhead STEP,...] per-step timing for all "
            "processes (or one pid, or one job's: yours, or UID's), by job with rank skew (over "
            "the last N s too with --window), then the VRAM ledger; --compute/--overhead: the 50% "
            "rule's steps\n"
            "  reset [--pid N | --ledger | --gpu UUID] clear the aggregates (all, or one pid's), "
            "or the VRAM ledger (all GPUs, or one); root or the daemon's uid only\n"
            "  stats [--json]              the daemon's own counters\n"
            "  trace [--pid N]... [--children] [--job [UID:]ID] [--last SECONDS | --for SECONDS] "
            "the flight recorder's recent events as a Chrome Trace Event document (Perfetto UI, "
            "speedscope): all processes, --pid's (and their live forked processes with "
            "--children), or a job's; --for records from now on\n"
            "  version                     daemon version, protocol version and commands, as "
            "one JSON line\n");
  const std::string trace_usage =
      " (usage: trace [--pid N]... [--children] [--job [UID:]ID] [--last SECONDS | --for "
      "SECONDS])\n";
  const std::pair<std::string, std::string> cases[] = {
      {"ping now", "error: ping: unexpected argument 'now' (usage: ping)\n"},
      {"help me", "error: help: unexpected argument 'me' (usage: help)\n"},
      {"version --json", "error: version: unexpected argument '--json' (usage: version)\n"},
      {"metrics --json", "error: metrics: unexpected argument '--json' (usage: metrics)\n"},
      {"stats extra", "error: stats: unexpected argument 'extra' (usage: stats [--json])\n"},
      {"stats --json=1", "error: stats: unexpected argument '--json=1' (usage: stats [--json])\n"},
      {"stats --json --json", "error: stats: --json given twice\n"},
      {"ledger --pid 3", "error: ledger: unexpected argument '--pid' (usage: ledger [--json])\n"},
      {"ledger --json cleanup",
       "error: ledger: unexpected argument 'cleanup' (usage: ledger [--json])\n"},
      {"ledger cleanup GPU-A",
       "error: ledger cleanup: needs a GPU UUID and a reservation id (usage: ledger cleanup GPU "
       "ID)\n"},
      {"ledger cleanup GPU-A 1 2",
       "error: ledger cleanup: needs a GPU UUID and a reservation id (usage: ledger cleanup GPU "
       "ID)\n"},
      {"ledger cleanup " + std::string(64, 'g') + " 1",
       "error: ledger cleanup: a GPU UUID is 1..63 printable characters\n"},
      {"ledger cleanup GPU-A x",
       "error: ledger cleanup: the reservation id must be an integer in "
       "0..18446744073709551615, got 'x'\n"},
      {"report --pid", "error: report: --pid needs a process id\n"},
      {"report --pid=abc", "error: report: --pid needs a process id in 1..2147483647, got 'abc'\n"},
      {"report --pid abc --pid 4",
       "error: report: --pid needs a process id in 1..2147483647, got 'abc'\n"},
      {"report --pid 3 --pid 4", "error: report: --pid given twice\n"},
      {"report --job",
       "error: report: --job needs a job id of 1..63 printable characters, or UID:ID for "
       "another uid's\n"},
      {"report --job=",
       "error: report: --job needs a job id of 1..63 printable characters, or UID:ID for "
       "another uid's\n"},
      {"report --job 1001:",
       "error: report: --job needs a job id of 1..63 printable characters, or UID:ID for "
       "another uid's, got '1001:'\n"},
      {"report --job 4294967296:x",
       "error: report: --job needs a job id of 1..63 printable characters, or UID:ID for "
       "another uid's, got '4294967296:x'\n"},
      {"report --job 7:" + std::string(64, 'x'),
       "error: report: --job needs a job id of 1..63 printable characters, or UID:ID for "
       "another uid's, got '7:" +
           std::string(62, 'x') + "'\n"},
      {"report --job a --job b", "error: report: --job given twice\n"},
      {"report --json --json", "error: report: --json given twice\n"},
      {"report --pidx 3",
       "error: report: unexpected argument '--pidx' (usage: report [--json] [--pid N] [--job "
       "[UID:]ID] [--window N] [--compute STEP,...] [--overhead STEP,...])\n"},
      {"reset --json",
       "error: reset: unexpected argument '--json' (usage: reset [--pid N | --ledger | --gpu "
       "UUID])\n"},
      {"reset --ledger --ledger", "error: reset: --ledger given twice\n"},
      {"reset --gpu A --gpu B", "error: reset: --gpu given twice\n"},
      {"reset --gpu=", "error: reset: --gpu needs a GPU UUID of 1..63 characters\n"},
      {"reset --pid 3 --gpu A --ledger",
       "error: reset: --pid, --ledger and --gpu exclude each other (usage: reset [--pid N | "
       "--ledger | --gpu UUID])\n"},
      {"reset --ledger --gpu A --bogus",
       "error: reset: unexpected argument '--bogus' (usage: reset [--pid N | --ledger | --gpu "
       "UUID])\n"},
      {"trace --json", "error: trace: unexpected argument '--json'" + trace_usage},
      {"trace --pid", "error: trace: --pid needs a process id" + trace_usage},
      {"trace --pid \x1b",
       "error: trace: --pid needs a process id in 1..2147483647, got '?'" + trace_usage},
      {"trace --last",
       "error: trace: --last needs a number of seconds in (0, 86400]" + trace_usage},
      {"trace --last 0",
       "error: trace: --last needs a number of seconds in (0, 86400], got '0'" + trace_usage},
      {"trace --for=3601",
       "error: trace: --for needs a number of seconds in (0, 3600], got '3601'" + trace_usage},
      {"trace --for 1 --for 2", "error: trace: --for given twice" + trace_usage},
      {"trace --last 1 --for 1", "error: trace: --last and --for exclude each other" + trace_usage},
  };
  for (const auto& [line, reply] : cases) EXPECT_EQ(run(line), reply) << line;
  std::string many = "trace";
  for (int pid = 1; pid <= 64; ++pid) many += " --pid " + std::to_string(pid);
  EXPECT_EQ(run(many + " --pid 65"), "error: trace: at most 64 --pid options" + trace_usage);
  EXPECT_FALSE(run(many + " --pid 64").starts_with("error: ")) << "a pid again is no more";
}

// Who may run a command is checked once its words parsed: a bad line is told so whoever
// sends it; a good one from another uid is refused before anything runs.
TEST_F(CommandsTest, PermissionIsCheckedAfterTheWordsParsed) {
  EXPECT_EQ(run("reset --bogus", /*uid=*/2000),
            "error: reset: unexpected argument '--bogus' (usage: reset [--pid N | --ledger | "
            "--gpu UUID])\n");
  EXPECT_EQ(run("reset --pid 777", /*uid=*/2000), "error: permission denied\n");
  EXPECT_EQ(run("reset --pid 777", /*uid=*/0), "error: no process with pid 777\n");
  // Every other command is anyone's.
  for (const char* line :
       {"ping", "report", "ledger", "stats", "metrics", "version", "help", "trace --last 1"}) {
    EXPECT_NE(run(line, /*uid=*/2000).rfind("error: ", 0), 0u) << line;
  }
}

TEST_F(CommandsTest, RequestsParseIntoTypedStructs) {
  const std::vector<std::string_view> words = {"--json", "--pid", "42"};
  auto parsed = ReportRequest::parse(words);
  ASSERT_TRUE(std::holds_alternative<ReportRequest>(parsed));
  EXPECT_TRUE(std::get<ReportRequest>(parsed).json);
  EXPECT_EQ(std::get<ReportRequest>(parsed).pid, 42);

  const std::vector<std::string_view> eq = {"--pid=7"};
  auto reset = ResetRequest::parse(eq);
  ASSERT_TRUE(std::holds_alternative<ResetRequest>(reset));
  EXPECT_EQ(std::get<ResetRequest>(reset).pid, 7);
  EXPECT_FALSE(std::get<ResetRequest>(reset).ledger);
  EXPECT_FALSE(std::get<ResetRequest>(reset).gpu);

  const std::vector<std::string_view> ledger = {"--ledger"};
  reset = ResetRequest::parse(ledger);
  ASSERT_TRUE(std::holds_alternative<ResetRequest>(reset));
  EXPECT_TRUE(std::get<ResetRequest>(reset).ledger);
  EXPECT_FALSE(std::get<ResetRequest>(reset).pid);
  for (const std::vector<std::string_view>& gpu :
       {std::vector<std::string_view>{"--gpu", "GPU-1"}, {"--gpu=GPU-1"}}) {
    reset = ResetRequest::parse(gpu);
    ASSERT_TRUE(std::holds_alternative<ResetRequest>(reset));
    EXPECT_EQ(std::get<ResetRequest>(reset).gpu, "GPU-1");
    EXPECT_FALSE(std::get<ResetRequest>(reset).ledger);
  }

  auto none = StatsRequest::parse({});
  ASSERT_TRUE(std::holds_alternative<StatsRequest>(none));
  EXPECT_FALSE(std::get<StatsRequest>(none).json);
}

// Issue 26, item 7: a job is (uid, job id). `--job ID` is the caller's own job, whoever
// else names a job so; `--job UID:ID` reaches another uid's; a job the uid does not run
// is an error naming the uids that do. Root (and the daemon's uid) keep the old meaning
// of a bare ID when one uid runs it, and are told which uids when several do.
// `report --compute STEP,... --overhead STEP,...`: the 50% rule of other steps for one
// report, text and JSON; bad lists are one error line naming the option.
TEST_F(CommandsTest, ReportComputeAndOverheadFlagsSetTheRule) {
  ingest(10, 3);  // Forward: 3 spans of 100 ns
  std::string text = run("report --compute Forward,Attention --overhead Alloc");
  EXPECT_NE(text.find("[Dr. Popper Analysis]\nRule (--compute/--overhead): compute Forward + "
                      "Attention, overhead Alloc\nCUDA Compute:   300.00ns\n"
                      "CPU Overhead:   0.00ns (0.00%)\n\n🟢 CORROBORATED"),
            std::string::npos)
      << text;
  text = run("report --compute=Alloc --overhead=Forward");
  EXPECT_NE(text.find("No Alloc spans, so no 50% verdict: the rule sets compute (Alloc) against "
                      "CPU overhead (Forward). Name other steps with report --compute/--overhead "
                      "or the config's overhead_rule.\n"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("nan"), std::string::npos) << text;

  // --json: "rule" beside "totals"; no compute is a verdict of its own, no NaN.
  json doc = json::parse(run("report --json --overhead Forward"));
  EXPECT_EQ(doc["rule"], json::parse(R"({"compute_steps": ["Matmul"], "overhead_steps":
      ["Forward"], "source": "flags", "compute_ns": 0, "overhead_ns": 300,
      "overhead_pct": null, "verdict": "no_compute"})"));
  doc = json::parse(run("report --json --compute Forward --overhead Alloc,Transpose"));
  EXPECT_EQ(doc["rule"]["verdict"], "corroborated");
  EXPECT_EQ(doc["rule"]["compute_ns"], 300);
  EXPECT_EQ(doc["rule"]["overhead_pct"], 0.0);
  doc = json::parse(run("report --json --compute Alloc,Transpose --overhead Forward"));
  EXPECT_EQ(doc["rule"]["verdict"], "no_compute");
  // Without flags: the default rule, said so.
  doc = json::parse(run("report --json"));
  EXPECT_EQ(doc["rule"]["source"], "default");
  EXPECT_EQ(doc["rule"]["overhead_steps"], json::parse(R"(["Transpose", "Alloc"])"));

  EXPECT_EQ(run("report --compute Forward --overhead Forward"),
            "error: report: step Forward is in both --compute and --overhead\n");
  EXPECT_EQ(run("report --compute Alloc"),
            "error: report: step Alloc is in both --compute and the default overhead steps "
            "(name the other list too)\n");
  EXPECT_EQ(run("report --compute"), "error: report: --compute needs STEP,STEP,... (step names)\n");
  EXPECT_EQ(run("report --overhead A,,B"),
            "error: report: --overhead has an empty step name (STEP,STEP,...), got 'A,,B'\n");
  EXPECT_EQ(run("report --compute A,A"), "error: report: --compute names A twice, got 'A,A'\n");
  EXPECT_EQ(run("report --compute A --compute B"), "error: report: --compute given twice\n");
  EXPECT_EQ(run("report --compute " + std::string(64, 'x'))
                .rfind("error: report: --compute a step name has 1..63 printable characters", 0),
            0u);
}

// The config's per-job rules: a job's section (and a `--job` report) uses its job's; the
// whole table the default; flags win over both.
TEST_F(CommandsTest, ReportUsesTheJobsConfiguredRule) {
  ingest(10, 3, 1000, "bert");
  ingest(11, 2, 1000, "other");
  report::OverheadRules rules;
  rules.by_job_id["bert"] = {{"Forward"}, {"DataLoader"}};
  CommandContext context{collector_, 1000, 1000};
  context.overhead_rules = &rules;
  json doc = json::parse(table_.execute("report --json", context));
  EXPECT_EQ(doc["rule"]["source"], "default");
  EXPECT_EQ(doc["rule"]["verdict"], "no_compute");
  ASSERT_EQ(doc["jobs"].size(), 2u);
  for (const json& job : doc["jobs"]) {
    if (job["job"] == "bert") {
      EXPECT_EQ(job["rule"]["source"], "job");
      EXPECT_EQ(job["rule"]["compute_ns"], 300);
      EXPECT_EQ(job["rule"]["verdict"], "corroborated");
    } else {
      EXPECT_EQ(job["rule"]["source"], "default");
    }
  }
  doc = json::parse(table_.execute("report --json --job bert", context));
  EXPECT_EQ(doc["rule"]["source"], "job");
  EXPECT_EQ(doc["rule"]["compute_steps"], json::parse(R"(["Forward"])"));
  const std::string text = table_.execute("report --job bert", context);
  EXPECT_NE(text.find("Rule (the job's config): compute Forward, overhead DataLoader\n"
                      "CUDA Compute:   300.00ns\n"),
            std::string::npos)
      << text;
  // A flag's list not given is the config's default, not the job's.
  doc = json::parse(table_.execute("report --json --job bert --overhead Forward", context));
  EXPECT_EQ(doc["rule"]["source"], "flags");
  EXPECT_EQ(doc["rule"]["compute_steps"], json::parse(R"(["Matmul"])"));
}

TEST_F(CommandsTest, ReportJobIsTheCallersOwnOrNamedByUid) {
  ingest(101, 3, 1001, "team-llm");
  ingest(102, 4, 1001, "team-llm");
  ingest(201, 50, 1002, "team-llm");  // another tenant picks the same id
  ingest(202, 7, 1002, "solo");
  const auto pids = [](const json& report) {
    std::vector<std::int32_t> out;
    for (const auto& p : report["processes"]) out.push_back(p["pid"]);
    return out;
  };
  const json own = json::parse(run("report --json --job team-llm", 1001));
  EXPECT_EQ(pids(own), (std::vector<std::int32_t>{101, 102}));
  ASSERT_EQ(own["jobs"].size(), 1u);
  EXPECT_EQ(own["jobs"][0]["uid"], 1001);
  EXPECT_EQ(own["totals"][0]["count"], 7);  // 3 + 4: none of uid 1002's 50
  EXPECT_EQ(pids(json::parse(run("report --json --job team-llm", 1002))),
            (std::vector<std::int32_t>{201}));
  // Explicitly, anyone's: the same as its owner sees.
  EXPECT_EQ(pids(json::parse(run("report --json --job 1002:team-llm", 1001))),
            (std::vector<std::int32_t>{201}));
  EXPECT_EQ(pids(json::parse(run("report --json --job=1001:team-llm", 3000))),
            (std::vector<std::int32_t>{101, 102}));
  // With --pid: both must hold.
  EXPECT_EQ(pids(json::parse(run("report --json --pid 102 --job team-llm", 1001))),
            (std::vector<std::int32_t>{102}));
  EXPECT_TRUE(
      json::parse(run("report --json --pid 201 --job team-llm", 1001))["processes"].empty());
  EXPECT_NE(run("report --pid 201 --job team-llm", 1001)
                .find("No process with pid 201 is tracked in job team-llm (uid 1001)."),
            std::string::npos);
  // The text report: the title names the job with its uid, the other's 50 spans absent.
  const std::string text = run("report --job team-llm", 1001);
  EXPECT_NE(text.find("STEPTRACE REPORT (job team-llm (uid 1001))"), std::string::npos) << text;
  EXPECT_EQ(text.find("Process 201"), std::string::npos) << text;

  // Not the caller's: an error naming who does run one.
  EXPECT_EQ(run("report --job solo", 1001),
            "error: report: no job 'solo' for uid 1001; uid 1002 has one: use --job 1002:solo\n");
  EXPECT_EQ(run("report --json --job solo", 1001),
            "error: report: no job 'solo' for uid 1001; uid 1002 has one: use --job 1002:solo\n");
  EXPECT_EQ(run("report --job team-llm", 3000),
            "error: report: no job 'team-llm' for uid 3000; uids 1001 and 1002 have one: use "
            "--job UID:team-llm\n");
  EXPECT_EQ(run("report --job 1001:solo", 1002),
            "error: report: no job 'solo' for uid 1001; uid 1002 has one: use --job 1002:solo\n");
  EXPECT_EQ(run("report --job nope", 1001), "error: report: no job 'nope' for uid 1001\n");

  // Root and the daemon's own uid (1000 here): a bare ID one uid runs is that uid's...
  EXPECT_EQ(pids(json::parse(run("report --json --job solo", 0))),
            (std::vector<std::int32_t>{202}));
  EXPECT_EQ(pids(json::parse(run("report --json --job solo", 1000))),
            (std::vector<std::int32_t>{202}));
  // ...several uids' is an error that lists them, and none is said so.
  EXPECT_EQ(run("report --job team-llm", 0),
            "error: report: job 'team-llm' is run by uids 1001 and 1002: name one with --job "
            "UID:team-llm\n");
  EXPECT_EQ(run("report --job nope", 0), "error: report: no job 'nope' for any uid\n");
  // Root's explicit UID:ID, and root's own job first when it runs one.
  EXPECT_EQ(pids(json::parse(run("report --json --job 1002:team-llm", 0))),
            (std::vector<std::int32_t>{201}));
  ingest(301, 1, 0, "team-llm");
  EXPECT_EQ(pids(json::parse(run("report --json --job team-llm", 0))),
            (std::vector<std::int32_t>{301}));

  // A job id with ':' in it: a head that is not all digits is part of the id; one that
  // is needs the uid in front.
  ingest(401, 1, 1001, "run:7");
  ingest(402, 1, 1001, "12:30");
  EXPECT_EQ(pids(json::parse(run("report --json --job run:7", 1001))),
            (std::vector<std::int32_t>{401}));
  EXPECT_EQ(pids(json::parse(run("report --json --job 1001:12:30", 1002))),
            (std::vector<std::int32_t>{402}));
  EXPECT_EQ(run("report --job 12:30", 1001), "error: report: no job '30' for uid 12\n");
}

TEST_F(CommandsTest, JsonRepliesAreOneLine) {
  ingest(4242, 3);
  for (const char* line :
       {"report --json", "ledger --json", "stats --json", "version", "report --json --pid 4242"}) {
    const auto reply = run(line);
    ASSERT_FALSE(reply.empty());
    EXPECT_EQ(reply.find('\n'), reply.size() - 1) << line;
    EXPECT_TRUE(json::accept(reply)) << line;
  }
  EXPECT_EQ(forward_count(json::parse(run("report --json")), 4242), 3u);
}

TEST_F(CommandsTest, TextRepliesEndWithNewline) {
  ingest(4242, 2);
  for (const char* line : {"report", "ledger", "stats", "metrics", "help"}) {
    const auto reply = run(line);
    ASSERT_FALSE(reply.empty()) << line;
    EXPECT_EQ(reply.back(), '\n') << line;
  }
  EXPECT_NE(run("metrics").find("# TYPE"), std::string::npos);
}

TEST_F(CommandsTest, ResetNeedsRootOrTheDaemonsUid) {
  ingest(4242, 5);
  EXPECT_EQ(run("reset", /*uid=*/2000), "error: permission denied\n");
  EXPECT_EQ(forward_count(json::parse(run("report --json")), 4242), 5u);
  EXPECT_EQ(run("reset --pid 4242", /*uid=*/1000), "ok\n");
  EXPECT_EQ(forward_count(json::parse(run("report --json")), 4242), 0u);
  EXPECT_EQ(run("reset --pid 777", /*uid=*/1000), "error: no process with pid 777\n");
  ingest(4243, 2);
  EXPECT_EQ(run("reset", /*uid=*/0), "ok\n");
  EXPECT_EQ(forward_count(json::parse(run("report --json")), 4243), 0u);
  EXPECT_TRUE(may_reset(0, 1000));
  EXPECT_TRUE(may_reset(1000, 1000));
  EXPECT_FALSE(may_reset(1001, 1000));
}

TEST_F(CommandsTest, ResetLedgerAndGpuClearTheLedgerForRootOrTheDaemonsUidOnly) {
  ingest(4242, 2);
  reserve(10, "GPU-A", 1);
  reserve(10, "GPU-B", 1);
  reserve(11, "GPU-C", 1);
  ASSERT_EQ(gpus(), (std::vector<std::string>{"GPU-A", "GPU-B", "GPU-C"}));

  EXPECT_EQ(run("reset --ledger", /*uid=*/2000), "error: permission denied\n");
  EXPECT_EQ(run("reset --gpu GPU-A", /*uid=*/2000), "error: permission denied\n");
  EXPECT_EQ(gpus().size(), 3u);

  EXPECT_EQ(run("reset --gpu GPU-nope", /*uid=*/0), "error: no GPU 'GPU-nope' in the ledger\n");
  EXPECT_EQ(run("reset --gpu GPU-A", /*uid=*/0), "ok: 1 GPU cleared from the ledger\n");
  EXPECT_EQ(gpus(), (std::vector<std::string>{"GPU-B", "GPU-C"}));
  EXPECT_EQ(run("reset --gpu=GPU-B", /*uid=*/1000), "ok: 1 GPU cleared from the ledger\n");
  reserve(12, "GPU-D", 1);
  EXPECT_EQ(run("reset --ledger", /*uid=*/0), "ok: 2 GPUs cleared from the ledger\n");
  EXPECT_TRUE(gpus().empty());
  EXPECT_EQ(run("reset --ledger", /*uid=*/0), "ok: 0 GPUs cleared from the ledger\n");
  // The aggregates are another reset's: they stay.
  EXPECT_EQ(forward_count(json::parse(run("report --json")), 4242), 2u);
  EXPECT_NE(run("help").find("reset [--pid N | --ledger | --gpu UUID]"), std::string::npos);
}

// `ledger cleanup GPU ID`: the rules of a Cleanup record (PROTOCOL.md 4.6), credited to
// the sender's process; every refusal is one error line saying why.
TEST_F(CommandsTest, LedgerCleanupFollowsTheCleanupRulesAndCreditsTheSender) {
  reserve(10, "GPU-A", 1);
  const PeerIdentity stranger{{20, 5}, 2000, 2000, "steptrace"};
  const PeerIdentity admin{{21, 6}, 0, 0, "steptrace"};
  const std::string refused = run("ledger cleanup GPU-A 1", 2000, &stranger);
  EXPECT_TRUE(is_error_line(refused)) << refused;
  EXPECT_EQ(refused.rfind("error: permission denied: reservation 1 on GPU 'GPU-A' is held by "
                          "pid 10, uid 1000, alive and not expired",
                          0),
            0u)
      << refused;
  EXPECT_EQ(run("ledger cleanup GPU-A 2", 0, &admin), "error: no reservation 2 on GPU 'GPU-A'\n");
  EXPECT_EQ(run("ledger cleanup GPU-Z 1", 0, &admin), "error: no reservation 1 on GPU 'GPU-Z'\n");
  for (const char* bad : {"ledger cleanup", "ledger cleanup GPU-A", "ledger cleanup GPU-A 1 2",
                          "ledger cleanup GPU-A -1", "ledger cleanup GPU-A x",
                          "ledger cleanup GPU-A 18446744073709551616"}) {
    const std::string reply = run(bad, 0, &admin);
    EXPECT_TRUE(is_error_line(reply)) << bad << ": " << reply;
    EXPECT_EQ(reply.rfind("error: ledger cleanup: ", 0), 0u) << bad << ": " << reply;
  }
  EXPECT_EQ(run("ledger cleanup GPU-A 1", 0, &admin),
            "ok: reservation 1 on GPU 'GPU-A' (alive, held by pid 10, uid 1000) cleaned up, "
            "credited to pid 21\n");
  const json ledger = json::parse(run("ledger --json"));
  const json& gpu = ledger["gpus"][0];
  EXPECT_TRUE(gpu["reservations"].empty());
  bool credited = false;
  for (const auto& p : gpu["processes"])
    credited = credited || (p["pid"] == 21 && p["cleanups"] == 1);
  EXPECT_TRUE(credited) << gpu.dump();
  EXPECT_EQ(json::parse(run("stats --json"))["ledger_anomalies"]["cleanup_refused"], 1);
}

TEST_F(CommandsTest, VersionListsEveryRegisteredCommand) {
  const auto doc = json::parse(run("version"));
  EXPECT_EQ(doc["version"], STEPTRACE_VERSION_STRING);
  EXPECT_EQ(doc["protocol"], proto::kProtocolVersion);
  const auto names = doc["commands"].get<std::vector<std::string>>();
  EXPECT_EQ(names, table_.names());
  for (const char* c :
       {"ping", "report", "ledger", "stats", "metrics", "reset", "version", "help"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), c), names.end()) << c;
    EXPECT_NE(run("help").find(c), std::string::npos) << c;
  }
}

}  // namespace
// `trace --job`: the daemon takes the job's processes, (uid, job) as report does, with no
// bound on their number; `--children` needs --pid. Errors rather than an empty trace.
TEST_F(CommandsTest, TraceJobTakesTheJobsProcessesOfItsUid) {
  ingest(101, 3, 1001, "team-llm");
  ingest(102, 4, 1001, "team-llm");
  ingest(201, 5, 1002, "team-llm");  // another tenant picks the same id
  ingest(202, 6, 1001, "solo");
  const auto pids = [](const std::string& reply) {
    std::set<int> out;
    const json doc = json::parse(reply);
    for (const json& e : doc["traceEvents"]) {
      if (e["ph"] == "X") out.insert(e["pid"].get<int>());
    }
    return out;
  };
  EXPECT_EQ(pids(run("trace --job team-llm", 1001)), (std::set<int>{101, 102}));
  EXPECT_EQ(pids(run("trace --job 1002:team-llm --last 60", 1001)), (std::set<int>{201}));
  EXPECT_EQ(pids(run("trace --job team-llm --pid 202", 1001)), (std::set<int>{101, 102, 202}));
  EXPECT_EQ(run("trace --job nosuch", 1001),
            "error: trace: no process of job 'nosuch' for uid 1001 in the flight recorder's "
            "window\n");
  EXPECT_EQ(run("trace --job solo", 1002),
            "error: trace: no process of job 'solo' for uid 1002 in the flight recorder's "
            "window; uid 1001 has one: use --job 1001:solo\n");
  EXPECT_TRUE(run("trace --job").starts_with("error: trace: --job needs a job id"));
  EXPECT_TRUE(run("trace --children").starts_with("error: trace: --children needs --pid N"));
  // No process of this test's has a live descendant in /proc.
  EXPECT_TRUE(run("trace --pid 999999 --children")
                  .starts_with("error: trace: no process with pid 999999 nor any live process"));
}

// `trace --children` past one of its walk's bounds (here small, over a stand-in /proc) is
// refused with the error naming the bound and counted once per refusal in limits_hit,
// under the bound's name, in stats and metrics. Other refusals are no limit hits.
TEST_F(CommandsTest, TraceChildrenPastABoundIsCountedAsThatLimitsHit) {
  test::FakeProc proc;
  proc.add(100, 1, 77);
  for (int pid = 201; pid <= 203; ++pid) proc.add(pid, 100, 77);
  proc.append(100, 150, "");  // a second thread of 100: 5 children files in all
  ingest(202, 2);             // in the recorder as {202, 77}
  const auto trace = [&](DescendantBounds bounds) {
    CommandContext context{collector_, 1000, /*daemon_euid=*/1000};
    context.proc_root = proc.path();
    context.descendant_bounds = bounds;
    return table_.execute("trace --pid 100 --children", context);
  };
  const auto hits = [&](const std::string& limit) {
    return json::parse(run("stats --json"))["limits_hit"].value(limit, std::uint64_t{0});
  };
  EXPECT_EQ(trace({.processes = 2}),
            "error: trace: --children takes at most 2 descendants of the --pid processes, and "
            "they have more; choose the processes with --pid or --job instead\n");
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(trace({.tasks = 4}),
              "error: trace: --children reads at most 4 threads' children files, and the --pid "
              "processes and their descendants have more threads; choose the processes with "
              "--pid or --job instead\n");
  }
  EXPECT_EQ(hits("trace_children_descendants"), 1u);
  EXPECT_EQ(hits("trace_children_threads"), 2u);
  const std::string metrics = run("metrics");
  EXPECT_NE(metrics.find("steptrace_limit_hits_total{limit=\"trace_children_descendants\"} 1\n"),
            std::string::npos);
  EXPECT_NE(metrics.find("steptrace_limit_hits_total{limit=\"trace_children_threads\"} 2\n"),
            std::string::npos);

  // Within the bounds the walk takes 202's window; a trace taking nothing is refused, but
  // passed no bound.
  const json doc = json::parse(trace({.processes = 3, .tasks = 5}));
  std::set<int> pids;
  for (const json& e : doc["traceEvents"]) {
    if (e["ph"] == "X") pids.insert(e["pid"].get<int>());
  }
  EXPECT_EQ(pids, std::set<int>{202});
  CommandContext nothing{collector_, 1000, 1000};
  nothing.proc_root = proc.path();
  EXPECT_TRUE(table_.execute("trace --pid 203 --children", nothing)
                  .starts_with("error: trace: no process with pid 203 nor any live process"));
  EXPECT_EQ(hits("trace_children_descendants"), 1u);
  EXPECT_EQ(hits("trace_children_threads"), 2u);
}

// `trace`: its options are checked word by word; a reply streams the recorder's window;
// at most TraceSlots::kMax (8) replies are alive at once, 2 per uid; the next is told busy.
TEST_F(CommandsTest, TraceValidatesItsOptionsAndBoundsRepliesInProgress) {
  for (const char* bad :
       {"trace --last 0", "trace --last abc", "trace --for 5000", "trace --last 1 --for 1",
        "trace --pid 0", "trace --json", "trace --last 1 --last 2"}) {
    const std::string reply = run(bad);
    EXPECT_TRUE(reply.starts_with("error: trace: ")) << bad << " -> " << reply;
    EXPECT_EQ(reply.find('\n'), reply.size() - 1) << reply;
  }
  ingest(42, 3);
  const json doc = json::parse(run("trace --pid 42 --last 60"));
  int spans = 0;
  for (const json& e : doc["traceEvents"]) spans += e["ph"] == "X" ? 1 : 0;
  EXPECT_EQ(spans, 3);

  std::vector<Reply> held;
  for (std::uint32_t uid = 2000; uid < 2004; ++uid) {
    const CommandContext context{collector_, uid, 1000};
    for (int i = 0; i < 2; ++i) {
      held.push_back(table_.dispatch("trace", context));
      ASSERT_TRUE(held.back().stream) << uid << ": " << held.back().text;
    }
  }
  const CommandContext other{collector_, 3000, 1000};
  const Reply ninth = table_.dispatch("trace", other);
  EXPECT_FALSE(ninth.stream);
  EXPECT_EQ(ninth.text, "error: busy: 8 traces are being sent; retry when one is done\n");
  held.pop_back();  // one of uid 2003's finishes: room again, for others
  EXPECT_TRUE(table_.dispatch("trace", other).stream);
  held.clear();
  const CommandContext one{collector_, 2000, 1000};
  held.push_back(table_.dispatch("trace", one));
  held.push_back(table_.dispatch("trace", one));
  const Reply third = table_.dispatch("trace", one);
  EXPECT_FALSE(third.stream);
  EXPECT_EQ(third.text,
            "error: busy: uid 2000 has 2 traces being sent; read them, or retry when one is "
            "done\n");
}

// `trace --for`: recording is on from the command (here with the standing window off)
// until the deferred reply is made (what it holds: tests/timeline).
TEST(CommandsTraceForTest, TurnsRecordingOnFromTheCommandUntilTheReplyIsMade) {
  Collector collector(Limits{}, test::alive_env(), FlightRecorderConfig{0, 300'000'000'000ULL});
  CommandTable table;
  const CommandContext context{collector, 1000, 1000};
  Reply reply = table.dispatch("trace --for 2.5", context);
  ASSERT_TRUE(reply.deferred);
  EXPECT_EQ(reply.deferred->delay, std::chrono::milliseconds(2500));
  EXPECT_EQ(collector.recorder().counters().budget_bytes, FlightRecorderConfig::kCaptureBudget);
  const Reply made = reply.deferred->make();
  ASSERT_TRUE(made.stream);
  EXPECT_EQ(collector.recorder().counters().budget_bytes, 0u);
}

// A uid may have limits.max_pending_traces_per_uid `trace --for` replies waiting; the
// next is refused (counted) while another uid's waits. A reply dropped uncalled (its
// connection closed) gives its slot and its capture back.
TEST(CommandsTraceForTest, PendingRepliesAreCappedPerUidAndFreedWhenDropped) {
  Collector collector(Limits{}, test::alive_env(), FlightRecorderConfig{0, 300'000'000'000ULL});
  CommandTable table;
  CommandContext greedy{collector, 2000, 1000};
  greedy.max_pending_traces_per_uid = 2;
  CommandContext other = greedy;
  other.peer_uid = 2001;
  std::optional<Reply> first = table.dispatch("trace --for 3600", greedy);
  const Reply second = table.dispatch("trace --for 3600", greedy);
  ASSERT_TRUE(first->deferred && second.deferred);
  const Reply third = table.dispatch("trace --for 3600", greedy);
  EXPECT_FALSE(third.deferred);
  EXPECT_EQ(third.text,
            "error: busy: uid 2000 has 2 trace --for replies waiting "
            "(limits.max_pending_traces_per_uid=2); close one, or retry when one is done\n");
  EXPECT_EQ(collector.counters().limits_hit.at("max_pending_traces_per_uid"), 1u);
  EXPECT_TRUE(table.dispatch("trace --for 1", other).deferred);    // another uid is not held up
  EXPECT_EQ(collector.recorder().counters().captures_active, 2u);  // the other's was dropped
  first.reset();  // its connection closed before the reply was made
  EXPECT_EQ(collector.recorder().counters().captures_active, 1u);
  EXPECT_TRUE(table.dispatch("trace --for 3600", greedy).deferred);
  // 0 refuses every `trace --for`; a plain `trace` still answers.
  other.max_pending_traces_per_uid = 0;
  EXPECT_EQ(table.dispatch("trace --for 1", other).text.rfind("error: busy: uid 2001 has 0 ", 0),
            0u);
  EXPECT_TRUE(table.dispatch("trace", other).stream);
}

}  // namespace steptrace::daemon
