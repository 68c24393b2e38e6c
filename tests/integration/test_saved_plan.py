"""A saved plan is tied to its contents, against real agents on loopback: `fleet apply PLANFILE` runs
it only if a fresh plan has exactly its changes (an edited action is stale, exit 6, and says what
differs), and a file that is no plan for this fleet (a self-dependency, an undeclared node, a missing
digest, changes that are not a list) is refused with a coded error before the apply lock is taken."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

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
    digests: dict[str, str]  # q, r: fake GGUF models held by cp

    def fleet(self, *args: str, state: str = "state", timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleet_bin(), *args, "-f", str(self.file)], capture_output=True, text=True,
                              timeout=timeout, env=agent_env(FLEET_STATE_DIR=str(self.base / state)),
                              stdin=subprocess.DEVNULL)

    def held(self, node: str) -> list[str]:
        return [w["digest"] for w in self.agents[node].get("/v1/state").json()["weights"]]

    def saved(self, name: str) -> tuple[Path, dict[str, Any]]:
        """A plan saved by `fleet plan -o`, and its JSON to edit."""
        path = self.base / name
        made = self.fleet("plan", "-o", str(path))
        assert made.returncode == 0, made.stderr
        return path, json.loads(path.read_text())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    base = tmp_path_factory.mktemp("saved-plan")
    port = free_port("127.0.0.2", "127.0.0.3")
    agents = {n: Agent(n, addr, port, base / n) for n, addr in (("cp", "127.0.0.2"), ("a", "127.0.0.3"))}
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda a: a.start(), agents.values()))
        digests = {}
        for name in ("q", "r"):
            fake = base / f"{name}.gguf"
            fake.write_bytes(random_gguf(4100))  # a valid GGUF of random bytes: enough to plan with
            digests[name] = import_model(agents["cp"], fake)
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        file = base / "fleet.yaml"
        file.write_text(f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n{nodes}\nmodels:\n"
                        + "".join(f'  {m}: {{format: gguf, digest: "{d}", source: cp}}\n' for m, d in digests.items())
                        + "replicas:\n  q: [cp, a]\n  r: [cp]\nclusters: {}\n")
        yield World(base, file, agents, digests)
    finally:
        for a in agents.values():
            a.stop()


def test_an_injected_delete_is_stale_and_nothing_is_deleted(world: World) -> None:
    path, plan = world.saved("inject.json")
    assert [c["address"] for c in plan["changes"]] == ["replica.q@a"]
    plan["changes"].append({"action": "delete", "address": "replica.q@cp", "node": "cp", "reason": "cleanup",
                            "depends_on": [], "details": {"digest": world.digests["q"]}, "drift": True})
    path.write_text(json.dumps(plan))
    applied = world.fleet("apply", str(path))
    assert applied.returncode == Exit.STALE_PLAN, applied.stdout + applied.stderr
    assert "change delete replica.q@cp in the saved plan is not in a fresh plan" in applied.stderr
    as_json = world.fleet("apply", str(path), "--json")
    assert as_json.returncode == Exit.STALE_PLAN
    document = json.loads(as_json.stdout)
    assert document["error"]["code"] == "stale_plan"
    assert [(d["code"], d["address"]) for d in document["diagnostics"]] == [("stale_plan", "replica.q@cp")]
    assert world.digests["q"] in world.held("cp")  # the weights are still there
    assert world.digests["q"] not in world.held("a")  # and nothing else of the plan ran


def test_an_edited_digest_is_stale_and_says_which_field(world: World) -> None:
    path, plan = world.saved("digest.json")
    plan["changes"][0]["details"]["digest"] = world.digests["r"]  # fetch another model than the plan showed
    path.write_text(json.dumps(plan))
    applied = world.fleet("apply", str(path), "--json")
    assert applied.returncode == Exit.STALE_PLAN, applied.stdout + applied.stderr
    [diag] = json.loads(applied.stdout)["diagnostics"]
    assert diag["address"] == "replica.q@a" and "details.digest differs" in diag["summary"]
    assert world.digests["r"] in diag["summary"] and world.digests["q"] in diag["summary"]
    assert world.held("a") == []


INVALID = [
    ("self-dependency", lambda p: p["changes"][0]["depends_on"].append(p["changes"][0]["address"]),
     "dependency_cycle", "changes[0].depends_on[0]"),
    ("undeclared-node", lambda p: p["changes"][0].update(node="gpu-z"), "unknown_node", "changes[0].node"),
    ("undeclared-peer", lambda p: p["changes"][0]["details"].update(peer="gpu-z"), "unknown_node",
     "changes[0].details.peer"),
    ("missing-digest", lambda p: p["changes"][0]["details"].pop("digest"), "schema_violation", "changes[0].details"),
    ("changes-not-a-list", lambda p: p.update(changes="x"), "schema_violation", "changes"),
    ("unknown-dependency", lambda p: p["changes"][0]["depends_on"].append("server.nope@a"), "unknown_dependency",
     "changes[0].depends_on[0]"),
]


@pytest.mark.parametrize("name,change,code,address", INVALID, ids=[i[0] for i in INVALID])
def test_a_file_that_is_no_plan_is_refused_before_the_lock(world: World, name: str,
                                                          change: Callable[[dict[str, Any]], None], code: str,
                                                          address: str) -> None:
    path, plan = world.saved(f"{name}.json")
    change(plan)
    path.write_text(json.dumps(plan))
    # Another apply holds the lock: refused before taking it, the answer is the plan's, not "locked".
    with StateStore(world.base / f"locked-{name}") as store:
        store.applies.acquire("fleet apply (held by the test)")
        began = time.monotonic()
        applied = world.fleet("apply", str(path), "--json", state=f"locked-{name}", timeout=60)
        took = time.monotonic() - began
    assert applied.returncode == Exit.INVALID_CONFIG, applied.stdout + applied.stderr
    assert "internal error" not in applied.stderr and "Traceback" not in applied.stderr
    document = json.loads(applied.stdout)
    assert document["error"]["code"] == "invalid_plan"
    assert (code, address) in [(d["code"], d["address"]) for d in document["diagnostics"]], document
    assert took < 20, f"took {took:.1f}s"
    text = world.fleet("apply", str(path))  # for people: the code and the place, on stderr
    assert text.returncode == Exit.INVALID_CONFIG and f"[{code}]" in text.stderr and address in text.stderr
    assert world.held("a") == []


def test_a_dependency_cycle_is_named_change_by_change(world: World) -> None:
    path, plan = world.saved("cycle.json")
    plan["changes"].append({"action": "replicate", "address": "replica.r@a", "node": "a", "reason": "",
                            "depends_on": ["replica.q@a"], "drift": False,
                            "details": {**plan["changes"][0]["details"], "digest": world.digests["r"]}})
    plan["changes"][0]["depends_on"] = ["replica.r@a"]
    path.write_text(json.dumps(plan))
    applied = world.fleet("apply", str(path), timeout=60)
    assert applied.returncode == Exit.INVALID_CONFIG, applied.stdout + applied.stderr
    assert "[dependency_cycle]" in applied.stderr
    assert "replica.q@a → replica.r@a → replica.q@a" in applied.stderr


def test_the_saved_plan_as_made_applies(world: World) -> None:
    path, _ = world.saved("as-made.json")
    applied = world.fleet("apply", str(path))
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert world.digests["q"] in world.held("a") and world.digests["q"] in world.held("cp")
