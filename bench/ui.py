"""bench/ui: what the status page's data costs `fleet serve` for N agents (SIMULATED: `fleet-agent
simulate` processes host N real agent apps on loopback; bench/simfleet.py), printed beside the
heartbeat's own cost for the same fleet:

- GET /ui/api/overview: the fleet summarised, the first page of nodes (100), every cluster, the
  weights, as JSON (serve/ui/app.py StatusPage.encoded, computed once per change of the view for
  every event stream asking the same page; a second stream asking it is a dictionary lookup);
- the same overview asking for one node by name (a filter walks every node);
- a /metrics scrape with the view's gauges (overview.ViewCollector);
- the heartbeat's quiet beat (every agent answers 304) and its first beat.

A beat's view changes the page's data once: an open page costs one overview per beat (and at most
one more every 5 s for the rates). 10,000 agents make 1,000 clusters of 10 here.

    .venv/bin/python bench/ui.py [--count 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from bench.simfleet import DIGEST, addresses, machine, simulated  # noqa: E402
from reconciler.agents.client import AgentClient  # noqa: E402
from reconciler.agents.observe import observer  # noqa: E402
from reconciler.agents.transport import SocketTransport  # noqa: E402
from reconciler.core.desired import ClusterSpec, ControlPlaneSpec, Desired, ModelSpec, NodeSpec  # noqa: E402
from reconciler.serve.heartbeat import Heartbeat  # noqa: E402
from reconciler.serve.metrics import ServeMetrics  # noqa: E402
from reconciler.serve.overview import ViewCollector  # noqa: E402
from reconciler.serve.ui.app import StatusPage, store_history  # noqa: E402
from reconciler.state.store import StateStore  # noqa: E402
from tests.agents import SECRET  # noqa: E402

INTERVAL_S = 30.0


def cpu(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    """The median CPU seconds of `fn` over `repeat` calls, and its last result."""
    times, out = [], None
    for _ in range(repeat):
        began = time.process_time()
        out = fn()
        times.append(time.process_time() - began)
    return sorted(times)[len(times) // 2], out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10000)
    ap.add_argument("--repeat", type=int, default=5, help="calls measured of each (the median is printed)")
    ap.add_argument("--sim-processes", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="print where one overview's CPU goes (cProfile)")
    args = ap.parse_args()
    n = args.count
    print(f"machine: {machine()}; SIMULATED agents in {args.sim_processes} processes on the same machine")
    with tempfile.TemporaryDirectory(prefix="fleet-ui-") as tmp:
        base = Path(tmp)
        with simulated(base, n, args.sim_processes) as (port, _):
            nodes = {f"n{i}": NodeSpec(f"n{i}", address, port)
                     for i, address in enumerate(addresses(n, args.sim_processes))}
            clusters = {f"c{k}": ClusterSpec(f"c{k}", "m", tuple(f"n{i}" for i in range(k * 10, min(n, k * 10 + 10))),
                                             9000) for k in range((n + 9) // 10)}
            desired = Desired(1, ControlPlaneSpec("n0"), nodes, {"m": ModelSpec("m", "safetensors", DIGEST, "n0")},
                              (), clusters)
            store = StateStore(base / "state")
            store.db.execute("PRAGMA synchronous=NORMAL")  # as fleet serve runs it

            async def run() -> None:
                async with AgentClient(SECRET, transport=SocketTransport(keep_alive=True, max_idle=n)) as client:
                    metrics = ServeMetrics()
                    beat = Heartbeat(desired, observer(desired, client), store.serve, interval=INTERVAL_S,
                                     timeout=INTERVAL_S)
                    began = time.process_time()
                    await beat.beat()
                    first = time.process_time() - began
                    assert len(beat.view.online) == n and all(beat.view.online.values()), "an agent did not answer"
                    quiet = []
                    for _ in range(3):
                        began = time.process_time()
                        await beat.beat()
                        quiet.append(time.process_time() - began)
                    page = StatusPage(desired, beat.view, metrics, store_history(store.serve.sql.execute))
                    metrics.registry.register(ViewCollector(desired, beat.view))

                    def fresh(params: dict[str, str]) -> Callable[[], bytes]:
                        def go() -> bytes:
                            page._cache.clear()  # as after a beat: computed again
                            return page.encoded(params)
                        return go

                    if args.profile:
                        import cProfile
                        import pstats
                        prof = cProfile.Profile()
                        prof.runcall(fresh({}))
                        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
                    overview, body = cpu(fresh({}), args.repeat)
                    assert isinstance(body, bytes)
                    one, _ = cpu(fresh({"q": f"n{n - 1}"}), args.repeat)
                    cached, _ = cpu(lambda: page.encoded({}), args.repeat)
                    scrape, text = cpu(metrics.render, args.repeat)
                    assert isinstance(text, bytes)
                    q = sorted(quiet)[1]
                    print(f"{n} simulated agents, {len(clusters)} clusters:")
                    print(f"  heartbeat, quiet beat:        {q * 1000:8.1f} ms CPU (first beat {first:.2f} s)")
                    print(f"  GET /ui/api/overview:         {overview * 1000:8.1f} ms CPU, {len(body) / 1e6:.2f} MB "
                          f"({overview / q:.1f}x a quiet beat; once per beat: {overview / INTERVAL_S * 100:.2f}% "
                          f"of a core at the {INTERVAL_S:g} s interval)")
                    print(f"  the overview filtered to one: {one * 1000:8.1f} ms CPU")
                    print(f"  a second stream, same page:   {cached * 1e6:8.1f} us CPU")
                    print(f"  /metrics with the view:       {scrape * 1000:8.1f} ms CPU, {len(text) / 1e6:.2f} MB")

            trio.run(run)


if __name__ == "__main__":
    os.environ.setdefault("FLEET_CLUSTER_SECRET", SECRET)
    main()
