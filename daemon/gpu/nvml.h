// Real VRAM from NVML, loaded at run time: no build or package dependency on NVIDIA.
//
// Data flow: Nvml::load() dlopen()s libnvidia-ml.so.1, resolves the entry points below
// with dlsym() and calls nvmlInit_v2. The sampler thread then calls sample() on a period:
// nvmlDeviceGetCount_v2, and for every index nvmlDeviceGetHandleByIndex_v2,
// nvmlDeviceGetUUID, nvmlDeviceGetName, nvmlDeviceGetMemoryInfo (nvmlMemory_t: total,
// free, used) and the compute process list. The result is plain data (GpuSample), joined
// with the ledger by the caller on uuid and pid. ~Nvml calls nvmlShutdown and dlclose.
//
// Process list entry points and the record each one fills (declarations follow the
// published nvml.h of CUDA 12.6.2, NVML API version 12, nvML_DEV 12.6.77; the history
// back to CUDA 11.5 was checked; our own declarations live in nvml.cpp):
//   nvmlDeviceGetComputeRunningProcesses_v3  nvmlProcessInfo_t (== nvmlProcessInfo_v2_t)
//   nvmlDeviceGetComputeRunningProcesses_v2  nvmlProcessInfo_v2_t: pid, usedGpuMemory,
//                                            gpuInstanceId, computeInstanceId (24 bytes)
//   nvmlDeviceGetComputeRunningProcesses     nvmlProcessInfo_v1_t: pid, usedGpuMemory (16)
// The first one the library exports is used, in that order. One exception: the CUDA
// 12.2.0/12.2.1 headers (R535 drivers before nvmlDeviceGetRunningProcessDetailList
// existed) gave _v3 a 32-byte record with a trailing usedGpuCcProtectedMemory. A library
// that exports nvmlDeviceGetConfComputeMemSizeInfo but not
// nvmlDeviceGetRunningProcessDetailList is taken to be one of those, and read with a
// 32-byte stride (the same test nvitop uses). Whatever the stride, the buffer holds
// 32 bytes per entry, so a library writing bigger records than we expect cannot overrun it.
// In every version pid is at offset 0 and usedGpuMemory at offset 8.
//
// Thread use: one thread calls sample(); there is no locking inside.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace steptrace::daemon::gpu {

struct GpuProcess {
  std::uint32_t pid = 0;
  // nullopt: NVML_VALUE_NOT_AVAILABLE (no permission to see it, MIG, WDDM...)
  std::optional<std::uint64_t> used_bytes;
};

struct GpuDevice {
  std::string uuid;  // "GPU-..." as nvmlDeviceGetUUID gives it (same string clients send)
  std::string name;
  std::uint64_t total_bytes = 0, used_bytes = 0, free_bytes = 0;
  bool processes_known = false;       // the process list call succeeded
  std::vector<GpuProcess> processes;  // compute processes
};

struct GpuSample {
  std::vector<GpuDevice> devices;
  // Per-sample failures, "; "-joined, empty when none: which device ("GPU <index>" and its
  // uuid when known), the call that failed and nvmlErrorString's text. A device whose
  // handle, uuid, name or memory call failed, or whose process call said GPU_IS_LOST, is
  // left out of `devices`; one whose process call failed otherwise (NOT_SUPPORTED,
  // NO_PERMISSION, too many processes) stays, with processes_known false.
  std::string error;
};

class Nvml {
 public:
  static constexpr const char* kDefaultPath = "libnvidia-ml.so.1";
  static constexpr std::uint32_t kInitialProcessCapacity = 32;  // entries, first buffer
  static constexpr std::uint32_t kMaxProcesses = 4096;          // entries, largest buffer
  static constexpr int kMaxProcessAttempts = 6;  // calls per device per sample, at most

  // dlopen(path, RTLD_NOW | RTLD_LOCAL), resolve the symbols, nvmlInit_v2. On failure:
  // nullptr, and `error` says which step failed ("cannot load <path>: <dlerror>",
  // "<path> lacks <symbol>", "nvmlInit_v2 failed: <nvmlErrorString> (<code>)").
  static std::unique_ptr<Nvml> load(const std::string& path, std::string& error);
  ~Nvml();  // nvmlShutdown, dlclose
  Nvml(const Nvml&) = delete;
  Nvml& operator=(const Nvml&) = delete;

  // Every device: uuid, name, memory, compute processes (see GpuSample::error for what a
  // failure does). The process buffer grows on NVML_ERROR_INSUFFICIENT_SIZE, up to
  // kMaxProcesses entries and kMaxProcessAttempts calls, and keeps its size for the next
  // sample.
  GpuSample sample();

  // Which process entry point was resolved: "nvmlDeviceGetComputeRunningProcesses_v3",
  // "nvmlDeviceGetComputeRunningProcesses_v2", or "" for the unversioned (v1) one.
  const char* process_entry_point() const;
  // The record stride read from it: 24 (v3, v2), 32 (v3 of a CUDA 12.2.0/12.2.1-era
  // driver, see above) or 16 (v1).
  std::size_t process_record_size() const;

 private:
  struct Impl;
  explicit Nvml(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace steptrace::daemon::gpu
