// A process's `report --json` entry once its connection has closed: the daemon's last
// pass over its rings is done, so its counts are final. For kill tests that compare what
// a trainer sent with what the daemon counted and dropped.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/support/daemon_process.h"

namespace steptrace::testing {

// `line`'s reply parsed as JSON (30 s to answer), or nothing.
inline std::optional<nlohmann::json> json_command(const std::string& socket,
                                                  const std::string& line) {
  const auto reply = command(socket, line, 30000);
  if (!reply) return std::nullopt;
  auto doc = nlohmann::json::parse(*reply, nullptr, false);
  if (doc.is_discarded()) return std::nullopt;
  return doc;
}

// The report entry of `pid` once its connection has closed, polled for at most
// `timeout_s`; a failure and the last entry seen (or null) when that does not happen.
inline nlohmann::json settled_process(const std::string& socket, long long pid, int timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  nlohmann::json last;
  for (;;) {
    if (const auto doc = json_command(socket, "report --json --pid " + std::to_string(pid))) {
      for (const auto& p : doc->at("processes")) {
        if (p.at("pid").get<long long>() == pid) last = p;
      }
    }
    if (last.is_object() && last.at("connections").get<long long>() == 0) return last;
    if (std::chrono::steady_clock::now() > deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ADD_FAILURE() << "pid " << pid << ": its connection was not closed within " << timeout_s
                << " s: " << (last.is_null() ? std::string("not in the report") : last.dump());
  return last;
}

}  // namespace steptrace::testing
