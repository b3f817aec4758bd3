#include "daemon/report/report_format.h"

#include "proto/text_safety.h"
#include "proto/units.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>

namespace steptrace::daemon::report {

std::string format_duration(std::uint64_t ns) { return units::duration(ns); }
std::string format_percent(double percent) { return units::percent(percent); }
std::string format_bytes(std::uint64_t bytes) { return units::bytes(bytes); }
std::string format_age(std::uint64_t from_ns, std::uint64_t now_ns) {
  return units::age(now_ns > from_ns ? now_ns - from_ns : 0);
}

std::string format_unix_time(std::int64_t unix_s) {
  const auto t = static_cast<std::time_t>(unix_s);
  std::tm tm{};
  char buf[40];
  if (::gmtime_r(&t, &tm) == nullptr || std::strftime(buf, sizeof buf, "%F %T UTC", &tm) == 0) {
    return "@" + std::to_string(unix_s);
  }
  return buf;
}

std::size_t display_width(std::string_view utf8) {
  std::size_t n = 0;
  for (const char c : utf8) {
    if ((static_cast<unsigned char>(c) & 0xC0) != 0x80) ++n;  // not a continuation byte
  }
  return n;
}

std::string pad_right(std::string_view text, std::size_t width) {
  std::string out(text);
  const std::size_t w = display_width(text);
  if (w < width) out.append(width - w, ' ');
  return out;
}

std::string pad_left(std::string_view text, std::size_t width) {
  const std::size_t w = display_width(text);
  std::string out;
  if (w < width) out.assign(width - w, ' ');
  out.append(text);
  return out;
}

namespace {
std::string repeat(std::string_view piece, std::size_t n) {
  std::string out;
  out.reserve(piece.size() * n);
  for (std::size_t i = 0; i < n; ++i) out.append(piece);
  return out;
}
}  // namespace

std::string boxed_title(std::string_view title) {
  const std::size_t inner = kReportWidth - 2;
  std::string out = "╔" + repeat("═", inner) + "╗\n";
  out += "║" + pad_right(std::string(7, ' ') + std::string(title), inner) + "║\n";
  out += "╚" + repeat("═", inner) + "╝\n";
  return out;
}

std::string rule() { return repeat("─", kReportWidth) + "\n"; }

std::string rule(std::span<const Column> columns) {
  std::size_t width = 0;
  for (const Column& column : columns) width += column.width;
  if (!columns.empty()) width += 3 * (columns.size() - 1);
  return repeat("─", std::max(width, kReportWidth)) + "\n";
}

std::string table_row(std::span<const Column> columns,
                      std::initializer_list<std::string_view> cells) {
  std::string out;
  std::size_t i = 0;
  for (const std::string_view cell : cells) {
    if (i > 0) out += " | ";
    const bool last = i + 1 == cells.size();
    const Column column = i < columns.size() ? columns[i] : Column{0};
    if (column.align == Align::kRight) {
      out += pad_left(cell, column.width);
    } else {
      out += last ? std::string(cell) : pad_right(cell, column.width);
    }
    ++i;
  }
  out += '\n';
  return out;
}

namespace {
// Prometheus text format escaping: backslash and newline always, '"' in label values.
// The format is UTF-8: a byte that is not part of a valid sequence (a process's comm may
// hold any bytes) becomes U+FFFD, or one such name would make the whole scrape invalid.
// What proto/text_safety.h calls unsafe becomes U+FFFD as well: control characters (ESC,
// CR, BEL, DEL, C1) are legal in the format, and bidi controls and invisible format
// characters too, but they would reach a terminal through `steptrace metrics` or `curl`
// (an RLO reverses the rest of the line there) or make two label values look the same.
// Appends to `out` (a scrape writes hundreds of thousands of label values).
void append_prometheus_escaped(std::string& out, std::string_view text, bool quote) {
  const bool plain = std::all_of(text.begin(), text.end(), [quote](char c) {
    const auto u = static_cast<unsigned char>(c);
    return c != '\\' && (c != '"' || !quote) && u >= 0x20 && u < 0x7F;
  });
  if (plain) {
    out += text;
    return;
  }
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\\' || c == '\n' || (c == '"' && quote)) {
      out += '\\';
      out += c == '\n' ? 'n' : c;
      ++i;
      continue;
    }
    const proto::Utf8Char ch = proto::decode_utf8(text.substr(i));
    if (ch.length == 0 || proto::is_unsafe(ch.code_point)) {
      out += "\xEF\xBF\xBD";  // U+FFFD, one per invalid byte or unsafe code point
      i += std::max<std::size_t>(ch.length, 1);
    } else {
      out += text.substr(i, ch.length);
      i += ch.length;
    }
  }
}
}  // namespace

std::string escape_label_value(std::string_view value) {
  std::string out;
  append_prometheus_escaped(out, value, true);
  return out;
}

std::string escape_help(std::string_view help) {
  std::string out;
  append_prometheus_escaped(out, help, false);
  return out;
}

std::string format_double(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buf[64];
  const auto [ptr, ec] = std::to_chars(buf, buf + sizeof buf, value);
  if (ec != std::errc{}) return "NaN";
  return std::string(buf, ptr);
}

MetricFamily::MetricFamily(std::string& out, std::string_view name, std::string_view type,
                           std::string_view help)
    : out_(out), name_(name) {
  out_ += "# HELP ";
  out_ += name_;
  out_ += ' ';
  out_ += escape_help(help);
  out_ += "\n# TYPE ";
  out_ += name_;
  out_ += ' ';
  out_ += type;
  out_ += '\n';
}

void MetricFamily::begin(Labels labels, std::string_view suffix) {
  out_ += name_;
  out_ += suffix;
  // A label with an empty value is left out: Prometheus does not tell them apart.
  bool first = true;
  for (const auto& [key, value] : labels) {
    if (value.empty()) continue;
    out_ += first ? '{' : ',';
    first = false;
    out_ += key;
    out_ += "=\"";
    append_prometheus_escaped(out_, value, true);
    out_ += '"';
  }
  if (!first) out_ += '}';
  out_ += ' ';
}

void MetricFamily::sample(Labels labels, std::uint64_t value, std::string_view suffix) {
  begin(labels, suffix);
  char buf[24];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof buf, value);
  out_.append(buf, ec == std::errc{} ? end : buf);
  out_ += '\n';
}

void MetricFamily::sample(Labels labels, double value, std::string_view suffix) {
  begin(labels, suffix);
  out_ += format_double(value);
  out_ += '\n';
}

}  // namespace steptrace::daemon::report
