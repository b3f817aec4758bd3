#include "daemon/serve/gpu_sampler.h"

#include <unistd.h>

#include <chrono>
#include <map>
#include <utility>

#include <spdlog/spdlog.h>
#include <boost/asio/post.hpp>

#include "daemon/gpu/nvml.h"

namespace steptrace::daemon {

namespace {

// NVML reports host pids; /proc shows this pid namespace's.
bool pid_visible(std::uint32_t pid) {
  const std::string path = "/proc/" + std::to_string(pid);
  return ::access(path.c_str(), F_OK) == 0;
}

std::map<std::string, ledger::Device, std::less<>> to_devices(const gpu::GpuSample& sample,
                                                              std::uint64_t now_ns) {
  std::map<std::string, ledger::Device, std::less<>> out;
  for (const gpu::GpuDevice& d : sample.devices) {
    ledger::Device device;
    device.name = d.name;
    device.total_bytes = d.total_bytes;
    device.used_bytes = d.used_bytes;
    device.free_bytes = d.free_bytes;
    device.at_ns = now_ns;
    device.processes_known = d.processes_known;
    for (const gpu::GpuProcess& p : d.processes) {
      device.processes.push_back({p.pid, p.used_bytes, pid_visible(p.pid)});
    }
    out[d.uuid] = std::move(device);
  }
  return out;
}

std::uint64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::uint64_t>(ts.tv_sec) * 1'000'000'000ULL +
         static_cast<std::uint64_t>(ts.tv_nsec);
}

}  // namespace

GpuSampler::GpuSampler(boost::asio::io_context& io, Collector& collector, const NvmlConfig& config)
    : io_(io), collector_(collector), config_(config) {}

GpuSampler::~GpuSampler() { stop(); }

std::optional<std::string> GpuSampler::start() {
  if (config_.mode == NvmlMode::kOff) return std::nullopt;
  std::string error;
  nvml_ = gpu::Nvml::load(config_.library, error);
  if (!nvml_) {
    if (config_.mode == NvmlMode::kOn) return "nvml: on, but " + error;
    spdlog::info("NVML not used ({}); VRAM figures come from clients' samples only", error);
    return std::nullopt;
  }
  spdlog::info("NVML loaded from {}; sampling every {} ms (process list: {})", config_.library,
               config_.interval_ms,
               *nvml_->process_entry_point() ? nvml_->process_entry_point()
                                             : "nvmlDeviceGetComputeRunningProcesses");
  collector_.set_device_rules(config_.rules);
  thread_ = std::thread([this] { run(); });
  return std::nullopt;
}

void GpuSampler::stop() {
  alive_->store(false);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  nvml_.reset();
}

void GpuSampler::run() {
  const auto interval = std::chrono::milliseconds(config_.interval_ms);
  auto next = std::chrono::steady_clock::now();
  std::string last_error;
  for (;;) {
    gpu::GpuSample sample = nvml_->sample();
    const std::uint64_t now = monotonic_ns();
    auto devices = to_devices(sample, now);
    if (sample.error != last_error) {
      // Errors repeat every period (a device without permission): log each change once.
      if (!sample.error.empty()) spdlog::warn("NVML: {}", sample.error);
      last_error = sample.error;
    }
    next += interval;
    const auto after = std::chrono::steady_clock::now();
    if (after > next) {
      // Slower than the interval: the next sample starts now, not to catch up.
      ++slow_samples_;
      next = after;
    }
    boost::asio::post(io_, [this, alive = alive_, devices = std::move(devices),
                            error = sample.error, now, slow = slow_samples_.load()]() mutable {
      if (alive->load()) collector_.apply_devices(std::move(devices), std::move(error), now, slow);
    });
    std::unique_lock<std::mutex> lock(mutex_);
    if (wake_.wait_until(lock, next, [this] { return stop_; })) return;
  }
}

}  // namespace steptrace::daemon
