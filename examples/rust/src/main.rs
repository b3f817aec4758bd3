//! A toy trainer that records its steps with steptrace. It was written against an
//! in-process tracer (`TRACER`); moving it over changed one line, the `use` below.
//!
//!     STEPTRACE_SOCKET=/path/to/steptraced.sock steptrace-example-trainer [STEPS]
//!
//! Each step: Forward (two Matmul and an Attention inside), Backward (two Matmul), and a
//! custom step, Optimizer; around them a VRAM reservation and its release. At the end it
//! flushes, prints the daemon's report for this process, and exits with 2 when the
//! daemon did not confirm every event (1 on bad arguments).

use std::process::ExitCode;
use std::time::Duration;

use steptrace::ledger;
use steptrace::trace::{TraceStep, TRACER}; // was: use entrenar::trace::{TraceStep, TRACER};

const N: usize = 16;
const GPU: &str = "GPU-00000000-example-rust-0000-000000000000";

fn matmul(a: &[f32], b: &[f32], c: &mut [f32]) {
    TRACER.span(TraceStep::Matmul, "16x16", || {
        for i in 0..N {
            for j in 0..N {
                c[i * N + j] = (0..N).map(|k| a[i * N + k] * b[k * N + j]).sum();
            }
        }
    });
}

fn attention(x: &[f32]) -> f32 {
    TRACER.span(TraceStep::Attention, "1 head", || {
        let max = x.iter().copied().fold(f32::MIN, f32::max);
        let weights: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
        let total: f32 = weights.iter().sum();
        weights.iter().zip(x).map(|(w, v)| w / total * v).sum()
    })
}

fn main() -> ExitCode {
    let steps: u32 = match std::env::args().nth(1).map(|arg| arg.parse()) {
        None => 10,
        Some(Ok(n)) => n,
        Some(Err(e)) => {
            eprintln!("usage: steptrace-example-trainer [STEPS] ({e})");
            return ExitCode::from(1);
        }
    };
    // Connects to $STEPTRACE_SOCKET (else /run/steptrace/steptraced.sock); without a
    // daemon it runs all the same: its events wait in the buffer until one is reachable,
    // and those that find the buffer full (or are left at exit) are counted as dropped.
    TRACER.enable();

    // A custom step, reported under its name.
    let optimizer = match steptrace::register_step("Optimizer") {
        Ok(step) => step,
        Err(e) => {
            eprintln!("example-trainer: {e}");
            return ExitCode::from(1);
        }
    };

    let reservation = u64::from(std::process::id());
    let reserved = TRACER.span(TraceStep::LedgerReserve, "weights", || {
        ledger::reserve(GPU, reservation, 64 << 20, "example-rust")
    });
    if let Err(e) = reserved {
        eprintln!("example-trainer: {e}");
        return ExitCode::from(1);
    }

    let mut weights: Vec<f32> = (0..N * N).map(|i| (i % 7) as f32 * 0.01).collect();
    let inputs: Vec<f32> = (0..N * N).map(|i| (i % 5) as f32 * 0.1).collect();
    let mut hidden = vec![0.0; N * N];
    let mut grads = vec![0.0; N * N];
    let mut loss = 0.0;
    for step in 0..steps {
        TRACER.span(TraceStep::Forward, format!("step {step}"), || {
            matmul(&inputs, &weights, &mut hidden);
            let mut out = vec![0.0; N * N];
            matmul(&hidden, &weights, &mut out);
            loss = attention(&out[..N]);
        });
        TRACER.span(TraceStep::Backward, "", || {
            matmul(&hidden, &inputs, &mut grads);
            let mut scratch = vec![0.0; N * N];
            matmul(&grads, &weights, &mut scratch);
        });
        TRACER.span(&optimizer, "sgd", || {
            for (w, g) in weights.iter_mut().zip(&grads) {
                *w -= 1e-3 * g;
            }
        });
    }

    let released = TRACER.span(TraceStep::LedgerRelease, "", || ledger::release(GPU, reservation));
    if let Err(e) = released {
        eprintln!("example-trainer: {e}");
        return ExitCode::from(1);
    }

    let flushed = steptrace::flush(Duration::from_secs(5));
    print!("{}", TRACER.report());
    println!(
        "example-trainer: {steps} steps, loss {loss:.4}, {} events dropped",
        steptrace::dropped()
    );
    match flushed {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("example-trainer: the daemon did not confirm every event: {e}");
            ExitCode::from(2)
        }
    }
}
