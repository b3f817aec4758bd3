// The `trace` document: a TraceCapture (daemon/state/flight_recorder.h) rendered as a
// Chrome Trace Event Format JSON document, one event per line, that Perfetto UI,
// speedscope and @tracerbench/trace-model read. Runs on the render thread; the capture is
// read, never changed.
//
// Data flow: the io thread captures the flight recorder -> a TraceExport over it (which
// first finds the trace's origin, the earliest time it shows, and the processes with
// nothing in the window, left out) -> next() appends a piece of about piece_bytes at a
// time. Process by process, chunk by chunk, a cursor pairs each end with the latest open
// start of its (thread, step); the spans of a thread wait until its outermost open span
// ends and are then written as complete ("X") events by start, the enclosing one first;
// then the marks become ledger and drop instants and GPU memory counters; otherData closes
// the document. Memory: the open spans (a start time each) and thread ids of the process
// being read and at most kMaxHeldTotal spans waiting to be written in order (4096 per
// thread, 65,536 in all: 2 MiB however many threads), plus the piece; never the number
// of events. At a process's end its spans still open join the held ones in lots of at
// most kMaxHeldTotal too (a client that sent only starts). Spans written before their
// thread's outermost span ended, past those bounds, and every span of a process end that
// took more than one lot, are counted in otherData.spans_written_early (their order at
// equal timestamps may be off).
//
// What viewers need (issue 27): timestamps are microseconds since the origin with three
// decimals, exact nanoseconds that a double holds exactly; a span's "dur" is written so
// that ts + dur, added in double precision as viewers do, is exactly the double of its
// end, so spans that touch (an end and the next start on the same nanosecond) never
// overlap and a child that ends with its parent stays inside it; every event has "cat"
// and "ts".
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "daemon/state/flight_recorder.h"

namespace steptrace::daemon {

// Renders a TraceCapture as a Chrome Trace Event document, a piece at a time, so that a
// trace of millions of events is never one string. Runs on the render thread.
class TraceExport {
 public:
  static constexpr std::size_t kPieceBytes = 1u << 20;
  // Spans waiting to be written in order, in all threads of a process together.
  static constexpr std::size_t kMaxHeldTotal = 1u << 16;
  // A null capture renders as an empty one.
  explicit TraceExport(std::shared_ptr<const TraceCapture> capture);
  // Appends the next piece (about piece_bytes; it may overshoot by one event's text) to
  // `out`. Returns false once the piece it appended ends the document (the document ends
  // with '\n'); after that it appends nothing and returns false.
  bool next(std::string& out, std::size_t piece_bytes = kPieceBytes);
  // The most spans held at once so far (tests: at most kMaxHeldTotal).
  std::size_t max_held() const { return max_held_; }

 private:
  enum class Phase : std::uint8_t {
    kHeader,
    kProcessBegin,  // metadata, window start
    kEvents,        // pairing, chunk by chunk
    kProcessEnd,    // open spans join the held ones, a lot at a time
    kWriting,       // writing sorted spans (then kEvents or the next process)
    kMarks,
    kFooter,
    kDone,
  };
  // A span waiting to be written in order: on its thread until the thread's outermost
  // span ends; those starting at the window start (clipped, or whose start is not in the
  // capture) and those still open until the process ends.
  struct Held {
    std::uint32_t tid = 0;
    std::uint32_t step = 0;
    std::uint64_t ts_ns = 0;
    std::uint64_t dur_ns = 0;
    std::uint8_t flags = 0;       // kFlag* in trace_export.cpp
    std::uint32_t ends_with = 0;  // 1 + its index in shared_ends_, 0 when alone
  };

  void step(std::string& out);
  void begin_process(std::string& out);
  void next_event(std::string& out);
  void plan();  // the origin and the processes shown
  void end_process();
  void take_open_spans(std::vector<Held>& lot);  // up to kMaxHeldTotal in `lot`
  // Sorts `spans` and writes them next; then phase `then`.
  void write_sorted(std::vector<Held>& spans, Phase then);
  void write_all_held();  // past kMaxHeldTotal
  void write_next_sorted(std::string& out);
  void mark_shared_ends();  // kFlagEndsWithOthers on writing_
  void next_mark(std::string& out);
  void write_drop(std::string& out, const TraceMark& m);
  void write_lease_expired(std::string& out, const TraceMark& m);
  void write_device_sample(std::string& out, const TraceMark& m);
  void write_ledger_instant(std::string& out, const TraceMark& m);
  void write_ledger_counter(std::string& out, const TraceMark& m);
  void write_footer(std::string& out);

  void begin_event(std::string& out);
  void span(std::uint32_t tid, std::uint32_t step, std::uint64_t start, std::uint64_t end,
            std::uint8_t flags);
  void write_span(std::string& out, const Held& h);
  void write_thread_name(std::string& out, std::uint32_t tid);
  // A time of the capture as the document's (ns since origin_ns_).
  std::uint64_t rel(std::uint64_t ts_ns) const {
    return ts_ns > origin_ns_ ? ts_ns - origin_ns_ : 0;
  }
  const std::string& step_name_json(std::uint32_t step);

  std::shared_ptr<const TraceCapture> capture_;
  Phase phase_ = Phase::kHeader;
  bool first_event_ = true;
  std::uint64_t origin_ns_ = 0;              // the document's time 0 (monotonic ns)
  std::vector<std::uint64_t> window_start_;  // per process: max(earliest event, since_ns)
  std::vector<bool> shown_;                  // per process: something in the window

  // The process being read and the cursor in it.
  std::size_t process_ = 0;
  std::size_t chunk_ = 0;
  std::uint32_t index_ = 0;
  std::uint64_t window_start_ns_ = 0;  // max(its earliest event, since_ns)
  std::int32_t pid_ = 0;               // its pid
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> open_;  // (tid,step)->starts
  std::unordered_set<std::uint32_t> threads_;
  std::unordered_map<std::uint32_t, std::uint32_t> depth_;        // tid -> spans open
  std::unordered_map<std::uint32_t, std::vector<Held>> pending_;  // tid -> waiting spans
  std::unordered_map<std::uint32_t, std::string> names_;          // step -> escaped name, quoted
  std::vector<Held> held_;
  std::size_t held_total_ = 0;  // in held_ and pending_
  std::size_t max_held_ = 0;
  std::uint64_t spans_written_early_ = 0;
  std::vector<Held> writing_;        // sorted, being written
  std::vector<std::size_t> ends_;    // mark_shared_ends()'s order of writing_
  std::vector<double> shared_ends_;  // per lot ending together: the end last written
  std::size_t writing_index_ = 0;
  Phase after_writing_ = Phase::kEvents;
  bool ending_in_lots_ = false;  // the process's end takes more than one lot

  // The marks.
  std::size_t mark_ = 0;
  std::uint8_t mark_part_ = 0;  // 0 instant, 1 reserved counter, 2 free counter
  bool gpu_process_named_ = false;
  // Writes the daemon's "steptraced: GPU memory" process name once; true when it did.
  bool name_gpu_process(std::string& out);
};

// The whole document at once (tests, small captures).
std::string render_trace(std::shared_ptr<const TraceCapture> capture);

}  // namespace steptrace::daemon
