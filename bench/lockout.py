"""bench/lockout: can strangers lock the control plane out of a real fleet-agent? Starts one agent
(at its default descriptor limit unless --nofile), opens --idle idle connections and --slow
slowloris ones (a request head trickled a line a second) and holds them, then asks the agent's
state with the cluster secret --asks times (a new connection each, as `fleet plan` does) and runs
`fleet plan` once. Prints the agent's cap, how many strangers it closed, what the asks were
answered (and their median time), the plan's exit code, and the agent's RSS. By default the
strangers outnumber the cap here (2 cores, hard limit 20,000: a cap of 6,624).

    .venv/bin/python bench/lockout.py [--idle 6000] [--slow 1000] [--nofile 0] [--asks 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402
import psutil  # noqa: E402

from host.descriptors import raise_descriptor_limit  # noqa: E402
from tests.agents import SECRET, Agent, free_port  # noqa: E402
from tests.integration import test_agent_lockout as lockout  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=int, default=6000)
    ap.add_argument("--slow", type=int, default=1000)
    ap.add_argument("--nofile", type=int, default=0, help="the agent's descriptor limit (0: what it raises it to)")
    ap.add_argument("--asks", type=int, default=20)
    args = ap.parse_args()
    raise_descriptor_limit()
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        if args.nofile:
            lockout.NOFILE = args.nofile
            a: Agent = lockout.LimitedAgent("node-b", "127.0.0.2", free_port("127.0.0.2"), base / "b")
        else:
            a = Agent("node-b", "127.0.0.2", free_port("127.0.0.2"), base / "b")
        a.start()
        cap = int(a.log().split("at most ")[1].split(" connections")[0])
        try:
            t0 = time.monotonic()
            strangers = lockout.Strangers(a, args.idle, args.slow)
            opened = time.monotonic() - t0
            try:
                closed = strangers.wait_closed(args.idle + args.slow - cap, timeout=120)
                codes, times = [], []
                for _ in range(args.asks):
                    t = time.monotonic()
                    try:
                        codes.append(httpx.get(a.url + "/v1/state", headers={"Authorization": f"Bearer {SECRET}"},
                                               timeout=30).status_code)
                    except httpx.HTTPError as exc:
                        codes.append(type(exc).__name__)  # type: ignore[arg-type]
                    times.append(time.monotonic() - t)
                t = time.monotonic()
                planned = lockout.plan(a, base)
                plan_s = time.monotonic() - t
                rss = psutil.Process(a.proc.pid).memory_info().rss if a.proc else 0
            finally:
                strangers.close()
        finally:
            a.stop()
    ok = sum(1 for c in codes if c == 200)
    print(f"agent cap {cap}; {args.idle} idle + {args.slow} slowloris strangers opened in {opened:.1f} s, "
          f"{closed} closed by the agent")
    print(f"authenticated GET /v1/state under them: {ok} of {len(codes)} answered 200 "
          f"(others: {sorted({str(c) for c in codes if c != 200}) or 'none'}), median {statistics.median(times) * 1000:.0f} ms")
    print(f"fleet plan: exit {planned.returncode} in {plan_s:.1f} s; agent RSS {rss / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
