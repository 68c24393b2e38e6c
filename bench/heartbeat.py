"""bench/heartbeat: the control plane's CPU for a heartbeat of N agents and its drift plan
(SIMULATED: `fleet-agent simulate` processes host N real agent apps on loopback; bench/simfleet.py).
Prints CPU per beat and the share of one core that costs at the 30 s interval, for:

- a quiet beat (the usual one: every agent answers 304 to the generation held, nothing is parsed,
  planned again or rewritten);
- a beat where every agent's state changed (each answers its state: parsed, checked, planned);
- the first beat (everything new: every row written).

Target (issue 16): heartbeat plus drift plan of 10,000 agents < 5% of one core at 30 s.

    .venv/bin/python bench/heartbeat.py [--count 10000] [--beats 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from bench.simfleet import DIGEST, addresses, cpu_of, machine, simulated, touch_gpus  # noqa: E402
from reconciler.agents.client import AgentClient  # noqa: E402
from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec  # noqa: E402
from reconciler.agents.observe import observer  # noqa: E402
from reconciler.serve.heartbeat import Heartbeat  # noqa: E402
from reconciler.state.store import StateStore  # noqa: E402
from reconciler.agents.transport import SocketTransport  # noqa: E402
from tests.agents import SECRET  # noqa: E402

INTERVAL_S, TARGET = 30.0, 5.0  # % of one core


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--beats", type=int, default=3, help="quiet beats measured (the median is printed)")
    ap.add_argument("--sim-processes", type=int, default=2)
    args = ap.parse_args()
    n = args.count
    print(f"machine: {machine()}; SIMULATED agents in {args.sim_processes} processes on the same machine")
    with tempfile.TemporaryDirectory(prefix="fleet-hb-") as tmp:
        base = Path(tmp)
        with simulated(base, n, args.sim_processes) as (port, sims):
            nodes = {f"n{i}": NodeSpec(f"n{i}", address, port)
                     for i, address in enumerate(addresses(n, args.sim_processes))}
            clusters = {f"c{k}": ClusterSpec(f"c{k}", "m", tuple(f"n{i}" for i in range(k * 10, min(n, k * 10 + 10))),
                                             9000) for k in range((n + 9) // 10)}
            desired = Desired(1, ControlPlaneSpec("n0"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "n0")},
                              (), clusters)
            store = StateStore(base / "state")
            store.db.execute("PRAGMA synchronous=NORMAL")  # as fleet serve runs it

            async def run() -> dict[str, list[tuple[float, float, float]]]:
                out: dict[str, list[tuple[float, float, float]]] = {"first": [], "changed": [], "quiet": []}
                # As fleet serve runs it (serve/run.py): a connection kept per agent between beats.
                async with AgentClient(SECRET, transport=SocketTransport(keep_alive=True, max_idle=n)) as client:
                    beat = Heartbeat(desired, observer(desired, client), store.serve, interval=INTERVAL_S,
                                     timeout=INTERVAL_S)

                    async def one(kind: str) -> None:
                        cpu, wall, sim = time.process_time(), time.perf_counter(), sum(cpu_of(p) for p in sims)
                        await beat.beat()
                        out[kind].append((time.process_time() - cpu, time.perf_counter() - wall,
                                          sum(cpu_of(p) for p in sims) - sim))

                    await one("first")
                    assert all(beat.view.online.values()) and len(beat.view.online) == n, "an agent did not answer"
                    plan = beat.view.plan
                    assert plan is not None and plan.count(plan.changes[0].action) == n  # every member to start
                    print(f"  before the quiet beats: {machine()}")
                    for _ in range(args.beats):
                        held = dict(beat.view.nodes)
                        await one("quiet")
                        news = sum(1 for name, node in beat.view.nodes.items() if node is not held.get(name))
                        # The agents' disk is shared with whatever else runs here: its free space
                        # crossing a 256 MiB step is news for every agent of a simulator.
                        print(f"  quiet beat: {news} of {n} agents had news"
                              + ("" if beat.view.plan is plan else " (planned again)"))
                    touch_gpus(base, 70 << 30)  # 10 GiB less free on every GPU: every state is news
                    await trio.sleep(1.1)  # the simulators measure their machine once a second
                    await one("changed")
                    assert beat.view.plan is not plan
                return out

            rows = trio.run(run)
            for kind in ("quiet", "changed", "first"):
                cpu, wall, sim = sorted(rows[kind])[len(rows[kind]) // 2]
                share = cpu / INTERVAL_S * 100
                verdict = (" (target < 5%: " + ("meets" if share < TARGET else "MISSES") + ")") if kind == "quiet" else ""
                print(f"heartbeat of {n} simulated agents, {kind} beat: {cpu:.2f} s CPU ({cpu / n * 1000:.3f} ms/node), "
                      f"{wall:.2f} s wall; at the {INTERVAL_S:g} s interval {share:.1f}% of one core{verdict}; "
                      f"the simulated agents' CPU {sim:.2f} s")


if __name__ == "__main__":
    os.environ.setdefault("FLEET_CLUSTER_SECRET", SECRET)
    main()
