#!/usr/bin/env python3
"""steptrace.torch against the real steptraced, with a stub module in place of a
torch.nn.Module (torch is not needed, and not imported).

The stub has the register_* methods instrument() uses and calls the hooks the way
torch.nn.Module does (a subclass without register_full_backward_pre_hook stands for torch
1.13, its outputs with register_hook for tensors; python_torch_real_test.py runs the real
torch): forward pre-hooks, forward, forward hooks (also when forward raises,
for hooks registered with always_call=True); in backward, the full backward pre-hooks
when the gradient reaches the module's output, then the module's own backward work, then
the full backward hooks. When none of the module's inputs requires grad, PyTorch calls
the full backward hooks right after the pre-hooks instead (every grad_input None), and
the work follows; the stub does the same, with a stub of the autograd engine's final
callbacks.

Run by ctest with STEPTRACE_LIBRARY, PYTHONPATH (the bindings dir) and STEPTRACED_BIN
set. The span counts and durations are read back from `report --json`."""

import os
import sys
import threading
import time
import unittest
import warnings

import steptrace
import steptrace.torch as st_torch
from python_testutil import ConnectedTestCase

WORK_S = 0.004  # what the stub's forward and backward take
WORK_NS = int(WORK_S * 1e9)


class Handle:
    def __init__(self, hooks, key):
        self.hooks, self.key = hooks, key

    def remove(self):
        self.hooks.pop(self.key, None)


class StubModule:
    """What instrument() needs of a torch.nn.Module, hooks called as torch calls them."""

    def __init__(self, forward_work=WORK_S, backward_work=WORK_S):
        self.forward_work, self.backward_work = forward_work, backward_work
        self._next = 0
        self.forward_pre_hooks, self.forward_hooks = {}, {}
        self.always_call = set()
        self.backward_pre_hooks, self.backward_hooks = {}, {}

    def _add(self, hooks, hook):
        self._next += 1
        hooks[self._next] = hook
        return Handle(hooks, self._next)

    def register_forward_pre_hook(self, hook):
        return self._add(self.forward_pre_hooks, hook)

    def register_forward_hook(self, hook, *, always_call=False):
        handle = self._add(self.forward_hooks, hook)
        if always_call:
            self.always_call.add(handle.key)
        return handle

    def register_full_backward_pre_hook(self, hook):
        return self._add(self.backward_pre_hooks, hook)

    def register_full_backward_hook(self, hook):
        return self._add(self.backward_hooks, hook)

    def hook_count(self):
        return sum(map(len, (self.forward_pre_hooks, self.forward_hooks,
                             self.backward_pre_hooks, self.backward_hooks)))

    def __call__(self, x, fail=False):
        args = (x,)
        for hook in list(self.forward_pre_hooks.values()):
            hook(self, args)
        try:
            time.sleep(self.forward_work)
            if fail:
                raise ArithmeticError("forward failed")
            out = x * 2
        except BaseException:
            for key, hook in list(self.forward_hooks.items()):
                if key in self.always_call:
                    hook(self, args, None)
            raise
        for hook in list(self.forward_hooks.values()):
            hook(self, args, out)
        return out

    def backward(self, inputs_require_grad=True, engine=None):
        """One backward pass through the module; `engine` runs the final callbacks."""
        grad_output = (1.0,)
        for hook in list(self.backward_pre_hooks.values()):
            hook(self, grad_output)
        if inputs_require_grad:
            time.sleep(self.backward_work)
            for hook in list(self.backward_hooks.values()):
                hook(self, (2.0,), grad_output)
        else:  # torch/utils/hooks.py: the user hooks now, with every grad_input None
            for hook in list(self.backward_hooks.values()):
                hook(self, (None,), grad_output)
            time.sleep(self.backward_work)
        if engine is not None:
            engine.end_of_pass()


class StubEngine:
    """torch.autograd.Variable._execution_engine's queue_callback, run at the end of a
    pass on the calling thread, or on another one (a model over several devices)."""

    def __init__(self, other_thread=False):
        self.callbacks, self.other_thread = [], other_thread

    def queue(self, callback):
        self.callbacks.append(callback)
        return True

    def end_of_pass(self):
        callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            if self.other_thread:
                t = threading.Thread(target=callback)
                t.start()
                t.join()
            else:
                callback()


class TorchStubTest(ConnectedTestCase):
    def setUp(self):
        super().setUp()
        self.engine = None
        self.addCleanup(setattr, st_torch, "_queue_callback", st_torch._queue_callback)

    def use_engine(self, engine):
        st_torch._queue_callback = engine.queue
        self.engine = engine

    def steps(self):
        self.assertEqual(steptrace.flush(10000), 0)
        return self.daemon.steps(os.getpid())

    def test_forward_backward_and_iterations(self):
        model = StubModule()
        hooks = st_torch.instrument(model)
        self.assertEqual(len(hooks), 4)
        self.assertEqual(model.hook_count(), 4)
        for i in range(7):
            self.assertEqual(st_torch.step(), i + 1)
            model(float(i))
            model.backward()
        st_torch.end_step()
        st_torch.end_step()  # nothing open: no-op
        hooks.remove()
        self.assertEqual(model.hook_count(), 0)
        model(1.0)  # not recorded any more
        model.backward()

        steps = self.steps()
        for name in ("Forward", "Backward", "Step"):
            self.assertEqual(steps[name]["count"], 7, name)
            self.assertEqual(steps[name]["open"], 0, name)
            self.assertEqual(steps[name]["unmatched_ends"], 0, name)
        self.assertGreaterEqual(steps["Forward"]["min_ns"], WORK_NS)
        self.assertGreaterEqual(steps["Backward"]["min_ns"], WORK_NS)
        # An iteration holds its forward and backward.
        self.assertGreaterEqual(steps["Step"]["min_ns"], 2 * WORK_NS)
        self.assertEqual(steptrace.dropped(), 0)

    def test_backward_when_no_input_requires_grad(self):
        # The whole model fed with data: the span ends when the pass does.
        self.use_engine(StubEngine())
        model = StubModule()
        with st_torch.instrument(model):
            for i in range(5):
                model(float(i))
                model.backward(inputs_require_grad=False, engine=self.engine)
        self.assertEqual(model.hook_count(), 0)
        steps = self.steps()
        self.assertEqual(steps["Forward"]["count"], 5)
        self.assertEqual(steps["Backward"]["count"], 5)
        self.assertEqual(steps["Backward"]["open"], 0)
        self.assertGreaterEqual(steps["Backward"]["min_ns"], WORK_NS)

    def test_no_engine_ends_at_the_hook(self):
        # No torch engine to ask (no torch): the hook ends the span, which is then empty.
        model = StubModule()
        with st_torch.instrument(model):
            for _ in range(3):
                model.backward(inputs_require_grad=False)
        steps = self.steps()
        self.assertEqual(steps["Backward"]["count"], 3)
        self.assertEqual(steps["Backward"]["open"], 0)
        self.assertLess(steps["Backward"]["max_ns"], WORK_NS)

    def test_pass_ending_on_another_thread(self):
        self.use_engine(StubEngine(other_thread=True))
        model = StubModule()
        with st_torch.instrument(model), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(4):
                model.backward(inputs_require_grad=False, engine=self.engine)
        self.assertEqual(len([w for w in caught if "another thread" in str(w.message)]), 1)
        steps = self.steps()
        # The first span is left open (once); the next three end at the hook.
        self.assertEqual(steps["Backward"]["count"], 3)
        self.assertEqual(steps["Backward"]["open"], 1)
        self.assertEqual(steps["Backward"]["unmatched_ends"], 0)
        steptrace.end("Backward")  # close it, for the tests after this one

    def test_forward_that_raises_still_ends(self):
        model = StubModule(forward_work=0)
        with st_torch.instrument(model):
            with self.assertRaises(ArithmeticError):
                model(1.0, fail=True)
            model(2.0)
        steps = self.steps()
        self.assertEqual(steps["Forward"]["count"], 2)
        self.assertEqual(steps["Forward"]["open"], 0)

    def test_forward_hook_without_always_call(self):
        # torch < 2.1 has no always_call: instrument() registers the hook without it.
        class OldModule(StubModule):
            def register_forward_hook(self, hook):
                return self._add(self.forward_hooks, hook)

        model = OldModule(forward_work=0, backward_work=0)
        with st_torch.instrument(model, backward=False) as hooks:
            self.assertEqual(len(hooks), 2)
            model(1.0)
        self.assertEqual(self.steps()["Forward"]["count"], 1)

    def test_backward_start_without_pre_hook(self):
        # torch < 2.0 (1.13): no register_full_backward_pre_hook; the span starts from a
        # hook on the output's tensors, run when the gradient reaches the output.
        class StubTensor:
            def __init__(self, requires_grad=True):
                self.requires_grad, self.hooks = requires_grad, []

            def register_hook(self, hook):
                self.hooks.append(hook)

        class OldModule(StubModule):
            register_full_backward_pre_hook = None

            def __call__(self, x):
                self.output = (StubTensor(), [StubTensor(), StubTensor(False)], 3)
                for hook in list(self.forward_hooks.values()):
                    hook(self, (x,), self.output)
                return self.output

            def backward(self, inputs_require_grad=True, engine=None):
                for tensor in (self.output[0], *self.output[1]):
                    for hook in tensor.hooks:  # two tensors get a gradient: one start
                        hook(1.0)
                time.sleep(self.backward_work)
                for hook in list(self.backward_hooks.values()):
                    hook(self, (2.0,), (1.0,))

        model = OldModule()
        with st_torch.instrument(model) as hooks:
            self.assertEqual(len(hooks), 4)  # forward pre-hook and hook, the start, the end
            for i in range(3):
                model(float(i))
                self.assertEqual([len(t.hooks) for t in (model.output[0], *model.output[1])],
                                 [1, 1, 0])
                model.backward()
        steps = self.steps()
        self.assertEqual(steps["Backward"]["count"], 3)
        self.assertEqual(steps["Backward"]["open"], 0)
        self.assertEqual(steps["Backward"]["unmatched_ends"], 0)
        self.assertGreaterEqual(steps["Backward"]["min_ns"], WORK_NS)

    def old_torch_module(self):
        """A module as torch 1.13 calls its hooks: no register_full_backward_pre_hook; the
        full backward hook (every grad_input None: the input needs no gradient) runs
        before the gradient reaches the forward output's tensor (its hook starts the
        span); `reach_output=False`: a pass that never reaches it."""

        class StubTensor:
            def __init__(self):
                self.requires_grad, self.hooks = True, []

            def register_hook(self, hook):
                self.hooks.append(hook)

        class OldModule(StubModule):
            register_full_backward_pre_hook = None

            def __call__(self, x):
                self.output = StubTensor()
                for hook in list(self.forward_hooks.values()):
                    hook(self, (x,), self.output)
                return self.output

            def backward(self, inputs_require_grad=False, engine=None, reach_output=True):
                for hook in list(self.backward_hooks.values()):
                    hook(self, (None,), (1.0,))
                if reach_output:
                    for hook in self.output.hooks:
                        hook(1.0)
                time.sleep(self.backward_work)
                if engine is not None:
                    engine.end_of_pass()

        return OldModule()

    def test_backward_hook_before_the_start_waits_for_it(self):
        # torch 1.13 with a model fed with data: the end comes first; it waits for the end
        # of the pass, and the span covers the module's backward.
        self.use_engine(StubEngine())
        model = self.old_torch_module()
        with st_torch.instrument(model) as hooks:
            for i in range(3):
                model(float(i))
                model.backward(engine=self.engine)
            # A second backward through the same (retained) graph: a span again.
            model.backward(engine=self.engine)
            self.assertEqual(hooks.skipped_backward_ends, 0)
        steps = self.steps()
        self.assertEqual(steps["Backward"]["count"], 4)
        self.assertEqual(steps["Backward"]["open"], 0)
        self.assertEqual(steps["Backward"]["unmatched_ends"], 0)
        self.assertGreaterEqual(steps["Backward"]["min_ns"], WORK_NS)

    def test_backward_end_without_a_start_is_skipped_and_counted(self):
        # Passes that reach the module's backward hook but not the hook that starts the
        # span: nothing is ended (no unmatched end, no span of negative length); the
        # ends are counted, one warning says so. With an engine (the end waits for the
        # pass) and without one (no torch: the end is decided at the hook).
        for engine in (StubEngine(), None):
            with self.subTest(engine=engine is not None):
                if engine is not None:
                    self.use_engine(engine)
                else:
                    st_torch._queue_callback = lambda callback: False
                model = self.old_torch_module()
                with st_torch.instrument(model) as hooks, \
                        warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for i in range(3):
                        model(float(i))
                        model.backward(engine=engine, reach_output=False)
                    self.assertEqual(hooks.skipped_backward_ends, 3)
                self.assertEqual(len([w for w in caught if "without a Backward span" in
                                      str(w.message)]), 1)
                steps = self.steps()
                self.assertNotIn("Backward", steps)

    def test_module_spans(self):
        class Linear(StubModule):
            pass

        class Conv(Linear):  # a subclass takes its base class's step
            pass

        class Model(StubModule):
            def __init__(self):
                super().__init__(forward_work=0, backward_work=0)
                self.layers = [Linear(0, 0), Conv(0, 0), StubModule(0, 0)]

            def modules(self):
                return [self, *self.layers]

            def __call__(self, x):
                return super().__call__(sum(layer(x) for layer in self.layers))

        model = Model()
        with st_torch.instrument(model, backward=False,
                                 modules={Linear: "Matmul", Model: None}) as hooks:
            self.assertEqual(len(hooks), 2 + 2 * 2)
            for _ in range(3):
                model(1.0)
        steps = self.steps()
        self.assertEqual(steps["Matmul"]["count"], 6)
        self.assertEqual(steps["Forward"]["count"], 3)
        with self.assertRaisesRegex(TypeError, "modules must be"):
            st_torch.instrument(model, modules="Linear")
        with self.assertRaisesRegex(TypeError, "has no modules"):
            st_torch.instrument(StubModule(), modules={Linear: "Matmul"})

    def test_synchronize(self):
        calls = []
        model = StubModule(forward_work=0, backward_work=0)
        with st_torch.instrument(model, synchronize=lambda: calls.append(1)):
            model(1.0)
            model.backward()
        self.assertEqual(len(calls), 4)  # before each start and each end
        with self.assertRaises(TypeError):
            st_torch.instrument(StubModule(), synchronize="yes")

    def test_instrument_checks(self):
        with self.assertRaisesRegex(TypeError, "register_full_backward_pre_hook"):
            st_torch.instrument(object())
        # What is missing is named: here only the backward end's hook.
        class NoBackwardHook(StubModule):
            register_full_backward_hook = None

        with self.assertRaisesRegex(TypeError, "NoBackwardHook has no "
                                    "register_full_backward_hook \\("):
            st_torch.instrument(NoBackwardHook())
        st_torch.instrument(NoBackwardHook(), backward=False).remove()
        model = StubModule()
        hooks = st_torch.instrument(model)
        with self.assertRaises(ValueError):
            st_torch.instrument(model)  # twice would count every call twice
        hooks.remove()
        st_torch.instrument(model).remove()  # again once removed
        self.assertEqual(model.hook_count(), 0)

    def test_steps_per_thread(self):
        counts = []

        def worker():
            counts.extend(st_torch.step() for _ in range(3))
            st_torch.end_step()

        t = threading.Thread(target=worker)
        t.start()
        t.join()
        self.assertEqual(counts, [1, 2, 3])
        steps = self.steps()
        self.assertEqual(steps["Step"]["count"], 3)  # three steps, the last ended by end_step()
        self.assertEqual(steps["Step"]["open"], 0)

    def test_torch_not_imported(self):  # modules=True would import it
        self.assertNotIn("torch", sys.modules)


if __name__ == "__main__":
    unittest.main(verbosity=2)
