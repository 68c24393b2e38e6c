"""An encrypted model never leaves its node, on real agents: its manifest is refused to a peer (403
encrypted_not_served naming the node), and another agent asked to fetch it fails at once with
encrypted_remote_unsupported naming itself, the peer and the digest (final, nothing kept)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.models import tiny_gguf

pytestmark = pytest.mark.e2e  # real fleet-agent processes

AUTH = {"Authorization": f"Bearer {SECRET}"}
HOLDER, OTHER = "127.0.0.13", "127.0.0.14"


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, Agent, str, str]]:
    """The holder of an encrypted model and of the same bytes in plaintext, and another agent."""
    base = tmp_path_factory.mktemp("encrypted-not-served")
    key = base / "weights.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    holder = Agent("holder", HOLDER, free_port(HOLDER), base / "holder", args=["--verify-every", "off"],
                   env={"FLEET_WEIGHTS_KEY_FILE": str(key)})
    other = Agent("other", OTHER, free_port(OTHER), base / "other")
    try:
        holder.start()
        model = tiny_gguf(base / "models")
        sealed = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(holder.home), str(model),
                                 "--name", "sealed", "--encrypt", "--json"], capture_output=True, text=True,
                                timeout=120, env=agent_env(**holder.env), check=True)
        plain = import_model(holder, model)
        yield holder, other.start(), json.loads(sealed.stdout)["digest"], plain
    finally:
        other.stop()
        holder.stop()


def test_the_manifest_of_an_encrypted_model_is_refused_and_a_plain_one_served(
        agents: tuple[Agent, Agent, str, str]) -> None:
    holder, _, sealed, plain = agents
    r = holder.get(f"/v1/manifests/{sealed}")
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    assert error["code"] == "encrypted_not_served" and sealed in error["message"] and "'holder'" in error["message"]
    assert "sha256" not in r.text.replace(sealed, "")  # nothing of the manifest in the refusal
    assert holder.get(f"/v1/manifests/{plain}").json()["format"] == "gguf"


def test_a_fetch_of_it_fails_naming_node_peer_and_digest(agents: tuple[Agent, Agent, str, str]) -> None:
    holder, other, sealed, _ = agents
    r = httpx.put(f"{other.url}/v1/weights/{sealed}", json={"peer": holder.url}, headers=AUTH, timeout=10)
    assert r.status_code == 202, r.text
    job = other.wait_for(f"/v1/weights/{sealed}", ("present", "failed"), timeout=30)
    assert job["state"] == "failed" and job["code"] == "encrypted_remote_unsupported", job
    assert not job["resumable"], job
    for part in ("'other'", holder.url, sealed, "encrypted"):
        assert part in job["error"], (part, job["error"])
    assert other.get("/v1/state").json()["weights"] == []
