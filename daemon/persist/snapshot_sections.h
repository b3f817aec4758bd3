// The snapshot codec's sections that stand on their own (snapshot_sections.cpp): the
// "ledger" section and each "histogram", the pieces of the strict reader that the
// whole document (snapshot_codec.cpp) shares with them, and the records that the
// version-2 file (snapshot_records.cpp) shares with the whole document. Private to
// daemon/persist/; the codec's API is snapshot_codec.h.
#pragma once

#include <functional>
#include <map>
#include <string>

#include <nlohmann/json_fwd.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/state/histogram.h"
#include "daemon/state/ledger_state.h"
#include "daemon/state/state_image.h"
#include "daemon/state/types.h"
#include "proto/wire_format.h"

namespace steptrace::daemon::snapshot_detail {

constexpr StringRule kNameRule{1, proto::kMaxNameLength};  // step names, GPU UUIDs

// Each reader returns false with the reader's error set.
// "pid" (1..2^31-1) and "start_time" of `o`.
bool read_process_key(JsonObject& o, ProcessKey& out);
bool read_histogram(JsonObject h, Histogram& out);
nlohmann::json ledger_json(const ledger::State& state);
bool read_ledger(JsonObject l, const Limits& limits, ledger::State& out);

// The reader's first error as "path: reason".
std::string error_text(const JsonReader& reader);

// The records of the whole document (snapshot_codec.cpp), each also a record of its own in a
// version-2 file (snapshot_records.cpp).
nlohmann::json process_json(const ProcessImage& p);
nlohmann::json counters_json(const DaemonCounters& c);
nlohmann::json retired_json(const std::string& step, const Histogram& hist);
nlohmann::json retired_job_json(const RetiredJobImage& job);
bool read_process(JsonObject p, ProcessImage& out);
bool read_counters(JsonObject c, DaemonCounters& out);
// A retired step's histogram into `out`, its name not already there.
bool read_retired_entry(JsonObject entry, std::map<std::string, Histogram, std::less<>>& out);
bool read_retired_job(JsonObject j, const ImageBounds& bounds, RetiredJobImage& out);

}  // namespace steptrace::daemon::snapshot_detail
