// Formatting helpers shared by every report the daemon writes (text report, ledger
// text, stats, Prometheus metrics), so durations, byte sizes, tables and escaping look
// the same everywhere. Pure functions, no state.
//
// Text: format_duration() prints like Rust's `{:.2?}` on a Duration (the reference
// tracer's report: "850.00ns", "12.34µs", "1.50ms", "3.00s"); durations, sizes and
// shares are proto/units.h's, the CLI's too; tables are rows of cells
// joined with " | ", padded by display width (UTF-8 aware).
// Prometheus: escape_label_value()/escape_help() and format_double() follow the text
// exposition format 0.0.4 and sanitise client strings (proto/text_safety.h);
// MetricFamily writes "# HELP"/"# TYPE" once and then samples.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>

namespace steptrace::daemon::report {

// ---- text ---------------------------------------------------------------------------
std::string format_duration(std::uint64_t ns);
// Rust's `{:>7.2}%`, e.g. "  83.33%".
std::string format_percent(double percent);
// "512 B", "1.50 KiB", "7.25 GiB".
std::string format_bytes(std::uint64_t bytes);
// How long from `from_ns` to `now_ns` (0 when now is not later): "4.20s", "3m 07s",
// "2h 05m", "3d 04h".
std::string format_age(std::uint64_t from_ns, std::uint64_t now_ns);
// A wall-clock time in UTC, "2026-12-05 08:30:01 UTC" (the same on every host, unlike
// local time): when snapshots began failing, in the report and the log.
std::string format_unix_time(std::int64_t unix_s);

// Terminal columns a UTF-8 string takes (code points; the box and rule characters and
// "µ" are one column each).
std::size_t display_width(std::string_view utf8);
std::string pad_right(std::string_view text, std::size_t width);
std::string pad_left(std::string_view text, std::size_t width);

inline constexpr std::size_t kReportWidth = 64;
// The reference's "╔═══╗ / ║ title ║ / ╚═══╝" box, kReportWidth columns wide, 3 lines.
std::string boxed_title(std::string_view title);
// A line of kReportWidth "─" plus '\n'.
std::string rule();

enum class Align { kLeft, kRight };
struct Column {
  std::size_t width;
  Align align = Align::kLeft;
};
// A rule under a table of `columns`: as wide as its rows (cells and " | " between them),
// and never narrower than rule().
std::string rule(std::span<const Column> columns);
// One table row: cells padded to their column and joined with " | ", plus '\n'. The
// last cell is not padded on the right (no trailing blanks).
std::string table_row(std::span<const Column> columns,
                      std::initializer_list<std::string_view> cells);

// ---- Prometheus text exposition ---------------------------------------------------
// The Prometheus sanitiser (one for every label value and HELP text): label values escape
// backslash, double quote and line feed; bytes that are not valid UTF-8 (the format is
// UTF-8) and the code points proto/text_safety.h calls unsafe (other control characters,
// bidi controls such as U+202E, invisible format characters) become U+FFFD.
std::string escape_label_value(std::string_view value);
// HELP text escapes backslash and line feed (invalid UTF-8 and unsafe as U+FFFD too).
std::string escape_help(std::string_view help);
// Shortest round-trip decimal; "+Inf", "-Inf", "NaN" as Prometheus spells them.
std::string format_double(double value);

// Appends one metric family: its HELP and TYPE lines, then samples through sample().
// Label values are escaped here; names are the caller's constants.
class MetricFamily {
 public:
  using Labels = std::initializer_list<std::pair<std::string_view, std::string_view>>;
  MetricFamily(std::string& out, std::string_view name, std::string_view type,
               std::string_view help);
  // `suffix` is appended to the family name ("_bucket", "_sum", "_count" for histograms).
  // Labels with an empty value are left out (Prometheus reads both alike).
  void sample(Labels labels, std::uint64_t value, std::string_view suffix = {});
  void sample(Labels labels, double value, std::string_view suffix = {});

 private:
  void begin(Labels labels, std::string_view suffix);
  std::string& out_;
  std::string name_;
};

// Counts by kind with every known kind present: each of `known` at zero, then what was
// counted on top (kinds outside `known` included). A labelled family or a stats object
// built from it shows every series before its first hit, so rate() works from the start.
template <class Known>
std::map<std::string, std::uint64_t> with_known_kinds(
    const Known& known, const std::map<std::string, std::uint64_t>& counted) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& kind : known) out.emplace(std::string(kind), 0);
  for (const auto& [kind, n] : counted) out[kind] = n;
  return out;
}

}  // namespace steptrace::daemon::report
