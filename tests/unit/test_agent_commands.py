"""fleet-agent's parser (agent/arguments.py) and its commands (agent/cli.py) are kept apart: every
command the parser offers has a function to run, and every function a command."""

from __future__ import annotations

import argparse

import pytest

from agent import cli
from agent.arguments import build_parser


def test_every_command_of_the_parser_runs_something_and_nothing_else_does() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(cli.COMMANDS)


def test_a_bare_fleet_agent_prints_the_help_with_the_usage_code(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.run([]) == 64
    assert "usage: fleet-agent" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["auto", "AUTO", " Auto "])
def test_piece_size_auto_in_any_case_leaves_the_size_to_each_file(text: str) -> None:
    assert cli._piece_size(text) is None


def test_a_piece_size_that_is_not_one_says_auto_is_the_other_choice() -> None:
    with pytest.raises(cli.CannotStart, match=r"--piece-size: .*, or auto$"):
        cli._piece_size("automatic")
    assert cli._piece_size("4MiB") == 4 << 20
