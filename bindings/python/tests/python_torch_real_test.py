#!/usr/bin/env python3
"""steptrace.torch on the real PyTorch (Debian 12's python3-torch is 1.13, which has no
register_full_backward_pre_hook: the Backward span starts from the output's tensor hook)
against the real steptraced: a small TransformerEncoder trained a few steps with AdamW,
counts and durations read back from `report --json`.

Needs torch: when the python running this has none, the script runs itself again with
/usr/bin/python3 (Debian's, where python3-torch installs it); with neither it exits 77,
which ctest reports as skipped. Run by ctest with STEPTRACE_LIBRARY, PYTHONPATH (the
bindings dir) and STEPTRACED_BIN set."""

import importlib.util
import os
import sys

SKIP = 77
SYSTEM_PYTHON = "/usr/bin/python3"

if importlib.util.find_spec("torch") is None:
    if os.path.realpath(sys.executable) != os.path.realpath(SYSTEM_PYTHON) and \
            os.path.exists(SYSTEM_PYTHON) and not os.environ.get("STEPTRACE_TORCH_REEXEC"):
        os.environ["STEPTRACE_TORCH_REEXEC"] = "1"
        os.execv(SYSTEM_PYTHON, [SYSTEM_PYTHON, "-B", *sys.argv])
    print("SKIP: no torch here (Debian: apt-get install python3-torch)")
    sys.exit(SKIP)

import time  # noqa: E402
import unittest  # noqa: E402

import torch  # noqa: E402

import steptrace  # noqa: E402
import steptrace.torch as st_torch  # noqa: E402
from python_testutil import ConnectedTestCase  # noqa: E402

LAYERS = 2
STEPS = 5
BATCH, SEQ, DIM, HEADS = 8, 16, 32, 4


class Model(torch.nn.Module):
    """A TransformerEncoder and a linear head: per forward, LAYERS attention blocks,
    2 * LAYERS + 1 Linear calls (the attention's own projections are not module calls)
    and 2 * LAYERS LayerNorms."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(DIM, HEADS, dim_feedforward=64, dropout=0.0)
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS)
        self.head = torch.nn.Linear(DIM, 1)

    def forward(self, x):
        return self.head(self.encoder(x)).squeeze(-1)


def train(model, steps, instrumented=True):
    """`steps` AdamW steps; the wall time of each loss.backward()."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randn(SEQ, BATCH, DIM)
    target = torch.randn(SEQ, BATCH)
    backward_ns = []
    for _ in range(steps):
        if instrumented:
            st_torch.step()
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(data), target)
        t0 = time.monotonic_ns()
        loss.backward()
        backward_ns.append(time.monotonic_ns() - t0)
        optimizer.step()
    if instrumented:
        st_torch.end_step()
    return backward_ns


class RealTorchTest(ConnectedTestCase):
    @classmethod
    def setUpClass(cls):
        torch.manual_seed(0)
        torch.set_num_threads(1)  # CI shares few cores
        super().setUpClass()

    def steps(self):
        self.assertEqual(steptrace.flush(10000), 0)
        return self.daemon.steps(os.getpid())

    def assertClosed(self, steps, *names):
        for name in names:
            self.assertEqual(steps[name]["open"], 0, name)
            self.assertEqual(steps[name]["unmatched_ends"], 0, name)

    def test_transformer_with_adamw(self):
        model = Model()
        model.train()
        with st_torch.instrument(model, modules=True):
            backward_ns = train(model, STEPS)
        steps = self.steps()
        print(f"torch {torch.__version__}: " + ", ".join(
            f"{n} {s['count']}" for n, s in sorted(steps.items())), file=sys.stderr)
        self.assertEqual(steps["Step"]["count"], STEPS)
        self.assertEqual(steps["Forward"]["count"], STEPS)
        self.assertEqual(steps["Backward"]["count"], STEPS)
        self.assertEqual(steps["Matmul"]["count"], STEPS * (2 * LAYERS + 1))
        self.assertEqual(steps["Attention"]["count"], STEPS * LAYERS)
        self.assertEqual(steps["Norm"]["count"], STEPS * 2 * LAYERS)
        self.assertClosed(steps, "Step", "Forward", "Backward", "Matmul", "Attention", "Norm")
        # The Backward span lies inside loss.backward() and covers most of it (it starts
        # when the gradient reaches the model's output: only the loss's backward is before).
        self.assertLessEqual(steps["Backward"]["total_ns"], sum(backward_ns))
        self.assertGreater(steps["Backward"]["total_ns"], sum(backward_ns) // 4)
        # Per-module spans nest inside Forward.
        self.assertLess(steps["Matmul"]["total_ns"], steps["Forward"]["total_ns"])
        self.assertEqual(steptrace.dropped(), 0)

    def test_hooks_come_off(self):
        model = Model()
        hooks = st_torch.instrument(model, modules={torch.nn.Linear: "Matmul"})
        hooks.remove()
        train(model, 1, instrumented=False)
        self.assertNotIn("Forward", self.steps())
        with st_torch.instrument(model):  # again, once removed
            train(model, 1, instrumented=False)
        self.assertEqual(self.steps()["Backward"]["count"], 1)

    def test_forward_only_and_no_grad(self):
        model = Model()
        with st_torch.instrument(model, backward=False):
            train(model, 2, instrumented=False)
        with st_torch.instrument(model), torch.no_grad():
            model(torch.randn(SEQ, BATCH, DIM))  # no gradient: no Backward span opens
        steps = self.steps()
        self.assertEqual(steps["Forward"]["count"], 3)
        self.assertNotIn("Backward", steps)
        self.assertClosed(steps, "Forward")

    def test_backward_passes_that_torch_113_orders_oddly(self):
        # Passes where, on torch 1.13, the module's backward hook runs before (or
        # without) the output's tensor hook that starts the span: a second backward
        # through a retained graph (it used to end a span it had not started), gradients
        # asked with autograd.grad, an input that needs a gradient, a module whose output
        # is a parameter (no grad_fn of its own), one output of two used. Every Backward
        # span starts before it ends: one per pass, none open, no unmatched end.
        class Leaf(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.randn(3))

            def forward(self, x):
                return self.weight

        class Two(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.linear(x), self.linear(x) * 2

        linear, leaf, two = torch.nn.Linear(4, 4), Leaf(), Two()
        passes = [
            lambda: self._twice(linear(torch.randn(2, 4)).sum()),
            lambda: torch.autograd.grad(linear(torch.randn(2, 4)).sum(), [linear.weight]),
            lambda: linear(torch.randn(2, 4, requires_grad=True)).sum().backward(),
            lambda: leaf(torch.randn(3)).sum().backward(),
            lambda: two(torch.randn(2, 4))[1].sum().backward(),
        ]
        with st_torch.instrument(linear, forward=False) as a, \
                st_torch.instrument(leaf, forward=False) as b, \
                st_torch.instrument(two, forward=False) as c:
            for run in passes:
                run()
            self.assertEqual([h.skipped_backward_ends for h in (a, b, c)], [0, 0, 0])
        steps = self.steps()
        self.assertEqual(steps["Backward"]["count"], 6)  # the retained graph's two passes
        self.assertClosed(steps, "Backward")

    @staticmethod
    def _twice(loss):
        loss.backward(retain_graph=True)
        loss.backward()

    def test_modules_map(self):
        model = Model()
        # A class of the default map left out, a subclass's base class, an id.
        mapping = {**st_torch.default_modules(), torch.nn.LayerNorm: None,
                   torch.nn.modules.linear.Linear: int(steptrace.Step.Matmul)}
        with st_torch.instrument(model, forward=False, backward=False, modules=mapping):
            train(model, 1, instrumented=False)
        steps = self.steps()
        self.assertEqual(steps["Matmul"]["count"], 2 * LAYERS + 1)
        self.assertNotIn("Norm", steps)
        self.assertNotIn("Forward", steps)
        with self.assertRaises(TypeError):
            st_torch.instrument(model, modules=[torch.nn.Linear])


if __name__ == "__main__":
    unittest.main(verbosity=2)
