#!/usr/bin/env python3
"""Checks Chrome Trace Event files (`steptrace trace`, `steptrace trace merge`) against the
rules Perfetto UI (ui.perfetto.dev) and speedscope apply when they import one, as far as
they can be stated without a browser (issue 27). Exit status 0 when every file passes,
1 when one breaks a rule (each problem is printed), 2 on bad usage.

The rules:
  R1 the file is one JSON object with a "traceEvents" array of objects (both viewers);
  R2 every event has "ph" and "ts": speedscope takes a file for a trace only when every
     event has both, metadata too; and "cat" (@tracerbench/trace-model, Perfetto's
     category filter);
  R3 "pid" and "tid" are integers; "ts" and "dur" numbers >= 0; "ph" one the viewers
     know; an instant's "s" is g, p or t; a counter's args are numbers; a metadata
     event's args.name is a string;
  R4 ts stays below 2^53 ns (= 9.0e9 s): past it a double loses the nanosecond, and
     ends computed as ts + dur drift (ts of ~1.29e9 us already rounded in speedscope);
  R5 on each thread the complete events ("X"), sorted by ts with ties in file order
     (what speedscope and trace-model do), nest: one that starts inside another ends
     inside it too, with ends computed in double precision as ts + dur. Perfetto
     drops or misplaces a slice that does not; speedscope draws a staircase;
  R6 "B"/"E" pairs match per thread;
  R7 a file past 50 MB is a warning: speedscope's tab closed on a 98 MB trace.

Usage: scripts/trace-viewer-check.py FILE...
"""
import json
import sys

PHASES = {"B", "E", "X", "i", "I", "b", "n", "e", "C", "M", "P", "O", "N", "D", "s", "t", "f",
          "R", "c", "v", "V", "(", ")"}
MAX_BYTES = 50_000_000
MAX_US = 2**53 / 1000.0


def check(path):
    problems = []
    warnings = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return [f"cannot read: {e}"], []
    if len(data) > MAX_BYTES:
        warnings.append(f"R7 {len(data)} bytes, past 50 MB: viewers may struggle")
    try:
        doc = json.loads(data)
    except ValueError as e:
        return [f"R1 not JSON: {e}"], warnings
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        return ["R1 not an object with a traceEvents array"], warnings
    spans = {}  # (pid, tid) -> [(ts, end, index, name)]
    open_b = {}
    for i, e in enumerate(doc["traceEvents"]):
        if not isinstance(e, dict):
            problems.append(f"R1 event {i} is not an object")
            continue
        where = f"event {i} {json.dumps(e)[:160]}"
        ph = e.get("ph")
        for key in ("ph", "ts", "cat"):
            if key not in e:
                problems.append(f"R2 no {key!r}: {where}")
        if ph not in PHASES:
            problems.append(f"R3 unknown ph: {where}")
        for key in ("pid", "tid"):
            if not isinstance(e.get(key), int) or isinstance(e.get(key), bool):
                problems.append(f"R3 {key} not an integer: {where}")
        ts = e.get("ts")
        if "ts" in e and (not isinstance(ts, (int, float)) or ts < 0):
            problems.append(f"R3 ts not a time: {where}")
            ts = None
        if isinstance(ts, (int, float)) and ts >= MAX_US:
            problems.append(f"R4 ts {ts} past 2^53 ns: {where}")
        if ph == "i" and e.get("s", "t") not in ("g", "p", "t"):
            problems.append(f"R3 instant scope: {where}")
        if ph == "C" and not all(isinstance(v, (int, float)) for v in e.get("args", {}).values()):
            problems.append(f"R3 counter args not numbers: {where}")
        if ph == "M" and e.get("name") in ("process_name", "thread_name") and not isinstance(
            e.get("args", {}).get("name"), str
        ):
            problems.append(f"R3 metadata without args.name: {where}")
        key = (e.get("pid"), e.get("tid"))
        if ph == "X":
            dur = e.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                problems.append(f"R3 dur not a duration: {where}")
            elif ts is not None:
                spans.setdefault(key, []).append((ts, ts + dur, i, e.get("name")))
        elif ph == "B":
            open_b.setdefault(key, []).append(e.get("name"))
        elif ph == "E":
            stack = open_b.get(key, [])
            if not stack:
                problems.append(f"R6 E without B: {where}")
            else:
                name = stack.pop()
                if "name" in e and e["name"] != name:
                    problems.append(f"R6 E of {e['name']} closes B of {name}: {where}")
    for key, stack in open_b.items():
        if stack:
            problems.append(f"R6 pid {key[0]} tid {key[1]}: {len(stack)} B without E")
    for key, events in spans.items():
        events.sort(key=lambda s: (s[0], s[2]))
        stack = []
        for ts, end, i, name in events:
            while stack and stack[-1][1] <= ts:
                stack.pop()
            if stack and end > stack[-1][1]:
                top = stack[-1]
                problems.append(
                    f"R5 pid {key[0]} tid {key[1]}: {name} [{ts!r}, {end!r}] (event {i}) "
                    f"overlaps {top[3]} [{top[0]!r}, {top[1]!r}] (event {top[2]}) without nesting"
                )
                continue
            stack.append((ts, end, i, name))
    return problems, warnings


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__, file=sys.stderr if len(argv) < 2 else sys.stdout)
        return 2 if len(argv) < 2 else 0
    failed = False
    for path in argv[1:]:
        problems, warnings = check(path)
        status = "ok" if not problems else f"{len(problems)} problems"
        print(f"{path}: {status}" + (f", {len(warnings)} warnings" if warnings else ""))
        for line in problems[:30] + warnings:
            print(f"  {line}")
        failed = failed or bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
