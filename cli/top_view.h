// `steptrace top`: one screen built from the daemon's `report --json` document.
//
// Data flow: the CLI polls `report --json` once per refresh (one connection each), parses
// it, and render_top() turns it into text: per live process the span each thread is in
// right now and for how long (from the "current" array; a WaitPoll is marked WAITING FOR
// VRAM so a trainer stuck on VRAM shows at a glance), its per-step totals with shares,
// and the ledger per GPU with leaked reservations marked. Rendering is a pure function
// of the document, so it is unit-tested without a daemon. Fields missing or of the wrong
// type render as blanks/zeros; nothing here throws on odd input. Every string from the
// document is printed through proto::printable() (non-printable bytes as '?'): they are
// chosen by clients and must not drive the terminal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace steptrace::cli {

struct TopStyle {
  bool color = false;  // ANSI highlighting (only when stdout is a terminal)
  std::string note;    // appended to the heading, e.g. the wall-clock time and interval
};

std::string render_top(const nlohmann::json& report, const TopStyle& style);

// The interactive screen (htop-like): a header that always stays (title, daemon counters,
// a summary with the sort and the job shown, the stragglers of jobs[].stragglers when the
// daemon sends them, the column heads), then one line per live process, busiest first by
// default (pid, uid, job, rank with '!' on a straggler, comm, traced time, busiest step,
// the span open longest now), then one line per GPU of the ledger, then `keys`. What does
// not fit in `height` rows is summarised in one line ("+ N more processes"); every line is
// cut to `width` columns before highlighting is added, so nothing wraps.
enum class TopSort { kTime, kName, kPid };

struct TopScreen {
  std::size_t width = 0;   // columns; 0: no limit
  std::size_t height = 0;  // rows; 0: no limit (every process and GPU)
  TopSort sort = TopSort::kTime;
  std::string job;  // only this job's processes, as "UID:ID" (top_jobs()); "": all
  bool color = false;
  std::string note;  // after the title, e.g. the wall-clock time and interval
  std::string keys;  // the last line, e.g. the keys' help; "": none
};

// One string per screen line, without line breaks.
std::vector<std::string> render_top_screen(const nlohmann::json& report, const TopScreen& screen);

// The jobs of a report as "UID:ID", in the daemon's order (jobs[], else the processes').
std::vector<std::string> top_jobs(const nlohmann::json& report);

}  // namespace steptrace::cli
