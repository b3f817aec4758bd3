"""config/prometheus passes promtool (config, rules, rule unit tests), and a live
daemon's `metrics` output, over the socket and over HTTP, is valid exposition that
carries the series the recording rules and the Grafana dashboard read."""
import ctypes
import os
import re
import socket
import unittest
import urllib.request

from packaging_util import (SOURCE_DIR, Daemon, TempDirTestCase, check_run, command, run,
                            tool)

STEPTRACED = os.environ["STEPTRACE_STEPTRACED"]
CLI = os.environ["STEPTRACE_CLI"]
CLIENT_LIB = os.environ["STEPTRACE_CLIENT_LIB"]
PROM_DIR = os.path.join(SOURCE_DIR, "config/prometheus")

# Every input series of steptrace.rules.yml.
RULE_INPUTS = [
    "steptrace_step_duration_seconds_bucket", "steptrace_step_duration_seconds_sum",
    "steptrace_step_duration_seconds_count", "steptrace_process_step_seconds_total",
    "steptrace_process_open_spans",
    "steptrace_job_step_seconds_total", "steptrace_job_step_spans_total",
    "steptrace_job_processes", "steptrace_job_dropped_events_total",
    "steptrace_gpu_reserved_bytes", "steptrace_gpu_free_bytes", "steptrace_gpu_total_bytes",
    "steptrace_gpu_reservations", "steptrace_gpu_leaked_reservations",
    "steptrace_gpu_expired_reservations", "steptrace_ledger_operations_total",
    "steptrace_ledger_step_seconds_total", "steptrace_events_received_total",
    "steptrace_events_dropped_by_clients_total",
    "steptrace_events_dropped_by_clients_by_cause_total", "steptrace_snapshot_failing",
    "steptrace_waiting_step_info",
]
# Per-rank inputs of the steptrace.ranks rules (issue 27): a daemon exports them only for
# processes that sent a rank, which the live check's process does not.
RANK_RULE_INPUTS = ["steptrace_job_rank_step_seconds_total", "steptrace_job_rank_step_spans_total"]

# The daemon's series that config/grafana/steptrace.json reads directly rather than
# through a recording rule (grafana_test.py keeps this list equal to what its panels use).
DASHBOARD_INPUTS = [
    "steptrace_build_info", "steptrace_uptime_seconds", "process_resident_memory_bytes",
    "process_open_fds", "process_max_fds", "process_cpu_seconds_total",
]


def free_tcp_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PromtoolFilesTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.promtool = tool("promtool", "prometheus")

    def test_config_is_valid_without_warnings(self):
        result = check_run(self, [self.promtool, "check", "config",
                                  os.path.join(PROM_DIR, "prometheus.yml")])
        self.assertNotIn("WARNING", result.stdout + result.stderr)

    def test_rules_are_valid(self):
        result = check_run(self, [self.promtool, "check", "rules",
                                  os.path.join(PROM_DIR, "steptrace.rules.yml")])
        self.assertRegex(result.stdout, r"SUCCESS: \d+ rules found")

    def test_rules_sum_across_nodes(self):
        check_run(self, [self.promtool, "test", "rules", "steptrace.rules.test.yml"],
                  cwd=PROM_DIR)

    def test_rules_read_only_metrics_listed_here(self):
        # Keeps RULE_INPUTS (checked against a live daemon below) in step with the rules.
        with open(os.path.join(PROM_DIR, "steptrace.rules.yml")) as f:
            rules = "".join(line.split("#")[0] + "\n" for line in f)
        # Metric names, not the level:name:operation names the rules record.
        used = set(re.findall(r"(?<![\w:])steptrace_[a-z_]+(?![\w:])", rules))
        self.assertIn("steptrace_step_duration_seconds_bucket", used)
        self.assertEqual(used - set(RULE_INPUTS + RANK_RULE_INPUTS), set())


class LiveMetricsTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.promtool = tool("promtool", "prometheus")
        self.sock = os.path.join(self.tmp, "d.sock")
        self.port = free_tcp_port()
        self.daemon = Daemon([STEPTRACED, "--socket", self.sock,
                              "--metrics-listen", f"127.0.0.1:{self.port}"],
                             os.path.join(self.tmp, "daemon.log"))
        self.addCleanup(self.daemon.stop)
        self.assertTrue(self.daemon.wait_ready(self.sock), self.daemon.log_text())
        self.send_events()

    def send_events(self):
        """Spans, a VRAM sample and reservations from this process, via libsteptrace."""
        lib = ctypes.CDLL(CLIENT_LIB)
        lib.steptrace_connect.argtypes = [ctypes.c_char_p]
        lib.steptrace_start.argtypes = [ctypes.c_uint32]
        lib.steptrace_end.argtypes = [ctypes.c_uint32]
        lib.steptrace_ledger_reserve.argtypes = [ctypes.c_char_p, ctypes.c_uint64,
                                                 ctypes.c_uint64, ctypes.c_char_p]
        lib.steptrace_ledger_release.argtypes = [ctypes.c_char_p, ctypes.c_uint64]
        lib.steptrace_vram_sample.argtypes = [ctypes.c_char_p, ctypes.c_uint64, ctypes.c_uint64]
        lib.steptrace_flush.argtypes = [ctypes.c_int]
        self.assertEqual(lib.steptrace_connect(self.sock.encode()), 0)
        for step in (0, 1, 2, 7):  # Forward, Backward, Matmul, LedgerReserve
            for _ in range(20):
                lib.steptrace_start(step)
                lib.steptrace_end(step)
        lib.steptrace_vram_sample(b"GPU-metrics", 6 << 30, 8 << 30)
        # A reserve inside a LedgerReserve span: the span is attributed to the GPU
        # (steptrace_ledger_step_seconds_total).
        lib.steptrace_start(7)
        lib.steptrace_ledger_reserve(b"GPU-metrics", 1, 1 << 30, b"task \"quoted\"")
        lib.steptrace_end(7)
        lib.steptrace_ledger_reserve(b"GPU-metrics", 2, 1 << 29, b"other")
        lib.steptrace_ledger_release(b"GPU-metrics", 2)
        self.assertEqual(lib.steptrace_flush(10000), 0)
        lib.steptrace_shutdown()

    def check_exposition(self, text):
        result = run([self.promtool, "check", "metrics"], input=text)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr + text)
        self.assertEqual(result.stdout + result.stderr, "")
        names = {line.split("{")[0].split(" ")[0]
                 for line in text.splitlines() if line and not line.startswith("#")}
        self.assertEqual(set(RULE_INPUTS + DASHBOARD_INPUTS) - names, set())
        self.assertRegex(text, r'steptrace_step_duration_seconds_count\{step="Forward"\} 20\b')
        self.assertRegex(text, r'steptrace_gpu_reserved_bytes\{gpu="GPU-metrics"\} 1073741824\b')
        self.assertRegex(text, r'steptrace_gpu_total_bytes\{gpu="GPU-metrics"\} 8589934592\b')

    def test_cli_metrics_pass_promtool(self):
        text = check_run(self, [CLI, "--socket", self.sock, "metrics"]).stdout
        self.check_exposition(text)
        self.check_exposition(command(self.sock, "metrics"))

    def test_http_metrics_pass_promtool(self):
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with no_proxy.open(f"http://127.0.0.1:{self.port}/metrics", timeout=10) as r:
            self.assertEqual(r.status, 200)
            self.assertTrue(r.headers["Content-Type"].startswith("text/plain"))
            self.assertIn("version=0.0.4", r.headers["Content-Type"])
            text = r.read().decode()
        self.check_exposition(text)


if __name__ == "__main__":
    unittest.main()
