// What a command, the HTTP scrape or the snapshot timer asks the RenderWorker
// (render_worker.h) to do: text rendered from a frozen view, possibly on another thread.
#pragma once

#include <functional>
#include <string>

#include "daemon/state/collector.h"

namespace steptrace::daemon {

using RenderJob = std::function<std::string(const CollectorView&)>;

}  // namespace steptrace::daemon
