#!/usr/bin/env python3
"""The Python binding's built-in steps are proto/steps.h's table, exactly.

Usage: python_steps_test.py PRINT_BUILTIN_STEPS (the program that prints the table).
Run by ctest with STEPTRACE_LIBRARY (libsteptrace.so) and PYTHONPATH (the bindings dir)
set; needs no daemon."""

import subprocess
import sys
import unittest

import steptrace

PRINTER = None


def table():
    """[(id, name)] of proto/steps.h, in table order."""
    out = subprocess.run([PRINTER], check=True, capture_output=True, text=True).stdout
    rows = []
    for line in out.splitlines():
        step_id, name, _ledger = line.split("\t")
        rows.append((int(step_id), name))
    return rows


class BuiltinStepsTest(unittest.TestCase):
    def test_step_enum_is_the_table(self):
        rows = table()
        self.assertEqual(len(rows), 12)  # PROTOCOL.md 4.5; guards against an empty printout
        # __members__ includes aliases, which iterating the enum would hide.
        members = [(int(v), k) for k, v in steptrace.Step.__members__.items()]
        self.assertEqual(members, rows)

    def test_built_in_names_resolve_to_their_ids(self):
        for step_id, name in table():
            self.assertEqual(steptrace.step_id(name), step_id, name)


if __name__ == "__main__":
    PRINTER = sys.argv.pop(1)
    unittest.main()
