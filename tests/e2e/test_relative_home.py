"""An operator starts the agent with a relative home (`fleet-agent serve --home .` in its
directory): the agent makes it absolute at start, and the router's scrubber, which replaces a
node's paths in its answers, leaves the full stops of a real answer alone (before, the home "."
was scrubbed and "Paris." came back as "Parissmol"). SmolLM2 on llama.cpp, applied by `fleet
apply`, asked through `fleet serve`, whole and streamed."""

from __future__ import annotations

import contextlib
import json
import signal
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.addresses import loopback
from tests.agents import Agent, free_port
from tests.fleets import Fleet, import_model, start_serve
from tests.models import smollm2_gguf

pytestmark = pytest.mark.e2e
[ADDRESS] = loopback(1)
CLUSTER = "smol"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Agent]]:
    base = tmp_path_factory.mktemp("relative-home")
    home = base / "cp"
    home.mkdir()
    # Started in its home with `--home .` (the last --home wins over the one Agent passes first).
    agent = Agent("cp", ADDRESS, free_port(ADDRESS), home, args=["--home", "."])
    proc = None
    try:
        with contextlib.chdir(home):
            agent.start()
        digest = import_model(agent, smollm2_gguf())
        f = Fleet(base, {"cp": agent}, {})
        listen = f"{ADDRESS}:{free_port(ADDRESS)}"
        f.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
  cp: {{address: {ADDRESS}, agent_port: {agent.port}}}
models:
  smollm2-q: {{format: gguf, digest: "{digest}", source: cp}}
clusters:
  {CLUSTER}: {{model: smollm2-q, members: [cp], port: {free_port(ADDRESS)},
         settings: {{context_length: 256, threads: 1, startup_timeout_s: 300}}}}
""")
        applied = f.run("apply", "--auto-approve", timeout=900)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen)  # up, and one heartbeat seen: the router knows the node's paths and its server
        yield f"http://{listen}/v1", agent
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        agent.stop()


def test_the_agent_reports_its_relative_home_as_an_absolute_path(served: tuple[str, Agent]) -> None:
    _, agent = served
    reported = agent.get("/v1/state").json()["inventory"]["disk"]["path"]
    assert reported.startswith("/") and Path(reported).resolve() == agent.home.resolve(), reported


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_with_full_stops_keeps_them(served: tuple[str, Agent], stream: bool) -> None:
    base, _ = served
    body = {"model": CLUSTER, "messages": [{"role": "user", "content": QUESTION}], "temperature": 0,
            "max_tokens": 48, "stream": stream}
    r = httpx.post(f"{base}/chat/completions", json=body, headers={"Authorization": "Bearer unused"}, timeout=300)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    else:
        text = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in text and "." in text, text  # the greedy answer ends its sentence
    assert CLUSTER not in text, text  # no full stop became the cluster's name
