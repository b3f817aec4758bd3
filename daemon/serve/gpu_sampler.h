// Samples the GPUs through NVML (daemon/gpu/nvml.h) on its own thread, never the io
// thread, and hands each sample to the Collector's ledger view on the io thread.
//
// Data flow: start() loads the library (config `nvml`: off, auto, on) -> a thread calls
// Nvml::sample() every nvml_interval_ms, checks each reported pid against /proc (a pid
// the daemon cannot see: exited, or another pid namespace) and posts the result to the
// io thread -> Collector::apply_devices() -> ledger::State::devices, which the ledger
// reports, `top` and metrics join with the reservations by UUID and pid
// (ledger::device_findings). A sample slower than the interval delays the next one (no
// backlog) and is counted.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <boost/asio/io_context.hpp>

#include "daemon/serve/config.h"
#include "daemon/state/collector.h"

namespace steptrace::daemon {

namespace gpu {
class Nvml;
}  // namespace gpu

class GpuSampler {
 public:
  GpuSampler(boost::asio::io_context& io, Collector& collector, const NvmlConfig& config);
  ~GpuSampler();  // stop()
  GpuSampler(const GpuSampler&) = delete;
  GpuSampler& operator=(const GpuSampler&) = delete;

  // Loads NVML and starts the thread. With `nvml: on` a library or init failure is an
  // error (the daemon does not start); with `auto` it is logged at info level and the
  // daemon runs without device figures; `off` does nothing.
  std::optional<std::string> start();
  void stop();  // joins the thread; no sample is applied after it
  bool running() const { return thread_.joinable(); }
  std::uint64_t slow_samples() const { return slow_samples_.load(); }

 private:
  void run();

  boost::asio::io_context& io_;
  Collector& collector_;
  NvmlConfig config_;
  std::unique_ptr<gpu::Nvml> nvml_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;  // guarded by mutex_
  std::shared_ptr<std::atomic<bool>> alive_ = std::make_shared<std::atomic<bool>>(true);
  std::atomic<std::uint64_t> slow_samples_{0};
};

}  // namespace steptrace::daemon
