// daemon/gpu/nvml.cpp against the scripted fake libnvidia-ml.so.1 (fake_nvml.c; its
// header comment describes the script). Four builds of the fake stand for four driver
// generations: FAKE_NVML_V3, FAKE_NVML_V3CC, FAKE_NVML_V2 and FAKE_NVML_V1 are their paths.
#include <dlfcn.h>
#include <stdlib.h>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "daemon/gpu/nvml.h"
#include "tests/support/daemon_process.h"

namespace {

using steptrace::daemon::gpu::GpuDevice;
using steptrace::daemon::gpu::GpuProcess;
using steptrace::daemon::gpu::GpuSample;
using steptrace::daemon::gpu::Nvml;
using ::testing::HasSubstr;

constexpr std::uint64_t kGiB = 1024ULL * 1024 * 1024;
constexpr std::uint64_t kMiB = 1024ULL * 1024;

// The fake's script file, named to it by $FAKE_NVML_SCRIPT for the test's lifetime.
class Script {
 public:
  Script() : path_(dir_.file("nvml.script")) { ::setenv("FAKE_NVML_SCRIPT", path_.c_str(), 1); }
  ~Script() { ::unsetenv("FAKE_NVML_SCRIPT"); }
  Script(const Script&) = delete;
  Script& operator=(const Script&) = delete;

  void write(const std::string& text) const {
    std::ofstream out(path_, std::ios::trunc);
    out << text;
    out.close();
    ASSERT_TRUE(out.good()) << path_;
  }

 private:
  steptrace::testing::TempDir dir_;
  std::string path_;
};

// (pid, used bytes) pairs, the way tests spell what a device should list.
using Expected = std::vector<std::pair<std::uint32_t, std::optional<std::uint64_t>>>;

Expected listed(const GpuDevice& device) {
  Expected out;
  for (const GpuProcess& process : device.processes)
    out.emplace_back(process.pid, process.used_bytes);
  return out;
}

const GpuDevice* find_device(const GpuSample& sample, const std::string& uuid) {
  for (const GpuDevice& device : sample.devices) {
    if (device.uuid == uuid) return &device;
  }
  return nullptr;
}

std::unique_ptr<Nvml> load(const char* path) {
  std::string error;
  auto nvml = Nvml::load(path, error);
  EXPECT_NE(nvml, nullptr) << error;
  EXPECT_EQ(error, "");
  return nvml;
}

constexpr const char* kUuidA = "GPU-aaaaaaaa-1111-2222-3333-444444444444";
constexpr const char* kUuidB = "GPU-bbbbbbbb-1111-2222-3333-444444444444";
constexpr const char* kUuidC = "GPU-cccccccc-1111-2222-3333-444444444444";

std::string gpu_line(const char* uuid, std::uint64_t total, std::uint64_t used,
                     const char* name = "Fake GPU") {
  return std::string("gpu ") + uuid + " total " + std::to_string(total) + " used " +
         std::to_string(used) + " name " + name + "\n";
}

// ---- loading ---------------------------------------------------------------------------

TEST(NvmlLoad, MissingLibraryIsNullWithAMessageNamingThePath) {
  const std::string path = "/nonexistent/steptrace/libnvidia-ml.so.1";
  std::string error;
  EXPECT_EQ(Nvml::load(path, error), nullptr);
  EXPECT_THAT(error, HasSubstr("cannot load " + path + ": "));
}

TEST(NvmlLoad, LibraryThatIsNotNvmlNamesTheMissingSymbol) {
  std::string error;
  EXPECT_EQ(Nvml::load("libm.so.6", error), nullptr);
  EXPECT_THAT(error, HasSubstr("libm.so.6 lacks nvmlInit_v2"));
}

TEST(NvmlLoad, InitFailureNamesNvmlInitAndTheReason) {
  Script script;
  script.write("init_fail 9\n" + gpu_line(kUuidA, 16 * kGiB, 0));
  std::string error;
  EXPECT_EQ(Nvml::load(FAKE_NVML_V3, error), nullptr);
  EXPECT_EQ(error, "nvmlInit_v2 failed: Driver Not Loaded (9)");
}

TEST(NvmlLoad, DestructorShutsNvmlDown) {
  Script script;
  script.write(gpu_line(kUuidA, 16 * kGiB, 0));
  // Our own reference to the same library: it stays loaded after ~Nvml's dlclose, and its
  // nvmlDeviceGetCount_v2 tells whether NVML is still initialized.
  void* library = ::dlopen(FAKE_NVML_V3, RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(library, nullptr) << ::dlerror();
  using GetCountFn = int (*)(unsigned int*);
  const auto get_count = reinterpret_cast<GetCountFn>(::dlsym(library, "nvmlDeviceGetCount_v2"));
  ASSERT_NE(get_count, nullptr);
  unsigned int count = 0;
  EXPECT_EQ(get_count(&count), 1);  // NVML_ERROR_UNINITIALIZED: nothing loaded it yet
  {
    auto nvml = load(FAKE_NVML_V3);
    ASSERT_NE(nvml, nullptr);
    EXPECT_EQ(get_count(&count), 0);
    EXPECT_EQ(count, 1u);
  }
  EXPECT_EQ(get_count(&count), 1);  // shut down again
  ::dlclose(library);
}

// ---- every driver generation ------------------------------------------------------------

struct Variant {
  const char* label;
  const char* path;
  const char* entry_point;  // what process_entry_point() should say
  std::size_t record_size;  // what process_record_size() should say
};
// gtest finds it by this name.
void PrintTo(const Variant& variant, std::ostream* out) {  // NOLINT(readability-identifier-naming)
  *out << variant.label;
}

class NvmlVariantTest : public ::testing::TestWithParam<Variant> {
 protected:
  Script script_;
};

TEST_P(NvmlVariantTest, DevicesMemoryAndProcessesMatchTheScript) {
  script_.write(gpu_line(kUuidA, 80 * kGiB, 6 * kGiB, "NVIDIA A100-SXM4-80GB") +
                "proc 1234 4294967296  # 4 GiB: needs the 64 bits\n"
                "proc 5678 536870912\n"
                "proc 4000000000 1\n" +  // a pid beyond 31 bits still reads back whole
                gpu_line(kUuidB, 24 * kGiB, 0, "Fake Card"));
  auto nvml = load(GetParam().path);
  ASSERT_NE(nvml, nullptr);
  EXPECT_STREQ(nvml->process_entry_point(), GetParam().entry_point);
  EXPECT_EQ(nvml->process_record_size(), GetParam().record_size);

  const GpuSample sample = nvml->sample();
  EXPECT_EQ(sample.error, "");
  ASSERT_EQ(sample.devices.size(), 2u);
  const GpuDevice& a = sample.devices[0];
  EXPECT_EQ(a.uuid, kUuidA);
  EXPECT_EQ(a.name, "NVIDIA A100-SXM4-80GB");
  EXPECT_EQ(a.total_bytes, 80 * kGiB);
  EXPECT_EQ(a.used_bytes, 6 * kGiB);
  EXPECT_EQ(a.free_bytes, 74 * kGiB);
  EXPECT_TRUE(a.processes_known);
  EXPECT_EQ(listed(a), (Expected{{1234, 4 * kGiB}, {5678, 512 * kMiB}, {4000000000u, 1}}));
  const GpuDevice& b = sample.devices[1];
  EXPECT_EQ(b.uuid, kUuidB);
  EXPECT_EQ(b.name, "Fake Card");
  EXPECT_EQ(b.total_bytes, 24 * kGiB);
  EXPECT_EQ(b.used_bytes, 0u);
  EXPECT_EQ(b.free_bytes, 24 * kGiB);
  EXPECT_TRUE(b.processes_known);
  EXPECT_TRUE(b.processes.empty());
}

TEST_P(NvmlVariantTest, MoreProcessesThanTheFirstBufferAreAllReturned) {
  static_assert(Nvml::kInitialProcessCapacity < 101);
  script_.write(gpu_line(kUuidA, 80 * kGiB, 60 * kGiB) + "proc 7 na\nprocs 100 20000 1048576\n");
  auto nvml = load(GetParam().path);
  ASSERT_NE(nvml, nullptr);
  for (int round = 0; round < 2; ++round) {  // the grown buffer serves the next sample too
    const GpuSample sample = nvml->sample();
    EXPECT_EQ(sample.error, "");
    ASSERT_EQ(sample.devices.size(), 1u);
    EXPECT_TRUE(sample.devices[0].processes_known);
    Expected expected{{7, std::nullopt}};
    for (std::uint32_t i = 0; i < 100; ++i) expected.emplace_back(20000 + i, kMiB);
    EXPECT_EQ(listed(sample.devices[0]), expected) << "round " << round;
  }
}

TEST_P(NvmlVariantTest, UpToTheMaximumAreReturnedAndBeyondItNone) {
  script_.write(gpu_line(kUuidA, 80 * kGiB, 60 * kGiB) + "procs " +
                std::to_string(Nvml::kMaxProcesses) + " 100000 4096\n" +
                gpu_line(kUuidB, 80 * kGiB, 60 * kGiB) + "procs " +
                std::to_string(Nvml::kMaxProcesses + 1) + " 100000 4096\n");
  auto nvml = load(GetParam().path);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 2u);
  const GpuDevice& a = sample.devices[0];
  EXPECT_TRUE(a.processes_known);
  ASSERT_EQ(a.processes.size(), Nvml::kMaxProcesses);
  EXPECT_EQ(a.processes.back().pid, 100000 + Nvml::kMaxProcesses - 1);
  EXPECT_EQ(a.processes.back().used_bytes, 4096u);
  // One over: the device is still sampled, its process list is not known.
  const GpuDevice& b = sample.devices[1];
  EXPECT_EQ(b.uuid, kUuidB);
  EXPECT_EQ(b.total_bytes, 80 * kGiB);
  EXPECT_FALSE(b.processes_known);
  EXPECT_TRUE(b.processes.empty());
  EXPECT_THAT(sample.error, HasSubstr(std::string("GPU 1 (") + kUuidB + ")"));
  EXPECT_THAT(sample.error, HasSubstr("4097 compute processes, more than the 4096 read"));
  EXPECT_EQ(sample.error.find(kUuidA), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(
    Drivers, NvmlVariantTest,
    ::testing::Values(Variant{"v3", FAKE_NVML_V3, "nvmlDeviceGetComputeRunningProcesses_v3", 24},
                      Variant{"v3cc", FAKE_NVML_V3CC, "nvmlDeviceGetComputeRunningProcesses_v3",
                              32},
                      Variant{"v2", FAKE_NVML_V2, "nvmlDeviceGetComputeRunningProcesses_v2", 24},
                      Variant{"v1", FAKE_NVML_V1, "", 16}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.label); });

// ---- failures --------------------------------------------------------------------------

class NvmlSampleTest : public ::testing::Test {
 protected:
  Script script_;
};

TEST_F(NvmlSampleTest, LostGpuIsLeftOutAndNamedTheOthersStillSampled) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "proc 11 1024\n" +
                gpu_line(kUuidB, 16 * kGiB, kGiB) + "proc 22 2048\nlost\n" +
                gpu_line(kUuidC, 16 * kGiB, 2 * kGiB) + "proc 33 4096\n");
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 2u);
  EXPECT_EQ(sample.devices[0].uuid, kUuidA);
  EXPECT_EQ(listed(sample.devices[0]), (Expected{{11, 1024}}));
  EXPECT_EQ(sample.devices[1].uuid, kUuidC);
  EXPECT_EQ(sample.devices[1].used_bytes, 2 * kGiB);
  EXPECT_EQ(listed(sample.devices[1]), (Expected{{33, 4096}}));
  // Its uuid cannot be read either: named by index.
  EXPECT_EQ(sample.error, "GPU 1: nvmlDeviceGetUUID failed: GPU is lost (15)");
}

TEST_F(NvmlSampleTest, FailureAfterTheUuidNamesTheUuidAndTheCall) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + gpu_line(kUuidB, 16 * kGiB, kGiB) +
                "fail memory 15\n" + gpu_line(kUuidC, 16 * kGiB, kGiB) + "fail name 999\n");
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 1u);
  EXPECT_EQ(sample.devices[0].uuid, kUuidA);
  EXPECT_EQ(sample.error, std::string("GPU 1 (") + kUuidB +
                              "): nvmlDeviceGetMemoryInfo failed: GPU is lost (15); GPU 2 (" +
                              kUuidC + "): nvmlDeviceGetName failed: Unknown Error (999)");
}

TEST_F(NvmlSampleTest, HandleFailureLeavesTheDeviceOut) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "fail handle 4\n" +
                gpu_line(kUuidB, 16 * kGiB, kGiB));
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 1u);
  EXPECT_EQ(sample.devices[0].uuid, kUuidB);
  EXPECT_EQ(sample.error,
            "GPU 0: nvmlDeviceGetHandleByIndex_v2 failed: Insufficient Permissions (4)");
}

TEST_F(NvmlSampleTest, GpuLostInTheProcessCallIsLeftOut) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "proc 1 1\nfail processes 15\n" +
                gpu_line(kUuidB, 16 * kGiB, kGiB));
  auto nvml = load(FAKE_NVML_V2);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 1u);
  EXPECT_EQ(sample.devices[0].uuid, kUuidB);
  EXPECT_EQ(sample.error,
            std::string("GPU 0 (") + kUuidA +
                "): nvmlDeviceGetComputeRunningProcesses_v2 failed: GPU is lost (15)");
}

TEST_F(NvmlSampleTest, ProcessCallOtherwiseFailingKeepsTheDeviceWithProcessesUnknown) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, 3 * kGiB) + "proc 1 1\nfail processes 3\n");
  auto nvml = load(FAKE_NVML_V1);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  ASSERT_EQ(sample.devices.size(), 1u);
  const GpuDevice& a = sample.devices[0];
  EXPECT_EQ(a.uuid, kUuidA);
  EXPECT_EQ(a.used_bytes, 3 * kGiB);
  EXPECT_FALSE(a.processes_known);
  EXPECT_TRUE(a.processes.empty());
  EXPECT_EQ(sample.error, std::string("GPU 0 (") + kUuidA +
                              "): nvmlDeviceGetComputeRunningProcesses failed: Not Supported (3)");
}

TEST_F(NvmlSampleTest, ProcessListThatOutgrowsEveryBufferGivesUpAfterBoundedRetries) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "proc 1 1\nalways_insufficient\n");
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();  // returns: does not retry forever
  ASSERT_EQ(sample.devices.size(), 1u);
  EXPECT_FALSE(sample.devices[0].processes_known);
  EXPECT_TRUE(sample.devices[0].processes.empty());
  EXPECT_THAT(sample.error,
              HasSubstr("nvmlDeviceGetComputeRunningProcesses_v3: the process list outgrew the "
                        "buffer " +
                        std::to_string(Nvml::kMaxProcessAttempts) + " times"));
}

TEST_F(NvmlSampleTest, GpuThatDisappearsBetweenSamplesIsAbsentFromTheSecond) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "proc 10 100\n" +
                gpu_line(kUuidB, 32 * kGiB, 2 * kGiB) + "proc 20 200\n");
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample first = nvml->sample();
  EXPECT_EQ(first.error, "");
  ASSERT_EQ(first.devices.size(), 2u);
  ASSERT_NE(find_device(first, kUuidA), nullptr);

  script_.write(gpu_line(kUuidB, 32 * kGiB, 3 * kGiB) + "proc 20 300\n");
  const GpuSample second = nvml->sample();
  EXPECT_EQ(second.error, "");
  ASSERT_EQ(second.devices.size(), 1u);
  EXPECT_EQ(find_device(second, kUuidA), nullptr);
  EXPECT_EQ(second.devices[0].uuid, kUuidB);
  EXPECT_EQ(second.devices[0].used_bytes, 3 * kGiB);
  EXPECT_EQ(listed(second.devices[0]), (Expected{{20, 300}}));
}

TEST_F(NvmlSampleTest, UsedMemoryNotAvailableIsNullopt) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB) + "proc 100 na\nproc 200 0\n");
  for (const char* path : {FAKE_NVML_V3, FAKE_NVML_V3CC, FAKE_NVML_V2, FAKE_NVML_V1}) {
    auto nvml = load(path);
    ASSERT_NE(nvml, nullptr);
    const GpuSample sample = nvml->sample();
    ASSERT_EQ(sample.devices.size(), 1u) << path;
    const auto& processes = sample.devices[0].processes;
    ASSERT_EQ(processes.size(), 2u) << path;
    EXPECT_EQ(processes[0].pid, 100u);
    EXPECT_EQ(processes[0].used_bytes, std::nullopt) << path;
    EXPECT_EQ(processes[1].used_bytes, std::optional<std::uint64_t>(0)) << path;  // 0 is a value
  }
}

TEST_F(NvmlSampleTest, DeviceCountFailureIsAnEmptySampleNamingTheCall) {
  script_.write(gpu_line(kUuidA, 16 * kGiB, kGiB));
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  script_.write("count_fail 999\n" + gpu_line(kUuidA, 16 * kGiB, kGiB));
  const GpuSample sample = nvml->sample();
  EXPECT_TRUE(sample.devices.empty());
  EXPECT_EQ(sample.error, "nvmlDeviceGetCount_v2 failed: Unknown Error (999)");
}

TEST_F(NvmlSampleTest, NoGpuIsAnEmptySampleWithoutError) {
  script_.write("# no gpu\n");
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const GpuSample sample = nvml->sample();
  EXPECT_TRUE(sample.devices.empty());
  EXPECT_EQ(sample.error, "");
}

TEST_F(NvmlSampleTest, SlowLibraryMakesASlowSample) {
  script_.write("sleep_ms 200\n" + gpu_line(kUuidA, 16 * kGiB, kGiB));
  auto nvml = load(FAKE_NVML_V3);
  ASSERT_NE(nvml, nullptr);
  const auto start = std::chrono::steady_clock::now();
  const GpuSample sample = nvml->sample();
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  EXPECT_EQ(sample.devices.size(), 1u);
  EXPECT_EQ(sample.error, "");
}

}  // namespace
