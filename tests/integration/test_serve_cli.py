"""`fleet serve` as a user runs it, with no agent answering: what it refuses to start with, what a
client gets when no member runs, and a clean stop on SIGTERM."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.agents import agent_env, free_port
from tests.conftest import fleet_bin

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

HOST = "127.0.0.2"


def fleet_file(tmp_path: Path, listen_port: int, extra: str = "") -> Path:
    agent_port = free_port("127.0.0.3")  # nothing listens there: the node is offline
    path = tmp_path / "fleet.yaml"
    path.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{HOST}:{listen_port}"{extra}}}
nodes:
  cp:    {{address: {HOST}, agent_port: {free_port(HOST)}}}
  gpu-a: {{address: 127.0.0.3, agent_port: {agent_port}}}
models:
  tiny: {{format: safetensors, digest: "sha256:{'ab' * 32}", source: cp}}
replicas:
  tiny: [gpu-a]
clusters:
  chat: {{model: tiny, members: [gpu-a], port: {free_port('127.0.0.3')}}}
""")
    return path


def serve(tmp_path: Path, path: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen([fleet_bin(), "serve", "-f", str(path), "--state-dir", str(tmp_path / "state"),
                             "--interval", "0.2", "--misses", "1", "--timeout", "1"],
                            env=agent_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_a_port_in_use_is_refused_with_the_address(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind((HOST, 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        proc = serve(tmp_path, fleet_file(tmp_path, port))
        out, _ = proc.communicate(timeout=60)
    finally:
        taken.close()
    assert proc.returncode == 3, out  # the environment refuses it, as fleet-agent's port in use: exit 3
    assert f"cannot listen on {HOST}:{port}" in out and "in use" in out and "Traceback" not in out


def test_api_keys_env_naming_an_empty_variable_is_refused(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, free_port(HOST), extra=", api_keys_env: FLEET_TEST_KEYS")
    proc = serve(tmp_path, path, FLEET_TEST_KEYS="")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3, out
    assert "FLEET_TEST_KEYS" in out and "holds no key" in out and "Traceback" not in out


def test_with_no_member_running_clients_get_503_naming_why_and_sigterm_stops_it(tmp_path: Path) -> None:
    port = free_port(HOST)
    proc = serve(tmp_path, fleet_file(tmp_path, port))
    try:
        base = f"http://{HOST}:{port}"
        for _ in range(200):
            try:
                if httpx.get(f"{base}/healthz", timeout=1).json()["beats"] >= 2:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        r = httpx.post(f"{base}/v1/chat/completions", json={"model": "chat", "stream": True,
                                                            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "no_running_member" and "gpu-a: node offline" in r.json()["error"]["message"]
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "chat"
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert "gpu-a: node offline" in out  # the refusal is in the log too


def test_a_bad_listen_address_is_a_config_error(tmp_path: Path) -> None:
    path = fleet_file(tmp_path, 1)
    path.write_text(path.read_text().replace(f'"{HOST}:1"', f'"{HOST}:notaport"'))
    proc = serve(tmp_path, path)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 3 and "listen" in out and "Traceback" not in out, out
