// examples/rust (a separate package using this crate, built by ctest's rust_example_build
// into the same target directory; STEPTRACE_EXAMPLE names the binary) run against a real
// steptraced: its spans arrive with the exact counts, and it prints the daemon's report.

mod common;

use std::env;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use common::{counts, step_counts, Daemon};

#[test]
fn example_trainer_reports_to_the_daemon() {
    let example = match env::var_os("STEPTRACE_EXAMPLE") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => panic!(
            "STEPTRACE_EXAMPLE is not set: it names the built examples/rust binary \
             (ctest -R rust builds it and sets it)"
        ),
    };
    let daemon = Daemon::start();
    let child = Command::new(&example)
        .arg("20")
        .env("STEPTRACE_SOCKET", &daemon.socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", example.display()));
    let pid = child.id();
    let output = child.wait_with_output().expect("example output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "{}: {}\n{stdout}\n{stderr}",
        example.display(),
        output.status
    );
    assert!(stdout.contains("example-trainer: 20 steps"), "{stdout}");
    assert!(stdout.contains(&format!("pid {pid}")), "the daemon's report:\n{stdout}");
    assert!(stdout.contains("Optimizer"), "{stdout}");
    assert!(stdout.contains(", 0 events dropped"), "{stdout}");

    let process = daemon.process_report(pid);
    assert_eq!(
        step_counts(&process),
        counts(&[
            ("Forward", 20),
            ("Backward", 20),
            ("Matmul", 80),
            ("Attention", 20),
            ("LedgerReserve", 1),
            ("LedgerRelease", 1),
            ("Optimizer", 20),
        ])
    );
    for field in ["dropped", "unmatched_ends", "abandoned"] {
        assert_eq!(process.get(field).as_u64(), 0, "{field}");
    }
}
