"""The bash completion of steptrace and steptraced (config/completion/steptrace.bash):
it loads with plain bash (no bash-completion needed), and offers exactly the
subcommands and flags the real binaries' help shows, file names after -o/--output,
--socket and --config, directories after --state-dir."""
import os
import unittest

from help_text import (cli_flags, cli_global_flags, daemon_choices, daemon_flags, subcommands)
from packaging_util import SOURCE_DIR, TempDirTestCase, run, tool

COMPLETION = os.path.join(SOURCE_DIR, "config", "completion", "steptrace.bash")

# Sources the completion, sets COMP_WORDS to the arguments (the last one the word being
# completed), calls the function `complete -p` names for the command, prints COMPREPLY.
_DRIVER = r'''
source "$COMPLETION" || exit 3
COMP_WORDS=("$@")
COMP_CWORD=$(($# - 1))
COMP_LINE="$*"
COMP_POINT=${#COMP_LINE}
spec=$(complete -p "$1") || exit 4
fn=${spec#*-F }
fn=${fn%% *}
"$fn" "$1" "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}"
printf '%s\n' "${COMPREPLY[@]}"
'''


class CompletionTest(TempDirTestCase):
    def setUp(self):
        super().setUp()
        self.bash = tool("bash", "bash")

    def complete(self, *words):
        """The completions bash would offer for `words` (the last one being completed)."""
        result = run([self.bash, "--norc", "--noprofile", "-c", _DRIVER, "bash", *words],
                     env={"COMPLETION": COMPLETION}, cwd=self.tmp)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr, "")
        return {w for w in result.stdout.splitlines() if w}

    def test_sourcing_registers_both_commands_without_bash_completion(self):
        result = run([self.bash, "--norc", "--noprofile", "-c",
                      f'source "{COMPLETION}" && complete -p steptrace && complete -p steptraced'])
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stderr, "")
        self.assertIn("complete -F _steptrace steptrace\n", result.stdout)
        self.assertIn("complete -F _steptraced steptraced\n", result.stdout)

    def test_subcommands_are_those_of_steptrace_help(self):
        names = set(subcommands(self))
        self.assertEqual(self.complete("steptrace", ""), names)
        self.assertEqual(self.complete("steptrace", "--socket", "/x.sock", ""), names)
        self.assertEqual(self.complete("steptrace", "--timeout", "=", "3", ""), names)
        self.assertEqual(self.complete("steptrace", "re"), {n for n in names if n.startswith("re")})
        self.assertEqual(self.complete("steptrace", "help", ""), names)
        # `help ledger cleanup` describes the nested one: offered after `help ledger`.
        self.assertEqual(self.complete("steptrace", "help", "ledger", ""), {"cleanup"})
        self.assertEqual(self.complete("steptrace", "help", "report", ""), set())

    def test_global_flags_are_those_of_steptrace_help(self):
        self.assertEqual(self.complete("steptrace", "--"),
                         {f for f in cli_global_flags(self) if f.startswith("--")})

    def test_each_subcommand_offers_its_flags_and_the_global_ones(self):
        global_flags = cli_global_flags(self) - {"-h"}
        for sub in subcommands(self):
            with self.subTest(sub):
                self.assertEqual(self.complete("steptrace", sub, "-"),
                                 (cli_flags(self, sub) | global_flags) - {"-h"})

    def test_file_names_after_output_socket_and_config(self):
        for name in ("trace-a.json", "trace-b.json", "other.txt"):
            open(os.path.join(self.tmp, name), "w").close()
        os.mkdir(os.path.join(self.tmp, "trace-dir"))
        files = {"trace-a.json", "trace-b.json", "trace-dir"}
        self.assertEqual(self.complete("steptrace", "trace", "-o", "trace-"), files)
        self.assertEqual(self.complete("steptrace", "trace", "--output", "=", "trace-"), files)
        self.assertEqual(self.complete("steptrace", "--socket", "trace-"), files)
        self.assertEqual(self.complete("steptraced", "--config", "trace-"), files)
        self.assertEqual(self.complete("steptraced", "--state-dir", "trace-"), {"trace-dir"})
        self.assertEqual(self.complete("steptrace", "report", "--pid", ""), set())

    def test_steptraced_flags_and_values_are_those_of_its_help(self):
        self.assertEqual(self.complete("steptraced", "-"), daemon_flags(self) - {"-h"})
        self.assertEqual(self.complete("steptraced", "--log-level", ""),
                         daemon_choices(self, "--log-level"))
        self.assertEqual(self.complete("steptraced", "--nvml", "=", ""),
                         daemon_choices(self, "--nvml"))


if __name__ == "__main__":
    unittest.main()
