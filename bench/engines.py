"""bench/engines: each engine serving SmolLM2-135M-Instruct, at 1 stream and at 8 concurrent
streams in one run: aggregate tokens/s, the ratio, and each stream's time to first token (TTFT)
against the single stream's. Targets (issue 13), PyTorch engine: 8 streams >= 3x one stream, no
stream's TTFT worse than 2x the single-stream figure.

Engines, each started with the argv of its launch spec (agent/backends/torch/spec.py, llama_cpp.py),
threads T and a context of 2048:
  torch        agent.backends.torch.worker (the batched engine), on the float32 twin made by
               `fleet-agent convert` (the tests' copy under .pytest_cache/d/fleet-models)
  torch_nocache  the same with --prefix-cache 0 (every prompt prefilled whole)
  llama_cpp_batched  agent.backends.llama_cpp.batched (fleet's batched llama.cpp worker, the agent's
               default) on the GGUF; its burst line has the prefill floor too (its /health counters)
  llama_cpp_batched_serve  the same worker as users reach it: started by a real fleet-agent through
               `fleet apply` (a GGUF cluster of one member, the control plane's node), every request
               relayed by a real `fleet serve` (issue 34's figures are taken through it)
  llama_cpp    agent.backends.llama_cpp.worker (llama-cpp-python's server app, FLEET_LLAMA_WORKER=server) on the GGUF
  llama_cpp_ni the same with --interrupt_requests False (the server's default, True, ends a running
               stream early whenever another request arrives: see "cut")
  llama_cpp_xN N such servers (N = --procs, each with T threads), streams spread round-robin:
               what several engine processes behind the router give
  llama_cpp_batch  the bindings' batched decoding (llama_batch over n sequences), in process
               without HTTP (bench/llama_batch.py): what a llama.cpp worker of our own could reach,
               on the same work as llama_cpp_batched's n streams (the same prompts, --requests
               rounds of n, --tokens each); with llama_cpp_batched, run after each of its rounds
               and put against it round by round (issue 34: at least 0.8x at n streams), in
               tokens per wall second and per CPU second (beside llama_cpp_batched_serve too)

Each stream asks for a story (greedy, --tokens new tokens, counted from the usage chunk or the
chunks) and sends its requests back to back. Three runs per engine: 1 stream (--requests in a
row); n at once (n requests arriving together, as one padded batch would take them); n streams
(--requests each, stream i starting i/n of a request's time after the first, as users arrive).
TTFT ratios are against the single stream's median in the same round (n streams: each stream's
requests after its first, i.e. once the others run); "cut" counts answers that ended short of
their tokens without finish_reason stop (a silent cut). Each round runs the three one after the
other and the last line per engine is the median over rounds (--rounds). "per CPU-s" divides
tokens by the CPU time of the engine's processes instead of wall time: on a machine shared with
other work, the wall-time ratios move with the neighbours' load, these far less. For the PyTorch
engine the n-at-once figure also gives the worst TTFT in ms and its prefill-bound floor: the
single request's TTFT less its prefill, plus all of the burst's prefill CPU seconds (the engine's own
counters, /health): on one thread the last first token cannot come before every prompt's tokens
that the prefix cache does not hold were computed. Next to it, the arithmetic rate the 2x target
would take (the burst's prefill FLOPs, 2 x the layers' multiply-adds per computed token plus the
head per prompt, within the single request's TTFT plus its own prefill), the rate the burst's
prefill ran at and the single request's (FLOPs per second of the engine thread's CPU), and this
machine's best float32 matmul at the same thread count ([512, 576] x [576, 1536], in the bench's
process): a target above that ceiling cannot be met by scheduling. Every prompt is its own (a serial number after
the topic), so that a cache holds only what users' prompts share: the chat template's opening.

    .venv/bin/python bench/engines.py [--engines torch,llama_cpp_ni] [--threads 1 (0: default)] [--tokens 32]
        [--requests 3] [--streams 8] [--procs 2] [--rounds 2] [--client httpx|openai]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import psutil  # noqa: E402

from reconciler.agents.netutil import free_port  # noqa: E402
from tests.models import smollm2_gguf, smollm2_safetensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
SERIAL = itertools.count(1)
DEFAULT_THREADS = len(os.sched_getaffinity(0))  # what torch takes without --threads: every core it may run on
TOPICS = ["a dragon who learns to cook", "a lighthouse keeper and a storm", "a robot that paints the sea",
          "two friends crossing a desert", "a city that never sleeps", "a cat who runs a bakery",
          "the last train of the night", "a garden on the moon"]


@dataclass(frozen=True, slots=True)
class Result:
    ttft: float
    tokens: int
    finish: str | None
    start: float  # perf_counter when sent
    times: tuple[float, ...]  # perf_counter of each content chunk

    def in_window(self, a: float, b: float) -> float:
        """Tokens that arrived within [a, b] (each chunk weighs tokens/chunks)."""
        return sum(a <= t <= b for t in self.times) * self.tokens / max(len(self.times), 1)


Launch = Callable[[str, int], list[str]]  # (host, port) -> argv


def launch(spec: Any, path: Path, threads: int, *extra: str, env: dict[str, str] | None = None) -> Launch:
    """The argv the agent would run for this engine (its launch spec, in an agent whose environment
    has `env`), plus `extra` options."""
    def argv(host: str, port: int) -> list[str]:
        saved = {k: os.environ.get(k) for k in env or {}}
        os.environ.update(env or {})
        try:
            cmd = spec.command(str(path), host, port, {"threads": threads, "context_length": 2048}, _no_draft)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return [*cmd.argv, *extra]
    return argv


def _no_draft(digest: str, what: str) -> str:
    raise SystemExit(f"bench/engines runs no {what}")


class Engine:
    """One or more engine processes on loopback, stopped by stop()."""

    model = "m"  # the name requests give (a worker serves whatever it is asked)

    def __init__(self, argvs: list[Launch], health: str) -> None:
        self.urls: list[str] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        for argv in argvs:
            port = free_port(HOST)
            self.urls.append(f"http://{HOST}:{port}")
            self.procs.append(subprocess.Popen(argv(HOST, port), stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL))
        for url, proc in zip(self.urls, self.procs):
            deadline = time.monotonic() + 300
            while True:
                try:
                    if httpx.get(url + health, timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"engine {proc.args!r} did not come up")
                time.sleep(0.2)

    def stats(self) -> dict[str, float]:
        """The engine's own counters from /health (the PyTorch worker's, the batched llama.cpp
        worker's; none from llama-cpp-python's server app)."""
        out: dict[str, float] = {}
        for url in self.urls:
            try:
                for k, v in (httpx.get(url + "/health", timeout=5).json().get("engine") or {}).items():
                    out[k] = out.get(k, 0.0) + float(v)
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
        return out

    def cpu(self) -> float:
        """CPU seconds used so far by the engine processes (all their threads)."""
        return sum(sum(psutil.Process(p.pid).cpu_times()[:2]) for p in self.procs)

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


class ThroughServe:
    """The batched llama.cpp worker as users reach it (issue 34's "through fleet serve"): a real
    fleet-agent holding the GGUF, a fleet file with a GGUF cluster of that one node (the control
    plane's own, as GGUF is), a real `fleet apply` that starts the worker, and `fleet serve`, whose
    router relays every request. The streams go to serve's /v1 with the cluster's name; the engine's
    counters are read from the worker's /health with the credential the agent reports, its CPU
    from the worker process the agent started."""

    model = "chat"

    def __init__(self, threads: int) -> None:
        import tempfile

        from tests.agents import Agent, agent_env
        from tests.conftest import fleet_bin
        from tests.fleets import import_model, start_serve

        self.dir = tempfile.TemporaryDirectory(prefix="bench-engines-")
        self.base = base = Path(self.dir.name)
        address = "127.0.0.2"
        self.agent = Agent("cp", address, free_port(address), base / "cp").start()
        self.serve: subprocess.Popen[str] | None = None
        try:
            digest = import_model(self.agent, smollm2_gguf())
            listen = f"{address}:{free_port(address)}"
            settings = f"context_length: 2048{f', threads: {threads}' if threads else ''}, startup_timeout_s: 300"
            self.file = base / "fleet.yaml"
            self.state_dir = base / "state"
            self.file.write_text(f"""version: 1
control_plane: {{node: cp, listen: {listen}}}
nodes:
  cp: {{address: {address}, agent_port: {self.agent.port}}}
models:
  smollm2: {{format: gguf, digest: "{digest}", source: cp}}
replicas:
  smollm2: [cp]
clusters:
  chat: {{model: smollm2, members: [cp], port: {free_port(address)}, settings: {{{settings}}}}}
""")
            applied = subprocess.run([fleet_bin(), "apply", "-f", str(self.file), "--auto-approve"], capture_output=True,
                                     text=True, timeout=600, env=agent_env(FLEET_STATE_DIR=str(self.state_dir)))
            if applied.returncode != 0:
                raise SystemExit(f"fleet apply failed:\n{applied.stdout}\n{applied.stderr}")
            self.serve = start_serve(self, listen, interval=30)
            self.urls = [f"http://{listen}"]
            self.worker = psutil.Process(self._server()["pid"])
        except BaseException:
            self.stop()
            raise

    def _server(self) -> dict[str, Any]:
        return next(s for s in self.agent.get("/v1/state").json()["servers"] if s["id"] == "chat@cp")

    def stats(self) -> dict[str, float]:
        try:
            server = self._server()
            r = httpx.get(f"http://{server['host']}:{server['port']}/health", timeout=5,
                          headers={"Authorization": f"Bearer {server.get('credential', '')}"})
            return {k: float(v) for k, v in (r.json().get("engine") or {}).items()}
        except (httpx.HTTPError, ValueError, KeyError, StopIteration, AttributeError):
            return {}

    def cpu(self) -> float:
        return float(sum(self.worker.cpu_times()[:2]))

    def stop(self) -> None:
        from tests.fleets import stop_serve

        stop_serve(self.serve)
        self.serve = None
        self.agent.stop()
        self.dir.cleanup()


def content(topic: str) -> str:
    """A user's message. Each prompt its own (a serial number after the topic): only the chat
    template's system prompt and the words before the topic are shared, as between users; an
    engine's prefix cache would otherwise hold whole prompts asked again."""
    return f"Write a long story about {topic}, number {next(SERIAL)}."


CLIENT = {"name": "httpx"}  # --client: "openai" streams through the openai package instead


def ask(client: httpx.Client, url: str, topic: str, tokens: int, model: str = "m") -> Result:
    if CLIENT["name"] == "openai":
        return ask_openai(url, topic, tokens, model)
    body = {"model": model, "messages": [{"role": "user", "content": content(topic)}],
            "max_tokens": tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: list[float] = []
    usage, finish = None, None
    try:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                for c in event.get("choices") or []:
                    if c.get("delta", {}).get("content"):
                        times.append(time.perf_counter())
                    finish = c.get("finish_reason") or finish
    except httpx.HTTPError:  # a stream the engine broke off counts as cut, with what it delivered
        finish = "broken"
    ttft = (times[0] if times else time.perf_counter()) - t0
    return Result(ttft, usage if usage is not None else len(times), finish, t0, tuple(times))


_openai: dict[str, Any] = {}  # one openai client per base URL (each keeps its own connection pool)


def ask_openai(url: str, topic: str, tokens: int, model: str) -> Result:
    """As ask, through the openai package's streaming chat completions (what a user's code does)."""
    import openai

    client = _openai.get(url)
    if client is None:
        client = _openai[url] = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    times: list[float] = []
    usage, finish = None, None
    try:
        for chunk in client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": content(topic)}], max_tokens=tokens,
                temperature=0, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    times.append(time.perf_counter())
                finish = c.finish_reason or finish
    except openai.APIError:  # a stream the engine broke off counts as cut, with what it delivered
        finish = "broken"
    ttft = (times[0] if times else time.perf_counter()) - t0
    return Result(ttft, usage if usage is not None else len(times), finish, t0, tuple(times))


def streams(urls: list[str], n: int, requests: int, tokens: int, stagger: float = 0.0,
            model: str = "m") -> tuple[float, list[list[Result]]]:
    """n streams, each `requests` requests back to back, stream i starting i * stagger seconds after
    the first: (wall seconds, results per stream)."""
    out: list[list[Result]] = [[] for _ in range(n)]
    go = threading.Barrier(n + 1)

    def run(i: int) -> None:
        with httpx.Client(timeout=600) as client:
            go.wait()
            time.sleep(i * stagger)
            for k in range(requests):
                out[i].append(ask(client, urls[i % len(urls)], TOPICS[(i + k) % len(TOPICS)], tokens, model))
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, out


Shape = tuple[float, float]  # a model's FLOPs per prompt token through its layers, and per prompt for its head


def model_shape(model_dir: Path) -> Shape:
    """From config.json: 2 x the layers' multiply-adds per token (attention's own, a few percent at
    these lengths, left out), and 2 x the head's per prompt (only the last token's logits)."""
    c = json.loads((model_dir / "config.json").read_text())
    hidden, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or hidden // heads
    kv = c.get("num_key_value_heads") or heads
    per_layer = hidden * head_dim * (2 * heads + 2 * kv) + 3 * hidden * c["intermediate_size"]
    return 2.0 * per_layer * c["num_hidden_layers"], 2.0 * hidden * c["vocab_size"]


def prefill_flops(shape: Shape | None, tokens: float, prompts: int) -> float:
    return float("nan") if shape is None else shape[0] * tokens + shape[1] * prompts


def matmul_peak(threads: int) -> float:
    """FLOP/s of float32 matmul at its best here ([512, 576] x [576, 1536], the shape of a big
    prefill's MLP), best of a few tries: the ceiling a prefill could reach."""
    import torch

    torch.set_num_threads(threads)
    a, w = torch.randn(512, 576), torch.randn(1536, 576)
    best = float("inf")
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(10):
            torch.nn.functional.linear(a, w)
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * 512 * 576 * 1536 / best


def measure(name: str, engine: Engine, args: argparse.Namespace, shape: Shape | None = None,
            beside: Callable[[tuple[float, ...]], None] | None = None) -> tuple[float, ...]:
    """Rounds of (1 stream, n at once, n staggered streams), one after the other, so that a change
    in the machine's load hits all three alike; ratios are taken within a round, then the median.
    `beside`, if given, runs after each round with the round's figures (a figure to be put against
    them, measured under the same load).
    The staggered run is measured over the window in which all n streams are running (ramp-up
    and ramp-down left out). Tokens per CPU-second of the engine's processes is printed too: on a
    shared machine it moves far less with the neighbours' load than tokens per wall second."""
    with httpx.Client(timeout=600) as client:
        ask(client, engine.urls[0], "warming up", 4, engine.model)
    n, rows = args.streams, []
    counters: dict[str, float] = {}
    engine_cpu_at: Callable[[float], float] = lambda t: float("nan")
    peak = matmul_peak(args.threads or DEFAULT_THREADS) if shape is not None else float("nan")

    def phase(count: int, requests: int, stagger: float = 0.0) -> tuple[float, float, list[list[Result]]]:
        nonlocal counters, engine_cpu_at
        samples: list[tuple[float, float]] = []
        before = engine.stats()
        done = threading.Event()

        def sample() -> None:  # the engine's CPU time, to be read over any window of the run
            while not done.wait(0.1):
                samples.append((time.perf_counter(), engine.cpu()))
        sampler = threading.Thread(target=sample)
        samples.append((time.perf_counter(), engine.cpu()))
        sampler.start()
        _, out = streams(engine.urls, count, requests, args.tokens, stagger, engine.model)
        done.set()
        sampler.join()
        samples.append((time.perf_counter(), engine.cpu()))
        after = engine.stats()
        counters = {k: after[k] - before.get(k, 0.0) for k in after}
        a, b = max(s[0].start for s in out), min(s[-1].times[-1] if s[-1].times else 0.0 for s in out)
        if b <= a:  # no window with every stream running (a burst): the whole run
            a, b = samples[0][0], samples[-1][0]
        tokens = sum(r.in_window(a, b) for s in out for r in s)

        def cpu_at(t: float) -> float:
            return min(samples, key=lambda x: abs(x[0] - t))[1]
        engine_cpu_at = cpu_at
        return tokens / (b - a), tokens / max(cpu_at(b) - cpu_at(a), 1e-9), out

    for _ in range(args.rounds):
        tps1, cps1, one = phase(1, args.requests)
        ttft1 = statistics.median(r.ttft for r in one[0])
        prefill1 = counters.get("prefill_cpu_s", 0.0) / args.requests
        flops1 = prefill_flops(shape, counters.get("prefill_tokens", 0.0), args.requests) / args.requests
        tpsb, cpsb, burst = phase(n, 1)
        # On one thread the slowest first token of a burst comes after all of the burst's prefill
        # work: at best the single request's TTFT with the burst's prefill CPU time in place of its
        # own. That is the floor of the ratio (the engine's CPU seconds, so the load moves it little).
        worst = max(s[0].ttft for s in burst)
        # The same in the engine's CPU seconds, which the neighbours' load moves little: from the
        # burst's first request to its last first token, against the burst's prefill CPU (1.00:
        # nothing but the prompts ran before it; sampled every 0.1 s).
        sent = min(s[0].start for s in burst)
        burst_cpu = engine_cpu_at(max(s[0].start + s[0].ttft for s in burst)) - engine_cpu_at(sent)
        cpu_over_floor = burst_cpu / counters["prefill_cpu_s"] if counters.get("prefill_cpu_s") else float("nan")
        floor = (ttft1 - prefill1 + counters.get("prefill_cpu_s", 0.0)) / ttft1 if counters else float("nan")
        work = (worst, floor, counters.get("prefills", float("nan")), counters.get("prefill_tokens", float("nan")),
                counters.get("prefix_hit_tokens", float("nan")), prefill1, counters.get("prefill_cpu_s", float("nan")))
        # The arithmetic rate that 2x would take: the burst's prefill done within the single
        # request's TTFT plus its own prefill (the rest of a TTFT, HTTP and sampling, as for one).
        flopsn = prefill_flops(shape, counters.get("prefill_tokens", 0.0), n)
        rates = (flopsn / (ttft1 + prefill1), flopsn / max(counters.get("prefill_cpu_s", 0.0), 1e-9),
                 flops1 / max(prefill1, 1e-9))
        # Spread arrivals: stream i joins i/n of a request's time after stream 0, as users do.
        tpss, cpss, steady = phase(n, args.requests, stagger=args.tokens / tps1 / n)
        cut = sum(1 for runs in (burst, steady) for s in runs for r in s
                  if r.tokens < args.tokens and r.finish != "stop")
        rows.append((tps1, ttft1, tpsb / tps1, worst / ttft1, *work, *rates, tpss / tps1,
                     max(statistics.median(r.ttft for r in s[1:] or s) for s in steady) / ttft1,
                     max(r.ttft for s in steady for r in s[1:] or s) / ttft1, cps1, cpsb / cps1, cpss / cps1, cut,
                     cpu_over_floor))
        if beside is not None:
            beside(rows[-1])
    for label, row in [*((f"  round {i + 1}", r) for i, r in enumerate(rows)),
                       (name, tuple(statistics.median(c) for c in zip(*rows)))]:
        (tps1, ttft1, rb, tb, worst, floor, forwards, computed, known, cpu1, cpun, need, rate, rate1, rs, ts, tw, cps1,
         cb, cs, cut, cpu_over_floor) = row
        detail = "" if floor != floor else (
            f" ({worst * 1000:4.0f} ms; floor {floor:3.1f}x: prefill CPU {cpun * 1000:3.0f} ms against "
            f"{cpu1 * 1000:3.0f} ms for one, {forwards:g} forwards, {computed:g} prompt tokens computed, "
            f"{known:g} from the cache; the engine's CPU to the last first token {cpu_over_floor:4.2f}x the prefill's")
        if shape is not None and floor == floor:
            detail += (f"; 2x needs the burst's prefill at {need / 1e9:3.0f} GFLOP/s, it ran at {rate / 1e9:3.0f} "
                       f"(one request's {rate1 / 1e9:3.0f}), this machine's best matmul at {args.threads or DEFAULT_THREADS} thread(s) "
                       f"{peak / 1e9:3.0f}")
        detail += ")" if detail else ""
        print(f"{label:<16} 1 stream {tps1:5.1f} tok/s, TTFT {ttft1 * 1000:4.0f} ms | {n} at once {rb:4.2f}x, "
              f"worst TTFT {tb:4.1f}x{detail} | {n} streams {rs:4.2f}x, TTFT worst stream median {ts:4.1f}x, worst "
              f"request {tw:4.1f}x | per CPU-s: 1 stream {cps1:5.1f} tok, {n} at once {cb:4.2f}x, {n} streams "
              f"{cs:4.2f}x | cut {cut:g}", flush=True)
    return tuple(statistics.median(c) for c in zip(*rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", default="torch,llama_cpp_batched,llama_cpp,llama_cpp_ni,llama_cpp_xN,llama_cpp_batch")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads per engine process; 0: none given, as a fleet without `threads` launches them")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=4, help="requests per stream, back to back")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2, help="processes for llama_cpp_xN")
    ap.add_argument("--client", choices=("httpx", "openai"), default="httpx",
                    help="how the streams ask: httpx's line iterator (lean), or the openai package as users do")
    args = ap.parse_args()
    CLIENT["name"] = args.client
    from agent.backends.llama_cpp import spec as llama_spec
    from agent.backends.torch import spec as torch_spec

    gguf = smollm2_gguf()
    server = {llama_spec.WORKER_ENV: "server"}
    llama = launch(llama_spec.SPEC, gguf, args.threads, env=server)
    quiet = launch(llama_spec.SPEC, gguf, args.threads, "--interrupt_requests", "False", env=server)
    batched = launch(llama_spec.SPEC, gguf, args.threads, env={llama_spec.WORKER_ENV: "batched"})
    threads = f"{args.threads}" if args.threads else f"the engines' default (torch: {DEFAULT_THREADS})"
    print(f"SmolLM2-135M-Instruct, {args.tokens} tokens per request, {args.requests} requests per stream, "
          f"{threads} thread(s) per engine process", flush=True)
    for name in args.engines.split(","):
        shape: Shape | None = None
        if name == "llama_cpp_batch":
            if not any(e.startswith("llama_cpp_batched") for e in args.engines.split(",")):
                from bench.llama_batch import llama_batched

                llama_batched(args, TOPICS, content)
            continue  # else measured round by round beside llama_cpp_batched
        if name in ("torch", "torch_nocache"):
            model = smollm2_safetensors(ROOT / ".pytest_cache" / "d" / "fleet-models", "float32")  # the tests' copy
            extra = ("--prefix-cache", "0") if name == "torch_nocache" else ()
            engine = Engine([launch(torch_spec.SPEC, model, args.threads, *extra)], torch_spec.SPEC.health)
            shape = model_shape(model)
        elif name == "llama_cpp_batched_serve":
            engine = ThroughServe(args.threads)
        elif name == "llama_cpp_batched":
            engine = Engine([batched], llama_spec.SPEC.health)
        elif name == "llama_cpp":
            engine = Engine([llama], llama_spec.SPEC.health)
        elif name == "llama_cpp_ni":
            engine = Engine([quiet], llama_spec.SPEC.health)
        elif name == "llama_cpp_xN":
            name = f"llama_cpp_x{args.procs}"
            engine = Engine([quiet] * args.procs, llama_spec.SPEC.health)
        else:
            raise SystemExit(f"unknown engine {name}")
        try:
            if name.startswith("llama_cpp_batched") and "llama_cpp_batch" in args.engines.split(","):
                measure_beside(name, engine, args)
            else:
                measure(name, engine, args, shape)
        finally:
            engine.stop()


def measure_beside(name: str, engine: Engine, args: argparse.Namespace) -> None:
    """llama_cpp_batched's rounds with the bindings' in-process batched decoding at n sequences
    (bench/llama_batch: the same prompts, --requests rounds of n, --tokens each) run after each
    round, in this process while the worker idles: each round's ratio (issue 34: the worker's n
    streams at least 0.8x) is taken between figures measured a minute apart under the same load,
    then the median. Tokens per wall second, and per CPU second (the worker's process, its HTTP
    side included, against the in-process loop's thread), which the neighbours' load moves less."""
    from bench.llama_batch import Figures, InProcess, line

    arm = InProcess(args, TOPICS, content)
    arm.run(1)  # warm-up
    one = arm.run(1)
    n, runs, ratios = args.streams, [], []

    def beside(row: tuple[float, ...]) -> None:
        many = arm.run(n)
        tps1, rb, rs, cps1, cs = (row[i] for i in (0, 2, 14, 17, 19))
        runs.append(many)
        ratios.append((rb * tps1 / many.tps, rs * tps1 / many.tps, cs * cps1 / many.cps, rs * tps1, cs * cps1, many.tps,
                       many.cps, many.load))
    try:
        measure(name, engine, args, beside=beside)
    finally:
        arm.close()
    print(line(n, one, Figures(*(statistics.median(getattr(r, f) for r in runs)
                                 for f in ("tps", "ttft", "cps", "prompt", "load")))), flush=True)
    for label, r in [*((f"  round {i + 1}", r) for i, r in enumerate(ratios)),
                     (name, tuple(statistics.median(c) for c in zip(*ratios)))]:
        at_once, streams, cpu, tps, cps, inproc, inproc_cps, load = r
        print(f"{label:<16} against the in-process batched decoding at {n} sequences: {n} streams {tps:5.1f} tok/s "
              f"against {inproc:5.1f} ({streams:4.2f}x; {n} at once {at_once:4.2f}x) | per CPU-s {cps:5.1f} tok "
              f"against {inproc_cps:5.1f} ({cpu:4.2f}x) | in-process arm at load {load:3.1f}", flush=True)


if __name__ == "__main__":
    main()
