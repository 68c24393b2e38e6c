"""Agent to agent over TLS, on real processes: a fetch checks the peer's certificate as the control
plane checks an agent's, against the peer's `hostname` from fleet.yaml (the PUT's peer_hostname)
with the CAs of `fleet-agent serve --peer-ca-file`; a certificate for another name is
peer_tls_failed naming the peer and why, final (not resumable)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.agents import SECRET, Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model
from tests.integration.test_agent_tls import HOSTNAME, NamedAgent, make_pki
from tests.models import tiny_safetensors

pytestmark = pytest.mark.e2e  # real fleet-agent processes

AUTH = {"Authorization": f"Bearer {SECRET}"}
PEER_ADDRESS, FETCHER_ADDRESS = "127.0.0.11", "127.0.0.12"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory, pki: tuple[Path, Path]) -> Iterator[tuple[Agent, Agent, str]]:
    """The peer (HTTPS, a certificate for HOSTNAME only, no IP address) holding a model, and a plain
    agent that trusts the CA that signed it."""
    ca, cert = pki
    base = tmp_path_factory.mktemp("peer-tls")
    peer = NamedAgent("node-a", PEER_ADDRESS, free_port(PEER_ADDRESS), base / "node-a", tls_cert=cert, ca=ca)
    fetcher = Agent("node-b", FETCHER_ADDRESS, free_port(FETCHER_ADDRESS), base / "node-b",
                    args=["--peer-ca-file", str(ca)])
    try:
        peer.start()
        digest = import_model(peer, tiny_safetensors(base / "models"))
        yield peer, fetcher.start(), digest
    finally:
        fetcher.stop()
        peer.stop()


def fetch(fetcher: Agent, peer: Agent, digest: str, **extra: Any) -> dict[str, Any]:
    r = httpx.put(f"{fetcher.url}/v1/weights/{digest}", json={"peer": peer.url, **extra}, headers=AUTH, timeout=10)
    assert r.status_code == 202, r.text
    return fetcher.wait_for(f"/v1/weights/{digest}", ("present", "failed"), timeout=60)


@pytest.mark.parametrize("hostname", ["node-b.test", None], ids=["another-hostname", "address-only"])
def test_a_peer_whose_certificate_names_another_host_is_refused(agents: tuple[Agent, Agent, str],
                                                                hostname: str | None) -> None:
    peer, fetcher, digest = agents
    job = fetch(fetcher, peer, digest, **({"peer_hostname": hostname} if hostname else {}))
    assert job["state"] == "failed" and job["code"] == "peer_tls_failed", job
    assert not job["resumable"], job  # the same certificate would be met again
    assert peer.url in job["error"] and f"checked as '{hostname or PEER_ADDRESS}'" in job["error"], job
    assert "certificate verify failed" in job["error"], job
    assert fetcher.get("/v1/state").json()["weights"] == []


def test_the_peer_checked_by_its_hostname_with_the_ca_file_is_fetched(agents: tuple[Agent, Agent, str]) -> None:
    peer, fetcher, digest = agents
    job = fetch(fetcher, peer, digest, peer_hostname=HOSTNAME)
    try:
        assert job["state"] == "present", job
        assert job["fetch"]["bytes_fetched"] > 0, job
    finally:
        httpx.delete(f"{fetcher.url}/v1/weights/{digest}", headers=AUTH, timeout=10)


def test_a_peer_hostname_that_is_not_a_host_name_is_refused(agents: tuple[Agent, Agent, str]) -> None:
    peer, fetcher, digest = agents
    for bad in ("node a", "node-a\n", "", 7, "x" * 254):
        r = httpx.put(f"{fetcher.url}/v1/weights/{digest}", json={"peer": peer.url, "peer_hostname": bad},
                      headers=AUTH, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_peer", (bad, r.text)


def test_fleet_apply_sends_the_peer_hostname_from_the_fleet_file(tmp_path: Path, agents: tuple[Agent, Agent, str],
                                                                  pki: tuple[Path, Path]) -> None:
    """The control plane's fetch request names the peer as fleet.yaml does: without it the agent would
    check the peer's certificate against its address and be refused."""
    peer, fetcher, digest = agents
    (tmp_path / "fleet.yaml").write_text(f"""version: 1
control_plane: {{node: node-b, agent_ca_file: {pki[0]}}}
nodes:
  node-a: {{address: {peer.address}, agent_port: {peer.port}, tls: true, hostname: {HOSTNAME}}}
  node-b: {{address: {fetcher.address}, agent_port: {fetcher.port}}}
models:
  tiny: {{format: safetensors, digest: "{digest}", source: node-a}}
replicas:
  tiny: [node-a, node-b]
""")
    try:
        done = subprocess.run([fleet_bin(), "apply", "--auto-approve", "-f", str(tmp_path / "fleet.yaml")],
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                              env=agent_env(FLEET_STATE_DIR=str(tmp_path / "state")))
        assert done.returncode == 0, done.stdout + done.stderr
        assert [w["digest"] for w in fetcher.get("/v1/state").json()["weights"]] == [digest]
    finally:
        httpx.delete(f"{fetcher.url}/v1/weights/{digest}", headers=AUTH, timeout=10)


def test_a_peer_ca_file_that_cannot_be_read_stops_the_agent_at_start(tmp_path: Path) -> None:
    home = tmp_path / "home"
    subprocess.run([fleet_bin("fleet-agent"), "enroll", "--home", str(home), "--name", "x"], check=True,
                   capture_output=True, env=agent_env(), timeout=30)
    (tmp_path / "not-a-ca.pem").write_text("hello\n")
    for path in (tmp_path / "missing.pem", tmp_path / "not-a-ca.pem"):
        done = subprocess.run([fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen", "127.0.0.1:1",
                               "--peer-ca-file", str(path)], capture_output=True, text=True, timeout=30,
                              env=agent_env(), stdin=subprocess.DEVNULL)
        assert done.returncode == 3 and "--peer-ca-file" in done.stderr and str(path) in done.stderr, done.stderr
