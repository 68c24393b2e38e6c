"""bench/relay: the same streamed chat requests sent straight to a worker, through the router in a
process of its own, and through a real `fleet serve` process, at 1 and 64 concurrent streams, in
rounds that rotate which goes first; prints, for each relay, the time to the first event it adds
(p50, p99), relayed/direct events per second (median and range over rounds) and each process's
CPU per event. Targets (issue 7): <= 1 ms p50 added, >= 95% of direct.

The worker is a STAND-IN (hypercorn + starlette) that streams CHUNKS OpenAI-shaped SSE events as
fast as it can, so that the relay, not a model, is what is measured. "router" is fleet's own
(reconciler.serve.router behind reconciler.serve.front) in a process of its own, with a heartbeat
view that says the stand-in is running. "fleet serve" is the command as users run it, with its
heartbeat, store, logging and metrics, told by a SIMULATED agent (`fleet-agent simulate`, the
real agent API, no engine) that the stand-in is cluster chat's running member after a real
`fleet apply`.

Client, relays and worker share this machine's cores, so the load generator competes with the
relay for CPU: the default client is a lean raw-socket reader (fleet's own, net/client.py);
`--client httpx` uses httpx's line iterator, which costs about 85 us per event here, so that
client and worker alone fill two cores and every microsecond the relay spends shows as lost
throughput. Each run opens new client connections, so the first request of every run (1% of them
at the default 100, i.e. the p99) is the first on its connection.

    .venv/bin/python bench/relay.py [--chunks 200] [--requests 100] [--rounds 5] [--client lean|httpx]
                                    [--concurrency N ...] [--realtime]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, AsyncIterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from tests.agents import free_port  # noqa: E402

HOST = "127.0.0.2"


def serve_upstream(port: int, chunks: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    piece = json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "/srv/home/store/models/abc",
                        "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}).encode()

    async def chat(request: Request) -> StreamingResponse:
        await request.body()

        async def gen() -> AsyncIterator[bytes]:
            for _ in range(chunks):
                yield b"data: " + piece + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    config = Config()
    config.bind = [f"{HOST}:{port}"]
    config.accesslog = None
    app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
    trio.run(functools.partial(serve, app, config))  # type: ignore[arg-type]

def serve_router(port: int, upstream: int) -> None:
    from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
    from reconciler.core.observed import node_from_state
    from reconciler.serve.heartbeat import View
    from reconciler.serve.front import Front
    from reconciler.serve.router import Router

    digest = "sha256:" + "1" * 64
    desired = Desired(1, ControlPlaneSpec("w"), {"w": NodeSpec("w", HOST)},
                      {"m": ModelSpec("m", "safetensors", digest, "w")}, (), {"chat": ClusterSpec("chat", "m", ("w",), upstream)})
    state = {"servers": [{"id": "chat@w", "state": "running", "model": digest}],
             "inventory": {"disk": {"path": "/srv/home"}}, "weights": []}
    view = View(nodes={"w": node_from_state("w", state)}, online={"w": True})

    async def main() -> None:
        front = Front(Router(desired, view).app())
        gc.collect()
        gc.freeze()  # as fleet serve does once started (reconciler/serve/run.py)
        await front.serve(front.listen(HOST, port), trio.Event())
    trio.run(main)


async def measure(url: str, concurrency: int, requests: int, client: str) -> tuple[list[float], float, int]:
    """(time-to-first-event of each request, wall seconds, events received)."""
    measure_one = measure_httpx if client == "httpx" else measure_lean
    return await measure_one(url, concurrency, requests)


async def measure_lean(url: str, concurrency: int, requests: int) -> tuple[list[float], float, int]:
    # The lean client is fleet's own (net/client.py: raw socket, llhttp framing, keep-alive):
    # it costs the shared cores a fraction of httpx's per-line reader, so that what is measured
    # is the relay rather than the load generator competing with it for CPU.
    from net import client

    host, _, rest = url.removeprefix("http://").partition(":")
    port, path = int(rest.split("/", 1)[0]), "/" + rest.split("/", 1)[1]
    body = json.dumps({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    pool = client.Pool(per_host=concurrency)
    ttfb: list[float] = []
    events = 0
    limiter = trio.CapacityLimiter(concurrency)

    async def one() -> None:
        nonlocal events
        async with limiter:
            start = time.perf_counter()
            response = await client.request("POST", host, port, path, body=body, pool=pool,
                                            headers=[("Content-Type", "application/json")])
            carry, first = b"", True
            async for piece in response.chunks():
                if first:
                    ttfb.append(time.perf_counter() - start)
                    first = False
                seen = carry + piece
                events += seen.count(b"data: ") - carry.count(b"data: ")
                carry = seen[-5:]
            events -= 1  # data: [DONE]
            response.close()

    start = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for _ in range(requests):
            nursery.start_soon(one)
    return ttfb, time.perf_counter() - start, events


async def measure_httpx(url: str, concurrency: int, requests: int) -> tuple[list[float], float, int]:
    body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    ttfb: list[float] = []
    chunks = 0
    limiter = trio.CapacityLimiter(concurrency)
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def one() -> None:
            nonlocal chunks
            async with limiter:
                start = time.perf_counter()
                async with client.stream("POST", url, json=body) as r:
                    first = True
                    async for line in r.aiter_lines():
                        if first:
                            ttfb.append(time.perf_counter() - start)
                            first = False
                        if line.startswith("data: ") and line != "data: [DONE]":
                            chunks += 1
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(requests):
                nursery.start_soon(one)
        return ttfb, time.perf_counter() - start, chunks


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of a process (this one when pid is None)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def start_fleet_serve(base: Path, upstream: int, log: Path,
                      interval: float = 30.0) -> tuple[list[subprocess.Popen[bytes]], int]:
    """A simulated agent for node w (on HOST, beside the stand-in), `fleet apply` of cluster chat
    on the stand-in's port, and `fleet serve` as a user runs it. (processes, serve's port)"""
    from tests.agents import SECRET, agent_env, wait_healthy
    from tests.conftest import fleet_bin

    digest = "sha256:" + "1" * 64
    agent_port, port = free_port(HOST), free_port(HOST)
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
    (base / "fleet.yaml").write_text(f"""version: 1
control_plane: {{node: w, listen: "{HOST}:{port}"}}
nodes:
  w: {{address: {HOST}, agent_port: {agent_port}}}
models:
  m: {{format: safetensors, digest: "{digest}", source: w}}
clusters:
  chat: {{model: m, members: [w], port: {upstream}}}
""")
    env = agent_env(FLEET_STATE_DIR=str(base / "state"), FLEET_CLUSTER_SECRET=SECRET)
    sim = subprocess.Popen([fleet_bin("fleet-agent"), "simulate", "--dir", str(base / "sim"), "--first", HOST,
                            "--count", "1", "--port", str(agent_port), "--gpus", str(gpus),
                            "--hold", f"{digest}:safetensors:1000"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    wait_healthy(f"http://{HOST}:{agent_port}")
    subprocess.run([fleet_bin(), "apply", "-f", str(base / "fleet.yaml"), "--auto-approve"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    serve = subprocess.Popen([fleet_bin(), "serve", "-f", str(base / "fleet.yaml"), "--interval", str(interval)], env=env,
                             stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return [sim, serve], port


def wait_streaming(port: int) -> None:
    """Until a chat request through `port` answers 200 (the relay is up and sees its member)."""
    for _ in range(600):
        try:
            if httpx.post(f"http://{HOST}:{port}/v1/chat/completions", json={"model": "chat"},
                          timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"nothing answers on {HOST}:{port}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="load generator: fleet's raw-socket reader (default) or httpx's streaming lines")
    ap.add_argument("--concurrency", type=int, action="append", help="streams at once (default: 1 and 64)")
    ap.add_argument("--realtime", action="store_true",
                    help="run client and relays at SCHED_FIFO 30 and the worker at 20 (root only), so that other "
                         "load on a shared machine does not decide the tail; keep --chunks small (20) or the "
                         "kernel's RT throttling adds 50 ms stalls of its own")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        return serve_upstream(args.serve_upstream, args.chunks)
    if args.serve_router:
        return serve_router(args.serve_router, args.upstream)
    up = free_port(HOST)
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up), "--chunks", str(args.chunks)])]
    rt = free_port(HOST)
    procs.append(subprocess.Popen([sys.executable, __file__, "--serve-router", str(rt), "--upstream", str(up)]))
    with tempfile.TemporaryDirectory(prefix="fleet-relay-") as tmp:
        try:
            wait_streaming(up)
            wait_streaming(rt)
            started, fs = start_fleet_serve(Path(tmp), up, Path(tmp) / "serve.log")
            procs += started
            wait_streaming(fs)
            if args.realtime:
                subprocess.run(["chrt", "-a", "-f", "-p", "20", str(procs[0].pid)], check=True)
                for pid in (procs[1].pid, procs[3].pid):
                    subprocess.run(["chrt", "-a", "-f", "-p", "30", str(pid)], check=True)
                os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(30))
            run(args, {"direct": up, "router": rt, "fleet serve": fs},
                {"client": None, "worker": procs[0].pid, "router": procs[1].pid, "fleet serve": procs[3].pid})
        finally:
            for p in reversed(procs):
                p.terminate()
                p.wait(30)


def run(args: argparse.Namespace, ports: dict[str, int], pids: dict[str, int | None]) -> None:
    labels = list(ports)
    print(f"{args.rounds} rounds of {args.requests} streamed requests of {args.chunks} chunks each, per setting, "
          f"{', '.join(labels)} in rotating order; client ({args.client}), relays and stand-in worker share this "
          f"machine's {os.cpu_count()} cores")
    for concurrency in args.concurrency or (1, 64):
        rounds = []
        pooled: dict[str, list[float]] = {label: [] for label in labels}
        firsts: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(args.rounds):
            runs: dict[str, tuple[list[float], float, int, dict[str, float]]] = {}
            for label in labels[r % len(labels):] + labels[:r % len(labels)]:
                before = {k: cpu_seconds(p) for k, p in pids.items()}
                ttfb, wall, events = trio.run(measure, f"http://{HOST}:{ports[label]}/v1/chat/completions",
                                              concurrency, args.requests, args.client)
                assert events == args.requests * args.chunks, (label, events)  # nothing lost or invented
                cpu = {k: (cpu_seconds(p) - before[k]) / events * 1e6 for k, p in pids.items()}
                runs[label] = (ttfb, wall, events, cpu)
                pooled[label] += ttfb
                firsts[label].append(ttfb[0])
            d = runs["direct"]
            row: dict[str, Any] = {"direct50": pct(d[0], 50) * 1000, "rate_d": d[2] / d[1], "cpu_direct": d[3]}
            for label in labels[1:]:
                rl = runs[label]
                row[label] = {"added50": (pct(rl[0], 50) - pct(d[0], 50)) * 1000,
                              "added99": (pct(rl[0], 99) - pct(d[0], 99)) * 1000,
                              "rate": rl[2] / rl[1], "ratio": (rl[2] / rl[1]) / (d[2] / d[1]), "cpu": rl[3]}
            rounds.append(row)
        print(f"concurrency {concurrency:2d}: TTFB p50 direct {statistics.median(x['direct50'] for x in rounds):6.2f} ms,"
              f" events/s direct {statistics.median(x['rate_d'] for x in rounds):6.0f}")
        # Each run's p99 is its slowest request or so, often its first (a new connection); pooled
        # over all rounds the p99 is steadier, and the rounds' spread shows the machine's noise.
        for label in labels[1:]:
            print(f"  {label:11s} pooled over rounds: adds p50 "
                  f"{(pct(pooled[label], 50) - pct(pooled['direct'], 50)) * 1000:+.2f} ms, p99 "
                  f"{(pct(pooled[label], 99) - pct(pooled['direct'], 99)) * 1000:+.2f} ms; first request on a new "
                  f"connection {statistics.median(firsts[label]) * 1000:.2f} ms (direct "
                  f"{statistics.median(firsts['direct']) * 1000:.2f} ms)")
        for label in labels[1:]:
            per = [x[label] for x in rounds]
            a50, a99 = [p["added50"] for p in per], [p["added99"] for p in per]
            ratios = [p["ratio"] for p in per]
            print(f"  {label:11s} adds p50 {statistics.median(a50):+.2f} ms (rounds {min(a50):+.2f}..{max(a50):+.2f}), "
                  f"p99 {statistics.median(a99):+.2f} ms (rounds {min(a99):+.2f}..{max(a99):+.2f}); "
                  f"events/s {statistics.median(p['rate'] for p in per):6.0f}: relayed/direct "
                  f"{statistics.median(ratios):.2f} (rounds {min(ratios):.2f}-{max(ratios):.2f})")
        for label in labels:
            key = "cpu_direct" if label == "direct" else label
            cpu = {k: statistics.median((x[key] if label == "direct" else x[key]["cpu"])[k] for x in rounds)
                   for k in pids}
            print(f"    CPU us/event via {label:11s}: " + ", ".join(
                f"{k} {v:5.1f}" for k, v in cpu.items() if k in ("client", "worker", label)))


if __name__ == "__main__":
    main()
