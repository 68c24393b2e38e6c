"""`fleet demo`: fleet's main job on an embedded default. Three real agents on loopback addresses,
tiny real models made on the spot, a plan, an apply, `fleet serve`, and a streamed answer through
the control plane. Every process it starts is stopped at the end (or on Ctrl-C), and every file
it writes stays under its directory."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from .exitcodes import Exit
from .netutil import free_port
from .render import console

BIN = Path(sys.executable).parent


class Demo:
    def __init__(self, root: Path, first: str, out: Any) -> None:
        self.root = root
        self.out = out
        start = ipaddress.IPv4Address(first)
        self.nodes = {"cp": str(start), "gpu-a": str(start + 1), "gpu-b": str(start + 2)}
        self.procs: list[subprocess.Popen[bytes]] = []
        cache = root / "cache"  # engines' caches too: nothing is written outside the directory
        self.env = {**os.environ, "FLEET_CLUSTER_SECRET": secrets.token_hex(24), "FLEET_STATE_DIR": str(root / "state"),
                    "HF_HOME": str(cache / "huggingface"), "TORCH_HOME": str(cache / "torch"),
                    "LLAMA_CACHE": str(cache / "llama.cpp"), "XDG_CACHE_HOME": str(cache),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def say(self, text: str) -> None:
        self.out.print(f"\n[bold cyan]==>[/] [bold]{text}[/]")

    def run(self, *argv: str, show: bool = True, ok: tuple[int, ...] = (0,)) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / argv[0]), *argv[1:]]
        self.out.print(f"[dim]$ {' '.join(argv)}[/]")
        # stderr joins stdout so progress and results read in the order they happened
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if not show else subprocess.STDOUT,
                              text=True, env=self.env, cwd=self.root, stdin=subprocess.DEVNULL)
        if show:
            sys.stdout.write(proc.stdout)
            sys.stdout.flush()
        if proc.returncode not in ok:
            raise RuntimeError(f"`{' '.join(argv)}` exited with {proc.returncode}:\n{proc.stdout}")
        return proc

    def background(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")
        proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.root, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_http(self, url: str, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not start; see the logs under {self.root}")

    def stop_all(self) -> None:
        for p in reversed(self.procs):  # serve first, then the agents (which stop their workers)
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)

    def main(self) -> None:
        agent_port = free_port(*self.nodes.values())
        server_port = free_port(*self.nodes.values())
        listen = f"{self.nodes['cp']}:{free_port(self.nodes['cp'])}"

        self.say(f"Three agents, each a real fleet-agent process on its own address (port {agent_port})")
        for name, addr in self.nodes.items():
            self.run("fleet-agent", "enroll", "--home", str(self.root / name), "--name", name)
            self.background(f"agent-{name}", "fleet-agent", "serve", "--home", str(self.root / name),
                            "--listen", f"{addr}:{agent_port}")
        for addr in self.nodes.values():
            self.wait_http(f"http://{addr}:{agent_port}/healthz", f"the agent on {addr}")

        self.say("Two tiny real models, made on the spot (random weights, a tokenizer trained here)")
        self.run("fleet-agent", "make-test-model", "safetensors", str(self.root / "models" / "tiny-llama"))
        self.run("fleet-agent", "make-test-model", "gguf", str(self.root / "models" / "tiny-llama.gguf"))
        digests = {}
        for fmt, path in (("safetensors", "tiny-llama"), ("gguf", "tiny-llama.gguf")):
            proc = self.run("fleet-agent", "import", "--home", str(self.root / "cp"), str(self.root / "models" / path),
                            "--json", show=False)
            digests[fmt] = json.loads(proc.stdout)["digest"]
            self.out.print(f"imported {path} on cp: {digests[fmt]}")

        self.say("The fleet file (fleet.yaml)")
        fleet = self.root / "fleet.yaml"
        fleet.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{listen}"}}
nodes:
  cp:    {{address: {self.nodes['cp']}, agent_port: {agent_port}}}
  gpu-a: {{address: {self.nodes['gpu-a']}, agent_port: {agent_port}}}
  gpu-b: {{address: {self.nodes['gpu-b']}, agent_port: {agent_port}}}
models:
  tiny:   {{format: safetensors, digest: "{digests['safetensors']}", source: cp}}
  tiny-q: {{format: gguf, digest: "{digests['gguf']}", source: cp}}
replicas:
  tiny: [gpu-a, gpu-b]          # cp holds the original; gpu-b may fetch from gpu-a's verified copy
clusters:
  chat:                         # safetensors on PyTorch, two members on one port
    model: tiny
    members: [gpu-a, gpu-b]
    port: {server_port}
    settings: {{context_length: 256, threads: 1}}
  local:                        # GGUF on llama.cpp: the control plane's node only
    model: tiny-q
    members: [cp]
    port: {free_port(self.nodes['cp'])}
    settings: {{context_length: 256}}
""")
        self.out.print(fleet.read_text(), markup=False, highlight=False)
        self.run("fleet", "validate", "-f", "fleet.yaml")

        self.say("fleet plan: what the agents have, against what the file asks for")
        self.run("fleet", "plan", "-f", "fleet.yaml", "--detailed-exitcode", ok=(2,))
        self.say("fleet apply: weights first (digest-verified), then servers, in order")
        self.run("fleet", "apply", "-f", "fleet.yaml", "--auto-approve")
        self.run("fleet", "plan", "-f", "fleet.yaml", "--detailed-exitcode")

        self.say(f"fleet serve: heartbeat and the one client entry point, on http://{listen}")
        self.background("serve", "fleet", "serve", "-f", "fleet.yaml", "--interval", "5")
        self.wait_http(f"http://{listen}/healthz", "fleet serve")

        self.say("A streamed chat request through the control plane (OpenAI API), printed as it arrives")
        self.out.print("[dim](a tiny random model: its words are noise; the path they took is the point)[/]")
        body = {"model": "chat", "stream": True, "max_tokens": 24, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello, fleet!"}]}
        pieces = 0
        sys.stdout.write("answer: ")
        with httpx.stream("POST", f"http://{listen}/v1/chat/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    pieces += 1
                    sys.stdout.write(delta)
                    sys.stdout.flush()
        sys.stdout.write(f"\n[{pieces} chunks streamed through http://{listen}]\n")
        if pieces == 0:
            raise RuntimeError("the streamed answer was empty")

        time.sleep(0.5)
        self.say("fleet nodes --wide")
        self.run("fleet", "nodes", "--wide", "-f", "fleet.yaml")

        self.say("To do the same by hand")
        self.out.print("""  export FLEET_CLUSTER_SECRET=$(openssl rand -hex 32)
  fleet-agent enroll --home DIR --name NAME; fleet-agent serve --home DIR --listen ADDR:PORT   # on each node
  fleet-agent import PATH --home DIR          # on the source node; paste the digest into fleet.yaml
  fleet validate -f fleet.yaml && fleet plan -f fleet.yaml && fleet apply -f fleet.yaml
  fleet serve -f fleet.yaml                   # then point any OpenAI client at control_plane.listen""",
                       markup=False, highlight=False)


def cmd_demo(args: argparse.Namespace) -> int:
    out = console(stderr=False)
    keep = args.dir is not None
    root = Path(args.dir).resolve() if keep else Path(tempfile.mkdtemp(prefix="fleet-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    demo = Demo(root, args.first_address, out)
    interrupted = False
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        demo.main()
        code: int = Exit.OK
    except KeyboardInterrupt:
        interrupted, code = True, 130
    except RuntimeError as exc:
        console(stderr=True).print(f"[red]demo failed:[/] {exc}", markup=True)
        code = Exit.FAILURE
    finally:
        signal.signal(signal.SIGTERM, previous)
        demo.stop_all()
        out.print("\n[dim]stopped every process the demo started[/]" + (" (interrupted)" if interrupted else ""))
        if keep:
            out.print(f"[dim]its files are in {root}[/]")
        elif code == Exit.OK:
            shutil.rmtree(root, ignore_errors=True)
        else:
            out.print(f"[dim]logs kept in {root}[/]")
    return code
