// Nvml: libnvidia-ml.so.1 through dlopen/dlsym, sampled on demand (see nvml.h for the
// entry points and the record versions). The NVML types below are our own declarations,
// written from the published nvml.h of CUDA 12.6.2 (NVML API version 12); no NVIDIA
// header is used.
#include "daemon/gpu/nvml.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <string>
#include <utility>

namespace steptrace::daemon::gpu {
namespace {

// nvmlReturn_t: a C enum, int-sized. The codes sample() tells apart.
using NvmlReturn = int;
constexpr NvmlReturn kNvmlSuccess = 0;           // NVML_SUCCESS
constexpr NvmlReturn kNvmlInsufficientSize = 7;  // NVML_ERROR_INSUFFICIENT_SIZE
constexpr NvmlReturn kNvmlGpuIsLost = 15;        // NVML_ERROR_GPU_IS_LOST

// NVML_VALUE_NOT_AVAILABLE is (-1): all ones in an unsigned long long field.
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;
// NVML_DEVICE_UUID_V2_BUFFER_SIZE and NVML_DEVICE_NAME_V2_BUFFER_SIZE: the header
// guarantees either string fits, NUL included.
constexpr unsigned int kUuidBufferSize = 96;
constexpr unsigned int kNameBufferSize = 96;

using NvmlDevice = void*;  // nvmlDevice_t: a pointer to an opaque struct

// nvmlMemory_t (the v1 memory record): bytes.
struct NvmlMemory {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
};
static_assert(sizeof(NvmlMemory) == 24);

// nvmlProcessInfo_v1_t: what the unversioned nvmlDeviceGetComputeRunningProcesses fills.
struct NvmlProcessInfoV1 {
  unsigned int pid;
  unsigned long long used_gpu_memory;
};
// nvmlProcessInfo_v2_t (== nvmlProcessInfo_t since CUDA 12.2.2): what _v2 and _v3 fill.
struct NvmlProcessInfoV2 {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;      // 0xFFFFFFFF without MIG
  unsigned int compute_instance_id;  // 0xFFFFFFFF without MIG
};
// nvmlProcessInfo_t as the CUDA 12.2.0 and 12.2.1 headers had it, what _v3 of those
// drivers fills: v2 plus the confidential-computing protected memory.
struct NvmlProcessInfoCc {
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
  unsigned long long used_gpu_cc_protected_memory;
};
static_assert(sizeof(NvmlProcessInfoV1) == 16 && sizeof(NvmlProcessInfoV2) == 24 &&
              sizeof(NvmlProcessInfoCc) == 32);
// Every version starts alike, so one decoder reads them all, at the version's stride.
constexpr std::size_t kPidOffset = offsetof(NvmlProcessInfoV1, pid);
constexpr std::size_t kUsedOffset = offsetof(NvmlProcessInfoV1, used_gpu_memory);
static_assert(kPidOffset == offsetof(NvmlProcessInfoV2, pid) &&
              kPidOffset == offsetof(NvmlProcessInfoCc, pid));
static_assert(kUsedOffset == 8 && kUsedOffset == offsetof(NvmlProcessInfoV2, used_gpu_memory) &&
              kUsedOffset == offsetof(NvmlProcessInfoCc, used_gpu_memory));
// The buffer holds this much per entry whatever the stride read.
constexpr std::size_t kMaxRecordSize = sizeof(NvmlProcessInfoCc);

using InitFn = NvmlReturn (*)();
using ShutdownFn = NvmlReturn (*)();
using ErrorStringFn = const char* (*)(NvmlReturn);
using GetCountFn = NvmlReturn (*)(unsigned int*);
using GetHandleByIndexFn = NvmlReturn (*)(unsigned int, NvmlDevice*);
using GetStringFn = NvmlReturn (*)(NvmlDevice, char*, unsigned int);
using GetMemoryInfoFn = NvmlReturn (*)(NvmlDevice, NvmlMemory*);
// The three entry points differ only in the record type infos points to.
using GetProcessesFn = NvmlReturn (*)(NvmlDevice, unsigned int*, void*);

constexpr const char* kProcessesV3 = "nvmlDeviceGetComputeRunningProcesses_v3";
constexpr const char* kProcessesV2 = "nvmlDeviceGetComputeRunningProcesses_v2";
constexpr const char* kProcessesV1 = "nvmlDeviceGetComputeRunningProcesses";

template <typename Fn>
bool resolve(void* library, const char* name, Fn& out) {
  void* symbol = ::dlsym(library, name);
  if (symbol == nullptr) return false;
  out = reinterpret_cast<Fn>(symbol);
  return true;
}

void append_error(std::string& error, const std::string& what) {
  if (!error.empty()) error += "; ";
  error += what;
}

}  // namespace

struct Nvml::Impl {
  void* library = nullptr;
  InitFn init = nullptr;
  ShutdownFn shutdown = nullptr;
  ErrorStringFn error_string = nullptr;
  GetCountFn get_count = nullptr;
  GetHandleByIndexFn get_handle_by_index = nullptr;
  GetStringFn get_uuid = nullptr;
  GetStringFn get_name = nullptr;
  GetMemoryInfoFn get_memory_info = nullptr;
  GetProcessesFn get_processes = nullptr;
  const char* process_call = kProcessesV1;  // the resolved entry point's full name
  std::size_t process_record_size = sizeof(NvmlProcessInfoV1);
  // Entries the process buffer is offered: grows, never shrinks.
  std::uint32_t process_capacity = kInitialProcessCapacity;
  std::vector<std::uint64_t> process_buffer;  // 8-aligned, kMaxRecordSize bytes an entry

  // "<nvmlErrorString's text> (<code>)".
  std::string describe(NvmlReturn rc) const {
    const char* text = error_string != nullptr ? error_string(rc) : nullptr;
    return std::string(text != nullptr ? text : "unknown NVML error") + " (" + std::to_string(rc) +
           ")";
  }
  std::string call_failed(const char* call, NvmlReturn rc) const {
    return std::string(call) + " failed: " + describe(rc);
  }

  // The compute processes on `device` into `out`: "" on success, else what failed, with
  // `lost` set when NVML said the GPU is lost.
  std::string read_processes(NvmlDevice device, std::vector<GpuProcess>& out, bool& lost);
};

std::string Nvml::Impl::read_processes(NvmlDevice device, std::vector<GpuProcess>& out,
                                       bool& lost) {
  lost = false;
  for (int attempt = 0; attempt < kMaxProcessAttempts; ++attempt) {
    const std::uint32_t capacity = process_capacity;
    const std::size_t words = (std::size_t{capacity} * kMaxRecordSize) / sizeof(std::uint64_t);
    if (process_buffer.size() < words) process_buffer.resize(words);
    unsigned int count = capacity;
    const NvmlReturn rc = get_processes(device, &count, process_buffer.data());
    if (rc == kNvmlSuccess) {
      // More than offered cannot have been written; never read past what was offered.
      count = std::min<unsigned int>(count, capacity);
      const auto* bytes = reinterpret_cast<const unsigned char*>(process_buffer.data());
      out.reserve(count);
      for (unsigned int i = 0; i < count; ++i) {
        const unsigned char* record = bytes + std::size_t{i} * process_record_size;
        unsigned int pid = 0;
        unsigned long long used = 0;
        std::memcpy(&pid, record + kPidOffset, sizeof pid);
        std::memcpy(&used, record + kUsedOffset, sizeof used);
        GpuProcess process;
        process.pid = pid;
        if (used != kNvmlValueNotAvailable) process.used_bytes = used;
        out.push_back(process);
      }
      return {};
    }
    if (rc != kNvmlInsufficientSize) {
      lost = rc == kNvmlGpuIsLost;
      return call_failed(process_call, rc);
    }
    // `count` now says how many entries NVML needs; more may start before the next call.
    if (capacity >= kMaxProcesses || count > kMaxProcesses) {
      return std::string(process_call) + ": " + std::to_string(count) +
             " compute processes, more than the " + std::to_string(kMaxProcesses) + " read";
    }
    const std::uint64_t wanted =
        std::max<std::uint64_t>(std::uint64_t{count} + count / 4 + 8, std::uint64_t{capacity} * 2);
    process_capacity = static_cast<std::uint32_t>(std::min<std::uint64_t>(wanted, kMaxProcesses));
  }
  return std::string(process_call) + ": the process list outgrew the buffer " +
         std::to_string(kMaxProcessAttempts) + " times (last " + std::to_string(process_capacity) +
         " entries)";
}

Nvml::Nvml(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Nvml::~Nvml() {
  if (impl_ == nullptr || impl_->library == nullptr) return;
  impl_->shutdown();
  ::dlclose(impl_->library);
}

std::unique_ptr<Nvml> Nvml::load(const std::string& path, std::string& error) {
  error.clear();
  ::dlerror();  // clear a stale message
  void* library = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* why = ::dlerror();
    error = "cannot load " + path + ": " + (why != nullptr ? why : "dlopen failed");
    return nullptr;
  }
  auto impl = std::make_unique<Impl>();
  impl->library = library;
  const char* missing = nullptr;
  auto need = [&](const char* name, auto& fn) {
    if (missing == nullptr && !resolve(library, name, fn)) missing = name;
  };
  need("nvmlInit_v2", impl->init);
  need("nvmlShutdown", impl->shutdown);
  need("nvmlErrorString", impl->error_string);
  need("nvmlDeviceGetCount_v2", impl->get_count);
  need("nvmlDeviceGetHandleByIndex_v2", impl->get_handle_by_index);
  need("nvmlDeviceGetUUID", impl->get_uuid);
  need("nvmlDeviceGetName", impl->get_name);
  need("nvmlDeviceGetMemoryInfo", impl->get_memory_info);
  if (missing == nullptr) {
    if (resolve(library, kProcessesV3, impl->get_processes)) {
      impl->process_call = kProcessesV3;
      // A CUDA 12.2.0/12.2.1-era driver: confidential computing already, the process
      // detail list not yet; its _v3 fills the 32-byte record (see nvml.h).
      const bool cc_era = ::dlsym(library, "nvmlDeviceGetConfComputeMemSizeInfo") != nullptr &&
                          ::dlsym(library, "nvmlDeviceGetRunningProcessDetailList") == nullptr;
      impl->process_record_size = cc_era ? sizeof(NvmlProcessInfoCc) : sizeof(NvmlProcessInfoV2);
    } else if (resolve(library, kProcessesV2, impl->get_processes)) {
      impl->process_call = kProcessesV2;
      impl->process_record_size = sizeof(NvmlProcessInfoV2);
    } else if (resolve(library, kProcessesV1, impl->get_processes)) {
      impl->process_call = kProcessesV1;
      impl->process_record_size = sizeof(NvmlProcessInfoV1);
    } else {
      missing = kProcessesV1;
    }
  }
  if (missing != nullptr) {
    error = path + " lacks " + missing + " (not NVML, or an NVML too old)";
    ::dlclose(library);
    return nullptr;
  }
  if (const NvmlReturn rc = impl->init(); rc != kNvmlSuccess) {
    error = impl->call_failed("nvmlInit_v2", rc);
    ::dlclose(library);
    return nullptr;
  }
  return std::unique_ptr<Nvml>(new Nvml(std::move(impl)));
}

GpuSample Nvml::sample() {
  Impl& nvml = *impl_;
  GpuSample sample;
  unsigned int count = 0;
  if (const NvmlReturn rc = nvml.get_count(&count); rc != kNvmlSuccess) {
    append_error(sample.error, nvml.call_failed("nvmlDeviceGetCount_v2", rc));
    return sample;
  }
  sample.devices.reserve(std::min(count, 64u));  // a library gone wrong may say anything
  for (unsigned int index = 0; index < count; ++index) {
    std::string where = "GPU " + std::to_string(index);
    auto failed = [&](const char* call, NvmlReturn rc) {
      append_error(sample.error, where + ": " + nvml.call_failed(call, rc));
    };
    NvmlDevice handle = nullptr;
    if (const NvmlReturn rc = nvml.get_handle_by_index(index, &handle); rc != kNvmlSuccess) {
      failed("nvmlDeviceGetHandleByIndex_v2", rc);
      continue;
    }
    GpuDevice device;
    char text[std::max(kUuidBufferSize, kNameBufferSize)] = {};
    if (const NvmlReturn rc = nvml.get_uuid(handle, text, kUuidBufferSize); rc != kNvmlSuccess) {
      failed("nvmlDeviceGetUUID", rc);
      continue;
    }
    device.uuid.assign(text, ::strnlen(text, kUuidBufferSize));
    where += " (" + device.uuid + ")";
    std::memset(text, 0, sizeof text);
    if (const NvmlReturn rc = nvml.get_name(handle, text, kNameBufferSize); rc != kNvmlSuccess) {
      failed("nvmlDeviceGetName", rc);
      continue;
    }
    device.name.assign(text, ::strnlen(text, kNameBufferSize));
    NvmlMemory memory{};
    if (const NvmlReturn rc = nvml.get_memory_info(handle, &memory); rc != kNvmlSuccess) {
      failed("nvmlDeviceGetMemoryInfo", rc);
      continue;
    }
    device.total_bytes = memory.total;
    device.used_bytes = memory.used;
    device.free_bytes = memory.free;
    bool lost = false;
    if (std::string why = nvml.read_processes(handle, device.processes, lost); !why.empty()) {
      append_error(sample.error, where + ": " + why);
      if (lost) continue;
      device.processes.clear();
    } else {
      device.processes_known = true;
    }
    sample.devices.push_back(std::move(device));
  }
  return sample;
}

const char* Nvml::process_entry_point() const {
  return std::strcmp(impl_->process_call, kProcessesV1) == 0 ? "" : impl_->process_call;
}

std::size_t Nvml::process_record_size() const { return impl_->process_record_size; }

}  // namespace steptrace::daemon::gpu
