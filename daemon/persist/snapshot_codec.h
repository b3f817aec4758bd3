// The snapshot codec: the daemon's state as a "steptrace.snapshot/v1" JSON document and
// back, for the snapshot file (daemon/persist/snapshot.h).
//
// Data flow: the server renders encode_snapshot(view) from a CollectorView (on the render
// thread, or at shutdown), which writes the view's StateImage (daemon/state/state_image.h:
// what a snapshot keeps, as plain values), and saves it; at start it loads the file and
// calls restore_from_snapshot(collector, doc), which decodes the document with the strict
// reader (daemon/persist/json_reader.h) into a StateImage and hands that to
// Collector::adopt(). The state classes only hand their state over (CollectorView::image,
// LedgerView::state, Histogram::parts) and take a decoded one (Collector::adopt,
// LedgerView::adopt, Histogram::from_parts); the document's layout lives here, all of it
// (its keys are its own: a report's field or a wire name renamed changes no snapshot):
// the whole document in snapshot_codec.cpp, the ledger and histogram sections in
// snapshot_sections.cpp.
//
// The format is fixed: files earlier builds wrote restore, and encoding what was decoded
// gives the same bytes (tests/daemon/persist/snapshot_v1.json is such a file). A document
// is rejected whole, naming the first bad field as "path: reason"
// (`processes[0].steps[1].histogram.prom: must be an array of 23 elements`); unknown keys
// are errors.
#pragma once

#include <optional>
#include <string>
#include <system_error>

#include <nlohmann/json_fwd.hpp>

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

// The longest array a snapshot of live state under `limits` can hold (processes,
// reservations per GPU, GPUs, retired names, histogram buckets, steps of a process, open
// threads and spans of a process):
// load_snapshot() stops parsing at the first longer one.
std::size_t snapshot_max_array_elements(const Limits& limits);

// ---- sections (the snapshot's "ledger" and each "histogram"), on their own -------------
nlohmann::json encode_ledger(const LedgerView& ledger);
// Paths in `error` start at the section ("gpus[0].sample.free_bytes: ...").
std::optional<ledger::State> decode_ledger(const nlohmann::json& doc, const Limits& limits,
                                           std::string& error);
nlohmann::json encode_histogram(const Histogram& histogram);
std::optional<Histogram> decode_histogram(const nlohmann::json& doc, std::string& error);

}  // namespace steptrace::daemon
