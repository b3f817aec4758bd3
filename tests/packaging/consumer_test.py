"""Outside projects build against an installed steptrace, once through
find_package(steptrace) and once through pkg-config, and their events reach a live
daemon started from the same install: `report --json` counts what each program sent."""
import os
import sys
import unittest

from packaging_util import (CMAKE, LIBDIR, SOURCE_DIR, VERSION, Daemon, TempDirTestCase,
                            check_run, process_steps, report_json, run, tool)

CONSUMER_DIR = os.path.join(SOURCE_DIR, "tests/packaging/consumer")
CC = os.environ["STEPTRACE_C_COMPILER"]
CXX = os.environ["STEPTRACE_CXX_COMPILER"]
GENERATOR = os.environ["STEPTRACE_CMAKE_GENERATOR"]
MAKE_PROGRAM = os.environ["STEPTRACE_CMAKE_MAKE_PROGRAM"]


def needed_libraries(test, binary):
    """DT_NEEDED entries of an ELF file."""
    out = check_run(test, [tool("readelf", "binutils"), "-d", binary]).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


class ConsumerTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.prefix = self.install_prefix()
        self.sock = os.path.join(self.tmp, "d.sock")
        self.daemon = Daemon([os.path.join(self.prefix, "bin/steptraced"), "--socket", self.sock],
                             os.path.join(self.tmp, "daemon.log"))
        self.addCleanup(self.daemon.stop)
        self.assertTrue(self.daemon.wait_ready(self.sock), self.daemon.log_text())
        self.cli = os.path.join(self.prefix, "bin/steptrace")

    def run_consumer(self, binary, n, env=None):
        """Runs a consumer program against the daemon; returns its pid."""
        return self.run_consumer_argv([binary, str(n)], env)

    def run_consumer_argv(self, argv, env=None):
        full_env = {"STEPTRACE_SOCKET": self.sock}
        full_env.update(env or {})
        result = check_run(self, argv, env=full_env, timeout=60)
        return int(result.stdout.strip())

    def check_c_consumer(self, pid, n):
        report = report_json(self, self.cli, self.sock)
        steps = process_steps(self, report, pid)
        self.assertEqual(steps, {"Forward": n, "Matmul": n, "consumer_c_step": n})
        gpus = {g["gpu"]: g for g in report["ledger"]["gpus"]}
        self.assertIn("GPU-consumer", gpus)
        reservations = [r for r in gpus["GPU-consumer"]["reservations"] if r["pid"] == pid]
        self.assertEqual([(r["id"], r["bytes"], r["task"]) for r in reservations],
                         [(pid, 1000, "consumer-c")])

    def check_cpp_consumer(self, pid, n):
        steps = process_steps(self, report_json(self, self.cli, self.sock), pid)
        self.assertEqual(steps, {"Backward": n, "Attention": n})

    def test_installed_headers_are_the_public_ones_only(self):
        # The public headers, and version.h generated from project(VERSION).
        public = sorted(os.listdir(os.path.join(SOURCE_DIR, "client/include/steptrace"))
                        + ["version.h"])
        installed = sorted(os.listdir(os.path.join(self.prefix, "include/steptrace")))
        self.assertEqual(installed, public)
        headers = []
        for root, _, files in os.walk(self.prefix):
            headers += [os.path.relpath(os.path.join(root, f), self.prefix)
                        for f in files if f.endswith((".h", ".hpp"))]
        self.assertEqual(sorted(headers), [f"include/steptrace/{h}" for h in public])
        with open(os.path.join(self.prefix, "include/steptrace/version.h")) as f:
            self.assertIn(f'#define STEPTRACE_VERSION_STRING "{VERSION}"', f.read())

    def test_find_package_consumers(self):
        build = os.path.join(self.tmp, "consumer-build")
        check_run(self, [CMAKE, "-S", CONSUMER_DIR, "-B", build, "-G", GENERATOR,
                         f"-DCMAKE_MAKE_PROGRAM={MAKE_PROGRAM}",
                         f"-DCMAKE_C_COMPILER={CC}", f"-DCMAKE_CXX_COMPILER={CXX}",
                         f"-DCMAKE_PREFIX_PATH={self.prefix}", "-DCMAKE_BUILD_TYPE=Release"])
        check_run(self, [CMAKE, "--build", build, "-j", "2"])

        # The shared consumers link libsteptrace.so.N from the prefix, the static one
        # carries the library inside.
        for name in ("consumer_c", "consumer_cpp"):
            self.assertTrue(any(lib.startswith("libsteptrace.so")
                                for lib in needed_libraries(self, os.path.join(build, name))),
                            name)
        self.assertFalse(any(lib.startswith("libsteptrace")
                             for lib in needed_libraries(self, os.path.join(build, "consumer_static"))))

        pid = self.run_consumer(os.path.join(build, "consumer_c"), 25)
        self.check_c_consumer(pid, 25)
        pid = self.run_consumer(os.path.join(build, "consumer_cpp"), 30)
        self.check_cpp_consumer(pid, 30)
        pid = self.run_consumer(os.path.join(build, "consumer_static"), 7)
        self.check_c_consumer(pid, 7)

    def test_version_file_refuses_another_major_version(self):
        project = os.path.join(self.tmp, "wrong-version")
        os.makedirs(project)
        major = int(VERSION.split(".")[0])
        with open(os.path.join(project, "CMakeLists.txt"), "w") as f:
            f.write("cmake_minimum_required(VERSION 3.25)\nproject(v LANGUAGES NONE)\n"
                    f"find_package(steptrace {major + 1} REQUIRED)\n")
        result = run([CMAKE, "-S", project, "-B", os.path.join(project, "b"),
                      f"-DCMAKE_PREFIX_PATH={self.prefix}"])
        self.assertNotEqual(result.returncode, 0)
        self.assertIn(f'compatible with requested version "{major + 1}"', result.stderr)
        self.assertIn(f"steptraceConfig.cmake, version: {VERSION}", result.stderr)

    def test_pkg_config_consumers(self):
        pkg_config = tool("pkg-config", "pkg-config")
        env = {"PKG_CONFIG_PATH": os.path.join(self.prefix, LIBDIR, "pkgconfig")}
        self.assertEqual(check_run(self, [pkg_config, "--modversion", "steptrace"],
                                   env=env).stdout.strip(), VERSION)
        cflags = check_run(self, [pkg_config, "--cflags", "steptrace"], env=env).stdout.split()
        libs = check_run(self, [pkg_config, "--libs", "steptrace"], env=env).stdout.split()
        self.assertEqual(cflags, [f"-I{self.prefix}/include"])
        self.assertEqual(libs, [f"-L{self.prefix}/{LIBDIR}", "-lsteptrace"])

        warnings = ["-Wall", "-Wextra", "-Wpedantic", "-Werror"]
        c_bin = os.path.join(self.tmp, "pc_consumer_c")
        cpp_bin = os.path.join(self.tmp, "pc_consumer_cpp")
        check_run(self, [CC, "-std=c99", *warnings, *cflags,
                         os.path.join(CONSUMER_DIR, "consumer.c"), "-o", c_bin, *libs])
        check_run(self, [CXX, "-std=c++17", *warnings, *cflags,
                         os.path.join(CONSUMER_DIR, "consumer.cpp"), "-o", cpp_bin, *libs])

        run_env = {"LD_LIBRARY_PATH": os.path.join(self.prefix, LIBDIR)}
        pid = self.run_consumer(c_bin, 11, run_env)
        self.check_c_consumer(pid, 11)
        pid = self.run_consumer(cpp_bin, 13, run_env)
        self.check_cpp_consumer(pid, 13)

    def test_installed_python_binding(self):
        script = ("import os, steptrace\n"
                  "assert steptrace.__file__.startswith(os.environ['PREFIX']), steptrace.__file__\n"
                  "assert steptrace.connect() == 0\n"
                  "for _ in range(9):\n"
                  "    with steptrace.span('Forward'):\n"
                  "        pass\n"
                  "assert steptrace.flush(10000) == 0\n"
                  "print(os.getpid())\n")
        env = {"PREFIX": self.prefix,
               "PYTHONPATH": os.path.join(self.prefix, "lib/python3/dist-packages"),
               "STEPTRACE_LIBRARY": os.path.join(self.prefix, LIBDIR, "libsteptrace.so.0")}
        pid = self.run_consumer_argv([sys.executable, "-c", script], env)
        self.assertEqual(process_steps(self, report_json(self, self.cli, self.sock), pid),
                         {"Forward": 9})


if __name__ == "__main__":
    unittest.main()
