"""Servers that cannot load, shown whole end to end: real agents, real engines, `fleet plan/apply/
serve/nodes`. One cluster per cause (a GGUF llama.cpp cannot load, a safetensors tensor missing, a KV
cache larger than the machine's memory, a torch build that cannot use the node's GPUs); each is
shown with its full reason in `fleet nodes --wide`, and a client asking its cluster through `fleet
serve` gets a 503 naming the machine and carrying that reason, with no filesystem path in it."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import psutil
import pytest

from agent.simulation.testmodel import Shape, make_gguf
from tests.agents import Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import import_model, start_serve
from tests.models import gguf_missing_tensor, tiny_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e

GIB = 2**30
PATH = re.compile(r"(?<![\w.:/~-])/[\w.@+~-]+/[\w.@+~/-]*")  # an absolute path of two segments or more
# The engine's (or the worker's) own words for each cause, as the reason must carry them.
CAUSES = {
    "truncated": ("a", ["exited with code", "llama_model_load"]),
    "missing": ("a", ["the weights lack 1 tensor(s) the model needs: model.layers.1.mlp.up_proj.weight"]),
    "oom": ("a", ["insufficient memory", "failed to allocate buffer for kv cache"]),
    "variant": ("g", ["wrong engine build", "is a CPU-only build", "pip install torch --index-url"]),
}


@dataclass
class Failing:
    base: Path
    agents: dict[str, Agent]
    file: Path
    router: str
    plan: subprocess.CompletedProcess[str]
    apply: subprocess.CompletedProcess[str]

    @property
    def state_dir(self) -> Path:
        return self.base / "state"

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleet_bin(), *args, "-f", str(self.file)], capture_output=True, text=True, timeout=120,
                              env=agent_env(FLEET_STATE_DIR=str(self.state_dir)), stdin=subprocess.DEVNULL)


def broken_models(models: Path) -> dict[str, Path]:
    from safetensors.numpy import load_file, save_file

    truncated = gguf_missing_tensor(models, "truncated.gguf")  # well-formed, but llama.cpp cannot load it
    src, missing = tiny_safetensors(models), models / "missing-tensor"
    missing.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, missing / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(missing / "model.safetensors"), metadata={"format": "pt"})
    # Its KV cache at the schema's largest context (10,485,760 tokens) takes 40 GiB a layer in f16:
    # layers enough for twice this machine's memory, so the allocation fails for real.
    layers = max(2, math.ceil(2 * psutil.virtual_memory().total / (40 * GIB)))
    wide = models / f"wide-{layers}.gguf"
    if not wide.exists():
        make_gguf(wide, Shape(layers=layers, hidden=1024, intermediate=64, heads=8, kv_heads=8))
    return {"truncated": truncated, "missing": missing, "oom": wide}


def fleet_file(base: Path, agents: dict[str, Agent], digests: dict[str, str], listen: str) -> Path:
    port = free_port("127.0.0.2", "127.0.0.3")
    fmt = {"truncated": "gguf", "missing": "safetensors", "oom": "gguf", "variant": "safetensors"}
    settings = {"truncated": "{threads: 1}", "missing": "{threads: 1}",
                "oom": "{threads: 1, context_length: 10485760}", "variant": "{threads: 1, tensor_parallel: 1}"}
    models = "\n".join(f"  {c}-model: {{format: {fmt[c]}, digest: \"{digests[c]}\", source: {CAUSES[c][0]}}}"
                       for c in CAUSES)
    clusters = "\n".join(f"  {c}: {{model: {c}-model, members: [{CAUSES[c][0]}], port: {port + i}, "
                         f"settings: {settings[c]}}}" for i, c in enumerate(CAUSES))
    nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
    path = base / "fleet.yaml"
    path.write_text(f"version: 1\ncontrol_plane: {{node: a, listen: {listen}}}\nnodes:\n{nodes}\nmodels:\n{models}\n"
                    f"clusters:\n{clusters}\n")
    return path


@pytest.fixture(scope="module")
def failing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Failing]:
    base = tmp_path_factory.mktemp("failures")
    gpus = base / "gpus.json"  # the seam for GPUs on a machine without any (fleet-agent --simulate-gpus)
    gpus.write_text(json.dumps([{"name": "NVIDIA H100 80GB HBM3", "memory_total_bytes": 80 * GIB}] * 2))
    port = free_port("127.0.0.2", "127.0.0.3")
    agents = {"a": Agent("a", "127.0.0.2", port, base / "a"),
              "g": Agent("g", "127.0.0.3", port, base / "g", args=["--simulate-gpus", str(gpus)])}
    serve = None
    try:
        for a in agents.values():
            a.start()
        paths = broken_models(base / "models")
        digests = {c: import_model(agents["a"], p) for c, p in paths.items()}
        digests["variant"] = import_model(agents["g"], tiny_safetensors(base / "models"))
        listen = f"127.0.0.2:{free_port('127.0.0.2')}"
        f = Failing(base, agents, fleet_file(base, agents, digests, listen), f"http://{listen}/v1",
                    subprocess.CompletedProcess([], 0), subprocess.CompletedProcess([], 0))
        f.plan = f.run("plan")
        f.apply = f.run("apply", "--auto-approve")
        serve = start_serve(f, listen, interval=0.5)
        deadline = time.monotonic() + 60
        while True:  # until the heartbeat has recorded every server
            nodes = f.run("nodes", "--json")
            rows = json.loads(nodes.stdout)["servers"] if nodes.returncode == 0 else []
            if len(rows) == len(CAUSES) and all(r["state"] == "failed" for r in rows):
                break
            assert time.monotonic() < deadline, f"servers not all recorded failed: {nodes.stdout}{nodes.stderr}"
            time.sleep(0.2)
        yield f
    finally:
        if serve is not None:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)
        for a in agents.values():
            a.stop()


def test_apply_fails_each_server_with_its_cause(failing: Failing) -> None:
    assert failing.apply.returncode != 0, failing.apply.stdout
    for cluster, (node, words) in CAUSES.items():
        s = failing.agents[node].get(f"/v1/servers/{cluster}@{node}").json()
        assert s["state"] == "failed"
        for w in words:
            assert w in s["reason"], (cluster, s["reason"])


def test_wrong_build_is_in_the_state_the_plan_and_nodes(failing: Failing) -> None:
    findings = failing.agents["g"].get("/v1/state").json()["variant"]["findings"]
    torch = next(f for f in findings if f["check"] == "variant:torch")
    assert torch["level"] == "error" and "2 NVIDIA GPU(s) present" in torch["message"]
    assert "download.pytorch.org/whl/cu128" in torch["install"]
    assert "findings" not in failing.agents["a"].get("/v1/state").json()["variant"]  # no GPUs, CPU torch: fine
    assert "engine_build_mismatch" in failing.plan.stdout + failing.plan.stderr
    plan = json.loads(failing.run("plan", "--json").stdout)
    warned = [d for d in plan["diagnostics"] if d["code"] == "engine_build_mismatch"]
    assert {d["address"] for d in warned} == {"node.g"}
    assert any("pip install torch --index-url https://download.pytorch.org/whl/cu128" in d["detail"] for d in warned)
    wide = failing.run("nodes", "--wide")
    assert wide.returncode == 0, wide.stderr
    assert "cpu (MISMATCH)" in wide.stdout
    assert "g (variant:torch): 2 NVIDIA GPU(s) present but torch" in wide.stdout
    assert "download.pytorch.org/whl/cu128" in wide.stdout


@pytest.mark.parametrize("cluster", list(CAUSES))
def test_nodes_wide_shows_the_full_reason(failing: Failing, cluster: str) -> None:
    node, words = CAUSES[cluster]
    wide = failing.run("nodes", "--wide").stdout
    reason = failing.agents[node].get(f"/v1/servers/{cluster}@{node}").json()["reason"]
    shown = " ".join(wide[wide.index(f"{cluster}@{node} (failed): "):].split())  # tabs expanded by the table
    assert len(reason.splitlines()) >= 3
    for line in reason.splitlines():  # every line of it, not the first alone
        assert " ".join(line.split()) in shown, line
    for w in words:
        assert w in shown


@pytest.mark.parametrize("cluster", list(CAUSES))
def test_a_client_gets_a_503_naming_the_machine_with_the_reason_scrubbed(failing: Failing, cluster: str) -> None:
    node, words = CAUSES[cluster]
    for path, body in (("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/completions", {"prompt": "hi", "stream": True})):
        r = httpx.post(failing.router + path, json={"model": cluster, "max_tokens": 4, **body}, timeout=30)
        assert r.status_code == 503, r.text
        error: dict[str, Any] = r.json()["error"]
        assert error["code"] == "no_running_member"
        message = error["message"]
        assert f"cluster '{cluster}' has no running member: {node}: server failed (" in message
        for w in words:
            assert w in message
        assert "--- last lines of its output" in message  # the tail too, not the first line alone
        for a in failing.agents.values():
            assert str(a.home) not in message
        assert str(failing.base) not in message and "site-packages" not in message
        assert not PATH.search(message), PATH.search(message)
