// The C ABI (steptrace.h) over the Client. Every body catches everything: no exception
// crosses the ABI; a failure degrades to "dropped and counted" or an error return.
#include <cerrno>

#include <steptrace/steptrace.h>

#include "client/src/client.h"

using steptrace::client::Client;
namespace proto = steptrace::proto;

// The C enum is the wire's cause index (PROTOCOL.md 4.7a).
static_assert(STEPTRACE_DROP_BUFFER_FULL == static_cast<int>(proto::DropCause::kBufferFull));
static_assert(STEPTRACE_DROP_NOT_CONNECTED == static_cast<int>(proto::DropCause::kNotConnected));
static_assert(STEPTRACE_DROP_IN_FLIGHT == static_cast<int>(proto::DropCause::kInFlight));
static_assert(STEPTRACE_DROP_INVALID == static_cast<int>(proto::DropCause::kInvalid));
static_assert(STEPTRACE_DROP_CAUSE_COUNT == proto::kDropCauseCount);

extern "C" {

STEPTRACE_EXPORT int steptrace_connect(const char* socket_path) {
  try {
    return Client::get().connect(socket_path);
  } catch (...) {
    return -ENOMEM;
  }
}

STEPTRACE_EXPORT uint32_t steptrace_register_step(const char* name) {
  try {
    return Client::get().register_step(name);
  } catch (...) {
    return UINT32_MAX;
  }
}

STEPTRACE_EXPORT void steptrace_start(uint32_t step) {
  try {
    steptrace::client::record(step, proto::EventKind::kStart);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_end(uint32_t step) {
  try {
    steptrace::client::record(step, proto::EventKind::kEnd);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_ledger_reserve(const char* gpu_uuid, uint64_t reservation_id,
                                               uint64_t bytes, const char* task) {
  try {
    Client::get().ledger(proto::LedgerOp::kReserve, gpu_uuid, reservation_id, bytes, 0, 0, task);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_ledger_release(const char* gpu_uuid, uint64_t reservation_id) {
  try {
    Client::get().ledger(proto::LedgerOp::kRelease, gpu_uuid, reservation_id, 0, 0, 0, nullptr);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_ledger_cleanup(const char* gpu_uuid, uint64_t reservation_id,
                                               uint32_t holder_pid) {
  try {
    Client::get().ledger(proto::LedgerOp::kCleanup, gpu_uuid, reservation_id, 0, 0, holder_pid,
                         nullptr);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_vram_sample(const char* gpu_uuid, uint64_t free_bytes,
                                            uint64_t total_bytes) {
  try {
    Client::get().ledger(proto::LedgerOp::kVramSample, gpu_uuid, 0, free_bytes, total_bytes, 0,
                         nullptr);
  } catch (...) {
  }
}

STEPTRACE_EXPORT int steptrace_flush(int timeout_ms) {
  try {
    return Client::get().flush(timeout_ms);
  } catch (...) {
    return -ENOMEM;
  }
}

STEPTRACE_EXPORT uint64_t steptrace_dropped(void) {
  try {
    return Client::get().dropped();
  } catch (...) {
    return 0;
  }
}

STEPTRACE_EXPORT uint64_t steptrace_dropped_by_cause(int cause) {
  if (cause < 0 || cause >= STEPTRACE_DROP_CAUSE_COUNT) return 0;
  try {
    return Client::get().dropped_by_cause().count[cause];
  } catch (...) {
    return 0;
  }
}

STEPTRACE_EXPORT int steptrace_set_buffer_size(uint64_t per_thread_bytes, uint64_t total_bytes) {
  try {
    return Client::get().set_buffer_size(per_thread_bytes, total_bytes);
  } catch (...) {
    return -ENOMEM;
  }
}

STEPTRACE_EXPORT void steptrace_set_enabled(int on) {
  try {
    Client::get().set_enabled(on != 0);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_set_block_when_full(int on) {
  try {
    Client::get().set_block_when_full(on != 0);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_shutdown(void) {
  try {
    Client::get().shutdown(500);
  } catch (...) {
  }
}

}  // extern "C"

namespace {
// Set the library up at load time (clock calibration start, fork and exit hooks), so
// the first event of the first thread does not pay for it.
__attribute__((constructor)) void steptrace_load() {
  try {
    Client::get();
  } catch (...) {
  }
}
}  // namespace
