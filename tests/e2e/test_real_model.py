"""A real instruct model behind a real fleet: SmolLM2-135M-Instruct's GGUF on llama.cpp and its
float32 safetensors twin on PyTorch, applied by `fleet apply`, asked through `fleet serve` with the
official openai client. What a user would judge: the greedy answer is right on both engines,
streamed or not, the usage chunk arrives, and mistakes come back as OpenAI errors (an over-long
prompt, a malformed body) without a traceback or a path, through the router and from the worker."""

from __future__ import annotations

import re
import signal
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.addresses import loopback
from tests.agents import Agent, free_port
from tests.fleets import Fleet, import_model, start_serve
from tests.models import smollm2_gguf

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France? Answer in one sentence."
CONTEXT = 256  # small, so that a long prompt is easy to make; the question takes 42 tokens
ADDRESSES = dict(zip(("cp", "a"), loopback(2)))
ENGINES = [("local", "cp"), ("chat", "a")]
IDS = ["llama.cpp-gguf", "pytorch-safetensors"]


class Served:
    def __init__(self, fleet: Fleet, base: str, ports: dict[str, int]) -> None:
        self.fleet, self.base, self.ports = fleet, base, ports

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, smollm2_f32: Path) -> Iterator[Served]:
    base = tmp_path_factory.mktemp("real")
    port = free_port(*ADDRESSES.values())
    agents = {n: Agent(n, addr, port, base / n) for n, addr in ADDRESSES.items()}
    proc = None
    try:
        for a in agents.values():
            a.start()
        digests = {"smollm2": import_model(agents["cp"], smollm2_f32),
                   "smollm2-q": import_model(agents["cp"], smollm2_gguf())}
        f = Fleet(base, agents, digests)
        listen = f"{ADDRESSES['cp']}:{free_port(ADDRESSES['cp'])}"
        ports = {"chat": free_port(ADDRESSES["a"]), "local": free_port(ADDRESSES["cp"])}
        settings = f"{{context_length: {CONTEXT}, threads: 1, startup_timeout_s: 300}}"
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        f.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
{nodes}
models:
  smollm2: {{format: safetensors, digest: "{digests['smollm2']}", source: cp}}
  smollm2-q: {{format: gguf, digest: "{digests['smollm2-q']}", source: cp}}
replicas:
  smollm2: [a]
clusters:
  chat: {{model: smollm2, members: [a], port: {ports['chat']}, settings: {settings}}}
  local: {{model: smollm2-q, members: [cp], port: {ports['local']}, settings: {settings}}}
""")
        applied = f.run("apply", "--auto-approve", timeout=900)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen)  # up, and one heartbeat seen: the router knows both servers run
        yield Served(f, f"http://{listen}/v1", ports)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for a in agents.values():
            a.stop()


def ask(s: Served, cluster: str, **extra: Any) -> Any:
    return s.client().chat.completions.create(model=cluster, messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=48, **extra)


@pytest.mark.parametrize("cluster, node", ENGINES, ids=IDS)
def test_the_greedy_answer_is_right_streamed_or_not(served: Served, cluster: str, node: str) -> None:
    whole = ask(served, cluster)
    assert "Paris" in (whole.choices[0].message.content or ""), whole
    assert whole.usage is not None and whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0
    chunks = list(ask(served, cluster, stream=True, stream_options={"include_usage": True}))
    texts = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert "Paris" in "".join(texts) and "".join(texts).strip() == (whole.choices[0].message.content or "").strip()
    *body, last = chunks
    assert last.choices == [] and last.usage is not None, last  # the usage chunk, last before [DONE]
    assert all(c.choices for c in body)
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens > 0
    assert last.usage.completion_tokens >= len(texts) > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


@pytest.mark.parametrize("cluster, node", ENGINES, ids=IDS)
def test_concurrent_streams_each_get_their_whole_answer(served: Served, cluster: str, node: str) -> None:
    # llama-cpp-python's server cuts a running stream when another request arrives unless told not to.
    whole = ask(served, cluster)
    expected = (whole.choices[0].message.content or "").strip()
    results: list[str] = []

    def stream() -> None:
        chunks = list(ask(served, cluster, stream=True))
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        results.append(f"{finish}|{text.strip()}")

    threads = [threading.Thread(target=stream) for _ in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # each arrives while the one before is streaming
    for t in threads:
        t.join(300)
    assert len(results) == 3, results
    assert all(r.split("|", 1)[1] == expected and r.split("|", 1)[0] in ("['stop']", "['length']")
               for r in results), (expected, results)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("cluster, node", ENGINES, ids=IDS)
def test_a_prompt_longer_than_the_context_is_a_400(served: Served, cluster: str, node: str, stream: bool) -> None:
    long = "Tell me about the fleet. " * 80  # some 500 tokens, twice the context
    with pytest.raises(openai.BadRequestError) as caught:
        result = served.client().chat.completions.create(
            model=cluster, messages=[{"role": "user", "content": long}], max_tokens=8, stream=stream)
        if stream:
            list(result)
    assert caught.value.status_code == 400 and caught.value.code == "context_length_exceeded", caught.value.body
    assert str(CONTEXT) in caught.value.message


PATHLIKE = re.compile(r"/[\w.-]+/")


@pytest.mark.parametrize("body", [{"messages": "What is the capital of France?"}, {"messages": [{"content": 3}]},
                                  {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}],
                         ids=["messages-not-a-list", "message-without-role", "max-tokens-not-a-number"])
@pytest.mark.parametrize("cluster, node", ENGINES, ids=IDS)
def test_a_malformed_body_is_a_clean_400(served: Served, cluster: str, node: str, body: dict[str, Any]) -> None:
    direct = f"http://{ADDRESSES[node]}:{served.ports[cluster]}/v1/chat/completions"
    # The worker answers only the router's credential, which its agent reports in the state.
    credential = next(s["credential"] for s in served.fleet.agents[node].get("/v1/state").json()["servers"]
                      if s["id"] == f"{cluster}@{node}")
    for url, key in ((served.base + "/chat/completions", "unused"), (direct, credential)):
        r = httpx.post(url, json={"model": cluster, **body}, headers={"authorization": f"Bearer {key}"}, timeout=60)
        assert r.status_code == 400, (url, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], r.text
        assert "Traceback" not in r.text and 'File "' not in r.text and not PATHLIKE.search(r.text), r.text
        assert "site-packages" not in r.text and str(served.fleet.base) not in r.text
