// Every configured bound under "limits" in the config file, one row each: its key, the
// LimitKind its hits are counted under (the name in stats, metrics and snapshots comes
// from kLimitNames, state/types.h, and must be the key; the fixed LimitKinds, from
// kFirstFixedLimit on, have no row), the values the config accepts,
// and where the value lives (ServerLimits or the Collector's Limits, whose fields hold
// the defaults). read_limits() and config_to_json() (config.cpp) walk it;
// config/steptraced.json and config/README.md are checked against it by
// tests/daemon/serve/config_test.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string_view>
#include <type_traits>

#include "daemon/serve/config.h"
#include "daemon/state/types.h"
#include "proto/wire_format.h"

namespace steptrace::daemon {

struct LimitRow {
  std::string_view key;
  std::optional<LimitKind> kind;  // none: a bound whose excess is an error, not a hit
  std::uint64_t min = 0;
  std::uint64_t max = 0;
  std::uint64_t (*get)(const Config&) = nullptr;
  void (*set)(Config&, std::uint64_t) = nullptr;
};

namespace limit_table_detail {

template <auto kGroup, auto kField>
std::uint64_t get(const Config& c) {
  return static_cast<std::uint64_t>((c.*kGroup).*kField);
}
template <auto kGroup, auto kField>
void set(Config& c, std::uint64_t value) {
  auto& field = (c.*kGroup).*kField;
  field = static_cast<std::remove_reference_t<decltype(field)>>(value);
}
// A row of ServerLimits (the server's) or Limits (the Collector's).
template <auto kField>
constexpr LimitRow server(std::string_view key, std::optional<LimitKind> kind, std::uint64_t min,
                          std::uint64_t max) {
  return {key,
          kind,
          min,
          max,
          &get<&Config::server_limits, kField>,
          &set<&Config::server_limits, kField>};
}
template <auto kField>
constexpr LimitRow collector(std::string_view key, std::optional<LimitKind> kind, std::uint64_t min,
                             std::uint64_t max) {
  return {key, kind, min, max, &get<&Config::limits, kField>, &set<&Config::limits, kField>};
}

}  // namespace limit_table_detail

inline constexpr std::array<LimitRow, 29> kLimitTable = [] {
  using limit_table_detail::collector;
  using limit_table_detail::server;
  using K = LimitKind;
  constexpr std::uint64_t kMiB = std::uint64_t{1} << 20;
  return std::array<LimitRow, 29>{
      server<&ServerLimits::max_connections>("max_connections", K::kMaxConnections, 1, 65536),
      server<&ServerLimits::max_connections_per_uid>("max_connections_per_uid",
                                                     K::kMaxConnectionsPerUid, 1, 65536),
      // A frame must at least hold the largest fixed record (a LedgerRecord).
      server<&ServerLimits::max_frame_bytes>("max_frame_bytes", std::nullopt, 256,
                                             proto::kMaxFramePayload),
      server<&ServerLimits::max_line_bytes>("max_line_bytes", std::nullopt, 64, 1 << 20),
      // 0 refuses every ring: the clients send their events on the socket instead.
      server<&ServerLimits::max_rings_per_process>("max_rings_per_process", K::kMaxRingsPerProcess,
                                                   0, 65536),
      server<&ServerLimits::max_rings_per_uid>("max_rings_per_uid", K::kMaxRingsPerUid, 0,
                                               1'000'000),
      server<&ServerLimits::max_ring_bytes_per_process>(
          "max_ring_bytes_per_process", K::kMaxRingBytesPerProcess, 0, std::uint64_t{1} << 40),
      server<&ServerLimits::max_ring_bytes_per_uid>(
          "max_ring_bytes_per_uid", K::kMaxRingBytesPerUid, 0, std::uint64_t{1} << 44),
      server<&ServerLimits::max_rings>("max_rings", K::kMaxRings, 0, 1'000'000),
      // 0 refuses every `trace --for` (a plain `trace` still answers).
      server<&ServerLimits::max_pending_traces_per_uid>("max_pending_traces_per_uid",
                                                        K::kMaxPendingTracesPerUid, 0, 4096),
      server<&ServerLimits::max_pending_reply_bytes_per_uid>("max_pending_reply_bytes_per_uid",
                                                             K::kMaxPendingReplyBytesPerUid,
                                                             64 * 1024, std::uint64_t{1} << 40),
      collector<&Limits::max_processes>("max_processes", K::kMaxProcesses, 1, 1'000'000),
      collector<&Limits::max_exited_processes>("max_exited_processes", K::kMaxExitedProcesses, 0,
                                               1'000'000),
      collector<&Limits::max_custom_steps>("max_custom_steps", K::kMaxCustomSteps, 0,
                                           proto::kMaxCustomSteps),
      collector<&Limits::max_open_depth>("max_open_depth", K::kMaxOpenDepth, 1, 4096),
      collector<&Limits::max_threads_per_process>("max_threads_per_process",
                                                  K::kMaxThreadsPerProcess, 1, 65536),
      collector<&Limits::max_gpus>("max_gpus", K::kMaxGpus, 1, 4096),
      collector<&Limits::max_reservations_per_gpu>("max_reservations_per_gpu",
                                                   K::kMaxReservationsPerGpu, 1, 1'000'000),
      collector<&Limits::max_processes_per_uid>("max_processes_per_uid", K::kMaxProcessesPerUid, 1,
                                                1'000'000),
      collector<&Limits::max_jobs>("max_jobs", K::kMaxJobs, 1, 100'000),
      collector<&Limits::max_jobs_per_uid>("max_jobs_per_uid", K::kMaxJobsPerUid, 1, 100'000),
      collector<&Limits::max_process_state_bytes>(
          "max_process_state_bytes", K::kMaxProcessStateBytes, 65536, std::uint64_t{1} << 40),
      collector<&Limits::max_state_bytes>("max_state_bytes", K::kMaxStateBytes, kMiB,
                                          std::uint64_t{1} << 44),
      // The largest snapshot file written and read: records past it are left out (written)
      // or skipped (read), the uid with the most processes losing its last ones first.
      collector<&Limits::max_snapshot_bytes>("max_snapshot_bytes", std::nullopt, kMiB,
                                             std::uint64_t{1} << 40),
      collector<&Limits::max_gpus_per_uid>("max_gpus_per_uid", K::kMaxGpusPerUid, 1, 4096),
      collector<&Limits::max_reservations_per_uid>("max_reservations_per_uid",
                                                   K::kMaxReservationsPerUid, 1, 1'000'000'000),
      // 1 us .. 2^63 ns (292 years: no bound in practice, the sums saturating).
      collector<&Limits::max_span_ns>("max_span_ns", K::kMaxSpanNs, 1'000, std::uint64_t{1} << 63),
      collector<&Limits::max_ledger_rows_per_uid>("max_ledger_rows_per_uid",
                                                  K::kMaxLedgerRowsPerUid, 1, 1'000'000),
      // Up to a year; a row of a live process never ages out.
      collector<&Limits::max_ledger_row_age_s>("max_ledger_row_age_s", std::nullopt, 1, 31'536'000),
  };
}();

// Each counted limit's key is its name in kLimitNames, each configured LimitKind has its
// row, and a fixed one (kFirstFixedLimit on) none.
consteval bool limit_table_names_match() {
  std::array<int, kLimitNames.size()> rows{};
  for (const LimitRow& row : kLimitTable) {
    if (!row.kind) continue;
    if (row.key != limit_name(*row.kind)) return false;
    ++rows[static_cast<std::size_t>(*row.kind)];
  }
  for (std::size_t kind = 0; kind < rows.size(); ++kind) {
    const bool fixed = kind >= static_cast<std::size_t>(kFirstFixedLimit);
    if (rows[kind] != (fixed ? 0 : 1)) return false;
  }
  return true;
}
static_assert(limit_table_names_match(),
              "a configured LimitKind without its config row, a fixed one with one, or misnamed");

}  // namespace steptrace::daemon
