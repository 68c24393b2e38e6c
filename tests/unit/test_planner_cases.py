"""Golden planner cases: tests/cases/NAME/{fleet.yaml, observed.yaml} → expected.yaml.
Regenerate with FLEET_UPDATE_GOLDEN=1 after a deliberate change, and read the diff."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from tests.golden import CASES, render_lines, run_case

ALL = sorted(p for p in CASES.iterdir() if (p / "fleet.yaml").exists())


def test_there_are_enough_cases() -> None:
    assert len(ALL) >= 30


@pytest.mark.parametrize("case", ALL, ids=[p.name for p in ALL])
def test_case(case: Path) -> None:
    actual = render_lines(run_case(case))
    expected_file = case / "expected.yaml"
    if os.environ.get("FLEET_UPDATE_GOLDEN"):
        expected_file.write_text(yaml.safe_dump(actual, sort_keys=False, width=200, allow_unicode=True))
    assert expected_file.exists(), f"{case.name}: no expected.yaml (run with FLEET_UPDATE_GOLDEN=1, then review)"
    assert actual == yaml.safe_load(expected_file.read_text())


def test_planner_is_deterministic() -> None:
    for case in ALL[:5]:
        assert run_case(case) == run_case(case)
