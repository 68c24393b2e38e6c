"""The PyTorch worker as a real process on loopback: batching (greedy output the same alone and in a
batch), per-request settings, backpressure for a slow reader, a client that leaves, and the OpenAI
API's edges (usage chunk, models, errors as JSON). The e2e class runs the real SmolLM2 model."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from agent.backends.forkserver import ForkServer
from reconciler.agents.netutil import free_port
from tests import forked
from tests.models import tiny_safetensors

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

HOST = "127.0.0.1"


class Worker:
    """`python -m agent.backends.torch.worker` on a free loopback port, forked from the test process's
    fork server (tests/forked.py), its output in a log in `logs` (beside its model: a test's
    directory); stopped on exit."""

    def __init__(self, forks: ForkServer, model: Path, *extra: str, logs: Path | None = None) -> None:
        self.model, self.port = model, free_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.log = (logs or model.parent) / f"worker-{self.port}.log"
        self.proc = forked.start(forks, [sys.executable, "-m", "agent.backends.torch.worker", "--model", str(model),
                                         "--host", HOST, "--port", str(self.port), "--threads", "1", *extra], self.log)
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError(f"the worker did not come up:\n{self.log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = httpx.get(self.url + "/health", timeout=5).json()["engine"]
        return out

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def completion(w: Worker, prompt: str, max_tokens: int, **extra: Any) -> tuple[str, str, int]:
    r = w.client().completions.create(model="m", prompt=prompt, max_tokens=max_tokens, **extra)
    assert r.usage is not None
    return r.choices[0].text, str(r.choices[0].finish_reason), r.usage.completion_tokens


def together(calls: list[Any]) -> list[Any]:
    """Run the calls at the same time, each on its own thread; their results in order."""
    out: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        out[i] = calls[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return out


def sse_events(raw: bytes) -> list[Any]:
    """The `data:` events of a whole chunked SSE response (head and chunk framing removed)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0], head
    data = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        data, body = data + rest[:n], rest[n + 2:]
    events = [e.removeprefix(b"data: ") for e in data.split(b"\n\n") if e]
    return [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]


def slow_stream(w: Worker, body: dict[str, Any]) -> socket.socket:
    """A streamed request on a socket with a small receive window, so that the worker feels its
    reader stop (a default window would take a whole tiny-model answer)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.connect((HOST, w.port))
    payload = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: w\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
    return sock


PROMPTS = ["The fleet", "Weights are pinned by digest and replicated from a peer",
           "A cluster serves one model", "Hello! How can I help you today? I am a tiny model made for tests."]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, forks: ForkServer) -> Iterator[Worker]:
    w = Worker(forks, tiny_safetensors(tmp_path_factory.mktemp("models")), "--stream-buffer", "4", "--max-batch", "8")
    yield w
    w.stop()


def test_batched_greedy_equals_alone(tiny: Worker) -> None:
    alone = [completion(tiny, p, 24 + 4 * i, temperature=0) for i, p in enumerate(PROMPTS)]
    batched = together([lambda p=p, i=i: completion(tiny, p, 24 + 4 * i, temperature=0)
                        for i, p in enumerate(PROMPTS)])
    assert batched == alone
    assert [n for _, _, n in alone] == [24, 28, 32, 36]
    assert tiny.stats()["widest_step"] >= 2, "nothing ran batched"


def test_each_request_keeps_its_seed_and_stop(tiny: Worker) -> None:
    seeded = completion(tiny, "The fleet", 16, temperature=1.0, seed=7)
    mixed = together([lambda: completion(tiny, "The fleet", 16, temperature=1.0, seed=7),
                      lambda: completion(tiny, "A cluster", 30, temperature=0)])
    assert mixed[0] == seeded
    text, _, _ = completion(tiny, PROMPTS[1], 30, temperature=0)
    stop = text[10:13]
    cut, finish, _ = completion(tiny, PROMPTS[1], 30, temperature=0, stop=[stop])
    assert finish == "stop" and cut == text[:text.index(stop)]


def test_usage_chunk_before_done(tiny: Worker) -> None:
    chunks = list(tiny.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hello!"}], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].usage.prompt_tokens > 0
    assert chunks[-2].choices[0].finish_reason == "length" and all(c.usage is None for c in chunks[:-1])
    raw = httpx.post(tiny.url + "/v1/completions", json={"prompt": "The fleet", "max_tokens": 3, "stream": True,
                                                         "stream_options": {"include_usage": True}}).text
    assert raw.endswith('"usage":{"prompt_tokens":4,"completion_tokens":3,"total_tokens":7}}\n\ndata: [DONE]\n\n')


def test_models_list_and_retrieve(tiny: Worker) -> None:
    first = httpx.get(tiny.url + "/v1/models").json()["data"]
    time.sleep(1.1)
    again = httpx.get(tiny.url + "/v1/models").json()["data"]
    assert first == again and first[0]["created"] <= time.time() and first[0]["object"] == "model"
    assert tiny.client().models.retrieve(first[0]["id"]).created == first[0]["created"]
    missing = httpx.get(tiny.url + "/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("method,path,status,code", [
    ("GET", "/v1/embeddings", 404, "not_found"), ("POST", "/nothing/here", 404, "not_found"),
    ("GET", "/v1/chat/completions", 405, "method_not_allowed"), ("DELETE", "/v1/models", 405, "method_not_allowed")])
def test_unknown_routes_answer_openai_errors(tiny: Worker, method: str, path: str, status: int, code: str) -> None:
    r = httpx.request(method, tiny.url + path)
    assert r.status_code == status and r.headers["content-type"] == "application/json"
    assert set(r.json()["error"]) == {"message", "type", "param", "code"} and r.json()["error"]["code"] == code


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "fleet " * 300}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "fleet " * 300}]})])
def test_prompt_longer_than_the_context_is_400(tiny: Worker, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(tiny.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded" and "256" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        tiny.client().completions.create(model="m", prompt="fleet " * 300)
    assert refused.value.code == "context_length_exceeded"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", b'{"messages": "hi"}', b'{"messages": [{"role": 1}]}',
                                  b'{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
                                  b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}',
                                  b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
                                  b'{"messages": [{"role": "user", "content": "x"}], "stop": [1]}', b"\xff\xfe"])
def test_malformed_bodies_are_400_without_trace_or_path(tiny: Worker, body: bytes) -> None:
    r = httpx.post(tiny.url + "/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "Traceback" not in r.text and str(tiny.model) not in r.text and "/" not in r.json()["error"]["message"]


def test_a_body_past_the_limit_is_413_before_it_is_parsed(tiny: Worker) -> None:
    from agent.backends.openai_app import MAX_BODY

    r = httpx.post(tiny.url + "/v1/completions", content=b"{" + b" " * MAX_BODY + b"}",
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text[:300]
    assert completion(tiny, "The fleet", 4, temperature=0)[2] == 4  # and the worker goes on


def test_a_slow_reader_gets_every_token_and_stalls_no_one(tiny: Worker) -> None:
    body = {"prompt": "The fleet", "max_tokens": 240, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    whole, _, _ = completion(tiny, "The fleet", 240, temperature=0)
    aside = tiny.stats()["set_aside"]
    with slow_stream(tiny, body) as sock:
        raw = sock.recv(512)
        t0 = time.monotonic()
        other = completion(tiny, PROMPTS[3], 20, temperature=0)  # while this reader sleeps
        assert time.monotonic() - t0 < 4 and other[2] == 20
        deadline = time.monotonic() + 30  # the worker sets the request aside once its reader's buffers fill
        while tiny.stats()["set_aside"] <= aside and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tiny.stats()["set_aside"] > aside, "the worker never paused the request for its slow reader"
        sock.settimeout(30)
        while not raw.endswith(b"\r\n0\r\n\r\n"):  # the last chunk (the worker keeps the connection)
            chunk = sock.recv(65536)
            assert chunk, "the worker closed the stream early"
            raw += chunk
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and events[-2]["usage"]["completion_tokens"] == 240
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == whole


def test_a_client_that_leaves_frees_its_row(tiny: Worker) -> None:
    before = tiny.stats()["steps"]
    with slow_stream(tiny, {"prompt": "The fleet", "max_tokens": 240, "stream": True}) as sock:
        assert sock.recv(512)
    deadline = time.monotonic() + 5
    while tiny.stats()["rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tiny.stats()["rows"] == 0
    assert tiny.stats()["steps"] - before < 120, "the worker went on generating for a client that left"


@pytest.fixture(scope="module")
def smol(smollm2_f32: Path, forks: ForkServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    w = Worker(forks, smollm2_f32, logs=tmp_path_factory.mktemp("smol"))  # the model is kept between runs
    yield w
    w.stop()


@pytest.mark.e2e
class TestSmolLM2:
    """The real instruct model (float32 twin of the GGUF, made by fleet-agent convert)."""

    def test_answers_a_factual_question(self, smol: Worker) -> None:
        r = smol.client().chat.completions.create(
            model="m", temperature=0, max_tokens=20,
            messages=[{"role": "user", "content": "What is the capital of France? Answer in one sentence."}])
        assert "Paris" in (r.choices[0].message.content or "") and r.choices[0].finish_reason == "stop"

    def test_batched_greedy_equals_alone(self, smol: Worker) -> None:
        questions = ["What is the capital of France?", "Write a haiku about the sea.",
                     "Name three primary colors and say why they are called primary.", "What is 2 + 2?"]

        def ask(q: str) -> str:
            r = smol.client().chat.completions.create(model="m", temperature=0, max_tokens=24,
                                                      messages=[{"role": "user", "content": q}])
            return r.choices[0].message.content or ""
        alone = [ask(q) for q in questions]
        assert together([lambda q=q: ask(q) for q in questions]) == alone
        assert smol.stats()["widest_step"] >= 2
