"""`fleet observe` (as plan and apply do) against a real fleet-agent process, keeping what it saw
in the cache of observed states (reconciler/cache/observed.py): the next run uses a held state only once
the agent confirms its generation, brought up to the agent's clock; a state that changed is asked
for whole; a damaged cache is ignored with a warning."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from reconciler.fleetfile import config
from reconciler.cache.observed import ObservationCache
from reconciler.core.observed import Observed, node_from_state
from tests.agents import Agent, agent_env, enroll, free_port
from tests.conftest import fleet_bin

pytestmark = pytest.mark.e2e
MARK = "held-by-the-cache"


# The agent's home on a tmpfs of its own, mounted in a user and mount namespace of the agent's
# (`unshare -rm`; the network is the machine's): its free space, which the state's generation
# counts in 256 MiB steps (agent/api/context.py), moves only with what this agent writes. On the
# machine's shared disk a whole-suite run wrote and deleted GBs beside it, and a step crossed
# between two observations was (rightly) a new generation: the test failed once that way.
OWN_DISK = ("set -e; home=$1; shift; kept=$(mktemp -d); cp -a \"$home/.\" \"$kept/\"; "
            "mount -t tmpfs -o size=1g fleet-test \"$home\"; cp -a \"$kept/.\" \"$home/\"; rm -rf \"$kept\"; "
            "exec \"$@\"")


def own_disk_works() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs t \"$(mktemp -d)\""], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def start_on_own_disk(a: Agent, timeout: float = 30) -> Agent:
    """What Agent.start does, the agent run through OWN_DISK: the same process (exec), so stop() works."""
    enroll(a.home, a.name)
    log = open(a.home.parent / f"{a.name}.log", "a")
    a.proc = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", OWN_DISK, "sh", str(a.home), fleet_bin("fleet-agent"), "serve",
         "--home", str(a.home), "--listen", f"{a.address}:{a.port}", *a.args],
        env=agent_env(), stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert a.proc.poll() is None, f"agent exited with {a.proc.returncode}: {a.log()}"
        try:
            if httpx.get(a.url + "/healthz", timeout=1).status_code == 200:
                disk = a.get("/v1/state").json()["inventory"]["disk"]
                assert disk["total_bytes"] == 1 << 30, disk  # its own tmpfs, not the machine's disk
                return a
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    a.stop()
    raise AssertionError(f"agent did not answer within {timeout}s: {a.log()}")


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    base = tmp_path_factory.mktemp("observed-cache")
    (base / "gpus.json").write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                                 "memory_free_bytes": (60 << 30) + (128 << 20)}]))
    a = Agent("node-a", "127.0.0.3", free_port("127.0.0.3"), base / "a", args=["--simulate-gpus", str(base / "gpus.json")])
    try:
        # Where namespaces are not allowed, the shared disk, and the retries below.
        yield start_on_own_disk(a) if own_disk_works() else a.start()
    finally:
        a.stop()


def observe(agent: Agent, cache: Path) -> tuple[dict[str, Any], str]:
    """The node's state in a fresh snapshot, and what fleet said on stderr."""
    fleet, snapshot = agent.home.parent / "fleet.yaml", agent.home.parent / "snapshot.json"
    fleet.write_text(f"version: 1\ncontrol_plane: {{node: a}}\nnodes:\n  a: {{address: {agent.address}, "
                     f"agent_port: {agent.port}}}\n")
    done = subprocess.run([fleet_bin(), "observe", "-f", str(fleet), "-o", str(snapshot)], capture_output=True,
                          text=True, timeout=60, env=agent_env(FLEET_CACHE_DIR=str(cache)))
    assert done.returncode == 0, done.stderr
    state: dict[str, Any] = json.loads(snapshot.read_text())["nodes"]["a"]["state"]
    return state, done.stderr


def mark_the_held_state(agent: Agent, cache_dir: Path) -> str:
    """Rewrite the cache so that its state says MARK where the agent says its version, at the same
    generation (returned): a run that shows MARK took the state from the cache."""
    desired = config.load(agent.home.parent / "fleet.yaml").desired
    assert desired is not None
    [kept] = (cache_dir / "observed").iterdir()  # the one fleet file's
    cache = ObservationCache(kept, lambda m: pytest.fail(m))
    state = cache.load(desired)["a"].state
    assert state is not None
    cache.save(desired, Observed({"a": node_from_state("a", {**state, "agent_version": MARK})}))
    return str(state["generation"])


def test_a_held_state_is_used_once_the_agent_confirms_it_and_a_changed_one_is_asked_whole(
        agent: Agent, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, said = observe(agent, cache)
    assert first["agent_version"] != MARK and "warning" not in said
    [kept] = (cache / "observed").iterdir()
    assert os.stat(kept).st_mode & 0o777 == 0o600

    def confirmed() -> dict[str, Any] | None:
        held = mark_the_held_state(agent, cache)
        state, _ = observe(agent, cache)
        # Whatever the disk did: the held state is used exactly when the agent has its generation.
        # (Before, a retry after a step crossed held the new generation, was confirmed, and was then
        # compared with the first run's: a retry that could only fail.)
        assert (state["agent_version"] == MARK) == (state["generation"] == held), (state["generation"], held)
        return state if state["agent_version"] == MARK else None

    # On its own disk the first try is confirmed; on a shared one a step may cross in between.
    warm = next((s for s in (confirmed() for _ in range(3)) if s is not None), None)
    assert warm is not None, "the agent never confirmed the generation held"
    assert warm["observed_at"] > first["observed_at"]

    # 1 GiB less free on the GPU: another generation, so the state is asked whole (not MARK's).
    mark_the_held_state(agent, cache)
    (agent.home.parent / "gpus.json").write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                                               "memory_free_bytes": (59 << 30) + (128 << 20)}]))
    changed, _ = observe(agent, cache)
    assert changed["agent_version"] != MARK and changed["generation"] != warm["generation"]
    assert changed["inventory"]["gpus"][0]["memory_free_bytes"] == (59 << 30) + (128 << 20)

    kept.write_bytes(kept.read_bytes()[:-7])  # damaged: ignored with a warning, every state asked whole
    after, said = observe(agent, cache)
    assert after["agent_version"] != MARK and "is ignored" in said and "checksum" in said
