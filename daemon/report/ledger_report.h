// Renderers of the VRAM ledger view (daemon/state/ledger_view.h): pure functions of its
// state, run on the render thread from a frozen CollectorView.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace steptrace::daemon {
struct CleanupOutcome;
namespace ledger {
struct State;
}  // namespace ledger

namespace report {

// {"gpus": [...]}: the `ledger --json` document of proto/PROTOCOL.md section 10.4.
nlohmann::json ledger_json(const ledger::State& state, std::uint64_t now_ns);
// The `ledger` text: per GPU, totals, reservations (LEAKED when the holder died), and
// per-process rows.
std::string ledger_text(const ledger::State& state, std::uint64_t now_ns);
// Appends the ledger's Prometheus families (HELP/TYPE lines included).
void append_ledger_metrics(const ledger::State& state, std::string& out);
// Anomaly counts by kind, for stats.
nlohmann::json ledger_anomalies_json(const ledger::State& state);
// The reply line (with its newline) to `ledger cleanup GPU ID` sent by `sender_pid`:
// "ok: ..." or "error: ..." saying why not.
std::string cleanup_reply(const CleanupOutcome& outcome, std::string_view gpu, std::uint64_t id,
                          std::int32_t sender_pid);

}  // namespace report
}  // namespace steptrace::daemon
