"""Shared helpers for the packaging tests (tests/packaging/*_test.py).

The tests work on what users get: the build installed into a temporary prefix, the
real steptraced started from it on a temporary socket, the .deb cpack makes. ctest
passes the paths through the environment (see CMakeLists.txt here).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

# One client of the daemon's text commands for all the Python tests: the binding's, in
# bindings/python/tests (they cannot import this module, which needs the packaging tests'
# environment).
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                             "bindings", "python", "tests"))
from python_testutil import command as _command  # noqa: E402

BUILD_DIR = os.environ["STEPTRACE_BUILD_DIR"]
SOURCE_DIR = os.environ["STEPTRACE_SOURCE_DIR"]
CMAKE = os.environ["STEPTRACE_CMAKE"]
LIBDIR = os.environ["STEPTRACE_INSTALL_LIBDIR"]  # relative, e.g. lib or lib/x86_64-linux-gnu
VERSION = os.environ["STEPTRACE_VERSION"]


def tool(name, package):
    """Absolute path of a tool; fails the test (never skips) when it is missing."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} not found: install the Debian package {package} "
                             f"(scripts/setup.sh lists it)")
    return path


def run(argv, *, env=None, cwd=None, timeout=120, input=None):
    """Runs argv, returns CompletedProcess with text stdout/stderr."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.run([str(a) for a in argv], env=full_env, cwd=cwd, input=input,
                          capture_output=True, text=True, timeout=timeout)


def check_run(test, argv, **kwargs):
    """Runs argv and fails `test` with its output unless it exits 0."""
    result = run(argv, **kwargs)
    test.assertEqual(result.returncode, 0,
                     f"{' '.join(map(str, argv))} exited {result.returncode}\n"
                     f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


class TempDirTestCase(unittest.TestCase):
    """Gives each test a short private directory (Unix socket paths must stay < 108), and
    each test class one install of the build, made on first use and shared read-only."""

    _prefix_root = None

    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="stpkg-")
        self.addCleanup(shutil.rmtree, self.tmp, ignore_errors=True)

    @classmethod
    def tearDownClass(cls):
        if cls._prefix_root is not None:
            shutil.rmtree(cls._prefix_root, ignore_errors=True)
            cls._prefix_root = None

    def install_prefix(self):
        """`cmake --install` of the build into a temporary prefix; returns the prefix."""
        cls = type(self)
        if cls._prefix_root is None:
            root = tempfile.mkdtemp(prefix="stinst-")
            result = run([CMAKE, "--install", BUILD_DIR, "--prefix", os.path.join(root, "p")])
            if result.returncode != 0:
                shutil.rmtree(root, ignore_errors=True)
                self.fail(f"cmake --install failed:\n{result.stdout}\n{result.stderr}")
            cls._prefix_root = root
        return os.path.join(cls._prefix_root, "p")


def command(sock_path, line, timeout=10.0):
    """One text command over the daemon's socket; the reply, or None when it fails."""
    try:
        return _command(sock_path, line, timeout)
    except OSError:
        return None


class Daemon:
    """A steptraced child process. `argv` is the whole command line (so tests can start
    it through systemd-socket-activate); stderr goes to `log_path`."""

    def __init__(self, argv, log_path, env=None):
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env.pop("NOTIFY_SOCKET", None)
        full_env.pop("LISTEN_FDS", None)
        full_env.pop("LISTEN_PID", None)
        if env:
            full_env.update(env)
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(self.argv, env=full_env, stdout=subprocess.DEVNULL,
                                     stderr=self.log)

    def wait_ready(self, sock_path, timeout=10.0):
        """True once `ping` answers `pong` on sock_path."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if os.path.exists(sock_path) and (command(sock_path, "ping", 2.0) or "").strip() == "pong":
                return True
            time.sleep(0.05)
        return False

    def wait_exit(self, timeout=20.0):
        """Waits (without signalling) for the daemon to exit and returns its status; a
        daemon still running at the timeout is killed (and the status says so)."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def stop(self, sig=signal.SIGTERM, timeout=20.0):
        """Signals the daemon and returns its exit status (negative: killed by signal)."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)

    def log_text(self):
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop(signal.SIGKILL if exc[0] else signal.SIGTERM)


def report_json(test, cli, sock_path):
    """`steptrace --socket S report --json`, parsed."""
    result = check_run(test, [cli, "--socket", sock_path, "report", "--json"])
    report = json.loads(result.stdout)
    test.assertEqual(report.get("schema"), "steptrace.report/v1")
    return report


def process_steps(test, report, pid):
    """{step name: count} of process `pid` in a report."""
    rows = [p for p in report["processes"] if p["pid"] == pid]
    test.assertEqual(len(rows), 1, f"pid {pid} not once in report: {json.dumps(report)}")
    return {s["step"]: s["count"] for s in rows[0]["steps"]}
