"""Helpers of the Python binding's tests: a real steptraced on a temporary socket, and
its text commands. Needs STEPTRACED_BIN (the daemon) in the environment."""

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import unittest


def command(sock_path, line, timeout=10.0):
    """The daemon's whole reply to one text command; OSError when it cannot be had.
    tests/packaging (packaging_util.command) uses it too."""
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
    """steptraced on a socket in a temporary directory, killed by close()."""

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
        self.close()
        raise RuntimeError("steptraced did not answer ping")

    def process(self, pid):
        """The `report --json` entry of process `pid`, or None."""
        doc = json.loads(command(self.socket, "report --json --pid %d" % pid))
        for p in doc["processes"]:
            if p["pid"] == pid:
                return p
        return None

    def steps(self, pid):
        """{step name: its report --json row} for process `pid`."""
        proc = self.process(pid)
        return {} if proc is None else {s["step"]: s for s in proc["steps"]}

    def reset(self, pid):
        """Clears pid's per-step aggregates (its open spans stay open)."""
        reply = command(self.socket, "reset --pid %d" % pid)
        if not reply.startswith("ok") and "no process" not in reply:
            raise RuntimeError("reset: " + reply)

    def close(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class ConnectedTestCase(unittest.TestCase):
    """Tests of one process connected to its own steptraced for the whole class; each
    test starts with everything flushed and this process's figures reset."""

    @classmethod
    def setUpClass(cls):
        import steptrace  # by then the test has put the package on sys.path

        cls.daemon = Daemon()
        assert steptrace.connect(cls.daemon.socket) == 0

    @classmethod
    def tearDownClass(cls):
        import steptrace

        steptrace.shutdown()
        cls.daemon.close()

    def setUp(self):
        import steptrace

        self.assertEqual(steptrace.flush(10000), 0)
        self.daemon.reset(os.getpid())
