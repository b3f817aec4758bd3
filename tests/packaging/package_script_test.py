"""scripts/package.sh, as a user runs it: the .deb and the build's Python wheel side by
side in the package directory, their paths on stdout (the .deb first), and the wheel
installing offline into a plain venv (pip only: no setuptools, no wheel package, no
index) where `import steptrace` finds the library the wheel carries with no environment
variable. The build is complete already (PACKAGE_BUILD=0: the script does not build);
the package directory is a temporary one (PACKAGE_DIR). The venv part follows
bindings/python/tests/python_package_test.py's VenvTest.plain_venv()."""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

from packaging_util import BUILD_DIR, SOURCE_DIR, VERSION, TempDirTestCase, check_run, run

CPACK = os.environ["STEPTRACE_CPACK"]
PIP_ENV = {"PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
           "PIP_NO_INDEX": "1", "PIP_NO_CACHE_DIR": "1"}


def clean_env():
    """The environment without anything pointing at a library or a package."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("STEPTRACE_LIBRARY", "LD_LIBRARY_PATH", "PYTHONPATH", "LD_PRELOAD")}
    env.update(PIP_ENV)
    return env


class PackageScriptTest(TempDirTestCase):

    @classmethod
    def setUpClass(cls):
        cls.pkgdir = tempfile.mkdtemp(prefix="stpkg-")
        cls.result = run([os.path.join(SOURCE_DIR, "scripts", "package.sh"), BUILD_DIR],
                         env={"PACKAGE_BUILD": "0", "PACKAGE_DIR": cls.pkgdir, "CPACK": CPACK},
                         timeout=300)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.pkgdir, ignore_errors=True)
        super().tearDownClass()

    def setUp(self):
        super().setUp()
        self.assertEqual(self.result.returncode, 0, self.result.stdout + self.result.stderr)
        self.lines = self.result.stdout.splitlines()
        self.built = glob.glob(os.path.join(BUILD_DIR, "python", f"steptrace-{VERSION}-*.whl"))
        if not self.built:
            self.skipTest(f"no wheel in {BUILD_DIR}/python (configured without python3)")

    def test_deb_and_wheel_side_by_side(self):
        self.assertEqual(len(self.lines), 2, self.result.stdout)
        deb, wheel = self.lines
        self.assertTrue(deb.endswith(".deb") and os.path.isfile(deb), deb)
        self.assertEqual(os.path.dirname(deb), os.path.realpath(self.pkgdir))
        self.assertEqual(os.path.dirname(wheel), os.path.dirname(deb))
        self.assertEqual(os.path.basename(wheel), os.path.basename(self.built[0]))
        self.assertRegex(os.path.basename(wheel), rf"^steptrace-{VERSION}-py3-none-\w+\.whl$")
        with open(wheel, "rb") as a, open(self.built[0], "rb") as b:
            self.assertEqual(a.read(), b.read())

    def test_wheel_installs_offline_into_a_plain_venv(self):
        wheel = self.lines[-1]
        venv = os.path.join(self.tmp, "venv")
        r = subprocess.run([sys.executable, "-m", "venv", venv], env=clean_env(),
                           capture_output=True, text=True, timeout=240)
        if r.returncode != 0:
            self.skipTest(f"{sys.executable} -m venv: {r.stderr.strip()} (Debian: python3-venv)")
        vpython = os.path.join(venv, "bin", "python")
        listed = check_run(self, [vpython, "-m", "pip", "list", "--format=json"],
                           env=clean_env()).stdout
        extra = [p["name"] for p in json.loads(listed)
                 if p["name"].lower() in ("setuptools", "wheel")]
        if extra:
            check_run(self, [vpython, "-m", "pip", "uninstall", "-y", *extra], env=clean_env())
        check_run(self, [vpython, "-m", "pip", "install", "--no-index", wheel], env=clean_env(),
                  timeout=240)
        probe = ("import json, steptrace; print(json.dumps({'version': steptrace.__version__, "
                 "'library': steptrace.library_path, 'found_by': steptrace._found_by}))")
        r = subprocess.run([vpython, "-c", probe], env=clean_env(), cwd=self.tmp,
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        out = json.loads(r.stdout)
        self.assertEqual(out["version"], VERSION)
        self.assertEqual(out["found_by"], "wheel")
        self.assertTrue(out["library"].startswith(os.path.realpath(venv)), out["library"])


if __name__ == "__main__":
    unittest.main()
