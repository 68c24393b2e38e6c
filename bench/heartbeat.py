"""bench/heartbeat: the control plane's CPU for heartbeating N agents (SIMULATED: one process hosts
N real agent HTTP apps on loopback, `fleet-agent simulate`). Prints CPU per beat and the share of
one core that costs at the 30 s interval. Target (issue 7): < 5% of one core for 1,000 agents.

    .venv/bin/python bench/heartbeat.py [--count 1000] [--beats 3]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from reconciler.client import AgentClient  # noqa: E402
from reconciler.model import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec  # noqa: E402
from reconciler.observe import observer  # noqa: E402
from reconciler.serve.heartbeat import Heartbeat  # noqa: E402
from reconciler.state_store import StateStore  # noqa: E402
from tests.agents import SECRET, agent_env, free_port, wait_healthy  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402

DIGEST = "sha256:" + "ab" * 32
FIRST = "127.1.0.1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=1000)
    ap.add_argument("--beats", type=int, default=3)
    args = ap.parse_args()
    n = args.count
    with tempfile.TemporaryDirectory(prefix="fleet-hb-") as tmp:
        base = Path(tmp)
        gpus = base / "gpus.json"
        gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
        port = free_port(FIRST)
        sim = subprocess.Popen([fleet_bin("fleet-agent"), "simulate", "--dir", str(base / "sim"), "--count", str(n),
                                "--port", str(port), "--gpus", str(gpus), "--hold", f"{DIGEST}:safetensors:1000"],
                               env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        try:
            assert sim.stdout is not None
            sim.stdout.readline()
            first = ipaddress.IPv4Address(FIRST)
            wait_healthy(f"http://{first + n - 1}:{port}")
            nodes = {f"n{i}": NodeSpec(f"n{i}", str(first + i), port) for i in range(n)}
            clusters = {f"c{k}": ClusterSpec(f"c{k}", "m", tuple(f"n{i}" for i in range(k * 10, min(n, k * 10 + 10))),
                                             9000) for k in range((n + 9) // 10)}
            desired = Desired(1, ControlPlaneSpec("n0"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "n0")},
                              (), clusters)
            store = StateStore(base / "state")

            async def run() -> list[tuple[float, float]]:
                out = []
                async with AgentClient(SECRET) as client:
                    beat = Heartbeat(desired, observer(desired, client), store.serve)
                    await beat.beat()  # warm: connections, imports, first rows
                    for _ in range(args.beats):
                        cpu, wall = time.process_time(), time.perf_counter()
                        await beat.beat()
                        out.append((time.process_time() - cpu, time.perf_counter() - wall))
                    assert all(beat.view.online.values()) and len(beat.view.online) == n
                return out

            rows = trio.run(run)
            cpu = sorted(c for c, _ in rows)[len(rows) // 2]
            wall = sorted(w for _, w in rows)[len(rows) // 2]
            print(f"heartbeat of {n} simulated agents: {cpu:.2f} s CPU, {wall:.2f} s wall per beat (median of "
                  f"{len(rows)}); at the 30 s interval: {cpu / 30 * 100:.1f}% of one core (target < 5%)")
            print(f"  per node: {cpu / n * 1000:.2f} ms CPU per beat (state fetch, schema check, store rows)")
        finally:
            sim.terminate()
            sim.wait(30)


if __name__ == "__main__":
    os.environ.setdefault("FLEET_CLUSTER_SECRET", SECRET)
    main()
