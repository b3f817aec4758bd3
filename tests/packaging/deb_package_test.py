"""`cpack -G DEB` makes steptrace_<version>_amd64.deb with the files where the units and
Debian expect them (prefix /usr, config in /etc), shlibdeps-computed Depends, the
conffile and maintainer scripts. The package is inspected, never installed here."""
import glob
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from packaging_util import BUILD_DIR, VERSION, TempDirTestCase, check_run, tool

CPACK = os.environ["STEPTRACE_CPACK"]


class DebPackageTest(TempDirTestCase):
    @classmethod
    def setUpClass(cls):
        # One package for all the checks below (cpack is the slow part).
        cls.pkgdir = tempfile.mkdtemp(prefix="stdeb-")
        cls.cpack = subprocess.run(
            [CPACK, "-G", "DEB", "--config", os.path.join(BUILD_DIR, "CPackConfig.cmake"),
             "-B", cls.pkgdir], capture_output=True, text=True, timeout=300)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.pkgdir, ignore_errors=True)

    def setUp(self):
        super().setUp()
        self.assertEqual(self.cpack.returncode, 0, self.cpack.stdout + self.cpack.stderr)
        self.dpkg_deb = tool("dpkg-deb", "dpkg")
        arch = check_run(self, [tool("dpkg", "dpkg"), "--print-architecture"]).stdout.strip()
        self.deb = os.path.join(self.pkgdir, f"steptrace_{VERSION}_{arch}.deb")
        self.assertTrue(os.path.isfile(self.deb), os.listdir(self.pkgdir))

    def field(self, name):
        return check_run(self, [self.dpkg_deb, "-f", self.deb, name]).stdout.strip()

    def test_files_are_at_debian_paths(self):
        listing = check_run(self, [self.dpkg_deb, "-c", self.deb]).stdout
        # "-rw-r--r-- root/root 123 2024-01-01 00:00 ./usr/bin/x [-> target]"
        files = {line.split(maxsplit=5)[5].split(" -> ")[0].lstrip(".")
                 for line in listing.splitlines() if not line.startswith("d")}
        expected = {
            "/usr/bin/steptraced", "/usr/bin/steptrace",
            "/usr/include/steptrace/steptrace.h", "/usr/include/steptrace/steptrace.hpp",
            "/usr/lib/systemd/system/steptraced.service",
            "/usr/lib/systemd/system/steptraced.socket",
            "/usr/lib/sysusers.d/steptrace.conf", "/usr/lib/tmpfiles.d/steptrace.conf",
            "/etc/steptrace/steptraced.json",
            "/usr/lib/python3/dist-packages/steptrace.py",
            "/usr/share/steptrace/systemd/metrics-listen.conf",
            "/usr/share/steptrace/prometheus/prometheus.yml",
            "/usr/share/steptrace/prometheus/steptrace.rules.yml",
        }
        self.assertEqual(expected - files, set())
        libdir = r"/usr/lib(/[a-z0-9_]+-linux-gnu)?"
        for pattern in (rf"{libdir}/libsteptrace\.so", rf"{libdir}/libsteptrace\.so\.\d+",
                        rf"{libdir}/libsteptrace\.a",
                        rf"{libdir}/cmake/steptrace/steptraceConfig\.cmake",
                        rf"{libdir}/cmake/steptrace/steptraceConfigVersion\.cmake",
                        rf"{libdir}/cmake/steptrace/steptraceTargets\.cmake",
                        rf"{libdir}/pkgconfig/steptrace\.pc"):
            self.assertTrue(any(re.fullmatch(pattern, f) for f in files), pattern)
        # Nothing outside /usr and /etc, and no internal header.
        self.assertEqual({f for f in files if not f.startswith(("/usr/", "/etc/"))}, set())
        self.assertEqual({f for f in files if f.endswith((".h", ".hpp"))
                          and not f.startswith("/usr/include/steptrace/")}, set())

    def test_control_fields(self):
        self.assertEqual(self.field("Package"), "steptrace")
        self.assertEqual(self.field("Version"), VERSION)
        self.assertRegex(self.field("Maintainer"), r".+ <[^@ ]+@[^@ ]+>")
        self.assertEqual(self.field("Section"), "devel")
        self.assertTrue(self.field("Description").startswith("Out-of-process trace collector"))
        depends = [d.strip().split(" ")[0] for d in self.field("Depends").split(",")]
        # dpkg-shlibdeps found the libraries the daemon and library link.
        for package in ("libc6", "libstdc++6", "libsystemd0"):
            self.assertIn(package, depends)

    def test_conffile_and_maintainer_scripts(self):
        control = os.path.join(self.tmp, "control")
        check_run(self, [self.dpkg_deb, "-e", self.deb, control])
        with open(os.path.join(control, "conffiles")) as f:
            self.assertEqual(f.read().split(), ["/etc/steptrace/steptraced.json"])
        with open(os.path.join(control, "triggers")) as f:
            self.assertEqual(f.read().split(), ["activate-noawait", "ldconfig"])
        with open(os.path.join(control, "shlibs")) as f:
            self.assertEqual(f.read().split(), ["libsteptrace", "0", "steptrace", "(>=", f"{VERSION})"])
        for script in ("postinst", "prerm", "postrm"):
            path = os.path.join(control, script)
            self.assertTrue(os.access(path, os.X_OK), script)
            check_run(self, ["sh", "-n", path])
        with open(os.path.join(control, "postinst")) as f:
            postinst = f.read()
        self.assertIn("systemd-sysusers steptrace.conf", postinst)
        self.assertIn("systemd-tmpfiles --create steptrace.conf", postinst)
        self.assertIn("deb-systemd-helper enable", postinst)
        # systemctl and deb-systemd-invoke run only when systemd is the running init, so
        # installing in a container or chroot starts nothing.
        for script in ("postinst", "prerm", "postrm"):
            conditions, calls = [], 0
            with open(os.path.join(control, script)) as f:
                for line in f:
                    line = line.strip()
                    if line.startswith("if "):
                        conditions.append(line)
                    elif line.startswith("elif "):
                        conditions[-1] = line
                    elif line == "fi":
                        conditions.pop()
                    if re.match(r"(systemctl|deb-systemd-invoke) ", line):
                        calls += 1
                        self.assertTrue(any("-d /run/systemd/system" in c for c in conditions),
                                        f"{script}: {line}")
            self.assertGreater(calls, 0, script)

    def test_unpacked_units_point_at_packaged_paths(self):
        root = os.path.join(self.tmp, "root")
        check_run(self, [self.dpkg_deb, "-x", self.deb, root])
        with open(os.path.join(root, "usr/lib/systemd/system/steptraced.service")) as f:
            service = f.read()
        self.assertIn("\nExecStart=/usr/bin/steptraced --config /etc/steptrace/steptraced.json "
                      "--state-dir /var/lib/steptrace\n", service)
        pcs = glob.glob(os.path.join(root, "usr/lib/**/pkgconfig/steptrace.pc"), recursive=True)
        self.assertEqual(len(pcs), 1)
        with open(pcs[0]) as f:
            pc = f.read()
        self.assertIn("prefix=/usr\n", pc)
        self.assertIn("libdir=${prefix}/lib", pc)


if __name__ == "__main__":
    unittest.main()
