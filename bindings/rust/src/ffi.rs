//! The C ABI of libsteptrace (`<steptrace/steptrace.h>`), declared by hand.
//!
//! Every function is safe to call from any thread, before `steptrace_connect` and after
//! the daemon died; none blocks except `steptrace_connect`, `steptrace_flush` (bounded)
//! and `steptrace_shutdown` (bounded). The wrappers in the crate root are the safe way
//! to call them; these are here for code that wants the raw ids (`steptrace_start` with
//! an id that is neither built-in nor registered is dropped and counted as invalid, and
//! counted by `steptrace_rejected`). Strings are NUL-terminated; a null `gpu_uuid` is
//! refused by the library (counted as invalid and rejected), a null `task` means none.

use std::os::raw::{c_char, c_int};

/// `steptrace_register_step` returns this when it refuses a name.
pub const STEPTRACE_INVALID_STEP: u32 = u32::MAX;

/// `STEPTRACE_DROP_CAUSE_COUNT`: the causes of `steptrace_dropped_by_cause` are 0..4.
pub const STEPTRACE_DROP_CAUSE_COUNT: c_int = 4;

extern "C" {
    /// 0, or -errno when the daemon cannot be reached now (recording works either way).
    pub fn steptrace_connect(socket_path: *const c_char) -> c_int;
    /// A custom step id, or [`STEPTRACE_INVALID_STEP`].
    pub fn steptrace_register_step(name: *const c_char) -> u32;
    /// Starts a span of `step` on the calling thread.
    pub fn steptrace_start(step: u32);
    /// Ends the innermost open span of `step` on the calling thread.
    pub fn steptrace_end(step: u32);
    /// A VRAM reservation of `bytes` on a GPU.
    pub fn steptrace_ledger_reserve(
        gpu_uuid: *const c_char,
        reservation_id: u64,
        bytes: u64,
        task: *const c_char,
    );
    /// The release of a reservation.
    pub fn steptrace_ledger_release(gpu_uuid: *const c_char, reservation_id: u64);
    /// The cleanup of another process's reservation.
    pub fn steptrace_ledger_cleanup(gpu_uuid: *const c_char, reservation_id: u64, holder_pid: u32);
    /// A reservation that expires unless renewed within `lease_ms` (1 ms .. 7 days).
    pub fn steptrace_ledger_reserve_lease(
        gpu_uuid: *const c_char,
        reservation_id: u64,
        bytes: u64,
        task: *const c_char,
        lease_ms: u32,
    );
    /// Renews a reservation's lease for `lease_ms` from now.
    pub fn steptrace_ledger_renew(gpu_uuid: *const c_char, reservation_id: u64, lease_ms: u32);
    /// A sample of a GPU's free and total memory.
    pub fn steptrace_vram_sample(gpu_uuid: *const c_char, free_bytes: u64, total_bytes: u64);
    /// 0 once the daemon applied every event recorded before; -ETIMEDOUT or -ENOTCONN.
    pub fn steptrace_flush(timeout_ms: c_int) -> c_int;
    /// Events this process could not deliver (all causes).
    pub fn steptrace_dropped() -> u64;
    /// Events dropped for one cause (0..[`STEPTRACE_DROP_CAUSE_COUNT`]).
    pub fn steptrace_dropped_by_cause(cause: c_int) -> u64;
    /// Calls refused for their arguments: bad step names at registration (or past the
    /// limit of custom steps), start/end with an unknown id, ledger calls with a null or
    /// empty GPU UUID or a lease out of range. New with protocol version 4.
    pub fn steptrace_rejected() -> u64;
    /// Buffer sizes of threads whose first event comes later; 0 or -EINVAL.
    pub fn steptrace_set_buffer_size(per_thread_bytes: u64, total_bytes: u64) -> c_int;
    /// Records (on != 0) or not.
    pub fn steptrace_set_enabled(on: c_int);
    /// A full buffer waits (bounded) for the flusher instead of dropping (on != 0).
    pub fn steptrace_set_block_when_full(on: c_int);
    /// Flushes briefly, stops the flusher and disconnects.
    pub fn steptrace_shutdown();
}
