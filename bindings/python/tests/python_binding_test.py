#!/usr/bin/env python3
"""The Python package (bindings/python/steptrace) against the real steptraced.

Run by ctest with STEPTRACE_LIBRARY (libsteptrace.so), PYTHONPATH (the bindings dir) and
STEPTRACED_BIN (the daemon) set. Starts its own daemon on a temporary socket."""

import errno
import json
import os
import signal
import unittest

import steptrace
from python_testutil import Daemon, command


class BindingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()
        cls.connected = steptrace.connect(cls.daemon.socket)

    @classmethod
    def tearDownClass(cls):
        steptrace.shutdown()
        cls.daemon.close()

    def report(self):
        doc = json.loads(command(self.daemon.socket, "report --json --pid %d" % os.getpid()))
        for p in doc["processes"]:
            if p["pid"] == os.getpid():
                return p
        self.fail("pid not in report")

    def test_round_trip(self):
        self.assertEqual(self.connected, 0)
        self.assertEqual(steptrace.step_id("Forward"), steptrace.Step.Forward)
        custom = steptrace.register_step("PyStep")
        self.assertNotEqual(custom, steptrace.INVALID_STEP)
        self.assertEqual(steptrace.register_step("PyStep"), custom)
        self.assertEqual(steptrace.step_id(custom), custom)
        with self.assertRaises(ValueError):
            steptrace.register_step("")

        for _ in range(10):
            with steptrace.span("Forward"):
                with steptrace.span(steptrace.Step.Matmul):
                    pass

        @steptrace.span("PyDecorated")
        def work(x):
            return x * 2

        @steptrace.traced("PyTraced")  # the older spelling of the decorator
        def legacy():
            return "ok"

        self.assertEqual([work(i) for i in range(5)], [0, 2, 4, 6, 8])
        self.assertEqual(legacy(), "ok")
        reused = steptrace.span("Transpose")  # one object, nested and entered again
        with reused:
            with reused:
                pass
        steptrace.start("PyStep")
        steptrace.end("PyStep")
        with self.assertRaises(ValueError):
            with steptrace.span("Backward"):
                raise ValueError("the span still ends")

        with steptrace.span("LedgerReserve"):
            steptrace.ledger_reserve("GPU-python", 11, 4096, "py-task")
        steptrace.vram_sample("GPU-python", 1 << 30, 2 << 30)

        self.assertEqual(steptrace.flush(10000), 0)
        self.assertEqual(steptrace.dropped(), 0)
        self.assertEqual(steptrace.dropped_by_cause(),
                         {"buffer_full": 0, "not_connected": 0, "in_flight": 0, "invalid": 0})

        proc = self.report()
        counts = {s["step"]: s["count"] for s in proc["steps"]}
        self.assertEqual(counts.get("Forward"), 10)
        self.assertEqual(counts.get("Matmul"), 10)
        self.assertEqual(counts.get("PyDecorated"), 5)
        self.assertEqual(counts.get("PyTraced"), 1)
        self.assertEqual(counts.get("Transpose"), 2)
        self.assertEqual(counts.get("PyStep"), 1)
        self.assertEqual(counts.get("Backward"), 1)
        self.assertEqual(counts.get("LedgerReserve"), 1)
        self.assertEqual(proc["dropped"], 0)

        ledger = json.loads(command(self.daemon.socket, "ledger --json"))
        reservations = [r for g in ledger["gpus"] if g["gpu"] == "GPU-python"
                        for r in g["reservations"]]
        self.assertIn((11, os.getpid(), 4096), [(r["id"], r["pid"], r["bytes"])
                                                for r in reservations])

        # An unknown step id never reaches the library from Python...
        with self.assertRaises(ValueError):
            steptrace.start(5000)
        self.assertEqual(steptrace.dropped_by_cause()["invalid"], 0)
        # ... and last (the daemon's view above expects no drop): sent to the C function
        # directly, the library counts it as invalid.
        steptrace._c_start(5000)
        after = steptrace.dropped_by_cause()
        self.assertEqual(list(after), list(steptrace.DROP_CAUSES))
        self.assertEqual(after["invalid"], 1)
        self.assertEqual(sum(after.values()), steptrace.dropped())

    @unittest.skipUnless(steptrace.HAS_LEASES, "the library has no leases")
    def test_leases(self):
        # No LedgerReserve span around it: test_round_trip counts those.
        steptrace.ledger_reserve_lease("GPU-python-lease", 21, 8192, "py-lease", 60000)
        steptrace.ledger_renew("GPU-python-lease", 21, 120000)
        with self.assertRaises(ValueError):
            steptrace.ledger_renew("GPU-python-lease", 21, 0)
        with self.assertRaises(ValueError):
            steptrace.ledger_reserve_lease("GPU-python-lease", 22, 1, None,
                                           steptrace.MAX_LEASE_MS + 1)
        self.assertEqual(steptrace.flush(10000), 0)
        self.assertEqual(steptrace.dropped_by_cause()["invalid"], 0)
        ledger = json.loads(command(self.daemon.socket, "ledger --json"))
        reservations = [r for g in ledger["gpus"] if g["gpu"] == "GPU-python-lease"
                        for r in g["reservations"]]
        self.assertEqual([(r["id"], r["pid"], r["bytes"]) for r in reservations],
                         [(21, os.getpid(), 8192)], reservations)

    def test_buffer_size(self):
        self.assertEqual(steptrace.set_buffer_size(1 << 20, 0), 0)
        self.assertEqual(steptrace.set_buffer_size(0, 64 << 20), 0)
        with self.assertRaises(OSError) as caught:
            steptrace.set_buffer_size(1024)
        self.assertEqual(caught.exception.errno, errno.EINVAL)
        self.assertEqual(steptrace.set_buffer_size(4 << 20, 256 << 20), 0)  # the defaults

    def test_disabled_records_nothing(self):
        before = steptrace.dropped()
        steptrace.set_enabled(False)
        for _ in range(100000 // 10):
            steptrace.start("Alloc")
            steptrace.end("Alloc")
        steptrace.set_enabled(True)
        self.assertEqual(steptrace.dropped(), before)


class CheckedCalls(unittest.TestCase):
    """connect and flush with check=True against a daemon of its own: 0 when they
    succeed, OSError with the errno when they fail. (After BindingTest, whose
    tearDownClass shut the library down: the names sort in that order.)"""

    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        steptrace.shutdown()
        cls.daemon.close()

    def test_connect_and_flush(self):
        self.assertEqual(steptrace.connect(self.daemon.socket, check=True), 0)
        with steptrace.span("PyChecked"):
            pass
        self.assertEqual(steptrace.flush(10000, check=True), 0)

        # A stopped daemon applies nothing: the flush runs out of time.
        self.daemon.proc.send_signal(signal.SIGSTOP)
        try:
            with steptrace.span("PyChecked"):
                pass
            self.assertEqual(steptrace.flush(100), -errno.ETIMEDOUT)
            with self.assertRaises(TimeoutError) as caught:
                steptrace.flush(100, check=True)
            self.assertEqual(caught.exception.errno, errno.ETIMEDOUT)
            self.assertIn("steptrace.flush(100)", caught.exception.strerror)
        finally:
            self.daemon.proc.send_signal(signal.SIGCONT)
        self.assertEqual(steptrace.flush(10000, check=True), 0)
        self.assertEqual(self.daemon.steps(os.getpid())["PyChecked"]["count"], 2)

        # After shutdown: not connected.
        steptrace.shutdown()
        with self.assertRaises(OSError) as caught:
            steptrace.flush(1000, check=True)
        self.assertEqual(caught.exception.errno, errno.ENOTCONN)


if __name__ == "__main__":
    unittest.main(verbosity=2)
