"""steptraced adopts a listening socket passed the systemd way (LISTEN_FDS), as
steptraced.socket does: systemd-socket-activate holds the socket and starts the daemon,
without --socket, on the first connection."""
import ctypes
import json
import os
import time
import unittest

from packaging_util import Daemon, TempDirTestCase, command, process_steps, tool

STEPTRACED = os.environ["STEPTRACE_STEPTRACED"]
CLIENT_LIB = os.environ["STEPTRACE_CLIENT_LIB"]


class SocketActivationTest(TempDirTestCase):
    def start(self):
        sock = os.path.join(self.tmp, "activated.sock")
        daemon = Daemon([tool("systemd-socket-activate", "systemd"), "-l", sock, STEPTRACED],
                        os.path.join(self.tmp, "daemon.log"))
        self.addCleanup(daemon.stop)
        # It binds, then listens, then says so; connecting in between would be refused.
        deadline = time.monotonic() + 10
        while f"Listening on {sock}" not in daemon.log_text():
            self.assertLess(time.monotonic(), deadline, daemon.log_text())
            time.sleep(0.02)
        return daemon, sock

    def test_serves_commands_on_the_passed_socket(self):
        daemon, sock = self.start()
        # The first connection makes systemd-socket-activate exec steptraced with the
        # listening socket as fd 3; the connection waits in its backlog meanwhile.
        self.assertEqual((command(sock, "ping") or "").strip(), "pong", daemon.log_text())
        report = json.loads(command(sock, "report --json"))
        self.assertEqual(report["schema"], "steptrace.report/v1")
        self.assertEqual(report["processes"], [])
        self.assertIsNone(daemon.proc.poll())

    def test_collects_events_on_the_passed_socket(self):
        daemon, sock = self.start()
        self.assertEqual((command(sock, "ping") or "").strip(), "pong", daemon.log_text())
        # This process records through the real client library.
        lib = ctypes.CDLL(CLIENT_LIB)
        lib.steptrace_connect.argtypes = [ctypes.c_char_p]
        lib.steptrace_flush.argtypes = [ctypes.c_int]
        self.assertEqual(lib.steptrace_connect(sock.encode()), 0)
        for _ in range(5):
            lib.steptrace_start(1)  # STEPTRACE_BACKWARD
            lib.steptrace_end(1)
        self.assertEqual(lib.steptrace_flush(10000), 0)
        lib.steptrace_shutdown()
        report = json.loads(command(sock, "report --json"))
        self.assertEqual(process_steps(self, report, os.getpid()), {"Backward": 5})

    def test_sigterm_stops_the_activated_daemon_cleanly(self):
        daemon, sock = self.start()
        self.assertEqual((command(sock, "ping") or "").strip(), "pong", daemon.log_text())
        self.assertEqual(daemon.stop(), 0, daemon.log_text())


if __name__ == "__main__":
    unittest.main()
