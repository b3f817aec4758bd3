// steptraced's entry point: flags and config -> logging -> Collector + Server -> run.
// Start-up failures are one line on stderr: exit 2 for usage and configuration errors,
// 1 for runtime ones (socket in use, directory missing). Exceptions stop here.
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>

#include "daemon/serve/config.h"
#include "daemon/serve/server.h"
#include "daemon/state/charge.h"
#include "daemon/state/collector.h"

namespace {

void setup_logging(const std::string& level) {
  auto logger = spdlog::stderr_logger_mt("steptraced");
  // Under systemd the journal stamps time and unit itself.
  if (std::getenv("JOURNAL_STREAM") != nullptr) {
    logger->set_pattern("%l: %v");
  } else {
    logger->set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] %v");
  }
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(level));
  spdlog::flush_on(spdlog::level::trace);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace steptrace::daemon;
  try {
    const CommandLine command_line =
        parse_command_line(std::vector<std::string>(argv, argv + argc));
    if (!command_line.config) {
      std::fputs(command_line.output.c_str(), command_line.exit_code == 0 ? stdout : stderr);
      return command_line.exit_code;
    }
    const Config& config = *command_line.config;
    setup_logging(config.log_level);
    // Replies and other big blocks go back to the kernel when freed (charge.h); before the
    // Server starts any thread. Not glibc's allocator (a sanitizer's): nothing to set.
    heap::return_big_blocks_when_freed();
    // Peers that vanish mid-write must not kill the daemon.
    std::signal(SIGPIPE, SIG_IGN);

    Collector collector(config.limits, Environment::system(), config.flight_recorder);
    Server server(config, collector);
    if (auto error = server.start()) {
      std::fprintf(stderr, "steptraced: %s\n", error->c_str());
      return 1;
    }
    if (!server.run()) {
      std::fprintf(stderr, "steptraced: the final snapshot could not be written (see the log)\n");
      return 1;
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "steptraced: %s\n", e.what());
    return 1;
  }
}
