"""Real fleet-agent processes on 127.0.0.2 and 127.0.0.3, sharing one port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import trio

from agent.app import assemble, create_app, route_table
from agent.machine.identity import Identity
from agent.machine.inventory import NoGpus
from agent.backends.launch import ProcessLauncher
from reconciler.agents.client import AgentClient, NodeAuthRejected, NodeUnreachable
from reconciler.core.desired import NodeSpec
from tests.agents import SECRET, Agent, agent_env, enroll, free_port
from tests.conftest import fleet_bin

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

GIB = 2**30


@pytest.fixture(scope="module")
def gpu_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpus") / "gpus.json"
    path.write_text(json.dumps([{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-sim-0",
                                 "memory_total_bytes": 80 * GIB, "memory_free_bytes": 79 * GIB}]))
    return path


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory, gpu_file: Path) -> Iterator[tuple[Agent, Agent]]:
    base = tmp_path_factory.mktemp("agents")
    port = free_port("127.0.0.2", "127.0.0.3")
    a = Agent("node-a", "127.0.0.2", port, base / "a")
    b = Agent("node-b", "127.0.0.3", port, base / "b", args=["--simulate-gpus", str(gpu_file),
                                                             "--available", "22:00-06:00"])
    try:
        yield a.start(), b.start()
    finally:
        a.stop()
        b.stop()


def proc_cores() -> int:
    return sum(1 for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("processor"))


def proc_mem_total() -> int:
    m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    assert m
    return int(m.group(1)) * 1024


def test_two_agents_share_a_port_on_their_own_addresses(agents: tuple[Agent, Agent]) -> None:
    a, b = agents
    assert a.port == b.port
    sa, sb = a.get("/v1/state").json(), b.get("/v1/state").json()
    assert sa["identity"]["name"] == "node-a" and sb["identity"]["name"] == "node-b"
    assert sa["identity"]["id"] != sb["identity"]["id"]


def test_state_reports_measured_cores_and_memory(agents: tuple[Agent, Agent]) -> None:
    inv = agents[0].get("/v1/state").json()["inventory"]
    assert inv["cores"]["logical"] == proc_cores()
    assert inv["memory"]["total_bytes"] == proc_mem_total()
    assert 0 < inv["memory"]["available_bytes"] <= inv["memory"]["total_bytes"]
    assert 0 < inv["disk"]["free_bytes"] <= inv["disk"]["total_bytes"]
    assert inv["gpus"] == [] and inv["simulated"] is False
    state = agents[0].get("/v1/state").json()
    assert state["weights"] == [] and state["servers"] == []
    assert state["availability"]["always"] is True and state["availability"]["inside"] is True


def test_simulated_gpus_are_read_at_request_time(agents: tuple[Agent, Agent], gpu_file: Path) -> None:
    b = agents[1]
    inv = b.get("/v1/state").json()["inventory"]
    assert inv["simulated"] is True and inv["gpu_source"] == "simulated"
    assert inv["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert inv["gpus"][0]["memory_free_bytes"] == 79 * GIB
    original = gpu_file.read_text()
    try:
        gpu_file.write_text(original.replace(str(79 * GIB), str(12 * GIB)))
        assert b.get("/v1/state").json()["inventory"]["gpus"][0]["memory_free_bytes"] == 12 * GIB
    finally:
        gpu_file.write_text(original)
    assert b.get("/v1/state").json()["availability"]["windows"] == ["22:00-06:00"]


def _app(home: Path) -> object:
    ident = Identity(id="0" * 32, name="x", enrolled_at="2026-01-01T00:00:00+00:00", agent_version="t")
    return create_app(assemble(home, ident, SECRET.encode(), "t", NoGpus("test"), ProcessLauncher()))


@pytest.mark.parametrize("header, code", [
    (None, "secret_missing"),
    ("Bearer wrong-secret-wrong-secret-wrong", "secret_wrong"),
    ("Bearer " + SECRET[:-1] + chr(ord(SECRET[-1]) ^ 1), "secret_wrong"),  # one byte differs
    ("Bearer " + SECRET + "x", "secret_wrong"),
    ("Basic " + SECRET, "secret_wrong"),  # the right secret in the wrong scheme
    ("Bearer", "secret_wrong"),
], ids=["none", "wrong", "one-byte", "longer", "basic-scheme", "empty-bearer"])
def test_every_route_but_healthz_rejects_a_bad_secret(agents: tuple[Agent, Agent], header: str | None,
                                                     code: str, tmp_path: Path) -> None:
    import httpx

    a = agents[0]
    table = route_table(_app(tmp_path))  # type: ignore[arg-type]
    assert ("/v1/state", {"GET", "HEAD"}) in table
    for path, methods in table + [("/v1/no-such-route", {"GET"})]:
        for method in methods - {"HEAD"}:
            headers = {} if header is None else {"Authorization": header}
            r = httpx.request(method, a.url + path, headers=headers, timeout=10)
            if path == "/healthz":
                assert r.status_code == 200 and r.json() == {"status": "ok"}
                continue
            assert r.status_code == 401, (method, path)
            assert r.json()["error"]["code"] == code
            sent = (header or "").partition(" ")[2]
            assert SECRET[4:] not in r.text and (not sent or sent not in r.text)
    assert SECRET not in a.log()


def test_client_names_the_node_on_rejection(agents: tuple[Agent, Agent]) -> None:
    a = agents[0]
    node = NodeSpec(name="node-a", address=a.address, agent_port=a.port)

    async def go() -> None:
        async with AgentClient("not-the-secret-at-all-0000") as client:
            with pytest.raises(NodeAuthRejected) as info:
                await client.state(node)
        assert "node-a" in str(info.value) and "127.0.0.2" in str(info.value)
        assert info.value.code == "node_auth_rejected"
        async with AgentClient(SECRET) as client:
            state = await client.state(node)
        assert state["identity"]["name"] == "node-a"

    trio.run(go)


def test_client_names_node_address_and_cause_when_unreachable() -> None:
    port = free_port("127.0.0.9")
    node = NodeSpec(name="ghost", address="127.0.0.9", agent_port=port)

    async def go() -> None:
        async with AgentClient(SECRET, timeout=2) as client:
            with pytest.raises(NodeUnreachable) as info:
                await client.state(node)
        msg = str(info.value)
        assert "ghost" in msg and f"127.0.0.9:{port}" in msg and "connection refused" in msg
        assert info.value.retryable

    trio.run(go)


def test_enrolling_twice_changes_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    first = enroll(home, "n1")
    ident_file = home / "identity.json"
    before = ident_file.read_bytes()
    assert ident_file.stat().st_mode & 0o777 == 0o600
    assert home.stat().st_mode & 0o777 == 0o700
    second = subprocess.run([fleet_bin("fleet-agent"), "enroll", "--home", str(home), "--name", "other"],
                            capture_output=True, text=True, timeout=30)
    assert second.returncode == 0
    ident = json.loads(before)["id"]
    assert "already enrolled" in second.stdout and ident in second.stdout and ident in first.stdout
    assert ident_file.read_bytes() == before


def _serve(home: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    port = free_port("127.0.0.2")
    return subprocess.run([fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen",
                           f"127.0.0.2:{port}", *args], capture_output=True, text=True, timeout=30,
                          env=env if env is not None else agent_env())


def test_serve_refuses_without_identity_or_secret(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc = _serve(home)
    assert proc.returncode == 3 and "run `fleet-agent enroll --home" in proc.stderr
    enroll(home, "n1")
    env = agent_env()
    del env["FLEET_CLUSTER_SECRET"]
    proc = _serve(home, env=env)
    assert proc.returncode == 3 and "FLEET_CLUSTER_SECRET is not set" in proc.stderr
    proc = _serve(home, env=agent_env(FLEET_CLUSTER_SECRET="short"))
    assert proc.returncode == 3 and "at least 16" in proc.stderr and "short" not in proc.stderr
    proc = _serve(home, "--available", "7pm-7am")
    assert proc.returncode == 3 and "HH:MM-HH:MM" in proc.stderr


def test_serve_refuses_when_its_port_is_taken(agents: tuple[Agent, Agent], tmp_path: Path) -> None:
    home = tmp_path / "home"
    enroll(home, "n1")
    a = agents[0]
    proc = subprocess.run([fleet_bin("fleet-agent"), "serve", "--home", str(home), "--listen",
                           f"{a.address}:{a.port}"], capture_output=True, text=True, timeout=30, env=agent_env())
    assert proc.returncode == 3 and f"{a.address}:{a.port}" in proc.stderr and "in use" in proc.stderr


def test_serve_refuses_an_unwritable_cache_dir(tmp_path: Path) -> None:
    home = tmp_path / "home"
    enroll(home, "n1")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    proc = _serve(home, env=agent_env(HF_HOME=str(blocker / "hf")))
    assert proc.returncode == 3
    assert f"HF_HOME {blocker / 'hf'} is not writable" in proc.stderr


def test_serve_refuses_a_read_only_home(tmp_path: Path) -> None:
    """A read-only bind mount of the home, in a private mount namespace: root cannot write there
    either, which chmod alone would not show when the tests run as root."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    probe = subprocess.run(["unshare", "-m", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot create a mount namespace here: {probe.stderr.decode().strip()}")
    home = tmp_path / "home"
    enroll(home, "n1")
    port = free_port("127.0.0.2")
    script = (f"mount --bind {home} {home} && mount -o remount,bind,ro {home} && "
              f"exec {fleet_bin('fleet-agent')} serve --home {home} --listen 127.0.0.2:{port}")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True,
                          timeout=30, env=agent_env())
    assert proc.returncode == 3, proc.stderr
    assert f"home {home} is not writable by user" in proc.stderr
    assert "Read-only file system" in proc.stderr


def test_sigterm_stops_the_agent_cleanly(tmp_path: Path) -> None:
    port = free_port("127.0.0.4")
    a = Agent("solo", "127.0.0.4", port, tmp_path / "solo").start()
    assert a.stop() == 0
    assert "SIGTERM received" in a.log()


def test_doctor_reports_checks(tmp_path: Path, gpu_file: Path) -> None:
    home = tmp_path / "home"
    enroll(home, "n1")
    proc = subprocess.run([fleet_bin("fleet-agent"), "doctor", "--home", str(home), "--json",
                           "--simulate-gpus", str(gpu_file)], capture_output=True, text=True, timeout=60)
    findings = {f["check"]: f for f in json.loads(proc.stdout)}
    assert findings["writable:home"]["level"] == "ok"
    assert "NVIDIA H100" in findings["gpus"]["message"]
    assert findings["identity"]["level"] == "ok"
    # A simulated GPU with no CUDA torch is the mismatch doctor exists to catch, or no torch at all.
    assert findings["variant:torch"]["level"] in ("error", "warning")
    assert proc.returncode == (3 if findings["variant:torch"]["level"] == "error" else 0)  # 3: configuration


def test_tls_agent_and_client(tmp_path: Path) -> None:
    import httpx

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=fleet-test",
                    "-addext", "subjectAltName=IP:127.0.0.5", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    a = Agent("tls", "127.0.0.5", free_port("127.0.0.5"), tmp_path / "tls", tls_cert=cert).start()
    try:
        node = NodeSpec(name="tls", address="127.0.0.5", agent_port=a.port, tls=True)

        async def go() -> dict:
            async with AgentClient(SECRET, ca_file=str(cert)) as client:
                return await client.state(node)

        assert trio.run(go)["identity"]["name"] == "tls"

        async def untrusting() -> None:
            async with AgentClient(SECRET) as client:  # the system's CAs do not know this certificate
                await client.state(node)

        with pytest.raises(NodeUnreachable, match="tls.*certificate verify failed"):
            trio.run(untrusting)
        with pytest.raises(httpx.TransportError):  # plain HTTP to the TLS port gets no answer
            httpx.get(f"http://127.0.0.5:{a.port}/healthz", timeout=2)
    finally:
        a.stop()


def test_agent_metrics_need_the_secret_and_report_the_tables(agents: tuple[Agent, Agent]) -> None:
    a = agents[0]
    assert a.get("/metrics", secret=None).status_code == 401
    text = a.get("/metrics").text
    assert 'fleet_agent_servers{state="running"} 0.0' in text
    assert "fleet_agent_fetches_in_flight 0.0" in text and "fleet_agent_models_held" in text


def test_a_slice_starts_only_as_the_pipeline_stage_of_its_layers(tmp_path: Path) -> None:
    import httpx

    from agent.weights.store import Store
    from tests.models import hold_slices, tiny_safetensors

    home = tmp_path / "stage"
    digests = hold_slices(Store(home), tiny_safetensors(tmp_path / "models"), ["0-1", "2-3"])
    a = Agent("stage", "127.0.0.6", free_port("127.0.0.6"), home).start()
    try:
        stages = [{"node": "stage", "address": "127.0.0.6", "layers": "0-1"},
                  {"node": "other", "address": "127.0.0.7", "layers": "2-3"}]
        pipeline = {"group": "0123456789abcdef", "rank": 0, "world_size": 2,
                    "rendezvous": {"address": "127.0.0.6", "port": 9101}, "stages": stages}

        def start(body: dict) -> httpx.Response:
            return httpx.post(a.url + "/v1/servers", json={"id": "big@stage", "port": 9100, **body},
                              headers={"Authorization": f"Bearer {SECRET}"}, timeout=10)

        refusals = [(start({"model": digests[0]}), 409, "model_is_slice"),
                    (start({"model": digests[1], "pipeline": pipeline}), 409, "pipeline_slice_mismatch"),
                    (start({"model": digests[0], "pipeline": {**pipeline, "rank": 5}}), 400, "bad_request")]
        for r, status, code in refusals:
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
        assert "holds layers 2-3, but stage 0 of pipeline 0123456789abcdef serves layers 0-1" in refusals[1][0].text
        assert {w["slice"]["layers"] for w in a.get("/v1/state").json()["weights"] if w["slice"]} == {"0-1", "2-3"}
    finally:
        a.stop()
