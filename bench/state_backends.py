"""bench/state_backends: the state store's costs on SQLite and on PostgreSQL side by side (a server
started for the run, as the tests start it: tests/postgres.py). Prints, per backend, the median of
each over --rounds:

- the apply lock: acquire + release by one apply; a refused apply's wait until it can name the
  holder (PostgreSQL waits up to 500 ms for a just-killed holder's session to end);
- a heartbeat's writes at --nodes nodes, as the time it holds the event loop and the time until
  committed (PostgreSQL: sent from a worker thread, pipelined): the first beat (a row per node and
  member), a quiet beat (only the seen-at stamps), a beat where every node changed;
- PostgreSQL only: from a committed beat to a listening `fleet serve` being woken (NOTIFY), and
  from a leader's connection closing to another process holding the leadership lock, and from a
  holder's SIGKILL to the next apply holding the apply lock.

    .venv/bin/python bench/state_backends.py [--nodes 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402

from reconciler.state.backend import Store, open_state, sqlite_url  # noqa: E402
from reconciler.state.pg import SharedStore  # noqa: E402
from reconciler.state.store import LockHeld, ServeRecord  # noqa: E402
from tests import postgres  # noqa: E402

STATE = {"servers": [{"id": "c@n", "state": "running", "model": "sha256:" + "0" * 64, "port": 9000}],
         "weights": [], "inventory": {"gpus": [], "disk": {"free_bytes": 1 << 40}}}


def ms(f: Callable[[], object], rounds: int) -> float:
    took = []
    for _ in range(rounds):
        start = time.perf_counter()
        f()
        took.append(time.perf_counter() - start)
    return statistics.median(took) * 1000


def beat(record: ServeRecord, nodes: int, state: dict[str, object] | None, when: str) -> tuple[float, float]:
    """(ms the event loop is held, ms until committed): a deferred record's batch is committed from
    a worker thread (trio.run here stands in for serve's loop)."""
    start = time.perf_counter()
    with record.transaction():
        if state is not None:
            for i in range(nodes):
                record.put_node(f"n{i}", "online", when, state={**state, "beat": when}, error=None)
                record.put_server_row({"id": f"c@n{i}", "cluster": "c", "node": f"n{i}", "model": "m",
                                       "port": 9000, "state": "running", "reason": None}, when)
        record.touch_online(when)
        record.touch_rows(when)
    held = time.perf_counter() - start
    trio.run(record.flush)
    return held * 1000, (time.perf_counter() - start) * 1000


def beats(record: ServeRecord, nodes: int, state: dict[str, object] | None, rounds: int) -> str:
    counter = iter(range(10**9))
    took = [beat(record, nodes, state, f"T{next(counter)}") for _ in range(rounds)]
    held, done = statistics.median(t[0] for t in took), statistics.median(t[1] for t in took)
    return f"{held:.1f} ms held / {done:.1f} ms committed"


def measure(name: str, url: str, nodes: int, rounds: int) -> None:
    a, b = open_state(url), open_state(url)

    def lock_cycle() -> None:
        lock, _ = a.applies.acquire("fleet apply (bench)")
        a.applies.release(lock.id)

    held, _ = a.applies.acquire("fleet apply (bench holder)")

    def refused() -> None:
        try:
            b.applies.acquire("fleet apply")
        except LockHeld:
            return
        raise AssertionError("the lock was not held")

    refused_ms = ms(refused, rounds)
    a.applies.release(held.id)
    cycle_ms = ms(lock_cycle, rounds)
    record = a.beat_record() if isinstance(a, SharedStore) else a.serve  # as fleet serve writes its beats
    first = beats(record, nodes, STATE, 1)
    quiet = beats(record, nodes, None, rounds)
    changed = beats(record, nodes, STATE, rounds)
    print(f"{name:10} lock acquire+release {cycle_ms:7.2f} ms | refused, holder named {refused_ms:7.1f} ms")
    print(f"{'':10} beat of {nodes} (event loop held / committed): first {first}, quiet {quiet}, "
          f"all changed {changed}")
    if isinstance(a, SharedStore):
        notify_and_takeover(a, b, rounds)
    a.close()
    b.close()


def notify_and_takeover(a: SharedStore, b: Store, rounds: int) -> None:
    woken: list[float] = []

    async def main() -> None:
        notifier = a.notifier()
        async with trio.open_nursery() as nursery:
            await nursery.start(notifier.run)
            for i in range(rounds):
                await trio.sleep(0.05)
                start = time.perf_counter()
                with b.serve.transaction():
                    b.serve.put_node("notified", "offline", f"T{i}", state=None, error=f"E{i}")
                await notifier.wait(ServeRecord.CHANNEL, 5)
                woken.append(time.perf_counter() - start)
            nursery.cancel_scope.cancel()

    trio.run(main)
    takeovers = []
    for _ in range(rounds):
        leader, follower = a.leader_lock(), a.leader_lock()
        assert leader.try_take()
        start = time.perf_counter()
        leader.close()
        while not follower.try_take():
            time.sleep(0.001)
        takeovers.append(time.perf_counter() - start)
        follower.close()
    killed = []
    for _ in range(rounds):
        holder = subprocess.Popen([sys.executable, "-c", HOLDER, a.url], stdout=subprocess.PIPE, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        start = time.perf_counter()
        holder.kill()
        lock, taken = b.applies.acquire("fleet apply (after a SIGKILL)")
        killed.append(time.perf_counter() - start)
        assert taken is not None
        b.applies.release(lock.id)
        holder.wait()
    print(f"{'':10} apply lock taken {statistics.median(killed) * 1000:.1f} ms after its holder's SIGKILL")
    print(f"{'':10} NOTIFY: commit to a listener woken {statistics.median(woken) * 1000:.2f} ms | leader's "
          f"connection closed to another leading {statistics.median(takeovers) * 1000:.1f} ms (polling every 1 ms; "
          "fleet serve polls every interval/4)")


# A process holding the apply lock until killed (what a SIGKILLed `fleet apply` leaves).
HOLDER = """
import sys, time
from reconciler.state.backend import open_state
store = open_state(sys.argv[1])
store.applies.acquire("fleet apply (to be killed)")
print("held", flush=True)
time.sleep(60)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        measure("sqlite", sqlite_url(Path(tmp) / "state"), args.nodes, args.rounds)
    why = postgres.why_not()
    if why is not None:
        print(f"postgresql: not measured ({why})")
        return
    server = postgres.start()
    try:
        measure("postgresql", next(server).fresh_url(), args.nodes, args.rounds)
    finally:
        server.close()


if __name__ == "__main__":
    main()
