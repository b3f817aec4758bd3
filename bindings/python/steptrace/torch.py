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

    # per-module spans too: Linear/Conv -> Matmul, MultiheadAttention -> Attention, ...
    hooks = steptrace.torch.instrument(model, modules=True)

Works on every torch from 1.13: where a module has no register_full_backward_pre_hook
(torch < 2.0), the Backward span starts from a hook on the forward output's tensors
(Tensor.register_hook), which runs when the gradient reaches the output, as the pre-hook
would. That hook may run after the module's backward hook (torch 1.13 calls it first when
no input needs a gradient): a Backward span is never ended before it starts (the end
waits for the pass's end), and an end with no start (e.g. a pass that never reaches the
output's hook) is skipped and counted (Instrumentation.skipped_backward_ends). This module never imports torch by itself: instrument() needs only an object with
torch.nn.Module's register_* methods (so it works, and is tested, without torch), and
torch is imported only for synchronize=True and for modules=True (the default map is
made of torch.nn classes).

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

from . import Step, _c_end, _c_start, register_step, step_id

__all__ = ["instrument", "Instrumentation", "step", "end_step", "default_modules",
           "STEP_NAME"]

FORWARD = int(Step.Forward)
BACKWARD = int(Step.Backward)
# The custom step step() records, one span per iteration.
STEP_NAME = "Step"

_FORWARD_METHODS = ("register_forward_pre_hook", "register_forward_hook")
_BACKWARD_PRE_HOOK = "register_full_backward_pre_hook"  # torch >= 2.0
_BACKWARD_HOOK = "register_full_backward_hook"  # torch >= 1.8

# modules=True: which torch.nn classes get which span (subclasses too). Matmul and
# Attention are built-in steps, the compute side of the report's 50% rule; the others are
# custom steps. Names missing from an older torch are skipped.
_DEFAULT_MODULES = (
    ("Linear", "Matmul"), ("Bilinear", "Matmul"),
    ("Conv1d", "Matmul"), ("Conv2d", "Matmul"), ("Conv3d", "Matmul"),
    ("ConvTranspose1d", "Matmul"), ("ConvTranspose2d", "Matmul"),
    ("ConvTranspose3d", "Matmul"),
    ("MultiheadAttention", "Attention"),
    ("Embedding", "Embedding"), ("EmbeddingBag", "Embedding"),
    ("LayerNorm", "Norm"), ("GroupNorm", "Norm"), ("RMSNorm", "Norm"),
    ("BatchNorm1d", "Norm"), ("BatchNorm2d", "Norm"), ("BatchNorm3d", "Norm"),
)

_instrumented = weakref.WeakSet()  # modules with hooks in place
_instrumented_lock = threading.Lock()


class Instrumentation:
    """The hook handles instrument() registered. remove() takes them all off; used as a
    context manager, they come off at the end of the block."""

    def __init__(self, module, handles, backward=None):
        self.module = module
        self.handles = list(handles)
        self._backward = backward

    @property
    def skipped_backward_ends(self):
        """Backward hooks that ran with no Backward span started for them on their thread
        (so no span was ended before it started): 0 in a well-formed training loop."""
        return 0 if self._backward is None else self._backward.skipped_ends

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
    warning says so, and this module's Backward spans end at the hook from then on.

    A span is never ended before it starts: the starts still open are counted per
    thread, and an end with none open is deferred to the end of the pass (on torch < 2.0
    the start comes from the output's tensor hook, which may run after the backward
    hook) or, when no start came by then or there is no pass to wait for, skipped and
    counted in `skipped_ends` (a backward pass that reaches the module's backward hook
    but not the hook that starts the span), with one warning."""

    def __init__(self, sync):
        self.sync = sync
        self.defer = True
        self.skipped_ends = 0
        self._open = threading.local()  # .count: starts not yet ended, on this thread

    def _open_count(self):
        return getattr(self._open, "count", 0)

    def pre_hook(self, module, grad_output):
        if self.sync is not None:
            self.sync()
        _c_start(BACKWARD)
        self._open.count = self._open_count() + 1
        return None

    def hook(self, module, grad_input, grad_output):
        if self.defer and (self._open_count() == 0 or all(g is None for g in grad_input)):
            owner = threading.get_ident()
            if _queue_callback(lambda: self._end_of_pass(owner)):
                return None
        self._end()
        return None

    def _end(self):
        """Ends this thread's innermost open Backward span, or counts the end as skipped."""
        if self._open_count() == 0:
            self.skipped_ends += 1
            if self.skipped_ends == 1:
                warnings.warn("steptrace.torch: a module's backward hook ran without a "
                              "Backward span started for it on this thread (e.g. a second "
                              "backward through a retained graph on torch < 2.0); its end "
                              "is skipped, and Instrumentation.skipped_backward_ends counts "
                              "such ends", RuntimeWarning, stacklevel=3)
            return
        self._open.count -= 1
        try:
            if self.sync is not None:
                self.sync()
        finally:
            _c_end(BACKWARD)

    def _end_of_pass(self, owner):
        if threading.get_ident() != owner:
            if self.defer:
                self.defer = False
                warnings.warn("steptrace.torch: the backward pass ended on another thread "
                              "than it started on; one Backward span is left open, and "
                              "this module's Backward spans now end at its backward hook",
                              RuntimeWarning, stacklevel=1)
            return
        self._end()


def _output_tensors(output, depth=0):
    """The tensors of a forward output that will receive a gradient: the output itself, or
    those in a tuple, list or dict of it (a few levels: ModelOutput-like results)."""
    if callable(getattr(output, "register_hook", None)):
        if getattr(output, "requires_grad", False):
            yield output
    elif depth < 3:
        if isinstance(output, dict):
            output = output.values()
        elif not isinstance(output, (tuple, list)):
            return
        for item in output:
            yield from _output_tensors(item, depth + 1)


class _BackwardStartFromOutput:
    """The Backward span's start without register_full_backward_pre_hook (torch < 2.0): a
    forward hook puts a tensor hook on each output tensor that requires grad; the first of
    them to run in a pass (the gradient has reached the output) starts the span, as the
    pre-hook would. No output requiring grad (torch.no_grad(), eval): no span."""

    def __init__(self, backward):
        self.backward = backward

    def forward_hook(self, module, args, output):
        tensors = list(_output_tensors(output))
        if not tensors:
            return None
        # One start per forward call and backward pass, however many outputs get a
        # gradient: cleared at the end of the pass, so that a second backward through a
        # retained graph (retain_graph=True) starts a span again.
        fired = []

        def tensor_hook(grad):
            if not fired:
                fired.append(True)
                _queue_callback(fired.clear)
                self.backward.pre_hook(module, (grad,))
            return None

        for tensor in tensors:
            tensor.register_hook(tensor_hook)
        return None


def default_modules():
    """modules=True's map, {torch.nn class: step name} (imports torch)."""
    import torch.nn  # only here: the default map is made of torch.nn classes

    mapping = {}
    for class_name, step_name in _DEFAULT_MODULES:
        cls = getattr(torch.nn, class_name, None)
        if isinstance(cls, type):
            mapping[cls] = step_name
    return mapping


def _module_step(mapping, module):
    """The step of `module` in `mapping` (its class or the nearest base class listed), or
    None."""
    for cls in type(module).__mro__:
        if cls in mapping:
            return mapping[cls]
    return None


def _register_forward_span(module, sid, sync, handles):
    def pre_hook(mod, args):
        if sync is not None:
            sync()
        _c_start(sid)

    def hook(mod, args, output):
        if sync is not None:
            sync()
        _c_end(sid)

    handles.append(module.register_forward_pre_hook(pre_hook))
    try:  # torch >= 2.1: the hook runs even when forward() raises
        handles.append(module.register_forward_hook(hook, always_call=True))
    except TypeError:
        handles.append(module.register_forward_hook(hook))


def _missing(module, names):
    return [name for name in names if not callable(getattr(module, name, None))]


def instrument(module, *, forward=True, backward=True, synchronize=False, modules=None):
    """Records a Forward span around every call of `module` (forward pre-hook to forward
    hook) and a Backward span around its part of every backward pass (from when the
    gradient reaches its output to when the gradients for its inputs are computed, or to
    the end of the pass when none of its inputs requires grad). Returns an
    Instrumentation holding the hook handles.

    `module`: a torch.nn.Module (torch >= 1.13), or any object with its
    register_forward_pre_hook and register_forward_hook (forward), and
    register_full_backward_hook plus either register_full_backward_pre_hook (torch >= 2.0)
    or, for the fallback, register_forward_hook on a module whose outputs are tensors
    with register_hook (backward). Instrument the top-level model for one Forward/Backward
    pair per iteration; submodules nest inside it.
    `synchronize`: True calls torch.cuda.synchronize() (when CUDA is available) before
    each span starts and ends, so spans cover the device's work; a callable is called
    instead. A module can be instrumented once at a time (ValueError otherwise).
    `modules`: spans around the calls of submodules (module.modules(), the module itself
    included) by class: a dict {class: step} (a step name, a Step or an id; None leaves
    that class out), or True for default_modules() (Linear and Conv -> Matmul,
    MultiheadAttention -> Attention, Embedding -> "Embedding", LayerNorm and BatchNorm ->
    "Norm"). A submodule takes the step of its class or of its nearest listed base class.

    Full backward hooks make PyTorch wrap the module's inputs and outputs: an in-place
    operation on the model's output (`out.relu_()`) then raises, as with any full
    backward hook."""
    needed = []
    if forward:
        needed += _FORWARD_METHODS
    if backward:
        needed.append(_BACKWARD_HOOK)
        if not callable(getattr(module, _BACKWARD_PRE_HOOK, None)):
            needed.append("register_forward_hook")  # the fallback's start
    missing = _missing(module, dict.fromkeys(needed))
    if missing:
        what = []
        if forward:
            what.append("forward=True needs " + ", ".join(_FORWARD_METHODS))
        if backward:
            what.append(f"backward=True needs {_BACKWARD_HOOK} (torch >= 1.8) and "
                        f"{_BACKWARD_PRE_HOOK} (torch >= 2.0) or register_forward_hook")
        raise TypeError(f"instrument() needs a torch.nn.Module (torch >= 1.13): "
                        f"{type(module).__name__} has no {', '.join(missing)} "
                        f"({'; '.join(what)})")
    if modules is True:
        mapping = default_modules()
    elif modules is None or modules is False:
        mapping = {}
    elif isinstance(modules, dict):
        mapping = dict(modules)
        for cls in mapping:
            if not isinstance(cls, type):
                raise TypeError(f"modules: keys are classes, not {type(cls).__name__}")
    else:
        raise TypeError(f"modules must be a dict, True or None, not {type(modules).__name__}")
    submodules = []
    if mapping:
        if not callable(getattr(module, "modules", None)):
            raise TypeError(f"modules= needs a torch.nn.Module: {type(module).__name__} "
                            "has no modules()")
        ids = {}  # step -> id, resolved (and custom names registered) once
        for sub in module.modules():
            step = _module_step(mapping, sub)
            if step is None:
                continue
            key = (type(step), step)
            if key not in ids:
                ids[key] = step_id(step)
            missing = _missing(sub, _FORWARD_METHODS)
            if missing:
                raise TypeError(f"modules: {type(sub).__name__} has no {', '.join(missing)}")
            submodules.append((sub, ids[key]))
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
    state = None
    try:
        if forward:
            _register_forward_span(module, FORWARD, sync, handles)
        if backward:
            state = _Backward(sync)
            if callable(getattr(module, _BACKWARD_PRE_HOOK, None)):
                handles.append(getattr(module, _BACKWARD_PRE_HOOK)(state.pre_hook))
            else:
                start = _BackwardStartFromOutput(state)
                handles.append(module.register_forward_hook(start.forward_hook))
            handles.append(getattr(module, _BACKWARD_HOOK)(state.hook))
        for sub, sid in submodules:
            _register_forward_span(sub, sid, sync, handles)
    except BaseException:
        Instrumentation(module, handles).remove()
        raise
    return Instrumentation(module, handles, state)


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
