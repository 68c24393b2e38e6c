"""A saved plan file checked before it runs (reconciler/applying/planfile.py): every plan the planner makes
passes its schema and its checks and equals itself, and each kind of edited file is named by code
and JSON path; the real `fleet apply` on these is tests/integration/test_saved_plan.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Callable

import pytest

from reconciler.fleetfile import config
from reconciler.applying import planfile
from reconciler.planning.plan import Plan
from tests.golden import CASES, run_case

ALL = sorted(p for p in CASES.iterdir() if (p / "fleet.yaml").exists())


@pytest.mark.parametrize("case", ALL, ids=[p.name for p in ALL])
def test_every_golden_plan_is_a_valid_file_equal_to_itself(case: Path) -> None:
    made = run_case(case)
    data = json.loads(json.dumps(made.to_json()))  # as `fleet plan -o` writes it and apply reads it
    desired = config.load(case / "fleet.yaml").desired
    assert desired is not None
    # A refused plan is a valid file, but one never applied (issue 31): that is its one problem.
    assert [d.code for d in planfile.check(data, desired.nodes)] == (["plan_errored"] if made.errored else [])
    assert planfile.differences(Plan.from_json(data), made) == []


NODES = ("cp", "gpu-a", "gpu-b", "gpu-c")
DIGEST = "sha256:" + "9" * 64


def saved() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(json.dumps(run_case(CASES / "replicate-then-start").to_json()))
    return data


EDITS: list[tuple[str, Callable[[dict[str, Any]], Any], str, str]] = [
    ("changes-not-a-list", lambda p: p.update(changes="x"), "schema_violation", "changes"),
    ("no-digest", lambda p: p["changes"][0]["details"].pop("digest"), "schema_violation", "changes[0].details"),
    ("delete-without-digest", lambda p: p["changes"][-1].update(action="delete", details={}), "schema_violation",
     "changes[3].details"),
    ("extra-detail", lambda p: p["changes"][0]["details"].update(command="rm -rf /"), "schema_violation",
     "changes[0].details"),
    ("bytes-not-a-number", lambda p: p["changes"][0]["details"].update(bytes="many"), "schema_violation",
     "changes[0].details.bytes"),
    ("undeclared-node", lambda p: p["changes"][0].update(node="gpu-z"), "unknown_node", "changes[0].node"),
    ("undeclared-peer", lambda p: p["changes"][0]["details"].update(peer="gpu-z"), "unknown_node",
     "changes[0].details.peer"),
    ("self-dependency", lambda p: p["changes"][0]["depends_on"].append(p["changes"][0]["address"]),
     "dependency_cycle", "changes[0].depends_on[0]"),
    ("cycle", lambda p: p["changes"][0]["depends_on"].append(p["changes"][-1]["address"]), "dependency_cycle",
     "changes[0].depends_on"),
    ("unknown-dependency", lambda p: p["changes"][0]["depends_on"].append("server.x@cp"), "unknown_dependency",
     "changes[0].depends_on[0]"),
    ("twice", lambda p: p["changes"].append(copy.deepcopy(p["changes"][0])), "duplicate_change",
     "changes[4].address"),
]


@pytest.mark.parametrize("name,edit,code,address", EDITS, ids=[e[0] for e in EDITS])
def test_an_edited_file_is_named_by_code_and_place(name: str, edit: Callable[[dict[str, Any]], Any], code: str,
                                                   address: str) -> None:
    data = saved()
    edit(data)
    found = [(d.code, d.address) for d in planfile.check(data, NODES)]
    assert (code, address) in found, found


def test_a_cycle_is_named_change_by_change() -> None:
    data = saved()
    data["changes"][0]["depends_on"].append(data["changes"][-1]["address"])
    [diag] = planfile.check(data, NODES)
    # gpu-b's copy is chained from gpu-a's (reconciler/planning/fanout.py), the shortest way back
    assert diag.summary.endswith("replica.llama@gpu-a → server.chat@gpu-b → replica.llama@gpu-b → replica.llama@gpu-a")


def test_what_differs_from_a_fresh_plan_is_said_change_by_change() -> None:
    fresh = run_case(CASES / "replicate-then-start")
    data = saved()
    data["changes"][0]["details"]["digest"] = DIGEST
    data["changes"][3]["depends_on"] = ["replica.llama@gpu-b"]
    data["changes"].append({"action": "delete", "address": "replica.llama@cp", "node": "cp", "reason": "",
                            "depends_on": [], "details": {"digest": DIGEST}, "drift": True})
    removed = data["changes"].pop(2)
    said = [(d.code, d.address, d.summary) for d in planfile.differences(Plan.from_json(data), fresh)]
    assert [s[1] for s in said] == ["replica.llama@gpu-a", "server.chat@gpu-b", "replica.llama@cp", removed["address"]]
    assert {s[0] for s in said} == {"stale_plan"}
    assert said[0][2].startswith(f'change replica.llama@gpu-a: details.digest differs (saved "{DIGEST}", fresh "sha256:1111')
    assert "depends_on differs" in said[1][2]
    assert said[2][2] == "change delete replica.llama@cp in the saved plan is not in a fresh plan"
    assert said[3][2].startswith(f"a fresh plan has change {removed['action']} {removed['address']}, which the saved plan does not")


def test_the_same_changes_in_another_order_are_stale() -> None:
    fresh = run_case(CASES / "replicate-then-start")
    data = saved()
    data["changes"].reverse()
    [diag] = planfile.differences(Plan.from_json(data), fresh)
    assert "another order" in diag.summary


def test_an_integer_and_its_float_are_one_value() -> None:
    fresh = run_case(CASES / "replicate-then-start")
    data = saved()
    start = next(c for c in data["changes"] if c["action"] == "start")
    start["details"]["settings"]["startup_timeout_s"] = 300  # JSON makes no difference between 300 and 300.0
    assert planfile.differences(Plan.from_json(data), fresh) == []
