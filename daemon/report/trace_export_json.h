// The one writer of Trace Event JSON for the `trace` document (trace_export.cpp):
// every event goes through write_event(), so all of them have one shape. Written by hand
// (std::to_chars, no iostreams, no nlohmann): a capture can hold millions of events.
// Internal to daemon/report/.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

namespace steptrace::daemon::trace_json {

void append_uint(std::string& out, std::uint64_t value);
void append_int(std::string& out, std::int64_t value);

// Nanoseconds as microseconds with three decimals: 1234567 -> "1234.567". At most
// kUsChars characters from `p`; returns their end.
constexpr std::size_t kUsChars = 24;
inline char* write_us(char* p, std::uint64_t ns) {
  p = std::to_chars(p, p + kUsChars - 4, ns / 1000).ptr;
  const auto frac = static_cast<unsigned>(ns % 1000);
  *p++ = '.';
  *p++ = static_cast<char>('0' + frac / 100);
  *p++ = static_cast<char>('0' + frac / 10 % 10);
  *p++ = static_cast<char>('0' + frac % 10);
  return p;
}

// Nanoseconds as microseconds with three decimals (write_us()).
void append_us(std::string& out, std::uint64_t ns);

// How a span's "dur" meets its end when no double makes ts + dur exactly the end (below).
struct DurEnd {
  bool not_before = false;  // the nearest sum at or above the end, not below it
  double cap = std::numeric_limits<double>::infinity();  // no sum past this
};

// The "dur" of a span starting at `ts_ns` (a document time, below 2^53), as the double
// a viewer reads, adding ts and dur as doubles (JavaScript, speedscope, trace-model):
// the three-decimal value when ts + dur is then exactly the double of the end
// ("ts_ns + dur_ns" written as write_us()), else another double that makes it so, so
// that spans that touch never overlap and a child that ends with its parent stays
// inside it. Sometimes no double does: when ts's bits below the end's last place are
// exactly half of it, every sum is a tie and rounds to even, so an odd end is never
// reached. Then the nearest sum below the end (a sibling that starts at that
// nanosecond must not overlap), or with `how.not_before` above it (the outermost of
// spans that end together must contain the others): one unit in the last place off.
// `how.cap` is the end the enclosing span was written with when they end together: the
// sum never passes it (the largest sum at or below it and the end), so a chain of spans
// ending at one nanosecond nests. `exact` is set when the three-decimal value is it.
inline double dur_us(std::uint64_t ts_ns, std::uint64_t dur_ns, const DurEnd& how, bool& exact) {
  // A decimal with three places is read as the double nearest ns / 1000, and IEEE
  // division of two exact doubles rounds the same quotient the same way.
  const double start = static_cast<double>(ts_ns) / 1000.0;
  const double end = static_cast<double>(ts_ns + dur_ns) / 1000.0;
  const double three = static_cast<double>(dur_ns) / 1000.0;
  exact = start + three == end && end <= how.cap;
  if (exact) return three;
  // The sums on a side of the end, nearest first: the first one some dur reaches. Only a
  // few units in the last place away (every other double at worst), so a few tries.
  constexpr double kUp = std::numeric_limits<double>::infinity();
  constexpr int kSteps = 8;
  const auto reach = [start](double sum, double& dur) {
    const double guess = sum - start;
    double lower = guess;
    double upper = guess;
    for (int i = 0; i < 3; ++i) {
      for (const double d : {lower, upper}) {
        if (d >= 0 && start + d == sum) {
          dur = d;
          return true;
        }
      }
      lower = std::nextafter(lower, 0.0);
      upper = std::nextafter(upper, kUp);
    }
    return false;
  };
  double dur = three;
  if (how.not_before) {
    double sum = end;
    for (int i = 0; i < kSteps && sum <= how.cap; ++i, sum = std::nextafter(sum, kUp)) {
      if (reach(sum, dur)) return dur;
    }
  }
  double sum = std::min(end, how.cap);
  for (int i = 0; i < kSteps && sum >= start; ++i, sum = std::nextafter(sum, 0.0)) {
    if (reach(sum, dur)) return dur;
  }
  exact = true;  // nothing near (a cap below the start): as written
  return three;
}

// dur_us() written: the three-decimal form when exact, else the shortest decimal that
// reads back as that double (e.g. "4.107000000000028"). At most kUsChars characters.
inline char* write_dur_us(char* p, std::uint64_t ts_ns, std::uint64_t dur_ns,
                          const DurEnd& how = {}) {
  bool exact = false;
  const double dur = dur_us(ts_ns, dur_ns, how, exact);
  if (exact) return write_us(p, dur_ns);
  return std::to_chars(p, p + kUsChars, dur).ptr;
}

// The trace's sanitiser: a JSON string of client-controlled bytes (a comm, a step name, a
// job id): quotes and backslashes escaped, what proto/text_safety.h calls unsafe (control
// characters, bidi controls, invisible format characters) as \uXXXX, other valid UTF-8
// kept, every byte of invalid UTF-8 '?'.
void append_json_string(std::string& out, std::string_view s);

// ---- one event ---------------------------------------------------------------------
// The fields of one Trace Event. write_event() writes them on one line, in this order,
// leaving out "s", "cat", "ts", "dur" and "args" when they are not set (the `trace`
// document sets "cat" and "ts" on every event, as @tracerbench/trace-model wants):
//   {"ph":"X","s":"p","cat":"step","name":"Forward","pid":7,"tid":8,"ts":1.000,"dur":2.000,
//    "args":{...}}
struct TraceEvent {
  char ph = 'X';                 // 'X' complete, 'i' instant, 'C' counter, 'M' metadata
  char scope = 0;                // "s" of an instant: 'p' (process) or 't' (thread); 0 none
  std::string_view cat{};        // "" when none
  std::string_view name{};       // escaped when written
  std::string_view name_json{};  // or the name already a JSON string (step_name_json())
  std::int64_t pid = 0;
  std::int64_t tid = 0;
  std::optional<std::uint64_t> ts_ns{};   // written as microseconds, append_us()
  std::optional<std::uint64_t> dur_ns{};  // likewise, write_dur_us() (with ts_ns)
  DurEnd dur_end{};                       // write_dur_us()'s how
};

// The members of an event's "args" object, in the order they are added.
class EventArgs {
 public:
  explicit EventArgs(std::string& out) : out_(out) {}
  EventArgs& add_uint(std::string_view key, std::uint64_t value) {
    add_key(key);
    append_uint(out_, value);
    return *this;
  }
  EventArgs& add_string(std::string_view key, std::string_view value) {
    add_key(key);
    append_json_string(out_, value);
    return *this;
  }
  EventArgs& add_bool(std::string_view key, bool value) {
    add_key(key);
    out_.append(value ? "true" : "false");
    return *this;
  }

 private:
  void add_key(std::string_view key) {
    if (!first_) out_.push_back(',');
    first_ = false;
    append_json_string(out_, key);
    out_.push_back(':');
  }
  std::string& out_;
  bool first_ = true;
};

// Text composed on the stack and appended to a string in a few pieces: an event is a
// handful of appends, not one per field (a capture's spans are millions of events).
class LineBuffer {
 public:
  explicit LineBuffer(std::string& out) : out_(out) {}
  LineBuffer(const LineBuffer&) = delete;
  LineBuffer& operator=(const LineBuffer&) = delete;
  ~LineBuffer() { flush(); }

  // A literal: a copy of known size, inlined.
  template <std::size_t N>
  void put(const char (&text)[N]) {
    room(N - 1);
    std::memcpy(p_, text, N - 1);
    p_ += N - 1;
  }
  void put(std::string_view text) {
    if (!room(text.size())) {
      out_.append(text);
      return;
    }
    std::memcpy(p_, text.data(), text.size());
    p_ += text.size();
  }
  void put_char(char c) {
    room(1);
    *p_++ = c;
  }
  void put_int(std::int64_t value) {
    room(kIntChars);
    p_ = std::to_chars(p_, p_ + kIntChars, value).ptr;
  }
  void put_us(std::uint64_t ns) {
    room(kUsChars);
    p_ = write_us(p_, ns);
  }
  void put_dur_us(std::uint64_t ts_ns, std::uint64_t dur_ns, const DurEnd& how) {
    room(kUsChars);
    p_ = write_dur_us(p_, ts_ns, dur_ns, how);
  }
  // Appends what is composed; `out` may then be written directly.
  std::string& flush() {
    out_.append(buf_, p_);
    p_ = buf_;
    return out_;
  }

 private:
  static constexpr std::size_t kIntChars = 24;
  // Flushes unless `n` more characters fit; false when they would not fit even then.
  bool room(std::size_t n) {
    if (n <= static_cast<std::size_t>(buf_ + sizeof buf_ - p_)) return true;
    flush();
    return n <= sizeof buf_;
  }
  std::string& out_;
  char buf_[256];
  char* p_ = buf_;
};

// The event up to "args": then `tail` ("}" or the start of "args").
void write_event_fields(std::string& out, const TraceEvent& e, std::string_view tail);

// An event without args.
void write_event(std::string& out, const TraceEvent& e);

// An event whose args `add_args(EventArgs&)` adds.
template <class AddArgs>
void write_event(std::string& out, const TraceEvent& e, AddArgs&& add_args) {
  write_event_fields(out, e, R"(,"args":{)");
  EventArgs args(out);
  add_args(args);
  out.append("}}");
}

}  // namespace steptrace::daemon::trace_json
