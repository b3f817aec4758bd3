//! Safe Rust bindings to libsteptrace: record spans and VRAM-ledger annotations in a
//! trainer; the daemon `steptraced` aggregates them and answers reports.
//!
//! ```no_run
//! use steptrace::{span, TraceStep};
//!
//! steptrace::connect_default().ok(); // $STEPTRACE_SOCKET, else /run/steptrace/steptraced.sock
//! let loss = span(TraceStep::Forward, || 0.25_f32);
//! {
//!     let _backward = steptrace::SpanGuard::new(TraceStep::Backward); // ends when dropped
//! }
//! let optimizer = steptrace::register_step("Optimizer").expect("a valid name");
//! span(&optimizer, || {});
//! span(TraceStep::LedgerReserve, || steptrace::ledger::reserve("GPU-1234", 7, 8 << 30, "qlora"))
//!     .expect("no NUL in the strings");
//! steptrace::flush(std::time::Duration::from_secs(1)).ok();
//! # let _ = loss;
//! ```
//!
//! Recording never blocks or fails: events that cannot be delivered are dropped and
//! counted ([`dropped`], [`drop_counts`]); calls the library refuses for their arguments
//! are counted by [`rejected`]. Errors ([`Error`]) are only for what the caller can fix: a
//! string with a NUL byte, a refused step name, a daemon that did not answer a [`flush`].
//! [`trace`] mirrors an in-process tracer's API (`TRACER`) for trainers that move over
//! from one.

#![warn(missing_docs)]

use std::ffi::CString;
use std::fmt;
use std::io::{self, Read, Write};
use std::marker::PhantomData;
use std::os::raw::c_int;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, Once, PoisonError};
use std::time::Duration;

pub mod ffi;
pub mod ledger;
pub mod trace;

/// The socket the library connects to when neither a path nor `$STEPTRACE_SOCKET` is given.
// proto/commands.h's kDefaultSocketPath (STEPTRACE_DEFAULT_SOCKET in C), checked by
// tests/default_socket.rs.
pub const DEFAULT_SOCKET: &str = "/run/steptrace/steptraced.sock";

// ---- steps ----------------------------------------------------------------------------

/// The built-in steps, with the wire's ids (`enum steptrace_step`, `proto/steps.h`).
/// `Display` prints the name reports use (`Forward`, ..., `LedgerRelease`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum TraceStep {
    /// The model's forward computation (id 0).
    Forward = 0,
    /// Gradients: the backward computation (id 1).
    Backward = 1,
    /// A matrix product (id 2).
    Matmul = 2,
    /// An attention block (id 3).
    Attention = 3,
    /// A transpose done on the CPU (id 4).
    Transpose = 4,
    /// Allocating memory (id 5).
    Alloc = 5,
    /// Copying between host and device (id 6).
    Transfer = 6,
    /// Reserving VRAM in the ledger (id 7, a ledger step).
    LedgerReserve = 7,
    /// Cleaning up a dead or expired holder's reservation (id 8, a ledger step).
    LedgerCleanup = 8,
    /// Asking the driver how much VRAM is free (id 9, a ledger step).
    VramQuery = 9,
    /// One poll while waiting for VRAM to become free (id 10, a ledger step).
    WaitPoll = 10,
    /// Releasing a reservation (id 11, a ledger step).
    LedgerRelease = 11,
}

impl TraceStep {
    /// Every built-in step, in id order.
    pub const ALL: [TraceStep; 12] = [
        TraceStep::Forward,
        TraceStep::Backward,
        TraceStep::Matmul,
        TraceStep::Attention,
        TraceStep::Transpose,
        TraceStep::Alloc,
        TraceStep::Transfer,
        TraceStep::LedgerReserve,
        TraceStep::LedgerCleanup,
        TraceStep::VramQuery,
        TraceStep::WaitPoll,
        TraceStep::LedgerRelease,
    ];

    /// The wire's step id.
    pub const fn id(self) -> u32 {
        self as u32
    }

    /// The name reports show.
    pub const fn name(self) -> &'static str {
        match self {
            TraceStep::Forward => "Forward",
            TraceStep::Backward => "Backward",
            TraceStep::Matmul => "Matmul",
            TraceStep::Attention => "Attention",
            TraceStep::Transpose => "Transpose",
            TraceStep::Alloc => "Alloc",
            TraceStep::Transfer => "Transfer",
            TraceStep::LedgerReserve => "LedgerReserve",
            TraceStep::LedgerCleanup => "LedgerCleanup",
            TraceStep::VramQuery => "VramQuery",
            TraceStep::WaitPoll => "WaitPoll",
            TraceStep::LedgerRelease => "LedgerRelease",
        }
    }

    /// A ledger step: the daemon credits its spans' time to the GPU that the same thread
    /// annotated inside the span.
    pub const fn is_ledger_step(self) -> bool {
        matches!(
            self,
            TraceStep::LedgerReserve
                | TraceStep::LedgerCleanup
                | TraceStep::VramQuery
                | TraceStep::WaitPoll
                | TraceStep::LedgerRelease
        )
    }

    /// The built-in step with this id.
    pub fn from_id(id: u32) -> Option<TraceStep> {
        TraceStep::ALL.get(id as usize).copied()
    }

    /// The built-in step with this name (as [`TraceStep::name`] spells it).
    pub fn from_name(name: &str) -> Option<TraceStep> {
        TraceStep::ALL.iter().copied().find(|s| s.name() == name)
    }
}

impl fmt::Display for TraceStep {
    /// The name alone (width and alignment flags are not applied, as with the
    /// in-process tracer's `Display`; pad `step.to_string()` instead).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A step to record: a built-in one ([`TraceStep`]) or a registered custom one
/// ([`CustomStep`]). Only these can make one, so a `Step` is always a valid id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Step(u32);

impl Step {
    /// The wire's step id (0..11 built-in, 256.. custom).
    pub const fn id(self) -> u32 {
        self.0
    }

    /// The built-in step, or `None` for a custom one.
    pub fn builtin(self) -> Option<TraceStep> {
        TraceStep::from_id(self.0)
    }

    /// The built-in step of that name, else the custom step of that name (registered
    /// now if it is not yet).
    pub fn named(name: &str) -> Result<Step, Error> {
        match TraceStep::from_name(name) {
            Some(builtin) => Ok(builtin.into()),
            None => register_step(name).map(|custom| custom.step()),
        }
    }
}

impl From<TraceStep> for Step {
    fn from(step: TraceStep) -> Step {
        Step(step.id())
    }
}

impl From<&CustomStep> for Step {
    fn from(step: &CustomStep) -> Step {
        step.step
    }
}

impl From<CustomStep> for Step {
    fn from(step: CustomStep) -> Step {
        step.step
    }
}

/// A custom step registered by name ([`register_step`]); reports show its name. Pass it
/// by reference (`span(&step, ..)`) or keep its [`Step`] (`step.step()`, `Copy`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct CustomStep {
    step: Step,
    name: String,
}

impl CustomStep {
    /// Same as [`register_step`].
    pub fn register(name: &str) -> Result<CustomStep, Error> {
        register_step(name)
    }

    /// The name it was registered with.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its step, to record it.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Its id (256 and above), stable per name within the process.
    pub fn id(&self) -> u32 {
        self.step.0
    }
}

impl fmt::Display for CustomStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

/// Registers a custom step: `name` is 1..63 printable ASCII characters; the same name
/// gives the same step within the process. Fails on a NUL byte, an invalid name, or when
/// the per-process limit of custom steps is reached.
pub fn register_step(name: &str) -> Result<CustomStep, Error> {
    let c_name = c_string("step name", name)?;
    // SAFETY: c_name is a NUL-terminated string that outlives the call.
    let id = unsafe { ffi::steptrace_register_step(c_name.as_ptr()) };
    if id == ffi::STEPTRACE_INVALID_STEP {
        return Err(Error::InvalidStepName(name.to_owned()));
    }
    Ok(CustomStep { step: Step(id), name: name.to_owned() })
}

// ---- spans ----------------------------------------------------------------------------

/// Starts a span of `step` on this thread; [`end`] of the same step on the same thread
/// ends it (spans nest, and are matched per thread). Prefer [`span`] or [`SpanGuard`].
pub fn start<S: Into<Step>>(step: S) {
    // SAFETY: no pointer; any id is accepted (a Step is always a valid one).
    unsafe { ffi::steptrace_start(step.into().0) }
}

/// Ends this thread's innermost open span of `step`.
pub fn end<S: Into<Step>>(step: S) {
    // SAFETY: as in start.
    unsafe { ffi::steptrace_end(step.into().0) }
}

/// Runs `f` inside a span of `step` and returns its value. The span ends even when `f`
/// panics.
pub fn span<S: Into<Step>, R, F: FnOnce() -> R>(step: S, f: F) -> R {
    let _guard = SpanGuard::new(step);
    f()
}

/// A span that ends when the guard is dropped (or [`SpanGuard::end`]). Not `Send`: spans
/// are matched per thread, so it ends on the thread that started it.
#[must_use = "the span ends as soon as the guard is dropped"]
#[derive(Debug)]
pub struct SpanGuard {
    step: Step,
    _same_thread: PhantomData<*const ()>,
}

impl SpanGuard {
    /// Starts a span of `step` on this thread.
    pub fn new<S: Into<Step>>(step: S) -> SpanGuard {
        let step = step.into();
        start(step);
        SpanGuard { step, _same_thread: PhantomData }
    }

    /// The step of this span.
    pub fn step(&self) -> Step {
        self.step
    }

    /// Ends the span now.
    pub fn end(self) {}
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        end(self.step);
    }
}

// ---- connection, flush, drops ---------------------------------------------------------

// The socket of the last connect call, for daemon_command; whether connect was called.
static SOCKET: Mutex<Option<PathBuf>> = Mutex::new(None);
static CONNECT_CALLED: AtomicBool = AtomicBool::new(false);
static AUTO_CONNECT: Once = Once::new();

fn remember_socket(path: PathBuf) {
    *SOCKET.lock().unwrap_or_else(PoisonError::into_inner) = Some(path);
    CONNECT_CALLED.store(true, Ordering::Release);
}

/// `$STEPTRACE_SOCKET` when set and not empty, else [`DEFAULT_SOCKET`].
fn env_socket() -> PathBuf {
    match std::env::var_os("STEPTRACE_SOCKET") {
        Some(path) if !path.is_empty() => PathBuf::from(path),
        _ => PathBuf::from(DEFAULT_SOCKET),
    }
}

/// Connects to the daemon listening on `socket_path` and starts the library's background
/// thread. An error (the daemon cannot be reached now) is only news: recording works
/// either way and the library keeps reconnecting.
pub fn connect<P: AsRef<Path>>(socket_path: P) -> Result<(), Error> {
    let path = socket_path.as_ref();
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|e| Error::InteriorNul { argument: "socket path", position: e.nul_position() })?;
    remember_socket(path.to_path_buf());
    // SAFETY: c_path is a NUL-terminated string that outlives the call.
    check("steptrace_connect", unsafe { ffi::steptrace_connect(c_path.as_ptr()) })
}

/// [`connect`] to `$STEPTRACE_SOCKET`, else [`DEFAULT_SOCKET`].
pub fn connect_default() -> Result<(), Error> {
    remember_socket(env_socket());
    // SAFETY: null asks the library for $STEPTRACE_SOCKET, then the default.
    check("steptrace_connect", unsafe { ffi::steptrace_connect(std::ptr::null()) })
}

/// Connects with [`connect_default`] once per process unless some connect was called
/// before (the drop-in tracer's `enable`).
pub(crate) fn connect_once() {
    if CONNECT_CALLED.load(Ordering::Acquire) {
        return;
    }
    AUTO_CONNECT.call_once(|| {
        if !CONNECT_CALLED.load(Ordering::Acquire) {
            // Not reachable now: the library keeps trying in the background.
            let _ = connect_default();
        }
    });
}

pub(crate) fn connect_called() -> bool {
    CONNECT_CALLED.load(Ordering::Acquire)
}

/// The daemon's socket: the last one [`connect`] was given, else `$STEPTRACE_SOCKET`,
/// else [`DEFAULT_SOCKET`].
pub fn socket_path() -> PathBuf {
    let remembered = SOCKET.lock().unwrap_or_else(PoisonError::into_inner).clone();
    remembered.unwrap_or_else(env_socket)
}

/// Waits (at most `timeout`, in whole milliseconds) until the daemon has applied every
/// event this process recorded before the call. Errors: timed out
/// ([`Error::is_timed_out`]), or not connected (at once when [`connect`] was never
/// called, or after one connection attempt when the daemon cannot be reached).
pub fn flush(timeout: Duration) -> Result<(), Error> {
    let ms = timeout.as_millis().min(c_int::MAX as u128) as c_int;
    // SAFETY: no pointer; bounded by the timeout.
    check("steptrace_flush", unsafe { ffi::steptrace_flush(ms) })
}

/// Flushes briefly (bounded), stops the library's background thread and disconnects.
/// Events recorded afterwards are dropped and counted until the next [`connect`].
pub fn shutdown() {
    // SAFETY: no argument.
    unsafe { ffi::steptrace_shutdown() }
}

/// Why events were dropped (`enum steptrace_drop_cause`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropCause {
    /// A buffer was full while connected (the daemon did not keep up), or a thread got
    /// no buffer.
    BufferFull = 0,
    /// Recorded while not connected and the buffer was full, after `shutdown`, ...
    NotConnected = 1,
    /// Lost with a connection the daemon ended before acknowledging them.
    InFlight = 2,
    /// Refused by the library: unknown step id, empty GPU UUID, lease out of range, ...
    Invalid = 3,
}

impl DropCause {
    /// The causes, in the C enum's order.
    pub const ALL: [DropCause; 4] =
        [DropCause::BufferFull, DropCause::NotConnected, DropCause::InFlight, DropCause::Invalid];

    /// The name reports use (`buffer_full`, `not_connected`, `in_flight`, `invalid`).
    pub const fn name(self) -> &'static str {
        match self {
            DropCause::BufferFull => "buffer_full",
            DropCause::NotConnected => "not_connected",
            DropCause::InFlight => "in_flight",
            DropCause::Invalid => "invalid",
        }
    }
}

impl fmt::Display for DropCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Events this process could not deliver, per cause ([`drop_counts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct DropCounts {
    /// [`DropCause::BufferFull`]
    pub buffer_full: u64,
    /// [`DropCause::NotConnected`]
    pub not_connected: u64,
    /// [`DropCause::InFlight`]
    pub in_flight: u64,
    /// [`DropCause::Invalid`]
    pub invalid: u64,
}

impl DropCounts {
    /// The sum over the causes.
    pub fn total(&self) -> u64 {
        self.buffer_full
            .saturating_add(self.not_connected)
            .saturating_add(self.in_flight)
            .saturating_add(self.invalid)
    }
}

/// Events this process could not deliver, all causes together.
pub fn dropped() -> u64 {
    // SAFETY: no argument.
    unsafe { ffi::steptrace_dropped() }
}

/// Events dropped for `cause`.
pub fn dropped_by_cause(cause: DropCause) -> u64 {
    // SAFETY: no pointer; every cause is one the library knows.
    unsafe { ffi::steptrace_dropped_by_cause(cause as c_int) }
}

/// Calls the library refused for their arguments (`steptrace_rejected`), a count of its
/// own: a mistake in the program, not a loss of the daemon's. The library refuses a step
/// registration with an empty, overlong (> 63) or non-printable-ASCII name, or past the
/// per-process limit of custom steps (each an [`Error::InvalidStepName`] from
/// [`register_step`]); `start`/`end` with an id neither built-in nor registered (only
/// reachable through [`ffi`]: a [`Step`] is always valid); a ledger call with an empty GPU
/// UUID or a lease outside 1 ms .. 7 days (or a null UUID, through [`ffi`]). The span and
/// ledger calls among them are also dropped as [`DropCause::Invalid`]; a refused
/// registration counts nowhere else. A string with a NUL byte is an [`Error`] here and
/// never reaches the library, so it is not counted. Span and ledger calls are checked
/// only while recording: with [`set_enabled`]`(false)` or `STEPTRACE_DISABLE=1` they
/// return unchecked, and after [`shutdown`] they count as [`DropCause::NotConnected`].
pub fn rejected() -> u64 {
    // SAFETY: no argument.
    unsafe { ffi::steptrace_rejected() }
}

/// Events dropped, per cause.
pub fn drop_counts() -> DropCounts {
    DropCounts {
        buffer_full: dropped_by_cause(DropCause::BufferFull),
        not_connected: dropped_by_cause(DropCause::NotConnected),
        in_flight: dropped_by_cause(DropCause::InFlight),
        invalid: dropped_by_cause(DropCause::Invalid),
    }
}

// ---- settings -------------------------------------------------------------------------

/// Sizes the event buffers of threads whose first event comes later: per thread (64 KiB
/// .. 1 GiB, rounded down to a power of two) and all of them together (64 KiB .. 1 TiB);
/// 0 keeps that value. An out-of-range value changes nothing and is an error (EINVAL).
pub fn set_buffer_size(per_thread_bytes: u64, total_bytes: u64) -> Result<(), Error> {
    // SAFETY: no pointer.
    check("steptrace_set_buffer_size", unsafe {
        ffi::steptrace_set_buffer_size(per_thread_bytes, total_bytes)
    })
}

/// Records (true, the default unless `STEPTRACE_DISABLE=1`) or not, for the whole process.
pub fn set_enabled(on: bool) {
    // SAFETY: no pointer.
    unsafe { ffi::steptrace_set_enabled(c_int::from(on)) }
}

/// With true, a full buffer waits (bounded) for the background thread instead of
/// dropping.
pub fn set_block_when_full(on: bool) {
    // SAFETY: no pointer.
    unsafe { ffi::steptrace_set_block_when_full(c_int::from(on)) }
}

// ---- the daemon's text commands -------------------------------------------------------

/// Sends one text command (`report`, `report --json --pid N`, `ledger --json`, `stats`,
/// ...; `proto/PROTOCOL.md` section 10) to the daemon at [`socket_path`] and returns its
/// whole reply, as `steptrace COMMAND` prints it. Waits at most 10 s for each read.
pub fn daemon_command(command: &str) -> io::Result<String> {
    if command.bytes().any(|b| b == b'\n' || b == b'\r' || b == 0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "one command line, without line breaks",
        ));
    }
    let mut stream = UnixStream::connect(socket_path())?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(command.as_bytes())?;
    stream.write_all(b"\n")?;
    stream.shutdown(std::net::Shutdown::Write)?;
    let mut reply = Vec::new();
    stream.read_to_end(&mut reply)?;
    Ok(String::from_utf8_lossy(&reply).into_owned())
}

// ---- errors ---------------------------------------------------------------------------

/// What a call could not do. Recording itself never fails: see [`dropped`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Error {
    /// A string argument has a NUL byte (C strings cannot carry one); nothing was sent.
    InteriorNul {
        /// Which argument: "gpu uuid", "task", "step name", "socket path".
        argument: &'static str,
        /// The byte offset of the first NUL.
        position: usize,
    },
    /// The library refused this custom step name: not 1..63 printable ASCII characters,
    /// or the per-process limit of custom steps is reached.
    InvalidStepName(String),
    /// A C call returned -errno.
    Os {
        /// The C function.
        call: &'static str,
        /// The (positive) errno.
        errno: i32,
    },
}

impl Error {
    /// The errno of an [`Error::Os`].
    pub fn raw_os_error(&self) -> Option<i32> {
        match self {
            Error::Os { errno, .. } => Some(*errno),
            _ => None,
        }
    }

    /// The kind, as for an [`io::Error`] (`TimedOut` for a flush that timed out,
    /// `NotConnected`, `InvalidInput` for a bad argument).
    pub fn kind(&self) -> io::ErrorKind {
        match self {
            Error::Os { errno, .. } => io::Error::from_raw_os_error(*errno).kind(),
            _ => io::ErrorKind::InvalidInput,
        }
    }

    /// A [`flush`] that timed out.
    pub fn is_timed_out(&self) -> bool {
        self.kind() == io::ErrorKind::TimedOut
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InteriorNul { argument, position } => {
                write!(f, "steptrace: the {argument} has a NUL byte at offset {position}")
            }
            Error::InvalidStepName(name) => write!(
                f,
                "steptrace: step name {name:?} refused (1..63 printable ASCII characters, \
                 within the per-process limit of custom steps)"
            ),
            Error::Os { call, errno } => {
                write!(f, "steptrace: {call}: {}", io::Error::from_raw_os_error(*errno))
            }
        }
    }
}

impl std::error::Error for Error {}

impl From<Error> for io::Error {
    fn from(e: Error) -> io::Error {
        match e {
            Error::Os { errno, .. } => io::Error::from_raw_os_error(errno),
            other => io::Error::new(io::ErrorKind::InvalidInput, other),
        }
    }
}

fn check(call: &'static str, rc: c_int) -> Result<(), Error> {
    if rc >= 0 {
        Ok(())
    } else {
        Err(Error::Os { call, errno: rc.saturating_neg() })
    }
}

pub(crate) fn c_string(argument: &'static str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|e| Error::InteriorNul { argument, position: e.nul_position() })
}

#[cfg(test)]
mod tests;
