"""`fleet serve` with real agents, real engines and the official openai client pointed at the
control plane: relayed answers, scrubbed paths, offline members, a member dying mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.agents import free_port
from tests.fleets import Fleet, chat, start_serve, stop_serve, three_node_fleet

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str, subprocess.Popen[str]]]:
    with three_node_fleet(tmp_path_factory.mktemp("serve")) as f:
        listen = f"127.0.0.2:{free_port('127.0.0.2')}"
        f.write(replicas="  tiny: [a, b]", listen=listen,
                clusters=chat(f, "[a, b]") + f"\n  local: {{model: tiny-q, members: [cp], port: {free_port('127.0.0.2')}}}")
        applied = f.run("apply", "--auto-approve")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen, interval=0.5, args=("--misses", "2"))
        try:
            yield f, f"http://{listen}/v1", proc
        finally:
            stop_serve(proc)


def deltas(chunks: list[Any]) -> tuple[str, list[str]]:
    """A stream's text and its finish reasons. Not its cut into chunks: an engine hands a reader that
    fell behind the tokens it has in one piece (the torch worker's outbox), so the same answer comes
    cut differently through the router than straight from the worker when the machine is busy."""
    return ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices),
            [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason])


def member_of(f: Fleet, node: str, cluster: str) -> dict[str, Any]:
    return next(s for s in f.agents[node].get("/v1/state").json()["servers"] if s["id"] == f"{cluster}@{node}")


@pytest.mark.parametrize("cluster, node", [("local", "cp"), ("chat", "a")], ids=["gguf-on-cp", "safetensors-remote"])
def test_answers_through_the_router_equal_the_worker_scrubbed(served: tuple[Fleet, str, Any], cluster: str,
                                                             node: str) -> None:
    f, base, _ = served
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=120)
    done = client.completions.create(model=cluster, prompt="The fleet", max_tokens=6, temperature=0)
    assert done.choices[0].finish_reason in ("stop", "length")
    messages = [{"role": "user", "content": "Hello there"}]
    routed = list(client.chat.completions.create(model=cluster, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True))
    port, credential = member_of(f, node, cluster)["port"], member_of(f, node, cluster)["credential"]
    direct_client = openai.OpenAI(base_url=f"http://{f.agents[node].address}:{port}/v1", api_key=credential,
                                  max_retries=0)
    direct = list(direct_client.chat.completions.create(model=cluster, messages=messages, max_tokens=8,
                                                        temperature=0, stream=True))
    if cluster == "chat":  # two members: make sure the routed answer came from this node's twin
        assert deltas(routed) == deltas(direct) or deltas(routed) == deltas(list(
            openai.OpenAI(base_url=f"http://{f.agents['b'].address}:{port}/v1",
                          api_key=member_of(f, "b", cluster)["credential"], max_retries=0)
            .chat.completions.create(model=cluster, messages=messages, max_tokens=8, temperature=0, stream=True)))
    else:
        assert deltas(routed) == deltas(direct)
    raw = httpx.post(f"{base}/chat/completions", json={"model": cluster, "messages": messages, "max_tokens": 4,
                                                        "stream": True}, timeout=120).text
    models = httpx.get(f"{base}/models", timeout=30).text
    for text in (raw, models, done.model_dump_json()):
        for a in f.agents.values():
            assert str(a.home) not in text  # no store path, no home directory
    assert all(c.model == cluster for c in routed)


def test_unknown_cluster_and_no_running_member(served: tuple[Fleet, str, Any]) -> None:
    _, base, _ = served
    r = httpx.post(f"{base}/completions", json={"model": "nope", "prompt": "x"}, timeout=30)
    assert r.status_code == 404 and "nope" in r.json()["error"]["message"]


def test_a_member_dying_mid_stream_ends_the_stream_naming_it(served: tuple[Fleet, str, Any]) -> None:
    f, base, _ = served
    body = {"model": "chat", "messages": [{"role": "user", "content": "Tell me everything"}], "max_tokens": 240,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/chat/completions", json=body, timeout=120) as r:
        chunks = r.iter_raw()
        first = next(chunks)
        assert first.startswith(b"data: ")
        # With no other request in flight the router picks the first member in line, a.
        os.kill(member_of(f, "a", "chat")["pid"], signal.SIGKILL)
        rest = b"".join(chunks)
    assert b"member_failed_mid_stream" in rest and rest.rstrip().endswith(b"data: [DONE]")
    event = json.loads(next(line for line in rest.split(b"\n") if b"member_failed_mid_stream" in line)[6:])
    assert event["error"]["node"] == "a" and "on a failed mid-stream" in event["error"]["message"]
    for _ in range(3):  # the next requests go to the healthy member, b
        r2 = httpx.post(f"{base}/chat/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=60)
        assert r2.status_code == 200, r2.text
    # An apply brings them back (the control plane never restarts anything on its own).
    assert f.run("apply", "--auto-approve").returncode == 0


def test_offline_node_alert_raised_routed_around_and_cleared(served: tuple[Fleet, str, Any]) -> None:
    f, base, _ = served
    b = f.agents["b"]
    b.stop(signal.SIGKILL)  # its worker dies with it
    deadline = time.monotonic() + 30
    while "node_offline b" not in (alerts := f.run("alerts").stdout):
        assert time.monotonic() < deadline, alerts
        time.sleep(0.2)
    nodes = json.loads(f.run("nodes", "--json").stdout)
    assert {r["id"]: r["state"] for r in nodes["servers"]}["chat@b"] == "node_offline"
    for _ in range(4):  # every request goes to the member that is up
        r = httpx.post(f"{base}/completions", json={"model": "chat", "prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text
    wide = f.run("nodes", "--wide")
    assert wide.returncode == 0 and "offline" in wide.stdout and "connection refused" in wide.stdout
    b.start()
    deadline = time.monotonic() + 30
    while "node_offline" in (alerts := f.run("alerts").stdout):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert "cleared" in f.run("alerts", "--all").stdout
    # b is back without its server (its agent restarted): drift, until an apply starts it again.
    assert "drift fleet" in alerts and "start server.chat@b" in alerts
