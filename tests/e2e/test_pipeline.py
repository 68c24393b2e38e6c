"""Pipeline-parallel serving end to end: SmolLM2-135M-Instruct (its float32 safetensors twin)
imported on cp, split into stages on real agents on loopback (two: a 0-14, b 15-29; three: a 0-9,
b 10-19, cp 20-29), planned and applied from fleet.yaml, served through `fleet serve` to the
official openai client. The pipeline's greedy tokens must equal the whole model's on one node,
streamed and not; a stage killed mid-stream fails its group visibly until the next apply. The
whole model is one server for both layouts, each of its answers asked once in the module."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.agents import free_port
from tests.fleets import Fleet, import_model, start_serve, stop_serve, three_node_fleet

pytestmark = pytest.mark.e2e

LAYOUTS = {"2 stages": [("a", "0-14"), ("b", "15-29")],
           "3 stages": [("a", "0-9"), ("b", "10-19"), ("cp", "20-29")]}
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.",
           "Name three primary colors and say why they are called primary."]
SETTINGS = "{context_length: 2048, threads: 1, startup_timeout_s: 300}"
KILLED = "b"  # the stage killed mid-stream: the last of two, the middle of three


@dataclass
class Served:
    smol: Smol
    fleet: Fleet
    base: str  # the router's /v1
    layout: list[tuple[str, str]]
    plan: str  # what `fleet plan` printed before the apply
    rendezvous: int
    port: int


def ports(n: int) -> list[int]:
    """n distinct ports free on every loopback address the fleet uses."""
    out: list[int] = []
    while len(out) < n:
        p = free_port("127.0.0.2", "127.0.0.3", "127.0.0.4")
        if p not in out:
            out.append(p)
    return out


@dataclass
class Smol:
    fleet: Fleet
    whole: int  # the port of the whole model on cp: the same server under both layouts
    answers: dict[tuple[str, bool], tuple[str, str | None]]  # the whole model's, asked once each


@pytest.fixture(scope="module")
def smol_fleet(tmp_path_factory: pytest.TempPathFactory, smollm2_f32: Path) -> Iterator[Smol]:
    with three_node_fleet(tmp_path_factory.mktemp("pipeline")) as f:
        f.digests["smol"] = import_model(f.agents["cp"], smollm2_f32)
        yield Smol(f, ports(1)[0], {})


def write(f: Fleet, layout: list[tuple[str, str]], whole: int, port: int, rendezvous: int, listen: str) -> None:
    slices = ", ".join(f'{{node: {n}, layers: "{layers}"}}' for n, layers in layout)
    members = ", ".join(n for n, _ in layout)
    f.write(listen=listen,
            extra_models=f'  smol: {{format: safetensors, digest: "{f.digests["smol"]}", source: cp, layers: 30}}',
            replicas=f"  smol: [{slices}]",
            clusters=f"  whole: {{model: smol, members: [cp], port: {whole}, settings: {SETTINGS}}}\n"
                     f"  big: {{model: smol, members: [{members}], port: {port}, "
                     f"pipeline: {{rendezvous_port: {rendezvous}}}, settings: {SETTINGS}}}")


@pytest.fixture(scope="module", params=list(LAYOUTS))
def served(smol_fleet: Smol, request: pytest.FixtureRequest) -> Iterator[Served]:
    f, layout, whole = smol_fleet.fleet, LAYOUTS[request.param], smol_fleet.whole
    port, rendezvous, router = [p for p in ports(4) if p != whole][:3]
    listen = f"127.0.0.2:{router}"
    write(f, layout, whole, port, rendezvous, listen)
    validated = f.run("validate")
    assert validated.returncode == 0, validated.stdout + validated.stderr
    planned = f.run("plan")
    assert planned.returncode in (0, 2), planned.stdout + planned.stderr
    applied = f.run("apply", "--auto-approve", timeout=900)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    # `fleet serve` reads fleet.yaml once: one per layout.
    proc = start_serve(f, listen, interval=0.5, args=("--misses", "2"), log=f"serve-{len(layout)}.log")
    try:
        base = f"http://{listen}/v1"
        wait_answering(base, "big")
        yield Served(smol_fleet, f, base, layout, planned.stdout, rendezvous, port)
    finally:
        stop_serve(proc)


def wait_answering(base: str, cluster: str, timeout: float = 120) -> None:
    """Until the router relays a request to `cluster` (its heartbeat saw every stage running)."""
    deadline, last = time.monotonic() + timeout, ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{base}/completions", json={"model": cluster, "prompt": "Hi", "max_tokens": 1},
                           timeout=60)
            if r.status_code == 200:
                return
            last = r.text
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.25)
    raise AssertionError(f"{cluster} did not answer within {timeout:g}s: {last}")


def server_of(f: Fleet, node: str, cluster: str = "big") -> dict[str, Any]:
    return next(s for s in f.agents[node].get("/v1/state").json()["servers"] if s["id"] == f"{cluster}@{node}")


def ask(client: openai.OpenAI, model: str, prompt: str, stream: bool) -> tuple[str, str | None]:
    messages: Any = [{"role": "user", "content": prompt}]
    if not stream:
        r = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24)
        return r.choices[0].message.content or "", r.choices[0].finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=24,
                                                stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


def whole_answer(served: Served, client: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, str | None]:
    """The whole model's greedy answer, asked of its one server once per prompt and mode."""
    key = (prompt, stream)
    if key not in served.smol.answers:
        served.smol.answers[key] = ask(client, "whole", prompt, stream)
    return served.smol.answers[key]


def test_the_plan_starts_the_stages_as_one_group(served: Served) -> None:
    stages = ", ".join(f"{n} {layers}" for n, layers in served.layout)
    assert (f"pipeline big: {len(served.layout)} stages ({stages}), rendezvous 127.0.0.3:{served.rendezvous}"
            in served.plan), served.plan
    groups = set()
    for rank, (node, layers) in enumerate(served.layout):
        s = server_of(served.fleet, node)
        assert s["state"] == "running" and s["port"] == served.port
        assert s["pipeline"]["rank"] == rank and s["pipeline"]["world_size"] == len(served.layout), s
        groups.add(s["pipeline"]["group"])
        held = {w["digest"]: w for w in served.fleet.agents[node].get("/v1/state").json()["weights"]}
        assert held[s["model"]]["slice"]["layers"] == layers  # a stage serves its slice
    assert len(groups) == 1
    nodes = json.loads(served.fleet.run("nodes", "--json").stdout)
    assert {r["id"]: r["state"] for r in nodes["servers"] if r["cluster"] == "big"} == {
        f"big@{n}": "running" for n, _ in served.layout}


@pytest.mark.parametrize("stream", [False, True], ids=["whole-answer", "streamed"])
def test_greedy_tokens_equal_the_whole_model_on_one_node(served: Served, stream: bool) -> None:
    client = openai.OpenAI(base_url=served.base, api_key="unused", max_retries=0, timeout=300)
    for prompt in PROMPTS:
        whole = whole_answer(served, client, prompt, stream)
        assert whole[0] and whole[1] in ("stop", "length"), whole
        assert ask(client, "big", prompt, stream) == whole, prompt


def test_a_stage_killed_mid_stream_fails_its_group_until_the_next_apply(served: Served) -> None:
    f, base = served.fleet, served.base
    body = {"model": "big", "messages": [{"role": "user", "content": "Tell me everything about the sea."}],
            "max_tokens": 1000, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: ")
        os.kill(server_of(f, KILLED)["pid"], signal.SIGKILL)
        rest = b"".join(chunks)
    errors = [json.loads(line[6:]) for line in rest.split(b"\n") if line.startswith(b"data: {") and b'"error"' in line]
    assert errors, rest[-2000:]
    assert f"node {KILLED}" in errors[-1]["error"]["message"], errors[-1]
    for a in f.agents.values():
        assert str(a.home) not in rest.decode(errors="replace")  # scrubbed as any member's answer

    # Every stage goes failed (the killed one and those that lost it), each with its reason.
    deadline = time.monotonic() + 90
    while True:
        rows = {r["id"]: r for r in json.loads(f.run("nodes", "--json").stdout)["servers"] if r["cluster"] == "big"}
        if all(r["state"] == "failed" for r in rows.values()):
            break
        assert time.monotonic() < deadline, rows
        time.sleep(0.5)
    for node, _ in served.layout:
        if node != KILLED:
            assert f"node {KILLED}" in rows[f"big@{node}"]["reason"], rows
    wide = f.run("nodes", "--wide")
    assert wide.returncode == 0
    for r in rows.values():
        for line in r["reason"].splitlines():
            assert line.strip() in wide.stdout, (line, wide.stdout)

    refused = httpx.post(f"{base}/chat/completions", json={**body, "stream": False, "max_tokens": 4}, timeout=60)
    assert refused.status_code >= 500, refused.text
    message = refused.json()["error"]["message"]
    assert f"{KILLED}: server failed" in message, message
    for a in f.agents.values():
        assert str(a.home) not in message

    # The control plane never restarts anything on its own: an apply brings the whole group back.
    planned = f.run("plan")
    for node, _ in served.layout:
        assert f"server.big@{node}" in planned.stdout, planned.stdout
    applied = f.run("apply", "--auto-approve", timeout=900)
    assert applied.returncode == 0, applied.stdout + applied.stderr
    wait_answering(base, "big")
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
    assert ask(client, "big", PROMPTS[0], False) == whole_answer(served, client, PROMPTS[0], False)
