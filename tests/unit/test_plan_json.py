"""The plan's JSON twin: valid against schemas/plan.schema.json, and a lossless round trip."""

from __future__ import annotations

import json

import pytest
from jsonschema import Draft202012Validator

from reconciler.plan import Plan
from reconciler.schema import load_schema
from tests.golden import CASES, run_case

CASE_DIRS = sorted(p for p in CASES.iterdir() if (p / "fleet.yaml").exists())


def test_plan_schema_is_valid() -> None:
    Draft202012Validator.check_schema(load_schema("plan.schema.json"))


@pytest.mark.parametrize("case", CASE_DIRS, ids=[p.name for p in CASE_DIRS])
def test_plan_json_validates_and_round_trips(case) -> None:  # type: ignore[no-untyped-def]
    plan = run_case(case)
    data = json.loads(json.dumps(plan.to_json()))
    errors = list(Draft202012Validator(load_schema("plan.schema.json")).iter_errors(data))
    assert errors == []
    assert Plan.from_json(data) == plan
    assert data["summary"] == {a: sum(1 for c in data["changes"] if c["action"] == a)
                               for a in ("replicate", "start", "replace", "stop", "delete")}
