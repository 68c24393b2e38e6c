"""One node whose agent (or whatever answers at its address) sends hostile JSON, beside good real
agents: `fleet plan` refuses with `agent_protocol_error` naming that node and the field, and
`fleet serve` keeps routing the good cluster. (Before: a 5,001-digit integer or JSON 200,000
levels deep made `fleet plan` exit 1 `internal_error` naming no node, and `fleet serve` exit 1,
taking the router down for every cluster.)

The good nodes are one `fleet-agent simulate` process hosting cp and gpu-a (simulated GPUs,
real HTTP API), with chat@gpu-a started by `fleet apply` and tests/integration/test_front_limits.py
run as the stand-in worker on its cluster port. The hostile one is this file run as a script
(`python test_hostile_agent.py hostile HOST PORT MODEFILE`): a real HTTP server that answers
/healthz and, for everything else, the hostile body named in MODEFILE (read on every request)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.addresses import loopback
from tests.agents import agent_env, free_port, wait_healthy
from tests.conftest import ROOT, fleet_bin

pytestmark = pytest.mark.e2e

CP, GOOD, BAD = loopback(3)  # consecutive: `fleet-agent simulate --first CP` hosts the first two
DIGEST = "sha256:" + "cd" * 32
WORKER = ROOT / "tests" / "integration" / "test_front_limits.py"  # its stand-in worker

# What the hostile agent answers: (status, body).
HOSTILE: dict[str, tuple[int, bytes]] = {
    "digits": (200, b"1" * 5001),
    "deep-array": (200, b"[" * 200_000 + b"]" * 200_000),
    "deep-object": (200, b'{"a":' * 200_000 + b"1" + b"}" * 200_000),
    "deep-in-a-field": (200, b'{"identity": {"id": "x", "name": "bad"}, "inventory": ' + b"[" * 100_000
                        + b"]" * 100_000 + b"}"),
    "digits-in-a-field": (200, b'{"inventory": {"memory": {"total_bytes": ' + b"9" * 5001 + b"}}}"),
    "deep-error": (500, b'{"error": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"),
    "nan": (200, b'{"inventory": {"memory": {"total_bytes": NaN}}}'),
}


def hostile_agent(host: str, port: int, modefile: str) -> None:
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            status, body = (200, b'{"status": "ok"}') if self.path == "/healthz" else \
                HOSTILE[Path(modefile).read_text().strip()]
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    ThreadingHTTPServer((host, port), Handler).serve_forever()


@dataclass
class Fleet:
    base: Path
    agent_port: int
    cluster_port: int
    modefile: Path

    def write(self, name: str, hostile: bool) -> Path:
        path = self.base / f"{name}.yaml"
        bad = f"\n  bad:   {{address: {BAD}, agent_port: {self.agent_port}}}" if hostile else ""
        path.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{CP}:{free_port(CP)}"}}
nodes:
  cp:    {{address: {CP}, agent_port: {self.agent_port}}}
  gpu-a: {{address: {GOOD}, agent_port: {self.agent_port}}}{bad}
models:
  tiny: {{format: safetensors, digest: "{DIGEST}", source: cp}}
replicas:
  tiny: [gpu-a{", bad" if hostile else ""}]
clusters:
  chat: {{model: tiny, members: [gpu-a], port: {self.cluster_port}}}
""" + (f"  other: {{model: tiny, members: [bad], port: {self.cluster_port}}}\n" if hostile else ""))
        return path

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleet_bin(), *args], capture_output=True, text=True, timeout=120,
                              env=agent_env(FLEET_STATE_DIR=str(self.base / "state")), stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    base = tmp_path_factory.mktemp("hostile-agent")
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
    f = Fleet(base, free_port(CP, GOOD, BAD), free_port(GOOD, BAD), base / "mode")
    f.modefile.write_text("digits")
    sim = subprocess.Popen([fleet_bin("fleet-agent"), "simulate", "--dir", str(base / "sim"), "--first", CP,
                            "--count", "2", "--port", str(f.agent_port), "--gpus", str(gpus),
                            "--hold", f"{DIGEST}:safetensors:1000"],
                           env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, str(WORKER), "worker", GOOD, str(f.cluster_port)])
    bad = subprocess.Popen([sys.executable, __file__, "hostile", BAD, str(f.agent_port), str(f.modefile)])
    try:
        wait_healthy(f"http://{GOOD}:{f.agent_port}")
        wait_healthy(f"http://{BAD}:{f.agent_port}")
        applied = f.run("apply", "-f", str(f.write("good", hostile=False)), "--auto-approve")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        yield f
    finally:
        for proc in (bad, worker, sim):
            proc.terminate()
            proc.wait(30)


@pytest.mark.parametrize(("mode", "field"), [
    ("digits", None), ("deep-array", "[0][0][0]"), ("deep-object", "a.a.a.a"), ("deep-in-a-field", "inventory[0][0]"),
    ("digits-in-a-field", "inventory.memory.total_bytes"), ("deep-error", None), ("nan", None)])
def test_plan_names_the_hostile_node_and_field_and_no_other(fleet: Fleet, mode: str, field: str | None) -> None:
    fleet.modefile.write_text(mode)
    path = fleet.write(f"plan-{mode}", hostile=True)
    done = fleet.run("plan", "-f", str(path), "--json")
    assert done.returncode == 4, done.stdout + done.stderr  # a plan error, refused (the README's exit codes)
    assert "Traceback" not in done.stderr and "internal_error" not in done.stdout + done.stderr, done.stderr
    errors = [d for d in json.loads(done.stdout)["diagnostics"] if d["severity"] == "error"]
    assert errors and all("'bad'" in d["summary"] and "'gpu-a'" not in d["summary"] for d in errors), errors
    codes = {d["code"] for d in errors}
    if mode == "deep-error":  # an error answer whose JSON cannot be read: the status is what is left
        assert codes == {"agent_error"}, errors
    else:
        assert codes == {"agent_protocol_error"}, errors
    if field is not None:
        assert f"(field {field}" in errors[0]["summary"], errors


def test_serve_keeps_routing_the_good_cluster_beside_a_hostile_node(fleet: Fleet) -> None:
    fleet.modefile.write_text("deep-array")
    path = fleet.write("serve", hostile=True)
    listen = path.read_text().split('listen: "')[1].split('"')[0]
    log = fleet.base / "serve.log"
    proc = subprocess.Popen([fleet_bin(), "serve", "-f", str(path), "--state-dir", str(fleet.base / "serve-state"),
                             "--interval", "0.2", "--misses", "2", "--timeout", "2"],
                            env=agent_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)
    base = f"http://{listen}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                r = httpx.get(base + "/healthz", timeout=1)
                if r.status_code == 200 and r.json()["beats"] >= 2:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        for mode in ("deep-array", "digits", "deep-object", "deep-error", "nan"):  # a beat or more each
            fleet.modefile.write_text(mode)
            beats = httpx.get(base + "/healthz", timeout=5).json()["beats"]
            while httpx.get(base + "/healthz", timeout=5).json()["beats"] < beats + 2:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
            with httpx.stream("POST", base + "/v1/chat/completions", timeout=10,
                              json={"model": "chat", "stream": True, "max_tokens": 3}) as r:
                assert r.status_code == 200, r.read()
                text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content", "")
                               for line in r.iter_lines() if line.startswith("data: {"))
            assert text == "t0 t1 t2 ", mode
            other = httpx.post(base + "/v1/chat/completions", json={"model": "other", "max_tokens": 3}, timeout=10)
            assert other.status_code == 503 and "bad: node offline" in other.json()["error"]["message"], other.text
        metrics = httpx.get(base + "/metrics", timeout=5).text
        assert 'fleet_node_up{node="gpu-a"} 1.0' in metrics and 'fleet_node_up{node="bad"} 0.0' in metrics
        assert proc.poll() is None
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


if __name__ == "__main__" and sys.argv[1:2] == ["hostile"]:
    hostile_agent(sys.argv[2], int(sys.argv[3]), sys.argv[4])
