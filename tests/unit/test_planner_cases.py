"""Golden planner cases: tests/cases/NAME/{fleet.yaml, observed.yaml} → expected.yaml.
Regenerate with FLEET_UPDATE_GOLDEN=1 after a deliberate change, and read the diff."""

from __future__ import annotations

import os
from pathlib import Path

from typing import Any

import pytest
import yaml

from reconciler.cli.render import pipeline_line
from tests.golden import CASES, render_lines, run_case

ALL = sorted(p for p in CASES.iterdir() if (p / "fleet.yaml").exists())


def test_there_are_enough_cases() -> None:
    assert len(ALL) >= 30


def lines(case: Path) -> dict[str, Any]:
    """The plan's lines, and each pipeline group it starts (rendezvous, stages, group id) once."""
    p = run_case(case)
    actual = render_lines(p)
    groups = list(dict.fromkeys(line for c in p.changes if (line := pipeline_line(c.details)) is not None))
    if groups:
        actual["pipelines"] = groups
    return actual


@pytest.mark.parametrize("case", ALL, ids=[p.name for p in ALL])
def test_case(case: Path) -> None:
    actual = lines(case)
    expected_file = case / "expected.yaml"
    if os.environ.get("FLEET_UPDATE_GOLDEN"):
        expected_file.write_text(yaml.safe_dump(actual, sort_keys=False, width=200, allow_unicode=True))
    assert expected_file.exists(), f"{case.name}: no expected.yaml (run with FLEET_UPDATE_GOLDEN=1, then review)"
    assert actual == yaml.safe_load(expected_file.read_text())


def test_planner_is_deterministic() -> None:
    for case in ALL[:5]:
        assert run_case(case) == run_case(case)


def test_the_plan_text_names_each_pipeline_group_once_above_its_stages() -> None:
    from rich.console import Console

    from reconciler.cli.render import print_plan

    out = Console(record=True, width=250, color_system=None)
    print_plan(out, run_case(CASES / "pipeline-stage-failed"))
    text = out.export_text().splitlines()
    header = next(i for i, line in enumerate(text) if "pipeline big:" in line)
    assert text[header].strip().startswith("pipeline big: 2 stages (a 0-2, b 3-5), rendezvous 10.0.0.2:9103, group ")
    assert "its stages start together" in text[header]
    assert sum("pipeline big:" in line for line in text) == 1
    assert "~ replace server.big@a" in text[header + 1]
    assert "restarts with its group: stage 1 on b failed: killed by signal 9 (SIGKILL)" in text[header + 2]


def test_a_pipeline_short_of_the_models_last_layer_is_refused_at_plan_time() -> None:
    """fleet.yaml need not say how many layers a model has: the plan checks the stages against the
    manifest the source reports."""
    from dataclasses import replace

    from reconciler.fleetfile import config
    from reconciler.core.observed import from_snapshot
    from reconciler.planning.planner import plan
    from tests.golden import snapshot

    case = CASES / "pipeline-new-two-stages"
    loaded = config.load(case / "fleet.yaml")
    assert loaded.desired is not None and loaded.document is not None
    snap = snapshot(loaded.document.data, yaml.safe_load((case / "observed.yaml").read_text()))
    (digest,) = snap["manifests"]
    snap["manifests"][digest]["layers"] = 7  # one more than the stages cover
    models = {n: replace(m, layers=None) for n, m in loaded.desired.models.items()}
    p = plan(replace(loaded.desired, models=models), from_snapshot(snap))
    assert [(d.code, d.address) for d in p.diagnostics] == [("pipeline_layers_gap", "server.big@b")]
    assert "end at layer 5, but 'big' has 7 layers (0-6)" in p.diagnostics[0].summary
    assert not any(c.action.value == "start" for c in p.changes)
