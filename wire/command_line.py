"""The command-line contract `fleet` and `fleet-agent` both keep: one table of exit codes, usage
errors with a code of their own (the subcommand's usage and a hint), and one help format.

Pure: a usage error is raised as a value (UsageError); each command prints it its own way (as text,
or as a JSON document when --json was asked for)."""

from __future__ import annotations

import argparse
import difflib
import re
import textwrap
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NoReturn, Sequence


class Exit(IntEnum):
    """Part of the interface: never renumbered. 64 is sysexits.h's EX_USAGE: not 2, which argparse
    uses for usage errors and `plan --detailed-exitcode` for "changes present"."""

    OK = 0
    FAILURE = 1
    CHANGES = 2
    INVALID_CONFIG = 3
    PLAN_REFUSED = 4
    LOCKED = 5
    STALE_PLAN = 6
    APPLY_FAILED = 7
    CANCELLED = 8
    USAGE = 64
    INTERRUPTED = 130


EVERY = "every command"


@dataclass(frozen=True, slots=True)
class ExitRow:
    code: Exit
    short: str  # for a subcommand's epilog
    meaning: str  # for the full table (README, `fleet --help`)
    commands: tuple[str, ...]  # who may end with it: "plan", "apply", "fleet-agent", or EVERY


EXIT_TABLE = (
    ExitRow(Exit.OK, "success", "success; for `plan`, no changes", (EVERY,)),
    ExitRow(Exit.FAILURE, "unexpected failure", "unexpected failure: a bug (the message says so), or an "
            "error with no better code", (EVERY,)),
    ExitRow(Exit.CHANGES, "changes present (--detailed-exitcode)",
            "`plan --detailed-exitcode`: success, changes present", ("plan",)),
    ExitRow(Exit.INVALID_CONFIG, "invalid input or environment", "invalid input or environment, said why, "
            "nothing done: the fleet file (what `validate` finds), a saved plan that cannot be read or is no "
            "valid plan (its schema, nodes, dependencies), a snapshot that cannot be read, FLEET_CLUSTER_SECRET, an address in use; `fleet-agent` refusing to start, `doctor` finding "
            "an error", (EVERY,)),
    ExitRow(Exit.PLAN_REFUSED, "plan refused", "plan refused: at least one plan error (an unreachable node, "
            "something that is not a fleet agent, GGUF served off the control plane, ...)", ("plan", "apply")),
    ExitRow(Exit.LOCKED, "the apply lock is held", "another apply holds the lock (`unlock`: by another id)",
            ("apply", "unlock")),
    ExitRow(Exit.STALE_PLAN, "saved plan is stale", "the saved plan is stale: the fleet file or a node it "
            "touches changed since, or a fresh plan's changes differ from it", ("apply",)),
    ExitRow(Exit.APPLY_FAILED, "some actions failed", "apply ran and some actions failed; running it again "
            "converges", ("apply",)),
    ExitRow(Exit.CANCELLED, "cancelled at the prompt", "cancelled at the prompt: any answer but `yes`, or "
            "the input closed (Ctrl-D); nothing changed", ("apply",)),
    ExitRow(Exit.USAGE, "usage error", "usage error: no command, an unknown command or option, a bad value; "
            "`apply` with no terminal to confirm on and no `--auto-approve`", (EVERY,)),
    ExitRow(Exit.INTERRUPTED, "interrupted", "interrupted (Ctrl-C)", (EVERY,)),
)


def exit_codes_epilog(command: str | None = None, *, rows: Sequence[ExitRow] = EXIT_TABLE,
                      full: str = "") -> str:
    """The exit codes for a --help epilog: the whole table (command None), or the codes `command`
    may end with, in short, and where the whole table is."""
    mine = [r for r in rows if command is None or EVERY in r.commands or command in r.commands]
    width = max(len(str(int(r.code))) for r in mine)
    title = ("exit codes (the same for every command):" if command is None
             else "exit codes" + (f" (in full: {full})" if full else "") + ":")
    return title + "\n" + "\n".join(
        f"  {int(r.code):>{width}}  {(r.meaning if command is None else r.short).replace('`', '')}" for r in mine)


class UsageError(Exception):
    """The command line is wrong. `usage` is the usage of the (sub)command that was being parsed."""

    def __init__(self, prog: str, usage: str, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.prog, self.usage, self.message, self.hint = prog, usage, message, hint

    def text(self) -> str:
        return f"{self.usage.rstrip()}\n{self.prog}: error: {self.message}\n" + (
            f"  hint: {self.hint}\n" if self.hint else "")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """One way for every help text: prose wrapped to the terminal (at most 100 columns), indented
    lines (examples, tables) kept as written, and every default written "(default: X)"."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)
        # argparse sizes help to the terminal; past 100 columns prose gets hard to read.
        self._width = min(self._width, 98)
        self._max_help_position = min(30, max(self._width - 20, 4))

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        out: list[str] = []
        prose: list[str] = []

        def flush() -> None:
            if prose:
                out.extend(textwrap.wrap(" ".join(prose), width, initial_indent=indent,
                                         subsequent_indent=indent) or [""])
                prose.clear()

        for line in text.splitlines():
            if not line.strip():
                flush()
                out.append("")
            elif line[0].isspace():
                flush()
                # A table row or an example: kept as written, a long one wrapped under its second column.
                hang = re.match(r"\s*\S+\s+", line)
                out.extend(textwrap.wrap(indent + line, width, subsequent_indent=indent + " " * (
                    hang.end() if hang else 0), break_on_hyphens=False) or [""])
            else:
                prose.append(line.strip())
        flush()
        return "\n".join(out)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        default = action.default
        if ("(default" in help or default is None or default is False or default == []
                or default is argparse.SUPPRESS or action.nargs == 0):
            return help
        return help + " (default: %(default)s)"


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def _hint(parser: argparse.ArgumentParser, message: str, extra: Sequence[str] = ()) -> str:
    """A way out of a usage error: the long option a one-dash spelling meant (Terraform's
    `-detailed-exitcode`), or the nearest known option or choice to a typo."""
    for token in extra:
        name = token.split("=", 1)[0]
        if name.startswith("-") and not name.startswith("--") and "-" + name in _options(parser):
            return f"long options take two dashes: -{name}"
        if name.startswith("--"):
            close = difflib.get_close_matches(name, _options(parser), n=1, cutoff=0.6)
            if close:
                return f"did you mean {close[0]}?"
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
    if choice:
        options = [c.strip().strip("'") for c in choice.group(2).split(",")]
        close = difflib.get_close_matches(choice.group(1), options, n=1, cutoff=0.5)
        if close:
            return f"did you mean {close[0]!r}?"
    return ""


class Parser(argparse.ArgumentParser):
    """argparse with the contract: a usage error raises UsageError (exit 64, printed by the caller)
    with the usage of the subcommand being parsed; no abbreviations (an abbreviation that works today
    breaks the day an option sharing its prefix is added, under a script that used it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str, extra: Sequence[str] = ()) -> NoReturn:
        raise UsageError(self.prog, self.format_usage(), message, _hint(self, message, extra))

    def chosen(self, args: argparse.Namespace) -> argparse.ArgumentParser:
        """The subcommand's parser that parsed `args` (this one when there is none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                name = getattr(args, action.dest, None)
                if name is not None:
                    parser: argparse.ArgumentParser = action.choices[name]
                    return parser
        return self

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            # argparse reports a subcommand's unknown arguments from the top level, with the top
            # level's usage: report them from the subcommand that did not know them.
            sub = self.chosen(parsed)
            message = f"unrecognized arguments: {' '.join(extra)}"
            if isinstance(sub, Parser):
                sub.error(message, extra)
            self.error(message, extra)
        return parsed


JSON_FORMAT_VERSION = "1.0"


def error_document(command: str, exit: int, code: str, message: str, hint: str = "",
                   diagnostics: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What a command asked for JSON prints when it cannot do its job (schemas/error.schema.json):
    the same for both commands and every failure, usage errors included."""
    return {"format_version": JSON_FORMAT_VERSION, "command": command, "exit_code": int(exit),
            "error": {"code": code, "message": message, "hint": hint}, "diagnostics": list(diagnostics)}


def json_asked(argv: Sequence[str]) -> bool:
    """Whether a command line asks for JSON, read before (or without) parsing it: a usage error
    must still answer in JSON to a caller that asked for JSON."""
    return "--json" in (argv[:list(argv).index("--")] if "--" in argv else argv)
