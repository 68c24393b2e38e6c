"""Saved plans a hostile or careless hand edited, against real agents on loopback (issue 31, item
10): a plan that was refused when it was made (`"errored": true`, or an error among its
diagnostics) is refused by `fleet apply PLANFILE` (exit 4, plan_errored) even when a fresh plan has
exactly its changes, and nothing runs; a long chain of changes ending in a cycle is named before
the lock. Before: the errored plan was applied (exit 0, the replica fetched). The chain's test
passed before too, only slower (the old check made a round a change: ~20 s for 3,000 on a busy
2-core machine); what fails before is the graph check's work, counted in
tests/unit/test_planfile_graph.py (and timed in bench/saved_plan.py)."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from reconciler.cli.exitcodes import Exit
from reconciler.state.store import StateStore
from tests.agents import Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.models import random_gguf

pytestmark = pytest.mark.e2e


@dataclass
class World:
    base: Path
    file: Path
    agents: dict[str, Agent]
    digest: str

    def fleet(self, *args: str, state: str = "state", timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleet_bin(), *args, "-f", str(self.file)], capture_output=True, text=True,
                              timeout=timeout, env=agent_env(FLEET_STATE_DIR=str(self.base / state)),
                              stdin=subprocess.DEVNULL)

    def held(self, node: str) -> list[str]:
        return [w["digest"] for w in self.agents[node].get("/v1/state").json()["weights"]]

    def saved(self, name: str) -> tuple[Path, dict[str, Any]]:
        path = self.base / name
        made = self.fleet("plan", "-o", str(path))
        assert made.returncode == 0, made.stderr
        return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("saved-plan-hostile")
    port = free_port("127.0.0.2", "127.0.0.3")
    agents = {n: Agent(n, addr, port, base / n) for n, addr in (("cp", "127.0.0.2"), ("a", "127.0.0.3"))}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda a: a.start(), agents.values()))
        fake = base / "q.gguf"
        fake.write_bytes(random_gguf(4100))  # a valid GGUF of random bytes: enough to plan with
        digest = import_model(agents["cp"], fake)
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        file = base / "fleet.yaml"
        file.write_text(f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n{nodes}\nmodels:\n"
                        f'  q: {{format: gguf, digest: "{digest}", source: cp}}\nreplicas:\n  q: [cp, a]\n')
        yield World(base, file, agents, digest)
    finally:
        for a in agents.values():
            a.stop()


def refused_as_errored(world: World, path: Path) -> dict[str, Any]:
    applied = world.fleet("apply", str(path), "--json")
    assert applied.returncode == Exit.PLAN_REFUSED, applied.stdout + applied.stderr
    assert "Traceback" not in applied.stderr and "internal error" not in applied.stderr
    document: dict[str, Any] = json.loads(applied.stdout)
    assert document["error"]["code"] == "plan_errored", document
    text = world.fleet("apply", str(path))  # for people: the code, on stderr
    assert text.returncode == Exit.PLAN_REFUSED and "[plan_errored]" in text.stderr, text.stderr
    assert world.held("a") == []  # nothing of the plan ran
    return document


def test_a_plan_marked_errored_is_refused_though_a_fresh_plan_has_its_changes(world: World) -> None:
    path, plan = world.saved("errored.json")
    assert [c["address"] for c in plan["changes"]] == ["replica.q@a"] and plan["errored"] is False
    plan["errored"] = True
    path.write_text(json.dumps(plan))
    document = refused_as_errored(world, path)
    assert [(d["code"], d["address"]) for d in document["diagnostics"]] == [("plan_errored", "errored")]


def test_a_plan_carrying_an_error_diagnostic_is_refused_though_it_says_not_errored(world: World) -> None:
    path, plan = world.saved("error-diagnostic.json")
    plan["diagnostics"].append({"severity": "error", "code": "llamacpp_remote_unsupported",
                                "summary": "GGUF served off the control plane", "detail": "", "address": "x",
                                "range": None})
    path.write_text(json.dumps(plan))
    document = refused_as_errored(world, path)
    (diag,) = document["diagnostics"]
    assert diag["address"] == "diagnostics" and "llamacpp_remote_unsupported" in diag["summary"], diag


def test_a_long_chain_that_closes_in_a_cycle_is_named_before_the_lock(world: World) -> None:
    path, plan = world.saved("chain.json")
    first = plan["changes"][0]
    n = 3000
    plan["changes"] = [{**first, "address": f"replica.m{i:04}@a", "details": {**first["details"], "model": f"m{i}"},
                        "depends_on": [f"replica.m{(i - 1) % n:04}@a"]} for i in range(n)]
    path.write_text(json.dumps(plan))
    with StateStore(world.base / "locked") as store:  # another apply holds the lock: the answer is the plan's
        store.applies.acquire("fleet apply (held by the test)")
        applied = world.fleet("apply", str(path), "--json", state="locked")
    assert applied.returncode == Exit.INVALID_CONFIG, applied.stdout[-2000:] + applied.stderr[-2000:]
    (diag,) = json.loads(applied.stdout)["diagnostics"]
    assert diag["code"] == "dependency_cycle" and diag["address"] == "changes[0].depends_on"
    assert diag["summary"].count(" → ") == n
    assert "replica.m0000@a → replica.m2999@a → replica.m2998@a" in diag["summary"]
    assert world.held("a") == []


def test_the_saved_plan_as_made_still_applies(world: World) -> None:
    path, _ = world.saved("as-made.json")
    applied = world.fleet("apply", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert world.digest in world.held("a")
