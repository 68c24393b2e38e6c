"""The fleet's last copy of a digest (reconciler/planning/order.py's guard), said in words: the plan
error names node, digest and both ways out; the opted-in delete is loud in its reason, its details
and a warning; the opt-in is checked like the rest of fleet.yaml. The golden cases last-copy-* and
delete-* hold the plans themselves; tests/integration/test_last_copy.py runs them on real agents."""

from __future__ import annotations

import json
from pathlib import Path

from reconciler.fleetfile import config
from reconciler.planning.plan import Plan
from tests.golden import CASES, run_case

FOREIGN = "sha256:" + "9" * 64


def test_the_last_copy_is_a_plan_error_naming_node_digest_and_the_ways_out() -> None:
    p = run_case(CASES / "delete-foreign-weights")
    assert p.errored
    [diag] = [d for d in p.diagnostics if d.code == "last_copy_delete"]
    assert diag.summary == (f"the plan would delete the fleet's last verified copy of {FOREIGN} "
                            "(replica.999999999999@gpu-a) from gpu-a")
    assert f"digest: {FOREIGN}, source: gpu-a" in diag.detail  # keep it: declare it
    assert f"list {FOREIGN} under `delete_last_copy`" in diag.detail  # or let it go
    assert "last_copy" not in p.changes[0].details


def test_each_of_two_copies_deleted_together_is_the_last() -> None:
    p = run_case(CASES / "last-copy-held-twice")
    said = [d.summary for d in p.diagnostics if d.code == "last_copy_delete"]
    assert said[0].endswith("from gpu-a; its copies on gpu-b are deleted by this plan too")
    assert said[1].endswith("from gpu-b; its copies on gpu-a are deleted by this plan too")


def test_the_opted_in_delete_is_loud_in_reason_details_warning_and_json() -> None:
    p = run_case(CASES / "last-copy-opted-in")
    assert not p.errored
    [change] = p.changes
    assert change.details == {"digest": FOREIGN, "last_copy": True}
    assert "LAST copy" in change.reason
    [diag] = [d for d in p.diagnostics if d.code == "last_copy_delete"]
    assert diag.severity.value == "warning" and diag.address == change.address
    assert "gpu-a deletes the fleet's last verified copy of " + FOREIGN in diag.summary
    saved = json.loads(json.dumps(p.to_json()))
    assert saved["changes"][0]["details"]["last_copy"] is True
    assert Plan.from_json(saved) == p  # a saved plan keeps it, and applies as made


def test_delete_last_copy_takes_digests_only(tmp_path: Path) -> None:
    text = (CASES / "last-copy-opted-in" / "fleet.yaml").read_text()
    loaded = config.load_text(text, "fleet.yaml")
    assert loaded.desired is not None and loaded.desired.delete_last_copy == frozenset({FOREIGN})
    bad = config.load_text(text.replace(f'"{FOREIGN}"', "llama"), "fleet.yaml")
    assert not bad.ok
    assert [(d.code, d.address) for d in bad.diagnostics] == [("schema_violation", "delete_last_copy[0]")]
