// Custom step names registered by the process (steptrace_register_step). Not on the hot
// path: guarded by a mutex. Ids are handed out densely from proto::kFirstCustomStep, so
// the hot path checks an id with one relaxed load of a copy of the count
// (g_custom_steps, client.h). The flusher sends every registration on each
// (re)connection, before any event using it.
#pragma once

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "proto/wire_format.h"

namespace steptrace::client {

inline constexpr std::uint32_t kInvalidStep = UINT32_MAX;

class StepRegistry {
 public:
  explicit StepRegistry(std::uint32_t limit = proto::kMaxCustomSteps) : limit_(limit) {}

  // The id of `name` (registered now or earlier); kInvalidStep when the name is not
  // 1..63 printable ASCII characters or the limit is reached.
  std::uint32_t register_step(std::string_view name);

  std::uint32_t count() const noexcept { return count_.load(std::memory_order_acquire); }
  // Name of the custom step with index i (< count()). Copies under the lock.
  std::string name(std::uint32_t index) const;

  std::mutex& mutex() { return mu_; }

 private:
  const std::uint32_t limit_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::uint32_t> ids_;
  std::vector<std::string> names_;
  std::atomic<std::uint32_t> count_{0};
};

}  // namespace steptrace::client
