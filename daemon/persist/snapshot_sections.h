// The snapshot codec's sections that stand on their own (snapshot_sections.cpp): the
// "ledger" section and each "histogram", and the pieces of the strict reader that the
// whole document (snapshot_codec.cpp) shares with them. Private to daemon/persist/; the
// codec's API is snapshot_codec.h.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

#include "daemon/persist/json_reader.h"
#include "daemon/state/histogram.h"
#include "daemon/state/ledger_state.h"
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

}  // namespace steptrace::daemon::snapshot_detail
