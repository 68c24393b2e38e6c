"""A small real fleet for end-to-end tests: agents cp, a, b on 127.0.0.2-4 sharing a port, the
tiny models imported on cp, and a fleet file the test rewrites as it goes."""

from __future__ import annotations

import signal
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Protocol

import httpx

from tests.agents import Agent, agent_env, free_port
from tests.conftest import fleet_bin
from tests.models import tiny_gguf, tiny_safetensors


class Fleet:
    def __init__(self, base: Path, agents: dict[str, Agent], digests: dict[str, str]) -> None:
        self.base, self.agents, self.digests = base, agents, digests
        self.file = base / "fleet.yaml"
        self.state_dir = base / "state"
        self.server_port = free_port("127.0.0.2", "127.0.0.3", "127.0.0.4")

    def write(self, replicas: str = "", clusters: str = "", extra_models: str = "", listen: str = "") -> None:
        nodes = "\n".join(f"  {n}: {{address: {a.address}, agent_port: {a.port}}}" for n, a in self.agents.items())
        listen = f", listen: {listen}" if listen else ""
        self.file.write_text(f"""version: 1
control_plane: {{node: cp{listen}}}
nodes:
{nodes}
models:
  tiny: {{format: safetensors, digest: "{self.digests['tiny']}", source: cp}}
  tiny-q: {{format: gguf, digest: "{self.digests['tiny-q']}", source: cp}}
{extra_models}
replicas:
{replicas or '  tiny: [cp]'}
clusters:
{clusters or '  {}'}
""".replace("clusters:\n  {}", "clusters: {}"))

    def run(self, *args: str, timeout: float = 300, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([fleet_bin(), *args, "-f", str(self.file)], capture_output=True, text=True,
                              timeout=timeout, env=agent_env(FLEET_STATE_DIR=str(self.state_dir), **(env or {})),
                              stdin=subprocess.DEVNULL)

    def states(self) -> dict[str, dict]:
        return {n: a.get("/v1/state").json() for n, a in self.agents.items()}


class Files(Protocol):
    """What `fleet serve` needs of a fleet: its directory (serve.log goes there), file and state."""

    base: Path
    file: Path
    state_dir: Path


def start_serve(f: Files, listen: str, interval: float = 1, timeout: float = 60, *, args: tuple[str, ...] = (),
                env: dict[str, str] | None = None, log: str = "serve.log") -> subprocess.Popen[str]:
    """`fleet serve` on the fleet's file (with `args` after its own), its output in `log` beside it,
    returned once it is up and one heartbeat was seen (the router then knows which servers run);
    the caller stops it (stop_serve)."""
    out = open(f.base / log, "w")
    proc = subprocess.Popen([fleet_bin(), "serve", "-f", str(f.file), "--interval", str(interval), *args],
                            env=agent_env(FLEET_STATE_DIR=str(f.state_dir), **(env or {})), stdout=out,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://{listen}/healthz", timeout=1).json().get("beats", 0) >= 1:
                return proc
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() >= deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise AssertionError((f.base / log).read_text())
        time.sleep(0.1)


def stop_serve(proc: subprocess.Popen[str] | None) -> None:
    """Stop a `fleet serve` as an operator would (SIGTERM), and reap it."""
    if proc is not None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def import_model(agent: Agent, path: Path) -> str:
    """`path` into the agent's store as `fleet-agent import` puts it there (Store.import_model), in
    this process: a process for it cost ~0.5 CPU-s of start-up, ~300 times a suite. The command
    itself is tested by test_cli_contract, test_import_json and test_import_hostile."""
    from agent.weights.importing import default_name
    from agent.weights.store import Store

    digest, _ = Store(agent.home).import_model(path, default_name(path))
    return digest



@contextmanager
def three_node_fleet(base: Path) -> Iterator[Fleet]:
    port = free_port("127.0.0.2", "127.0.0.3", "127.0.0.4")
    agents = {n: Agent(n, f"127.0.0.{i}", port, base / n) for n, i in (("cp", 2), ("a", 3), ("b", 4))}
    try:
        for a in agents.values():
            a.start()
        digests = {"tiny": import_model(agents["cp"], tiny_safetensors(base / "models")),
                   "tiny-q": import_model(agents["cp"], tiny_gguf(base / "models"))}
        assert all(d.startswith("sha256:") and len(d) == 71 for d in digests.values()), digests
        yield Fleet(base, agents, digests)
    finally:
        for a in agents.values():
            a.stop()


def chat(f: Fleet, members: str = "[a, b]", context: int = 256) -> str:
    return (f"  chat: {{model: tiny, members: {members}, port: {f.server_port}, "
            f"settings: {{context_length: {context}, threads: 1, startup_timeout_s: 120}}}}")


