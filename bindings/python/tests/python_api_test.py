#!/usr/bin/env python3
"""The Python package's argument checks and its span context manager / decorator, with
no daemon: every bad argument raises TypeError or ValueError in Python, before any C call
(so the library counts nothing as invalid, and steptrace.rejected() does not move); the
calls the library itself refuses are counted by rejected(); the calls it fails raise
OSError with their errno.

Run by ctest with STEPTRACE_LIBRARY, PYTHONPATH (the bindings dir) and STEPTRACE_VERSION
(the project's version) set."""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest
import unittest.mock

import steptrace

GPU = "GPU-python-api"


class ArgumentChecks(unittest.TestCase):
    def setUp(self):
        self.invalid_before = steptrace.dropped_by_cause()["invalid"]
        self.rejected_before = steptrace.rejected()

    def tearDown(self):
        # Nothing the checks refused reached the library.
        self.assertEqual(steptrace.dropped_by_cause()["invalid"], self.invalid_before)
        self.assertEqual(steptrace.rejected(), self.rejected_before)

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
        with self.assertRaises(TypeError):
            steptrace.flush(0, True)  # check is keyword-only
        with self.assertRaises(TypeError):
            steptrace.connect(None, True)


class FailingCalls(unittest.TestCase):
    """What the library fails raises OSError with its errno: set_buffer_size always,
    connect and flush with check=True. Without check=True, connect and flush return
    -errno as they always did."""

    def test_set_buffer_size_out_of_range(self):
        for args in ((1024,), (1 << 31,), (0, 1024), (0, 1 << 41)):
            with self.assertRaises(OSError, msg=repr(args)) as caught:
                steptrace.set_buffer_size(*args)
            self.assertEqual(caught.exception.errno, errno.EINVAL)
            self.assertIn("set_buffer_size", str(caught.exception))
            self.assertIn("nothing changed", caught.exception.strerror)
            self.assertIsNone(caught.exception.filename)
        self.assertEqual(steptrace.set_buffer_size(4 << 20, 256 << 20), 0)  # the defaults

    def test_flush_not_connected(self):
        # No daemon: flush says so at once, as -ENOTCONN or as OSError(ENOTCONN).
        self.assertEqual(steptrace.flush(0), -errno.ENOTCONN)
        with self.assertRaises(OSError) as caught:
            steptrace.flush(0, check=True)
        self.assertEqual(caught.exception.errno, errno.ENOTCONN)
        self.assertIn("steptrace.flush(0)", str(caught.exception))
        self.assertIsNone(caught.exception.filename)

    def test_connect_no_daemon(self):
        missing = os.path.join(tempfile.mkdtemp(prefix="steptrace-py-api-"), "none.sock")
        try:
            self.assertEqual(steptrace.connect(missing), -errno.ENOENT)
            with self.assertRaises(FileNotFoundError) as caught:
                steptrace.connect(missing, check=True)
            self.assertEqual(caught.exception.errno, errno.ENOENT)
            self.assertEqual(caught.exception.filename, missing)
            self.assertIn("steptrace.connect", caught.exception.strerror)
            # No path given: $STEPTRACE_SOCKET is the file named.
            with unittest.mock.patch.dict(os.environ, {"STEPTRACE_SOCKET": missing}):
                with self.assertRaises(OSError) as caught:
                    steptrace.connect(check=True)
            self.assertEqual(caught.exception.errno, errno.ENOENT)
            self.assertEqual(caught.exception.filename, missing)
        finally:
            # Not steptrace.shutdown(): RejectedCount needs recording on. The library
            # keeps trying this path in the background, as it tried the default before.
            shutil.rmtree(os.path.dirname(missing), ignore_errors=True)


# Counts the calls the library refused, in a fresh process: registers custom steps until
# the library's per-process limit refuses one (the one refusal Python's checks cannot see
# coming), then one more. Prints a JSON object.
_REGISTER_PAST_THE_LIMIT = """
import json, steptrace
out = {"rejected_at_start": steptrace.rejected()}
registered = 0
while True:
    try:
        steptrace.register_step("PyApiLimit%d" % registered)
    except RuntimeError:
        break
    registered += 1
    if registered > 1 << 20:
        raise SystemExit("no limit of custom steps after %d" % registered)
out["registered"] = registered
out["rejected_after_limit"] = steptrace.rejected()
try:
    steptrace.span("PyApiLimitOneMore")
except RuntimeError:
    out["span_raised"] = True
out["rejected_after_span"] = steptrace.rejected()
steptrace.register_step("PyApiLimit0")  # registered before: answered by Python, no C call
out["rejected_at_end"] = steptrace.rejected()
out["invalid"] = steptrace.dropped_by_cause()["invalid"]
print(json.dumps(out))
"""


class RejectedCount(unittest.TestCase):
    """steptrace.rejected(): steptrace_rejected, calls refused for their arguments."""

    def counts(self):
        return steptrace.rejected(), steptrace.dropped_by_cause()["invalid"]

    def test_refused_in_python_is_not_counted(self):
        before = self.counts()
        refusals = [
            (ValueError, steptrace.start, 12),           # unknown id
            (ValueError, steptrace.end, 5000),
            (ValueError, steptrace.start, steptrace.INVALID_STEP),
            (ValueError, steptrace.register_step, ""),   # bad names
            (ValueError, steptrace.register_step, "x" * 64),
            (ValueError, steptrace.span, "tab\there"),
            (TypeError, steptrace.start, None),
            (TypeError, steptrace.register_step, None),
            (ValueError, steptrace.ledger_release, "", 1),  # empty / missing GPU UUID
            (TypeError, steptrace.ledger_reserve, None, 1, 1),
            (ValueError, steptrace.vram_sample, "", 1, 2),
        ]
        if steptrace.HAS_LEASES:
            refusals += [(ValueError, steptrace.ledger_renew, GPU, 1, 0),
                         (ValueError, steptrace.ledger_reserve_lease, GPU, 1, 1, None,
                          steptrace.MAX_LEASE_MS + 1)]
        for error, call, *args in refusals:
            with self.assertRaises(error, msg=f"{call.__name__}{tuple(args)!r}"):
                call(*args)
        self.assertEqual(self.counts(), before)

    def test_refused_by_the_library_is_counted(self):
        # The module's own ctypes functions, past the Python checks; recording is on (no
        # test turns it off), which span and ledger calls need to be checked at all.
        steptrace.set_enabled(True)
        rejected, invalid = self.counts()
        # Accepted calls count nothing.
        steptrace._c_start(int(steptrace.Step.Forward))
        steptrace._c_end(int(steptrace.Step.Forward))
        steptrace._c_ledger_release(GPU.encode(), 1)
        self.assertEqual(self.counts(), (rejected, invalid))
        # Refused span and ledger calls: rejected, and dropped as invalid.
        steptrace._c_start(12)                     # neither built-in nor registered
        steptrace._c_end(256 + 5000)
        steptrace._c_ledger_release(b"", 1)        # empty GPU UUID
        steptrace._c_vram_sample(None, 1, 2)       # NULL GPU UUID
        self.assertEqual(self.counts(), (rejected + 4, invalid + 4))
        # A refused registration: rejected only.
        self.assertEqual(steptrace._c_register_step(b""), steptrace.INVALID_STEP)
        self.assertEqual(steptrace._c_register_step(b"tab\there"), steptrace.INVALID_STEP)
        self.assertEqual(self.counts(), (rejected + 6, invalid + 4))
        self.assertEqual(steptrace.rejected(), rejected + 6)

    def test_register_step_past_the_limit_is_counted(self):
        # A child process: the limit, once reached, would refuse the other tests' steps.
        env = dict(os.environ, STEPTRACE_AUTOCONNECT="0")
        run = subprocess.run([sys.executable, "-B", "-c", _REGISTER_PAST_THE_LIMIT], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             universal_newlines=True, timeout=60)
        self.assertEqual(run.returncode, 0, run.stderr)
        out = json.loads(run.stdout)
        self.assertEqual(out["rejected_at_start"], 0)
        self.assertGreater(out["registered"], 0)
        self.assertEqual(out["rejected_after_limit"], 1)  # the RuntimeError, once
        self.assertTrue(out.get("span_raised"))           # a new name through span
        self.assertEqual(out["rejected_after_span"], 2)
        self.assertEqual(out["rejected_at_end"], 2)
        self.assertEqual(out["invalid"], 0)               # registrations drop nothing


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
