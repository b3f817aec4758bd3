// Implementation of daemon/ledger_view.h (first cut; being fleshed out by its owner).
#include "daemon/ledger_view.h"

#include <nlohmann/json.hpp>

namespace steptrace::daemon {

struct LedgerView::State {};

LedgerView::LedgerView(const Limits& limits, DaemonCounters& counters)
    : limits_(limits), counters_(counters), state_(std::make_unique<State>()) {}
LedgerView::~LedgerView() = default;

void LedgerView::apply(const LedgerActor&, const proto::LedgerRecord&, std::uint64_t) {}
void LedgerView::attribute_span(const ProcessKey&, std::uint32_t, std::uint32_t, std::uint64_t,
                                std::uint64_t) {}
void LedgerView::check_holders(const std::function<bool(const ProcessKey&)>&) {}
void LedgerView::forget_process(const ProcessKey&) {}
nlohmann::json LedgerView::to_json(std::uint64_t) const {
  return nlohmann::json{{"gpus", nlohmann::json::array()}};
}
std::string LedgerView::to_text(std::uint64_t) const { return "ledger: empty\n"; }
void LedgerView::append_metrics(std::string&) const {}
nlohmann::json LedgerView::anomalies_json() const { return nlohmann::json::object(); }
nlohmann::json LedgerView::snapshot() const { return nlohmann::json::object(); }
std::error_code LedgerView::restore(const nlohmann::json&) { return {}; }

}  // namespace steptrace::daemon
