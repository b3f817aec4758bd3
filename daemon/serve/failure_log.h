// Logging of a failure that recurs on a timer (a snapshot write every second) without
// flooding the journal: the first failure of a run is one error line with its reason;
// while it keeps failing, at most one line per kInterval saying how many failed since
// and the latest reason; the first success after failures one info line. The Server
// (server.cpp) owns one for its snapshots and logs the lines it returns.
//
// RateLimitedLog (client_stream.h) is for many kinds of client misbehaviour, each in
// bursts; this is one condition with a start and an end, which the operator needs both of.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace steptrace::daemon {

class FailureLog {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::seconds kInterval{60};

  enum class Level { kError, kInfo };
  struct Line {
    Level level;
    std::string text;
  };

  // `what` names the thing that fails, in plural ("snapshots").
  explicit FailureLog(std::string what) : what_(std::move(what)) {}

  // A failure at `now` (`unix_s`: the wall clock, for the lines): the line to log, or
  // nothing while the last line is younger than kInterval.
  std::optional<Line> failed(const std::string& reason, Clock::time_point now, std::int64_t unix_s);
  // A success: one line after a run of failures, else nothing.
  std::optional<Line> succeeded();

  bool failing() const { return failures_ > 0; }

 private:
  std::string what_;
  std::uint64_t failures_ = 0;   // in the current run
  std::int64_t since_unix_ = 0;  // the run's first failure
  Clock::time_point last_line_;  // when the last line about this run was logged
};

}  // namespace steptrace::daemon
