"""Reading the real binaries' help: the subcommands `steptrace help` lists and the flags
CLI11's help of a (sub)command shows, for the tests that check the bash completion and
the man pages against them."""
import os
import re

from packaging_util import run

CLI = os.environ["STEPTRACE_CLI"]
STEPTRACED = os.environ["STEPTRACE_STEPTRACED"]


def _help(test, argv):
    result = run(argv)
    test.assertEqual(result.returncode, 0, f"{argv}: {result.stdout}{result.stderr}")
    return result.stdout


def section_lines(text, heading):
    """The lines of a help section ("Options:", "Subcommands:") up to the next blank one."""
    lines, inside = [], False
    for line in text.splitlines():
        if line.rstrip() == heading:
            inside = True
        elif inside and not line.strip():
            break
        elif inside:
            lines.append(line)
    return lines


def flags_of(text):
    """Every option name of a help text's "Options:" section: {"-h", "--help", ...}."""
    flags = set()
    for line in section_lines(text, "Options:"):
        match = re.match(r"^  (-[^\s]+)", line)
        if match:
            flags.update(match.group(1).split(","))
    return flags


def subcommands(test):
    """The subcommands `steptrace help` lists, in order."""
    names = [line.split()[0] for line in section_lines(_help(test, [CLI, "help"]), "Subcommands:")]
    test.assertIn("report", names)
    return names


def cli_global_flags(test):
    return flags_of(_help(test, [CLI, "--help"]))


def cli_flags(test, subcommand):
    """The flags `steptrace help SUBCOMMAND` shows (the global ones are not among them)."""
    return flags_of(_help(test, [CLI, "help", *subcommand.split()]))  # "trace merge": nested


def daemon_help(test):
    return _help(test, [STEPTRACED, "--help"])


def daemon_flags(test):
    flags = flags_of(daemon_help(test))
    test.assertIn("--config", flags)
    return flags


def daemon_choices(test, flag):
    """The values `steptraced --help` gives for a flag as "a|b|c" ("--nvml MODE  off|auto|on")."""
    match = re.search(rf"^  {re.escape(flag)} \S+\s+(\w+(?:\|\w+)+)", daemon_help(test), re.M)
    test.assertIsNotNone(match, f"steptraced --help lists no choices for {flag}")
    return set(match.group(1).split("|"))
