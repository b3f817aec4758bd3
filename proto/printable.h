// The one sanitiser for client-controlled text in any text output (the daemon's `report`,
// `ledger`, `stats` and error replies; the CLI's `top`): a process's comm, step names, a
// task, a GPU UUID. Printed raw, such a string could carry escape codes or newlines into
// an operator's terminal or forge lines of a report. Shared by the daemon and the CLI
// (which may include proto/ only), so both print the same thing. It is the terminal's
// sanitiser of the four (proto/text_safety.h lists them and what each treats as unsafe):
// it keeps printable ASCII only, so every control character, every bidi control and
// invisible format character (U+202E's bytes E2 80 AE print as "???") and all other UTF-8
// are replaced too (and a cell's bytes are its columns, so tables stay aligned).
#pragma once

#include <string>
#include <string_view>

#include "proto/codec.h"

namespace steptrace::proto {

// `text` with every byte that is not printable ASCII (control characters, ESC, DEL, and
// every byte >= 0x80, so UTF-8 too) replaced by '?'; at most `max_bytes` bytes of it.
inline std::string printable(std::string_view text,
                             std::size_t max_bytes = std::string_view::npos) {
  std::string out(text.substr(0, max_bytes));
  for (char& c : out) {
    if (!is_printable(c)) c = '?';
  }
  return out;
}

// True when printable(text) == text.
inline bool all_printable(std::string_view text) {
  for (const char c : text) {
    if (!is_printable(c)) return false;
  }
  return true;
}

}  // namespace steptrace::proto
