"""Help like the tools people know: every command of `fleet` and `fleet-agent` and every option
described, defaults written one way ("(default: X)"), lines wrapped to one width; and the exit codes
the same in the README's table, in `--help` and in the code."""

from __future__ import annotations

import argparse
import re

import pytest

from agent import cli as agent_cli
from reconciler.cli import main as fleet_cli
from reconciler.cli.exitcodes import EXIT_TABLE, Exit
from tests.conftest import ROOT

PARSERS = {"fleet": fleet_cli.build_parser, "fleet-agent": agent_cli.build_parser}


def subcommands(parser: argparse.ArgumentParser) -> tuple[argparse._SubParsersAction, dict[str, str]]:  # type: ignore[type-arg]
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action, {c.dest: c.help or "" for c in action._choices_actions}


COMMANDS = [(prog, None) for prog in PARSERS] + [
    (prog, name) for prog, build in PARSERS.items() for name in subcommands(build())[0].choices]


def help_text(prog: str, command: str | None, capsys: pytest.CaptureFixture[str]) -> str:
    argv = ([command] if command else []) + ["--help"]
    with pytest.raises(SystemExit) as ended:
        PARSERS[prog]().parse_args(argv)
    assert ended.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("prog, command", COMMANDS, ids=[f"{p} {c or ''}".strip() for p, c in COMMANDS])
def test_every_command_and_option_is_described(prog: str, command: str | None, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    top = PARSERS[prog]()
    parser = subcommands(top)[0].choices[command] if command else top
    if command:
        assert subcommands(top)[1][command].strip(), f"{prog} {command}: no summary in `{prog} --help`"
    assert (parser.description or "").strip(), f"{prog} {command}: no description"
    text = help_text(prog, command, capsys)
    flat = " ".join(text.split())
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            continue
        name = "/".join(action.option_strings) or action.dest
        assert action.help and action.help is not argparse.SUPPRESS and action.help.strip(), \
            f"`{prog} {command or ''} --help`: {name} has no description"
        assert " ".join(action.help.split())[:30] in flat, f"{name}'s description is not in the help"
        if action.default not in (None, False, [], argparse.SUPPRESS) and action.nargs != 0:
            assert f"(default: {action.default})" in flat, f"{name}: its default is not written (default: X)"
    for word in re.finditer(r"default", flat, re.IGNORECASE):  # one way: "(default: X)"
        assert flat[word.start() - 1:word.end() + 2] == "(default: ", flat[word.start() - 40:word.end() + 20]
    assert "exit codes" in text


@pytest.mark.parametrize("columns, width", [("200", 98), ("80", 78)])
def test_help_is_wrapped_to_the_terminal_and_at_most_100_columns(columns: str, width: int,
                                                                 capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", columns)
    for prog, command in COMMANDS:
        for line in help_text(prog, command, capsys).splitlines():
            # argparse keeps an option's invocation whole; everything else fits.
            assert len(line) <= width or line.strip().startswith("-"), f"{prog} {command}: {line!r}"


def test_the_readme_table_is_the_contract() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", section, re.MULTILINE)
    assert [(int(code), meaning) for code, meaning in rows] == [(int(r.code), r.meaning) for r in EXIT_TABLE]
    assert set(Exit) == {r.code for r in EXIT_TABLE}


def test_the_usage_code_is_none_that_argparse_or_plan_use() -> None:
    assert int(Exit.USAGE) not in (0, 1, 2) and int(Exit.USAGE) == 64  # sysexits.h EX_USAGE
    assert len(set(Exit)) == len(list(Exit))
    assert agent_cli.EXIT_REFUSED == Exit.INVALID_CONFIG
