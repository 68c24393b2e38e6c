"""Pipeline stages as real processes on loopback (no control plane): the tiny Llama split into
slices as an agent holds them gives exactly the whole model's tokens through torch_worker; rows are
freed on every stage when a client leaves; a stage that dies, stops answering, never joins or cannot
load ends every stage with one reason naming it; and the agent's Workers start and supervise a
group. SmolLM2-135M-Instruct (its float32 twin) in 2 and 3 stages, through a whole fleet, is
tests/e2e/test_pipeline.py's: its answers are asked once per layout, there."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
import trio

from agent.api.server import Spawner
from agent.backends.forkserver import ForkServer
from agent.backends.launch import ProcessLauncher
from agent.weights.store import Store
from agent.serving.supervisor import RequestRefused, Workers
from reconciler.agents.netutil import free_port
from tests import forked
from tests.addresses import loopback
from tests.integration.test_torch_worker import Worker, sse_events, together
from tests.models import hold_slices, sliced, tiny_safetensors

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

ADDRESSES = loopback(3)
PROMPTS = ["The fleet", "Weights are pinned by digest and replicated from a peer", "A cluster serves one model",
           "Hello! How can I help you today? I am a tiny model made for tests."]


def details(spans: list[str], rank: int, port: int, group: str = "0123456789abcdef") -> dict[str, Any]:
    return {"group": group, "rank": rank, "world_size": len(spans),
            "rendezvous": {"address": ADDRESSES[0], "port": port + 1},
            "stages": [{"node": f"node{i}", "address": ADDRESSES[i], "layers": s} for i, s in enumerate(spans)]}


@pytest.mark.parametrize("change, message", [
    ({"world_size": 3}, "world_size 3 does not match its 2 stages"),
    ({"rank": 2}, "rank must be an integer 0-1"),
    ({"stages": [{"node": "a", "address": "x", "layers": "0-1"}, {"node": "b", "address": "y", "layers": "3"}]},
     r"stages\[1\] starts at layer 3, not at 2"),
    ({"stages": [{"node": "a", "address": "x", "layers": "1-3"}, {"node": "b", "address": "y", "layers": "4"}]},
     r"stages\[0\] starts at layer 1, not at 0"),
    ({"rendezvous": {"address": "x", "port": 0}}, "rendezvous.port must be an integer 1-65535"),
    ({"group": ""}, "group must be a non-empty string"),
], ids=["world-size", "rank", "gap", "not-from-0", "port", "group"])
def test_pipeline_details_are_checked_before_any_process(change: dict[str, Any], message: str) -> None:
    from agent.backends.pipeline.spec import check_details
    from agent.backends.launch import BadSettings

    with pytest.raises(BadSettings, match=message):
        check_details({**details(["0-1", "2-3"], 0, 9000), **change})


def test_a_stage_is_launched_with_its_details_settings_and_reason_file() -> None:
    from agent.serving.registry import BACKENDS, PIPELINE, for_format
    from agent.backends.launch import BadSettings

    spec = BACKENDS[PIPELINE]
    assert for_format("safetensors") is BACKENDS["torch"]  # a whole model never goes to the stage worker
    settings = {"threads": 2, "context_length": 512, "startup_timeout_s": 300, "pipeline": details(["0-1", "2-3"], 1, 9000),
                "reason_file": "/agent/servers/big@b.reason"}
    argv = spec.command("/store/slice", "10.0.0.2", 9000, settings, lambda d, w: d).argv
    assert argv[1:9] == ("-m", "agent.backends.pipeline.stage", "--model", "/store/slice", "--host", "10.0.0.2",
                         "--port", "9000")
    assert json.loads(argv[argv.index("--pipeline") + 1]) == details(["0-1", "2-3"], 1, 9000)
    assert argv[11:] == ("--context-length", "512", "--threads", "2", "--join-timeout", "150", "--reason-file",
                         "/agent/servers/big@b.reason")
    with pytest.raises(BadSettings, match="speculatively"):
        spec.command("/s", "h", 1, {**settings, "speculative": {"mode": "prompt_lookup"}}, lambda d, w: d)


class Pipeline:
    """`python -m agent.backends.pipeline.stage` once per slice, stage i on ADDRESSES[i], all on one
    port (as a cluster's members), forked from the test process's fork server (tests/forked.py),
    each one's output in its own log; stopped on exit."""

    def __init__(self, forks: ForkServer, dirs: list[Path], spans: list[str], logs: Path, *extra: str,
                 wait: bool = True) -> None:
        self.port = free_port(*ADDRESSES[:len(dirs)])
        while not _free(ADDRESSES[0], self.port + 1):  # the rendezvous, on the first stage's address
            self.port = free_port(*ADDRESSES[:len(dirs)])
        self.url = f"http://{ADDRESSES[0]}:{self.port}"
        self.logs = [logs / f"stage{i}.log" for i in range(len(dirs))]
        self.reasons = [logs / f"stage{i}.reason" for i in range(len(dirs))]
        self.procs = []
        for i, d in enumerate(dirs):
            argv = [sys.executable, "-m", "agent.backends.pipeline.stage", "--model", str(d), "--host", ADDRESSES[i],
                    "--port", str(self.port), "--pipeline", json.dumps(details(spans, i, self.port)),
                    "--threads", "1", "--reason-file", str(self.reasons[i]), *extra]
            self.procs.append(forked.start(forks, argv, self.logs[i]))
        if wait:
            self.wait_healthy()

    def stage_url(self, i: int) -> str:
        return f"http://{ADDRESSES[i]}:{self.port}"

    def wait_healthy(self, timeout: float = 180) -> None:
        deadline = time.monotonic() + timeout
        for i, proc in enumerate(self.procs):
            while True:
                try:
                    if httpx.get(self.stage_url(i) + "/health", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"stage {i} did not come up:\n{self.output(i)[-3000:]}")
                time.sleep(0.2)

    def output(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def health(self, i: int) -> dict[str, Any]:
        body = httpx.get(self.stage_url(i) + "/health", timeout=5).json()
        out: dict[str, Any] = body["engine"] if i == 0 else body["stage"]
        return out

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def exits(self, timeout: float = 30) -> list[int]:
        return [p.wait(timeout) for p in self.procs]

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def answers(client: openai.OpenAI, prompts: list[str], max_tokens: int = 30, **extra: Any) -> list[str]:
    settings = {"temperature": 0, **extra}
    return [str(client.completions.create(model="m", prompt=p, max_tokens=max_tokens, **settings).choices[0].text)
            for p in prompts]


def streamed(client: openai.OpenAI, prompt: str, max_tokens: int) -> str:
    return "".join(c.choices[0].text for c in client.completions.create(
        model="m", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True) if c.choices)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_safetensors(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def whole(models: Path, forks: ForkServer) -> Iterator[Worker]:
    w = Worker(forks, models, "--max-batch", "8")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def two(models: Path, tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Pipeline]:
    spans = ["0-1", "2-3"]
    p = Pipeline(forks, sliced(models, spans, models.parent), spans, tmp_path_factory.mktemp("two"), "--stream-buffer", "4")
    yield p
    p.stop()


def test_two_stages_give_the_whole_models_tokens(two: Pipeline, whole: Worker) -> None:
    assert answers(two.client(), PROMPTS) == answers(whole.client(), PROMPTS)
    assert streamed(two.client(), PROMPTS[1], 40) == streamed(whole.client(), PROMPTS[1], 40)
    at_once = together([lambda p=p, i=i: answers(two.client(), [p], 24 + 4 * i)[0] for i, p in enumerate(PROMPTS)])
    assert at_once == [answers(whole.client(), [p], 24 + 4 * i)[0] for i, p in enumerate(PROMPTS)]
    assert two.health(0)["widest_step"] >= 2, "nothing ran batched"
    seeded = {"temperature": 1.0, "seed": 7, "top_p": 0.9}
    assert answers(two.client(), PROMPTS[:2], 16, **seeded) == answers(whole.client(), PROMPTS[:2], 16, **seeded)
    chat = [{"role": "user", "content": "Hello!"}]
    assert (two.client().chat.completions.create(model="m", messages=chat, max_tokens=12, temperature=0)  # type: ignore[arg-type]
            .choices[0].message.content == whole.client().chat.completions.create(
                model="m", messages=chat, max_tokens=12, temperature=0).choices[0].message.content)  # type: ignore[arg-type]


def test_later_stages_serve_health_only_and_count_what_they_send(two: Pipeline) -> None:
    r = httpx.get(two.stage_url(1) + "/health").json()
    assert r["status"] == "ok" and r["pipeline"] == {"group": "0123456789abcdef", "rank": 1, "world_size": 2}
    other = httpx.post(two.stage_url(1) + "/v1/completions", json={"prompt": "x"})
    assert other.status_code == 404 and f"requests go to stage 0 at {ADDRESSES[0]}:{two.port}" in other.text
    before = two.health(0)
    r = two.client().completions.create(model="m", prompt="The fleet", max_tokens=20, temperature=0)
    after = two.health(0)
    assert r.usage is not None and r.usage.completion_tokens == 20
    hidden = 64 * 4  # the tiny model's hidden size, float32
    # The prompt's rows once (prefill), then one row per token after the first.
    assert after["sent_activations"] - before["sent_activations"] == hidden * (r.usage.prompt_tokens + 19)
    # One 256-byte frame per step, one more for the row leaving, and an idle tick every 2 s around them.
    assert 21 <= (after["sent_frames"] - before["sent_frames"]) // 256 <= 25


def test_a_client_that_leaves_frees_its_rows_on_every_stage(two: Pipeline) -> None:
    with httpx.stream("POST", two.url + "/v1/completions", timeout=30,
                      json={"prompt": "The fleet", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n == 3:
                assert two.health(0)["rows"] == 1 and two.health(1)["rows"] == 1
                break
    deadline = time.monotonic() + 10
    while (two.health(0)["rows"], two.health(1)["rows"]) != (0, 0):
        assert time.monotonic() < deadline, (two.health(0), two.health(1))
        time.sleep(0.1)


def test_a_slow_reader_gets_every_token_and_stalls_no_one(two: Pipeline, whole: Worker) -> None:
    expected = answers(whole.client(), ["The fleet"], 200)[0]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # the worker feels its reader stop
    sock.connect((ADDRESSES[0], two.port))
    payload = json.dumps({"prompt": "The fleet", "max_tokens": 200, "temperature": 0, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    time.sleep(1.5)  # the reader reads nothing: its row goes aside, the others go on
    assert answers(two.client(), ["A cluster"], 30)[0] == answers(whole.client(), ["A cluster"], 30)[0]
    assert two.health(0)["set_aside"] >= 1
    raw = b""
    while not raw.endswith(b"0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, "the stream ended early"
        raw += chunk
    sock.close()
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == expected


def test_a_killed_stage_ends_the_stream_naming_it_and_every_stage_exits(models: Path, tmp_path: Path, forks: ForkServer) -> None:
    spans = ["0-1", "2", "3"]
    p = Pipeline(forks, sliced(models, spans, models.parent), spans, tmp_path)
    try:
        named = f"pipeline stage 1 (node node1, {ADDRESSES[1]}:{p.port}, layers 2)"
        events = []
        with httpx.stream("POST", p.url + "/v1/completions", timeout=30,
                          json={"prompt": "The fleet", "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            for n, line in enumerate(r.iter_lines()):
                if n == 4:
                    p.procs[1].kill()
                if line:
                    events.append(line)
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert events[-1] == "data: [DONE]" and error["message"].startswith(named + " stopped answering")
        assert error["code"] == "pipeline_stage_failed", error
        refused = httpx.post(p.url + "/v1/completions", json={"prompt": "x"})
        assert refused.status_code == 503 and refused.json()["error"]["message"].startswith(named)
        codes = p.exits()
        assert codes[0] == codes[2] == 3 and codes[1] == -signal.SIGKILL
        for i in (0, 2):
            assert p.reasons[i].read_text().startswith(named + " stopped answering"), p.output(i)
            assert p.output(i).rstrip().splitlines()[-1].startswith(named)
    finally:
        p.stop()


def test_a_silent_stage_is_named_once_its_heartbeat_stops(models: Path, tmp_path: Path, forks: ForkServer) -> None:
    spans = ["0-1", "2-3"]
    p = Pipeline(forks, sliced(models, spans, models.parent), spans, tmp_path, "--silence-timeout", "2")
    try:
        os.kill(p.procs[1].pid, signal.SIGSTOP)
        assert p.procs[0].wait(30) == 3
        assert p.reasons[0].read_text().strip() == (f"pipeline stage 1 (node node1, {ADDRESSES[1]}:{p.port}, "
                                                   "layers 2-3) stopped answering: no heartbeat for 2 s")
    finally:
        os.kill(p.procs[1].pid, signal.SIGCONT)
        p.stop()


def test_a_stage_that_never_joins_is_named(models: Path, tmp_path: Path, forks: ForkServer) -> None:
    spans = ["0-1", "2-3"]
    p = Pipeline(forks, sliced(models, spans, models.parent)[:1], spans, tmp_path, "--join-timeout", "2", wait=False)
    try:
        assert p.exits(60) == [3]
        assert p.reasons[0].read_text().strip() == (
            f"pipeline group 0123456789abcdef did not form within 2 s: pipeline stage 1 (node node1, "
            f"{ADDRESSES[1]}:{p.port}, layers 2-3) never joined")
    finally:
        p.stop()


def test_a_stage_that_cannot_load_fails_the_group(models: Path, tmp_path: Path, forks: ForkServer) -> None:
    spans = ["0-1", "2-3"]
    first, _ = sliced(models, spans, models.parent)
    p = Pipeline(forks, [first, first], spans, tmp_path, wait=False)  # stage 1 is handed the first slice
    try:
        assert p.exits(120) == [3, 3]
        reason = f"pipeline stage 1 (node node1, {ADDRESSES[1]}:{p.port}, layers 2-3) could not load its slice"
        assert [r.read_text().strip() for r in p.reasons] == [reason, reason]  # the group's: a code, no text
        assert f"{reason}: {first} holds layers 0-1, not all of 2-3" in p.output(1)  # what it saw, in its own log
    finally:
        p.stop()


def test_workers_start_a_group_from_held_slices_and_fail_it_whole(models: Path, tmp_path: Path, forks: ForkServer) -> None:
    spans = ["0-1", "2-3"]
    stores = [Store(tmp_path / f"node{i}") for i in range(2)]
    digests = [hold_slices(stores[i], models, spans)[i] for i in range(2)]
    port = free_port(*ADDRESSES[:2])

    async def main() -> None:
        spawner = Spawner()
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            workers = [Workers(tmp_path / f"node{i}", stores[i], spawner, ProcessLauncher(forks), ADDRESSES[i])
                       for i in range(2)]
            for i, w in enumerate(workers):
                with pytest.raises(RequestRefused) as info:
                    w.start({"id": "big", "model": digests[i], "port": port})
                assert info.value.code == "model_is_slice"
                with pytest.raises(RequestRefused) as info:
                    w.start({"id": "big", "model": digests[i], "port": port, "pipeline": details(spans, 1 - i, port)})
                assert info.value.code == "pipeline_slice_mismatch" and f"holds layers {spans[i]}" in info.value.message
                with pytest.raises(RequestRefused) as info:
                    w.start({"id": "big", "model": digests[i], "port": port, "pipeline": {**details(spans, i, port),
                                                                                          "world_size": 3}})
                assert (info.value.status, info.value.code) == (400, "bad_request")
            servers = [w.start({"id": "big", "model": digests[i], "port": port, "settings": {"threads": 1},
                                "pipeline": details(spans, i, port)}) for i, w in enumerate(workers)]
            assert servers[1].to_json()["pipeline"] == {"group": "0123456789abcdef", "rank": 1, "world_size": 2}
            with trio.fail_after(180):
                while any(s.state == "starting" for s in servers):
                    await trio.sleep(0.1)
            assert [s.state for s in servers] == ["running", "running"], [s.reason for s in servers]
            async with httpx.AsyncClient() as client:
                r = await client.post(f"http://{ADDRESSES[0]}:{port}/v1/completions",
                                      json={"prompt": "The fleet", "max_tokens": 5, "temperature": 0}, timeout=60,
                                      headers={"Authorization": f"Bearer {servers[0].credential}"})
                assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
                assert r.json()["model"] == "big"  # the cluster's name (the id's first part), not a path
                for i in range(2):  # no stage answers without its own credential, /health included
                    bare = await client.get(f"http://{ADDRESSES[i]}:{port}/health", timeout=10)
                    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_worker_credential"
            assert servers[1].pid is not None
            os.kill(servers[1].pid, signal.SIGKILL)
            with trio.fail_after(30):
                while servers[0].state != "failed":
                    await trio.sleep(0.1)
            named = f"pipeline stage 1 (node node1, {ADDRESSES[1]}:{port}, layers 2-3) stopped answering"
            assert servers[0].reason is not None and servers[0].reason.startswith(named), servers[0].reason
            assert servers[0].reason.splitlines()[0].endswith("; the worker exited with code 3")
            for w in workers:
                await w.stop_all()

    trio.run(main)

