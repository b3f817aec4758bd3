// The crate against the real steptraced (STEPTRACE_DAEMON) on a temporary socket: spans,
// custom steps, the drop-in TRACER and the ledger recorded through the crate, flushed, and
// the daemon's `report --json` / `ledger --json` checked for the exact counts.
//
// One test function: the library's state is per process (one connection, one set of
// drop counters), so the steps run in order.

mod common;

use std::time::Duration;

use common::{counts, step_counts, Daemon, Json};
use steptrace::trace::{Tracer, TRACER};
use steptrace::{ledger, span, DropCounts, SpanGuard, TraceStep};

const GPU: &str = "GPU-rust-binding-test";

#[test]
fn spans_and_ledger_reach_the_daemon() {
    let daemon = Daemon::start();
    let pid = std::process::id();
    steptrace::connect(&daemon.socket).expect("connect");
    assert_eq!(steptrace::socket_path(), daemon.socket);

    // Built-in steps: closures, guards, and start/end.
    for _ in 0..10 {
        span(TraceStep::Forward, || {
            let _matmul = SpanGuard::new(TraceStep::Matmul);
        });
    }
    for _ in 0..3 {
        steptrace::start(TraceStep::Transpose);
        steptrace::end(TraceStep::Transpose);
    }
    let caught: std::thread::Result<()> =
        std::panic::catch_unwind(|| span(TraceStep::Backward, || panic!("the span still ends")));
    assert!(caught.is_err());

    // Custom steps.
    let custom = steptrace::register_step("RustStep").expect("a valid name");
    assert_eq!(steptrace::register_step("RustStep").expect("again").id(), custom.id());
    let doubled: Vec<u32> = (0..5).map(|i| span(&custom, || i * 2)).collect();
    assert_eq!(doubled, [0, 2, 4, 6, 8]);
    assert!(steptrace::register_step("").is_err());
    assert!(steptrace::register_step("bad\0name").is_err());

    // The drop-in tracer: already connected, so enable() does not reconnect.
    assert!(!TRACER.is_enabled());
    TRACER.enable();
    assert!(TRACER.is_enabled());
    assert_eq!(TRACER.span(TraceStep::Attention, "4 heads", || "done"), "done");
    assert_eq!(TRACER.span(TraceStep::Attention, "4 heads", || 7), 7);
    TRACER.start(TraceStep::Alloc);
    TRACER.end(TraceStep::Alloc, "1 MiB");
    let disabled = Tracer::new();
    assert_eq!(disabled.span(TraceStep::Transfer, "not recorded", || 1), 1);
    disabled.start(TraceStep::Transfer);
    disabled.end(TraceStep::Transfer, "not recorded");

    // The ledger, each call inside its ledger step's span.
    span(TraceStep::LedgerReserve, || ledger::reserve(GPU, 21, 4096, "rs-task")).expect("reserve");
    span(TraceStep::LedgerReserve, || {
        ledger::reserve_lease(GPU, 24, 1024, "rs-lease", Duration::from_secs(600))
    })
    .expect("reserve_lease");
    span(TraceStep::LedgerReserve, || ledger::reserve(GPU, 22, 512, "short")).expect("reserve");
    span(TraceStep::LedgerRelease, || ledger::release(GPU, 22)).expect("release");
    span(TraceStep::VramQuery, || ledger::vram_sample(GPU, 1 << 30, 2 << 30)).expect("sample");
    assert!(ledger::reserve(GPU, 23, 1, "nul\0task").is_err());

    steptrace::flush(Duration::from_secs(10)).expect("flush");
    assert_eq!(steptrace::dropped(), 0);
    assert_eq!(steptrace::drop_counts(), DropCounts::default());

    let process = daemon.process_report(pid);
    assert_eq!(
        step_counts(&process),
        counts(&[
            ("Forward", 10),
            ("Backward", 1),
            ("Matmul", 10),
            ("Attention", 2),
            ("Transpose", 3),
            ("Alloc", 1),
            ("LedgerReserve", 3),
            ("VramQuery", 1),
            ("LedgerRelease", 1),
            ("RustStep", 5),
        ])
    );
    for field in ["dropped", "unmatched_ends", "abandoned"] {
        assert_eq!(process.get(field).as_u64(), 0, "{field}");
    }

    let ledger_view = Json::parse(&daemon.command("ledger --json").expect("ledger")).expect("json");
    let mut held: Vec<(u64, u64, u64)> = Vec::new();
    for gpu in ledger_view.get("gpus").as_array() {
        if gpu.get("gpu").as_str() == GPU {
            for r in gpu.get("reservations").as_array() {
                held.push((r.get("id").as_u64(), r.get("pid").as_u64(), r.get("bytes").as_u64()));
            }
        }
    }
    held.sort_unstable();
    let pid64 = u64::from(pid);
    assert_eq!(held, [(21, pid64, 4096), (24, pid64, 1024)]);

    // The drop-in's report is the daemon's text report for this process.
    let text = TRACER.report();
    assert!(text.contains(&format!("pid {pid}")), "{text}");
    for name in ["Attention", "Forward", "RustStep", "% Time"] {
        assert!(text.contains(name), "{name} not in\n{text}");
    }
    // The library's own command helper, on the socket connect was given.
    assert!(steptrace::daemon_command("ping").expect("ping").starts_with("pong"));

    // A renewal: refused by the library (counted as invalid) while connected to a daemon
    // older than leases (protocol < 3).
    let version = Json::parse(&daemon.command("version").expect("version")).expect("json");
    let leases = version.get("protocol").as_u64() >= 3;
    ledger::renew(GPU, 24, Duration::from_secs(600)).expect("renew");
    steptrace::flush(Duration::from_secs(10)).expect("flush");
    let invalid_after_renew = if leases { 0 } else { 1 };
    assert_eq!(
        steptrace::drop_counts().invalid,
        invalid_after_renew,
        "protocol 3 or later: {leases}"
    );

    // An id neither built-in nor registered (only the raw C ABI can send one).
    unsafe { steptrace::ffi::steptrace_start(5000) };
    let after = steptrace::drop_counts();
    assert_eq!(after.invalid, invalid_after_renew + 1);
    assert_eq!(after.total(), steptrace::dropped());

    // Disabled for the process: nothing recorded, nothing dropped.
    steptrace::set_enabled(false);
    for _ in 0..1000 {
        span(TraceStep::Alloc, || {});
    }
    steptrace::set_enabled(true);
    steptrace::flush(Duration::from_secs(10)).expect("flush");
    assert_eq!(steptrace::dropped(), after.total());
    assert_eq!(step_counts(&daemon.process_report(pid)).get("Alloc"), Some(&1));

    // clear() resets this process's aggregates in the daemon.
    TRACER.clear();
    let cleared = step_counts(&daemon.process_report(pid));
    assert!(cleared.values().all(|n| *n == 0), "{cleared:?}");
    TRACER.disable();

    steptrace::shutdown();
    let e = steptrace::flush(Duration::from_millis(100)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::NotConnected, "{e}");
}
