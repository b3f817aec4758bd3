// Unit tests: nothing here connects to a daemon (tests/ has those), so the library's
// process-wide state, which these tests share, stays unconnected.

use super::*;
use crate::trace::{TraceMeasurement, Tracer};

// A file of the source tree, when the crate is built from one (not when vendored alone).
fn source_file(relative: &str) -> Option<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(relative);
    match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) => {
            eprintln!(
                "skipped: {} not readable ({e}): not in a steptrace source tree",
                path.display()
            );
            None
        }
    }
}

const NAMES: [&str; 12] = [
    "Forward",
    "Backward",
    "Matmul",
    "Attention",
    "Transpose",
    "Alloc",
    "Transfer",
    "LedgerReserve",
    "LedgerCleanup",
    "VramQuery",
    "WaitPoll",
    "LedgerRelease",
];

#[test]
fn display_is_the_step_name_as_the_in_process_tracer_printed_it() {
    for (step, name) in TraceStep::ALL.iter().zip(NAMES) {
        assert_eq!(step.to_string(), name);
        // The in-process tracer's Display was `write!(f, "{self:?}")` over a derived Debug...
        assert_eq!(format!("{step:?}"), name);
        // ... which ignores width and alignment; so does this one.
        assert_eq!(format!("{step:>20}"), name);
        assert_eq!(format!("{:<15}|", step.to_string()), format!("{name:<15}|"));
    }
}

#[test]
fn ids_are_dense_and_round_trip() {
    for (i, step) in TraceStep::ALL.iter().enumerate() {
        assert_eq!(step.id(), i as u32);
        assert_eq!(TraceStep::from_id(i as u32), Some(*step));
        assert_eq!(TraceStep::from_name(step.name()), Some(*step));
        assert_eq!(Step::from(*step).id(), i as u32);
        assert_eq!(Step::from(*step).builtin(), Some(*step));
    }
    assert_eq!(TraceStep::from_id(12), None);
    assert_eq!(TraceStep::from_name("forward"), None);
}

#[test]
fn steps_are_proto_steps_h() {
    let text = match source_file("proto/steps.h") {
        Some(text) => text,
        None => return,
    };
    let mut table = Vec::new();
    for line in text.lines() {
        let row = match line.trim().strip_prefix("BuiltinStep{") {
            Some(row) => row,
            None => continue,
        };
        let fields: Vec<&str> = row.trim_end_matches("},").split(',').map(str::trim).collect();
        assert_eq!(fields.len(), 3, "unexpected row in proto/steps.h: {line}");
        let id: u32 = fields[0].parse().expect("an id");
        table.push((id, fields[1].trim_matches('"').to_string(), fields[2] == "true"));
    }
    let ours: Vec<(u32, String, bool)> =
        TraceStep::ALL.iter().map(|s| (s.id(), s.name().to_string(), s.is_ledger_step())).collect();
    assert_eq!(ours, table, "TraceStep must be proto/steps.h's kBuiltinSteps exactly");
}

#[test]
fn steps_are_the_c_enum() {
    let text = match source_file("client/include/steptrace/steptrace.h") {
        Some(text) => text,
        None => return,
    };
    let body = text
        .split("enum steptrace_step {")
        .nth(1)
        .and_then(|rest| rest.split("};").next())
        .expect("enum steptrace_step in steptrace.h");
    let mut enumerators = Vec::new();
    for item in body.split(',') {
        let mut parts = item.split('=').map(str::trim);
        if let (Some(name), Some(value)) = (parts.next(), parts.next()) {
            enumerators.push((name.to_string(), value.parse::<u32>().expect("a value")));
        }
    }
    // LedgerReserve -> STEPTRACE_LEDGER_RESERVE
    let ours: Vec<(String, u32)> = TraceStep::ALL
        .iter()
        .map(|s| {
            let mut c_name = String::from("STEPTRACE");
            for ch in s.name().chars() {
                if ch.is_ascii_uppercase() {
                    c_name.push('_');
                }
                c_name.push(ch.to_ascii_uppercase());
            }
            (c_name, s.id())
        })
        .collect();
    assert_eq!(ours, enumerators);
}

#[test]
fn custom_steps_register_by_name() {
    let a = register_step("UnitCustomA").expect("a valid name");
    let b = CustomStep::register("UnitCustomB").expect("a valid name");
    assert!(a.id() >= 256, "custom ids start at 256: {}", a.id());
    assert_ne!(a.id(), b.id());
    assert_eq!(register_step("UnitCustomA").expect("again"), a);
    assert_eq!(a.name(), "UnitCustomA");
    assert_eq!(a.to_string(), "UnitCustomA");
    assert_eq!(Step::from(&a), a.step());
    assert_eq!(a.step().builtin(), None);
    assert_eq!(Step::named("Matmul"), Ok(Step::from(TraceStep::Matmul)));
    assert_eq!(Step::named("UnitCustomB"), Ok(b.step()));
}

#[test]
fn invalid_step_names_are_errors() {
    let too_long = "x".repeat(64);
    for name in ["", "tab\there", "del\u{7f}", "caf\u{e9}", too_long.as_str()] {
        match register_step(name) {
            Err(Error::InvalidStepName(refused)) => assert_eq!(refused, name),
            other => panic!("{name:?}: expected InvalidStepName, got {other:?}"),
        }
    }
    assert!(register_step(&"x".repeat(63)).is_ok());
    assert_eq!(
        register_step("nul\0inside"),
        Err(Error::InteriorNul { argument: "step name", position: 3 })
    );
    assert!(Step::named("").is_err());
    let e = register_step("").unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("\"\""), "{e}");
}

#[test]
fn interior_nul_is_an_error_and_sends_nothing() {
    let before = drop_counts();
    let nul = |argument: &'static str, position: usize| -> Result<(), Error> {
        Err(Error::InteriorNul { argument, position })
    };
    assert_eq!(ledger::reserve("GPU\0x", 1, 2, "task"), nul("gpu uuid", 3));
    assert_eq!(ledger::reserve("GPU-x", 1, 2, "t\0"), nul("task", 1));
    assert_eq!(ledger::reserve_lease("\0", 1, 2, "t", Duration::from_secs(1)), nul("gpu uuid", 0));
    assert_eq!(ledger::reserve_lease("GPU", 1, 2, "\0", Duration::from_secs(1)), nul("task", 0));
    assert_eq!(ledger::renew("G\0", 1, Duration::from_secs(1)), nul("gpu uuid", 1));
    assert_eq!(ledger::release("G\0", 1), nul("gpu uuid", 1));
    assert_eq!(ledger::cleanup("G\0", 1, 42), nul("gpu uuid", 1));
    assert_eq!(ledger::vram_sample("G\0", 1, 2), nul("gpu uuid", 1));
    assert_eq!(connect("/tmp/\0.sock"), nul("socket path", 5));
    assert!(!connect_called(), "a refused path does not count as connecting");
    assert_eq!(drop_counts(), before);
    let e = ledger::release("G\0", 1).unwrap_err();
    assert_eq!(e.to_string(), "steptrace: the gpu uuid has a NUL byte at offset 1");
    assert_eq!(io::Error::from(e).kind(), io::ErrorKind::InvalidInput);
}

#[test]
fn flush_without_connect_is_not_connected() {
    let e = flush(Duration::from_millis(100)).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::NotConnected, "{e}");
    assert!(!e.is_timed_out());
    assert!(e.raw_os_error().is_some());
    assert!(e.to_string().starts_with("steptrace: steptrace_flush: "), "{e}");
}

#[test]
fn buffer_size_out_of_range_is_an_error() {
    let e = set_buffer_size(1024, 0).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    assert_eq!(set_buffer_size(0, 0), Ok(()));
}

#[test]
fn drop_counts_sum_to_dropped() {
    let counts = drop_counts();
    assert_eq!(counts.total(), dropped());
    let by_cause: Vec<u64> = DropCause::ALL.iter().map(|c| dropped_by_cause(*c)).collect();
    assert_eq!(
        by_cause,
        vec![counts.buffer_full, counts.not_connected, counts.in_flight, counts.invalid]
    );
    let names: Vec<String> = DropCause::ALL.iter().map(|c| c.to_string()).collect();
    assert_eq!(names, ["buffer_full", "not_connected", "in_flight", "invalid"]);
}

#[test]
fn spans_return_the_value_and_end_on_panic() {
    // Recorded into this thread's buffer (not connected: nothing is sent).
    assert_eq!(span(TraceStep::Forward, || 42), 42);
    let custom = register_step("UnitSpan").expect("valid");
    assert_eq!(span(&custom, || "done"), "done");
    let guard = SpanGuard::new(TraceStep::Backward);
    assert_eq!(guard.step(), Step::from(TraceStep::Backward));
    guard.end();
    let caught: std::thread::Result<()> =
        std::panic::catch_unwind(|| span(TraceStep::Matmul, || panic!("inside a span")));
    assert!(caught.is_err());
    start(TraceStep::Alloc);
    end(TraceStep::Alloc);
}

#[test]
fn daemon_command_takes_one_line() {
    for bad in ["report\nping", "ping\r", "a\0b"] {
        let e = daemon_command(bad).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{bad:?}");
    }
}

#[test]
fn disabled_tracer_passes_through() {
    let tracer = Tracer::new();
    assert!(!tracer.is_enabled());
    assert!(!Tracer::default().is_enabled());
    assert!(!crate::trace::TRACER.is_enabled());
    assert_eq!(tracer.span(TraceStep::Forward, "test", || 42), 42);
    tracer.start(TraceStep::Forward);
    tracer.end(TraceStep::Forward, "no panic");
    tracer.end(TraceStep::Attention, String::from("no start"));
    tracer.disable();
    assert!(!tracer.is_enabled());
    assert_eq!(format!("{tracer:?}"), "Tracer { enabled: false }");
    // Never enabled, never connected: the in-process tracer's empty report.
    assert!(tracer.report().contains("No measurements recorded"));
    tracer.clear();
    let global: &Tracer = &crate::trace::TRACER;
    assert!(!global.is_enabled());
}

#[test]
fn trace_measurement_is_plain_data() {
    let m = TraceMeasurement {
        step: TraceStep::Backward,
        duration: Duration::from_micros(50),
        metadata: "grad".to_string(),
    };
    let copy = m.clone();
    assert_eq!(copy.step, m.step);
    assert_eq!(copy.duration, m.duration);
    assert!(format!("{m:?}").contains("TraceMeasurement"));
}
