#!/usr/bin/env python3
"""The Python binding (bindings/python/steptrace.py) against the real steptraced.

Run by ctest with STEPTRACE_LIBRARY (libsteptrace.so), PYTHONPATH (the bindings dir) and
STEPTRACED_BIN (the daemon) set. Starts its own daemon on a temporary socket."""

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import steptrace


def command(sock_path, line, timeout=10.0):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(sock_path)
        s.sendall(line.encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while True:
            data = s.recv(65536)
            if not data:
                break
            chunks.append(data)
    return b"".join(chunks).decode()


class Daemon:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="steptrace-py-")
        self.socket = os.path.join(self.dir, "d.sock")
        self.log = open(os.path.join(self.dir, "d.log"), "wb")
        self.proc = subprocess.Popen([os.environ["STEPTRACED_BIN"], "--socket", self.socket],
                                     stderr=self.log)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if command(self.socket, "ping", 1.0).startswith("pong"):
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("steptraced did not answer ping")

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class BindingTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.daemon = Daemon()

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
        self.assertEqual(steptrace.connect(self.daemon.socket), 0)
        self.assertEqual(steptrace.step_id("Forward"), steptrace.Step.Forward)
        custom = steptrace.register_step("PyStep")
        self.assertNotEqual(custom, steptrace.INVALID_STEP)
        self.assertEqual(steptrace.register_step("PyStep"), custom)
        self.assertEqual(steptrace.register_step(""), steptrace.INVALID_STEP)

        for _ in range(10):
            with steptrace.span("Forward"):
                with steptrace.span(steptrace.Step.Matmul):
                    pass

        @steptrace.traced("PyDecorated")
        def work(x):
            return x * 2

        self.assertEqual([work(i) for i in range(5)], [0, 2, 4, 6, 8])
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
        self.assertEqual(counts.get("PyStep"), 1)
        self.assertEqual(counts.get("Backward"), 1)
        self.assertEqual(counts.get("LedgerReserve"), 1)
        self.assertEqual(proc["dropped"], 0)

        ledger = json.loads(command(self.daemon.socket, "ledger --json"))
        reservations = [r for g in ledger["gpus"] if g["gpu"] == "GPU-python"
                        for r in g["reservations"]]
        self.assertIn((11, os.getpid(), 4096), [(r["id"], r["pid"], r["bytes"])
                                                for r in reservations])

        # Last (the daemon's view above expects no drop): an unknown step id is counted
        # as invalid.
        steptrace.start(5000)
        after = steptrace.dropped_by_cause()
        self.assertEqual(list(after), list(steptrace.DROP_CAUSES))
        self.assertEqual(after["invalid"], 1)
        self.assertEqual(sum(after.values()), steptrace.dropped())

    def test_buffer_size(self):
        self.assertEqual(steptrace.set_buffer_size(1 << 20, 0), 0)
        self.assertEqual(steptrace.set_buffer_size(0, 64 << 20), 0)
        self.assertEqual(steptrace.set_buffer_size(1024), -errno.EINVAL)
        self.assertEqual(steptrace.set_buffer_size(4 << 20, 256 << 20), 0)  # the defaults

    def test_disabled_records_nothing(self):
        before = steptrace.dropped()
        steptrace.set_enabled(False)
        for _ in range(100000 // 10):
            steptrace.start("Alloc")
            steptrace.end("Alloc")
        steptrace.set_enabled(True)
        self.assertEqual(steptrace.dropped(), before)


if __name__ == "__main__":
    unittest.main(verbosity=2)
