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
#include <functional>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>
#include <utility>

namespace steptrace::cli {
namespace {

using nlohmann::json;

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

// `comm [pid] job J (uid U) rank R (exited)` (trace_export.cpp's process_name) -> its
// parts. The comm and the job id are the client's and may hold anything, "] rank 9"
// too, so the daemon's own parts are read from the end, and "[pid]" is the event's pid.
struct ProcessName {
  std::string comm_pid;  // "comm [pid]", or the whole name when it has no such part
  std::optional<std::int64_t> rank;
  bool exited = false;
};
ProcessName parse_process_name(std::string name, std::int64_t pid) {
  ProcessName out;
  const auto ends_with = [&name](std::string_view tail) {
    return name.size() >= tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  const std::string whole = name;
  out.exited = ends_with(" (exited)");
  if (out.exited) name.resize(name.size() - 9);
  // " rank N" last, N at most 9 digits (a rank is a 32-bit number).
  std::size_t digits = 0;
  while (digits < name.size() && digits <= 9 && name[name.size() - 1 - digits] >= '0' &&
         name[name.size() - 1 - digits] <= '9') {
    ++digits;
  }
  if (digits > 0 && digits <= 9 && name.size() > digits + 6 &&
      name.compare(name.size() - digits - 6, 6, " rank ") == 0) {
    out.rank = std::stoll(name.substr(name.size() - digits));
    name.resize(name.size() - digits - 6);
  }
  // "[pid]" followed by the end or " job ": the first such.
  const std::string tag = "[" + std::to_string(pid) + "]";
  for (std::size_t at = name.find(tag); at != std::string::npos; at = name.find(tag, at + 1)) {
    const std::size_t after = at + tag.size();
    if (after == name.size() || name.compare(after, 5, " job ") == 0) {
      out.comm_pid = name.substr(0, after);
      return out;
    }
  }
  out.comm_pid = whole;
  return out;
}

// One event of a file, compact: what the merge changes (pid, ts, dur) as numbers, the
// rest as the JSON text of its other members, kept in Input::bodies. ~48 bytes beside
// the text, where a parsed nlohmann object took ~10x the event's size.
struct Event {
  std::int64_t pid = 0;
  std::int64_t ts_ns = 0;
  std::int64_t dur_ns = 0;
  std::size_t body_at = 0;
  std::uint32_t body_size = 0;
  std::int32_t process_name = -1;  // its index in Input::process_names when it names one
  bool has_ts = false;
  bool has_dur = false;
};

// A process_name metadata event, kept parsed (a few per file): its track is renamed.
struct NamedProcess {
  json event;  // without pid, ts and dur
  ProcessName name;
};

struct Input {
  std::string name;  // as given, for errors
  std::string host;
  std::int64_t anchor_unix_ns = 0;  // Unix ns of the file's ts 0
  std::int64_t first_ns = 0;        // its earliest ts
  std::int64_t shift_ns = 0;        // added to its ts in the merged trace
  std::size_t align_ranks = 0;      // --align-step: the ranks (or processes) it was taken over
  std::vector<Event> events;
  std::string bodies;
  std::vector<NamedProcess> process_names;
  std::map<std::int64_t, std::vector<std::int64_t>> align_starts;  // pid -> NAME spans' ts
};

// A nlohmann SAX handler that reads a trace document one event at a time: each element of
// "traceEvents" (and "otherData") is built as a small JSON value, checked and stored as an
// Event; every other member is skipped. It refuses what the whole-document parse refused:
// nesting past kMaxDepth, an event that is not an object with "ph" and an integer "pid",
// a ts or dur that is no time; the lexer itself refuses bad UTF-8 and numbers past a
// double (reported through parse_error()).
class TraceReader {
 public:
  // The names nlohmann::json's SAX interface looks for, spelt its way.
  // NOLINTBEGIN(readability-identifier-naming)
  using number_integer_t = json::number_integer_t;
  using number_unsigned_t = json::number_unsigned_t;
  using number_float_t = json::number_float_t;
  using string_t = json::string_t;
  using binary_t = json::binary_t;
  // NOLINTEND(readability-identifier-naming)

  TraceReader(Input& in, const std::optional<AlignStep>& align) : in_(in), align_(align) {}

  bool null() { return value(nullptr); }
  bool boolean(bool v) { return value(v); }
  bool number_integer(number_integer_t v) { return value(v); }
  bool number_unsigned(number_unsigned_t v) { return value(v); }
  bool number_float(number_float_t v, const string_t& /*text*/) { return value(v); }
  bool string(string_t& v) { return value(std::move(v)); }
  bool binary(binary_t& /*v*/) { return fail(in_.name + " is not valid JSON"); }
  bool start_object(std::size_t /*size*/) { return open(json::object()); }
  bool start_array(std::size_t /*size*/) { return open(json::array()); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(string_t& k) {
    if (depth_ == 1) top_key_ = k;
    key_ = std::move(k);
    return true;
  }
  template <typename Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*token*/, const Exception& /*e*/) {
    return fail(in_.name + " is not valid JSON");
  }

  const std::string& error() const { return error_; }
  bool saw_events() const { return saw_events_; }
  const json& other_data() const { return other_; }

 private:
  bool fail(std::string text) {
    if (error_.empty()) error_ = std::move(text);
    return false;
  }
  bool not_a_trace() {
    return fail(in_.name + " is not a trace document (no \"traceEvents\" array)");
  }

  // Where a value goes in the value being built.
  json* place(json&& v) {
    if (stack_.empty()) {
      built_ = std::move(v);
      return &built_;
    }
    json* top = stack_.back();
    if (top->is_array()) {
      top->push_back(std::move(v));
      return &top->back();
    }
    json& slot = (*top)[key_];
    slot = std::move(v);
    return &slot;
  }

  bool value(json&& v) {
    if (building_) {
      place(std::move(v));
      return true;
    }
    if (depth_ == 0 || (depth_ == 1 && top_key_ == "traceEvents")) return not_a_trace();
    if (depth_ == 1 && top_key_ == "otherData") other_ = std::move(v);
    if (depth_ == 2 && in_events_) return add_event(std::move(v));  // a scalar event
    return true;                                                    // skipped
  }

  bool open(json&& v) {
    if (depth_ >= kMaxDepth) {
      return fail(in_.name + " nests deeper than " + std::to_string(kMaxDepth) +
                  " levels: not a trace");
    }
    const bool root = depth_ == 0;
    ++depth_;
    if (building_) {
      stack_.push_back(place(std::move(v)));
      return true;
    }
    if (root) return v.is_object() || not_a_trace();
    if (depth_ == 2 && top_key_ == "traceEvents") {
      if (!v.is_array() || saw_events_) return not_a_trace();
      saw_events_ = in_events_ = true;
      return true;
    }
    if ((depth_ == 3 && in_events_) || (depth_ == 2 && top_key_ == "otherData")) {
      building_ = true;
      stack_.push_back(place(std::move(v)));
    }
    return true;
  }

  bool close() {
    --depth_;
    if (building_) {
      stack_.pop_back();
      if (!stack_.empty()) return true;
      building_ = false;
      if (depth_ == 2) return add_event(std::move(built_));
      other_ = std::move(built_);
      return true;
    }
    if (depth_ == 1) in_events_ = false;
    return true;
  }

  bool add_event(json&& e);

  Input& in_;
  const std::optional<AlignStep>& align_;
  int depth_ = 0;  // containers open
  std::string top_key_;
  std::string key_;
  bool saw_events_ = false;
  bool in_events_ = false;
  bool building_ = false;
  json built_;
  std::vector<json*> stack_;  // the containers open in built_
  json other_;
  bool any_ts_ = false;
  std::string error_;  // the first refusal
};

// An event's checks, then its compact record.
bool TraceReader::add_event(json&& e) {
  if (!e.is_object() || !e.contains("ph") || !e["ph"].is_string()) {
    return fail(in_.name + ": an event is not an object with \"ph\": " + e.dump().substr(0, 200));
  }
  if (!e.contains("pid") || !e["pid"].is_number_integer()) {
    return fail(in_.name + ": an event has no integer \"pid\": " + e.dump().substr(0, 200));
  }
  Event event;
  event.pid = e["pid"].get<std::int64_t>();
  event.has_ts = e.contains("ts");
  if (event.has_ts && (!e["ts"].is_number() || !(e["ts"].get<double>() >= 0) ||
                       e["ts"].get<double>() > kMaxTimeUs)) {
    return fail(in_.name + ": an event's \"ts\" is not a time: " + e.dump().substr(0, 200));
  }
  event.has_dur = e.contains("dur");
  if (event.has_dur && (!e["dur"].is_number() || !(e["dur"].get<double>() >= 0) ||
                        e["dur"].get<double>() > kMaxTimeUs)) {
    return fail(in_.name + ": an event's \"dur\" is not a duration: " + e.dump().substr(0, 200));
  }
  if (event.has_ts) event.ts_ns = ns_of(e["ts"]);
  if (event.has_dur) event.dur_ns = ns_of(e["dur"]);
  const bool metadata = e["ph"] == "M";
  if (event.has_ts && !metadata) {
    if (!any_ts_ || event.ts_ns < in_.first_ns) in_.first_ns = event.ts_ns;
    any_ts_ = true;
    if (align_ && e["ph"] == "X" && string_field(e, "name") == align_->step) {
      in_.align_starts[event.pid].push_back(event.ts_ns);
    }
  }
  e.erase("pid");
  e.erase("ts");
  e.erase("dur");
  if (metadata && string_field(e, "name") == "process_name" && e.contains("args") &&
      e["args"].is_object() && e["args"].contains("name") && e["args"]["name"].is_string()) {
    ProcessName parsed = parse_process_name(e["args"]["name"].get<std::string>(), event.pid);
    event.process_name = static_cast<std::int32_t>(in_.process_names.size());
    in_.process_names.push_back({std::move(e), std::move(parsed)});
  } else {
    const std::string text = e.dump(-1, ' ', false, json::error_handler_t::replace);
    if (text.size() - 2 > std::numeric_limits<std::uint32_t>::max()) {
      return fail(in_.name + ": an event is larger than 4 GB");
    }
    event.body_at = in_.bodies.size();
    event.body_size = static_cast<std::uint32_t>(text.size() - 2);  // without the braces
    in_.bodies.append(text, 1, text.size() - 2);
  }
  in_.events.push_back(event);
  return true;
}

// The file's anchor and host, after its events were read; an error text, empty when fine.
std::string read_anchor(Input& in, const TraceReader& reader) {
  if (!reader.saw_events()) {
    return in.name + " is not a trace document (no \"traceEvents\" array)";
  }
  const json other = reader.other_data().is_null() ? json::object() : reader.other_data();
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
  return "";
}

// Parses one file (`source`: a string or a stream) into `in`; an error text, empty when
// fine. The events are stored as they come, so a refused file may leave some in `in`.
template <typename Source>
std::string read_input(Source&& source, Input& in, const std::optional<AlignStep>& align) {
  TraceReader reader(in, align);
  const bool parsed = json::sax_parse(std::forward<Source>(source), &reader,
                                      json::input_format_t::json, /*strict=*/true);
  if (!reader.error().empty()) return reader.error();
  if (!parsed) return in.name + " is not valid JSON";
  return read_anchor(in, reader);
}

// --align-step: the file's align point, the median over its ranks (processes without a
// rank each count as one) of the start of their K-th span of NAME; nullopt when no rank
// has K of them.
std::optional<std::int64_t> align_point(Input& in, const AlignStep& align) {
  std::map<std::int64_t, std::optional<std::int64_t>> rank_of;  // pid -> rank
  for (const Event& e : in.events) {
    if (e.process_name >= 0) {
      rank_of[e.pid] = in.process_names[static_cast<std::size_t>(e.process_name)].name.rank;
    }
  }
  // (false, rank) or (true, pid): all the spans of one rank, over its processes.
  std::map<std::pair<bool, std::int64_t>, std::vector<std::int64_t>> starts_of;
  for (const auto& [pid, starts] : in.align_starts) {
    const auto rank = rank_of[pid];
    auto& into = starts_of[rank ? std::make_pair(false, *rank) : std::make_pair(true, pid)];
    into.insert(into.end(), starts.begin(), starts.end());
  }
  std::vector<std::int64_t> points;
  for (auto& [rank, starts] : starts_of) {
    if (starts.size() < align.index) continue;
    const auto kth = starts.begin() + static_cast<std::ptrdiff_t>(align.index - 1);
    std::nth_element(starts.begin(), kth, starts.end());
    points.push_back(*kth);
  }
  in.align_ranks = points.size();
  if (points.empty()) return std::nullopt;
  // The lower median: a time one of the ranks really had.
  const auto mid = points.begin() + static_cast<std::ptrdiff_t>((points.size() - 1) / 2);
  std::nth_element(points.begin(), mid, points.end());
  return *mid;
}

// The shifts of the files and the merged trace's origin (Unix ns), or an error text.
std::string place_inputs(std::vector<Input>& inputs, const std::optional<AlignStep>& align,
                         std::int64_t& origin_unix_ns) {
  if (inputs.empty()) return "no input";
  if (!align) {
    // By wall-clock anchors: the earliest event of any file is the merged 0.
    origin_unix_ns = inputs[0].anchor_unix_ns + inputs[0].first_ns;
    for (const Input& in : inputs)
      origin_unix_ns = std::min(origin_unix_ns, in.anchor_unix_ns + in.first_ns);
    for (Input& in : inputs) in.shift_ns = in.anchor_unix_ns - origin_unix_ns;
    return "";
  }
  std::vector<std::int64_t> points;
  std::int64_t lead = 0;  // the most any file has before its align point
  for (Input& in : inputs) {
    const auto point = align_point(in, *align);
    if (!point) {
      return in.name + " has no span number " + std::to_string(align->index) + " of step " +
             align->step + " to align on in any rank";
    }
    points.push_back(*point);
    lead = std::max(lead, *point - std::min(in.first_ns, *point));
  }
  for (std::size_t i = 0; i < inputs.size(); ++i) inputs[i].shift_ns = lead - points[i];
  origin_unix_ns = inputs[0].anchor_unix_ns - inputs[0].shift_ns;
  return "";
}

// Where the merged text goes, in pieces of ~1 MB; without a sink it is only counted.
class Output {
 public:
  using Sink = std::function<bool(std::string_view)>;
  explicit Output(Sink sink = nullptr) : sink_(std::move(sink)) {}

  void put(std::string_view text) {
    size_ += text.size();
    if (!sink_) return;
    buffer_.append(text);
    if (buffer_.size() >= kFlushBytes) flush();
  }
  bool flush() {
    if (sink_ && ok_ && !buffer_.empty()) ok_ = sink_(buffer_);
    buffer_.clear();
    return ok_;
  }
  std::uint64_t size() const { return size_; }

 private:
  static constexpr std::size_t kFlushBytes = 1 << 20;
  Sink sink_;
  std::string buffer_;
  std::uint64_t size_ = 0;
  bool ok_ = true;
};

// One event as a line, with its new pid and times; `body` is its other members.
void put_event(Output& out, std::int64_t pid, std::string_view body, const Event& e,
               std::int64_t shift_ns) {
  out.put("{\"pid\":");
  out.put(std::to_string(pid));
  if (!body.empty()) {
    out.put(",");
    out.put(body);
  }
  if (e.has_ts) {
    const auto ts = static_cast<std::uint64_t>(std::max<std::int64_t>(0, e.ts_ns + shift_ns));
    out.put(",\"ts\":");
    out.put(us_text(ts));
    if (e.has_dur) {
      out.put(",\"dur\":");
      out.put(dur_text(ts, static_cast<std::uint64_t>(e.dur_ns)));
    }
  }
  out.put("}");
}

std::string members_text(const json& object) {
  const std::string text = object.dump(-1, ' ', false, json::error_handler_t::replace);
  return text.substr(1, text.size() - 2);
}

// The metadata event `name` of a merged process, at ts 0.
void put_metadata(Output& out, std::int64_t pid, const char* name, json args) {
  Event at_zero;
  at_zero.has_ts = true;
  const json members = {
      {"ph", "M"}, {"cat", "__metadata"}, {"name", name}, {"tid", 0}, {"args", std::move(args)}};
  put_event(out, pid, members_text(members), at_zero, 0);
}

// One file's events, renamed and shifted; `next_pid` numbers the merged processes.
void put_input(Output& out, const Input& in, const std::string& node, std::int64_t& next_pid,
               bool& first_line) {
  std::map<std::int64_t, std::int64_t> pids;  // the file's pid -> merged pid
  std::map<std::int64_t, bool> named;
  const auto separate = [&] {
    if (!first_line) out.put(",\n");
    first_line = false;
  };
  for (const Event& e : in.events) {
    const auto [it, added] = pids.emplace(e.pid, next_pid);
    if (added) ++next_pid;
    const std::int64_t pid = it->second;
    separate();
    if (e.process_name < 0) {
      put_event(out, pid, std::string_view(in.bodies).substr(e.body_at, e.body_size), e,
                in.shift_ns);
      continue;
    }
    const NamedProcess& named_process = in.process_names[static_cast<std::size_t>(e.process_name)];
    const ProcessName& parsed = named_process.name;
    std::string track = node;
    if (parsed.rank) track += " / rank " + std::to_string(*parsed.rank);
    track += " / " + parsed.comm_pid;
    if (parsed.exited) track += " (exited)";
    json renamed = named_process.event;
    renamed["args"]["name"] = track;
    put_event(out, pid, members_text(renamed), e, in.shift_ns);
    separate();
    put_metadata(out, pid, "process_sort_index",
                 {{"sort_index", parsed.rank ? *parsed.rank : kNoRankSort + pid}});
    named[e.pid] = true;
  }
  // Processes the file never named (a mark on a process left out of its window).
  for (const auto& [old_pid, pid] : pids) {
    if (named.count(old_pid) != 0) continue;
    separate();
    put_metadata(out, pid, "process_name",
                 {{"name", node + " / [" + std::to_string(old_pid) + "]"}});
  }
}

// The merged document, from the placed inputs.
void put_merged(Output& out, const std::vector<Input>& inputs,
                const std::optional<AlignStep>& align, std::int64_t origin_unix_ns) {
  std::map<std::string, int> host_count;  // hosts named twice (two files of one node)
  json nodes = json::array();
  std::int64_t next_pid = 1;
  bool first_line = true;
  out.put("{\"traceEvents\":[\n");
  for (const Input& in : inputs) {
    std::string node = in.host;
    if (const int seen = host_count[in.host]++; seen > 0) node += " #" + std::to_string(seen + 1);
    put_input(out, in, node, next_pid, first_line);
    json about = {{"file", in.name},
                  {"host", node},
                  {"ts_origin_unix_ns", in.anchor_unix_ns},
                  {"shift_ns", in.shift_ns}};
    if (align) about["align_ranks"] = in.align_ranks;
    nodes.push_back(std::move(about));
  }
  const json other = {{"generator", "steptrace trace merge"},
                      {"clock", "CLOCK_REALTIME"},
                      {"ts_origin_unix_ns", origin_unix_ns},
                      {"aligned_on", align ? json(align->step + ":" + std::to_string(align->index))
                                           : json(nullptr)},
                      {"nodes", nodes}};
  out.put(first_line ? "]" : "\n]");
  out.put(",\"displayTimeUnit\":\"ms\",\"otherData\":");
  out.put(other.dump(-1, ' ', false, json::error_handler_t::replace));
  out.put("}\n");
}

// Writes to a file descriptor, all of it; false (errno set) on failure.
bool write_all(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    data.remove_prefix(static_cast<std::size_t>(n));
  }
  return true;
}

// Reads and places the files named by `request`; exit status and message on failure.
int read_inputs(const MergeRequest& request, const std::optional<AlignStep>& align,
                std::vector<Input>& inputs, std::int64_t& origin_unix_ns) {
  inputs.resize(request.inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const std::string& path = request.inputs[i];
    inputs[i].name = path;
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      say("steptrace: trace merge: cannot read " + path + ": " + std::strerror(errno));
      return kExitFailure;
    }
    std::string error;
    try {
      error = read_input(file, inputs[i], align);
    } catch (const std::exception& e) {  // a field of a type the checks did not expect
      error = path + " is not a trace this build can read (" + e.what() + ")";
    }
    if (error.empty() && file.bad()) error = "cannot read " + path;
    if (!error.empty()) {
      say("steptrace: trace merge: " + error + "; nothing was written");
      return kExitFailure;
    }
  }
  if (std::string error = place_inputs(inputs, align, origin_unix_ns); !error.empty()) {
    say("steptrace: trace merge: " + error + "; nothing was written");
    return kExitFailure;
  }
  return kExitOk;
}

// Writes the merged document to standard output or FILE (through FILE.partial).
int write_merged(const MergeRequest& request, const std::vector<Input>& inputs,
                 const std::optional<AlignStep>& align, std::int64_t origin_unix_ns) {
  if (request.output == "-") {
    Output out([](std::string_view piece) {
      return std::fwrite(piece.data(), 1, piece.size(), stdout) == piece.size();
    });
    put_merged(out, inputs, align, origin_unix_ns);
    const bool ok = out.flush() && std::fflush(stdout) == 0;
    if (!ok) say("steptrace: trace merge: cannot write to standard output");
    return ok ? kExitOk : kExitFailure;
  }
  // FILE.partial, renamed when whole: no half-written FILE. Created exclusively, as
  // `trace` does: a concurrent merge's or a leftover .partial is not clobbered (--force
  // takes a stale one away first).
  const std::string partial = request.output + ".partial";
  if (request.force) ::unlink(partial.c_str());
  const int fd =
      ::open(partial.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  int error = fd >= 0 ? 0 : errno;
  Output out([&](std::string_view piece) {
    if (error != 0) return false;
    if (!write_all(fd, piece)) error = errno != 0 ? errno : EIO;
    return error == 0;
  });
  if (fd >= 0) {
    put_merged(out, inputs, align, origin_unix_ns);
    out.flush();
    if (::close(fd) != 0 && error == 0) error = errno;
  }
  if (error == 0 && ::rename(partial.c_str(), request.output.c_str()) != 0) error = errno;
  if (error != 0) {
    say("steptrace: trace merge: cannot write " + request.output + ": " + std::strerror(error));
    if (fd >= 0) ::unlink(partial.c_str());
    return kExitFailure;
  }
  say("wrote " + request.output + " (" + std::to_string(out.size()) + " bytes, " +
      std::to_string(request.inputs.size()) +
      " nodes); open it in https://ui.perfetto.dev (\"Open trace file\") or "
      "https://www.speedscope.app");
  return kExitOk;
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
    if (std::string error = read_input(documents[i], inputs[i], align); !error.empty()) {
      return {"", error};
    }
  }
  std::int64_t origin_unix_ns = 0;
  if (std::string error = place_inputs(inputs, align, origin_unix_ns); !error.empty()) {
    return {"", error};
  }
  std::string document;
  Output out([&document](std::string_view piece) {
    document.append(piece);
    return true;
  });
  put_merged(out, inputs, align, origin_unix_ns);
  out.flush();
  return {std::move(document), ""};
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
  std::vector<Input> inputs;
  std::int64_t origin_unix_ns = 0;
  if (const int status = read_inputs(request, align, inputs, origin_unix_ns); status != kExitOk) {
    return status;
  }
  // --max-mb as `trace` has it: past it the merge is refused and nothing is written. The
  // size is known before a byte is written (a dry run of the writer, which only counts),
  // so standard output gets nothing either.
  Output counter;
  put_merged(counter, inputs, align, origin_unix_ns);
  if (request.max_mb != 0 && counter.size() > request.max_mb * 1'000'000) {
    say("steptrace: trace merge: the merged trace would be " +
        std::to_string(counter.size() / 1'000'000) + " MB, larger than " +
        std::to_string(request.max_mb) +
        " MB, which viewers struggle with (a 98 MB one closed speedscope's tab); nothing was "
        "written. Merge narrower traces (trace --last SECONDS, --job) or pass --max-mb 0 to "
        "write it all");
    return kExitFailure;
  }
  return write_merged(request, inputs, align, origin_unix_ns);
}

}  // namespace steptrace::cli
