"""PyTorch integration: Forward and Backward spans from a module's hooks, and iterations.

    import steptrace, steptrace.torch
    steptrace.connect()
    hooks = steptrace.torch.instrument(model)      # Forward/Backward spans per model call
    for batch in loader:
        steptrace.torch.step()                     # a "Step" span from one call to the next
        loss = model(batch).loss
        loss.backward()
        optimizer.step()
    steptrace.torch.end_step()
    hooks.remove()                                 # or `with steptrace.torch.instrument(m):`

This module never imports torch by itself: instrument() needs only an object with the
four register_* methods of torch.nn.Module (so it works, and is tested, without torch),
and torch is imported only for instrument(..., synchronize=True).

Spans measure host time. On a GPU, forward() returns once its kernels are queued, and
backward's hooks run when the autograd engine has queued that module's gradient kernels:
neither waits for the device. For device time, synchronize at both ends
(instrument(model, synchronize=True) calls torch.cuda.synchronize() in each hook, which
serialises host and device: for measuring, not for production runs), or time with CUDA
events (bindings/python/README.md).
"""

import atexit
import sys
import threading
import warnings
import weakref

from . import Step, _c_end, _c_start, register_step

__all__ = ["instrument", "Instrumentation", "step", "end_step", "STEP_NAME"]

FORWARD = int(Step.Forward)
BACKWARD = int(Step.Backward)
# The custom step step() records, one span per iteration.
STEP_NAME = "Step"

_HOOK_METHODS = ("register_forward_pre_hook", "register_forward_hook",
                 "register_full_backward_pre_hook", "register_full_backward_hook")

_instrumented = weakref.WeakSet()  # modules with hooks in place
_instrumented_lock = threading.Lock()


class Instrumentation:
    """The hook handles instrument() registered. remove() takes them all off; used as a
    context manager, they come off at the end of the block."""

    def __init__(self, module, handles):
        self.module = module
        self.handles = list(handles)

    def remove(self):
        for handle in reversed(self.handles):
            handle.remove()
        self.handles.clear()
        with _instrumented_lock:
            try:
                _instrumented.discard(self.module)
            except TypeError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.remove()
        return False

    def __iter__(self):
        return iter(self.handles)

    def __len__(self):
        return len(self.handles)


def _synchronizer(synchronize):
    if synchronize is None or synchronize is False:
        return None
    if synchronize is True:
        import torch  # only here: synchronize=True is about CUDA

        return torch.cuda.synchronize if torch.cuda.is_available() else None
    if callable(synchronize):
        return synchronize
    raise TypeError(f"synchronize must be a bool or a callable, not {type(synchronize).__name__}")


def _queue_callback(callback):
    """Runs `callback` when the current backward pass ends (the autograd engine's final
    callbacks, as DistributedDataParallel uses); False when there is no torch engine to
    ask (torch not imported: a stub module)."""
    torch = sys.modules.get("torch")
    engine = getattr(getattr(getattr(torch, "autograd", None), "Variable", None),
                     "_execution_engine", None)
    if engine is None:
        return False
    try:
        engine.queue_callback(callback)
    except RuntimeError:  # not inside a backward pass
        return False
    return True


class _Backward:
    """The Backward span's end. PyTorch calls a module's full backward hook once the
    gradients for the module's inputs are computed, but when none of its inputs requires
    grad (a whole model fed with data) it calls it right after the pre-hook, before any
    of the module's backward ran: every grad_input is None then. The span then ends when
    the backward pass does, from the engine's final callback. Spans are matched per
    thread, and that callback runs on the thread that finished the pass, which for a
    model on one device is the thread that ran the pre-hook; if it is another one (a
    model over several devices), the span cannot end there: it is left open once, a
    warning says so, and this module's Backward spans end at the hook from then on."""

    def __init__(self, sync):
        self.sync = sync
        self.defer = True

    def pre_hook(self, module, grad_output):
        if self.sync is not None:
            self.sync()
        _c_start(BACKWARD)
        return None

    def hook(self, module, grad_input, grad_output):
        if self.defer and all(g is None for g in grad_input):
            owner = threading.get_ident()
            if _queue_callback(lambda: self._end_of_pass(owner)):
                return None
        if self.sync is not None:
            self.sync()
        _c_end(BACKWARD)
        return None

    def _end_of_pass(self, owner):
        if threading.get_ident() != owner:
            if self.defer:
                self.defer = False
                warnings.warn("steptrace.torch: the backward pass ended on another thread "
                              "than it started on; one Backward span is left open, and "
                              "this module's Backward spans now end at its backward hook",
                              RuntimeWarning, stacklevel=1)
            return
        try:
            if self.sync is not None:
                self.sync()
        finally:
            _c_end(BACKWARD)


def instrument(module, *, forward=True, backward=True, synchronize=False):
    """Records a Forward span around every call of `module` (forward pre-hook to forward
    hook) and a Backward span around its part of every backward pass (full backward
    pre-hook to full backward hook, or to the end of the pass when none of its inputs
    requires grad). Returns an Instrumentation holding the hook handles.

    `module`: a torch.nn.Module, or any object with its register_forward_pre_hook,
    register_forward_hook, register_full_backward_pre_hook and
    register_full_backward_hook (torch >= 2.0). Instrument the top-level model for one
    Forward/Backward pair per iteration; submodules nest inside it.
    `synchronize`: True calls torch.cuda.synchronize() (when CUDA is available) before
    each span starts and ends, so spans cover the device's work; a callable is called
    instead. A module can be instrumented once at a time (ValueError otherwise).

    Full backward hooks make PyTorch wrap the module's inputs and outputs: an in-place
    operation on the model's output (`out.relu_()`) then raises, as with any full
    backward hook."""
    missing = [name for name in _HOOK_METHODS if not callable(getattr(module, name, None))]
    if missing:
        raise TypeError(f"instrument() needs a torch.nn.Module (torch >= 2.0); "
                        f"{type(module).__name__} has no {', '.join(missing)}")
    sync = _synchronizer(synchronize)
    with _instrumented_lock:
        try:
            if module in _instrumented:
                raise ValueError(f"{type(module).__name__} is instrumented already: "
                                 "remove() the first Instrumentation before another")
            _instrumented.add(module)
        except TypeError:  # not weakly referenceable: no double-instrumentation check
            pass

    handles = []
    try:
        if forward:
            def forward_pre_hook(mod, args):
                if sync is not None:
                    sync()
                _c_start(FORWARD)

            def forward_hook(mod, args, output):
                if sync is not None:
                    sync()
                _c_end(FORWARD)

            handles.append(module.register_forward_pre_hook(forward_pre_hook))
            try:  # torch >= 2.1: the hook runs even when forward() raises
                handles.append(module.register_forward_hook(forward_hook, always_call=True))
            except TypeError:
                handles.append(module.register_forward_hook(forward_hook))
        if backward:
            state = _Backward(sync)
            handles.append(module.register_full_backward_pre_hook(state.pre_hook))
            handles.append(module.register_full_backward_hook(state.hook))
    except BaseException:
        Instrumentation(module, handles).remove()
        raise
    return Instrumentation(module, handles)


# ---- iterations ------------------------------------------------------------------------

_step_id = None
_step_lock = threading.Lock()
_thread = threading.local()  # .open: a Step span is open on this thread; .count


def _step():
    global _step_id
    if _step_id is None:
        with _step_lock:
            if _step_id is None:
                _step_id = register_step(STEP_NAME)
    return _step_id


def step():
    """Marks the start of an iteration on the calling thread: ends the "Step" span the
    previous call started (if any) and starts the next one. Returns the number of
    iterations this thread has started. The report's Step row then has one span per
    finished iteration: total time per iteration, against which Forward and Backward
    (and whatever else is traced) can be compared. end_step() ends the last one; a Step
    span still open at interpreter exit is ended then (on the main thread)."""
    sid = _step()
    if getattr(_thread, "open", False):
        _c_end(sid)
    _c_start(sid)
    _thread.open = True
    _thread.count = getattr(_thread, "count", 0) + 1
    return _thread.count


def end_step():
    """Ends the calling thread's open "Step" span; nothing when none is open."""
    if getattr(_thread, "open", False):
        _c_end(_step())
        _thread.open = False


atexit.register(end_step)
