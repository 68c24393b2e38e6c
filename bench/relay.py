"""bench/relay: the same streamed chat requests sent straight to a worker and through the router,
at 1 and 64 concurrent streams, in rounds that alternate which goes first; prints the time to the
first event the relay adds (p50, p99), relayed/direct events per second (median and range over
rounds) and each process's CPU per event. Targets (issue 7): <= 1 ms p50 added, >= 95% of direct.

The worker is a STAND-IN (hypercorn + starlette) that streams CHUNKS OpenAI-shaped SSE events as
fast as it can, so that the relay, not a model, is what is measured. The router is fleet's own
(reconciler.serve.router behind reconciler.serve.front), in its own process, as `fleet serve`
runs it, with a heartbeat view that says the stand-in is running.

Client, router and worker share this machine's cores, so the load generator competes with the
relay for CPU: the default client is a lean raw-socket reader (fleet's own upstream reader);
`--client httpx` uses httpx's line iterator, which costs about 85 us per event here, so that
client and worker alone fill two cores and every microsecond the relay spends shows as lost
throughput.

    .venv/bin/python bench/relay.py [--chunks 200] [--requests 100] [--rounds 5] [--client lean|httpx]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import trio  # noqa: E402

from tests.agents import free_port  # noqa: E402

HOST = "127.0.0.2"


def serve_upstream(port: int, chunks: int) -> None:
    from hypercorn.config import Config
    from hypercorn.trio import serve
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    piece = json.dumps({"id": "x", "object": "chat.completion.chunk", "model": "/srv/home/store/models/abc",
                        "choices": [{"index": 0, "delta": {"content": "tok "}, "finish_reason": None}]}).encode()

    async def chat(request):  # type: ignore[no-untyped-def]
        await request.body()

        async def gen():  # type: ignore[no-untyped-def]
            for _ in range(chunks):
                yield b"data: " + piece + b"\n\n"
            yield b"data: [DONE]\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream")

    config = Config()
    config.bind = [f"{HOST}:{port}"]
    config.accesslog = None
    trio.run(serve, Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])]), config)


def serve_router(port: int, upstream: int) -> None:
    from reconciler.model import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
    from reconciler.observed import node_from_state
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
        await front.serve(front.listen(HOST, port), trio.Event())
    trio.run(main)


async def measure(url: str, concurrency: int, requests: int, client: str) -> tuple[list[float], float, int]:
    """(time-to-first-event of each request, wall seconds, events received)."""
    measure_one = measure_httpx if client == "httpx" else measure_lean
    return await measure_one(url, concurrency, requests)


async def measure_lean(url: str, concurrency: int, requests: int) -> tuple[list[float], float, int]:
    # The lean client is fleet's own upstream reader (raw socket, chunked decoding, keep-alive):
    # it costs the shared cores a fraction of httpx's per-line reader, so that what is measured
    # is the relay rather than the load generator competing with it for CPU.
    from reconciler.serve import upstream

    host, _, rest = url.removeprefix("http://").partition(":")
    port, path = int(rest.split("/", 1)[0]), "/" + rest.split("/", 1)[1]
    body = json.dumps({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
    pool = upstream.Pool(per_host=concurrency)
    ttfb: list[float] = []
    events = 0
    limiter = trio.CapacityLimiter(concurrency)

    async def one() -> None:
        nonlocal events
        async with limiter:
            start = time.perf_counter()
            response = await upstream.post(host, port, path, body, pool)
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--client", choices=("lean", "httpx"), default="lean",
                    help="load generator: fleet's raw-socket reader (default) or httpx's streaming lines")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--serve-router", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        return serve_upstream(args.serve_upstream, args.chunks)
    if args.serve_router:
        return serve_router(args.serve_router, args.upstream)
    up, rt = free_port(HOST), free_port(HOST)
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up), "--chunks", str(args.chunks)]),
             subprocess.Popen([sys.executable, __file__, "--serve-router", str(rt), "--upstream", str(up)])]
    try:
        for port in (up, rt):
            for _ in range(300):
                try:
                    httpx.post(f"http://{HOST}:{port}/v1/chat/completions", json={"model": "chat"}, timeout=1)
                    break
                except httpx.TransportError:
                    time.sleep(0.05)
        print(f"{args.rounds} rounds of {args.requests} streamed requests of {args.chunks} chunks each, per setting, "
              f"direct and relayed alternating; client ({args.client}), router and stand-in worker share this "
              f"machine's {os.cpu_count()} cores")
        pids = {"client": None, "worker": procs[0].pid, "router": procs[1].pid}
        for concurrency in (1, 64):
            rounds = []
            for r in range(args.rounds):
                runs: dict[str, tuple[list[float], float, int, dict[str, float]]] = {}
                order = (("direct", up), ("relayed", rt)) if r % 2 == 0 else (("relayed", rt), ("direct", up))
                for label, port in order:
                    before = {k: cpu_seconds(p) for k, p in pids.items()}
                    ttfb, wall, events = trio.run(measure, f"http://{HOST}:{port}/v1/chat/completions", concurrency,
                                                  args.requests, args.client)
                    assert events == args.requests * args.chunks, (label, events)  # nothing lost or invented
                    cpu = {k: (cpu_seconds(p) - before[k]) / events * 1e6 for k, p in pids.items()}
                    runs[label] = (ttfb, wall, events, cpu)
                d, rl = runs["direct"], runs["relayed"]
                rounds.append({"added50": (pct(rl[0], 50) - pct(d[0], 50)) * 1000,
                               "added99": (pct(rl[0], 99) - pct(d[0], 99)) * 1000,
                               "direct50": pct(d[0], 50) * 1000, "rate_d": d[2] / d[1], "rate_r": rl[2] / rl[1],
                               "ratio": (rl[2] / rl[1]) / (d[2] / d[1]), "cpu_d": d[3], "cpu_r": rl[3]})
            med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0] if not k.startswith("cpu")}
            lo, hi = min(x["ratio"] for x in rounds), max(x["ratio"] for x in rounds)
            print(f"concurrency {concurrency:2d}: TTFB p50 direct {med['direct50']:6.2f} ms, added by the relay "
                  f"p50 {med['added50']:+.2f} ms, p99 {med['added99']:+.2f} ms; events/s direct {med['rate_d']:6.0f}, "
                  f"relayed {med['rate_r']:6.0f}: relayed/direct {med['ratio']:.2f} (rounds {lo:.2f}-{hi:.2f})")
            for label in ("direct", "relayed"):
                cpu = {k: statistics.median(x["cpu_" + label[0]][k] for x in rounds) for k in pids}
                print(f"    CPU us/event {label:7s}: " + ", ".join(f"{k} {v:5.1f}" for k, v in cpu.items()
                                                                   if v or k != "router"))
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
