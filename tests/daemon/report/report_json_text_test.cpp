// `report --json` written a piece at a time (report::report_json_text) is byte for byte
// the reply the whole document gave (serve's json_line: dump with invalid UTF-8
// replaced, unsafe code points escaped, '\n'), over a table with jobs, ranks, open spans,
// an exited process, custom steps and hostile strings.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>

#include "daemon/report/report.h"
#include "daemon/state/collector.h"
#include "proto/text_safety.h"
#include "tests/daemon/daemon_test_util.h"

namespace steptrace::daemon {
namespace {

using test::Connection;
using test::end;
using test::FakeWorld;
using test::start;

std::string whole_document_line(const nlohmann::json& doc) {
  return proto::escape_unsafe_in_json(
             doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)) +
         "\n";
}

class ReportJsonTextTest : public ::testing::Test {
 protected:
  void expect_same(const report::ReportFilter& filter, const report::ReportOptions& options = {}) {
    const auto view = collector_.freeze();
    const std::string text = report::report_json_text(*view, filter, options);
    EXPECT_EQ(text, whole_document_line(report::report_json(*view, filter, options)));
    EXPECT_EQ(text.find('\n'), text.size() - 1);
    EXPECT_TRUE(nlohmann::json::accept(text));
  }
  FakeWorld world_;
  Collector collector_{Limits{}, world_.env()};
};

TEST_F(ReportJsonTextTest, AnEmptyTable) { expect_same({}); }

TEST_F(ReportJsonTextTest, AFullTableIsTheSameBytesAsTheWholeDocument) {
  // Ranks of one job (rank skew, stragglers), another uid's job of the same name, a
  // process without one, an invalid byte, an ESC and a bidi control in comms.
  std::vector<std::unique_ptr<Connection>> conns;
  for (std::int32_t rank = 0; rank < 4; ++rank) {
    auto& c = *conns.emplace_back(
        std::make_unique<Connection>(collector_, world_.spawn(100 + rank, 1,
                                                              "train\xE2\x80\xAE"
                                                              "er",
                                                              1000)));
    ASSERT_FALSE(c.identity("llama", static_cast<std::uint32_t>(rank), 0, 4));
    ASSERT_FALSE(c.register_step(256, "Tokenize"));
    std::vector<proto::EventRecord> events;
    for (std::uint64_t i = 0; i < 20; ++i) {
      const std::uint64_t t = i * 1'000'000;
      const std::uint64_t d = rank == 3 ? 900'000 : 300'000;
      events.push_back(start(1, 0, t));
      events.push_back(start(1, 256, t + 10));
      events.push_back(end(1, 256, t + 20 + d / 2));
      events.push_back(end(1, 0, t + d));
    }
    events.push_back(start(2, 1, 50'000'000));  // left open
    ASSERT_FALSE(c.events(events));
  }
  auto& other = *conns.emplace_back(
      std::make_unique<Connection>(collector_, world_.spawn(300, 1, "ev\x1b[2Jil\xff", 1001)));
  ASSERT_FALSE(other.identity("llama"));
  ASSERT_FALSE(other.events({start(1, 2, 0), end(1, 2, 5'000), end(1, 3, 6'000)}));
  auto& none = *conns.emplace_back(
      std::make_unique<Connection>(collector_, world_.spawn(400, 1, "plain", 1002)));
  ASSERT_FALSE(none.events({start(1, 5, 0), end(1, 5, 70'000)}));
  none.close();
  world_.kill(400);
  collector_.refresh_liveness();
  expect_same({});
  // What the table was built to show is there.
  const std::string text = report::report_json_text(*collector_.freeze(), {});
  EXPECT_NE(text.find("\"rank_skew\":{"), std::string::npos) << text;
  EXPECT_NE(text.find("\"exited_at_ns\":"), std::string::npos) << text;
  EXPECT_NE(text.find("\\u202e"), std::string::npos) << text;
  EXPECT_NE(text.find("\xEF\xBF\xBD"), std::string::npos) << text;  // the invalid byte
  expect_same({}, {.window_s = 60});
  expect_same({.pid = 101, .job = std::nullopt});
  expect_same({.pid = std::nullopt, .job = JobRef{1000, "llama"}});
  expect_same({.pid = std::nullopt, .job = JobRef{1001, "nobody"}});
}

}  // namespace
}  // namespace steptrace::daemon
