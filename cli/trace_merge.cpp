#include "cli/trace_merge.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

namespace steptrace::cli {
namespace {

using nlohmann::json;

constexpr int kExitOk = 0;
constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;
// A process's sort index when it has no rank: after the ranks, in the order met.
constexpr std::int64_t kNoRankSort = 1'000'000;

void say(const std::string& text) {
  std::fputs(text.c_str(), stderr);
  if (text.empty() || text.back() != '\n') std::fputc('\n', stderr);
}

// Microseconds with three decimals, as the daemon writes them (trace_export_json.h).
std::string us_text(std::uint64_t ns) {
  char buf[32];
  char* p = std::to_chars(buf, buf + 24, ns / 1000).ptr;
  const auto frac = static_cast<unsigned>(ns % 1000);
  *p++ = '.';
  *p++ = static_cast<char>('0' + frac / 100);
  *p++ = static_cast<char>('0' + frac / 10 % 10);
  *p++ = static_cast<char>('0' + frac % 10);
  return {buf, p};
}

// "dur" as the daemon writes it (trace_export_json.h's write_dur_us(), which the CLI may
// not include): three decimals when ts + dur in doubles is the end's double, else the
// shortest double that makes it so. Shifting a file moves its ts, so each dur is redone.
std::string dur_text(std::uint64_t ts_ns, std::uint64_t dur_ns) {
  const double start = static_cast<double>(ts_ns) / 1000.0;
  const double end = static_cast<double>(ts_ns + dur_ns) / 1000.0;
  if (start + static_cast<double>(dur_ns) / 1000.0 == end) return us_text(dur_ns);
  const double dur = end - start;
  if (dur < 0 || start + dur != end) return us_text(dur_ns);
  char buf[32];
  return {buf, std::to_chars(buf, buf + sizeof buf, dur).ptr};
}

// A JSON number of microseconds as whole nanoseconds (the daemon writes exact ones).
std::int64_t ns_of(const json& us) { return std::llround(us.get<double>() * 1000.0); }

// The largest ts or dur a file may hold (µs): 10^15 µs, some 31 years, keeps every sum
// of times and anchors (Unix ns, below kMaxAnchorNs) far inside 64 bits.
constexpr double kMaxTimeUs = 1e15;
constexpr std::int64_t kMaxAnchorNs = 4'000'000'000'000'000'000;
// How deep a file's JSON may nest: a trace needs 4 or 5 levels; a hostile file nesting
// 10^5 deep must not exhaust the stack of the code that walks or prints it.
constexpr int kMaxDepth = 64;

// A string member of `e`, or "" when it is absent or not a string.
std::string string_field(const json& e, const char* key) {
  const auto it = e.find(key);
  return it != e.end() && it->is_string() ? it->get<std::string>() : std::string();
}

struct Input {
  std::string name;  // as given, for errors
  json doc;
  std::string host;
  std::int64_t anchor_unix_ns = 0;  // Unix ns of the file's ts 0
  std::int64_t first_ns = 0;        // its earliest ts
  std::int64_t shift_ns = 0;        // added to its ts in the merged trace
};

// The file's anchor and host; an error text, empty when fine.
std::string read_input(Input& in) {
  if (!in.doc.is_object() || !in.doc.contains("traceEvents") || !in.doc["traceEvents"].is_array()) {
    return in.name + " is not a trace document (no \"traceEvents\" array)";
  }
  const json other = in.doc.value("otherData", json::object());
  if (!other.is_object()) return in.name + ": \"otherData\" is not an object";
  if (other.contains("ts_origin_unix_ns") && other["ts_origin_unix_ns"].is_number_integer()) {
    in.anchor_unix_ns = other["ts_origin_unix_ns"].get<std::int64_t>();
    if (in.anchor_unix_ns < 0 || in.anchor_unix_ns > kMaxAnchorNs) {
      return in.name + ": otherData.ts_origin_unix_ns is not a time";
    }
  } else if (other.contains("wall_clock_offset_ns") &&
             other["wall_clock_offset_ns"].is_number_integer()) {
    // A file of a steptraced before issue 27: ts is the monotonic time itself.
    in.anchor_unix_ns = other["wall_clock_offset_ns"].get<std::int64_t>();
    if (in.anchor_unix_ns < -kMaxAnchorNs || in.anchor_unix_ns > kMaxAnchorNs) {
      return in.name + ": otherData.wall_clock_offset_ns is not a time";
    }
  } else {
    return in.name +
           " has no wall-clock anchor (otherData.ts_origin_unix_ns): not a steptrace trace";
  }
  in.host = string_field(other, "host");
  if (in.host.empty()) in.host = in.name;
  bool any = false;
  for (const json& e : in.doc["traceEvents"]) {
    if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) {
      return in.name + ": an event is not an object with \"ph\": " + e.dump().substr(0, 200);
    }
    if (!e.contains("pid") || !e["pid"].is_number_integer()) {
      return in.name + ": an event has no integer \"pid\": " + e.dump().substr(0, 200);
    }
    const bool has_ts = e.contains("ts");
    if (has_ts && (!e["ts"].is_number() || !(e["ts"].get<double>() >= 0) ||
                   e["ts"].get<double>() > kMaxTimeUs)) {
      return in.name + ": an event's \"ts\" is not a time: " + e.dump().substr(0, 200);
    }
    if (e.contains("dur") && (!e["dur"].is_number() || !(e["dur"].get<double>() >= 0) ||
                              e["dur"].get<double>() > kMaxTimeUs)) {
      return in.name + ": an event's \"dur\" is not a duration: " + e.dump().substr(0, 200);
    }
    if (!has_ts || e["ph"] == "M") continue;
    const std::int64_t ts = ns_of(e["ts"]);
    if (!any || ts < in.first_ns) in.first_ns = ts;
    any = true;
  }
  return "";
}

// The index-th (from 1) start of a span of `step` in the file, in its ns.
std::optional<std::int64_t> align_point(const Input& in, const AlignStep& align) {
  std::vector<std::int64_t> starts;
  for (const json& e : in.doc["traceEvents"]) {
    if (e["ph"] == "X" && string_field(e, "name") == align.step && e.contains("ts")) {
      starts.push_back(ns_of(e["ts"]));
    }
  }
  if (starts.size() < align.index) return std::nullopt;
  std::nth_element(starts.begin(), starts.begin() + static_cast<std::ptrdiff_t>(align.index - 1),
                   starts.end());
  return starts[align.index - 1];
}

// `comm [pid] job J (uid U) rank R (exited)` -> its parts.
struct ProcessName {
  std::string comm_pid;  // "comm [pid]", or the whole name when it has no such part
  std::optional<std::int64_t> rank;
  bool exited = false;
};
ProcessName parse_process_name(const std::string& name) {
  ProcessName out;
  const std::size_t close = name.find(']');
  out.comm_pid = close == std::string::npos ? name : name.substr(0, close + 1);
  // After "[pid]": a comm may hold anything. " rank N", N at most 9 digits (a rank is a
  // 32-bit number; a longer run of digits is no rank).
  const std::string tail = close == std::string::npos ? "" : name.substr(close + 1);
  for (std::size_t at = tail.find(" rank "); at != std::string::npos;
       at = tail.find(" rank ", at + 1)) {
    const std::size_t from = at + 6;
    std::size_t to = from;
    while (to < tail.size() && to - from <= 9 && tail[to] >= '0' && tail[to] <= '9') ++to;
    if (to == from || to - from > 9) continue;
    out.rank = std::stoll(tail.substr(from, to - from));
    break;
  }
  out.exited = name.size() >= 9 && name.compare(name.size() - 9, 9, " (exited)") == 0;
  return out;
}

// One event as a line, with its new pid and times.
std::string event_line(json e, std::int64_t pid, std::int64_t shift_ns) {
  e["pid"] = pid;
  std::string times;
  if (e.contains("ts")) {
    const auto ts =
        static_cast<std::uint64_t>(std::max<std::int64_t>(0, ns_of(e["ts"]) + shift_ns));
    times = ",\"ts\":" + us_text(ts);
    if (e.contains("dur")) {
      times += ",\"dur\":" + dur_text(ts, static_cast<std::uint64_t>(ns_of(e["dur"])));
    }
  }
  e.erase("ts");
  e.erase("dur");
  std::string line = e.dump(-1, ' ', false, json::error_handler_t::replace);
  line.insert(line.size() - 1, times);                      // before the closing brace
  if (line.size() > 2 && line[1] == ',') line.erase(1, 1);  // "{,"ts"..." of an empty object
  return line;
}

}  // namespace

std::optional<AlignStep> parse_align_step(const std::string& text) {
  AlignStep out;
  const std::size_t colon = text.rfind(':');
  out.step = colon == std::string::npos ? text : text.substr(0, colon);
  if (out.step.empty()) return std::nullopt;
  if (colon != std::string::npos) {
    const std::string k = text.substr(colon + 1);
    const auto [end, ec] = std::from_chars(k.data(), k.data() + k.size(), out.index);
    if (k.empty() || ec != std::errc() || end != k.data() + k.size() || out.index == 0) {
      return std::nullopt;
    }
  }
  return out;
}

MergeResult merge_traces(const std::vector<std::string>& documents,
                         const std::vector<std::string>& names,
                         const std::optional<AlignStep>& align) {
  std::vector<Input> inputs(documents.size());
  for (std::size_t i = 0; i < documents.size(); ++i) {
    inputs[i].name = i < names.size() ? names[i] : "input " + std::to_string(i + 1);
    bool too_deep = false;
    inputs[i].doc = json::parse(
        documents[i],
        [&](int depth, json::parse_event_t, json&) {
          if (depth > kMaxDepth) too_deep = true;
          return !too_deep;
        },
        false);
    if (too_deep) {
      return {"", inputs[i].name + " nests deeper than " + std::to_string(kMaxDepth) +
                      " levels: not a trace"};
    }
    if (inputs[i].doc.is_discarded()) return {"", inputs[i].name + " is not valid JSON"};
    if (std::string error = read_input(inputs[i]); !error.empty()) return {"", error};
  }
  if (inputs.empty()) return {"", "no input"};

  // The shifts: by wall-clock anchors, or so that the align points coincide.
  json nodes = json::array();
  std::int64_t origin_unix_ns = 0;
  if (align) {
    std::vector<std::int64_t> points;
    std::int64_t lead = 0;  // the most any file has before its align point
    for (const Input& in : inputs) {
      const auto point = align_point(in, *align);
      if (!point) {
        return {"", in.name + " has no span number " + std::to_string(align->index) + " of step " +
                        align->step + " to align on"};
      }
      points.push_back(*point);
      lead = std::max(lead, *point - std::min(in.first_ns, *point));
    }
    for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i].shift_ns = lead - points[i];
    origin_unix_ns = inputs[0].anchor_unix_ns - inputs[0].shift_ns;
  } else {
    origin_unix_ns = inputs[0].anchor_unix_ns + inputs[0].first_ns;
    for (const Input& in : inputs)
      origin_unix_ns = std::min(origin_unix_ns, in.anchor_unix_ns + in.first_ns);
    for (Input& in : inputs) in.shift_ns = in.anchor_unix_ns - origin_unix_ns;
  }

  // Hosts named twice (two files of one node) are told apart.
  std::map<std::string, int> host_count;
  std::string out = "{\"traceEvents\":[\n";
  bool first_line = true;
  const auto emit = [&](const std::string& line) {
    if (!first_line) out.append(",\n");
    first_line = false;
    out.append(line);
  };
  std::int64_t next_pid = 1;
  for (Input& in : inputs) {
    std::string node = in.host;
    if (const int seen = host_count[in.host]++; seen > 0) node += " #" + std::to_string(seen + 1);
    std::map<std::int64_t, std::int64_t> pids;  // the file's pid -> merged pid
    const auto pid_of = [&](std::int64_t pid) {
      auto [it, added] = pids.emplace(pid, next_pid);
      if (added) ++next_pid;
      return it->second;
    };
    std::map<std::int64_t, bool> named;
    for (const json& e : in.doc["traceEvents"]) {
      const std::int64_t old_pid = e["pid"].get<std::int64_t>();
      const std::int64_t pid = pid_of(old_pid);
      if (e["ph"] == "M" && string_field(e, "name") == "process_name" && e.contains("args") &&
          e["args"].is_object() && e["args"].contains("name") && e["args"]["name"].is_string()) {
        const ProcessName parsed = parse_process_name(e["args"]["name"].get<std::string>());
        std::string track = node;
        if (parsed.rank) track += " / rank " + std::to_string(*parsed.rank);
        track += " / " + parsed.comm_pid;
        if (parsed.exited) track += " (exited)";
        json renamed = e;
        renamed["args"]["name"] = track;
        emit(event_line(renamed, pid, in.shift_ns));
        const std::int64_t sort = parsed.rank ? *parsed.rank : kNoRankSort + pid;
        emit(event_line({{"ph", "M"},
                         {"cat", "__metadata"},
                         {"name", "process_sort_index"},
                         {"tid", 0},
                         {"ts", 0},
                         {"args", {{"sort_index", sort}}}},
                        pid, 0));
        named[old_pid] = true;
        continue;
      }
      emit(event_line(e, pid, in.shift_ns));
    }
    // Processes the file never named (a mark on a process left out of its window).
    for (const auto& [old_pid, pid] : pids) {
      if (named.count(old_pid) != 0) continue;
      emit(event_line({{"ph", "M"},
                       {"cat", "__metadata"},
                       {"name", "process_name"},
                       {"tid", 0},
                       {"ts", 0},
                       {"args", {{"name", node + " / [" + std::to_string(old_pid) + "]"}}}},
                      pid, 0));
    }
    nodes.push_back({{"file", in.name},
                     {"host", node},
                     {"ts_origin_unix_ns", in.anchor_unix_ns},
                     {"shift_ns", in.shift_ns}});
  }
  json other = {{"generator", "steptrace trace merge"},
                {"clock", "CLOCK_REALTIME"},
                {"ts_origin_unix_ns", origin_unix_ns},
                {"aligned_on",
                 align ? json(align->step + ":" + std::to_string(align->index)) : json(nullptr)},
                {"nodes", nodes}};
  out.append(first_line ? "]" : "\n]");
  out.append(",\"displayTimeUnit\":\"ms\",\"otherData\":");
  out.append(other.dump(-1, ' ', false, json::error_handler_t::replace));
  out.append("}\n");
  return {std::move(out), ""};
}

int run_trace_merge(const MergeRequest& request) {
  std::optional<AlignStep> align;
  if (!request.align_step.empty()) {
    align = parse_align_step(request.align_step);
    if (!align) {
      say("steptrace: trace merge: --align-step wants NAME or NAME:K (K a span number from 1), "
          "not '" +
          request.align_step + "'");
      return kExitUsage;
    }
  }
  if (request.output.empty()) {
    say("steptrace: trace merge: name the merged file with -o FILE (- for standard output)");
    return kExitUsage;
  }
  struct stat st {};
  if (request.output != "-" && !request.force && ::lstat(request.output.c_str(), &st) == 0) {
    say("steptrace: " + request.output +
        " already exists; choose another file with -o, or pass --force to replace it");
    return kExitUsage;
  }
  std::vector<std::string> documents;
  for (const std::string& path : request.inputs) {
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      say("steptrace: trace merge: cannot read " + path + ": " + std::strerror(errno));
      return kExitFailure;
    }
    std::stringstream text;
    text << in.rdbuf();
    documents.push_back(text.str());
  }
  MergeResult merged;
  try {
    merged = merge_traces(documents, request.inputs, align);
  } catch (const std::exception& e) {  // a field of a type the checks did not expect
    merged.error = std::string("an input is not a trace this build can read (") + e.what() + ")";
  }
  if (!merged.error.empty()) {
    say("steptrace: trace merge: " + merged.error + "; nothing was written");
    return kExitFailure;
  }
  if (request.output == "-") {
    const bool ok = std::fwrite(merged.document.data(), 1, merged.document.size(), stdout) ==
                        merged.document.size() &&
                    std::fflush(stdout) == 0;
    if (!ok) say("steptrace: trace merge: cannot write to standard output");
    return ok ? kExitOk : kExitFailure;
  }
  // FILE.partial, renamed when whole: no half-written FILE.
  const std::string partial = request.output + ".partial";
  // Created exclusively, as `trace` does: a concurrent merge's or a leftover .partial is
  // not clobbered (--force takes a stale one away first).
  if (request.force) ::unlink(partial.c_str());
  const int fd =
      ::open(partial.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  bool ok = fd >= 0;
  std::string_view data = merged.document;
  while (ok && !data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) data.remove_prefix(static_cast<std::size_t>(n));
  }
  const int error = ok ? 0 : errno;
  if (fd >= 0 && ::close(fd) != 0 && ok) ok = false;
  if (ok) ok = ::rename(partial.c_str(), request.output.c_str()) == 0;
  if (!ok) {
    say("steptrace: trace merge: cannot write " + request.output + ": " +
        std::strerror(error != 0 ? error : errno));
    ::unlink(partial.c_str());
    return kExitFailure;
  }
  say("wrote " + request.output + " (" + std::to_string(merged.document.size()) + " bytes, " +
      std::to_string(request.inputs.size()) +
      " nodes); open it in https://ui.perfetto.dev (\"Open trace file\") or "
      "https://www.speedscope.app");
  return kExitOk;
}

}  // namespace steptrace::cli
