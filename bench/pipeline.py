"""bench/pipeline: SmolLM2-135M-Instruct (float32 twin) whole on one node against split in two
pipeline stages on loopback, in one run: the whole model's tokens/s (torch_worker), the two-stage
pipeline's tokens/s at 1 and at n concurrent streams, and the bytes the stages moved between them
per generated token against the floor (hidden_size x bytes per element per token and hop: what a
step of batch b must move at least is hidden_size x bytes x b).

Targets (issue 14): at 1 stream the pipeline >= 0.85x the whole model; at n = 8 streams the
pipeline >= 1.5x its own 1-stream figure.

Each process gets --threads threads, as the agent starts them; the slices are the ones an agent
would hold (wire.manifest.make_slice, assembled), made once beside the cached twin. Each stream
asks for a story (greedy, --tokens new tokens) and sends --requests requests back to back. Rounds
of (whole 1 stream, pipeline 1 stream, pipeline n streams) alternate; ratios are taken within a
round, and the round with the median 1-stream ratio is shown first.

    .venv/bin/python bench/pipeline.py [--threads 1] [--tokens 32] [--requests 3] [--streams 8]
        [--rounds 3] [--micro-batches N] [--nice N]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from reconciler.agents.netutil import free_port  # noqa: E402
from tests.models import sliced, smollm2_safetensors  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ADDRESSES = ["127.0.0.41", "127.0.0.42"]
SPANS = ["0-14", "15-29"]
TOPICS = ["a dragon who learns to cook", "a lighthouse keeper and a storm", "a robot that paints the sea",
          "two friends crossing a desert", "a city that never sleeps", "a cat who runs a bakery",
          "the last train of the night", "a garden on the moon"]


def start(argv: list[str], nice: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=(lambda: os.setpriority(os.PRIO_PROCESS, 0, nice)) if nice else None)


def free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def wait_healthy(urls: list[str], procs: list[subprocess.Popen[bytes]]) -> None:
    deadline = time.monotonic() + 600
    for url in urls:
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
                stop(procs)
                raise SystemExit(f"{url} did not come up")
            time.sleep(0.3)


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def ask(client: httpx.Client, url: str, topic: str, tokens: int) -> tuple[int, int]:
    """(completion tokens, prompt tokens) of one greedy story."""
    body = {"model": "m", "messages": [{"role": "user", "content": f"Write a long story about {topic}."}],
            "max_tokens": tokens, "temperature": 0}
    r = client.post(url + "/v1/chat/completions", json=body)
    r.raise_for_status()
    usage = r.json()["usage"]
    return int(usage["completion_tokens"]), int(usage["prompt_tokens"])


def streams(url: str, n: int, requests: int, tokens: int) -> tuple[float, int, int]:
    """n streams of `requests` requests each, back to back: (wall seconds, tokens made, prompt tokens)."""
    made = [[0, 0] for _ in range(n)]
    go = threading.Barrier(n + 1)

    def run(i: int) -> None:
        with httpx.Client(timeout=900) as client:
            go.wait()
            for k in range(requests):
                done, prompt = ask(client, url, TOPICS[(i + k) % len(TOPICS)], tokens)
                made[i][0] += done
                made[i][1] += prompt
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    go.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0, sum(m[0] for m in made), sum(m[1] for m in made)


def sent(urls: list[str]) -> dict[str, int]:
    """What the stages put on the wire so far, by kind, and the time they spent computing (summed
    over the stages)."""
    out: dict[str, int] = {}
    for i, url in enumerate(urls):
        body: dict[str, Any] = httpx.get(url + "/health", timeout=10).json()
        for k, v in (body["engine"] if i == 0 else body["stage"]).items():
            if k.startswith("sent_") or k == "compute_us":
                out[k] = out.get(k, 0) + int(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(prog="bench/pipeline.py")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--nice", type=int, default=0,
                    help="niceness of every engine process, the whole model's and the stages' alike (negative: "
                         "root only; on a shared machine it keeps other load from deciding each wake-up)")
    ap.add_argument("--micro-batches", type=int, help="the first stage's lanes in flight (default: one per stage)")
    args = ap.parse_args()
    twin = smollm2_safetensors(ROOT / ".pytest_cache" / "d" / "fleet-models", "float32")
    config = json.loads((twin / "config.json").read_text())
    hidden, element = int(config["hidden_size"]), 4
    dirs = sliced(twin, SPANS, twin.parent)
    py = sys.executable

    port = free_port("127.0.0.1")
    whole = [start([py, "-m", "agent.backends.torch.worker", "--model", str(twin), "--host", "127.0.0.1", "--port",
                    str(port), "--threads", str(args.threads)], args.nice)]
    whole_url = f"http://127.0.0.1:{port}"
    port = free_port(*ADDRESSES)
    while not free(ADDRESSES[0], port + 1):  # the rendezvous
        port = free_port(*ADDRESSES)
    stage_urls = [f"http://{a}:{port}" for a in ADDRESSES]
    details = {"group": "bench0000000000", "world_size": 2, "rendezvous": {"address": ADDRESSES[0], "port": port + 1},
               "stages": [{"node": f"node{i}", "address": a, "layers": s} for i, (a, s) in enumerate(zip(ADDRESSES, SPANS))]}
    extra = ["--micro-batches", str(args.micro_batches)] if args.micro_batches else []
    stages = [start([py, "-m", "agent.backends.pipeline.stage", "--model", str(d), "--host", ADDRESSES[i], "--port",
                     str(port), "--threads", str(args.threads), "--pipeline", json.dumps({**details, "rank": i}),
                     *extra], args.nice) for i, d in enumerate(dirs)]
    try:
        wait_healthy([whole_url], whole)
        wait_healthy(stage_urls, stages)
        with httpx.Client(timeout=900) as client:
            ask(client, whole_url, "warming up", 4)
            ask(client, stage_urls[0], "warming up", 4)
        rounds = []
        for _ in range(args.rounds):  # alternated, so that a change in the machine's load hits all alike
            wall, made, _ = streams(whole_url, 1, args.requests, args.tokens)
            row: list[Any] = [made / wall]
            for n in (1, args.streams):
                before = sent(stage_urls)
                wall, made, prompt = streams(stage_urls[0], n, args.requests, args.tokens)
                after = sent(stage_urls)
                row.append((made / wall, made, prompt, {k: after[k] - before.get(k, 0) for k in after}))
            rounds.append(row)
        print(f"SmolLM2-135M-Instruct f32, {args.threads} thread(s) per process, {args.tokens} tokens x "
              f"{args.requests} requests per stream, {args.rounds} rounds (median, then each round)")
        ordered = sorted(rounds, key=lambda r: r[1][0] / r[0])  # by the 1-stream ratio
        for label, (whole_tps, *rows) in [("median", ordered[len(ordered) // 2]),
                                          *((f"round {i + 1}", r) for i, r in enumerate(rounds))]:
            print(f"{label}: whole model (torch_worker) 1 stream {whole_tps:6.1f} tok/s")
            one = rows[0][0]
            for n, (tps, made, prompt, moved) in zip((1, args.streams), rows):
                if n == 1:  # where a token's time goes: the stages' own arithmetic, and the rest
                    compute = moved["compute_us"] / 1000 / made
                    print(f"  pipeline 1 stream: {1000 / tps:5.1f} ms/token, of which the stages computed "
                          f"{compute:5.1f} (whole model: {1000 / whole_tps:5.1f}); waiting and the link: "
                          f"{1000 / tps - compute:5.1f}")
                total = sum(v for k, v in moved.items() if k.startswith("sent_") and k != "sent_messages")
                decode = total - prompt * hidden * element  # the prompts' rows cross once, at prefill
                floor = hidden * element  # per generated token and hop (two stages: one hop forward)
                ratio = f"= {tps / whole_tps:4.2f}x whole" if n == 1 else f"= {tps / one:4.2f}x its 1 stream"
                print(f"  pipeline, 2 stages {n:2d} stream{'s' if n > 1 else ' '} {tps:6.1f} tok/s {ratio} | moved "
                      f"{total / made:5.0f} B/token, {decode / made:5.0f} past the prompts; floor {floor} B/token "
                      f"(hidden {hidden} x {element} B, x batch per step) | {moved.get('sent_messages', 0) / made:3.1f} "
                      "messages/token", flush=True)
    finally:
        stop(whole + stages)


if __name__ == "__main__":
    main()
