//! VRAM-ledger annotations: who holds how much memory on which GPU.
//!
//! Timing comes from the span around each call: record a reservation inside a
//! [`TraceStep::LedgerReserve`](crate::TraceStep::LedgerReserve) span, a release inside a
//! `LedgerRelease` one, and so on; the daemon credits those spans' time to the GPU. A GPU
//! UUID or task longer than 63 bytes is cut by the library and refused by the daemon
//! (counted as an anomaly); an empty GPU UUID is refused by the library (counted as a
//! [`DropCause::Invalid`](crate::DropCause::Invalid) drop). A string with a NUL byte is an
//! error here and nothing is sent.

use std::time::Duration;

use crate::{c_string, ffi, Error};

/// A reservation of `bytes` on `gpu_uuid`, identified by `reservation_id` (unique per
/// GPU), held by this process for `task`.
pub fn reserve(gpu_uuid: &str, reservation_id: u64, bytes: u64, task: &str) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    let task = c_string("task", task)?;
    // SAFETY: both strings are NUL-terminated and outlive the call.
    unsafe { ffi::steptrace_ledger_reserve(gpu.as_ptr(), reservation_id, bytes, task.as_ptr()) };
    Ok(())
}

/// Like [`reserve`], with a lease: unless this process renews it ([`renew`]) within
/// `lease` (1 ms .. 7 days, in whole milliseconds) of the reservation or of the last
/// renewal, the daemon marks it EXPIRED and any process may clean it up. A lease out of
/// that range is refused by the library (a `DropCause::Invalid` drop). A daemon too old
/// for leases gets a plain reservation.
pub fn reserve_lease(
    gpu_uuid: &str,
    reservation_id: u64,
    bytes: u64,
    task: &str,
    lease: Duration,
) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    let task = c_string("task", task)?;
    // SAFETY: both strings are NUL-terminated and outlive the call.
    unsafe {
        ffi::steptrace_ledger_reserve_lease(
            gpu.as_ptr(),
            reservation_id,
            bytes,
            task.as_ptr(),
            lease_ms(lease),
        )
    };
    Ok(())
}

/// Renews the lease of a reservation of this process (or its uid) for `lease` from now;
/// gives a reservation without a lease one and revives an EXPIRED one. While connected
/// to a daemon too old for leases, the renewal is dropped (`DropCause::Invalid`).
pub fn renew(gpu_uuid: &str, reservation_id: u64, lease: Duration) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    // SAFETY: the string is NUL-terminated and outlives the call.
    unsafe { ffi::steptrace_ledger_renew(gpu.as_ptr(), reservation_id, lease_ms(lease)) };
    Ok(())
}

/// The release of reservation `reservation_id` on `gpu_uuid`.
pub fn release(gpu_uuid: &str, reservation_id: u64) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    // SAFETY: the string is NUL-terminated and outlives the call.
    unsafe { ffi::steptrace_ledger_release(gpu.as_ptr(), reservation_id) };
    Ok(())
}

/// The cleanup of a reservation left by `holder_pid` (a dead or expired holder), done by
/// this process; the daemon credits the cleanup to it.
pub fn cleanup(gpu_uuid: &str, reservation_id: u64, holder_pid: u32) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    // SAFETY: the string is NUL-terminated and outlives the call.
    unsafe { ffi::steptrace_ledger_cleanup(gpu.as_ptr(), reservation_id, holder_pid) };
    Ok(())
}

/// A sample of `gpu_uuid`'s free and total memory, in bytes.
pub fn vram_sample(gpu_uuid: &str, free_bytes: u64, total_bytes: u64) -> Result<(), Error> {
    let gpu = c_string("gpu uuid", gpu_uuid)?;
    // SAFETY: the string is NUL-terminated and outlives the call.
    unsafe { ffi::steptrace_vram_sample(gpu.as_ptr(), free_bytes, total_bytes) };
    Ok(())
}

/// Whole milliseconds, saturating at u32::MAX (out of the library's range either way).
fn lease_ms(lease: Duration) -> u32 {
    lease.as_millis().min(u128::from(u32::MAX)) as u32
}
