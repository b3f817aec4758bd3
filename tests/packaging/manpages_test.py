"""The hand-written man pages docs/man/steptrace.1 and steptraced.8: they format without
warnings, and name every subcommand and flag the real binaries' help shows, and no
flag the binaries do not have."""
import os
import re
import shutil
import unittest

from help_text import cli_flags, cli_global_flags, daemon_flags, subcommands
from packaging_util import SOURCE_DIR, TempDirTestCase, run

MAN_DIR = os.path.join(SOURCE_DIR, "docs", "man")
# Flags of other programs an example uses (systemctl enable --now).
OTHER_PROGRAMS_FLAGS = {"--now"}


def page_text(name):
    """The page's roff source with roff's escaped minus signs as plain '-' and without
    font changes (\\fB, \\fI, \\fR, \\fP)."""
    with open(os.path.join(MAN_DIR, name), encoding="utf-8") as f:
        return re.sub(r"\\f[BIRP]", "", f.read()).replace("\\-", "-")


def long_flags(text):
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", text))


def mentions(text, flag):
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


class ManPagesTest(TempDirTestCase):
    def test_pages_format_without_warnings(self):
        groff = shutil.which("groff")
        if groff is None:
            self.skipTest("groff is not installed (Debian package groff-base)")
        for name in ("steptrace.1", "steptraced.8"):
            with self.subTest(name):
                result = run([groff, "-man", "-ww", "-z", "-Tutf8",
                              os.path.join(MAN_DIR, name)], env={"LC_ALL": "C.UTF-8"})
                self.assertEqual(result.returncode, 0, result.stderr)
                self.assertEqual(result.stderr, "")

    def test_title_lines_name_the_page_and_section(self):
        self.assertRegex(page_text("steptrace.1"), r"(?m)^\.TH STEPTRACE 1 ")
        self.assertRegex(page_text("steptraced.8"), r"(?m)^\.TH STEPTRACED 8 ")

    def test_steptrace_page_describes_every_subcommand_and_flag(self):
        text = page_text("steptrace.1")
        for flag in cli_global_flags(self):
            self.assertTrue(mentions(text, flag), flag)
        known = set(cli_global_flags(self))
        for sub in subcommands(self):
            # Each subcommand is a tagged paragraph of SUBCOMMANDS: ".B name ...".
            self.assertRegex(text, rf"(?m)^\.B {re.escape(sub)}(\s|$)", sub)
            for flag in cli_flags(self, sub):
                self.assertTrue(mentions(text, flag), f"{sub} {flag}")
            known |= cli_flags(self, sub)
        for flag in cli_flags(self, "trace merge"):  # a nested subcommand's own flags
            self.assertTrue(mentions(text, flag), f"trace merge {flag}")
            known.add(flag)
        self.assertEqual(long_flags(text) - known - OTHER_PROGRAMS_FLAGS, set())

    def test_steptraced_page_describes_every_flag(self):
        text = page_text("steptraced.8")
        flags = daemon_flags(self)
        for flag in flags:
            self.assertTrue(mentions(text, flag), flag)
        self.assertEqual(long_flags(text) - flags - OTHER_PROGRAMS_FLAGS, set())


if __name__ == "__main__":
    unittest.main()
