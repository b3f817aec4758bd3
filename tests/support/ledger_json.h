// Test support: finding things in the daemon's `ledger --json` reply (PROTOCOL.md,
// "ledger --json"). nullptr when absent.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace steptrace::testing {

// The GPU entry of `uuid`.
inline const nlohmann::json* find_gpu(const nlohmann::json& ledger, const std::string& uuid) {
  if (!ledger.contains("gpus")) return nullptr;
  for (const auto& g : ledger["gpus"]) {
    if (g["gpu"] == uuid) return &g;
  }
  return nullptr;
}

// A GPU's reservation `id`.
inline const nlohmann::json* find_reservation(const nlohmann::json& gpu, std::uint64_t id) {
  for (const auto& r : gpu["reservations"]) {
    if (r["id"] == id) return &r;
  }
  return nullptr;
}

// The GPU's row of per-process ledger activity (reserves, releases, cleanups, refused).
inline const nlohmann::json* find_row(const nlohmann::json& gpu, pid_t pid) {
  for (const auto& p : gpu["processes"]) {
    if (p["pid"] == pid) return &p;
  }
  return nullptr;
}

}  // namespace steptrace::testing
