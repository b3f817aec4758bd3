"""Type=notify: steptraced tells the service manager READY=1 once it serves its socket,
and STOPPING=1 on SIGTERM. A datagram socket stands in for systemd's NOTIFY_SOCKET."""
import os
import socket
import unittest

from packaging_util import Daemon, TempDirTestCase, command

STEPTRACED = os.environ["STEPTRACE_STEPTRACED"]


class ReadinessTest(TempDirTestCase):
    def test_ready_after_serving_and_stopping_on_sigterm(self):
        notify_path = os.path.join(self.tmp, "notify")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(listener.close)
        listener.bind(notify_path)
        listener.settimeout(10)

        sock = os.path.join(self.tmp, "d.sock")
        daemon = Daemon([STEPTRACED, "--socket", sock], os.path.join(self.tmp, "daemon.log"),
                        env={"NOTIFY_SOCKET": notify_path})
        self.addCleanup(daemon.stop)

        messages = []
        while not any(line == "READY=1" for m in messages for line in m.splitlines()):
            try:
                messages.append(listener.recv(4096).decode())
            except socket.timeout:
                self.fail(f"no READY=1 within 10 s; got {messages}\n{daemon.log_text()}")
        # Ready means serving: the socket answers at once, without any retry.
        self.assertEqual((command(sock, "ping") or "").strip(), "pong")

        daemon.proc.terminate()
        stopping = []
        while not any(line == "STOPPING=1" for m in stopping for line in m.splitlines()):
            try:
                stopping.append(listener.recv(4096).decode())
            except socket.timeout:
                self.fail(f"no STOPPING=1 within 10 s; got {stopping}\n{daemon.log_text()}")
        # One SIGTERM is enough: the daemon drains and exits 0 by itself.
        self.assertEqual(daemon.wait_exit(), 0, daemon.log_text())


if __name__ == "__main__":
    unittest.main()
