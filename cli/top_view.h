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

#include <cstdint>
#include <string>

#include <nlohmann/json_fwd.hpp>

namespace steptrace::cli {

struct TopStyle {
  bool color = false;  // ANSI highlighting (only when stdout is a terminal)
  std::string note;    // appended to the heading, e.g. the wall-clock time and interval
};

std::string render_top(const nlohmann::json& report, const TopStyle& style);

}  // namespace steptrace::cli
