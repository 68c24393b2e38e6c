"""Integrity at rest, on real agents: a flipped byte in a stored model is found (on demand, and at
start), reported corrupt in the state with the file and the reason, never served (model_corrupt,
and the bad blob not given to peers), shown by `fleet plan` as a replace, and repaired by `fleet
apply`; a slice is checked tensor by tensor; hashing never stalls the agent's API."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.integration.test_weights import hashed_in, import_linked, sparse_gguf
from tests.models import flip, tiny_gguf, tiny_safetensors
from wire import manifest as mf
from wire.layers import LayerRange

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {SECRET}"}


def verify(agent: Agent, digest: str) -> httpx.Response:
    return httpx.post(f"{agent.url}/v1/weights/{digest}/verify", headers=AUTH, timeout=120)


def held(agent: Agent, digest: str) -> dict[str, Any]:
    entries = {w["digest"]: w for w in agent.get("/v1/state").json()["weights"]}
    return entries[digest]  # type: ignore[no-any-return]


def manifest(agent: Agent, digest: str) -> dict[str, Any]:
    return json.loads(agent.get(f"/v1/manifests/{digest}").content)  # type: ignore[no-any-return]


def test_a_flipped_byte_is_corrupt_not_served_planned_as_a_replace_and_repaired(tmp_path: Path) -> None:
    port = free_port("127.0.0.2", "127.0.0.3")
    cp = Agent("cp", "127.0.0.2", port, tmp_path / "cp").start()
    a = Agent("a", "127.0.0.3", port, tmp_path / "a").start()
    try:
        model = tiny_safetensors(tmp_path / "models")
        digest = import_model(cp, model)
        httpx.put(f"{a.url}/v1/weights/{digest}", json={"peer": cp.url, "name": "tiny"}, headers=AUTH, timeout=10)
        assert a.wait_for(f"/v1/weights/{digest}", ("present", "failed"))["state"] == "present"
        assert held(cp, digest)["integrity"]["state"] == "verified"  # hashed on import

        weights = next(f for f in manifest(cp, digest)["files"] if f["path"] == "model.safetensors")
        victim = next(t for t in weights["tensors"] if t["end"] - t["begin"] > 16)
        stored = cp.home / "store" / "models" / digest[7:] / "model.safetensors"
        flip(stored, victim["begin"] + 7)

        r = verify(cp, digest)
        assert r.status_code == 200, r.text
        found = r.json()["integrity"]
        assert found["state"] == "corrupt" and found["file"] == "model.safetensors"
        assert f"tensor {victim['name']} does not match" in found["reason"]
        assert held(cp, digest)["integrity"] == found  # in the state the control plane reads
        assert "fleet_agent_models_corrupt 1.0" in cp.get("/metrics").text
        # The bad bytes go nowhere: no peer is served them, no server starts on them.
        assert cp.get(f"/v1/blobs/{weights['sha256']}").status_code == 404
        start = httpx.post(f"{cp.url}/v1/servers", json={"id": "chat@cp", "model": digest, "port": free_port(
            "127.0.0.2"), "settings": {"threads": 1}}, headers=AUTH, timeout=10)
        assert start.status_code == 409 and start.json()["error"]["code"] == "model_corrupt", start.text
        assert "model.safetensors" in start.json()["error"]["message"]
        assert a.get(f"/v1/weights/{digest}").json()["integrity"]["state"] == "verified"  # a's copy is another

        fleet = tmp_path / "fleet.yaml"
        fleet.write_text(f"""version: 1
control_plane: {{node: cp}}
nodes:
  cp: {{address: 127.0.0.2, agent_port: {port}}}
  a: {{address: 127.0.0.3, agent_port: {port}}}
models:
  tiny: {{format: safetensors, digest: "{digest}", source: cp}}
replicas:
  tiny: [a]
""")
        env = agent_env(FLEET_STATE_DIR=str(tmp_path / "state"))
        planned = subprocess.run([fleet_bin(), "plan", "-f", str(fleet)], capture_output=True, text=True, env=env,
                                 timeout=120)
        assert planned.returncode == 0, planned.stdout + planned.stderr
        assert "replica.tiny@cp" in planned.stdout and "corrupt" in planned.stdout, planned.stdout
        assert f"tensor {victim['name']}" in planned.stdout and "again from a" in planned.stdout, planned.stdout

        applied = subprocess.run([fleet_bin(), "apply", "--auto-approve", "-f", str(fleet)], capture_output=True,
                                 text=True, env=env, timeout=300, stdin=subprocess.DEVNULL)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert stored.read_bytes() == (model / "model.safetensors").read_bytes()  # fetched again from a
        assert verify(cp, digest).json()["integrity"]["state"] == "verified"
        assert cp.get(f"/v1/blobs/{weights['sha256']}").status_code == 200
        again = subprocess.run([fleet_bin(), "plan", "-f", str(fleet)], capture_output=True, text=True, env=env,
                               timeout=120)
        assert "corrupt" not in again.stdout and "replica.tiny@cp" not in again.stdout, again.stdout
    finally:
        cp.stop()
        a.stop()


def test_found_at_start_and_kept_across_restarts(tmp_path: Path) -> None:
    port = free_port("127.0.0.2")
    agent = Agent("n", "127.0.0.2", port, tmp_path / "n").start()
    try:
        digest = import_model(agent, tiny_gguf(tmp_path / "models"))
        agent.stop()
        gguf = next((agent.home / "store" / "models" / digest[7:]).iterdir())
        flip(gguf, gguf.stat().st_size // 2)
        agent.start()  # --verify-every defaults to 24h: everything held is verified at start
        deadline = time.monotonic() + 60
        while held(agent, digest)["integrity"]["state"] != "corrupt":
            assert time.monotonic() < deadline, held(agent, digest)
            time.sleep(0.1)
        found = held(agent, digest)["integrity"]
        assert found["file"] == gguf.name and "its sha256 is" in found["reason"]
        agent.stop()
        agent.args = ["--verify-every", "off"]
        agent.start()
        assert held(agent, digest)["integrity"] == found  # remembered, not forgotten by a restart
    finally:
        agent.stop()


def test_a_slice_is_checked_tensor_by_tensor(tmp_path: Path) -> None:
    port = free_port("127.0.0.2", "127.0.0.3")
    cp = Agent("cp", "127.0.0.2", port, tmp_path / "cp", args=["--verify-every", "off"]).start()
    b = Agent("b", "127.0.0.3", port, tmp_path / "b", args=["--verify-every", "off"]).start()
    try:
        full = import_model(cp, tiny_safetensors(tmp_path / "models"))
        sliced = mf.make_slice(manifest(cp, full), full, LayerRange(2, 3))
        digest = mf.digest_of(sliced)
        httpx.put(f"{b.url}/v1/weights/{digest}", json={"peer": cp.url, "source_digest": full, "layers": "2-3"},
                  headers=AUTH, timeout=10)
        assert b.wait_for(f"/v1/weights/{digest}", ("present", "failed"))["state"] == "present"
        assembled = next(f for f in sliced["files"] if f.get("assembled"))
        path = b.home / "store" / "models" / digest[7:] / assembled["path"]
        tensor = assembled["tensors"][1]
        for offset, what in ((tensor["begin"] + 3, f"tensor {tensor['name']}"), (9, "the slice header")):
            flip(path, offset)
            found = verify(b, digest).json()["integrity"]
            assert found["state"] == "corrupt" and found["file"] == assembled["path"], found
            assert found["reason"] == f"{what} does not match its sha256 in the manifest"
            flip(path, offset)  # put back: the next verification clears the mark
            assert verify(b, digest).json()["integrity"]["state"] == "verified"
    finally:
        cp.stop()
        b.stop()


def test_verifying_never_stalls_the_api(tmp_path: Path) -> None:
    """Hashing a model sized to take about 3 s here; meanwhile GET /v1/state answers as usual (on
    the event loop, a request made during the hashing would wait for all of it)."""
    port = free_port("127.0.0.2")
    agent = Agent("n", "127.0.0.2", port, tmp_path / "n", args=["--verify-every", "off"]).start()
    try:
        digest = import_linked(agent, sparse_gguf(tmp_path / "big.gguf", hashed_in(3)))
        result: dict[str, Any] = {}

        def run() -> None:
            began = time.monotonic()
            result["answer"] = verify(agent, digest)
            result["seconds"] = time.monotonic() - began

        worker = threading.Thread(target=run)
        worker.start()
        slowest = 0.0
        while worker.is_alive():
            began = time.monotonic()
            assert agent.get("/v1/state").status_code == 200
            slowest = max(slowest, time.monotonic() - began)
            time.sleep(0.01)
        worker.join()
        assert result["answer"].json()["integrity"]["state"] == "verified"
        assert result["seconds"] > 1, result  # long enough for a stall to show
        assert slowest < result["seconds"] / 3, (slowest, result["seconds"])
    finally:
        agent.stop()


@pytest.mark.parametrize("method, path, status, code", [
    ("POST", "/v1/weights/sha256:" + "a" * 64 + "/verify", 404, "weights_not_held"),
    ("POST", "/v1/weights/sha256:abc/verify", 400, "bad_request"),
])
def test_verify_refuses_what_it_does_not_hold(tmp_path: Path, method: str, path: str, status: int,
                                              code: str) -> None:
    agent = Agent("n", "127.0.0.2", free_port("127.0.0.2"), tmp_path / "n", args=["--verify-every", "off"]).start()
    try:
        r = httpx.request(method, agent.url + path, headers=AUTH, timeout=10)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
        assert httpx.request(method, agent.url + path, timeout=10).status_code == 401  # the secret is needed
    finally:
        agent.stop()
