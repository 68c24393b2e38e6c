"""What a replication will cost: per node the bytes it receives and how long at the rate it measured
from the peer ("no measurement yet" without one), and the plan error when that ends after the node's
availability window closes (golden cases replicate-estimated, replicate-exceeds-*-window)."""

from __future__ import annotations

from pathlib import Path

from jsonschema import Draft202012Validator
import json

from reconciler.planning.notes import receive_lines
from reconciler.planning.plan import Plan
from tests.golden import run_case

CASES = Path(__file__).parent.parent / "cases"
PLAN_SCHEMA = json.loads((Path(__file__).parent.parent.parent / "schemas" / "plan.schema.json").read_text())


def estimate(plan: Plan, address: str = "replica.llama@gpu-a") -> dict[str, object]:
    [change] = [c for c in plan.changes if c.address == address]
    return dict(change.details["estimate"])


def test_a_measured_link_gives_bytes_and_seconds_per_node() -> None:
    plan = run_case(CASES / "replicate-estimated")
    assert estimate(plan) == {"node_bytes": 1073741824, "seconds": 10.7, "bytes_per_s": 100000000, "samples": 3}
    assert receive_lines(plan.changes) == ["gpu-a receives 1,073,741,824 bytes: ~11 s at 100.0 MB/s from cp"]
    Draft202012Validator(PLAN_SCHEMA).validate(plan.to_json())
    assert Plan.from_json(plan.to_json()).changes == plan.changes  # the estimate round-trips


def test_no_measurement_yet_is_said_and_refuses_nothing() -> None:
    plan = run_case(CASES / "replicate-one")
    notes = [c.details["estimate"] for c in plan.changes if "estimate" in c.details]
    assert notes and all(n["seconds"] is None and n["bytes_per_s"] is None for n in notes)
    assert all("no measurement yet from cp" in line for line in receive_lines(plan.changes))
    Draft202012Validator(PLAN_SCHEMA).validate(plan.to_json())


def test_past_the_agents_window_is_refused_naming_window_and_estimate() -> None:
    plan = run_case(CASES / "replicate-exceeds-agent-window")
    [d] = [d for d in plan.diagnostics if d.code == "replication_exceeds_window"]
    assert d.is_error and d.address == "replica.llama@gpu-a"
    assert d.summary == ("fetching 1,073,741,824 bytes onto 'gpu-a' from 'cp' takes ~17 min 54 s at 1.0 MB/s "
                         "(measured), ending 07:07, after gpu-a's availability window (19:00-07:00, the agent's "
                         "own) closes at 07:00")


def test_past_the_config_window_is_refused_naming_it() -> None:
    plan = run_case(CASES / "replicate-exceeds-config-window")
    [d] = [d for d in plan.diagnostics if d.code == "replication_exceeds_window"]
    assert "(19:00-07:00, from fleet.yaml) closes at 07:00" in d.summary and "ending 07:12" in d.summary
