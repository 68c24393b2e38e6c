"""Served after it was found corrupt (issue 31, item 1), with real processes: SmolLM2-135M's GGUF on
llama.cpp behind `fleet serve`, a good copy on a second node. A byte of the store's file is flipped
under the running server (in place, as bit rot or a stray write would: llama.cpp maps the file, so
its answers change at once); POST /v1/weights/{digest}/verify finds it. From the moment that
verification answers, no wrong answer reaches a client: the agent has killed the server and
reports it failed with the reason, so the router has nowhere to send the request and answers an
error. `fleet plan` then fetches the copy again and starts the server again on the new file (a
new inode renamed into the store: the new worker maps no deleted file), after which the answers
are right again and `fleet plan` finds nothing to do.

The same on PyTorch with the tiny random Llama (tests/models.py; SmolLM2's answers on PyTorch are
tests/e2e/test_real_model.py's), whose worker holds its own copy of the weights once loaded (its
answer may not change under the flip; the rest holds the same).

Before: the router kept sending to the member until the apply, so the corrupt answer reached
clients after the verification; after the repair the worker still mapped the deleted corrupt file."""

from __future__ import annotations

import json
import signal
import struct
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from tests.addresses import loopback
from tests.agents import SECRET, Agent, free_port
from tests.fleets import Fleet, import_model, start_serve
from tests.models import smollm2_gguf, tiny_safetensors

pytestmark = pytest.mark.e2e
QUESTION = "What is the capital of France? Answer in one sentence."
ADDRESSES = dict(zip(("cp", "a"), loopback(2)))


class World:
    def __init__(self, fleet: Fleet, listen: str, digest: str, port: int, fmt: str) -> None:
        self.fleet, self.listen, self.digest, self.port, self.format = fleet, listen, digest, port, fmt

    def ask(self) -> str:
        client = openai.OpenAI(base_url=f"http://{self.listen}/v1", api_key="unused", max_retries=0, timeout=120)
        done = client.chat.completions.create(model="local", messages=[{"role": "user", "content": QUESTION}],
                                              temperature=0, max_tokens=24)
        return done.choices[0].message.content or ""

    def ask_or_error(self) -> str | None:
        """The answer, or None where the router answered an error (nothing to send the request to)."""
        try:
            return self.ask()
        except openai.APIStatusError as exc:
            assert exc.status_code in (502, 503), exc
            return None

    def server(self) -> dict[str, Any]:
        [server] = self.fleet.agents["cp"].get("/v1/state").json()["servers"]
        return server  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["gguf", "safetensors"], ids=["llama.cpp", "pytorch"])
def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    fmt = request.param
    base = tmp_path_factory.mktemp("corrupt-served")
    port = free_port(*ADDRESSES.values())
    agents = {n: Agent(n, addr, port, base / n) for n, addr in ADDRESSES.items()}
    proc = None
    try:
        for a in agents.values():
            a.start()
        model = smollm2_gguf() if fmt == "gguf" else tiny_safetensors(base / "models")
        digest = import_model(agents["cp"], model)
        f = Fleet(base, agents, {"q": digest})
        listen = f"{ADDRESSES['cp']}:{free_port(ADDRESSES['cp'])}"
        served_port = free_port(ADDRESSES["cp"])
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in agents.items())
        f.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
{nodes}
models:
  q: {{format: {fmt}, digest: "{digest}", source: cp}}
replicas:
  q: [a]
clusters:
  local: {{model: q, members: [cp], port: {served_port}, settings: {{context_length: 256, threads: 1}}}}
""")
        applied = f.run("apply", "--auto-approve", timeout=600)
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen)  # up, and one heartbeat seen
        yield World(f, listen, digest, served_port, fmt)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        for a in agents.values():
            a.stop()


def flip_a_byte(path: Path) -> None:
    """The high byte of the final norm's first float flipped in place (same inode): 0x3F.. to
    0x7F.., an exponent of all ones, so the norm holds an infinity or a NaN. GGUF: output_norm.weight
    (F32 in SmolLM2's Q4_1 file); safetensors: model.norm.weight (float32, the tiny model's)."""
    if path.suffix == ".gguf":
        import gguf

        [norm] = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == "output_norm.weight"]
        offset = int(norm.data_offset) + 3
    else:
        with open(path, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        assert header["model.norm.weight"]["dtype"] == "F32"
        offset = 8 + size + header["model.norm.weight"]["data_offsets"][0] + 3
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))
        fh.flush()


def mapped_model_files(pid: int, model_dir: str) -> list[str]:
    with open(f"/proc/{pid}/maps") as fh:
        return sorted({line.split(None, 5)[5].strip() for line in fh
                       if len(line.split(None, 5)) == 6 and model_dir in line})


def test_no_wrong_answer_reaches_a_client_once_the_corruption_is_found_nor_after_the_repair(world: World) -> None:
    right = world.ask()
    # SmolLM2 knows the answer; the tiny random model's is the reference the rest is compared to.
    assert ("Paris" in right) if world.format == "gguf" else bool(right), right
    entry = next(w for w in world.fleet.agents["cp"].get("/v1/state").json()["weights"]
                 if w["digest"] == world.digest)
    if world.format == "gguf":  # a GGUF's entry names its one file in the model's directory
        stored = Path(entry["path"])
        model_dir = str(stored.parent)
    else:
        model_dir = str(entry["path"])
        stored = Path(model_dir) / "model.safetensors"
    before = world.server()
    assert before["state"] == "running"
    if world.format == "gguf":
        assert mapped_model_files(before["pid"], model_dir), "llama.cpp maps the store's file"

    flip_a_byte(stored)
    if world.format == "gguf":
        # Found by nobody yet: the mapped bytes changed under the running engine (what made this
        # test). PyTorch holds its own copy of the weights once loaded: its answer may stay right.
        assert world.ask() != right

    cp = world.fleet.agents["cp"]
    found = httpx.post(f"{cp.url}/v1/weights/{world.digest}/verify", headers={"Authorization": f"Bearer {SECRET}"},
                       timeout=300).json()
    assert found["integrity"]["state"] == "corrupt", found
    # From here on: an error or the right answer, never the corrupt copy's, over several heartbeats.
    answers = [world.ask_or_error() for _ in range(8)]
    assert all(a is None or a == right for a in answers), answers
    failed = world.server()
    assert failed["state"] == "failed" and "found corrupt" in failed["reason"], failed
    time.sleep(2.5)  # two heartbeats: the router has dropped the member
    assert world.ask_or_error() is None

    plan = world.fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 2, plan.stdout + plan.stderr
    assert "replica.q@cp" in plan.stdout and "server.local@cp" in plan.stdout, plan.stdout
    applied = world.fleet.run("apply", "--auto-approve", timeout=600)
    assert applied.returncode == 0, applied.stdout + applied.stderr

    repaired = world.server()
    assert repaired["state"] == "running" and repaired["pid"] != before["pid"], repaired
    mapped = mapped_model_files(repaired["pid"], model_dir)
    assert not any(m.endswith("(deleted)") for m in mapped), mapped
    if world.format == "gguf":
        assert mapped, "llama.cpp maps the new file"
    deadline = time.monotonic() + 60
    after: list[str | None] = []
    while not after or after[-1] is None:  # until the heartbeat has seen the new server
        after.append(world.ask_or_error())
        assert time.monotonic() < deadline, after
        time.sleep(0.2) if after[-1] is None else None
    after += [world.ask() for _ in range(3)]
    assert all(a is None or a == right for a in after), after

    again = world.fleet.run("plan", "--detailed-exitcode")
    assert again.returncode == 0 and "No changes" in again.stdout, again.stdout + again.stderr
