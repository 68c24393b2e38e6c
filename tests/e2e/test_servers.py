"""Servers behind a real agent: a GGUF model on llama.cpp and a safetensors model on PyTorch,
answered through the official `openai` client; failures reported with their full reason."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model
from tests.models import gguf_missing_tensor, tiny_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {SECRET}"}


def start(agent: Agent, sid: str, digest: str, port: int, **settings: Any) -> httpx.Response:
    return httpx.post(f"{agent.url}/v1/servers", json={"id": sid, "model": digest, "port": port,
                                                        "settings": settings}, headers=AUTH, timeout=30)


def settle(agent: Agent, sid: str) -> dict[str, Any]:
    return agent.wait_for(f"/v1/servers/{sid}", ("running", "failed"), timeout=180, every=0.2)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Agent, dict[str, str], Path]]:
    base = tmp_path_factory.mktemp("servers")
    models = base / "models"
    a = Agent("srv", "127.0.0.2", free_port("127.0.0.2"), base / "srv").start()
    try:
        digests = {"gguf": import_model(a, tiny_gguf(models)),
                   "safetensors": import_model(a, tiny_safetensors(models))}
        yield a, digests, models
    finally:
        a.stop()


@pytest.mark.parametrize("fmt", ["gguf", "safetensors"])
def test_openai_client_gets_completion_and_streamed_chat(node: tuple[Agent, dict[str, str], Path], fmt: str) -> None:
    agent, digests, _ = node
    port = free_port("127.0.0.2")
    r = start(agent, f"chat-{fmt}", digests[fmt], port, context_length=256, threads=2)
    assert r.status_code == 202 and r.json()["state"] == "starting", r.text
    s = settle(agent, f"chat-{fmt}")
    assert s["state"] == "running", s["reason"]
    assert s["backend"] == ("llama_cpp" if fmt == "gguf" else "torch") and s["pid"] and s["port"] == port
    assert s["settings"]["context_length"] == 256
    # The worker answers only with the credential its agent made for it (the router's).
    client = openai.OpenAI(base_url=f"http://127.0.0.2:{port}/v1", api_key=s["credential"], max_retries=0,
                           timeout=120)
    done = client.completions.create(model="tiny", prompt="The fleet", max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length") and done.usage.completion_tokens >= 1
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello!"}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert len(chunks) >= 2
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    busy = httpx.delete(f"{agent.url}/v1/weights/{digests[fmt]}", headers=AUTH, timeout=30)
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "weights_in_use"
    assert f"chat-{fmt}" in busy.json()["error"]["message"]
    # The engines name the model by the server's cluster (its id, here), never by a path.
    assert client.models.list().data[0].id == f"chat-{fmt}" and done.model == f"chat-{fmt}"
    stopped = httpx.delete(f"{agent.url}/v1/servers/chat-{fmt}", headers=AUTH, timeout=60).json()
    assert stopped["state"] == "stopped" and not alive(s["pid"])
    with socket.socket() as sock:  # free again for the next server (servers set SO_REUSEADDR, as here)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.2", port))
        sock.listen(1)


def test_refused_before_spawning(node: tuple[Agent, dict[str, str], Path]) -> None:
    agent, digests, _ = node
    port = free_port("127.0.0.2")
    with socket.socket() as busy:
        busy.bind(("127.0.0.2", port))
        busy.listen(1)
        r = start(agent, "busy", digests["gguf"], port)
        assert r.status_code == 409 and r.json()["error"]["code"] == "port_unavailable"
        assert str(port) in r.json()["error"]["message"]
    r = start(agent, "ghost", "sha256:" + "e" * 64, port)
    assert r.status_code == 409 and r.json()["error"]["code"] == "model_not_held"
    assert "sha256:" + "e" * 64 in r.json()["error"]["message"]
    assert "busy" not in [s["id"] for s in agent.get("/v1/servers").json()["servers"]]


def test_gguf_llama_cpp_cannot_load_fails_with_the_engine_error(node: tuple[Agent, dict[str, str], Path]) -> None:
    agent, _, models = node
    digest = import_model(agent, gguf_missing_tensor(models, "no-norm.gguf"))
    start(agent, "trunc", digest, free_port("127.0.0.2"))
    s = settle(agent, "trunc")
    assert s["state"] == "failed"
    assert "exited with code" in s["reason"] and "output_norm" in s["reason"]
    assert s["exit"]["code"] not in (0, None)


def test_safetensors_missing_a_tensor_fails_naming_it(node: tuple[Agent, dict[str, str], Path]) -> None:
    from safetensors.numpy import load_file, save_file

    agent, _, models = node
    src = tiny_safetensors(models)
    broken = models / "missing-tensor"
    broken.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    digest = import_model(agent, broken)
    start(agent, "missing", digest, free_port("127.0.0.2"))
    s = settle(agent, "missing")
    assert s["state"] == "failed"
    assert "model.layers.1.mlp.up_proj.weight" in s["reason"]


def test_a_killed_worker_stays_failed(node: tuple[Agent, dict[str, str], Path]) -> None:
    agent, digests, _ = node
    start(agent, "victim", digests["gguf"], free_port("127.0.0.2"))
    s = settle(agent, "victim")
    assert s["state"] == "running", s["reason"]
    os.kill(s["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while agent.get("/v1/servers/victim").json()["state"] != "failed":
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)  # long enough for a restart loop to show itself
    after = agent.get("/v1/servers/victim").json()
    assert after["state"] == "failed" and after["pid"] == s["pid"]
    assert "killed by signal 9 (SIGKILL)" in after["reason"] and after["exit"]["signal"] == 9


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_stopping_the_agent_leaves_no_worker(tmp_path: Path, node: tuple[Agent, dict[str, str], Path],
                                             how: int) -> None:
    _, _, models = node
    a = Agent("short", "127.0.0.3", free_port("127.0.0.3"), tmp_path / "short").start()
    digest = import_model(a, tiny_gguf(models))
    start(a, "w", digest, free_port("127.0.0.3"))
    s = settle(a, "w")
    assert s["state"] == "running", s["reason"]
    a.stop(how)
    deadline = time.monotonic() + 20
    while alive(s["pid"]):
        assert time.monotonic() < deadline, f"worker {s['pid']} outlived its agent"
        time.sleep(0.1)


@pytest.mark.parametrize("fmt, spec, how", [
    ("safetensors", "draft", "transformers assisted generation"),
    ("safetensors", "prompt_lookup", "transformers prompt-lookup decoding"),
    ("gguf", "prompt_lookup", "llama.cpp prompt-lookup decoding"),
])
def test_speculative_settings_reach_the_engine(node: tuple[Agent, dict[str, str], Path], fmt: str, spec: str,
                                               how: str) -> None:
    agent, digests, _ = node
    port = free_port("127.0.0.2")
    speculative: dict[str, Any] = {"mode": spec, "tokens": 3}
    if spec == "draft":  # the tiny model drafts for itself: same tokenizer, as assisted generation needs
        speculative["draft_digest"] = digests[fmt]
    sid = f"spec-{fmt}-{spec}"
    assert start(agent, sid, digests[fmt], port, speculative=speculative).status_code == 202
    s = settle(agent, sid)
    assert s["state"] == "running", s["reason"]
    assert s["speculative"]["applied"] is True and s["speculative"]["how"] == how
    client = openai.OpenAI(base_url=f"http://127.0.0.2:{port}/v1", api_key=s["credential"], max_retries=0,
                           timeout=120)
    done = client.completions.create(model="tiny", prompt="The fleet reconciles", max_tokens=6, temperature=0)
    assert done.usage.completion_tokens >= 1
    httpx.delete(f"{agent.url}/v1/servers/{sid}", headers=AUTH, timeout=60)
