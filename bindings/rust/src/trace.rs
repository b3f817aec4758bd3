//! A drop-in for an in-process training tracer (a global `TRACER` with `enable`,
//! `start`/`end`, `span` and `report`): a trainer moves over by changing one line,
//!
//! ```text
//! use entrenar::trace::{TraceStep, TRACER};   // before
//! use steptrace::trace::{TraceStep, TRACER};  // after
//! ```
//!
//! and its spans go to `steptraced` instead of a table in the process. Same names and
//! signatures: [`TraceStep`], [`TraceMeasurement`], [`Tracer`] (`new`, `default`,
//! `enable`, `disable`, `is_enabled`, `start`, `end`, `span`, `clear`, `report`) and
//! [`TRACER`]. Differences (see the crate's README):
//!
//! - `enable()` connects to the daemon (`$STEPTRACE_SOCKET`, else the default socket)
//!   the first time, unless [`crate::connect`] was called before.
//! - Spans are matched per thread and nest: `start` twice then `end` twice on one thread
//!   is two spans (the in-process tracer kept one start per step for all threads), and
//!   an `end` on another thread than its `start` does not end it.
//! - An `end` without a `start` is sent; the daemon counts it in `unmatched_ends`.
//! - `metadata` is accepted and ignored (as before).
//! - `report()` is the daemon's text report for this process (`steptrace report --pid
//!   PID`), after a bounded flush; it covers every `Tracer` of the process. `clear()`
//!   resets this process's aggregates in the daemon (`reset --pid PID`; allowed for
//!   the daemon's uid and root).

use std::fmt;
use std::ops::Deref;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::Step;
pub use crate::TraceStep;

// How long report() and clear() wait for the daemon to apply this process's events.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(1);

/// One span's step, duration and note: kept for code that names the type. The daemon
/// aggregates the spans now, so nothing here makes one.
#[derive(Debug, Clone)]
pub struct TraceMeasurement {
    /// The step measured.
    pub step: TraceStep,
    /// How long it took.
    pub duration: Duration,
    /// Free text.
    pub metadata: String,
}

/// A tracer that records while enabled (disabled when made). Recording is a call into
/// libsteptrace: no lock, no allocation.
pub struct Tracer {
    enabled: AtomicBool,
}

impl Tracer {
    /// A disabled tracer.
    pub const fn new() -> Tracer {
        Tracer { enabled: AtomicBool::new(false) }
    }

    /// Enables recording; the first time in the process, connects to the daemon unless
    /// the program called [`crate::connect`] (or `connect_default`) itself.
    pub fn enable(&self) {
        crate::connect_once();
        self.enabled.store(true, Ordering::Release);
    }

    /// Disables recording (a `span` already running still ends; an `end` after this
    /// is not sent, as before).
    pub fn disable(&self) {
        self.enabled.store(false, Ordering::Release);
    }

    /// Whether it records.
    pub fn is_enabled(&self) -> bool {
        self.enabled.load(Ordering::Acquire)
    }

    /// Starts a span of `step` on this thread (when enabled).
    pub fn start(&self, step: impl Into<Step>) {
        if self.is_enabled() {
            crate::start(step);
        }
    }

    /// Ends this thread's innermost open span of `step` (when enabled). `metadata` is
    /// ignored.
    pub fn end(&self, step: impl Into<Step>, metadata: impl Into<String>) {
        let _ = metadata;
        if self.is_enabled() {
            crate::end(step);
        }
    }

    /// Runs `f` inside a span of `step` (when enabled) and returns its value; the span
    /// ends even when `f` panics. `metadata` is ignored.
    #[inline]
    pub fn span<F, R>(&self, step: impl Into<Step>, metadata: impl Into<String>, f: F) -> R
    where
        F: FnOnce() -> R,
    {
        let _ = metadata;
        if !self.is_enabled() {
            return f();
        }
        crate::span(step, f)
    }

    /// Clears this process's aggregates in the daemon (`reset --pid PID`) after a bounded
    /// flush. Does nothing when the daemon cannot be reached or refuses (another uid).
    pub fn clear(&self) {
        if !crate::connect_called() {
            return;
        }
        let _ = crate::flush(FLUSH_TIMEOUT);
        let _ = crate::daemon_command(&format!("reset --pid {}", std::process::id()));
    }

    /// The daemon's text report for this process (`steptrace report --pid PID`), after a
    /// bounded flush: steps by time with count, duration and share, the compute versus
    /// overhead analysis, and the VRAM ledger. When nothing was ever enabled, the
    /// in-process tracer's "No measurements recorded" line; when the daemon cannot be
    /// reached, a line saying so.
    pub fn report(&self) -> String {
        if !crate::connect_called() {
            return "No measurements recorded. Enable tracing with TRACER.enable()".to_string();
        }
        let _ = crate::flush(FLUSH_TIMEOUT);
        let pid = std::process::id();
        match crate::daemon_command(&format!("report --pid {pid}")) {
            Ok(text) => text,
            Err(e) => format!(
                "No report: steptraced at {} did not answer ({e}). Run `steptrace report \
                 --pid {pid}` where it runs.\n",
                crate::socket_path().display()
            ),
        }
    }
}

impl Default for Tracer {
    fn default() -> Tracer {
        Tracer::new()
    }
}

impl fmt::Debug for Tracer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tracer").field("enabled", &self.is_enabled()).finish()
    }
}

/// The type of [`TRACER`]: a [`Tracer`] (it dereferences to one), so `TRACER.enable()`
/// and `&*TRACER` work as with a lazily made global.
pub struct GlobalTracer(Tracer);

impl Deref for GlobalTracer {
    type Target = Tracer;

    fn deref(&self) -> &Tracer {
        &self.0
    }
}

impl fmt::Debug for GlobalTracer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The global tracer, disabled until `TRACER.enable()`.
pub static TRACER: GlobalTracer = GlobalTracer(Tracer::new());
