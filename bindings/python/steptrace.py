"""steptrace: Python binding (ctypes) over libsteptrace's C ABI.

    import steptrace
    steptrace.connect()                      # $STEPTRACE_SOCKET, then the default path
    with steptrace.span("Forward"):          # built-in step names map to their ids
        ...
    @steptrace.traced("Tokenize")            # other names are registered as custom steps
    def tokenize(batch): ...
    steptrace.flush(1000)                    # 0 once the daemon has applied everything
    steptrace.dropped_by_cause()             # {"buffer_full": 0, "not_connected": 0, ...}

The library is found via $STEPTRACE_LIBRARY, else ctypes.util.find_library("steptrace"),
else next to this module, else in ../../build*/client of a source checkout.
Every call is cheap and never raises for tracing problems: events that cannot be
delivered are dropped and counted (dropped()).
"""

import contextlib
import ctypes
import ctypes.util
import enum
import functools
import glob
import os
import threading

__all__ = [
    "Step", "connect", "register_step", "start", "end", "span", "traced",
    "ledger_reserve", "ledger_release", "ledger_cleanup", "vram_sample",
    "flush", "dropped", "dropped_by_cause", "set_buffer_size", "set_enabled",
    "set_block_when_full", "shutdown", "step_id", "INVALID_STEP", "DROP_CAUSES",
]

INVALID_STEP = 0xFFFFFFFF

# The drop causes, in the order of steptrace.h's enum steptrace_drop_cause (0..3).
DROP_CAUSES = ("buffer_full", "not_connected", "in_flight", "invalid")


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


def _candidates():
    env = os.environ.get("STEPTRACE_LIBRARY")
    if env:
        yield env
    found = ctypes.util.find_library("steptrace")
    if found:
        yield found
    here = os.path.dirname(os.path.abspath(__file__))
    for name in ("libsteptrace.so", "libsteptrace.so.0"):
        yield os.path.join(here, name)
    root = os.path.dirname(os.path.dirname(here))
    for path in sorted(glob.glob(os.path.join(root, "build*", "client", "libsteptrace.so"))):
        yield path


def _load():
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("libsteptrace not found (set STEPTRACE_LIBRARY): " + "; ".join(errors))


_lib = _load()


def _fn(name, restype, *argtypes):
    f = getattr(_lib, name)
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_c = ctypes
_connect = _fn("steptrace_connect", _c.c_int, _c.c_char_p)
_register_step = _fn("steptrace_register_step", _c.c_uint32, _c.c_char_p)
_start = _fn("steptrace_start", None, _c.c_uint32)
_end = _fn("steptrace_end", None, _c.c_uint32)
_ledger_reserve = _fn("steptrace_ledger_reserve", None, _c.c_char_p, _c.c_uint64, _c.c_uint64,
                      _c.c_char_p)
_ledger_release = _fn("steptrace_ledger_release", None, _c.c_char_p, _c.c_uint64)
_ledger_cleanup = _fn("steptrace_ledger_cleanup", None, _c.c_char_p, _c.c_uint64, _c.c_uint32)
_vram_sample = _fn("steptrace_vram_sample", None, _c.c_char_p, _c.c_uint64, _c.c_uint64)
_flush = _fn("steptrace_flush", _c.c_int, _c.c_int)
_dropped = _fn("steptrace_dropped", _c.c_uint64)
_dropped_by_cause = _fn("steptrace_dropped_by_cause", _c.c_uint64, _c.c_int)
_set_buffer_size = _fn("steptrace_set_buffer_size", _c.c_int, _c.c_uint64, _c.c_uint64)
_set_enabled = _fn("steptrace_set_enabled", None, _c.c_int)
_set_block_when_full = _fn("steptrace_set_block_when_full", None, _c.c_int)
_shutdown = _fn("steptrace_shutdown", None)

_ids = {}
_ids_lock = threading.Lock()


def _bytes(s):
    if s is None:
        return None
    return s.encode("utf-8", "replace") if isinstance(s, str) else bytes(s)


def connect(socket_path=None):
    """Connects (None: $STEPTRACE_SOCKET, then the default). 0 or -errno; recording works
    either way and the library keeps reconnecting in the background."""
    return _connect(_bytes(socket_path))


def register_step(name):
    """The custom step id for `name` (stable per name); INVALID_STEP when refused."""
    return _register_step(_bytes(name))


def step_id(step):
    """An id for a Step, an int id, a built-in name ("Forward") or a custom name."""
    if isinstance(step, int):
        return int(step)
    try:
        return int(Step[step])
    except KeyError:
        pass
    with _ids_lock:
        sid = _ids.get(step)
        if sid is None:
            sid = register_step(step)
            if sid != INVALID_STEP:
                _ids[step] = sid
    return sid


def start(step):
    _start(step_id(step))


def end(step):
    _end(step_id(step))


@contextlib.contextmanager
def span(step):
    """`with steptrace.span("Forward"):` records a span around the block."""
    sid = step_id(step)
    _start(sid)
    try:
        yield
    finally:
        _end(sid)


def traced(step):
    """Decorator: every call of the function is a span of `step`."""
    def wrap(func):
        sid = step_id(step)

        @functools.wraps(func)
        def inner(*args, **kwargs):
            _start(sid)
            try:
                return func(*args, **kwargs)
            finally:
                _end(sid)
        return inner
    return wrap


def ledger_reserve(gpu_uuid, reservation_id, nbytes, task=None):
    _ledger_reserve(_bytes(gpu_uuid), reservation_id, nbytes, _bytes(task))


def ledger_release(gpu_uuid, reservation_id):
    _ledger_release(_bytes(gpu_uuid), reservation_id)


def ledger_cleanup(gpu_uuid, reservation_id, holder_pid):
    _ledger_cleanup(_bytes(gpu_uuid), reservation_id, holder_pid)


def vram_sample(gpu_uuid, free_bytes, total_bytes):
    _vram_sample(_bytes(gpu_uuid), free_bytes, total_bytes)


def flush(timeout_ms=1000):
    """0 once the daemon has applied every event recorded before; -errno otherwise."""
    return _flush(int(timeout_ms))


def dropped():
    """Events this process could not deliver (the sum of dropped_by_cause())."""
    return int(_dropped())


def dropped_by_cause():
    """Dropped events per cause: a dict with the keys of DROP_CAUSES (see steptrace.h)."""
    return {name: int(_dropped_by_cause(i)) for i, name in enumerate(DROP_CAUSES)}


def set_buffer_size(per_thread, total=0):
    """Buffer bytes for threads whose first event comes later: per thread (64 KiB..1 GiB,
    rounded down to a power of two) and for all of them (64 KiB..1 TiB); 0 keeps a
    value. 0, or -errno (-EINVAL: out of range, nothing changed)."""
    return _set_buffer_size(int(per_thread), int(total))


def set_enabled(on):
    _set_enabled(1 if on else 0)


def set_block_when_full(on):
    _set_block_when_full(1 if on else 0)


def shutdown():
    _shutdown()
