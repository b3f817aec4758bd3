#include "daemon/report/report_format.h"

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
// Length of the valid UTF-8 sequence at the start of `text` (1..4), or 0 when it does
// not start with one (a stray continuation byte, an overlong form, a surrogate, > U+10FFFF
// or a cut sequence).
std::size_t utf8_sequence(std::string_view text) {
  const auto b = [&text](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  const unsigned char c = b(0);
  if (c < 0x80) return 1;
  std::size_t n = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // bounds of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (text.size() < n || b(1) < lo || b(1) > hi) return 0;
  for (std::size_t i = 2; i < n; ++i) {
    if (b(i) < 0x80 || b(i) > 0xBF) return 0;
  }
  return n;
}

// Prometheus text format escaping: backslash and newline always, '"' in label values.
// The format is UTF-8: a byte that is not part of a valid sequence (a process's comm may
// hold any bytes) becomes U+FFFD, or one such name would make the whole scrape invalid.
// Appends to `out` (a scrape writes hundreds of thousands of label values).
void append_prometheus_escaped(std::string& out, std::string_view text, bool quote) {
  // Control characters (ESC, CR, BEL...) and DEL are legal in the format but would reach
  // a terminal through `steptrace metrics` or `curl`: replaced like invalid UTF-8.
  const auto control = [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return (u < 0x20 && c != '\n') || u == 0x7F;
  };
  const bool plain = std::all_of(text.begin(), text.end(), [quote, &control](char c) {
    return c != '\\' && c != '\n' && (c != '"' || !quote) && static_cast<unsigned char>(c) < 0x80 &&
           !control(c);
  });
  if (plain) {
    out += text;
    return;
  }
  for (std::size_t i = 0; i < text.size();) {
    const char c = text[i];
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '"' && quote) {
      out += "\\\"";
    } else if (control(c)) {
      out += "\xEF\xBF\xBD";  // U+FFFD
    } else if (const std::size_t n = utf8_sequence(text.substr(i)); n == 0) {
      out += "\xEF\xBF\xBD";  // U+FFFD
    } else {
      out += text.substr(i, n);
      i += n;
      continue;
    }
    ++i;
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
