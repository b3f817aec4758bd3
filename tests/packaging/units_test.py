"""The systemd units, sysusers.d and tmpfiles.d entries as `cmake --install` writes them:
valid for systemd-analyze, pointing at the installed daemon and config, hardened without
hiding other users' processes, no directive given twice."""
import os
import re
import shutil
import stat
import unittest

from packaging_util import TempDirTestCase, check_run, run, tool


def directives(path):
    """[(section, key, value)] of a unit file, comments and blank lines skipped."""
    out, section = [], None
    with open(path) as f:
        for raw in f:
            line = raw.strip()
            if not line or line[0] in "#;":
                continue
            if line.startswith("["):
                section = line.strip("[]")
                continue
            key, _, value = line.partition("=")
            out.append((section, key.strip(), value.strip()))
    return out


class UnitsTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.analyze = tool("systemd-analyze", "systemd")
        self.prefix = self.install_prefix()
        self.unitdir = os.path.join(self.prefix, "lib/systemd/system")
        self.service = os.path.join(self.unitdir, "steptraced.service")
        self.socket = os.path.join(self.unitdir, "steptraced.socket")

    def verify(self, *units):
        result = run([self.analyze, "verify", *units])
        # verify exits 0 on unknown keys and bad values but prints them: both count.
        self.assertEqual((result.returncode, result.stdout + result.stderr), (0, ""))

    def test_installed_units_verify_and_run_the_installed_daemon(self):
        self.verify(self.socket, self.service)
        exec_start = [v for s, k, v in directives(self.service) if k == "ExecStart"]
        self.assertEqual(exec_start, [
            f"{self.prefix}/bin/steptraced --config {self.prefix}/etc/steptrace/steptraced.json"
            " --state-dir /var/lib/steptrace"])
        self.assertTrue(os.access(f"{self.prefix}/bin/steptraced", os.X_OK))
        self.assertTrue(os.path.isfile(f"{self.prefix}/etc/steptrace/steptraced.json"))

    def test_a_bad_unit_fails_verification(self):
        # The check above can fail: a unit whose daemon is missing does not verify.
        broken = os.path.join(self.tmp, "steptraced.service")
        with open(self.service) as f, open(broken, "w") as out:
            out.write(f.read().replace(f"{self.prefix}/bin/steptraced", "/nonexistent/steptraced"))
        shutil.copy(self.socket, self.tmp)
        result = run([self.analyze, "verify", os.path.join(self.tmp, "steptraced.socket"), broken])
        self.assertNotEqual(result.returncode, 0)

    def test_socket_unit_matches_the_default_socket(self):
        d = {k: v for s, k, v in directives(self.socket) if s == "Socket"}
        self.assertEqual(d["ListenStream"], "/run/steptrace/steptraced.sock")
        self.assertEqual((d["SocketUser"], d["SocketGroup"], d["SocketMode"]),
                         ("steptrace", "steptrace", "0660"))
        self.assertEqual((d["Accept"], d["RemoveOnStop"]), ("no", "yes"))

    def test_service_is_notify_hardened_and_keeps_proc_visible(self):
        d = {k: v for s, k, v in directives(self.service) if s == "Service"}
        self.assertEqual(d["Type"], "notify")
        self.assertEqual((d["User"], d["Group"]), ("steptrace", "steptrace"))
        self.assertEqual((d["RuntimeDirectory"], d["StateDirectory"]), ("steptrace", "steptrace"))
        for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                           ("ProtectHome", "read-only"), ("PrivateTmp", "yes"),
                           ("DevicePolicy", "closed"), ("ProtectKernelTunables", "yes"),
                           ("ProtectKernelModules", "yes"), ("ProtectKernelLogs", "yes"),
                           ("ProtectControlGroups", "yes"), ("RestrictAddressFamilies", "AF_UNIX"),
                           ("SystemCallFilter", "@system-service"),
                           ("SystemCallArchitectures", "native"), ("LockPersonality", "yes"),
                           ("MemoryDenyWriteExecute", "yes"), ("RestrictRealtime", "yes"),
                           ("RestrictNamespaces", "yes")]:
            self.assertEqual(d.get(key), value, key)
        # NVML's devices only (PrivateDevices=yes would hide them).
        allowed = [v for s, k, v in directives(self.service) if s == "Service" and k == "DeviceAllow"]
        self.assertEqual(allowed, ["char-nvidiactl rw", "char-nvidia-frontend rw"])
        # These would hide other users' /proc/PID or their uids from the daemon.
        self.assertNotIn("ProtectProc", d)
        self.assertNotIn("ProcSubset", d)
        self.assertNotIn("PrivateUsers", d)
        # The daemon gets its socket from systemd, never a path of its own.
        self.assertNotIn("--socket", d["ExecStart"])

    def test_no_directive_is_repeated(self):
        for unit in (self.service, self.socket):
            seen = set()
            for section, key, _ in directives(unit):
                if key == "DeviceAllow":  # one device per line
                    continue
                self.assertNotIn((section, key), seen, f"{unit}: {key}= twice in [{section}]")
                seen.add((section, key))

    def test_exposure_is_low(self):
        # systemd's scale: 0 fully locked down .. 10 unprotected ("OK" below 2); the
        # threshold is given in tenths.
        result = run([self.analyze, "security", "--offline=yes", "--threshold=15",
                      "--no-pager", self.service])
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertRegex(result.stdout, r"Overall exposure level for steptraced.service: [01]\.\d")

    def test_metrics_drop_in_verifies_and_opens_the_network(self):
        dropin = os.path.join(self.prefix, "share/steptrace/systemd/metrics-listen.conf")
        unitdir = os.path.join(self.tmp, "units")
        os.makedirs(os.path.join(unitdir, "steptraced.service.d"))
        shutil.copy(self.service, unitdir)
        shutil.copy(self.socket, unitdir)
        shutil.copy(dropin, os.path.join(unitdir, "steptraced.service.d"))
        self.verify(os.path.join(unitdir, "steptraced.socket"),
                    os.path.join(unitdir, "steptraced.service"))
        d = dict(((k, v) for s, k, v in directives(dropin) if k != "ExecStart"))
        self.assertEqual(d, {"PrivateNetwork": "no",
                             "RestrictAddressFamilies": "AF_INET AF_INET6"})
        exec_start = [v for s, k, v in directives(dropin) if k == "ExecStart"]
        self.assertEqual(exec_start[0], "")
        self.assertIn(f"{self.prefix}/bin/steptraced ", exec_start[1])
        self.assertIn("--metrics-listen 127.0.0.1:9464", exec_start[1])  # loopback as shipped

    def test_sysusers_and_tmpfiles_create_user_and_state_dir(self):
        root = os.path.join(self.tmp, "root")
        os.makedirs(os.path.join(root, "etc"))
        check_run(self, [tool("systemd-sysusers", "systemd"), f"--root={root}",
                         os.path.join(self.prefix, "lib/sysusers.d/steptrace.conf")])
        with open(os.path.join(root, "etc/passwd")) as f:
            user = [line.split(":") for line in f if line.startswith("steptrace:")]
        with open(os.path.join(root, "etc/group")) as f:
            group = [line.split(":") for line in f if line.startswith("steptrace:")]
        self.assertEqual(len(user), 1)
        self.assertEqual(len(group), 1)
        uid, gid = int(user[0][2]), int(user[0][3])
        self.assertEqual(gid, int(group[0][2]))
        self.assertLess(uid, 1000, "a system user")

        result = run([tool("systemd-tmpfiles", "systemd"), f"--root={root}", "--create",
                      os.path.join(self.prefix, "lib/tmpfiles.d/steptrace.conf")])
        state = os.path.join(root, "var/lib/steptrace")
        st = os.stat(state)
        self.assertEqual(stat.S_IMODE(st.st_mode), 0o750)
        if os.geteuid() == 0:
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertEqual((st.st_uid, st.st_gid), (uid, gid))
        else:
            # Only root may give the directory to steptrace; everything else must work.
            self.assertEqual(re.findall(r"^.*failed.*$", result.stderr, re.M),
                             [f"fchownat() of {state} failed: Operation not permitted"])


if __name__ == "__main__":
    unittest.main()
