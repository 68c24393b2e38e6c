"""Link rates on real agents: a fetch records its rate per peer, the state reports it, a restart keeps
it, `fleet plan` estimates the next fetch from it (compared here with the real duration), and an
agent refuses new work outside its availability window on its own API."""

from __future__ import annotations

import json
import subprocess
from dataclasses import replace
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from agent.simulation.testmodel import Shape, make_gguf
from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model

pytestmark = pytest.mark.e2e  # real agents moving ~120 MB between them
AUTH = {"Authorization": f"Bearer {SECRET}"}
SHAPE = Shape(layers=6, hidden=512, intermediate=1024, heads=8, kv_heads=8)  # ~60 MB of f32


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent, dict[str, str], Path]]:
    base = tmp_path_factory.mktemp("rates")
    port = free_port("127.0.0.2", "127.0.0.3")
    a, b = Agent("a", "127.0.0.2", port, base / "a"), Agent("b", "127.0.0.3", port, base / "b")
    try:
        a.start(), b.start()
        digests = {}
        for seed in (1, 2):
            path = base / "models" / f"m{seed}.gguf"
            make_gguf(path, replace(SHAPE, seed=seed))
            digests[f"m{seed}"] = import_model(a, path)
        yield a, b, digests, base
    finally:
        a.stop(), b.stop()


def fetch(receiver: Agent, peer: Agent, digest: str) -> float:
    """PUT the fetch and wait until it is held: the seconds a replication takes, as apply sees them."""
    t0 = time.monotonic()
    r = httpx.put(f"{receiver.url}/v1/weights/{digest}", json={"peer": peer.url}, headers=AUTH, timeout=30)
    assert r.status_code in (200, 202), r.text
    assert receiver.wait_for(f"/v1/weights/{digest}", ("present", "failed"), timeout=120, every=0.02)["state"] \
        == "present"
    return time.monotonic() - t0


def fleet_file(base: Path, a: Agent, b: Agent, digests: dict[str, str], replicas: str) -> Path:
    path = base / "fleet.yaml"
    path.write_text(f"""version: 1
control_plane: {{node: a}}
nodes:
  a: {{address: {a.address}, agent_port: {a.port}}}
  {b.name}: {{address: {b.address}, agent_port: {b.port}}}
models:
  m1: {{format: gguf, digest: "{digests['m1']}", source: a}}
  m2: {{format: gguf, digest: "{digests['m2']}", source: a}}
replicas:
{replicas}
""")
    return path


def plan_json(base: Path, path: Path) -> dict[str, Any]:
    proc = subprocess.run([fleet_bin(), "plan", "-f", str(path), "--json"], capture_output=True, text=True,
                          timeout=120, env=agent_env(FLEET_STATE_DIR=str(base / "state")))
    assert proc.stdout, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def estimate_of(plan: dict[str, Any], address: str) -> dict[str, Any]:
    [change] = [c for c in plan["changes"] if c["address"] == address]
    return change["details"]["estimate"]  # type: ignore[no-any-return]


def test_the_second_fetch_is_estimated_from_the_first(pair: tuple[Agent, Agent, dict[str, str], Path]) -> None:
    a, b, digests, base = pair
    path = fleet_file(base, a, b, digests, "  m1: [b]\n  m2: [b]")
    before = estimate_of(plan_json(base, path), "replica.m1@b")
    assert before["seconds"] is None and before["bytes_per_s"] is None  # no measurement yet
    first = fetch(b, a, digests["m1"])
    [rate] = b.get("/v1/state").json()["link_rates"]
    assert rate["peer"] == f"{a.address}:{a.port}" and rate["samples"] == 1
    size = b.get(f"/v1/weights/{digests['m1']}").json().get("bytes") or 0
    plan = plan_json(base, path)
    second = estimate_of(plan, "replica.m2@b")
    assert second["bytes_per_s"] == rate["bytes_per_s"] and second["seconds"] is not None
    real = fetch(b, a, digests["m2"])
    ratio = second["seconds"] / real
    print(f"\nfirst fetch {first:.2f} s; second estimated {second['seconds']:.2f} s, took {real:.2f} s "
          f"(estimate/real {ratio:.2f}); rate {rate['bytes_per_s'] / 1e6:.1f} MB/s; {size} bytes")
    assert 1 / 3 < ratio < 3, (second, real)
    assert len(b.get("/v1/state").json()["link_rates"]) == 1
    assert b.get("/v1/state").json()["link_rates"][0]["samples"] == 2


def test_rates_survive_a_restart(pair: tuple[Agent, Agent, dict[str, str], Path]) -> None:
    _, b, _, _ = pair
    kept = b.get("/v1/state").json()["link_rates"]
    assert kept
    b.stop()
    b.start()
    assert b.get("/v1/state").json()["link_rates"] == kept


def test_work_outside_the_agents_window_is_refused_on_its_api(pair: tuple[Agent, Agent, dict[str, str], Path],
                                                              tmp_path: Path) -> None:
    a, _, digests, _ = pair
    later = datetime.now().astimezone() + timedelta(hours=3)  # a window that is not now, whatever the hour
    window = f"{later:%H}:00-{(later + timedelta(hours=1)):%H}:00"
    c = Agent("c", "127.0.0.4", free_port("127.0.0.4"), tmp_path / "c", args=["--available", window]).start()
    try:
        r = httpx.put(f"{c.url}/v1/weights/{digests['m1']}", json={"peer": a.url}, headers=AUTH, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "outside_availability_window", r.text
        assert window in r.json()["error"]["message"] and "c is outside" in r.json()["error"]["message"]
        r = httpx.post(f"{c.url}/v1/servers", json={"id": "x@c", "model": digests["m1"], "port": 9999},
                       headers=AUTH, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "outside_availability_window", r.text
        assert c.get("/v1/state").json()["fetches"] == []
    finally:
        c.stop()


def test_a_fetch_past_the_window_is_refused_by_plan_apply_and_agent(
        pair: tuple[Agent, Agent, dict[str, str], Path], tmp_path: Path) -> None:
    """A node whose window closes within two minutes, and whose earlier fetches from `a` ran at
    50 kB/s (its kept measurements, as a slow link leaves them): 64 MB would take ~21 min."""
    from agent.transfer.rates import Rates

    a, _, digests, base = pair
    now = datetime.now().astimezone()
    window = f"{now - timedelta(hours=1):%H:%M}-{now + timedelta(minutes=2):%H:%M}"
    home = tmp_path / "d"
    (home / "store").mkdir(parents=True)
    Rates(home / "store" / "link-rates.json").record(a.url, 5_000_000, 100.0)
    d = Agent("d", "127.0.0.4", a.port, home, args=["--available", window]).start()
    try:
        path = fleet_file(tmp_path, a, d, digests, "  m1: [d]")
        env = agent_env(FLEET_STATE_DIR=str(tmp_path / "state"))
        for command in (["plan"], ["apply", "--auto-approve"]):
            proc = subprocess.run([fleet_bin(), *command, "-f", str(path)], capture_output=True, text=True,
                                  timeout=120, env=env, stdin=subprocess.DEVNULL)
            out = proc.stdout + proc.stderr
            assert proc.returncode == 4, out  # a plan error refuses the whole plan
            assert "replication_exceeds_window" in out and f"d's availability window ({window}, the agent's own)" in out
            assert "at 50.0 kB/s (measured)" in out and "replica.m1@d" in out
        assert d.get("/v1/state").json()["weights"] == []
        size = a.get(f"/v1/weights/{digests['m1']}").json()["bytes"]
        r = httpx.put(f"{d.url}/v1/weights/{digests['m1']}", json={"peer": a.url, "bytes": size}, headers=AUTH,
                      timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "replication_exceeds_window", r.text
    finally:
        d.stop()
