// steptrace::rejected(), the calls the library refuses for their arguments, read before
// and after each such call. Its own file, so its own process (cargo runs each file of
// tests/ as one binary): no other test moves the process-wide counters between two reads,
// and they start at 0. No daemon: refusals are counted whether connected or not (ctest
// points STEPTRACE_SOCKET at a path nobody listens on, tests/rust/CMakeLists.txt).

use std::ptr;
use std::time::Duration;

use steptrace::{ffi, ledger, Error, TraceStep};

const GPU: &str = "GPU-rust-rejected-test";

/// (rejected, dropped as invalid)
fn counts() -> (u64, u64) {
    (steptrace::rejected(), steptrace::drop_counts().invalid)
}

#[test]
fn refused_calls_are_counted() {
    assert_eq!(counts(), (0, 0));

    // Accepted calls count nothing, nor do NUL bytes (an Error here, never sent).
    let custom = steptrace::register_step("RustRejectedStep").expect("a valid name");
    steptrace::span(&custom, || {});
    steptrace::span(TraceStep::Forward, || {});
    ledger::release(GPU, 1).expect("release");
    ledger::reserve_lease(GPU, 2, 1, "task", Duration::from_secs(60)).expect("lease");
    assert!(matches!(steptrace::register_step("nul\0"), Err(Error::InteriorNul { .. })));
    assert!(ledger::release("G\0", 1).is_err());
    assert_eq!(counts(), (0, 0));

    // Names the library refuses: an Err each, counted, and no event dropped.
    let too_long = "x".repeat(64);
    for (i, name) in ["", "tab\there", "caf\u{e9}", too_long.as_str()].iter().enumerate() {
        match steptrace::register_step(name) {
            Err(Error::InvalidStepName(refused)) => assert_eq!(&refused, name),
            other => panic!("{name:?}: expected InvalidStepName, got {other:?}"),
        }
        assert_eq!(counts(), (i as u64 + 1, 0), "after {name:?}");
    }

    // The safe ledger wrappers pass these on to the library: counted, and dropped as
    // invalid.
    ledger::release("", 1).expect("an empty UUID is not an Error here");
    ledger::vram_sample("", 1, 2).expect("sample");
    ledger::reserve_lease(GPU, 3, 1, "task", Duration::ZERO).expect("lease 0");
    ledger::renew(GPU, 3, Duration::from_secs(8 * 24 * 3600)).expect("lease > 7 days");
    assert_eq!(counts(), (8, 4));

    // Ids neither built-in nor registered, and a null UUID: only the raw ABI can send them.
    // SAFETY: no pointer but a null gpu_uuid, which the library refuses.
    unsafe {
        ffi::steptrace_start(12);
        ffi::steptrace_end(256 + 5000);
        ffi::steptrace_ledger_release(ptr::null(), 1);
    }
    assert_eq!(counts(), (11, 7));
    // SAFETY: no argument.
    assert_eq!(unsafe { ffi::steptrace_rejected() }, 11);

    // Not recording: span and ledger calls return unchecked; registration is still checked.
    steptrace::set_enabled(false);
    // SAFETY: no pointer.
    unsafe { ffi::steptrace_start(12) };
    ledger::release("", 1).expect("release");
    assert!(steptrace::register_step("").is_err());
    steptrace::set_enabled(true);
    assert_eq!(counts(), (12, 7));
}
