"""Workers supervising real processes through the production launcher (a tiny HTTP worker stands in
for an engine), and simulated agents assembled from the same parts with the simulated launcher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator
from urllib.parse import urlsplit

import httpx
import pytest
import trio

from agent.api.server import Spawner
from agent.backends.launch import BadSettings, Command, LaunchSpec, ModelPath, ProcessLauncher
from agent.simulation.simulate import ClaimedStore, SimulatedLauncher
from agent.weights.store import Store
from agent.serving.supervisor import RequestRefused, Server, Workers
from tests.addresses import loopback
from tests.agents import SECRET, agent_env, free_port, wait_healthy
from tests.conftest import fleet_bin
from tests.models import random_gguf

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

HOST = "127.0.0.2"
# A worker that answers GET /health with 200, unless told to exit at once or never to answer.
WORKER = """
import http.server, sys
host, port, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "exit":
    print("boom: the model would not load", flush=True)
    sys.exit(3)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if mode == "ok" else 503)
        self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer((host, port), H).serve_forever()
"""


def command(path: str, host: str, port: int, s: dict[str, Any], paths: ModelPath) -> Command:
    if s.get("mode") == "bad":
        raise BadSettings("mode bad is not a mode")
    exe = s.get("exe", sys.executable)
    return Command((exe, "-c", WORKER, host, str(port), s.get("mode", "ok")), None)


SPEC = LaunchSpec(name="tiny", format="gguf", modules=("json",), extra="tiny", health="/health", command=command)


def held_gguf(home: Path) -> tuple[Store, str]:
    src = home / "m.gguf"
    home.mkdir(parents=True, exist_ok=True)
    src.write_bytes(random_gguf(4100))
    store = Store(home)
    digest, _ = store.import_model(src, "m")
    return store, digest


def run(home: Path, fn: Callable[[Workers, str], Awaitable[None]], **spec: Any) -> None:
    store, digest = held_gguf(home)

    async def main() -> None:
        spawner = Spawner()
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            workers = Workers(home, store, spawner, ProcessLauncher(), HOST, specs={"tiny": replace(SPEC, **spec)})
            with trio.fail_after(30):
                await fn(workers, digest)
            await workers.stop_all()

    trio.run(main)


async def settled(server: Server, *states: str) -> Server:
    while server.state not in states:
        await trio.sleep(0.02)
    return server


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_a_worker_runs_once_healthy_and_stops_on_sigterm(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        port = free_port(HOST)
        server = workers.start({"id": "w", "model": digest, "port": port})
        assert server.state == "starting" and server.backend == "tiny"
        await settled(server, "running", "failed")
        assert server.state == "running", server.reason
        assert server.pid and alive(server.pid) and workers.using(digest) == "w"
        pid = server.pid
        stopped = await workers.stop("w")
        assert stopped.state == "stopped" and stopped.exit == {"code": None, "signal": signal.SIGTERM}
        assert not alive(pid) and "w" not in workers.servers

    run(tmp_path, go)


def test_a_worker_that_exits_fails_with_its_output(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        server = workers.start({"id": "x", "model": digest, "port": free_port(HOST), "settings": {"mode": "exit"}})
        await settled(server, "failed")
        assert server.exit == {"code": 3, "signal": None}
        assert server.reason is not None and server.reason.startswith("the worker exited with code 3\n")
        assert "boom: the model would not load" in server.reason and str(server.log) in server.reason

    run(tmp_path, go)


def test_no_health_within_the_startup_timeout_kills_the_worker(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        server = workers.start({"id": "slow", "model": digest, "port": free_port(HOST),
                                "settings": {"mode": "unhealthy", "startup_timeout_s": 0.5}})
        await settled(server, "failed")
        assert server.reason is not None and server.reason.startswith(
            "did not answer its health check (/health) within 0.5s (startup_timeout_s); killed")
        assert server.exit == {"code": None, "signal": signal.SIGKILL}
        assert server.pid is not None
        with trio.move_on_after(5):  # the kernel finishes the kill on its own time on a loaded machine
            while alive(server.pid):
                await trio.sleep(0.02)
        assert not alive(server.pid)

    run(tmp_path, go)


def test_a_killed_worker_stays_failed(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        server = await settled(workers.start({"id": "v", "model": digest, "port": free_port(HOST)}), "running")
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        await settled(server, "failed")
        await trio.sleep(0.5)  # long enough for a restart to show itself
        assert server.state == "failed" and server.exit == {"code": None, "signal": 9}
        assert server.reason == "the worker was killed by signal 9 (SIGKILL)"

    run(tmp_path, go)


def test_a_command_that_cannot_start_fails_saying_so(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        server = workers.start({"id": "n", "model": digest, "port": free_port(HOST),
                                "settings": {"exe": str(tmp_path / "no-such-engine")}})
        await settled(server, "failed")
        assert server.reason is not None and server.reason.startswith(f"could not start {tmp_path / 'no-such-engine'}: ")
        assert server.pid is None

    run(tmp_path, go)


@pytest.mark.parametrize("body, spec, status, code", [
    ({"id": "-bad"}, {}, 400, "bad_request"),
    ({"id": "a", "model": "sha256:" + "e" * 64}, {}, 409, "model_not_held"),
    ({"id": "a", "settings": {"mode": "bad"}}, {}, 400, "bad_request"),
    ({"id": "a"}, {"modules": ("json", "no_such_engine_module")}, 409, "backend_not_installed"),
    ({"id": "a"}, {"format": "safetensors"}, 409, "format_not_served"),
], ids=["bad-id", "not-held", "bad-settings", "engine-missing", "format-not-served"])
def test_refusals_come_before_any_process(tmp_path: Path, body: dict[str, Any], spec: dict[str, Any],
                                          status: int, code: str) -> None:
    async def go(workers: Workers, digest: str) -> None:
        with pytest.raises(RequestRefused) as info:
            workers.start({"model": digest, "port": free_port(HOST), **body})
        assert (info.value.status, info.value.code) == (status, code)
        assert workers.servers == {} and not (tmp_path / "servers" / "a.log").exists()

    run(tmp_path, go, **spec)


def test_a_port_in_use_is_refused(tmp_path: Path) -> None:
    async def go(workers: Workers, digest: str) -> None:
        with socket.socket() as busy:
            busy.bind((HOST, 0))
            busy.listen(1)
            port = busy.getsockname()[1]
            with pytest.raises(RequestRefused, match=f"port {port} on {HOST} is in use") as info:
                workers.start({"id": "p", "model": digest, "port": port})
        assert info.value.code == "port_unavailable"

    run(tmp_path, go)


def test_simulated_workers_run_claimed_models_through_the_same_checks(tmp_path: Path) -> None:
    claimed = "sha256:" + "ab" * 32
    store = ClaimedStore(Store(tmp_path), [{"digest": claimed, "format": "safetensors", "bytes": 1000}])

    async def main() -> None:
        spawner = Spawner()
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            workers = Workers(tmp_path, store, spawner, SimulatedLauncher(), HOST)
            server = workers.start({"id": "s", "model": claimed, "port": 9000})
            assert server.backend == "torch"
            await settled(server, "running")
            assert server.pid == 0
            with pytest.raises(RequestRefused, match="already running"):
                workers.start({"id": "s", "model": claimed, "port": 9000})
            with pytest.raises(RequestRefused) as info:
                workers.start({"id": "t", "model": "sha256:" + "cd" * 32, "port": 9000})
            assert info.value.code == "model_not_held"
            assert (await workers.stop("s")).state == "stopped" and workers.servers == {}

    trio.run(main)
    assert store.entries() == [{"digest": claimed, "format": "safetensors", "bytes": 1000, "name": "",
                                "layers": None, "slice": None, "path": "(simulated)", "simulated": True}]
    assert list(store.digests()) == [claimed]


@pytest.fixture
def simulated(tmp_path: Path) -> Iterator[str]:
    gpus = tmp_path / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
    cp, node = loopback(2)
    port = free_port(cp, node)
    sim = subprocess.Popen([fleet_bin("fleet-agent"), "simulate", "--dir", str(tmp_path / "sim"), "--count", "2",
                            "--first", cp, "--port", str(port), "--gpus", str(gpus), "--hold", f"sha256:{'ab' * 32}:safetensors:1000"],
                           env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_healthy(f"http://{node}:{port}", timeout=30)
        yield f"http://{node}:{port}"
    finally:
        sim.terminate()
        sim.wait(30)


def test_fleet_agent_simulate_serves_real_routes_over_simulated_parts(simulated: str) -> None:
    auth = {"Authorization": f"Bearer {SECRET}"}
    digest = "sha256:" + "ab" * 32
    state = httpx.get(simulated + "/v1/state", headers=auth).json()
    assert state["identity"]["name"] == "sim-1" and state["inventory"]["simulated"] is True
    assert [(w["digest"], w["simulated"]) for w in state["weights"]] == [(digest, True)]
    r = httpx.post(simulated + "/v1/servers", headers=auth, json={"id": "c@n1", "model": digest, "port": 9000})
    assert r.status_code == 202, r.text
    for _ in range(100):
        s = httpx.get(simulated + "/v1/servers/c@n1", headers=auth).json()
        if s["state"] == "running":
            break
    assert s["state"] == "running" and s["pid"] == 0 and s["host"] == urlsplit(simulated).hostname
    assert httpx.delete(simulated + "/v1/servers/c@n1", headers=auth).json()["state"] == "stopped"
    assert httpx.get(simulated + "/v1/state").status_code == 401
