// Rank skew end to end (issue 27): the real steptraced and four real trainer processes
// of one job (ranked_trainer.cpp, job and rank from their environment), rank 2 made slow
// in Forward (so it waits least in WaitPoll): `report --json --window N` names it in
// jobs[].stragglers (window and run), the text report's [Ranks] section says so, and the
// per-rank counters are in `metrics` without a pid label.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;

class RankSkewIntegration : public ::testing::Test {
 protected:
  void SetUp() override {
    // Samples every 200 ms, so a window of a few seconds fills in a test's time.
    const std::string config = dir_.file("steptraced.json");
    std::ofstream(config) << R"({"liveness_interval_ms": 50,
      "rank_skew": {"sample_interval_ms": 200, "window_samples": 100}})";
    daemon_ =
        std::make_unique<DaemonProcess>(socket(), std::vector<std::string>{"--config", config});
    ASSERT_TRUE(daemon_->start()) << daemon_->log();
  }
  void TearDown() override {
    std::ofstream(release()) << "go\n";
    for (const pid_t pid : ranks_) {
      int status = 0;
      for (int i = 0; i < 2000 && ::waitpid(pid, &status, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
  }
  std::string socket() const { return dir_.file("d.sock"); }
  std::string release() const { return dir_.file("release"); }

  void start_rank(int rank, int world, int forward_ms, int wait_ms) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::setenv("STEPTRACE_JOB", "skew", 1);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      ::unsetenv("TORCHELASTIC_RUN_ID");
      ::unsetenv("SLURM_JOB_ID");
      const std::string f = std::to_string(forward_ms), w = std::to_string(wait_ms);
      const std::string s = socket(), r = release();
      ::execl(STEPTRACE_RANKED_TRAINER, STEPTRACE_RANKED_TRAINER, s.c_str(), f.c_str(), w.c_str(),
              r.c_str(), static_cast<char*>(nullptr));
      std::_Exit(127);
    }
    ranks_.push_back(pid);
  }

  json report_json(const std::string& args) {
    const auto reply = command(socket(), "report --json" + args);
    EXPECT_TRUE(reply);
    return reply ? json::parse(*reply) : json();
  }

  TempDir dir_;
  std::unique_ptr<DaemonProcess> daemon_;
  std::vector<pid_t> ranks_;
};

json job_skew(const json& report) {
  for (const auto& j : report.at("jobs")) {
    if (j.at("job") == "skew") return j;
  }
  return nullptr;
}

TEST_F(RankSkewIntegration, ReportWindowNamesTheSlowRank) {
  // Rank 2 takes 40 ms in Forward, the others 8 ms; the others then wait for it.
  for (int rank = 0; rank < 4; ++rank) {
    start_rank(rank, 4, rank == 2 ? 40 : 8, rank == 2 ? 2 : 34);
  }
  // Until the window of 3 s is covered and names a straggler (or 30 s).
  json job;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  for (;;) {
    job = job_skew(report_json(" --window 3"));
    if (!job.is_null() && !job.at("rank_skew").is_null() &&
        job.at("rank_skew").at("window_covered_s").get<double>() >= 3.0 &&
        !job.at("stragglers").empty()) {
      break;
    }
    ASSERT_LT(std::chrono::steady_clock::now(), deadline) << job.dump(2) << daemon_->log();
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));  // a few more iterations
  job = job_skew(report_json(" --window 3"));
  ASSERT_FALSE(job.is_null());
  EXPECT_EQ(job.at("rank_skew").at("window_s"), 3);
  bool window_forward = false, window_wait = false;
  for (const auto& s : job.at("stragglers")) {
    EXPECT_EQ(s.at("rank"), 2) << s.dump();
    if (s.at("scope") == "window" && s.at("step") == "Forward") {
      window_forward = true;
      EXPECT_FALSE(s.at("waiting").get<bool>());
      EXPECT_GT(s.at("ratio").get<double>(), 3.0);
      EXPECT_EQ(s.at("pids").size(), 1u);
    }
    if (s.at("scope") == "window" && s.at("step") == "WaitPoll") {
      window_wait = true;
      EXPECT_TRUE(s.at("waiting").get<bool>());
      EXPECT_LT(s.at("ratio").get<double>(), 0.5);
    }
  }
  EXPECT_TRUE(window_forward) << job.dump(2);
  EXPECT_TRUE(window_wait) << job.dump(2);
  // The window's figures per step: rank 2 the slowest in Forward, at about 5x the median.
  for (const auto& s : job.at("rank_skew").at("window")) {
    if (s.at("step") != "Forward") continue;
    EXPECT_EQ(s.at("slowest").at("rank"), 2);
    EXPECT_EQ(s.at("ranks").size(), 4u);
  }
  // Without --window: the run's figures only.
  const json run_only = job_skew(report_json(""));
  EXPECT_TRUE(run_only.at("rank_skew").at("window").is_null());
  EXPECT_FALSE(run_only.at("rank_skew").at("run").empty());

  // The text report's [Ranks] section.
  const auto text = command(socket(), "report --job skew --window 3");
  ASSERT_TRUE(text);
  EXPECT_THAT(*text, HasSubstr("[Ranks]"));
  EXPECT_THAT(*text, HasSubstr("straggler (window): rank 2 in Forward"));

  // Per-rank counters, no pid label.
  const auto metrics = command(socket(), "metrics");
  ASSERT_TRUE(metrics);
  for (int rank = 0; rank < 4; ++rank) {
    EXPECT_THAT(*metrics, HasSubstr("steptrace_job_rank_step_spans_total{job_id=\"skew\",uid=\"" +
                                    std::to_string(::getuid()) + "\",rank=\"" +
                                    std::to_string(rank) + "\",step=\"Forward\"}"));
  }
}

TEST_F(RankSkewIntegration, WindowOutOfRangeIsRefused) {
  const auto reply = command(socket(), "report --window 0");
  ASSERT_TRUE(reply);
  EXPECT_THAT(*reply, HasSubstr("error: "));
  EXPECT_THAT(*reply, HasSubstr("--window needs seconds"));
}

}  // namespace
}  // namespace steptrace::testing
