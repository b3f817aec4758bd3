#include "daemon/report/trace_export_json.h"

#include "proto/text_safety.h"

namespace steptrace::daemon::trace_json {

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
  out.push_back('"');
  std::size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (c >= 0x20 && c < 0x7F) {
      out.push_back(static_cast<char>(c));
      ++i;
    } else if (const proto::Utf8Char ch = proto::decode_utf8(s.substr(i)); ch.length == 0) {
      out.push_back('?');
      ++i;
    } else if (proto::is_unsafe(ch.code_point)) {
      // Controls, bidi controls and invisible format characters: kept as data, written
      // as their escape (a viewer's names and a terminal showing the file stay in order).
      proto::append_json_escape(out, ch.code_point);
      i += ch.length;
    } else {
      out.append(s.substr(i, ch.length));
      i += ch.length;
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
    line.put_dur_us(e.ts_ns.value_or(0), *e.dur_ns, e.dur_end);
  }
  line.put(tail);
}

void write_event(std::string& out, const TraceEvent& e) { write_event_fields(out, e, "}"); }

}  // namespace steptrace::daemon::trace_json
