"""bench/relay: the same streamed chat requests sent straight to a worker and through the router,
at 1 and 64 concurrent streams; prints added time-to-first-byte (p50, p99) and chunks/s as ratios
measured side by side in one run. Targets (issue 7): <= 1 ms p50 added, >= 95% of direct throughput.

The worker here is a STAND-IN that streams CHUNKS OpenAI-shaped SSE chunks as fast as it can, so
that the relay, not a model, is what is measured. The router is fleet's own (reconciler.serve.router)
under hypercorn, in its own process, with a heartbeat view that says the stand-in is running.

    .venv/bin/python bench/relay.py [--chunks 200] [--requests 100]
"""

from __future__ import annotations

import argparse
import json
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
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from reconciler.model import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec
    from reconciler.serve.heartbeat import View
    from reconciler.serve.router import Router

    digest = "sha256:" + "1" * 64
    desired = Desired(1, ControlPlaneSpec("w"), {"w": NodeSpec("w", HOST)},
                      {"m": ModelSpec("m", "safetensors", digest, "w")}, (), {"chat": ClusterSpec("chat", "m", ("w",), upstream)})
    view = View(states={"w": {"servers": [{"id": "chat@w", "state": "running", "model": digest}],
                              "inventory": {"disk": {"path": "/srv/home"}}, "weights": []}}, online={"w": True})
    config = Config()
    config.bind = [f"{HOST}:{port}"]
    config.accesslog = None
    trio.run(serve, Router(desired, view).app(), config)


async def measure(url: str, concurrency: int, requests: int) -> tuple[list[float], float, int]:
    """(time-to-first-byte of each request, wall seconds, chunks received)."""
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


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--requests", type=int, default=100)
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
        print(f"{args.requests} streamed requests of {args.chunks} chunks each, per setting; client, router and "
              "stand-in worker share this machine's cores")
        for concurrency in (1, 64):
            direct = trio.run(measure, f"http://{HOST}:{up}/v1/chat/completions", concurrency, args.requests)
            relayed = trio.run(measure, f"http://{HOST}:{rt}/v1/chat/completions", concurrency, args.requests)
            assert relayed[2] == direct[2] == args.requests * args.chunks, (relayed[2], direct[2])
            added50 = (pct(relayed[0], 50) - pct(direct[0], 50)) * 1000
            added99 = (pct(relayed[0], 99) - pct(direct[0], 99)) * 1000
            rate_d, rate_r = direct[2] / direct[1], relayed[2] / relayed[1]
            print(f"concurrency {concurrency:2d}: TTFB p50 direct {pct(direct[0], 50) * 1000:6.2f} ms, relayed "
                  f"{pct(relayed[0], 50) * 1000:6.2f} ms (+{added50:.2f}); p99 +{added99:.2f} ms; chunks/s direct "
                  f"{rate_d:8.0f}, relayed {rate_r:8.0f} = {rate_r / rate_d:.2f} of direct")
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


if __name__ == "__main__":
    main()
