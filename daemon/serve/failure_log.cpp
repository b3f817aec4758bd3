#include "daemon/serve/failure_log.h"

#include "daemon/report/report_format.h"

namespace steptrace::daemon {

std::optional<FailureLog::Line> FailureLog::failed(const std::string& reason, Clock::time_point now,
                                                   std::int64_t unix_s) {
  if (failures_++ == 0) {
    since_unix_ = unix_s;
    last_line_ = now;
    return Line{Level::kError, reason};
  }
  if (now - last_line_ < kInterval) return std::nullopt;
  last_line_ = now;
  return Line{Level::kError, what_ + " still failing: " + std::to_string(failures_) +
                                 " failures since " + report::format_unix_time(since_unix_) +
                                 "; latest: " + reason};
}

std::optional<FailureLog::Line> FailureLog::succeeded() {
  if (failures_ == 0) return std::nullopt;
  Line line{Level::kInfo, what_ + " written again after " + std::to_string(failures_) +
                              (failures_ == 1 ? " failure" : " failures") + " since " +
                              report::format_unix_time(since_unix_)};
  failures_ = 0;
  return line;
}

}  // namespace steptrace::daemon
