#!/usr/bin/env python3
"""Checks every project #include against the "may include" column of the Folders table
in docs/ARCHITECTURE.md, the one place the rules live. Python 3 standard library only.

  scripts/check-includes.py [--root DIR]   check the tree at DIR (default: this checkout)
  scripts/check-includes.py --self-test    plant violations in a copy and expect failures

How the table is read (section "## Folders", the first table in it):
  - "folder" column: one or more backticked paths, a folder (`daemon/state/`) or a file
    (`daemon/main.cpp`). A C/C++ file belongs to the row with the longest such prefix;
    files in no row (tests/ aside: "anything") are not checked.
  - "may include" column: backticked paths, each either from the root (`proto/`,
    `client/include/`) or naming another row's folder by its tail (`state/` is
    `daemon/state/`); or "nothing" / "the standard library only" (no project header);
    or "anything" (unchecked). A row may always include its own folder, and what it may
    include is transitive: `persist/` may include `state/`, which may include `proto/`,
    so `persist/` may include `proto/` too.
  - Below the table, lines "- `FOLDER` may include `PATH`: why" are known exceptions:
    tolerated and listed on every run, and an error once nothing uses them any more.
  - Below the table, lines "- `HEADER` is private to `FOLDER`: why" make a header one
    that only FOLDER's files may include: every other file of the tree, tests too, is a
    violation. FOLDER is written like a "may include" path (`state/`).
An #include is a project header when it names a file in the tree, looked up (quotes) next
to the including file, then (both forms) from the root and from client/include/, the
include paths the build uses. Anything else (the standard library, Boost, the generated
<steptrace/version.h>) is not checked.
Exit status: 0 clean, 1 a violation (each printed as file:line with its rule), 2 the
table could not be read.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

DOC = "docs/ARCHITECTURE.md"
SOURCE_EXTENSIONS = (".h", ".hpp", ".c", ".cc", ".cpp")
INCLUDE_ROOTS = ("", "client/include/")  # -I paths every target has, from the root
INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
TICKED_RE = re.compile(r"`([^`]+)`")
EXCEPTION_RE = re.compile(r"^\s*[-*]\s+`([^`]+)`\s+may\s+(?:also\s+)?include\s+`([^`]+)`")
PRIVATE_RE = re.compile(r"^\s*[-*]\s+`([^`]+)`\s+is\s+private\s+to\s+`([^`]+)`")


class TableError(Exception):
    pass


def split_row(line):
    cells = line.strip().strip("|").split("|")
    return [c.strip() for c in cells]


def read_rules(doc_path):
    """Returns (rows, exceptions, private): rows maps a folder or file to its may-include
    entry (a list of raw tokens, or None for "anything"); exceptions is
    [(folder, path, line)]; private is [(header, folder, line)]."""
    try:
        with open(doc_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise TableError(f"cannot read {doc_path}: {e}")
    try:
        start = next(i for i, l in enumerate(lines) if re.match(r"^##\s+Folders\s*$", l))
    except StopIteration:
        raise TableError(f'{doc_path}: no "## Folders" section')
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
               len(lines))
    section = list(enumerate(lines[start:end], start=start + 1))
    table = [(n, l) for n, l in section if l.lstrip().startswith("|")]
    if len(table) < 3:
        raise TableError(f"{doc_path}:{start + 1}: the Folders section has no table")
    header = [c.lower() for c in split_row(table[0][1])]
    if "folder" not in header or "may include" not in header:
        raise TableError(f'{doc_path}:{table[0][0]}: the Folders table needs the columns '
                         f'"folder" and "may include" (has: {", ".join(header)})')
    folder_col, rule_col = header.index("folder"), header.index("may include")
    rows = {}
    for n, line in table[2:]:
        cells = split_row(line)
        if len(cells) != len(header):
            raise TableError(f"{doc_path}:{n}: {len(cells)} cells, the header has "
                             f"{len(header)}")
        subjects = TICKED_RE.findall(cells[folder_col])
        if not subjects:
            raise TableError(f"{doc_path}:{n}: no `folder` in the folder column")
        rule = cells[rule_col]
        tokens = TICKED_RE.findall(rule)
        words = rule.lower()
        if "anything" in words:
            allowed = None
        elif tokens:
            allowed = tokens
        elif "nothing" in words or "standard library only" in words:
            allowed = []
        else:
            raise TableError(f'{doc_path}:{n}: cannot read the rule "{rule}" (expected '
                             'backticked paths, "nothing", "the standard library only" '
                             'or "anything")')
        for subject in subjects:
            if subject in rows:
                raise TableError(f"{doc_path}:{n}: `{subject}` has two rows")
            rows[subject] = (allowed, n)
    table_end = table[-1][0]
    exceptions, private = [], []
    for n, line in section:
        if n <= table_end:
            continue
        m = EXCEPTION_RE.match(line)
        if m:
            exceptions.append((m.group(1), m.group(2), n))
        m = PRIVATE_RE.match(line)
        if m:
            private.append((m.group(1), m.group(2), n))
    return rows, exceptions, private


def row_of(path, rows):
    """The row a repository path belongs to: the longest folder prefix, or the file."""
    best = None
    for subject in rows:
        if path == subject or (subject.endswith("/") and path.startswith(subject)):
            if best is None or len(subject) > len(best):
                best = subject
    return best


def resolve_token(token, rows, doc_path, line):
    """A may-include path as a prefix from the root."""
    if any(s == token or s.startswith(token) or token.startswith(s) for s in rows):
        return token
    tails = [s for s in rows if s.endswith("/" + token)]
    if len(tails) == 1:
        return tails[0]
    raise TableError(f"{doc_path}:{line}: `{token}` names no row of the Folders table"
                     + (f" unambiguously ({', '.join(tails)})" if tails else ""))


def allowed_prefixes(rows, doc_path):
    """Each row's may-include list, resolved and closed over the rows it names."""
    direct = {}
    for subject, (allowed, line) in rows.items():
        direct[subject] = (None if allowed is None else
                           [resolve_token(t, rows, doc_path, line) for t in allowed])
    closed = {}
    for subject in rows:
        if direct[subject] is None:
            closed[subject] = None
            continue
        seen, todo = set(), list(direct[subject])
        while todo:
            prefix = todo.pop()
            if prefix in seen:
                continue
            seen.add(prefix)
            owner = row_of(prefix, rows)
            if owner and owner != subject and direct[owner]:
                todo.extend(direct[owner])
        if subject.endswith("/"):
            seen.add(subject)
        closed[subject] = seen
    return direct, closed


def source_files(root, use_git=True):
    """The tree's C/C++ files: git's list in a checkout (no build trees), else a walk."""
    try:
        if not use_git:
            raise OSError("walk")
        out = subprocess.run(["git", "-C", root, "ls-files", "-z"], check=True,
                             capture_output=True).stdout.decode()
        files = [f for f in out.split("\0") if f]
    except (OSError, subprocess.CalledProcessError):
        files = []
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "target"
                           and not os.path.exists(os.path.join(dirpath, d, "CMakeCache.txt"))]
            rel = os.path.relpath(dirpath, root)
            for name in filenames:
                files.append(name if rel == "." else os.path.join(rel, name).replace(os.sep, "/"))
    return sorted(f for f in files if f.endswith(SOURCE_EXTENSIONS))


def resolve_include(root, including, kind, name):
    """The repository path an #include names, or None when it is not in the tree."""
    candidates = []
    if kind == '"':
        candidates.append(os.path.join(os.path.dirname(including), name))
    candidates += [prefix + name for prefix in INCLUDE_ROOTS]
    for c in candidates:
        c = os.path.normpath(c).replace(os.sep, "/")
        if not c.startswith("../") and os.path.isfile(os.path.join(root, c)):
            return c
    return None


def check(root, quiet=False, use_git=True):
    doc_path = os.path.join(root, DOC)
    try:
        rows, exceptions, private = read_rules(doc_path)
        direct, closed = allowed_prefixes(rows, doc_path)
        exceptions = [(resolve_token(f, rows, doc_path, n), p, n) for f, p, n in exceptions]
        private = {h: (resolve_token(f, rows, doc_path, n), n) for h, f, n in private}
        for header, (_, n) in private.items():
            if not os.path.isfile(os.path.join(root, header)):
                raise TableError(f"{doc_path}:{n}: the private header `{header}` does not exist")
    except TableError as e:
        print(f"check-includes: {e}", file=sys.stderr)
        return 2
    violations, tolerated, used = [], [], set()
    checked = 0
    for path in source_files(root, use_git):
        subject = row_of(path, rows)
        unchecked = subject is None or closed[subject] is None
        if unchecked and not private:
            continue
        checked += 0 if unchecked else 1
        try:
            with open(os.path.join(root, path), encoding="utf-8", errors="replace") as f:
                text = f.read().splitlines()
        except OSError:
            continue
        for number, line in enumerate(text, start=1):
            m = INCLUDE_RE.match(line)
            if not m:
                continue
            target = resolve_include(root, path, m.group(1), m.group(2))
            close = ">" if m.group(1) == "<" else '"'
            where = f"{path}:{number}: #include {m.group(1)}{m.group(2)}{close}"
            if target in private and not path.startswith(private[target][0]):
                violations.append(f"{where}: `{target}` is private to `{private[target][0]}` "
                                  f"({DOC}:{private[target][1]})")
                continue
            if unchecked:
                continue
            if target is None or any(target == p or (p.endswith("/") and target.startswith(p))
                                     for p in closed[subject]):
                continue
            excused = [e for e in exceptions
                       if e[0] == subject and (target == e[1] or
                                               (e[1].endswith("/") and target.startswith(e[1])))]
            if excused:
                used.update(excused)
                tolerated.append(f"{where} ({DOC}:{excused[0][2]}: known exception)")
                continue
            rule = ", ".join(f"`{p}`" for p in direct[subject]) or "no project header"
            violations.append(f"{where}: `{subject}` may include {rule} "
                              f"({DOC}:{rows[subject][1]}), not `{target}`")
    stale = [e for e in exceptions if e not in used]
    for line in tolerated:
        print(f"check-includes: tolerated: {line}")
    for line in violations:
        print(line, file=sys.stderr)
    for folder, target, n in stale:
        print(f"{DOC}:{n}: the exception `{folder}` may include `{target}` is no longer "
              "used: remove it", file=sys.stderr)
    if violations or stale:
        print(f"check-includes: {len(violations)} forbidden include(s), {len(stale)} stale "
              f"exception(s) (rules: the Folders table of {DOC})", file=sys.stderr)
        return 1
    if not quiet:
        print(f"check-includes: {checked} files follow the Folders table of {DOC}")
    return 0


def self_test(root):
    """Copies the tree's sources and DOC into a temporary directory (no git there, so its
    files are walked), expects it to pass, then plants violations and expects each to
    fail, named by file:line."""
    failures = []
    with tempfile.TemporaryDirectory(prefix="check-includes.") as tmp:
        rows, _, _ = read_rules(os.path.join(root, DOC))
        for path in source_files(root):
            if row_of(path, rows) is None or path.startswith("tests/"):
                continue  # only what is checked: no tests, no build trees
            os.makedirs(os.path.join(tmp, os.path.dirname(path)), exist_ok=True)
            shutil.copy(os.path.join(root, path), os.path.join(tmp, path))
        os.makedirs(os.path.join(tmp, "docs"), exist_ok=True)
        shutil.copy(os.path.join(root, DOC), os.path.join(tmp, DOC))

        def expect(name, status, needle=None):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                got = check(tmp, quiet=True, use_git=False)
            text = out.getvalue() + err.getvalue()
            if got != status or (needle and needle not in text):
                failures.append(f"{name}: expected status {status}"
                                + (f" and {needle!r}" if needle else "")
                                + f", got {got}:\n{text}")

        def plant(path, body):
            full = os.path.join(tmp, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(body)

        def unplant(path):
            os.remove(os.path.join(tmp, path))

        expect("the copied tree", 0)
        # state/ reaching up into serve/, with a quoted path from the root.
        plant("daemon/serve/planted.h", "#pragma once\n")
        plant("daemon/state/planted_bad.cpp",
              '#include "daemon/state/types.h"\n#include <vector>\n'
              '#include "daemon/serve/planted.h"\n')
        expect("state/ includes serve/", 1, "daemon/state/planted_bad.cpp:3:")
        unplant("daemon/state/planted_bad.cpp")
        # proto/ includes nothing of the project but itself; here, by a relative path.
        plant("proto/planted_bad.h", '#pragma once\n  #  include "../client/src/planted.h"\n')
        plant("client/src/planted.h", "#pragma once\n")
        expect("proto/ includes client/ (relative)", 1, "proto/planted_bad.h:2:")
        unplant("proto/planted_bad.h")
        # gpu/ may include nothing: the public client header by angle brackets.
        plant("client/include/steptrace/planted.h", "#pragma once\n")
        plant("daemon/gpu/planted_bad.cpp", "#include <steptrace/planted.h>\n")
        expect("gpu/ includes client/include/", 1, "daemon/gpu/planted_bad.cpp:1:")
        unplant("daemon/gpu/planted_bad.cpp")
        # The transitive rule holds: persist/ -> state/ -> proto/.
        plant("daemon/persist/planted_ok.cpp", '#include "proto/codec.h"\n')
        expect("persist/ includes proto/ (allowed)", 0)
        # A header of a folder outside the table is not allowed either.
        plant("tests/support/planted.h", "#pragma once\n")
        plant("daemon/report/planted_bad.cpp", '#include "tests/support/planted.h"\n')
        expect("report/ includes tests/", 1, "daemon/report/planted_bad.cpp:1:")
        unplant("daemon/report/planted_bad.cpp")
        # A known exception: tolerated while used, an error once unused.
        with open(os.path.join(tmp, DOC), encoding="utf-8") as f:
            doc = f.read()
        threads = doc.index("\n## ", doc.index("## Folders"))
        with open(os.path.join(tmp, DOC), "w", encoding="utf-8") as f:
            f.write(doc[:threads] + "\n- `gpu/` may include `proto/planted.h`: a test.\n"
                    + doc[threads:])
        plant("proto/planted.h", "#pragma once\n")
        plant("daemon/gpu/planted_excused.cpp", '#include "proto/planted.h"\n')
        expect("a used exception", 0, "tolerated: daemon/gpu/planted_excused.cpp:1:")
        unplant("daemon/gpu/planted_excused.cpp")
        expect("an unused exception", 1, "is no longer used")
        # A private header: its folder may include it, no one else may, tests neither.
        with open(os.path.join(tmp, DOC), "w", encoding="utf-8") as f:
            f.write(doc[:threads] + "\n- `daemon/state/planted_private.h` is private to "
                    "`state/`: a test.\n" + doc[threads:])
        plant("daemon/state/planted_private.h", "#pragma once\n")
        plant("daemon/state/planted_ok.cpp", '#include "daemon/state/planted_private.h"\n')
        expect("state/ includes its private header", 0)
        plant("daemon/report/planted_bad.cpp", '#include "daemon/state/planted_private.h"\n')
        expect("report/ includes state/'s private header", 1,
               "daemon/report/planted_bad.cpp:1:")
        unplant("daemon/report/planted_bad.cpp")
        plant("tests/planted_bad.cpp", '\n#include "daemon/state/planted_private.h"\n')
        expect("a test includes state/'s private header", 1, "tests/planted_bad.cpp:2:")
        unplant("tests/planted_bad.cpp")
        unplant("daemon/state/planted_private.h")
        expect("a private header that does not exist", 2, "does not exist")
        # A broken table is an error of its own (status 2), not a silent pass.
        with open(os.path.join(tmp, DOC), "w", encoding="utf-8") as f:
            f.write(doc.replace("| may include |", "| may use |", 1))
        expect("no may-include column", 2, "may include")
    if failures:
        for f in failures:
            print(f"check-includes self-test: FAILED {f}", file=sys.stderr)
        return 1
    print("check-includes: self-test passed (planted violations fail, the tree passes)")
    return 0


def main():
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=here, help="the tree to check (default: %(default)s)")
    parser.add_argument("--self-test", action="store_true",
                        help="check that planted violations in a copy of the tree fail")
    args = parser.parse_args()
    root = os.path.abspath(args.root)
    return self_test(root) if args.self_test else check(root)


if __name__ == "__main__":
    sys.exit(main())
