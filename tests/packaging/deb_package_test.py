"""`cpack -G DEB` makes steptrace_<version>_amd64.deb with the files where the units and
Debian expect them (prefix /usr, config in /etc), shlibdeps-computed Depends, the
conffile and maintainer scripts, and the documentation Debian asks for (gzipped man
pages, bash completion, copyright in the machine-readable format, changelog.gz). The
package is inspected, never installed here."""
import glob
import gzip
import os
import re
import shutil
import subprocess
import tempfile
import unittest

from packaging_util import BUILD_DIR, SOURCE_DIR, VERSION, TempDirTestCase, check_run, run, tool

CPACK = os.environ["STEPTRACE_CPACK"]


# ---- Depends against what the packaged ELF files link -------------------------------------

# Where a soname is looked for when ldconfig does not list it (multiarch dirs included).
_LIB_DIRS = ("/lib", "/usr/lib", "/lib64", "/usr/lib64", "/lib32", "/usr/lib32")


def elf_identity(path):
    """(class, byte order, machine) of an ELF file, None for anything else; a binary can
    only load a library of the same identity (so a 32-bit libc.so.6 is not the one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4], head[5], int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")


def library_candidates(soname, ldconfig_cache):
    """Paths on this machine named `soname`: the ldconfig cache first, then the usual dirs."""
    paths = re.findall(rf"^\s*{re.escape(soname)} \(.*\) => (\S+)$", ldconfig_cache, re.M)
    for d in _LIB_DIRS:
        paths += sorted(glob.glob(os.path.join(d, soname)))
        paths += sorted(glob.glob(os.path.join(d, "*-linux-gnu*", soname)))
    return list(dict.fromkeys(p for p in paths if os.path.exists(p)))


def path_variants(path):
    """Spellings dpkg may have recorded a library under: with merged /usr, /lib/x and
    /usr/lib/x are one file but dpkg knows only the one the package shipped."""
    out = []
    for p in (path, os.path.realpath(path)):
        out += [p, p[len("/usr"):] if p.startswith("/usr/") else "/usr" + p]
    return list(dict.fromkeys(out))


def relation_names(field):
    """Package names a Depends-style field mentions (alternatives and arch qualifiers
    included: "a (>= 1), b | c:any" -> {a, b, c})."""
    names = set()
    for clause in field.split(","):
        for alternative in clause.split("|"):
            name = alternative.strip().split(" ")[0].split("(")[0].split(":")[0]
            if name:
                names.add(name)
    return names


def missing_dependencies(needs, depends, provides):
    """The part of `needs` ({package: reasons}) that `depends` names neither by the package
    nor by a virtual package it provides (`provides`: {package: names}). Debian's shlibs can
    point at a virtual name: libspdlog1.10 Provides libspdlog1.10-fmt9, the ABI it was
    built against, and that is what dpkg-shlibdeps writes into Depends."""
    present = relation_names(depends)
    return {pkg: reasons for pkg, reasons in needs.items()
            if not ({pkg} | provides.get(pkg, set())) & present}


def format_missing(missing, depends, provides):
    lines = []
    for pkg, reasons in sorted(missing.items()):
        also = sorted(provides.get(pkg, set()))
        name = pkg + (f" (or a virtual package it provides: {', '.join(also)})" if also else "")
        lines.append(f"  {name}: " + "; ".join(sorted(reasons)))
    return ("Depends lacks the packages that provide libraries the packaged ELF files link:\n"
            + "\n".join(lines) + f"\nDepends: {depends}")


class DebPackageTest(TempDirTestCase):
    _needs = None  # library_needs(), computed once per run

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
            "/usr/include/steptrace/version.h",
            "/usr/lib/systemd/system/steptraced.service",
            "/usr/lib/systemd/system/steptraced.socket",
            "/usr/lib/sysusers.d/steptrace.conf", "/usr/lib/tmpfiles.d/steptrace.conf",
            "/etc/steptrace/steptraced.json",
            "/usr/lib/python3/dist-packages/steptrace/__init__.py",
            "/usr/share/steptrace/systemd/metrics-listen.conf",
            "/usr/share/steptrace/prometheus/prometheus.yml",
            "/usr/share/steptrace/prometheus/steptrace.rules.yml",
            "/usr/share/steptrace/grafana/steptrace.json",
            "/usr/share/bash-completion/completions/steptrace",
            "/usr/share/bash-completion/completions/steptraced",
            "/usr/share/man/man1/steptrace.1.gz", "/usr/share/man/man8/steptraced.8.gz",
            "/usr/share/doc/steptrace/copyright", "/usr/share/doc/steptrace/changelog.gz",
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

    def listing(self):
        """{path: mode string} of the regular files in the package."""
        listing = check_run(self, [self.dpkg_deb, "-c", self.deb]).stdout
        return {line.split(maxsplit=5)[5].lstrip("."): line.split()[0]
                for line in listing.splitlines() if line.startswith("-")}

    def unpack(self):
        root = os.path.join(self.tmp, "root")
        if not os.path.isdir(root):
            check_run(self, [self.dpkg_deb, "-x", self.deb, root])
        return root

    def test_documentation_files_are_plain_files_readable_by_all(self):
        files = self.listing()
        for path in ("/usr/share/bash-completion/completions/steptrace",
                     "/usr/share/bash-completion/completions/steptraced",
                     "/usr/share/man/man1/steptrace.1.gz", "/usr/share/man/man8/steptraced.8.gz",
                     "/usr/share/doc/steptrace/copyright", "/usr/share/doc/steptrace/changelog.gz"):
            self.assertEqual(files.get(path), "-rw-r--r--", path)

    def assert_gzip_n(self, path):
        """Debian's gzip -9n: no file name and no time stamp in the header."""
        with open(path, "rb") as f:
            header = f.read(10)
        self.assertEqual(header[:3], b"\x1f\x8b\x08", path)
        self.assertEqual(header[3] & 0x08, 0, f"{path}: the gzip header names a file")
        self.assertEqual(header[4:8], b"\0\0\0\0", f"{path}: the gzip header has a time stamp")

    def test_man_pages_are_the_hand_written_ones_gzipped(self):
        root = self.unpack()
        for packaged, source in (("usr/share/man/man1/steptrace.1.gz", "steptrace.1"),
                                 ("usr/share/man/man8/steptraced.8.gz", "steptraced.8")):
            with self.subTest(packaged):
                path = os.path.join(root, packaged)
                self.assert_gzip_n(path)
                with gzip.open(path, "rt", encoding="utf-8") as f, \
                        open(os.path.join(SOURCE_DIR, "docs", "man", source), encoding="utf-8") as g:
                    self.assertEqual(f.read(), g.read())
        man = shutil.which("man")
        if man is not None:  # man-db formats the packaged page as installed
            result = run([man, "--warnings", "-l", os.path.join(root, "usr/share/man/man1/steptrace.1.gz")],
                         env={"MANPAGER": "cat", "MANWIDTH": "80", "LC_ALL": "C.UTF-8"})
            self.assertEqual(result.returncode, 0, result.stderr)
            self.assertIn("steptrace", result.stdout)
            self.assertIn("EXIT STATUS", result.stdout)

    def test_bash_completion_is_the_source_file(self):
        root = self.unpack()
        with open(os.path.join(SOURCE_DIR, "config", "completion", "steptrace.bash")) as f:
            source = f.read()
        for command in ("steptrace", "steptraced"):
            with open(os.path.join(root, "usr/share/bash-completion/completions", command)) as f:
                self.assertEqual(f.read(), source, command)

    def test_copyright_is_machine_readable_with_the_license(self):
        with open(os.path.join(self.unpack(), "usr/share/doc/steptrace/copyright")) as f:
            copyright_text = f.read()
        paragraphs = [p for p in copyright_text.split("\n\n") if p.strip()]
        header = dict(line.split(": ", 1) for line in paragraphs[0].splitlines())
        self.assertEqual(header["Format"],
                         "https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/")
        self.assertEqual(header["Upstream-Name"], "steptrace")
        files = paragraphs[1].splitlines()
        self.assertEqual(files[:3], ["Files: *", "Copyright: 2026 the steptrace authors",
                                     "License: Expat"])
        # The license text, one space in, an empty line as " .", is LICENSE's.
        body = "\n".join("" if line == " ." else line[1:] for line in files[3:])
        self.assertTrue(all(line.startswith(" ") for line in files[3:]), files)
        with open(os.path.join(SOURCE_DIR, "LICENSE")) as f:
            license_text = f.read()
        self.assertIn("Copyright (c) 2026 the steptrace authors\n", license_text)
        self.assertTrue(body.startswith("Permission is hereby granted"), body)
        self.assertTrue(license_text.rstrip().endswith(body), body)

    def test_changelog_has_one_entry_for_this_version(self):
        path = os.path.join(self.unpack(), "usr/share/doc/steptrace/changelog.gz")
        self.assert_gzip_n(path)
        with gzip.open(path, "rt") as f:
            text = f.read()
        plain = os.path.join(self.tmp, "changelog")
        with open(plain, "w") as f:
            f.write(text)
        self.assertEqual(len(re.findall(r"(?m)^steptrace \(", text)), 1, text)
        parse = tool("dpkg-parsechangelog", "dpkg-dev")
        fields = check_run(self, [parse, "-l", plain]).stdout
        self.assertIn("\nVersion: " + VERSION + "\n", fields)
        self.assertIn("Source: steptrace\n", fields)
        self.assertIn("\nMaintainer: " + self.field("Maintainer") + "\n", fields)
        self.assertRegex(fields, r"\nDate: \w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} \+0000\n")

    def test_control_fields(self):
        self.assertEqual(self.field("Package"), "steptrace")
        self.assertEqual(self.field("Version"), VERSION)
        self.assertRegex(self.field("Maintainer"), r".+ <[^@ ]+@[^@ ]+>")
        self.assertEqual(self.field("Section"), "devel")
        self.assertTrue(self.field("Description").startswith("Out-of-process trace collector"))

    def library_needs(self):
        """{Debian package: {"usr/bin/x: libfoo.so.1 (/usr/lib/.../libfoo.so.1)", ...}} for
        every NEEDED soname of every ELF file in the .deb, resolved to the installed package
        that provides it here; sonames the .deb ships itself are left out. Computed once."""
        cls = type(self)
        if cls._needs is not None:
            return cls._needs
        root = tempfile.mkdtemp(prefix="stdebx-")
        self.addCleanup(shutil.rmtree, root, ignore_errors=True)
        check_run(self, [self.dpkg_deb, "-x", self.deb, root])
        readelf = tool("readelf", "binutils")
        shipped, elves = set(), {}
        for dirpath, _, filenames in os.walk(root):
            for name in filenames:
                path = os.path.join(dirpath, name)
                shipped.add(name)
                if not os.path.islink(path) and elf_identity(path) is not None:
                    elves[os.path.relpath(path, root)] = path
        # Guards against a vacuous pass (nothing recognised as ELF, nothing parsed).
        self.assertTrue({"usr/bin/steptraced", "usr/bin/steptrace"} <= set(elves), sorted(elves))
        self.assertTrue(any(re.fullmatch(r"usr/lib/(.+/)?libsteptrace\.so\.\d+\.\d+\.\d+", f)
                            for f in elves), sorted(elves))

        ldconfig_cache = check_run(self, [tool("ldconfig", "libc-bin"), "-p"]).stdout
        wanted = {}  # library path on this machine -> reasons
        unresolved = []
        for rel, path in sorted(elves.items()):
            dynamic = check_run(self, [readelf, "-d", "-W", path]).stdout
            sonames = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
            self.assertTrue(sonames, f"{rel} has no NEEDED entries:\n{dynamic}")
            for soname in sonames:
                if soname in shipped:
                    continue
                same_kind = [c for c in library_candidates(soname, ldconfig_cache)
                             if elf_identity(c) == elf_identity(path)]
                if not same_kind:
                    unresolved.append(f"{rel}: {soname} (not found on this machine)")
                    continue
                wanted.setdefault(same_kind[0], set()).add(f"{rel}: {soname} ({same_kind[0]})")

        # One dpkg-query for all of them; it exits 1 when some spelling is unknown.
        variants = {lib: path_variants(lib) for lib in wanted}
        query = run([tool("dpkg-query", "dpkg"), "-S"] + sorted({v for vs in variants.values()
                                                                  for v in vs}))
        owners = {}  # path -> {package}
        for line in query.stdout.splitlines():
            if line.startswith("diversion by ") or ": " not in line:
                continue
            packages, path = line.split(": ", 1)
            owners.setdefault(path.strip(), set()).update(
                p.strip().split(":")[0] for p in packages.split(","))
        needs = {}
        for lib, reasons in wanted.items():
            packages = set().union(*(owners.get(v, set()) for v in variants[lib]))
            packages.discard("steptrace")  # an installed copy of this very package
            if not packages:
                unresolved += sorted(r + " not owned by any installed package" for r in reasons)
            for pkg in packages:
                needs.setdefault(pkg, set()).update(reasons)
        self.assertEqual(unresolved, [], "libraries the packaged ELF files link that no Debian "
                         "package provides here:\n  " + "\n  ".join(unresolved) +
                         f"\ndpkg-query -S stderr:\n{query.stderr}")
        self.assertIn("libc6", needs)
        provides = {}
        fields = check_run(self, [tool("dpkg-query", "dpkg"), "-W", "-f",
                                  "${Package}\t${Provides}\n"] + sorted(needs)).stdout
        for line in fields.splitlines():
            pkg, _, provided = line.partition("\t")
            provides.setdefault(pkg, set()).update(relation_names(provided))
        cls._needs = needs, provides
        return cls._needs

    def test_depends_names_the_package_of_every_linked_library(self):
        # dpkg-shlibdeps should have found each library the daemon, CLI and client
        # library link; check it against readelf + dpkg-query rather than a fixed list.
        depends = ", ".join(f for f in (self.field("Pre-Depends"), self.field("Depends")) if f)
        needs, provides = self.library_needs()
        missing = missing_dependencies(needs, depends, provides)
        if missing:
            self.fail(format_missing(missing, depends, provides))

    def test_depends_check_reports_a_removed_entry(self):
        # The check above can fail: with any one needed package taken out of the real
        # Depends, exactly that package is reported.
        depends = self.field("Depends")
        needs, provides = self.library_needs()
        for pkg in needs:
            names = {pkg} | provides.get(pkg, set())
            without = ", ".join(c for c in depends.split(",") if not names & relation_names(c))
            missing = missing_dependencies(needs, without, provides)
            self.assertEqual(set(missing), {pkg}, without)
            self.assertIn(f"  {pkg}", format_missing(missing, without, provides))

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
