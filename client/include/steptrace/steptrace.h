/* libsteptrace: the C ABI trainers link to send span and VRAM-ledger events to
 * steptraced.
 *
 * steptrace_start/end read a clock and append a 16-byte record to a buffer owned by the
 * calling thread: no lock, no system call, no allocation after the thread's first event.
 * A background thread ships the buffers to the daemon over a Unix socket. When the
 * daemon is absent, slow or restarted, events that do not fit are dropped and counted
 * (steptrace_dropped), never waited for (unless STEPTRACE_BLOCK_WHEN_FULL=1 or
 * steptrace_set_block_when_full(1) asks for a bounded wait).
 *
 * Every function is safe to call before steptrace_connect, after the daemon died, and
 * from any thread; none throws, none raises SIGPIPE. Environment:
 *   STEPTRACE_SOCKET          socket path (default /run/steptrace/steptraced.sock)
 *   STEPTRACE_DISABLE=1       record nothing
 *   STEPTRACE_BLOCK_WHEN_FULL=1  a full buffer waits (bounded) for the flusher
 *   STEPTRACE_CLOCK=monotonic    timestamp with clock_gettime instead of the TSC
 *                                (the TSC is used only when invariant; =tsc forces it then)
 */
#ifndef STEPTRACE_STEPTRACE_H_
#define STEPTRACE_STEPTRACE_H_

#include <stdint.h>

#if defined(STEPTRACE_BUILDING_LIBRARY)
#define STEPTRACE_EXPORT __attribute__((visibility("default")))
#else
#define STEPTRACE_EXPORT
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define STEPTRACE_DEFAULT_SOCKET "/run/steptrace/steptraced.sock"

/* C naming, fixed by the ABI. NOLINTBEGIN(readability-identifier-naming) */
enum steptrace_step {
  STEPTRACE_FORWARD = 0,
  STEPTRACE_BACKWARD = 1,
  STEPTRACE_MATMUL = 2,
  STEPTRACE_ATTENTION = 3,
  STEPTRACE_TRANSPOSE = 4,
  STEPTRACE_ALLOC = 5,
  STEPTRACE_TRANSFER = 6,
  STEPTRACE_LEDGER_RESERVE = 7,
  STEPTRACE_LEDGER_CLEANUP = 8,
  STEPTRACE_VRAM_QUERY = 9,
  STEPTRACE_WAIT_POLL = 10,
  STEPTRACE_LEDGER_RELEASE = 11
};
/* NOLINTEND(readability-identifier-naming) */

/* Connects to the daemon (NULL: $STEPTRACE_SOCKET, then the default path) and starts the
 * flusher thread. 0 on success, -errno when the daemon cannot be reached now; recording
 * works either way and the flusher keeps reconnecting with backoff. */
STEPTRACE_EXPORT int steptrace_connect(const char* socket_path);

/* A custom step id for `name` (1..63 printable ASCII characters), stable per name within
 * the process. Returns UINT32_MAX when the name is invalid or the per-process limit of
 * custom steps is reached. */
STEPTRACE_EXPORT uint32_t steptrace_register_step(const char* name);

STEPTRACE_EXPORT void steptrace_start(uint32_t step);
STEPTRACE_EXPORT void steptrace_end(uint32_t step);

/* VRAM-ledger annotations (timing comes from the spans around them). A GPU UUID or task
 * longer than 63 characters is cut and flagged; the daemon counts such a record as an
 * anomaly and refuses it. */
STEPTRACE_EXPORT void steptrace_ledger_reserve(const char* gpu_uuid, uint64_t reservation_id,
                                               uint64_t bytes, const char* task);
STEPTRACE_EXPORT void steptrace_ledger_release(const char* gpu_uuid, uint64_t reservation_id);
STEPTRACE_EXPORT void steptrace_ledger_cleanup(const char* gpu_uuid, uint64_t reservation_id,
                                               uint32_t holder_pid);
STEPTRACE_EXPORT void steptrace_vram_sample(const char* gpu_uuid, uint64_t free_bytes,
                                            uint64_t total_bytes);

/* 0 once the daemon has applied every event recorded before the call; -ETIMEDOUT, or
 * -ENOTCONN when not connected, otherwise. */
STEPTRACE_EXPORT int steptrace_flush(int timeout_ms);

/* Events this process could not deliver (buffers full, daemon absent). */
STEPTRACE_EXPORT uint64_t steptrace_dropped(void);

STEPTRACE_EXPORT void steptrace_set_enabled(int on);

/* Opt-in backpressure: with on != 0 a full thread buffer waits up to a bounded time for
 * the flusher instead of dropping. Off by default. */
STEPTRACE_EXPORT void steptrace_set_block_when_full(int on);

/* Flushes briefly (bounded), stops the flusher and disconnects. Recording after it is
 * dropped and counted until steptrace_connect is called again. */
STEPTRACE_EXPORT void steptrace_shutdown(void);

#ifdef __cplusplus
}
#endif

#endif /* STEPTRACE_STEPTRACE_H_ */
