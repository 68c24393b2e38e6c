"""The plan's JSON twin: valid against schemas/plan.schema.json and a lossless round trip, written by
`fleet plan --json` and `-o` (commands.plan_json) as the same JSON as json.dumps gives, indented to its
second level with each change on a line of its own."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from reconciler.cli.commands import plan_json
from reconciler.core.diagnostics import warning
from reconciler.planning.plan import Action, Change, Plan
from reconciler.schemas import load_schema
from tests.golden import CASES, run_case

CASE_DIRS = sorted(p for p in CASES.iterdir() if (p / "fleet.yaml").exists())


def a_plan(n: int) -> Plan:
    changes = tuple(Change(Action.START, f"clusters.c.n{i}", f"n{i}", "not running\nat all \u2713 \"quoted\"",
                           (f"replicas.m.n{i}",), {"settings": {"context_length": 4096, "nested": [1, {"a": None}]}})
                    for i in range(n))
    return Plan(changes, (warning("w", "a warning", "line one\nline two", "nodes.n0"),), "sha256:ab", "fleet.yaml",
                {f"n{i}": f"sha256:{i}" for i in range(n)}, ("clusters.c",))


def test_plan_schema_is_valid() -> None:
    Draft202012Validator.check_schema(load_schema("plan.schema.json"))


@pytest.mark.parametrize("case", CASE_DIRS, ids=[p.name for p in CASE_DIRS])
def test_plan_json_validates_and_round_trips(case: Path) -> None:
    plan = run_case(case)
    data = json.loads(plan_json(plan.to_json()))  # as fleet plan --json and -o write it
    errors = list(Draft202012Validator(load_schema("plan.schema.json")).iter_errors(data))
    assert errors == []
    assert Plan.from_json(data) == plan
    assert data["summary"] == {a: sum(1 for c in data["changes"] if c["action"] == a)
                               for a in ("replicate", "start", "replace", "stop", "delete")}


@pytest.mark.parametrize("n", [0, 1, 3])
def test_the_same_document_as_json_gives(n: int) -> None:
    document = a_plan(n).to_json()
    assert json.loads(plan_json(document)) == json.loads(json.dumps(document))


@pytest.mark.parametrize("document", [{}, {"a": []}, {"a": {}}, {"a": [[]], "b": {"c": {}}}, {"a": "x\ny", "b": None}],
                         ids=["empty", "empty-list", "empty-dict", "nested-empties", "scalars"])
def test_edges(document: dict[str, Any]) -> None:
    assert json.loads(plan_json(document)) == document


def test_each_change_on_a_line_of_its_own() -> None:
    document = a_plan(5).to_json()
    lines = plan_json(document).splitlines()
    for change in document["changes"]:
        assert f"    {json.dumps(change)}," in lines or f"    {json.dumps(change)}" in lines
    assert lines[0] == "{" and lines[-1] == "}" and '  "format_version": "1.0",' in lines
