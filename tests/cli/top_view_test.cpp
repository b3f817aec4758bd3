// Unit tests of `steptrace top`'s rendering (cli/top_view.h) from report documents.
#include "cli/top_view.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "proto/units.h"

namespace steptrace::cli {
namespace {

using nlohmann::json;
using ::testing::HasSubstr;
using ::testing::Not;

json process(int pid, const char* comm, bool alive, json current, json steps) {
  return {{"pid", pid},     {"start_time", 1}, {"uid", 1000},    {"comm", comm},
          {"alive", alive}, {"dropped", 0},    {"steps", steps}, {"current", current}};
}

json step(const char* name, std::uint64_t count, std::uint64_t total_ns) {
  return {{"step", name},       {"count", count}, {"total_ns", total_ns}, {"min_ns", 1},
          {"max_ns", total_ns}, {"p50_ns", 1},    {"p99_ns", total_ns},   {"open", 0}};
}

json report(json processes, json gpus) {
  return {{"schema", "steptrace.report/v1"},
          {"processes", processes},
          {"totals", json::array()},
          {"ledger", {{"gpus", gpus}}},
          {"daemon",
           {{"events_received", 10},
            {"events_dropped_by_clients", 0},
            {"protocol_errors", 0},
            {"clients_connected", 2},
            {"uptime_s", 5}}}};
}

TEST(TopView, MarksAThreadInWaitPollAsWaitingForVram) {
  const json doc = report(
      json::array(
          {process(101, "sim-worker-1", true,
                   json::array({{{"thread", 101},
                                 {"step", "WaitPoll"},
                                 {"open_for_ns", 1500000000ULL},
                                 {"depth", 1}}}),
                   json::array()),
           process(
               102, "sim-worker-2", true,
               json::array(
                   {{{"thread", 102}, {"step", "Matmul"}, {"open_for_ns", 2000000}, {"depth", 2}}}),
               json::array())}),
      json::array());
  const std::string out = render_top(doc, {});
  // The marker sits on the waiting thread's line, not on the busy one's.
  const auto waiting_line = out.substr(out.find("in WaitPoll"));
  EXPECT_THAT(waiting_line.substr(0, waiting_line.find('\n')), HasSubstr("WAITING FOR VRAM"));
  const auto busy_line = out.substr(out.find("in Matmul"));
  EXPECT_THAT(busy_line.substr(0, busy_line.find('\n')), Not(HasSubstr("WAITING")));
  EXPECT_THAT(busy_line.substr(0, busy_line.find('\n')), HasSubstr("(depth 2)"));
  EXPECT_THAT(out, HasSubstr("for      1.50s"));      // open_for_ns, as the reports print it
  EXPECT_THAT(out, HasSubstr("1 WAITING FOR VRAM"));  // summary line counts processes
  EXPECT_THAT(out, HasSubstr("2 live processes"));
}

TEST(TopView, ShowsOnlyLiveProcessesAndCountsTheExitedOnes) {
  const json doc =
      report(json::array({process(201, "alive-one", true, json::array(), json::array()),
                          process(202, "gone-one", false, json::array(), json::array())}),
             json::array());
  const std::string out = render_top(doc, {});
  EXPECT_THAT(out, HasSubstr("alive-one"));
  EXPECT_THAT(out, Not(HasSubstr("gone-one")));
  EXPECT_THAT(out, HasSubstr("1 live process (1 exited, not shown)"));
  EXPECT_THAT(out, HasSubstr("(no open span)"));
}

TEST(TopView, StepSharesAreOfTheProcessTotalAndSortedByTime) {
  const json doc = report(
      json::array(
          {process(301, "trainer", true, json::array(),
                   json::array({step("Backward", 4, 1000000), step("Forward", 4, 3000000)}))}),
      json::array());
  const std::string out = render_top(doc, {});
  const auto forward = out.find("Forward");
  const auto backward = out.find("Backward");
  ASSERT_NE(forward, std::string::npos);
  ASSERT_NE(backward, std::string::npos);
  EXPECT_LT(forward, backward);
  EXPECT_THAT(out.substr(forward, out.find('\n', forward) - forward), HasSubstr("  75.00%"));
  EXPECT_THAT(out.substr(backward, out.find('\n', backward) - backward), HasSubstr("  25.00%"));
}

TEST(TopView, LedgerShowsReservationsAndMarksLeakedOnes) {
  const json gpu = {{"gpu", "GPU-test"},
                    {"total_bytes", 8ULL << 30},
                    {"free_bytes", 2ULL << 30},
                    {"reserved_bytes", 6ULL << 30},
                    {"reservations", json::array({{{"id", 7},
                                                   {"pid", 401},
                                                   {"bytes", 3ULL << 30},
                                                   {"task", "ok-task"},
                                                   {"holder_alive", true}},
                                                  {{"id", 8},
                                                   {"pid", 402},
                                                   {"bytes", 3ULL << 30},
                                                   {"task", "dead-task"},
                                                   {"holder_alive", false}}})}};
  const std::string out = render_top(report(json::array(), json::array({gpu})), {});
  EXPECT_THAT(out, HasSubstr("GPU GPU-test: reserved 6.00 GiB of 8.00 GiB, free 2.00 GiB"));
  const auto ok_line = out.substr(out.find("ok-task"));
  EXPECT_THAT(ok_line.substr(0, ok_line.find('\n')), HasSubstr("alive"));
  const auto dead_line = out.substr(out.find("dead-task"));
  EXPECT_THAT(dead_line.substr(0, dead_line.find('\n')), HasSubstr("LEAKED"));
}

TEST(TopView, LedgerMarksExpiredLeasesAndShowsFindings) {
  const json gpu = {{"gpu", "GPU-test"},
                    {"total_bytes", 8ULL << 30},
                    {"free_bytes", 2ULL << 30},
                    {"reserved_bytes", 3ULL << 30},
                    {"reservations", json::array({{{"id", 9},
                                                   {"pid", 403},
                                                   {"bytes", 3ULL << 30},
                                                   {"task", "hung-task"},
                                                   {"holder_alive", true},
                                                   {"state", "EXPIRED"}}})},
                    {"findings", json::array({{{"kind", "UNDECLARED"},
                                               {"pid", 404},
                                               {"used_bytes", 1ULL << 30},
                                               {"reserved_bytes", 0}},
                                              {{"kind", "IDLE"},
                                               {"pid", 403},
                                               {"used_bytes", 0},
                                               {"reserved_bytes", 3ULL << 30},
                                               {"reservation_id", 9}}})}};
  const std::string out = render_top(report(json::array(), json::array({gpu})), {});
  const auto hung = out.substr(out.find("hung-task"));
  EXPECT_THAT(hung.substr(0, hung.find('\n')), HasSubstr("EXPIRED (lease not renewed)"));
  EXPECT_THAT(out, HasSubstr("UNDECLARED pid 404: uses 1.00 GiB, reserved 0 B"));
  EXPECT_THAT(out, HasSubstr("IDLE pid 403: holds 3.00 GiB and uses none"));
}

// Every string of the report is a client's (comm, step names, task, GPU UUID): none may
// put escape codes, line breaks or other control bytes on the terminal (issue 15, item 8).
TEST(TopView, ClientStringsAreSanitised) {
  const json doc =
      report(json::array({process(7, "\x1b[2Jev\nil\xff", true,
                                  json::array({{{"thread", 1},
                                                {"step",
                                                 "st\x1b]0;x\x07"
                                                 "ep"},
                                                {"open_for_ns", 10},
                                                {"depth", 1}}}),
                                  json::array({step("cu\rstom\x9b", 1, 100)}))}),
             json::array({{{"gpu", "GPU-\x1b[31m"},
                           {"reserved_bytes", 1},
                           {"reservations", json::array({{{"id", 1},
                                                          {"pid", 7},
                                                          {"bytes", 1},
                                                          {"task", "ta\nsk"},
                                                          {"holder_alive", true}}})}}}));
  for (const bool color : {false, true}) {
    TopStyle style;
    style.color = color;
    const std::string out = render_top(doc, style);
    // With color on, the only escapes are top's own SGR codes, each "ESC [ digits ; m".
    std::string rest = out;
    for (const char* sgr : {"\x1b[1;97;41m", "\x1b[1m", "\x1b[2m", "\x1b[0m"}) {
      for (auto at = rest.find(sgr); at != std::string::npos; at = rest.find(sgr)) {
        rest.erase(at, std::string_view(sgr).size());
      }
    }
    EXPECT_EQ(rest.find('\x1b'), std::string::npos) << out;
    EXPECT_EQ(rest.find('\x07'), std::string::npos) << out;
    EXPECT_EQ(rest.find('\r'), std::string::npos) << out;
    EXPECT_EQ(rest.find('\xff'), std::string::npos) << out;
    EXPECT_EQ(rest.find('\x9b'), std::string::npos) << out;  // the 8-bit CSI
    EXPECT_THAT(rest, HasSubstr("?[2Jev?il?"));
    EXPECT_THAT(rest, HasSubstr("st?]0;x?ep"));
    EXPECT_THAT(rest, HasSubstr("cu?stom?"));
    EXPECT_THAT(rest, HasSubstr("GPU GPU-?[31m"));
    EXPECT_THAT(rest, HasSubstr("ta?sk"));
    EXPECT_THAT(rest, Not(HasSubstr("ev\nil")));
  }
}

TEST(TopView, UnknownTotalWhenTheGpuWasNeverSampled) {
  const json gpu = {{"gpu", "GPU-nosample"},
                    {"total_bytes", nullptr},
                    {"free_bytes", nullptr},
                    {"reserved_bytes", 1024},
                    {"reservations", json::array()}};
  const std::string out = render_top(report(json::array(), json::array({gpu})), {});
  EXPECT_THAT(out, HasSubstr("GPU GPU-nosample: reserved 1.00 KiB (no VRAM sample yet)"));
  EXPECT_THAT(out, HasSubstr("(no reservations)"));
}

TEST(TopView, ColorOnlyWhenAsked) {
  const json doc = report(
      json::array({process(
          501, "w", true,
          json::array({{{"thread", 501}, {"step", "WaitPoll"}, {"open_for_ns", 1}, {"depth", 1}}}),
          json::array())}),
      json::array());
  EXPECT_THAT(render_top(doc, {.color = false, .note = ""}), Not(HasSubstr("\x1b[")));
  EXPECT_THAT(render_top(doc, {.color = true, .note = ""}), HasSubstr("\x1b[1;97;41m"));
}

TEST(TopView, FieldsOfTheWrongTypeRenderWithoutThrowing) {
  const json doc = {{"processes", json::array({{{"pid", "not-a-number"},
                                                {"comm", 42},
                                                {"current", "nope"},
                                                {"steps", json::array({"junk", 3})}}})},
                    {"ledger", {{"gpus", json::array({"junk"})}}},
                    {"daemon", "junk"}};
  std::string out;
  EXPECT_NO_THROW(out = render_top(doc, {}));
  EXPECT_THAT(out, HasSubstr("1 live process"));
  EXPECT_NO_THROW(out = render_top(json::array({1, 2}), {}));
  EXPECT_THAT(out, HasSubstr("0 live processes"));
}

// One style with the daemon's reports (proto/units.h): the reference tracer's durations,
// binary sizes with two decimals, ages in minutes and seconds.
TEST(TopView, NumbersReadAsInTheReports) {
  json doc = report(
      json::array({process(
          401, "trainer", true,
          json::array({{{"thread", 7}, {"step", "Forward"}, {"open_for_ns", 12345}, {"depth", 1}}}),
          json::array({step("Forward", 3, 4560000)}))}),
      json::array({{{"gpu", "GPU-units"},
                    {"total_bytes", 24ULL << 30},
                    {"free_bytes", 1536ULL << 20},
                    {"reserved_bytes", 3 * 1024},
                    {"reservations", json::array()}}}));
  doc["daemon"]["uptime_s"] = 185;
  const std::string out = render_top(doc, {});
  EXPECT_THAT(out, HasSubstr("steptraced up 3m 05s,")) << out;
  EXPECT_THAT(out, HasSubstr("for    12.35µs")) << out;
  EXPECT_THAT(out, HasSubstr("     4.56ms  100.00%")) << out;
  EXPECT_THAT(out, HasSubstr("reserved 3.00 KiB of 24.00 GiB, free 1.50 GiB")) << out;

  EXPECT_EQ(units::duration(999), "999.00ns");
  EXPECT_EQ(units::duration(185ULL * 1000000000), "185.00s");
  EXPECT_EQ(units::bytes(512), "512 B");
  EXPECT_EQ(units::percent(2.0 / 3.0 * 100), "  66.67%");
  EXPECT_EQ(units::age(4'200'000'000), "4.20s");
  EXPECT_EQ(units::age(59'994'999'999), "59.99s");
  EXPECT_EQ(units::age(59'995'000'000), "1m 00s");  // not "60.00s"
  EXPECT_EQ(units::age(60'000'000'000), "1m 00s");
  EXPECT_EQ(units::bytes(1023), "1023 B");
  EXPECT_EQ(units::bytes((1ULL << 20) - 1), "1.00 MiB");  // not "1024.00 KiB"
  EXPECT_EQ(units::bytes(1023ULL << 10), "1023.00 KiB");
  EXPECT_EQ(units::age(7'500ULL * 1'000'000'000), "2h 05m");
  EXPECT_EQ(units::age(3ULL * 86400 * 1'000'000'000 + 4ULL * 3600 * 1'000'000'000), "3d 04h");
}

// ---- the interactive screen (render_top_screen) -----------------------------------

// Columns of a screen line: escape sequences take none, a UTF-8 code point one.
std::size_t columns(const std::string& line) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < line.size(); ++i) {
    if (line[i] == '\x1b') {
      while (i < line.size() && line[i] != 'm') ++i;
      continue;
    }
    if ((static_cast<unsigned char>(line[i]) & 0xC0) != 0x80) ++n;
  }
  return n;
}

json ranked(int pid, const char* comm, const char* job, int rank, int world, std::uint64_t busy_ns,
            json current = json::array()) {
  json p = process(pid, comm, true, std::move(current), json::array({step("Forward", 1, busy_ns)}));
  p["job"] = job;
  p["rank"] = rank;
  p["world_size"] = world;
  return p;
}

json many_processes(int n) {
  json processes = json::array();
  for (int i = 0; i < n; ++i) {
    processes.push_back(
        ranked(1000 + i, "trainer", "train", i, n, static_cast<std::uint64_t>(i + 1) * 1'000'000));
  }
  return processes;
}

std::string joined(const std::vector<std::string>& lines) {
  std::string out;
  for (const std::string& line : lines) out += line + "\n";
  return out;
}

TEST(TopScreen, FitsTheTerminalWithTheHeaderKeptAndTheRestSummarised) {
  const json doc = report(many_processes(80), json::array());
  for (const auto& [width, height] : {std::pair<std::size_t, std::size_t>{70, 18}, {160, 50}}) {
    for (const bool color : {false, true}) {
      TopScreen screen;
      screen.width = width;
      screen.height = height;
      screen.color = color;
      screen.note = "12:00:00, every 1 s, /run/steptrace/steptraced.sock";
      screen.keys = "q quit  t/n/p sort by time/name/pid  j next job  a all jobs  space refresh";
      const auto lines = render_top_screen(doc, screen);
      ASSERT_EQ(lines.size(), height) << joined(lines);
      for (const std::string& line : lines) {
        EXPECT_LE(columns(line), width) << line;
        EXPECT_EQ(line.find('\n'), std::string::npos);
      }
      EXPECT_THAT(lines[0], HasSubstr("steptrace top"));
      EXPECT_THAT(joined(lines), HasSubstr("PID"));
      EXPECT_THAT(lines.back(), HasSubstr("q quit"));
      // Busiest first: pid 1039 has the most time; the last ones are summarised.
      EXPECT_THAT(lines[4], HasSubstr("1079")) << joined(lines);
      EXPECT_THAT(joined(lines), HasSubstr("more processes")) << joined(lines);
      EXPECT_THAT(joined(lines), Not(HasSubstr("\n1000 "))) << joined(lines);  // the idlest
    }
  }
}

TEST(TopScreen, ShowsJobAndRankAndMarksStragglers) {
  json doc = report(json::array({ranked(501, "rank0", "llm", 0, 2, 5'000'000),
                                 ranked(502, "rank1", "llm", 1, 2, 9'000'000)}),
                    json::array());
  TopScreen screen;
  screen.width = 160;
  std::string out = joined(render_top_screen(doc, screen));
  EXPECT_THAT(out, HasSubstr("llm")) << out;
  EXPECT_THAT(out, HasSubstr("0/2")) << out;
  EXPECT_THAT(out, HasSubstr("1/2 ")) << out;
  EXPECT_THAT(out, Not(HasSubstr("!"))) << out;  // no jobs[].stragglers: no marker
  EXPECT_THAT(out, Not(HasSubstr("stragglers"))) << out;

  doc["jobs"] =
      json::array({{{"job", "llm"},
                    {"uid", 1000},
                    {"ranks", {0, 1}},
                    {"stragglers", json::array({{{"rank", 1}, {"step", "Backward"}, {"ratio", 1.8}},
                                                "garbage",
                                                {{"rank", "x"}}})}}});
  out = joined(render_top_screen(doc, screen));
  EXPECT_THAT(out, HasSubstr("1/2!")) << out;
  EXPECT_THAT(out, Not(HasSubstr("0/2!"))) << out;
  EXPECT_THAT(out, HasSubstr("stragglers: 1000:llm rank 1 Backward x1.80")) << out;

  doc["jobs"][0]["stragglers"] = "not an array";
  EXPECT_NO_THROW(out = joined(render_top_screen(doc, screen)));
  EXPECT_THAT(out, Not(HasSubstr("!"))) << out;
}

TEST(TopScreen, SortsAndFiltersByJob) {
  const json doc = report(json::array({ranked(30, "bravo", "a", 0, 1, 1'000'000),
                                       ranked(10, "charlie", "b", 0, 1, 3'000'000),
                                       ranked(20, "alpha", "a", 1, 2, 2'000'000)}),
                          json::array());
  const auto order = [&](TopSort sort, const std::string& job) {
    TopScreen screen;
    screen.sort = sort;
    screen.job = job;
    std::string out;
    for (const std::string& line : render_top_screen(doc, screen)) {
      for (const char* comm : {"alpha", "bravo", "charlie"}) {
        if (line.find(comm) != std::string::npos) out += std::string(comm) + " ";
      }
    }
    return out;
  };
  EXPECT_EQ(order(TopSort::kTime, ""), "charlie alpha bravo ");
  EXPECT_EQ(order(TopSort::kName, ""), "alpha bravo charlie ");
  EXPECT_EQ(order(TopSort::kPid, ""), "charlie alpha bravo ");
  EXPECT_EQ(order(TopSort::kPid, "1000:a"), "alpha bravo ");
  EXPECT_EQ(top_jobs(doc), (std::vector<std::string>{"1000:a", "1000:b"}));
}

TEST(TopScreen, WaitingForVramIsShownFirstAndFieldsOfTheWrongTypeDoNotThrow) {
  const json doc = report(
      json::array(
          {ranked(7, "worker", "j", 0, 1, 1000,
                  json::array({{{"thread", 1}, {"step", "Forward"}, {"open_for_ns", 5'000'000'000}},
                               {{"thread", 2}, {"step", "WaitPoll"}, {"open_for_ns", 2000}}}))}),
      json::array());
  TopScreen screen;
  screen.width = 70;
  const std::string out = joined(render_top_screen(doc, screen));
  EXPECT_THAT(out, HasSubstr("WAITING FOR VRAM 2.00µs")) << out;
  for (const json& odd : {json(nullptr), json::array({1}), json{{"processes", 3}},
                          json{{"processes", {{{"pid", "x"}, {"rank", -1}, {"job", 5}}}}}}) {
    EXPECT_NO_THROW(render_top_screen(odd, screen));
  }
}

}  // namespace
}  // namespace steptrace::cli
