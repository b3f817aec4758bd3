"""steptrace: Python binding (ctypes) over libsteptrace's C ABI.

    import steptrace
    steptrace.connect()                      # $STEPTRACE_SOCKET, then the default path
    with steptrace.span("Forward"):          # built-in step names map to their ids
        ...
    @steptrace.span("Tokenize")              # a decorator too; other names are custom steps
    def tokenize(batch): ...
    steptrace.flush(1000, check=True)        # OSError unless the daemon applied everything
    steptrace.dropped_by_cause()             # {"buffer_full": 0, "not_connected": 0, ...}

steptrace.torch instruments a torch.nn.Module (Forward/Backward spans from its hooks).

Where the library comes from: steptrace._loader (STEPTRACE_LIBRARY, the installed
prefix, the system's search, a source checkout's build tree); `library_path` is the file
loaded. Arguments are checked here, before any C call: a bad step name, a step id the
process never registered, a wrong type or an out-of-range number raises TypeError or
ValueError. A call the library fails raises OSError with its errno (set_buffer_size;
connect and flush with check=True: by default they still return 0 or -errno, as they
always did, a form kept for existing callers and deprecated for new code). Tracing itself
never raises: events that cannot be delivered (no daemon, a full buffer) are dropped and
counted (dropped(), dropped_by_cause()); calls the library refuses for their arguments
are counted by rejected().
"""

import ctypes as _c
import enum
import functools
import inspect
import operator
import os
import threading

from . import _loader
from ._version import __version__

__all__ = [
    "Step", "connect", "register_step", "step_id", "start", "end", "span", "traced",
    "ledger_reserve", "ledger_release", "ledger_cleanup", "vram_sample",
    "ledger_reserve_lease", "ledger_renew", "HAS_LEASES", "MAX_LEASE_MS",
    "flush", "dropped", "dropped_by_cause", "rejected", "set_buffer_size", "set_enabled",
    "set_block_when_full", "shutdown", "INVALID_STEP", "DROP_CAUSES", "MAX_NAME_LENGTH",
    "library_path", "__version__",
]

INVALID_STEP = 0xFFFFFFFF
# Step names, GPU UUIDs and tasks: at most 63 printable ASCII characters (PROTOCOL.md 3).
MAX_NAME_LENGTH = 63
# A lease runs 1 ms .. 7 days (steptrace.h, steptrace_ledger_reserve_lease).
MAX_LEASE_MS = 7 * 24 * 3600 * 1000

# The drop causes, in the order of steptrace.h's enum steptrace_drop_cause (0..3).
DROP_CAUSES = ("buffer_full", "not_connected", "in_flight", "invalid")

_U32 = (1 << 32) - 1
_U64 = (1 << 64) - 1


class Step(enum.IntEnum):
    """The built-in steps, ids as in steptrace.h; names as the reports spell them.

    Python cannot include proto/steps.h, the table that defines them: ctest's
    client_python_steps checks that this enum is that table exactly."""
    Forward = 0
    Backward = 1
    Matmul = 2
    Attention = 3
    Transpose = 4
    Alloc = 5
    Transfer = 6
    LedgerReserve = 7
    LedgerCleanup = 8
    VramQuery = 9
    WaitPoll = 10
    LedgerRelease = 11


_lib, _found_by = _loader.load()
library_path = _loader.loaded_path(_lib)


def _fn(name, restype, *argtypes, required=True):
    f = getattr(_lib, name, None)
    if f is None:
        if required:
            raise ImportError(f"steptrace: {library_path} has no {name}: not libsteptrace, "
                              "or an older one than this package")
        return None
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_c_connect = _fn("steptrace_connect", _c.c_int, _c.c_char_p)
_c_register_step = _fn("steptrace_register_step", _c.c_uint32, _c.c_char_p)
_c_start = _fn("steptrace_start", None, _c.c_uint32)
_c_end = _fn("steptrace_end", None, _c.c_uint32)
_c_ledger_reserve = _fn("steptrace_ledger_reserve", None, _c.c_char_p, _c.c_uint64,
                        _c.c_uint64, _c.c_char_p)
_c_ledger_release = _fn("steptrace_ledger_release", None, _c.c_char_p, _c.c_uint64)
_c_ledger_cleanup = _fn("steptrace_ledger_cleanup", None, _c.c_char_p, _c.c_uint64,
                        _c.c_uint32)
_c_vram_sample = _fn("steptrace_vram_sample", None, _c.c_char_p, _c.c_uint64, _c.c_uint64)
# Leases came with protocol version 3; a library from before them lacks both.
_c_ledger_reserve_lease = _fn("steptrace_ledger_reserve_lease", None, _c.c_char_p,
                              _c.c_uint64, _c.c_uint64, _c.c_char_p, _c.c_uint32,
                              required=False)
_c_ledger_renew = _fn("steptrace_ledger_renew", None, _c.c_char_p, _c.c_uint64, _c.c_uint32,
                      required=False)
_c_flush = _fn("steptrace_flush", _c.c_int, _c.c_int)
_c_dropped = _fn("steptrace_dropped", _c.c_uint64)
_c_dropped_by_cause = _fn("steptrace_dropped_by_cause", _c.c_uint64, _c.c_int)
# steptrace_rejected came with protocol version 4; a library from before it lacks it.
_c_rejected = _fn("steptrace_rejected", _c.c_uint64, required=False)
_c_set_buffer_size = _fn("steptrace_set_buffer_size", _c.c_int, _c.c_uint64, _c.c_uint64)
_c_set_enabled = _fn("steptrace_set_enabled", None, _c.c_int)
_c_set_block_when_full = _fn("steptrace_set_block_when_full", None, _c.c_int)
_c_shutdown = _fn("steptrace_shutdown", None)

HAS_LEASES = _c_ledger_reserve_lease is not None and _c_ledger_renew is not None

# ---- argument checks (before any C call) --------------------------------------------


def _uint(value, what, maximum, minimum=0):
    """An int (or anything with __index__, e.g. a numpy integer) within range; bools and
    floats are refused rather than truncated or wrapped by ctypes."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an int, not bool")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an int, not {type(value).__name__}") from None
    if not minimum <= value <= maximum:
        raise ValueError(f"{what} must be in {minimum}..{maximum}, got {value}")
    return value


def _text(value, what, *, allow_empty=False):
    """A str of at most 63 printable ASCII characters, as bytes for the C call."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str, not {type(value).__name__}")
    if not value and not allow_empty:
        raise ValueError(f"{what} must not be empty")
    if len(value) > MAX_NAME_LENGTH:
        raise ValueError(f"{what} is {len(value)} characters long; at most "
                         f"{MAX_NAME_LENGTH}: {value[:20]!r}...")
    bad = [ch for ch in value if not " " <= ch <= "~"]
    if bad:
        raise ValueError(f"{what} must be printable ASCII (0x20..0x7E); {value!r} has "
                         f"{bad[0]!r}")
    return value.encode("ascii")


# ---- steps -----------------------------------------------------------------------------

_ids = {}              # custom step name -> id, as registered through this module
_custom_ids = set()    # the ids in _ids, for step_id(int)
_ids_lock = threading.Lock()
_BUILTIN_BY_NAME = {s.name: int(s) for s in Step}


def register_step(name):
    """The custom step id for `name` (stable per name within the process).

    TypeError unless a str; ValueError unless 1..63 printable ASCII characters (a
    built-in name gives the built-in's id); RuntimeError when the library refuses it (the
    per-process limit of custom steps is reached)."""
    encoded = _text(name, "step name")
    builtin = _BUILTIN_BY_NAME.get(name)
    if builtin is not None:
        return builtin
    with _ids_lock:
        sid = _ids.get(name)
        if sid is None:
            sid = int(_c_register_step(encoded))
            if sid == INVALID_STEP:
                raise RuntimeError(f"steptrace: the library refused custom step {name!r} "
                                   "(the per-process limit of custom steps is reached)")
            _ids[name] = sid
            _custom_ids.add(sid)
    return sid


def step_id(step):
    """The id to record for `step`: a Step, a built-in id (0..11), an id register_step()
    returned, a built-in name ("Forward") or any other name (registered as a custom
    step on first use). TypeError for anything else (None included), ValueError for an
    unknown id or an invalid name."""
    if isinstance(step, str):
        builtin = _BUILTIN_BY_NAME.get(step)
        return builtin if builtin is not None else register_step(step)
    if isinstance(step, Step):
        return int(step)
    if isinstance(step, bool) or not hasattr(step, "__index__"):
        raise TypeError("step must be a str, a steptrace.Step or an int id, not "
                        f"{type(step).__name__}" +
                        (" (decorate with @steptrace.span(\"Name\"), not @steptrace.span)"
                         if callable(step) else ""))
    sid = operator.index(step)
    if 0 <= sid < len(_BUILTIN_BY_NAME) or sid in _custom_ids:
        return sid
    raise ValueError(f"unknown step id {sid}: neither built-in (0..{len(Step) - 1}) nor "
                     "returned by steptrace.register_step()")


def start(step):
    """Starts a span of `step` on the calling thread (end it on the same thread)."""
    _c_start(step_id(step))


def end(step):
    """Ends the most recent open span of `step` on the calling thread."""
    _c_end(step_id(step))


class span:
    """A span of `step` around a block or around every call of a function:

        with steptrace.span("Forward"):
            ...

        @steptrace.span("Tokenize")
        def tokenize(text): ...

    The step is resolved (and a custom name registered) once, when the span object is
    made. One object may be entered again, nested, and from several threads: it holds no
    per-use state. Spans time the calling thread's wall clock (host time: see
    bindings/python/README.md for device time). The block's exceptions pass through, and
    the span ends either way."""

    __slots__ = ("step", "id")

    def __init__(self, step):
        self.id = step_id(step)
        self.step = step

    def __enter__(self):
        _c_start(self.id)
        return self

    def __exit__(self, *exc_info):
        _c_end(self.id)
        return False

    def __call__(self, func):
        if not callable(func):
            raise TypeError(f"span(...) decorates a function, not {type(func).__name__}")
        if inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func) or \
                inspect.isgeneratorfunction(func):
            raise TypeError(f"span cannot decorate {func.__qualname__}: a generator or "
                            "coroutine function returns before its body runs, so the span "
                            "would time nothing; use `with steptrace.span(...)` inside it")
        sid = self.id

        @functools.wraps(func)
        def traced_call(*args, **kwargs):
            _c_start(sid)
            try:
                return func(*args, **kwargs)
            finally:
                _c_end(sid)
        return traced_call

    def __repr__(self):
        return f"steptrace.span({self.step!r})"


def traced(step):
    """The same as span(step) used as a decorator (kept for older code)."""
    return span(step)


# ---- VRAM ledger -----------------------------------------------------------------------


def _task(task):
    return b"" if task is None else _text(task, "task", allow_empty=True)


def ledger_reserve(gpu_uuid, reservation_id, nbytes, task=None):
    """Annotates a reservation of `nbytes` on GPU `gpu_uuid` (call it inside a
    LedgerReserve span). `task`: up to 63 printable ASCII characters, or None."""
    _c_ledger_reserve(_text(gpu_uuid, "gpu_uuid"), _uint(reservation_id, "reservation_id", _U64),
                      _uint(nbytes, "nbytes", _U64), _task(task))


def ledger_release(gpu_uuid, reservation_id):
    _c_ledger_release(_text(gpu_uuid, "gpu_uuid"),
                      _uint(reservation_id, "reservation_id", _U64))


def ledger_cleanup(gpu_uuid, reservation_id, holder_pid):
    """Releases a reservation `holder_pid` left behind (a dead or expired holder)."""
    _c_ledger_cleanup(_text(gpu_uuid, "gpu_uuid"),
                      _uint(reservation_id, "reservation_id", _U64),
                      _uint(holder_pid, "holder_pid", _U32))


def vram_sample(gpu_uuid, free_bytes, total_bytes):
    _c_vram_sample(_text(gpu_uuid, "gpu_uuid"), _uint(free_bytes, "free_bytes", _U64),
                   _uint(total_bytes, "total_bytes", _U64))


def _require_leases():
    if not HAS_LEASES:
        raise NotImplementedError(f"steptrace: {library_path} predates leases (no "
                                  "steptrace_ledger_reserve_lease / steptrace_ledger_renew)")


def ledger_reserve_lease(gpu_uuid, reservation_id, nbytes, task, lease_ms):
    """A reservation with a lease: unless renewed (ledger_renew) within `lease_ms`
    (1 .. MAX_LEASE_MS) of it or of the last renewal, the daemon marks it EXPIRED. To a
    daemon too old for leases it is sent as a plain reservation."""
    _require_leases()
    _c_ledger_reserve_lease(_text(gpu_uuid, "gpu_uuid"),
                            _uint(reservation_id, "reservation_id", _U64),
                            _uint(nbytes, "nbytes", _U64), _task(task),
                            _uint(lease_ms, "lease_ms", MAX_LEASE_MS, minimum=1))


def ledger_renew(gpu_uuid, reservation_id, lease_ms):
    """Renews the lease of a reservation for `lease_ms` from now (gives one to a
    reservation without a lease, and revives an EXPIRED one)."""
    _require_leases()
    _c_ledger_renew(_text(gpu_uuid, "gpu_uuid"), _uint(reservation_id, "reservation_id", _U64),
                    _uint(lease_ms, "lease_ms", MAX_LEASE_MS, minimum=1))


# ---- connection, delivery, settings ----------------------------------------------------


def _os_error(rc, what, path=None):
    """The OSError for the library's -errno `rc` (Python picks the subclass the errno maps
    to: FileNotFoundError, ConnectionRefusedError, TimeoutError, ...); `what` says which
    call failed and what it means, `path` is its filename (None: no file concerned)."""
    code = -rc
    message = f"{os.strerror(code)} ({what})"
    return OSError(code, message) if path is None else OSError(code, message, path)


def connect(socket_path=None, *, check=False):
    """Connects (None: $STEPTRACE_SOCKET, then the library's default path) and starts the
    background thread; recording works either way and the library keeps reconnecting.

    check=True: 0, or OSError with the errno when the daemon cannot be reached now
    (filename: the socket, unless it is the library's default). check=False (the
    default): 0 or -errno, the stable form existing code relies on; deprecated for new
    code, which should pass check=True."""
    if socket_path is not None:
        path = os.fsencode(socket_path)  # TypeError for anything but str/bytes/PathLike
        if not path or b"\0" in path:
            raise ValueError(f"bad socket path {socket_path!r}")
    else:
        # The default is libsteptrace's (STEPTRACE_DEFAULT_SOCKET, proto/commands.h's
        # kDefaultSocketPath): Python keeps no copy of it.
        path = None
    rc = _c_connect(path)
    if check and rc < 0:
        if path is None:
            path = os.environb.get(b"STEPTRACE_SOCKET") or None
        raise _os_error(rc, "steptrace.connect: steptraced cannot be reached at "
                        + ("this socket" if path else "the library's default socket")
                        + "; the library keeps reconnecting in the background",
                        None if path is None else os.fsdecode(path))
    return rc


def flush(timeout_ms=1000, *, check=False):
    """Waits up to `timeout_ms` until the daemon has applied every event recorded before.

    check=True: 0, or OSError: errno ETIMEDOUT (TimeoutError) when the time ran out,
    ENOTCONN when not connected (nothing recorded or connected yet, after shutdown(), or
    the daemon cannot be reached). check=False (the default): 0 or -errno, the stable
    form existing code relies on; deprecated for new code, which should pass check=True."""
    timeout_ms = _uint(timeout_ms, "timeout_ms", (1 << 31) - 1)
    rc = _c_flush(timeout_ms)
    if check and rc < 0:
        raise _os_error(rc, f"steptrace.flush({timeout_ms}): events recorded before it "
                        "are not all applied by the daemon")
    return rc


def dropped():
    """Events this process could not deliver (the sum of dropped_by_cause())."""
    return int(_c_dropped())


def dropped_by_cause():
    """Dropped events per cause: a dict with the keys of DROP_CAUSES (see steptrace.h)."""
    return {name: int(_c_dropped_by_cause(i)) for i, name in enumerate(DROP_CAUSES)}


def rejected():
    """Calls the library refused for their arguments (steptrace_rejected), a count of its
    own: a mistake in the program, not a loss of the daemon's. The library refuses a step
    registration with a NULL, empty, overlong (> 63) or non-printable-ASCII name or past
    the per-process limit of custom steps; a start/end with an id neither built-in nor
    registered; a ledger call with a NULL or empty GPU UUID or a lease outside 1 ms ..
    7 days. The span and ledger calls among them also count as drops of cause "invalid"
    (dropped_by_cause()); a refused registration counts nowhere else.

    Through this module, only one of these reaches the library: register_step() (or a
    new custom name given to span/start/end/step_id) past the per-process limit of
    custom steps, which raises RuntimeError and counts 1 here. Every other bad argument
    (a bad name, None, an unknown id, an empty GPU UUID, a lease out of range) raises
    TypeError or ValueError here before any C call, so it is not counted. Span and
    ledger calls are checked only while recording: with tracing off (set_enabled(False),
    STEPTRACE_DISABLE=1) they return unchecked, and after shutdown() they count as
    not_connected drops instead.

    NotImplementedError with a library from before this counter (protocol version < 4)."""
    if _c_rejected is None:
        raise NotImplementedError(f"steptrace: {library_path} predates steptrace_rejected")
    return int(_c_rejected())


def set_buffer_size(per_thread, total=0):
    """Buffer bytes for threads whose first event comes later: per thread (64 KiB..1 GiB,
    rounded down to a power of two) and for all of them (64 KiB..1 TiB); 0 keeps a
    value. Returns 0; OSError with errno EINVAL when a value is out of range (nothing
    changed). (It used to return -EINVAL, which a caller could miss.)"""
    per_thread = _uint(per_thread, "per_thread", _U64)
    total = _uint(total, "total", _U64)
    rc = _c_set_buffer_size(per_thread, total)
    if rc < 0:
        raise _os_error(rc, f"steptrace.set_buffer_size(per_thread={per_thread}, "
                        f"total={total}): per_thread must be 0 or 64 KiB..1 GiB, total 0 or "
                        "64 KiB..1 TiB; nothing changed")
    return rc


def set_enabled(on):
    _c_set_enabled(1 if on else 0)


def set_block_when_full(on):
    _c_set_block_when_full(1 if on else 0)


def shutdown():
    _c_shutdown()
