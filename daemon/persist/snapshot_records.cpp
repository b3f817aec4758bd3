// The version-2 snapshot file (snapshot_codec.h): a checksummed record per line, written
// in an order that keeps the daemon's own records and every uid's first processes and
// retired jobs when max_bytes cuts it, and read record by record so that a bad one costs itself
// alone.
#include "daemon/persist/snapshot_codec.h"

#include <boost/crc.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <limits>
#include <map>
#include <queue>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/persist/snapshot_sections.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {
namespace {

using nlohmann::json;
using snapshot_detail::error_text;

constexpr std::uint64_t kRecordsVersion = 2;
constexpr std::size_t kCrcDigits = 8;
// What the end record's line takes at most: kept free while records are written.
constexpr std::size_t kEndRoom = 96;
// Reasons kept for the log; past these a skipped record is only counted.
constexpr std::size_t kKeptReasons = 100;

std::uint32_t crc32_of(std::string_view text) {
  boost::crc_32_type crc;
  crc.process_bytes(text.data(), text.size());
  return crc.checksum();
}

std::string line_of(const json& record) {
  // Invalid UTF-8 replaced rather than thrown: comm is any bytes a process chose.
  const std::string body = record.dump(-1, ' ', false, json::error_handler_t::replace);
  char crc[kCrcDigits + 2];
  std::snprintf(crc, sizeof crc, "%08x ", static_cast<unsigned>(crc32_of(body)));
  std::string line;
  line.reserve(kCrcDigits + 1 + body.size() + 1);
  line.append(crc, kCrcDigits + 1).append(body).push_back('\n');
  return line;
}

std::string describe(const ProcessImage& p) {
  return "process " + std::to_string(p.peer.key.pid) + " of uid " + std::to_string(p.peer.uid);
}

// Thrown by the parse callback to stop at an over-long array.
struct ArrayTooLong {
  std::size_t depth;
};

}  // namespace

// Each open container is on a stack, an array counting the values and containers that
// end inside it.
nlohmann::json parse_bounded_json(std::string_view content, std::size_t max_elements,
                                  std::string& error) {
  using Event = nlohmann::json::parse_event_t;
  std::vector<std::pair<bool, std::size_t>> open;  // (is an array, elements so far)
  const auto element_done = [&](int depth) {
    if (open.empty() || !open.back().first) return;
    if (++open.back().second > max_elements) throw ArrayTooLong{static_cast<std::size_t>(depth)};
  };
  const nlohmann::json::parser_callback_t callback = [&](int depth, Event event, nlohmann::json&) {
    switch (event) {
      case Event::object_start:
        open.emplace_back(false, 0);
        break;
      case Event::array_start:
        open.emplace_back(true, 0);
        break;
      case Event::object_end:
      case Event::array_end:
        if (!open.empty()) open.pop_back();
        element_done(depth);
        break;
      case Event::value:
        element_done(depth);
        break;
      case Event::key:
        break;
    }
    return true;
  };
  try {
    return nlohmann::json::parse(content, callback, /*allow_exceptions=*/false);
  } catch (const ArrayTooLong& e) {
    error = "an array (at depth " + std::to_string(e.depth) + ") holds more than " +
            std::to_string(max_elements) +
            " elements, more than the configured limits allow live state to hold (raise the "
            "limits to restore it)";
    return nlohmann::json(nlohmann::json::value_t::discarded);
  }
}

namespace {

// Writes lines to the sink until max_bytes, counting what it leaves out.
class RecordWriter {
 public:
  RecordWriter(std::size_t max_bytes, const SnapshotSink& sink) : max_(max_bytes), sink_(sink) {}

  // Writes `record`'s line unless it would pass max_bytes (`always`: the header, the
  // daemon's counters and ledger, the end record: charged first, never cut); its size, or
  // 0 when it was not written. `what` names it if it is left out.
  template <typename What>
  std::size_t put(const json& record, const What& what, bool always = false) {
    if (out_.stopped) return 0;
    const std::string line = line_of(record);
    if (!always && out_.bytes + line.size() + kEndRoom > max_) {
      leave_out(what);
      return 0;
    }
    if (!sink_(line)) {
      out_.stopped = true;
      return 0;
    }
    out_.bytes += line.size();
    ++out_.lines;
    return line.size();
  }
  template <typename What>
  void leave_out(const What& what) {
    if (out_.left_out++ == 0) out_.first_left_out = what();
  }
  EncodedSnapshot& result() { return out_; }

 private:
  const std::size_t max_;
  const SnapshotSink& sink_;
  EncodedSnapshot out_;
};

std::string describe(const RetiredJobImage& job) {
  return "retired job " + job.job + " of uid " + std::to_string(job.uid);
}

using RetiredEntry = std::pair<const std::string, Histogram>;
std::string describe(const RetiredEntry& entry) { return "retired step " + entry.first; }

json record_json(const ProcessImage& p) { return {{"process", snapshot_detail::process_json(p)}}; }
json record_json(const RetiredEntry& entry) {
  return {{"retired", snapshot_detail::retired_json(entry.first, entry.second)}};
}
json record_json(const RetiredJobImage& job) {
  return {{"retired_job", snapshot_detail::retired_job_json(job)}};
}

// A uid's records as they are written: its processes in key order, then its retired jobs
// in job order (the processes first: they hold what its live processes resume after a
// restart, a retired job only the totals its evicted ones left), while the uid's bytes so
// far are the fewest of any uid that still has some to write.
struct UidTurn {
  using Record = std::variant<const ProcessImage*, const RetiredJobImage*, const RetiredEntry*>;
  std::uint64_t bytes = 0;
  std::uint32_t uid = 0;
  std::vector<Record> records;
  std::size_t next = 0;
};

// Every uid's records, fair by bytes: the uid that has written the fewest bytes so far
// writes its next record; a uid whose next one does not fit loses it and the rest of its
// own (left out, counted), and the others go on. So the cap cuts the uid that holds the
// most bytes, never a small one, whatever its uid, pids or job ids, and however many
// retired jobs (each up to its kMaxJobRanks ranks' totals) another uid has.
//
// The retired step histograms are no uid's: each merges every evicted process of its step
// name, whoever ran it, into the daemon-wide per-step counters. They take turns of their
// own, as one more owner, ordered after every uid at equal bytes: bounded (at most
// kMaxRetiredNames + 1 records, each one step's histogram, about 1 KB for a typical step
// and some 12-16 KB when crafted spans hit every bucket the span bound allows), but one
// tenant can fill them with its own step names, so they must not pass everyone's
// processes either.
void put_uid_records(const StateImage& image, RecordWriter& writer) {
  std::map<std::uint32_t, UidTurn> by_uid;
  for (const ProcessImage& p : image.processes) by_uid[p.peer.uid].records.emplace_back(&p);
  for (const RetiredJobImage& job : image.retired_jobs) by_uid[job.uid].records.emplace_back(&job);
  UidTurn shared;  // the retired step histograms
  shared.uid = std::numeric_limits<std::uint32_t>::max();
  for (const RetiredEntry& entry : image.retired) shared.records.emplace_back(&entry);
  const auto later = [](const UidTurn* a, const UidTurn* b) {
    return std::tie(a->bytes, a->uid) > std::tie(b->bytes, b->uid);
  };
  std::priority_queue<UidTurn*, std::vector<UidTurn*>, decltype(later)> next(later);
  for (auto& [uid, turn] : by_uid) {
    turn.uid = uid;
    next.push(&turn);
  }
  if (!shared.records.empty()) next.push(&shared);
  const auto put = [&writer](const auto* record) {
    return writer.put(record_json(*record), [record] { return describe(*record); });
  };
  const auto leave_out = [&writer](const auto* record) {
    writer.leave_out([record] { return describe(*record); });
  };
  while (!next.empty()) {
    UidTurn* turn = next.top();
    next.pop();
    const std::size_t written = std::visit(put, turn->records[turn->next++]);
    if (written == 0) {
      for (; turn->next < turn->records.size(); ++turn->next) {
        std::visit(leave_out, turn->records[turn->next]);
      }
      continue;
    }
    turn->bytes += written;
    if (turn->next < turn->records.size()) next.push(turn);
  }
}

}  // namespace

EncodedSnapshot encode_snapshot_records(const StateImage& image, std::size_t max_bytes,
                                        const SnapshotSink& sink) {
  RecordWriter writer(max_bytes, sink);
  const auto daemon_own = [] { return std::string("the daemon's own record"); };
  writer.put({{"schema", kSnapshotRecordsSchema},
              {"version", kRecordsVersion},
              {"written_at_ns", image.taken_at_ns}},
             daemon_own, /*always=*/true);
  writer.put({{"counters", snapshot_detail::counters_json(image.counters)}}, daemon_own,
             /*always=*/true);
  writer.put({{"ledger", snapshot_detail::ledger_json(image.ledger)}}, daemon_own,
             /*always=*/true);
  put_uid_records(image, writer);
  EncodedSnapshot& out = writer.result();
  writer.put({{"end", {{"records", out.lines}, {"left_out", out.left_out}}}}, daemon_own,
             /*always=*/true);
  return out;
}

std::string encode_snapshot_text(const StateImage& image, std::size_t max_bytes) {
  std::string text;
  encode_snapshot_records(image, max_bytes, [&text](std::string_view line) {
    text.append(line);
    return true;
  });
  return text;
}

SnapshotRecordReader::SnapshotRecordReader(const Limits& limits)
    : limits_(limits),
      bounds_(image_bounds(limits)),
      max_elements_(snapshot_max_array_elements(limits)) {}

void SnapshotRecordReader::skip(const std::string& where, const std::string& reason) {
  if (image_.skipped.size() < kKeptReasons) {
    image_.skipped.push_back(where + ": " + reason);
  } else {
    ++image_.skipped_unnamed;
  }
}

void SnapshotRecordReader::skip_line(const std::string& reason) {
  skip("line " + std::to_string(++line_), reason);
}

void SnapshotRecordReader::read_failed(const std::string& reason) {
  skip_line(reason);
  read_failed_ = true;
}

void SnapshotRecordReader::line(std::string_view text, bool torn) {
  const std::string where = "line " + std::to_string(++line_);
  if (end_lines_) return skip(where, "after the end record");
  if (torn) return skip(where, "torn: the file ends inside it");
  std::uint32_t crc = 0;
  const char* const digits_end = text.data() + std::min(kCrcDigits, text.size());
  const auto [ptr, ec] = std::from_chars(text.data(), digits_end, crc, 16);
  if (text.size() <= kCrcDigits + 1 || ec != std::errc() || ptr != digits_end ||
      text[kCrcDigits] != ' ') {
    return skip(where, "not a checksummed record");
  }
  const std::string_view body = text.substr(kCrcDigits + 1);
  if (crc32_of(body) != crc) return skip(where, "checksum mismatch (the record is damaged)");
  std::string too_long;
  const json doc = parse_bounded_json(body, max_elements_, too_long);
  if (doc.is_discarded()) return skip(where, too_long.empty() ? "not JSON" : too_long);
  if (line_ == 1) return header(doc, where);
  record(doc, where);
}

void SnapshotRecordReader::header(const json& doc, const std::string& where) {
  // Another format first, before the strict read: a later build's header may carry keys
  // this one does not know, and reading its records as ours would be guessing.
  if (doc.is_object()) {
    const auto schema = doc.find("schema");
    const auto version = doc.find("version");
    const bool ours = schema != doc.end() && *schema == kSnapshotRecordsSchema &&
                      version != doc.end() && *version == kRecordsVersion;
    if (!ours && schema != doc.end() && schema->is_string()) {
      foreign_ = "a " + schema->get<std::string>() + " file (version " +
                 (version == doc.end() ? std::string("none") : version->dump()) +
                 "), not one this build reads";
      return;
    }
  }
  JsonReader reader;
  JsonObject h = reader.object(doc, "header");
  std::uint64_t written_at_ns = 0;
  h.ignore("schema");  // checked above
  h.ignore("version");
  h.get_unsigned("written_at_ns", written_at_ns);
  if (!h.finish()) return skip(where, error_text(reader));
  image_.taken_at_ns = written_at_ns;
  ++good_;
}

void SnapshotRecordReader::record(const json& doc, const std::string& where) {
  if (foreign_) return;
  if (!doc.is_object() || doc.size() != 1) return skip(where, "a record is an object of one key");
  const std::string& kind = doc.begin().key();
  const json& body = doc.begin().value();
  JsonReader reader;
  bool ok = true;
  if (kind == "counters") {
    if (counters_) return skip(where, "counters appear twice");
    DaemonCounters counters;
    ok = snapshot_detail::read_counters(reader.object(body, kind), counters);
    if (ok) {
      image_.counters = std::move(counters);
      counters_ = true;
    }
  } else if (kind == "ledger") {
    if (ledger_) return skip(where, "the ledger appears twice");
    ledger::State state;
    ok = snapshot_detail::read_ledger(reader.object(body, kind), limits_, state);
    if (ok) {
      image_.ledger = std::move(state);
      ledger_ = true;
    }
  } else if (kind == "retired") {
    if (image_.retired.size() >= bounds_.retired_names) {
      return skip(where, "more retired steps than the limits keep");
    }
    ok = snapshot_detail::read_retired_entry(reader.object(body, kind), image_.retired);
  } else if (kind == "retired_job") {
    ok = retired_job(reader, body);
  } else if (kind == "process") {
    return process(reader, body, where);
  } else if (kind == "end") {
    return end(reader, body, where);
  } else {
    return skip(where, "unknown record \"" + kind + "\"");
  }
  if (!ok) return skip(where, error_text(reader));
  ++good_;
}

bool SnapshotRecordReader::retired_job(JsonReader& reader, const json& body) {
  if (image_.retired_jobs.size() >= bounds_.retired_jobs) {
    return reader.fail("retired_job", "more retired jobs than limits.max_jobs keeps");
  }
  RetiredJobImage job;
  if (!snapshot_detail::read_retired_job(reader.object(body, "retired_job"), bounds_, job)) {
    return false;
  }
  if (!jobs_.emplace(job.uid, job.job).second) {
    return reader.fail("retired_job", "job \"" + job.job + "\" of uid " + std::to_string(job.uid) +
                                          " appears twice");
  }
  image_.retired_jobs.push_back(std::move(job));
  return true;
}

void SnapshotRecordReader::process(JsonReader& reader, const json& body, const std::string& where) {
  ProcessImage p;
  if (!snapshot_detail::read_process(reader.object(body, "process"), p)) {
    return skip(where, error_text(reader));
  }
  const ProcessKey& key = p.peer.key;
  const std::string what = describe(p);
  if (keys_.contains(key)) return skip(where, what + " appears twice");
  // The limits of live state bound what a restart brings back: a uid's live processes
  // (as at connect: exited ones make room by themselves) here, the table in finish().
  if (p.alive && alive_per_uid_[p.peer.uid] >= limits_.max_processes_per_uid) {
    return skip(where, what + ": past limits.max_processes_per_uid (" +
                           std::to_string(limits_.max_processes_per_uid) + " live)");
  }
  if (p.alive) ++alive_per_uid_[p.peer.uid];
  keys_.insert(key);
  image_.processes.push_back(std::move(p));
  ++good_;
}

// Past limits.max_processes, as the live table makes room: the exited processes go
// first, the least recent first; then the last read (the writer's last turns: the uid
// that held the most bytes).
void SnapshotRecordReader::fit_table() {
  std::vector<ProcessImage>& processes = image_.processes;
  if (processes.size() <= limits_.max_processes) return;
  std::vector<std::size_t> order(processes.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  const auto first_out = [&processes](std::size_t a, std::size_t b) {
    const ProcessImage& pa = processes[a];
    const ProcessImage& pb = processes[b];
    if (pa.alive != pb.alive) return !pa.alive;
    if (!pa.alive) return pa.exit_order < pb.exit_order;
    return a > b;
  };
  std::sort(order.begin(), order.end(), first_out);
  std::vector<bool> out(processes.size(), false);
  for (std::size_t k = 0; k < processes.size() - limits_.max_processes; ++k) {
    out[order[k]] = true;
    skip("process " + std::to_string(processes[order[k]].peer.key.pid),
         describe(processes[order[k]]) + ": past limits.max_processes (" +
             std::to_string(limits_.max_processes) + ")");
  }
  std::size_t kept = 0;
  for (std::size_t i = 0; i < processes.size(); ++i) {
    if (!out[i]) processes[kept++] = std::move(processes[i]);
  }
  processes.resize(kept);
}

void SnapshotRecordReader::end(JsonReader& reader, const json& body, const std::string& where) {
  JsonObject e = reader.object(body, "end");
  std::uint64_t lines = 0;
  std::uint64_t left_out = 0;
  e.get_unsigned("records", lines);
  e.get_unsigned("left_out", left_out);
  if (!e.finish()) return skip(where, error_text(reader));
  end_lines_ = lines;
  ++good_;
  // More lines written than read: lines run together (a damaged '\n') lost more records
  // than the one bad line counted; fewer (a line split in two) were counted already.
  if (lines > line_ - 1) {
    const std::uint64_t missing = lines - (line_ - 1);
    skip(where, std::to_string(missing) + " lines fewer than the end record counts");
    image_.skipped_unnamed += missing - 1;
  }
  if (left_out > 0) {
    // Not skipped here: the daemon that wrote the file counted them
    // (snapshot_records_left_out) and said which; said again for whoever reads the log.
    spdlog::warn(
        "the snapshot says {} records were left out when it was written "
        "(limits.max_snapshot_bytes)",
        left_out);
  }
}

std::optional<StateImage> SnapshotRecordReader::finish(std::string& error) {
  if (foreign_) {
    error = *foreign_;
    return std::nullopt;
  }
  if (good_ == 0) {
    error = line_ == 0 ? "the file is empty"
                       : "no line of it is a " + std::string(kSnapshotRecordsSchema) + " record" +
                             (image_.skipped.empty() ? "" : " (" + image_.skipped.front() + ")");
    return std::nullopt;
  }
  // A read error said where the file stopped already.
  if (!end_lines_ && !read_failed_) {
    skip("line " + std::to_string(line_ + 1),
         "missing: the file ends before its end record (cut short: what followed is lost)");
  }
  fit_table();
  // The writer interleaves the uids' turns; the image keeps its order (state_image.h).
  std::sort(image_.retired_jobs.begin(), image_.retired_jobs.end(),
            [](const RetiredJobImage& a, const RetiredJobImage& b) {
              return std::tie(a.uid, a.job) < std::tie(b.uid, b.job);
            });
  std::sort(image_.processes.begin(), image_.processes.end(),
            [](const ProcessImage& a, const ProcessImage& b) { return a.peer.key < b.peer.key; });
  return std::move(image_);
}

std::optional<StateImage> decode_snapshot_text(std::string_view text, const Limits& limits,
                                               std::string& error) {
  SnapshotRecordReader reader(limits);
  while (!text.empty()) {
    const std::size_t nl = text.find('\n');
    if (nl == std::string_view::npos) {
      reader.line(text, /*torn=*/true);
      break;
    }
    reader.line(text.substr(0, nl));
    text.remove_prefix(nl + 1);
  }
  return reader.finish(error);
}

std::error_code adopt_snapshot(Collector& collector, StateImage image) {
  // Bounded: a snapshot of a million bad records must not write a million log lines.
  constexpr std::size_t kLoggedSkips = 10;
  const std::uint64_t skipped = image.skipped.size() + image.skipped_unnamed;
  for (std::size_t i = 0; i < image.skipped.size() && i < kLoggedSkips; ++i) {
    spdlog::warn("snapshot record skipped, the rest restored: {}", image.skipped[i]);
  }
  if (skipped > kLoggedSkips)
    spdlog::warn("{} more snapshot records skipped", skipped - kLoggedSkips);
  return collector.adopt(std::move(image));
}

}  // namespace steptrace::daemon
