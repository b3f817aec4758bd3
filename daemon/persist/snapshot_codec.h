// The snapshot codec: the daemon's state as a snapshot file's content and back
// (daemon/persist/snapshot.h): since issue 25 a "steptrace.snapshot/v2" file of one
// checksummed record per line (below), read record by record; before, one
// "steptrace.snapshot/v1" JSON document, still read (files older builds wrote) and used as
// the document form of the same records.
//
// Data flow: the server takes the StateImage of a CollectorView (on the render thread, or
// at shutdown: daemon/state/state_image.h, what a snapshot keeps as plain values) and
// save_snapshot() writes it through encode_snapshot_records(); at start load_snapshot()
// reads the file through a SnapshotRecordReader (or, for a version-1 file,
// decode_snapshot() of the whole document) with the strict reader
// (daemon/persist/json_reader.h) into a StateImage, and adopt_snapshot() hands that to
// Collector::adopt(). The state classes only hand their state over (CollectorView::image,
// LedgerView::state, Histogram::parts) and take a decoded one (Collector::adopt,
// LedgerView::adopt, Histogram::from_parts); the document's layout lives here, all of it
// (its keys are its own: a report's field or a wire name renamed changes no snapshot):
// the whole document in snapshot_codec.cpp, the file of records in snapshot_records.cpp,
// the ledger and histogram sections in snapshot_sections.cpp.
//
// The formats are fixed: files earlier builds wrote restore, and encoding what was decoded
// gives the same bytes (tests/daemon/persist/snapshot_v1.json and snapshot_v2.txt are such
// files). A bad field is named as "path: reason"
// (`processes[0].steps[1].histogram.prom: must be an array of 23 elements`); unknown keys
// are errors. A version-1 document is rejected whole (but for its process records, each
// skipped alone); a version-2 file loses only its bad records.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

#include <nlohmann/json_fwd.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/state/histogram.h"
#include "daemon/state/state_image.h"
#include "daemon/state/types.h"
#include "proto/errc.h"

namespace steptrace::daemon {

class Collector;
class CollectorView;
class LedgerView;

// ---- the whole snapshot ----------------------------------------------------------------
// The document of `image` ("written_at_ns": its taken_at_ns).
nlohmann::json encode_snapshot(const StateImage& image);
// encode_snapshot(view.image()): spans open in `view` are written open, per thread, so
// that they end when their process reconnects after a restart (or, found dead, are
// abandoned then).
nlohmann::json encode_snapshot(const CollectorView& view);
// The state `doc` holds, checked against `limits` (the ledger's tables, the bounds of
// image_bounds()) and against the image's own rules (state_image.h: each key and step id
// once, step ids built-in or registered); nullopt with `error` set to "path: reason" when
// `doc` is not a snapshot this build reads.
std::optional<StateImage> decode_snapshot(const nlohmann::json& doc, const Limits& limits,
                                          std::string& error);
// decode_snapshot() under collector.limits(), then collector.adopt(). Fails (state
// unchanged) with errc::bad_snapshot when the document is rejected (the reason goes to
// the log), or as Collector::adopt() does while connections are attached.
std::error_code restore_from_snapshot(Collector& collector, const nlohmann::json& doc);

// Parses `content`, stopping (discarded, `error` set) at the first array with more than
// `max_elements` elements, so that a huge one costs memory and time only up to the bound.
nlohmann::json parse_bounded_json(std::string_view content, std::size_t max_elements,
                                  std::string& error);

// The longest array a snapshot of live state under `limits` can hold (processes,
// reservations per GPU, GPUs, retired names, histogram buckets, steps of a process, open
// threads and spans of a process):
// load_snapshot() stops parsing at the first longer one.
std::size_t snapshot_max_array_elements(const Limits& limits);

// ---- version 2: a record per line (snapshot_records.cpp) -------------------------------
// What the daemon writes since issue 25. Each line is the CRC-32 (IEEE, as zlib's) of the
// JSON that follows, as 8 lowercase hex digits, a space, one JSON object, '\n':
//   <crc> {"schema":"steptrace.snapshot/v2","version":2,"written_at_ns":N}   the header
//   <crc> {"counters":{...}}            the daemon's kept counters (as version 1's)
//   <crc> {"ledger":{...}}              the VRAM ledger (as version 1's)
//   <crc> {"process":{...}}             one process (an entry of v1's), fair by bytes
//   <crc> {"retired":{...}}             one retired step histogram (an entry of v1's), fair
//   <crc> {"retired_job":{...}}         one retired job (an entry of v1's), fair by bytes
//   <crc> {"end":{"records":N,"left_out":M}}   N lines before it, M records not written
// so that a bit flip, a torn tail or a record that breaks a rule costs that record alone:
// the reader skips it, says why, and restores the rest (in any order after the header).
// The daemon's own records come first and are never cut; then the uid that has written
// the fewest bytes so far writes its next record (its processes, then its retired jobs;
// the retired step histograms, daemon-wide, take turns as one more owner:
// snapshot_records.cpp), so that when `max_bytes` cuts the file, it cuts the owner that
// holds the most bytes (its
// last records, and every one after the first that did not fit), never a small one's and
// never everyone's state. Files written before issue 26 have every retired histogram and
// job before the processes.
inline constexpr const char* kSnapshotRecordsSchema = "steptrace.snapshot/v2";

struct EncodedSnapshot {
  std::uint64_t lines = 0;     // written, the header and the end record included
  std::uint64_t bytes = 0;     // written
  std::uint64_t left_out = 0;  // records whose line would have passed `max_bytes`
  std::string first_left_out;  // what the first of them was ("process 42 of uid 1000 ...")
  bool stopped = false;        // the sink refused a line (a write failed): the file is bad
};
// Calls `sink` with each line of `image`'s file ('\n' included) in order, leaving out a
// record whose line would take the file past `max_bytes` (room for the end record kept);
// stops at the first line `sink` refuses.
using SnapshotSink = std::function<bool(std::string_view line)>;
EncodedSnapshot encode_snapshot_records(const StateImage& image, std::size_t max_bytes,
                                        const SnapshotSink& sink);
// The same into a string (tests, tools).
std::string encode_snapshot_text(const StateImage& image, std::size_t max_bytes = SIZE_MAX);

// Reads a version-2 file line by line: each line is checked (checksum, JSON, the record's
// rules, `limits`: processes per uid and in all, the image bounds) on its own; one that
// fails is skipped with its reason ("line 7: checksum mismatch") in the image's `skipped`.
class SnapshotRecordReader {
 public:
  explicit SnapshotRecordReader(const Limits& limits);
  // The next line without its '\n'; `torn`: the file ended before its '\n'.
  void line(std::string_view text, bool torn = false);
  // A line the caller did not pass on (too long to hold, past max_snapshot_bytes).
  void skip_line(const std::string& reason);
  // The file could not be read past here (EIO): the rest counts as one record lost.
  void read_failed(const std::string& reason);
  // The state read, with what was skipped; nullopt with `error` set when the file is not a
  // version-2 snapshot at all (no good header and no good record).
  std::optional<StateImage> finish(std::string& error);

 private:
  void header(const nlohmann::json& doc, const std::string& where);
  void record(const nlohmann::json& doc, const std::string& where);
  bool retired_job(JsonReader& reader, const nlohmann::json& body);
  void process(JsonReader& reader, const nlohmann::json& body, const std::string& where);
  void end(JsonReader& reader, const nlohmann::json& body, const std::string& where);
  void skip(const std::string& where, const std::string& reason);
  void fit_table();

  const Limits& limits_;
  ImageBounds bounds_;
  std::size_t max_elements_;  // the longest array a record may hold
  StateImage image_;
  std::uint64_t line_ = 0;
  std::uint64_t good_ = 0;  // records read, the header included
  bool read_failed_ = false;
  bool counters_ = false;
  bool ledger_ = false;
  std::optional<std::string> foreign_;      // a good header of another format: why
  std::optional<std::uint64_t> end_lines_;  // the end record's count, once read
  std::set<ProcessKey> keys_;
  std::map<std::uint32_t, std::size_t> alive_per_uid_;  // live processes read, by uid
  std::set<std::pair<std::uint32_t, std::string>> jobs_;
};
// `text` (a whole file) through a SnapshotRecordReader.
std::optional<StateImage> decode_snapshot_text(std::string_view text, const Limits& limits,
                                               std::string& error);
// Logs what `image` skipped (bounded) and hands it to collector.adopt().
std::error_code adopt_snapshot(Collector& collector, StateImage image);

// ---- sections (the snapshot's "ledger" and each "histogram"), on their own -------------
nlohmann::json encode_ledger(const LedgerView& ledger);
// Paths in `error` start at the section ("gpus[0].sample.free_bytes: ...").
std::optional<ledger::State> decode_ledger(const nlohmann::json& doc, const Limits& limits,
                                           std::string& error);
nlohmann::json encode_histogram(const Histogram& histogram);
std::optional<Histogram> decode_histogram(const nlohmann::json& doc, std::string& error);

}  // namespace steptrace::daemon
