// The C ABI (steptrace.h) over the Client. Every body catches everything: no exception
// crosses the ABI; a failure degrades to "dropped and counted" or an error return.
#include <cerrno>

#include <steptrace/steptrace.h>
#include <steptrace/steptrace.hpp>

#include <array>
#include <string_view>

#include "client/src/client.h"
#include "proto/steps.h"

using steptrace::client::Client;
namespace proto = steptrace::proto;

// The C enum is the wire's cause index (PROTOCOL.md 4.7a).
static_assert(STEPTRACE_DROP_BUFFER_FULL == static_cast<int>(proto::DropCause::kBufferFull));
static_assert(STEPTRACE_DROP_NOT_CONNECTED == static_cast<int>(proto::DropCause::kNotConnected));
static_assert(STEPTRACE_DROP_IN_FLIGHT == static_cast<int>(proto::DropCause::kInFlight));
static_assert(STEPTRACE_DROP_INVALID == static_cast<int>(proto::DropCause::kInvalid));
static_assert(STEPTRACE_DROP_CAUSE_COUNT == proto::kDropCauseCount);

// The public step enums (C and C++) are the built-in table (proto/steps.h): one row per
// built-in step, each enum value its id. A step added to the table and not here, or an
// enum value that is not its step's id, does not compile.
namespace {
struct PublicStep {
  steptrace_step c;
  steptrace::Step cpp;
  std::string_view name;
};
constexpr std::array kPublicSteps = {
    PublicStep{STEPTRACE_FORWARD, steptrace::Step::kForward, "Forward"},
    PublicStep{STEPTRACE_BACKWARD, steptrace::Step::kBackward, "Backward"},
    PublicStep{STEPTRACE_MATMUL, steptrace::Step::kMatmul, "Matmul"},
    PublicStep{STEPTRACE_ATTENTION, steptrace::Step::kAttention, "Attention"},
    PublicStep{STEPTRACE_TRANSPOSE, steptrace::Step::kTranspose, "Transpose"},
    PublicStep{STEPTRACE_ALLOC, steptrace::Step::kAlloc, "Alloc"},
    PublicStep{STEPTRACE_TRANSFER, steptrace::Step::kTransfer, "Transfer"},
    PublicStep{STEPTRACE_LEDGER_RESERVE, steptrace::Step::kLedgerReserve, "LedgerReserve"},
    PublicStep{STEPTRACE_LEDGER_CLEANUP, steptrace::Step::kLedgerCleanup, "LedgerCleanup"},
    PublicStep{STEPTRACE_VRAM_QUERY, steptrace::Step::kVramQuery, "VramQuery"},
    PublicStep{STEPTRACE_WAIT_POLL, steptrace::Step::kWaitPoll, "WaitPoll"},
    PublicStep{STEPTRACE_LEDGER_RELEASE, steptrace::Step::kLedgerRelease, "LedgerRelease"},
};
constexpr bool public_steps_match_table() {
  if (kPublicSteps.size() != proto::kBuiltinSteps.size()) return false;
  for (std::uint32_t id = 0; id < kPublicSteps.size(); ++id) {
    const PublicStep& s = kPublicSteps[id];  // rows in id order, so each id has its row
    if (proto::builtin_step_name(id) != s.name || static_cast<std::uint32_t>(s.c) != id ||
        static_cast<std::uint32_t>(s.cpp) != id) {
      return false;
    }
  }
  return true;
}
}  // namespace
static_assert(public_steps_match_table(),
              "enum steptrace_step and steptrace::Step must be proto/steps.h's ids");

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

STEPTRACE_EXPORT void steptrace_ledger_reserve_lease(const char* gpu_uuid, uint64_t reservation_id,
                                                     uint64_t bytes, const char* task,
                                                     uint32_t lease_ms) {
  try {
    Client::get().ledger(proto::LedgerOp::kReserveLease, gpu_uuid, reservation_id, bytes, lease_ms,
                         0, task);
  } catch (...) {
  }
}

STEPTRACE_EXPORT void steptrace_ledger_renew(const char* gpu_uuid, uint64_t reservation_id,
                                             uint32_t lease_ms) {
  try {
    Client::get().ledger(proto::LedgerOp::kRenew, gpu_uuid, reservation_id, 0, lease_ms, 0,
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

STEPTRACE_EXPORT uint64_t steptrace_rejected(void) {
  try {
    return Client::get().state().rejected.load(std::memory_order_relaxed);
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
