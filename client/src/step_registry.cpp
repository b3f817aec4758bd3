#include "client/src/step_registry.h"

#include <algorithm>

#include "proto/codec.h"

namespace steptrace::client {

std::uint32_t StepRegistry::register_step(std::string_view name) {
  if (name.empty() || name.size() > proto::kMaxNameLength ||
      !std::all_of(name.begin(), name.end(), proto::is_printable)) {
    return kInvalidStep;
  }
  std::lock_guard lock(mu_);
  std::string key(name);
  if (auto it = ids_.find(key); it != ids_.end()) return it->second;
  if (names_.size() >= std::min(limit_, proto::kMaxCustomSteps)) return kInvalidStep;
  const auto id = proto::kFirstCustomStep + static_cast<std::uint32_t>(names_.size());
  names_.push_back(key);
  ids_.emplace(std::move(key), id);
  count_.store(static_cast<std::uint32_t>(names_.size()), std::memory_order_release);
  return id;
}

std::string StepRegistry::name(std::uint32_t index) const {
  std::lock_guard lock(mu_);
  return index < names_.size() ? names_[index] : std::string();
}

}  // namespace steptrace::client
