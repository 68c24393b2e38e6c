"""bench/simserver: the CPU one `fleet-agent simulate` process spends per request (SIMULATED agents,
bench/simfleet.py): GETs of /v1/state, one request per connection (`Connection: close`), 64 at a
time, through fleet's own fan-out client (reconciler/agents/batch.py), answered 304 (the generation
held) and 200 (the whole state), alternately. The simulator's CPU is read from /proc; what it
measures is net's server (net/server.py) and the real agent app in front of which it sits, the
per-request cost behind the simulators' figure in bench/plan_scale.

    .venv/bin/python bench/simserver.py [--agents 200] [--rounds 10] [--modes 304,200,304,200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.simfleet import addresses, cpu_of, machine, simulated  # noqa: E402
from reconciler.agents.batch import exchange_all  # noqa: E402
from reconciler.agents.transport import AgentRequest  # noqa: E402
from reconciler.core.desired import NodeSpec  # noqa: E402
from tests.agents import SECRET  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--agents", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10, help="requests to each agent per figure")
    ap.add_argument("--modes", default="304,200,304,200", help="the answers asked for, one figure each")
    args = ap.parse_args()
    print(f"machine: {machine()}; SIMULATED agents in 1 process on the same machine")
    with tempfile.TemporaryDirectory() as d, simulated(Path(d), args.agents, processes=1) as (port, pids):
        nodes = [NodeSpec(name=f"n{i}", address=a, agent_port=port) for i, a in enumerate(addresses(args.agents, 1))]
        for mode in args.modes.split(","):
            first = trio.run(lambda: exchange_all([AgentRequest("GET", n, "/v1/state", secret=SECRET) for n in nodes],
                                                   concurrency=64, timeout=60))
            held = [json.loads(r[1])["generation"] if isinstance(r, tuple) else None for r in first]
            requests = [AgentRequest("GET", n, "/v1/state", secret=SECRET, unless=g if mode == "304" else None)
                        for n, g in zip(nodes, held)] * args.rounds
            cpu, wall = cpu_of(pids[0]), time.perf_counter()
            results = trio.run(lambda: exchange_all(requests, concurrency=64, timeout=60))
            cpu, wall = cpu_of(pids[0]) - cpu, time.perf_counter() - wall
            other = sum(1 for r in results if not (isinstance(r, tuple) and r[0] == int(mode)))
            print(f"{mode}: {len(requests)} requests, the simulator's CPU {cpu * 1000 / len(requests):.3f} ms a request, "
                  f"{wall * 1000 / len(requests):.3f} ms wall" + (f", {other} answered otherwise" if other else "")
                  + f"; {machine()}")


if __name__ == "__main__":
    main()
