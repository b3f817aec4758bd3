// The `trace` document: a TraceCapture (daemon/state/flight_recorder.h) rendered as a
// Chrome Trace Event Format JSON document, one event per line, that Perfetto and
// chrome://tracing open. Runs on the render thread; the capture is read, never changed.
//
// Data flow: the io thread captures the flight recorder -> a TraceExport over it ->
// next() appends a piece of about piece_bytes at a time. Process by process, chunk by
// chunk, a cursor pairs each end with the latest open start of its (thread, step) and
// writes complete ("X") events; then the marks become ledger and drop instants and GPU
// memory counters; otherData closes the document. Memory: the open spans and thread ids
// of the process being read (and at most 4096 spans held back to be written parent
// first), plus the piece; never the number of events.
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
  // A null capture renders as an empty one.
  explicit TraceExport(std::shared_ptr<const TraceCapture> capture);
  // Appends the next piece (about piece_bytes; it may overshoot by one event's text) to
  // `out`. Returns false once the piece it appended ends the document (the document ends
  // with '\n'); after that it appends nothing and returns false.
  bool next(std::string& out, std::size_t piece_bytes = kPieceBytes);

 private:
  enum class Phase : std::uint8_t {
    kHeader,
    kProcessBegin,  // metadata, window start
    kEvents,        // pairing, chunk by chunk
    kProcessEnd,    // open spans join the held ones
    kHeld,          // writing the held spans (then kEvents or the next process)
    kMarks,
    kFooter,
    kDone,
  };
  // A span held back to be written parent first: those starting at the window start
  // (clipped, or whose start is not in the capture) and those still open.
  struct Held {
    std::uint32_t tid = 0;
    std::uint32_t step = 0;
    std::uint64_t ts_ns = 0;
    std::uint64_t dur_ns = 0;
    std::uint8_t flags = 0;  // kFlag* in trace_export.cpp
  };

  void step(std::string& out);
  void begin_process(std::string& out);
  void next_event(std::string& out);
  void end_process();
  void end_held_collection();  // sorts the held spans and starts writing them
  void write_held(std::string& out);
  void next_mark(std::string& out);
  void write_drop(std::string& out, const TraceMark& m);
  void write_lease_expired(std::string& out, const TraceMark& m);
  void write_device_sample(std::string& out, const TraceMark& m);
  void write_ledger_instant(std::string& out, const TraceMark& m);
  void write_ledger_counter(std::string& out, const TraceMark& m);
  void write_footer(std::string& out);

  void begin_event(std::string& out);
  void span(std::string& out, std::uint32_t tid, std::uint32_t step, std::uint64_t start,
            std::uint64_t end, std::uint8_t flags);
  void write_span(std::string& out, std::uint32_t tid, std::uint32_t step, std::uint64_t ts,
                  std::uint64_t dur, std::uint8_t flags);
  void write_thread_name(std::string& out, std::uint32_t tid);
  const std::string& step_name_json(std::uint32_t step);

  std::shared_ptr<const TraceCapture> capture_;
  Phase phase_ = Phase::kHeader;
  bool first_event_ = true;

  // The process being read and the cursor in it.
  std::size_t process_ = 0;
  std::size_t chunk_ = 0;
  std::uint32_t index_ = 0;
  std::uint64_t window_start_ns_ = 0;  // max(its earliest event, since_ns)
  std::int32_t pid_ = 0;               // its pid
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> open_;  // (tid,step)->starts
  std::unordered_set<std::uint32_t> threads_;
  std::unordered_map<std::uint32_t, std::string> names_;  // step -> escaped name, quoted
  std::vector<Held> held_;
  std::size_t held_index_ = 0;
  bool held_then_next_process_ = false;

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
