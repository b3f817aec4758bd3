#include "daemon/report/trace_export_json.h"

namespace steptrace::daemon::trace_json {
namespace {

// Length of the valid UTF-8 sequence of two or more bytes at s[i] (RFC 3629: no
// overlong forms, no surrogates, nothing past U+10FFFF); 0 when there is none.
std::size_t utf8_sequence(std::string_view s, std::size_t i) {
  const auto byte = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const auto cont = [&](std::size_t k, unsigned lo, unsigned hi) {
    return i + k < s.size() && byte(k) >= lo && byte(k) <= hi;
  };
  const unsigned c = byte(0);
  if (c >= 0xC2 && c <= 0xDF) return cont(1, 0x80, 0xBF) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    const unsigned lo = c == 0xE0 ? 0xA0 : 0x80;
    const unsigned hi = c == 0xED ? 0x9F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) ? 3 : 0;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    const unsigned lo = c == 0xF0 ? 0x90 : 0x80;
    const unsigned hi = c == 0xF4 ? 0x8F : 0xBF;
    return cont(1, lo, hi) && cont(2, 0x80, 0xBF) && cont(3, 0x80, 0xBF) ? 4 : 0;
  }
  return 0;
}

}  // namespace

void append_uint(std::string& out, std::uint64_t value) {
  char buf[24];
  const auto result = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, result.ptr);
}

void append_int(std::string& out, std::int64_t value) {
  char buf[24];
  const auto result = std::to_chars(buf, buf + sizeof buf, value);
  out.append(buf, result.ptr);
}

void append_us(std::string& out, std::uint64_t ns) {
  char buf[kUsChars];
  out.append(buf, write_us(buf, ns));
}

void append_json_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out.push_back('"');
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (c < 0x20 || c == 0x7F) {
      out.append("\\u00");
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 0xF]);
      ++i;
    } else if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (const std::size_t n = utf8_sequence(s, i); n != 0) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.push_back('?');
      ++i;
    }
  }
  out.push_back('"');
}

void write_event_fields(std::string& out, const TraceEvent& e, std::string_view tail) {
  LineBuffer line(out);
  line.put(R"({"ph":")");
  line.put_char(e.ph);
  if (e.scope != 0) {
    line.put(R"(","s":")");
    line.put_char(e.scope);
  }
  if (!e.cat.empty()) {
    line.put(R"(","cat":")");
    line.put(e.cat);
  }
  line.put(R"(","name":)");
  if (e.name_json.empty()) {
    append_json_string(line.flush(), e.name);
  } else {
    line.put(e.name_json);
  }
  line.put(R"(,"pid":)");
  line.put_int(e.pid);
  line.put(R"(,"tid":)");
  line.put_int(e.tid);
  if (e.ts_ns) {
    line.put(R"(,"ts":)");
    line.put_us(*e.ts_ns);
  }
  if (e.dur_ns) {
    line.put(R"(,"dur":)");
    line.put_us(*e.dur_ns);
  }
  line.put(tail);
}

void write_event(std::string& out, const TraceEvent& e) { write_event_fields(out, e, "}"); }

}  // namespace steptrace::daemon::trace_json
