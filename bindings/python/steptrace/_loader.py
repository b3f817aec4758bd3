"""Finds and loads libsteptrace.so for the steptrace package.

Where it looks, in this order (the first that loads wins):

1. ``$STEPTRACE_LIBRARY``, when set: that file and nothing else (an explicit choice
   that fails is an error, never silently replaced by another copy of the library).
2. The copy a platform wheel carries: ``libsteptrace.so.0`` next to this file (the
   build's wheel, bindings/python/build_backend; a pip install needs nothing else).
3. The installed prefix: the library directory recorded in ``_install_paths.py`` when
   CMake installed this package (``cmake --install``, the .deb): first relative to this
   package (so a relocated prefix still works), then as the absolute path.
4. The system's search: ``dlopen("libsteptrace.so.0")`` (LD_LIBRARY_PATH, the ld.so
   cache, the default directories), then whatever ``ctypes.util.find_library``
   finds.
5. A source checkout: when this package is ``bindings/python/steptrace`` of one,
   ``build*/client/libsteptrace.so.0`` of that checkout (``build`` first).

When none loads, ImportError lists every place tried with the loader's reason.
"""

import ctypes
import ctypes.util
import glob
import os

SONAME = "libsteptrace.so.0"
PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _installed_dirs(package_dir):
    """Library directories recorded at install time (none for a pip or source copy)."""
    try:
        from . import _install_paths  # written by cmake/SteptracePython.cmake
    except ImportError:
        return []
    dirs = []
    relative = getattr(_install_paths, "LIBDIR_FROM_PACKAGE", None)
    if relative:
        dirs.append(os.path.normpath(os.path.join(package_dir, relative)))
    absolute = getattr(_install_paths, "LIBDIR", None)
    if absolute and os.path.normpath(absolute) not in dirs:
        dirs.append(os.path.normpath(absolute))
    return dirs


def source_root(package_dir=PACKAGE_DIR):
    """The checkout this package sits in (ROOT/bindings/python/steptrace), else None."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(package_dir)))
    marker = os.path.join(root, "client", "include", "steptrace", "steptrace.h")
    return root if os.path.isfile(marker) else None


def _build_tree_libraries(root):
    dirs = sorted(glob.glob(os.path.join(root, "build*", "client")),
                  key=lambda d: (os.path.basename(os.path.dirname(d)) != "build", d))
    return [os.path.join(d, SONAME) for d in dirs if os.path.exists(os.path.join(d, SONAME))]


def candidates(environ=None, package_dir=PACKAGE_DIR):
    """(where, path or name) pairs to try, lazily: find_library runs only when reached."""
    environ = os.environ if environ is None else environ
    explicit = environ.get("STEPTRACE_LIBRARY")
    if explicit:
        yield "$STEPTRACE_LIBRARY", explicit
        return
    bundled = os.path.join(package_dir, SONAME)
    if os.path.exists(bundled):
        yield "wheel", bundled
    for d in _installed_dirs(package_dir):
        yield "installed prefix", os.path.join(d, SONAME)
    yield "system search", SONAME
    found = ctypes.util.find_library("steptrace")
    if found and found != SONAME:
        yield "ctypes.util.find_library", found
    root = source_root(package_dir)
    if root is not None:
        for path in _build_tree_libraries(root):
            yield "source tree", path


def load(tries=None):
    """(ctypes.CDLL, where) for the first candidate that loads; ImportError otherwise."""
    failures = []
    for where, path in (candidates() if tries is None else tries):
        try:
            return ctypes.CDLL(path), where
        except OSError as e:
            failures.append(f"  {where}: {path}: {e}")
    if not failures:
        failures.append("  (nowhere to look)")
    raise ImportError(
        "steptrace: cannot load libsteptrace; tried, in order:\n" + "\n".join(failures) +
        "\nInstall steptrace (the .deb puts the library where the system finds it), add "
        "the library's directory to LD_LIBRARY_PATH, or set STEPTRACE_LIBRARY to its path.")


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def loaded_path(lib, symbol="steptrace_connect"):
    """The file the dynamic loader actually mapped for `lib` (dladdr on one of its
    functions), or lib's name when that cannot be told."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        dladdr.restype = ctypes.c_int
        info = _DlInfo()
        address = ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
        if dladdr(address, ctypes.byref(info)) and info.dli_fname:
            return os.path.realpath(os.fsdecode(info.dli_fname))
    except (AttributeError, OSError):
        pass
    return lib._name
