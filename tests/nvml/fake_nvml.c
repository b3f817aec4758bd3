/* A scripted stand-in for libnvidia-ml.so.1, for the tests of daemon/gpu/nvml.cpp.
 *
 * Built in several variants from this one file (tests/nvml/CMakeLists.txt), each as a
 * libnvidia-ml.so.1 in its own directory:
 *   FAKE_ENTRY=3  exports nvmlDeviceGetComputeRunningProcesses_v3, _v2 and the
 *                 unversioned one, like a current driver (each fills its own record).
 *                 FAKE_V3_CC=0: also nvmlDeviceGetConfComputeMemSizeInfo and
 *                 nvmlDeviceGetRunningProcessDetailList; _v3 fills the 24-byte record.
 *                 FAKE_V3_CC=1: only nvmlDeviceGetConfComputeMemSizeInfo, and _v3 fills
 *                 the 32-byte record of the CUDA 12.2.0/12.2.1 headers (early R535).
 *   FAKE_ENTRY=2  _v2 and the unversioned one.
 *   FAKE_ENTRY=1  the unversioned one only.
 * Names, signatures and records follow the published nvml.h (CUDA 12.6.2, NVML API 12),
 * declared here independently of the loader.
 *
 * The script: the file named by $FAKE_NVML_SCRIPT, read by nvmlInit_v2 and again by
 * every nvmlDeviceGetCount_v2 (a test may rewrite it between samples). No variable, or
 * no file: no GPU. One directive a line; '#' starts a comment.
 *   init_fail CODE            nvmlInit_v2 returns CODE
 *   count_fail CODE           nvmlDeviceGetCount_v2 returns CODE
 *   sleep_ms N                nvmlDeviceGetCount_v2 sleeps N ms first (a slow library)
 *   gpu UUID total BYTES used BYTES name NAME...
 *                             a GPU (free = total - used); NAME runs to the line's end
 * and for the last gpu:
 *   proc PID BYTES|na         a compute process (na: NVML_VALUE_NOT_AVAILABLE)
 *   procs N FIRST_PID BYTES|na  N compute processes, pids FIRST_PID, FIRST_PID+1, ...
 *   lost                      every call taking its handle returns NVML_ERROR_GPU_IS_LOST
 *   fail CALL CODE            CALL (handle|uuid|name|memory|processes) returns CODE
 *   always_insufficient       the process calls always say they need one entry more
 *                             than offered (a process list that outgrows every buffer)
 * A line it cannot read makes nvmlDeviceGetCount_v2 fail with NVML_ERROR_UNKNOWN (and is
 * printed on stderr), so a broken script shows in the test. */
#define _POSIX_C_SOURCE 200809L

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifndef FAKE_ENTRY
#define FAKE_ENTRY 3
#endif
#ifndef FAKE_V3_CC
#define FAKE_V3_CC 0
#endif

/* nvml.h's types, as far as used here. nvmlReturn_t is a C enum; int has its size. */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_NO_PERMISSION 4
#define NVML_ERROR_NOT_FOUND 6
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999
#define NVML_VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL

typedef struct {
  unsigned long long total;
  unsigned long long free;
  unsigned long long used;
} nvmlMemory_t;

typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
} nvmlProcessInfo_v2_t;

#if FAKE_V3_CC
typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
  unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessInfo_t;
#else
typedef nvmlProcessInfo_v2_t nvmlProcessInfo_t;
#endif

typedef struct {
  unsigned long long protectedMemSizeKib;
  unsigned long long unprotectedMemSizeKib;
} nvmlConfComputeMemSizeInfo_t;

typedef struct {
  unsigned int pid;
  unsigned long long usedGpuMemory;
  unsigned int gpuInstanceId;
  unsigned int computeInstanceId;
  unsigned long long usedGpuCcProtectedMemory;
} nvmlProcessDetail_v1_t;

typedef struct {
  unsigned int version;
  unsigned int mode;
  unsigned int numProcArrayEntries;
  nvmlProcessDetail_v1_t* procArray;
} nvmlProcessDetailList_t;

/* ---- the scripted state ---------------------------------------------------------- */

enum { kMaxGpus = 16, kMaxProcs = 256, kTextSize = 96 };
enum { kCallHandle, kCallUuid, kCallName, kCallMemory, kCallProcesses, kCallCount };

typedef struct nvmlDevice_st {
  char uuid[kTextSize];
  char name[kTextSize];
  unsigned long long total;
  unsigned long long used;
  unsigned int proc_pids[kMaxProcs];
  unsigned long long proc_used[kMaxProcs];
  unsigned int procs;
  unsigned int range_count; /* `procs N FIRST BYTES`, after the explicit ones */
  unsigned int range_first_pid;
  unsigned long long range_used;
  int lost;
  int always_insufficient;
  nvmlReturn_t fail[kCallCount];
} FakeGpu;
typedef struct nvmlDevice_st* nvmlDevice_t;

static FakeGpu gpus[kMaxGpus];
static unsigned int gpu_count;
static nvmlReturn_t init_fail;
static nvmlReturn_t count_fail;
static long sleep_ms;
static int script_broken;
static int initialized; /* nvmlInit_v2 calls not yet shut down */

static int parse_bytes(const char* text, unsigned long long* out) {
  char* end = NULL;
  if (strcmp(text, "na") == 0) {
    *out = NVML_VALUE_NOT_AVAILABLE_ULL;
    return 1;
  }
  *out = strtoull(text, &end, 10);
  return end != text && *end == '\0';
}

static int parse_call(const char* text) {
  static const char* const names[kCallCount] = {"handle", "uuid", "name", "memory", "processes"};
  int i;
  for (i = 0; i < kCallCount; ++i) {
    if (strcmp(text, names[i]) == 0) return i;
  }
  return -1;
}

/* One directive; 0 when it cannot be read. */
static int parse_line(char* line) {
  char word[32], arg1[kTextSize], arg2[32], arg3[32];
  FakeGpu* last = gpu_count > 0 ? &gpus[gpu_count - 1] : NULL;
  int fields;
  char* hash = strchr(line, '#');
  if (hash != NULL) *hash = '\0';
  fields = sscanf(line, "%31s", word);
  if (fields != 1) return 1; /* blank */
  if (strcmp(word, "init_fail") == 0) return sscanf(line, "%*s %d", &init_fail) == 1;
  if (strcmp(word, "count_fail") == 0) return sscanf(line, "%*s %d", &count_fail) == 1;
  if (strcmp(word, "sleep_ms") == 0) return sscanf(line, "%*s %ld", &sleep_ms) == 1;
  if (strcmp(word, "gpu") == 0) {
    FakeGpu* gpu;
    int name_at = 0;
    if (gpu_count == kMaxGpus) return 0;
    gpu = &gpus[gpu_count];
    memset(gpu, 0, sizeof *gpu);
    if (sscanf(line, "%*s %95s total %llu used %llu name %n", gpu->uuid, &gpu->total, &gpu->used,
               &name_at) != 3 ||
        name_at == 0) {
      return 0;
    }
    strncpy(gpu->name, line + name_at, kTextSize - 1);
    gpu->name[strcspn(gpu->name, "\r\n")] = '\0';
    while (strlen(gpu->name) > 0 && gpu->name[strlen(gpu->name) - 1] == ' ') {
      gpu->name[strlen(gpu->name) - 1] = '\0';
    }
    ++gpu_count;
    return 1;
  }
  if (last == NULL) return 0; /* the rest apply to the last gpu */
  if (strcmp(word, "proc") == 0) {
    unsigned long long used;
    if (last->procs == kMaxProcs) return 0;
    if (sscanf(line, "%*s %u %31s", &last->proc_pids[last->procs], arg2) != 2) return 0;
    if (!parse_bytes(arg2, &used)) return 0;
    last->proc_used[last->procs++] = used;
    return 1;
  }
  if (strcmp(word, "procs") == 0) {
    if (sscanf(line, "%*s %u %u %31s", &last->range_count, &last->range_first_pid, arg3) != 3) {
      return 0;
    }
    return parse_bytes(arg3, &last->range_used);
  }
  if (strcmp(word, "lost") == 0) {
    last->lost = 1;
    return 1;
  }
  if (strcmp(word, "always_insufficient") == 0) {
    last->always_insufficient = 1;
    return 1;
  }
  if (strcmp(word, "fail") == 0) {
    int call, code;
    if (sscanf(line, "%*s %95s %d", arg1, &code) != 2) return 0;
    call = parse_call(arg1);
    if (call < 0) return 0;
    last->fail[call] = code;
    return 1;
  }
  return 0;
}

static void read_script(void) {
  const char* path = getenv("FAKE_NVML_SCRIPT");
  char line[512];
  FILE* file;
  gpu_count = 0;
  init_fail = NVML_SUCCESS;
  count_fail = NVML_SUCCESS;
  sleep_ms = 0;
  script_broken = 0;
  if (path == NULL) return;
  file = fopen(path, "r");
  if (file == NULL) return;
  while (fgets(line, sizeof line, file) != NULL) {
    char copy[512];
    memcpy(copy, line, sizeof copy);
    if (!parse_line(line)) {
      fprintf(stderr, "fake_nvml: %s: cannot read: %s", path, copy);
      script_broken = 1;
    }
  }
  fclose(file);
}

/* The gpu behind a handle, or the code a call on it returns. */
static nvmlReturn_t check(nvmlDevice_t device, int call) {
  if (initialized == 0) return NVML_ERROR_UNINITIALIZED;
  if (device < gpus || device >= gpus + gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
  if (device->lost) return NVML_ERROR_GPU_IS_LOST;
  return device->fail[call];
}

static nvmlReturn_t copy_text(const char* text, char* out, unsigned int length) {
  if (out == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  if (strlen(text) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
  memcpy(out, text, strlen(text) + 1);
  return NVML_SUCCESS;
}

/* The compute process list into records of `size` bytes; `version` says which fields
 * the record has beyond pid and usedGpuMemory (1: none, 2: the instance ids, 3: and the
 * protected memory). */
static nvmlReturn_t fill_processes(nvmlDevice_t device, unsigned int* info_count, void* infos,
                                   size_t size, int version) {
  unsigned int total, i;
  unsigned char* out = (unsigned char*)infos;
  nvmlReturn_t rc = check(device, kCallProcesses);
  if (rc != NVML_SUCCESS) return rc;
  if (info_count == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  total = device->procs + device->range_count;
  if (device->always_insufficient) {
    *info_count = *info_count + 1;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  if (*info_count < total) {
    *info_count = total;
    return NVML_ERROR_INSUFFICIENT_SIZE;
  }
  if (total > 0 && infos == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  for (i = 0; i < total; ++i) {
    const int explicit_proc = i < device->procs;
    const unsigned int pid =
        explicit_proc ? device->proc_pids[i] : device->range_first_pid + (i - device->procs);
    const unsigned long long used = explicit_proc ? device->proc_used[i] : device->range_used;
    unsigned char* record = out + (size_t)i * size;
    if (version == 1) {
      nvmlProcessInfo_v1_t info;
      memset(&info, 0, sizeof info);
      info.pid = pid;
      info.usedGpuMemory = used;
      memcpy(record, &info, sizeof info);
    } else {
      nvmlProcessDetail_v1_t info; /* the widest record; only `size` bytes are copied */
      memset(&info, 0, sizeof info);
      info.pid = pid;
      info.usedGpuMemory = used;
      info.gpuInstanceId = 0xFFFFFFFFu;
      info.computeInstanceId = 0xFFFFFFFFu;
      info.usedGpuCcProtectedMemory = version == 3 ? 0x5A5A5A5A5A5A5A5AULL : 0;
      memcpy(record, &info, size);
    }
  }
  *info_count = total;
  return NVML_SUCCESS;
}

/* ---- the exported NVML entry points ---------------------------------------------- */

nvmlReturn_t nvmlInit_v2(void) {
  read_script();
  if (init_fail != NVML_SUCCESS) return init_fail;
  ++initialized;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
  if (initialized == 0) return NVML_ERROR_UNINITIALIZED;
  --initialized;
  return NVML_SUCCESS;
}

const char* nvmlErrorString(nvmlReturn_t result) {
  switch (result) {
    case NVML_SUCCESS:
      return "Success";
    case NVML_ERROR_UNINITIALIZED:
      return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT:
      return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED:
      return "Not Supported";
    case NVML_ERROR_NO_PERMISSION:
      return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND:
      return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE:
      return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED:
      return "Driver Not Loaded";
    case NVML_ERROR_GPU_IS_LOST:
      return "GPU is lost";
    default:
      return "Unknown Error";
  }
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int* deviceCount) {
  if (initialized == 0) return NVML_ERROR_UNINITIALIZED;
  if (deviceCount == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  read_script();
  if (sleep_ms > 0) {
    struct timespec pause;
    pause.tv_sec = sleep_ms / 1000;
    pause.tv_nsec = (sleep_ms % 1000) * 1000000L;
    while (nanosleep(&pause, &pause) != 0 && errno == EINTR) {
    }
  }
  if (script_broken) return NVML_ERROR_UNKNOWN;
  if (count_fail != NVML_SUCCESS) return count_fail;
  *deviceCount = gpu_count;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t* device) {
  if (initialized == 0) return NVML_ERROR_UNINITIALIZED;
  if (device == NULL || index >= gpu_count) return NVML_ERROR_INVALID_ARGUMENT;
  if (gpus[index].fail[kCallHandle] != NVML_SUCCESS) return gpus[index].fail[kCallHandle];
  *device = &gpus[index];
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char* uuid, unsigned int length) {
  nvmlReturn_t rc = check(device, kCallUuid);
  return rc != NVML_SUCCESS ? rc : copy_text(device->uuid, uuid, length);
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char* name, unsigned int length) {
  nvmlReturn_t rc = check(device, kCallName);
  return rc != NVML_SUCCESS ? rc : copy_text(device->name, name, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t* memory) {
  nvmlReturn_t rc = check(device, kCallMemory);
  if (rc != NVML_SUCCESS) return rc;
  if (memory == NULL) return NVML_ERROR_INVALID_ARGUMENT;
  memory->total = device->total;
  memory->used = device->used;
  memory->free = device->total - device->used;
  return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int* infoCount,
                                                  nvmlProcessInfo_v1_t* infos) {
  return fill_processes(device, infoCount, infos, sizeof *infos, 1);
}

#if FAKE_ENTRY >= 2
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_v2_t* infos) {
  return fill_processes(device, infoCount, infos, sizeof *infos, 2);
}
#endif

#if FAKE_ENTRY >= 3
nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int* infoCount,
                                                     nvmlProcessInfo_t* infos) {
  return fill_processes(device, infoCount, infos, sizeof *infos, FAKE_V3_CC ? 3 : 2);
}

/* Exported only for the loader to see which driver generation this is. */
nvmlReturn_t nvmlDeviceGetConfComputeMemSizeInfo(nvmlDevice_t device,
                                                 nvmlConfComputeMemSizeInfo_t* memInfo) {
  (void)device;
  (void)memInfo;
  return NVML_ERROR_NOT_SUPPORTED;
}

#if !FAKE_V3_CC
nvmlReturn_t nvmlDeviceGetRunningProcessDetailList(nvmlDevice_t device,
                                                   nvmlProcessDetailList_t* plist) {
  (void)device;
  (void)plist;
  return NVML_ERROR_NOT_SUPPORTED;
}
#endif
#endif
