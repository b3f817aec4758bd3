// What a command, the HTTP scrape or the snapshot timer asks the RenderWorker
// (render_worker.h) to do: text rendered from a frozen view, possibly on another thread,
// and on which of the worker's two lanes.
#pragma once

#include <concepts>
#include <cstdint>
#include <functional>
#include <string>
#include <type_traits>
#include <utility>

#include "daemon/state/collector.h"

namespace steptrace::daemon {

enum class RenderLane : std::uint8_t {
  // Reports, the ledger, trace pieces, snapshots: as long as the table is big.
  kBulk,
  // stats, metrics and the HTTP scrape: small or bounded renders on a thread of their
  // own, so they never wait behind a tenant's reports.
  kFast,
};

class RenderJob {
 public:
  using Function = std::function<std::string(const CollectorView&)>;

  RenderJob() = default;
  template <typename F>
  requires(!std::same_as<std::remove_cvref_t<F>, RenderJob> &&
           std::is_invocable_r_v<std::string, F&, const CollectorView&>)
      RenderJob(F render,
                RenderLane lane = RenderLane::kBulk)  // NOLINT(google-explicit-constructor)
      : render_(std::move(render)), lane_(lane) {}

  std::string operator()(const CollectorView& view) const { return render_(view); }
  explicit operator bool() const { return static_cast<bool>(render_); }
  RenderLane lane() const { return lane_; }

 private:
  Function render_;
  RenderLane lane_ = RenderLane::kBulk;
};

}  // namespace steptrace::daemon
