/* libsteptrace: the C ABI trainers link to send span and VRAM-ledger events to
 * steptraced.
 *
 * steptrace_start/end read a clock and append a 16-byte record to a buffer owned by the
 * calling thread: no lock, no allocation after the thread's first event, and no system
 * call but one: when a buffer fills up to its high-water mark (an eighth of it, at most
 * 32,768 events), one write to an eventfd wakes the background thread, and no other
 * until its events have been taken. Each buffer is a sealed memfd that the background
 * thread hands to the daemon over a Unix socket (protocol version 5, PROTOCOL.md
 * section 11); the daemon maps it and reads the events itself, every 1-4 ms, and at once
 * when the woken background thread asks it to with a flush, and a last time when the
 * process's connection closes, so what a thread recorded in a buffer the daemon has taken
 * is not lost when the process is killed or calls _exit (a new thread's buffer is handed
 * over as soon as it is made). The background thread keeps the connection (hello,
 * step names, ledger records, drop counts). A buffer the daemon cannot take (a daemon
 * older than protocol 5, a buffer it refused, STEPTRACE_SHM_RINGS=0) is shipped by the
 * background thread over the socket instead, every 1-2 ms (at once when woken), draining
 * it completely.
 * When the daemon is absent, slow or restarted, events that do not fit are dropped and
 * counted (steptrace_dropped, steptrace_dropped_by_cause), never waited for (unless
 * STEPTRACE_BLOCK_WHEN_FULL=1 or steptrace_set_block_when_full(1) asks for a bounded
 * wait).
 *
 * Memory: each recording thread gets a buffer of 4 MiB by default (262,144 events, i.e.
 * a burst of 131,072 spans), mapped on its first event. Its pages are committed only as
 * they are first written, so a thread holds 16 bytes per event it has recorded, up to
 * the full 4 MiB once it has recorded 262,144 events (the buffer is circular; 4 MiB per
 * recording thread is the figure to plan for). All buffers of the process together
 * stay within 256 MiB by default: a thread gets the per-thread size, or the largest
 * power of two left in that total, or, below 64 KiB, no buffer at all (its events are
 * then dropped and counted as STEPTRACE_DROP_BUFFER_FULL). Each buffer also has a 4 KiB
 * header page, not counted in those sizes. While connected to a daemon of protocol
 * version 8, the library keeps up to 2 spare buffers of the per-thread size (made by its
 * flusher thread when a whole one fits in the total, so no thread gets less for them),
 * already handed to the daemon: a new thread that finds one ready takes it at its first
 * event, so what it records survives the process's death from the first event on (the
 * cases with none ready, e.g. more new threads at once than spares: PROTOCOL.md 11.2).
 * An exited thread's buffer is freed once sent or read by the daemon (while no daemon is
 * connected, the newest 64 are kept for it, within that total). See
 * steptrace_set_buffer_size.
 *
 * Connecting: calling steptrace_connect is optional. A process that never called it
 * (nor steptrace_shutdown) connects by itself at its first event, ledger call or
 * steptrace_register_step: the background thread starts then and connects to
 * $STEPTRACE_SOCKET, else the default path, in the background (the calling thread never
 * waits for it), retrying with backoff (10 ms .. 1 s) while the daemon is absent.
 * STEPTRACE_AUTOCONNECT=0 turns this off (nothing starts, no socket is opened, until
 * steptrace_connect). When the first connection attempt of the process fails, one line
 * on stderr says why (no daemon at that path, or permission: is the user in the
 * steptrace group?); it is printed once per process, by the background thread, never on
 * a reconnect, and not at all with STEPTRACE_QUIET=1.
 *
 * Every function is safe to call before any connection, after the daemon died, and
 * from any thread; none throws, none raises SIGPIPE. Environment (read at load, but
 * STEPTRACE_SOCKET: read when connecting):
 *   STEPTRACE_SOCKET          socket path (default /run/steptrace/steptraced.sock)
 *   STEPTRACE_DISABLE=1       record nothing, start nothing
 *   STEPTRACE_AUTOCONNECT=0   do not connect unless steptrace_connect is called
 *   STEPTRACE_QUIET=1         no stderr notice when the daemon cannot be reached
 *   STEPTRACE_BLOCK_WHEN_FULL=1  a full buffer waits (bounded) for its reader
 *   STEPTRACE_SHM_RINGS=0     buffers in private memory, all events over the socket
 *                             (events still buffered are lost if the process is killed)
 *   STEPTRACE_CLOCK=monotonic    timestamp with clock_gettime instead of the TSC
 *                                (the TSC is used only when invariant; =tsc forces it then)
 *   STEPTRACE_BUFFER_BYTES=4M    per-thread buffer, 64K..1G, rounded down to a power of 2
 *   STEPTRACE_BUFFER_TOTAL_BYTES=256M  all buffers of the process together, 64K..1024G
 *                             (sizes: bytes, or with a K, M or G suffix = KiB, MiB, GiB;
 *                             a bad value prints one line on stderr and keeps the default)
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

/* Where steptraced listens by default: proto/commands.h's kDefaultSocketPath, which the
 * library's build checks this against. */
#define STEPTRACE_DEFAULT_SOCKET "/run/steptrace/steptraced.sock"

/* C naming, fixed by the ABI. NOLINTBEGIN(readability-identifier-naming) */
/* The built-in steps: the wire's step ids (PROTOCOL.md 4.5); the library's build checks
 * them against its table of built-in steps. */
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

/* Why events were dropped: each one counts under exactly one cause (steptrace_dropped is
 * their sum). The daemon gets the same four counts (PROTOCOL.md 4.7a). */
enum steptrace_drop_cause {
  /* A thread's buffer was full while connected to the daemon (the daemon or the
   * background thread did not keep up), the thread got no buffer at all (the total of
   * steptrace_set_buffer_size was used up), or the VRAM-ledger queue was full while
   * connected. */
  STEPTRACE_DROP_BUFFER_FULL = 0,
  /* Recorded while no daemon connection existed and the buffer was full (before the
   * first connection, daemon absent, stopped or restarting), recorded after
   * steptrace_shutdown or exit, ledger queue full while not connected, buffers of exited
   * threads freed unsent (more than 64 waiting, or room needed for a live thread), and
   * events still buffered when the process exits unconnected. */
  STEPTRACE_DROP_NOT_CONNECTED = 1,
  /* Lost with a connection: sent on one the daemon ended (killed, restarted, refusing)
   * or that failed before the daemon acknowledged them, or not completely written when
   * the library closed it (steptrace_shutdown, exit); and events still buffered when the
   * process exits while connected (the final bounded flush at exit did not take them),
   * in a buffer the daemon does not map: one it maps is read by the daemon after the
   * exit, and loses nothing. */
  STEPTRACE_DROP_IN_FLIGHT = 2,
  /* Refused by the library: an unknown step id (neither built-in nor registered), a
   * ledger call with a null or empty GPU UUID or a lease outside 1 ms .. 7 days, or a
   * lease renewal while connected to a daemon too old for leases (protocol < 3). */
  STEPTRACE_DROP_INVALID = 3
};
#define STEPTRACE_DROP_CAUSE_COUNT 4
/* NOLINTEND(readability-identifier-naming) */

/* Connects to the daemon now (NULL: $STEPTRACE_SOCKET, then the default path) and starts
 * the flusher thread. Optional (the library connects by itself at the first event, see
 * above); call it to choose the path in code, to know at once whether the daemon is
 * reachable, or to connect again after steptrace_shutdown or with STEPTRACE_AUTOCONNECT=0.
 * After an auto-connect it switches to `socket_path` when that differs. 0 on success,
 * -errno when the daemon cannot be reached now (the once-per-process stderr notice says
 * so too); recording works either way and the flusher keeps reconnecting with backoff.
 * With STEPTRACE_DISABLE=1: 0, and nothing starts. */
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
/* A reservation with a lease: unless its holder renews it within `lease_ms` (1 ms ..
 * 7 days) of the reservation or of the last renewal, the daemon marks it EXPIRED (a
 * worker that hangs without dying), and any process may then clean it up. To a daemon
 * too old for leases (protocol version < 3) it is sent as steptrace_ledger_reserve. */
STEPTRACE_EXPORT void steptrace_ledger_reserve_lease(const char* gpu_uuid, uint64_t reservation_id,
                                                     uint64_t bytes, const char* task,
                                                     uint32_t lease_ms);
/* Renews the lease of this process's (or its uid's) reservation for `lease_ms` from now;
 * gives a reservation without a lease one, and revives an EXPIRED one. */
STEPTRACE_EXPORT void steptrace_ledger_renew(const char* gpu_uuid, uint64_t reservation_id,
                                             uint32_t lease_ms);
STEPTRACE_EXPORT void steptrace_vram_sample(const char* gpu_uuid, uint64_t free_bytes,
                                            uint64_t total_bytes);

/* 0 once the daemon has applied every event recorded before the call; -ETIMEDOUT
 * otherwise, or -ENOTCONN when not connected: at once when nothing started the
 * background thread (no event, ledger call, register_step or steptrace_connect yet;
 * STEPTRACE_DISABLE=1; STEPTRACE_AUTOCONNECT=0 without steptrace_connect; after
 * steptrace_shutdown), else after one immediate connection attempt (not the whole
 * timeout) when the daemon cannot be reached. After an auto-connect still under way it
 * waits for that connection like after steptrace_connect. */
STEPTRACE_EXPORT int steptrace_flush(int timeout_ms);

/* Events this process could not deliver: the sum of steptrace_dropped_by_cause over
 * all causes. That includes STEPTRACE_DROP_INVALID: the span and ledger calls refused
 * for their arguments (counted by steptrace_rejected too, with refused registrations)
 * and lease renewals a daemon older than protocol 3 cannot take. */
STEPTRACE_EXPORT uint64_t steptrace_dropped(void);

/* Events dropped for `cause` (enum steptrace_drop_cause) so far; 0 for an unknown
 * cause. */
STEPTRACE_EXPORT uint64_t steptrace_dropped_by_cause(int cause);

/* Calls refused for their arguments, a count of its own (a mistake in the program, not a
 * loss of the daemon's): steptrace_register_step with a NULL, empty, overlong (> 63) or
 * non-printable-ASCII name, or past the per-process limit; steptrace_start/end with an id
 * that is neither built-in nor registered; a ledger call with a NULL or empty GPU UUID or
 * a lease outside 1 ms .. 7 days. The span and ledger calls among them are also counted
 * as events dropped for STEPTRACE_DROP_INVALID, which is how the daemon learns of them; a
 * refused registration records nothing else. (New with protocol version 4.) */
STEPTRACE_EXPORT uint64_t steptrace_rejected(void);

/* Sizes the event buffers of threads whose first event comes after the call (existing
 * buffers keep their size): per_thread_bytes for each thread (64 KiB .. 1 GiB, rounded
 * down to a power of two; default 4 MiB or $STEPTRACE_BUFFER_BYTES) and total_bytes for
 * all of them together (64 KiB .. 1 TiB; default 256 MiB or
 * $STEPTRACE_BUFFER_TOTAL_BYTES). 0 keeps the current value of that argument. Returns 0,
 * or -EINVAL (nothing changed) when a non-zero value is out of range. */
STEPTRACE_EXPORT int steptrace_set_buffer_size(uint64_t per_thread_bytes, uint64_t total_bytes);

STEPTRACE_EXPORT void steptrace_set_enabled(int on);

/* Opt-in backpressure: with on != 0 a full thread buffer waits up to a bounded time for
 * its reader (the daemon, or the flusher on the socket path) instead of dropping. Off by
 * default. */
STEPTRACE_EXPORT void steptrace_set_block_when_full(int on);

/* Flushes briefly (bounded), stops the flusher and disconnects. Recording after it is
 * dropped and counted until steptrace_connect is called again (no auto-connect after
 * it). At exit the library does the same by itself, auto-connected or not. */
STEPTRACE_EXPORT void steptrace_shutdown(void);

#ifdef __cplusplus
}
#endif

#endif /* STEPTRACE_STEPTRACE_H_ */
