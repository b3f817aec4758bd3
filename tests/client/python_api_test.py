#!/usr/bin/env python3
"""The Python package's argument checks and its span context manager / decorator, with
no daemon: every bad argument raises TypeError or ValueError in Python, before any C call
(so the library counts nothing as invalid).

Run by ctest with STEPTRACE_LIBRARY, PYTHONPATH (the bindings dir) and STEPTRACE_VERSION
(the project's version) set."""

import os
import sys
import unittest

import steptrace

GPU = "GPU-python-api"


class ArgumentChecks(unittest.TestCase):
    def tearDown(self):
        # Nothing the checks refused reached the library.
        self.assertEqual(steptrace.dropped_by_cause()["invalid"], 0)

    def test_step_types(self):
        for bad in (None, 1.5, True, b"Forward", ["Forward"], object()):
            for call in (steptrace.start, steptrace.end, steptrace.span, steptrace.step_id):
                with self.assertRaises(TypeError, msg=f"{call.__name__}({bad!r})"):
                    call(bad)
        with self.assertRaisesRegex(TypeError, r"@steptrace\.span\(\"Name\"\)"):
            @steptrace.span
            def forgot_the_name():
                pass

    def test_step_names(self):
        for bad in ("", "x" * 64, "tab\there", "new\nline", "caf\u00e9", "\x7f"):
            for call in (steptrace.start, steptrace.end, steptrace.span,
                         steptrace.register_step):
                with self.assertRaises(ValueError, msg=f"{call.__name__}({bad!r})"):
                    call(bad)
        self.assertEqual(steptrace.register_step("x" * 63), steptrace.register_step("x" * 63))
        self.assertEqual(steptrace.register_step("Matmul"), steptrace.Step.Matmul)

    def test_step_ids(self):
        for bad in (-1, 12, 255, 5000, steptrace.INVALID_STEP, 1 << 40):
            with self.assertRaises(ValueError, msg=str(bad)):
                steptrace.start(bad)
            with self.assertRaises(ValueError, msg=str(bad)):
                steptrace.end(bad)
        custom = steptrace.register_step("PyApiCustom")
        self.assertEqual(steptrace.step_id(custom), custom)
        self.assertEqual(steptrace.step_id("PyApiCustom"), custom)
        steptrace.start(custom)
        steptrace.end(custom)
        self.assertEqual(steptrace.step_id(steptrace.Step.WaitPoll), 10)
        self.assertEqual(steptrace.step_id(3), 3)

    def test_ledger_arguments(self):
        with self.assertRaises(TypeError):
            steptrace.ledger_reserve(None, 1, 1)
        with self.assertRaises(TypeError):
            steptrace.ledger_reserve(GPU, "1", 1)
        with self.assertRaises(TypeError):
            steptrace.ledger_reserve(GPU, 1, 1.0)
        with self.assertRaises(TypeError):
            steptrace.ledger_reserve(GPU, 1, 1, task=7)
        with self.assertRaises(TypeError):
            steptrace.ledger_release(GPU, True)
        for args in (("", 1, 1), ("G" * 64, 1, 1), (GPU, -1, 1), (GPU, 1 << 64, 1),
                     (GPU, 1, -1), (GPU, 1, 1 << 64)):
            with self.assertRaises(ValueError, msg=repr(args)):
                steptrace.ledger_reserve(*args)
        with self.assertRaises(ValueError):
            steptrace.ledger_reserve(GPU, 1, 1, "t" * 64)
        with self.assertRaises(ValueError):
            steptrace.ledger_reserve(GPU, 1, 1, "t\u00e4sk")
        with self.assertRaises(ValueError):
            steptrace.ledger_cleanup(GPU, 1, 1 << 32)
        with self.assertRaises(ValueError):
            steptrace.ledger_cleanup(GPU, 1, -5)
        with self.assertRaises(ValueError):
            steptrace.vram_sample(GPU, -1, 10)
        with self.assertRaises(ValueError):
            steptrace.ledger_release("", 1)

    @unittest.skipUnless(steptrace.HAS_LEASES, "the library has no leases")
    def test_lease_arguments(self):
        for lease in (0, -1, steptrace.MAX_LEASE_MS + 1):
            with self.assertRaises(ValueError, msg=str(lease)):
                steptrace.ledger_reserve_lease(GPU, 1, 1, None, lease)
            with self.assertRaises(ValueError, msg=str(lease)):
                steptrace.ledger_renew(GPU, 1, lease)
        with self.assertRaises(TypeError):
            steptrace.ledger_renew(GPU, 1, 1.5)
        with self.assertRaises(TypeError):
            steptrace.ledger_reserve_lease(None, 1, 1, None, 1000)

    def test_other_arguments(self):
        with self.assertRaises(TypeError):
            steptrace.connect(5)
        with self.assertRaises(ValueError):
            steptrace.connect("")
        with self.assertRaises(TypeError):
            steptrace.flush("1000")
        with self.assertRaises(ValueError):
            steptrace.flush(-1)
        with self.assertRaises(ValueError):
            steptrace.set_buffer_size(-1)
        # Not connected: flush says so at once.
        self.assertLess(steptrace.flush(0), 0)


class SpanForms(unittest.TestCase):
    def test_decorator(self):
        @steptrace.span("PyApiDecorated")
        def work(x, *, scale=2):
            """Doubles."""
            return x * scale

        self.assertEqual(work(3), 6)
        self.assertEqual(work(3, scale=3), 9)
        self.assertEqual(work.__name__, "work")
        self.assertEqual(work.__doc__, "Doubles.")
        self.assertEqual(work.__wrapped__.__name__, "work")

        @steptrace.span(steptrace.Step.Attention)
        def fails():
            raise KeyError("passes through")

        with self.assertRaises(KeyError):
            fails()

    def test_decorator_refuses_generators_and_coroutines(self):
        def gen():
            yield 1

        async def coro():
            return 1

        for func in (gen, coro):
            with self.assertRaises(TypeError, msg=func.__name__):
                steptrace.span("Forward")(func)
        with self.assertRaises(TypeError):
            steptrace.span("Forward")(42)

    def test_context_manager(self):
        s = steptrace.span("Forward")
        self.assertEqual(s.id, steptrace.Step.Forward)
        with s as entered:
            self.assertIs(entered, s)
            with s:  # nested, same object
                pass
        with self.assertRaises(RuntimeError):
            with steptrace.span("PyApiBlock"):
                raise RuntimeError("passes through")
        self.assertEqual(repr(s), "steptrace.span('Forward')")


class Package(unittest.TestCase):
    def test_version_is_the_projects(self):
        self.assertEqual(steptrace.__version__, os.environ["STEPTRACE_VERSION"])

    def test_library(self):
        self.assertEqual(steptrace._found_by, "$STEPTRACE_LIBRARY")
        self.assertEqual(steptrace.library_path,
                         os.path.realpath(os.environ["STEPTRACE_LIBRARY"]))
        bindings = os.environ["PYTHONPATH"].split(os.pathsep)[0]
        self.assertTrue(os.path.samefile(os.path.dirname(steptrace.__file__),
                                         os.path.join(bindings, "steptrace")))

    def test_torch_module_imports_without_torch(self):
        import steptrace.torch  # noqa: F401  (torch is imported only when asked for)
        self.assertNotIn("torch", sys.modules)


if __name__ == "__main__":
    unittest.main(verbosity=2)
