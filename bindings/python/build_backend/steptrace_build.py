"""The steptrace package's PEP 517 build backend: the standard library and nothing else.

pyproject.toml names it (`backend-path = ["build_backend"]`), so that
`pip install --no-index --no-build-isolation bindings/python` works in a plain venv,
which has neither setuptools nor wheel and cannot fetch them offline. It builds:

- a wheel (PEP 427) of the package, steptrace-VERSION-py3-none-any.whl; with a library
  (config setting `library=PATH`, or $STEPTRACE_WHEEL_LIBRARY) the wheel carries it as
  steptrace/libsteptrace.so.0 and is tagged for this platform
  (steptrace-VERSION-py3-none-linux_x86_64.whl): the loader tries that copy first;
- an editable wheel (PEP 660): a .pth file that puts this directory on sys.path;
- an sdist (PEP 517), for completeness.

Run as a script it builds the wheel CMake makes (`steptrace_python_wheel`):
  python3 steptrace_build.py --outdir DIR [--library libsteptrace.so.0]
and prints the wheel's path."""

import base64
import hashlib
import io
import os
import re
import sysconfig
import tarfile
import zipfile

NAME = "steptrace"
SONAME = "libsteptrace.so.0"
SOURCE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # bindings/python
PACKAGE_DIR = os.path.join(SOURCE_DIR, NAME)
# Fixed timestamps (or SOURCE_DATE_EPOCH's): the same sources give the same wheel.
_EPOCH = max(int(os.environ.get("SOURCE_DATE_EPOCH", "315532800")), 315532800)


def _version():
    """The package's version, read from steptrace/_version.py without importing the
    package (importing it loads libsteptrace)."""
    with open(os.path.join(PACKAGE_DIR, "_version.py"), encoding="utf-8") as f:
        match = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if not match:
        raise RuntimeError("steptrace/_version.py has no __version__")
    return match.group(1)


def _metadata(version):
    """METADATA (core metadata 2.1): what pyproject.toml's [project] says."""
    with open(os.path.join(SOURCE_DIR, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    return (f"Metadata-Version: 2.1\n"
            f"Name: {NAME}\n"
            f"Version: {version}\n"
            "Summary: Python binding of libsteptrace: span and VRAM-ledger events for "
            "steptraced\n"
            "Requires-Python: >=3.8\n"
            "Classifier: Programming Language :: Python :: 3\n"
            "Classifier: Operating System :: POSIX :: Linux\n"
            "Description-Content-Type: text/markdown\n"
            f"\n{readme}")


def _package_files():
    """(path in the wheel, path on disk) of the package's modules. _install_paths.py is
    CMake's (an install into a prefix), never a wheel's."""
    files = []
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if name.endswith(".py") and name != "_install_paths.py":
            files.append((f"{NAME}/{name}", os.path.join(PACKAGE_DIR, name)))
    return files


def _library(config_settings):
    library = (config_settings or {}).get("library") or os.environ.get(
        "STEPTRACE_WHEEL_LIBRARY")
    if library and not os.path.isfile(library):
        raise FileNotFoundError(f"steptrace wheel: library {library} does not exist")
    return library or None


def platform_tag():
    """This platform's wheel tag (linux-x86_64 -> linux_x86_64)."""
    return re.sub(r"[^A-Za-z0-9]", "_", sysconfig.get_platform())


def _hash(data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + digest.decode()


class _Wheel:
    """A wheel written entry by entry, its RECORD (hash and size of each file) last."""

    def __init__(self, path):
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED)
        self.record = []

    def add(self, arcname, data, executable=False):
        info = zipfile.ZipInfo(arcname, date_time=_date_time())
        info.external_attr = (0o100755 if executable else 0o100644) << 16
        info.compress_type = zipfile.ZIP_DEFLATED
        self.zip.writestr(info, data)
        self.record.append(f"{arcname},{_hash(data)},{len(data)}")

    def close(self, dist_info):
        record = f"{dist_info}/RECORD"
        self.record.append(f"{record},,")
        info = zipfile.ZipInfo(record, date_time=_date_time())
        info.external_attr = 0o100644 << 16
        self.zip.writestr(info, "\n".join(self.record) + "\n")
        self.zip.close()


def _date_time():
    import time

    return time.gmtime(_EPOCH)[:6]


def _build(wheel_directory, library=None, editable=False):
    version = _version()
    tag = f"py3-none-{platform_tag()}" if library else "py3-none-any"
    filename = f"{NAME}-{version}-{tag}.whl"
    dist_info = f"{NAME}-{version}.dist-info"
    os.makedirs(wheel_directory, exist_ok=True)
    path = os.path.join(wheel_directory, filename)
    tmp = path + ".tmp"
    wheel = _Wheel(tmp)
    try:
        if editable:
            # PEP 660: the sources stay where they are; their directory goes on sys.path.
            wheel.add(f"__editable__.{NAME}-{version}.pth", (SOURCE_DIR + "\n").encode())
        else:
            for arcname, src in _package_files():
                with open(src, "rb") as f:
                    wheel.add(arcname, f.read())
            if library:
                with open(library, "rb") as f:  # the file a symlink names, not the link
                    wheel.add(f"{NAME}/{SONAME}", f.read(), executable=True)
        wheel.add(f"{dist_info}/METADATA", _metadata(version).encode())
        wheel.add(f"{dist_info}/WHEEL", (
            "Wheel-Version: 1.0\n"
            "Generator: steptrace_build (bindings/python/build_backend)\n"
            f"Root-Is-Purelib: {'false' if library else 'true'}\n"
            f"Tag: {tag}\n").encode())
        wheel.add(f"{dist_info}/top_level.txt", f"{NAME}\n".encode())
        wheel.close(dist_info)
        os.replace(tmp, path)
    except BaseException:
        wheel.zip.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return filename


# ---- PEP 517 / PEP 660 hooks -------------------------------------------------------------

def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, library=_library(config_settings))


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    return _build(wheel_directory, editable=True)


def build_sdist(sdist_directory, config_settings=None):
    version = _version()
    base = f"{NAME}-{version}"
    os.makedirs(sdist_directory, exist_ok=True)
    filename = f"{base}.tar.gz"
    members = [("pyproject.toml", os.path.join(SOURCE_DIR, "pyproject.toml")),
               ("README.md", os.path.join(SOURCE_DIR, "README.md")),
               ("build_backend/steptrace_build.py", os.path.abspath(__file__)),
               *_package_files()]
    with tarfile.open(os.path.join(sdist_directory, filename), "w:gz",
                      format=tarfile.PAX_FORMAT) as tar:
        pkg_info = _metadata(version).encode()
        for arcname, data in [("PKG-INFO", pkg_info)] + [
                (a, open(p, "rb").read()) for a, p in members]:
            info = tarfile.TarInfo(f"{base}/{arcname}")
            info.size, info.mtime, info.mode = len(data), _EPOCH, 0o644
            tar.addfile(info, io.BytesIO(data))
    return filename


def main(argv=None):
    import argparse

    parser = argparse.ArgumentParser(description="Builds the steptrace wheel.")
    parser.add_argument("--outdir", required=True, help="where the wheel goes")
    parser.add_argument("--library", help=f"the {SONAME} to carry (a platform wheel)")
    args = parser.parse_args(argv)
    settings = {"library": args.library} if args.library else {}
    print(os.path.join(args.outdir, build_wheel(args.outdir, settings)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
