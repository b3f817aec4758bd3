#!/usr/bin/env python3
"""The smallest Python user of libsteptrace (through the steptrace package, bindings/python).

Times a toy training loop with `with steptrace.span(...)` blocks and a decorated
function, annotates a VRAM-ledger reservation and its release, then flushes so the daemon
has everything before the process exits. Run it against a daemon:

    STEPTRACE_SOCKET=$PWD/run/steptraced.sock python3 examples/python/minimal.py
    steptrace report --pid <the pid it prints>

From a source checkout it uses bindings/python and the build tree's library; with the
.deb installed, Debian's python3 has both. Set STEPTRACE_LIBRARY=/path/to/libsteptrace.so
to choose the library (bindings/python/README.md, "Finding the library").
"""

import os
import sys

try:
    import steptrace
except ImportError:
    # Running from a source checkout: use the package next to the sources.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "bindings", "python"))
    try:
        import steptrace
    except ImportError as e:
        sys.exit(f"minimal.py: cannot load the steptrace binding: {e}")

GPU = "GPU-00000000-minimal-py-0000-00000000000"
STEPS = 5
N = 24


def matmul(a, b):
    with steptrace.span("Matmul"):
        return [[sum(a[i][k] * b[k][j] for k in range(N)) for j in range(N)] for i in range(N)]


@steptrace.span("Tokenize")  # also a decorator; a custom step (not a built-in name)
def tokenize(text):
    return [ord(c) % 7 for c in text]


def main():
    rc = steptrace.connect()
    if rc != 0:
        print(f"minimal.py: steptraced not reachable ({os.strerror(-rc)}); "
              "events are kept until it is, dropped if the buffer fills first", file=sys.stderr)
    a = [[(i + j) % 5 * 0.5 for j in range(N)] for i in range(N)]
    b = [[(i * j) % 3 * 0.25 for j in range(N)] for i in range(N)]
    reservation = os.getpid()

    with steptrace.span("LedgerReserve"):
        steptrace.ledger_reserve(GPU, reservation, 256 << 20, "minimal-py")

    loss = 0.0
    for _ in range(STEPS):
        tokens = tokenize("steptrace from python")
        with steptrace.span("Forward"):
            c = matmul(a, b)
        with steptrace.span("Backward"):
            c = matmul(c, a)
        loss += c[0][0] + len(tokens)

    with steptrace.span("LedgerRelease"):
        steptrace.ledger_release(GPU, reservation)

    rc = steptrace.flush(2000)
    print(f"minimal.py: pid {os.getpid()}, {STEPS} steps recorded, loss {loss:.3f}, "
          f"flush {'ok' if rc == 0 else os.strerror(-rc)}, {steptrace.dropped()} events dropped")
    steptrace.shutdown()
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
