// The version-2 snapshot file (snapshot_codec.h): a checksummed record per line, written
// in an order that keeps the daemon's own records and every uid's first processes when
// max_bytes cuts it, and read record by record so that a bad one costs itself alone.
#include "daemon/persist/snapshot_codec.h"

#include <boost/crc.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <utility>
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

// The processes in turns by uid: every uid's first, then every uid's second, and so on.
std::vector<const ProcessImage*> in_turns_by_uid(const std::vector<ProcessImage>& processes) {
  std::map<std::uint32_t, std::vector<const ProcessImage*>> by_uid;
  for (const ProcessImage& p : processes) by_uid[p.peer.uid].push_back(&p);
  std::vector<const std::vector<const ProcessImage*>*> active;
  for (const auto& [uid, list] : by_uid) active.push_back(&list);
  std::vector<const ProcessImage*> out;
  out.reserve(processes.size());
  for (std::size_t turn = 0; !active.empty(); ++turn) {
    std::size_t kept = 0;
    for (const auto* list : active) {
      out.push_back((*list)[turn]);
      if (turn + 1 < list->size()) active[kept++] = list;
    }
    active.resize(kept);
  }
  return out;
}

std::string describe(const ProcessImage& p) {
  return "process " + std::to_string(p.peer.key.pid) + " of uid " + std::to_string(p.peer.uid);
}

}  // namespace

EncodedSnapshot encode_snapshot_records(const StateImage& image, std::size_t max_bytes,
                                        const SnapshotSink& sink) {
  EncodedSnapshot out;
  // `what` names the record if it is left out; `always`: the header and the end record.
  const auto put = [&](const json& record, const auto& what, bool always = false) {
    if (out.stopped) return;
    const std::string line = line_of(record);
    if (!always && out.bytes + line.size() + kEndRoom > max_bytes) {
      if (out.left_out++ == 0) out.first_left_out = what();
      return;
    }
    if (!sink(line)) {
      out.stopped = true;
      return;
    }
    out.bytes += line.size();
    ++out.lines;
  };
  const auto header = [] { return std::string("the header"); };
  put({{"schema", kSnapshotRecordsSchema},
       {"version", kRecordsVersion},
       {"written_at_ns", image.taken_at_ns}},
      header, /*always=*/true);
  put({{"counters", snapshot_detail::counters_json(image.counters)}},
      [] { return std::string("the counters"); });
  put({{"ledger", snapshot_detail::ledger_json(image.ledger)}},
      [] { return std::string("the ledger"); });
  for (const auto& [name, hist] : image.retired) {
    put({{"retired", snapshot_detail::retired_json(name, hist)}},
        [&name] { return "retired step " + name; });
  }
  for (const RetiredJobImage& job : image.retired_jobs) {
    put({{"retired_job", snapshot_detail::retired_job_json(job)}},
        [&job] { return "retired job " + job.job + " of uid " + std::to_string(job.uid); });
  }
  for (const ProcessImage* p : in_turns_by_uid(image.processes)) {
    put({{"process", snapshot_detail::process_json(*p)}}, [p] { return describe(*p); });
  }
  put({{"end", {{"records", out.lines}, {"left_out", out.left_out}}}}, header, /*always=*/true);
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
    : limits_(limits), bounds_(image_bounds(limits)) {}

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
  const json doc = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return skip(where, "not JSON");
  if (line_ == 1) return header(doc, where);
  record(doc, where);
}

void SnapshotRecordReader::header(const json& doc, const std::string& where) {
  JsonReader reader;
  JsonObject h = reader.object(doc, "header");
  std::string schema;
  std::uint64_t version = 0;
  h.get_string("schema", schema, StringRule{1, 64});
  h.get_unsigned("version", version);
  h.get_unsigned("written_at_ns", image_.taken_at_ns);
  if (!h.finish()) return skip(where, error_text(reader));
  if (schema != kSnapshotRecordsSchema || version != kRecordsVersion) {
    // Not damage: a file of another format (a later build's). Reading part of it would be
    // guessing, so none of it is restored.
    foreign_ = "a " + schema + " file of version " + std::to_string(version) +
               ", not one this build reads";
    return;
  }
  header_ = true;
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
    if (ok) image_.counters = std::move(counters), counters_ = true;
  } else if (kind == "ledger") {
    if (ledger_) return skip(where, "the ledger appears twice");
    ledger::State state;
    ok = snapshot_detail::read_ledger(reader.object(body, kind), limits_, state);
    if (ok) image_.ledger = std::move(state), ledger_ = true;
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
  // The limits of live state bound what a restart brings back, per uid first: a uid
  // past its share loses its own records, not anyone else's.
  std::size_t& of_uid = per_uid_[p.peer.uid];
  if (of_uid >= limits_.max_processes_per_uid) {
    return skip(where, what + ": past limits.max_processes_per_uid (" +
                           std::to_string(limits_.max_processes_per_uid) + ")");
  }
  if (image_.processes.size() >= limits_.max_processes) {
    return skip(where, what + ": past limits.max_processes (" +
                           std::to_string(limits_.max_processes) + ")");
  }
  ++of_uid;
  keys_.insert(key);
  image_.processes.push_back(std::move(p));
  ++good_;
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
  if (lines != line_ - 1) {
    skip(where, "the end record counts " + std::to_string(lines) +
                    " lines before it, the file has " + std::to_string(line_ - 1));
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
  if (!end_lines_) {
    skip("line " + std::to_string(line_ + 1),
         "missing: the file ends before its end record (cut short: what followed is lost)");
  }
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
