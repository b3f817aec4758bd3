#!/usr/bin/env python3
"""bindings/python as an installed package, and how each copy finds libsteptrace.

- pip: `pip install --no-build-isolation --no-deps --target DIR bindings/python` (offline)
  and `import steptrace` from DIR with STEPTRACE_LIBRARY unset: the library is found by
  the system's search, here through LD_LIBRARY_PATH=<build>/client (as a library installed
  outside the ld.so cache would be); spans reach the real daemon.
- CMake: `cmake --install <build> --component python --prefix P` (the rules the .deb
  uses) with the build's library copied where the install puts it (P/<libdir>, as the
  full install would), found through the install's _install_paths.py, also once P moved.
- The build's wheel (STEPTRACE_PYTHON_WHEEL: py3-none-<platform>, carrying
  libsteptrace.so.0) into a plain venv (`python -m venv`, then setuptools and wheel taken
  out: what a venv of Python >= 3.12 has) with `pip install --no-index FILE.whl`: found in
  the wheel, with no environment variable; its RECORD holds every file's hash. Then
  `pip install --no-index --no-build-isolation bindings/python` in the same venv (the
  in-tree build backend needs only the standard library) and `pip install -e`. With the
  configured python and with /usr/bin/python3 (Debian's) when it is another one.
- A source checkout with neither STEPTRACE_LIBRARY nor LD_LIBRARY_PATH: the build tree.
- Nothing found, or STEPTRACE_LIBRARY naming a missing file: ImportError listing the
  places tried.

Every import runs in a child python with a controlled environment. Run by ctest with
STEPTRACE_LIBRARY (the build's library; the children do not inherit it), STEPTRACED_BIN,
STEPTRACE_SOURCE_DIR, STEPTRACE_VERSION, and for the CMake case STEPTRACE_BUILD_DIR,
STEPTRACE_CMAKE and STEPTRACE_INSTALL_LIBDIR."""

import base64
import csv
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from python_testutil import Daemon

SOURCE_DIR = os.environ["STEPTRACE_SOURCE_DIR"]
BINDINGS = os.path.join(SOURCE_DIR, "bindings", "python")
LIBRARY = os.path.realpath(os.environ["STEPTRACE_LIBRARY"])
VERSION = os.environ["STEPTRACE_VERSION"]
SONAME = "libsteptrace.so.0"
WHEEL = os.environ.get("STEPTRACE_PYTHON_WHEEL")

# What the child prints: where the package and the library came from.
PROBE = """
import json, os, sys, steptrace
rc = steptrace.connect(sys.argv[1]) if len(sys.argv) > 1 else None
if rc == 0:
    for _ in range(3):
        with steptrace.span("PyPackage"):
            pass
    rc = steptrace.flush(10000)
print(json.dumps({"file": steptrace.__file__, "library": steptrace.library_path,
                  "found_by": steptrace._found_by, "version": steptrace.__version__,
                  "rc": rc, "pid": os.getpid()}))
"""


def child_env(**extra):
    """The environment without anything that points at a library or a package."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("STEPTRACE_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # no __pycache__ in the source tree
    env.update(extra)
    return env


def probe(env, *args, cwd=None):
    """(returncode, parsed output or None, stderr) of PROBE run in a child python."""
    r = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, cwd=cwd,
                       capture_output=True, text=True, timeout=60)
    out = json.loads(r.stdout) if r.returncode == 0 else None
    return r.returncode, out, r.stderr


def system_has_library():
    """Whether dlopen("libsteptrace.so.0") works here without help (an installed .deb)."""
    r = subprocess.run([sys.executable, "-c", f"import ctypes; ctypes.CDLL('{SONAME}')"],
                       env=child_env(), capture_output=True, timeout=60)
    return r.returncode == 0


def pip_python():
    """A python with pip, which is all this package's build backend needs: the one running
    the test first, then Debian's (python3-pip); None when neither has it."""
    check = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pip') is None)"
    for python in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(python) and subprocess.run(
                [python, "-c", check], capture_output=True, timeout=60).returncode == 0:
            return python
    return None


class PackageTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="steptrace-pypkg-")
        cls.system_library = system_has_library()

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    _pip_target = None  # one pip install for the tests that use it

    def pip_install(self):
        """The package installed by pip into a fresh directory (once); that directory."""
        if PackageTest._pip_target is not None:
            return PackageTest._pip_target
        python = pip_python()
        if python is None:
            self.skipTest("no python here has pip (Debian: python3-pip)")
        work = tempfile.mkdtemp(dir=self.tmp)
        # A copy: building writes build/ and steptrace.egg-info/ next to pyproject.toml.
        src = os.path.join(work, "src")
        shutil.copytree(BINDINGS, src, ignore=shutil.ignore_patterns(
            "__pycache__", "build", "*.egg-info", "_install_paths.py"))
        target = os.path.join(work, "site")
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PYTHONPATH")}
        r = subprocess.run([python, "-m", "pip", "install", "--no-index", "--no-build-isolation",
                            "--no-deps", "--no-cache-dir", "--disable-pip-version-check",
                            "--target", target, src],
                           env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, f"{python} -m pip install:\n{r.stdout}{r.stderr}")
        PackageTest._pip_target = target
        return target

    def test_pip_install_finds_library_by_system_search(self):
        target = self.pip_install()
        self.assertEqual(sorted(f for f in os.listdir(os.path.join(target, "steptrace"))
                                if f.endswith(".py")),
                         ["__init__.py", "_loader.py", "_version.py", "torch.py"])
        self.assertTrue(os.path.isdir(os.path.join(target, f"steptrace-{VERSION}.dist-info")),
                        os.listdir(target))
        daemon = Daemon()
        self.addCleanup(daemon.close)
        rc, out, err = probe(child_env(PYTHONPATH=target,
                                       LD_LIBRARY_PATH=os.path.dirname(LIBRARY)),
                             daemon.socket, cwd=self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.path.dirname(out["file"]), os.path.join(target, "steptrace"))
        self.assertEqual(out["found_by"], "system search")
        self.assertEqual(out["library"], LIBRARY)
        self.assertEqual(out["version"], VERSION)
        self.assertEqual(out["rc"], 0)
        steps = daemon.steps(out["pid"])
        self.assertEqual(steps["PyPackage"]["count"], 3, steps)

    def test_pip_install_without_library(self):
        if self.system_library:
            self.skipTest(f"{SONAME} is installed on this machine")
        target = self.pip_install()
        rc, _, err = probe(child_env(PYTHONPATH=target), cwd=self.tmp)
        self.assertNotEqual(rc, 0)
        self.assertIn("ImportError: steptrace: cannot load libsteptrace; tried, in order:", err)
        self.assertIn(f"system search: {SONAME}:", err)
        self.assertIn("STEPTRACE_LIBRARY", err)
        self.assertNotIn("source tree", err)  # a pip copy is not in a checkout

    def test_explicit_library_is_the_only_one_tried(self):
        missing = os.path.join(self.tmp, "no-such-libsteptrace.so")
        rc, _, err = probe(child_env(PYTHONPATH=BINDINGS, STEPTRACE_LIBRARY=missing,
                                     LD_LIBRARY_PATH=os.path.dirname(LIBRARY)), cwd=self.tmp)
        self.assertNotEqual(rc, 0)
        self.assertIn(f"$STEPTRACE_LIBRARY: {missing}:", err)
        self.assertNotIn("system search", err)

    def test_source_tree_falls_back_to_the_build_tree(self):
        rc, out, err = probe(child_env(PYTHONPATH=BINDINGS), cwd=self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertEqual(os.path.dirname(out["file"]), os.path.join(BINDINGS, "steptrace"))
        if self.system_library:
            self.assertEqual(out["found_by"], "system search")
        else:
            self.assertEqual(out["found_by"], "source tree")
            lib_dir = os.path.dirname(out["library"])
            self.assertEqual(os.path.basename(lib_dir), "client")
            self.assertEqual(os.path.dirname(os.path.dirname(lib_dir)),
                             os.path.realpath(SOURCE_DIR))
            self.assertTrue(os.path.basename(os.path.dirname(lib_dir)).startswith("build"))

    def test_cmake_install_finds_the_installed_library(self):
        names = ("STEPTRACE_BUILD_DIR", "STEPTRACE_CMAKE", "STEPTRACE_INSTALL_LIBDIR")
        if not all(os.environ.get(n) for n in names):
            self.skipTest("STEPTRACE_INSTALL is OFF: no install rules")
        build, cmake, libdir = (os.environ[n] for n in names)
        if os.path.isabs(libdir):
            self.skipTest(f"CMAKE_INSTALL_LIBDIR {libdir} is outside the prefix")
        prefix = os.path.join(tempfile.mkdtemp(dir=self.tmp), "prefix")
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        r = subprocess.run([cmake, "--install", build, "--component", "python",
                            "--prefix", prefix], env=env, capture_output=True, text=True,
                           timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        installed = [os.path.relpath(os.path.join(d, f), prefix)
                     for d, _, files in os.walk(prefix) for f in files]
        packages = {os.path.dirname(f) for f in installed}
        self.assertEqual(len(packages), 1, installed)  # one directory, nothing else
        package = os.path.join(prefix, packages.pop())
        self.assertEqual(os.path.basename(package), "steptrace")
        self.assertEqual(sorted(os.listdir(package)),
                         ["__init__.py", "_install_paths.py", "_loader.py", "_version.py",
                          "torch.py"])
        # What the full install does for the library (not done here: the python component
        # alone is installed, so this test does not depend on the other install rules).
        os.makedirs(os.path.join(prefix, libdir), exist_ok=True)
        shutil.copy(LIBRARY, os.path.join(prefix, libdir, SONAME))

        rc, out, err = probe(child_env(PYTHONPATH=os.path.dirname(package)), cwd=self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out["found_by"], "installed prefix")
        self.assertEqual(out["library"], os.path.realpath(os.path.join(prefix, libdir, SONAME)))

        # The prefix moved elsewhere: the path relative to the package still holds.
        moved = prefix + "-moved"
        os.rename(prefix, moved)
        moved_package = os.path.join(moved, os.path.relpath(package, prefix))
        rc, out, err = probe(child_env(PYTHONPATH=os.path.dirname(moved_package)), cwd=self.tmp)
        self.assertEqual(rc, 0, err)
        self.assertEqual(out["found_by"], "installed prefix")
        self.assertEqual(out["library"], os.path.realpath(os.path.join(moved, libdir, SONAME)))


def pythons():
    """The pythons to make venvs of: the configured one, and Debian's when it differs."""
    found = []
    for python in (sys.executable, "/usr/bin/python3"):
        if os.path.exists(python) and os.path.realpath(python) not in map(
                os.path.realpath, found):
            found.append(python)
    return found


def pip_env():
    """pip's environment: no index, no user configuration, no ASan preload."""
    env = child_env(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1",
                    PIP_NO_INDEX="1", PIP_NO_CACHE_DIR="1")
    env.pop("LD_PRELOAD", None)
    return env


class VenvTest(unittest.TestCase):
    """pip into plain venvs, offline; the package imported from the venv with nothing
    in the environment pointing at it or at the library."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="steptrace-pyvenv-")
        cls.daemon = Daemon()

    @classmethod
    def tearDownClass(cls):
        cls.daemon.close()
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def run_ok(self, *args, cwd=None):
        r = subprocess.run(args, env=pip_env(), cwd=cwd or self.tmp, capture_output=True,
                           text=True, timeout=240)
        self.assertEqual(r.returncode, 0, f"{' '.join(args)}:\n{r.stdout}{r.stderr}")
        return r.stdout

    def plain_venv(self, python):
        """A new venv of `python` with pip only (setuptools and wheel taken out)."""
        venv = tempfile.mkdtemp(dir=self.tmp)
        r = subprocess.run([python, "-m", "venv", venv], env=pip_env(), capture_output=True,
                           text=True, timeout=240)
        if r.returncode != 0:
            self.skipTest(f"{python} -m venv: {r.stderr.strip()} (Debian: python3-venv)")
        vpython = os.path.join(venv, "bin", "python")
        installed = json.loads(self.run_ok(vpython, "-m", "pip", "list", "--format=json"))
        extra = [p["name"] for p in installed if p["name"].lower() in ("setuptools", "wheel")]
        if extra:
            self.run_ok(vpython, "-m", "pip", "uninstall", "-y", *extra)
        names = {p["name"].lower() for p in json.loads(
            self.run_ok(vpython, "-m", "pip", "list", "--format=json"))}
        self.assertEqual(names, {"pip"})
        return vpython

    def probe_in(self, vpython):
        r = subprocess.run([vpython, "-c", PROBE, self.daemon.socket], env=child_env(),
                           cwd=self.tmp, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        self.assertEqual(out["version"], VERSION)
        self.assertEqual(out["rc"], 0)
        self.assertEqual(self.daemon.steps(out["pid"])["PyPackage"]["count"], 3)
        return out

    def check_record(self, wheel, bundled=True):
        """Every file of the wheel is in its RECORD with its sha256 and size (PEP 427)."""
        import zipfile

        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            record = [n for n in names if n.endswith(".dist-info/RECORD")]
            self.assertEqual(len(record), 1, names)
            rows = {row[0]: row[1:] for row in csv.reader(
                io.StringIO(z.read(record[0]).decode()))}
            self.assertEqual(sorted(rows), sorted(names))
            for name in names:
                if name == record[0]:
                    self.assertEqual(rows[name], ["", ""])
                    continue
                data = z.read(name)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
                self.assertEqual(rows[name], ["sha256=" + digest.decode(), str(len(data))])
            self.assertEqual(f"steptrace/{SONAME}" in names, bundled)

    def test_metadata_is_pyprojects(self):
        # The backend writes METADATA itself: it must say what pyproject.toml's [project]
        # says (tomllib: Python >= 3.11).
        try:
            import tomllib
        except ImportError:
            self.skipTest("no tomllib (Python < 3.11)")
        import zipfile

        with open(os.path.join(BINDINGS, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f)["project"]
        out = tempfile.mkdtemp(dir=self.tmp)
        wheel = self.run_ok(sys.executable, "-B", os.path.join(
            BINDINGS, "build_backend", "steptrace_build.py"), "--outdir", out).strip()
        self.assertEqual(os.path.basename(wheel), f"steptrace-{VERSION}-py3-none-any.whl")
        self.check_record(wheel, bundled=False)
        with zipfile.ZipFile(wheel) as z:
            meta = z.read(f"steptrace-{VERSION}.dist-info/METADATA").decode()
        headers = meta.split("\n\n", 1)[0].splitlines()
        self.assertIn(f"Name: {project['name']}", headers)
        self.assertIn(f"Summary: {project['description']}", headers)
        self.assertIn(f"Requires-Python: {project['requires-python']}", headers)
        for classifier in project["classifiers"]:
            self.assertIn(f"Classifier: {classifier}", headers)
        self.assertEqual(project["dependencies"], [])
        self.assertEqual(project["dynamic"], ["version"])

    def test_wheel_and_source_in_plain_venvs(self):
        if not WHEEL:
            self.skipTest("no STEPTRACE_PYTHON_WHEEL (no python3 at configure time)")
        self.assertTrue(os.path.basename(WHEEL).startswith(f"steptrace-{VERSION}-py3-none-"))
        self.check_record(WHEEL)
        for python in pythons():
            with self.subTest(python=python):
                vpython = self.plain_venv(python)
                site = self.run_ok(vpython, "-c", "import sysconfig; "
                                   "print(sysconfig.get_paths()['platlib'])").strip()

                # The wheel: the library it carries, nothing else needed.
                self.run_ok(vpython, "-m", "pip", "install", WHEEL)
                out = self.probe_in(vpython)
                self.assertEqual(out["found_by"], "wheel")
                self.assertEqual(out["library"],
                                 os.path.realpath(os.path.join(site, "steptrace", SONAME)))
                self.run_ok(vpython, "-m", "pip", "uninstall", "-y", "steptrace")
                self.assertFalse(os.path.exists(os.path.join(site, "steptrace")))

                # The source tree, no build isolation, nothing but the standard library to
                # build it: a pure wheel; the library from the system's search here.
                src = os.path.join(tempfile.mkdtemp(dir=self.tmp), "src")
                shutil.copytree(BINDINGS, src, ignore=shutil.ignore_patterns(
                    "__pycache__", "_install_paths.py"))
                self.run_ok(vpython, "-m", "pip", "install", "--no-build-isolation", src)
                self.assertFalse(os.path.exists(os.path.join(site, "steptrace", SONAME)))
                self.assertEqual(sorted(os.listdir(src)), sorted(os.listdir(BINDINGS)))
                r = subprocess.run([vpython, "-c", PROBE, self.daemon.socket],
                                   env=child_env(LD_LIBRARY_PATH=os.path.dirname(LIBRARY)),
                                   cwd=self.tmp, capture_output=True, text=True, timeout=60)
                self.assertEqual(r.returncode, 0, r.stderr)
                self.assertEqual(json.loads(r.stdout)["found_by"], "system search")
                self.run_ok(vpython, "-m", "pip", "uninstall", "-y", "steptrace")

                # Editable (PEP 660), with build isolation (no requirement to fetch): the
                # checkout itself, its build tree's library.
                self.run_ok(vpython, "-m", "pip", "install", "-e", BINDINGS)
                out = self.probe_in(vpython)
                self.assertEqual(os.path.dirname(out["file"]),
                                 os.path.join(BINDINGS, "steptrace"))
                self.run_ok(vpython, "-m", "pip", "uninstall", "-y", "steptrace")


if __name__ == "__main__":
    unittest.main(verbosity=2)
