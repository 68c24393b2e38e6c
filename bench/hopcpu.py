"""bench/hopcpu: the agents' CPU seconds per GiB per hop of a chain, by role, on loopback without
shaping, beside the floor parts measured in the same run.

Three agents in a chain, src -> mid -> tail, one model (1 GiB by default, 16 MiB pieces): the source
only sends, the middle receives, verifies, writes and forwards, the tail receives, verifies and
writes. Each agent's CPU is its process's user+system time from /proc/PID/stat (all its threads),
so the figures hold on a machine busy with other work, where wall times do not. Beside them, this
process measures the parts no agent can go below: sha256 over 1 GiB, a plain write of 1 GiB with
fsync, and 1 GiB over a loopback socket (sendfile on one side, recv_into on the other, each side's
thread CPU). A hop of a chain costs at least a receive, one sha256 of each byte (the running hash
that checks each prefix digest and ends as the file's; a model imported before prefix digests,
with `pieces`, takes two), a write and, in the middle, a send.

    .venv/bin/python bench/hopcpu.py [--gib 1.0] [--runs 1] [--rate 1gbit] [--dir DIR]

With --rate, the three agents are set up as bench/fanout.py sets up its own (a namespace each, a
veth pair, a tbf egress limit; root): the CPU of a hop at line rate, where a sender is woken as the
link drains.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx  # noqa: E402

from bench.replication import make_file  # noqa: E402
from tests.agents import SECRET, Agent, agent_env, free_port  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402

AUTH = {"Authorization": f"Bearer {SECRET}"}
BLOCK = 4 << 20
GIB = 1 << 30


def cpu_of(pid: int) -> float:
    """User+system CPU seconds of a process, all its threads (fields 14 and 15 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def floor_sha256(src: Path) -> float:
    """CPU seconds of hashlib.sha256 over the file, read from the page cache (the read excluded)."""
    h, spent = hashlib.sha256(), 0.0
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    with open(src, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            t = time.thread_time()
            h.update(view[:n])
            spent += time.thread_time() - t
    return spent


def floor_write(src: Path, dest: Path) -> tuple[float, float]:
    """CPU seconds of a plain write of the file's bytes to `dest` (the read excluded), and of its fsync."""
    buf = bytearray(BLOCK)
    view = memoryview(buf)
    spent = 0.0
    with open(src, "rb", buffering=0) as fh, open(dest, "wb", buffering=0) as out:
        while n := fh.readinto(buf):
            t = time.thread_time()
            out.write(view[:n])
            spent += time.thread_time() - t
        t = time.thread_time()
        os.fsync(out.fileno())
        synced = time.thread_time() - t
    dest.unlink()
    return spent, synced


def floor_socket(src: Path) -> tuple[float, float]:
    """CPU seconds of sending the file with os.sendfile and of receiving it with recv_into, over
    loopback: (sender, receiver), each its own thread's."""
    size = src.stat().st_size
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    sender = [0.0]

    def send() -> None:
        conn, _ = server.accept()
        t = time.thread_time()
        with conn, open(src, "rb") as fh:
            sent = 0
            while sent < size:
                sent += os.sendfile(conn.fileno(), fh.fileno(), sent, size - sent)
        sender[0] = time.thread_time() - t

    thread = threading.Thread(target=send)
    thread.start()
    buf = bytearray(BLOCK)
    with socket.create_connection(server.getsockname()) as s:
        t = time.thread_time()
        got = 0
        while got < size:
            n = s.recv_into(buf)
            if not n:
                raise RuntimeError("socket floor: connection closed early")
            got += n
        receiver = time.thread_time() - t
    thread.join()
    server.close()
    return sender[0], receiver


def chain(urls: dict[str, str], pids: dict[str, int], digest: str) -> tuple[float, dict[str, float]]:
    """mid fetches from src and tail from mid, both asked at once: seconds, and each agent's CPU."""
    before = {n: cpu_of(p) for n, p in pids.items()}
    start = time.perf_counter()
    for name, peer in (("mid", "src"), ("tail", "mid")):
        httpx.put(f"{urls[name]}/v1/weights/{digest}", json={"peer": urls[peer], "name": "m"},
                  headers=AUTH, timeout=30).raise_for_status()
    waiting = {"mid", "tail"}
    while waiting:
        time.sleep(0.25)  # each poll costs the agents CPU: poll rarely
        for name in sorted(waiting):
            body = httpx.get(f"{urls[name]}/v1/weights/{digest}", headers=AUTH, timeout=30).json()
            if body["state"] == "present":
                waiting.discard(name)
            elif body["state"] == "failed":
                raise SystemExit(f"{name}: {body}")
    took = time.perf_counter() - start
    spent = {n: cpu_of(p) - before[n] for n, p in pids.items()}
    for name in ("mid", "tail"):
        httpx.delete(f"{urls[name]}/v1/weights/{digest}", headers=AUTH, timeout=30).raise_for_status()
    return took, spent


@contextmanager
def on_loopback(base: Path) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    port = free_port("127.0.0.2", "127.0.0.3", "127.0.0.4")
    agents = {n: Agent(n, f"127.0.0.{i}", port, base / n, args=["--verify-every", "off", "--disk-reserve", "0"])
              for i, n in ((2, "src"), (3, "mid"), (4, "tail"))}
    try:
        for a in agents.values():
            a.start()
        yield {n: a.url for n, a in agents.items()}, {n: a.proc.pid for n, a in agents.items() if a.proc}
    finally:
        for a in agents.values():
            a.stop()


@contextmanager
def shaped(base: Path, rate: str) -> Iterator[tuple[dict[str, str], dict[str, int]]]:
    """The three agents each in a network namespace of its own behind `rate` of tbf, as bench/fanout.py
    sets them up (and cleans them up: its namespaces and links, named with its prefix)."""
    from bench import fanout
    if os.geteuid() != 0:
        raise SystemExit("--rate needs root (ip netns, veth, tc)")
    fanout.cleanup([])
    agents = fanout.Agents(base)
    try:
        net = fanout.Net(rate, 2.0)
        for i, name in enumerate(("src", "mid", "tail")):
            agents.start(name, *net.add(i), i)
        agents.wait_up()
        yield {n: agents.url(n) for n in agents.nodes}, {n: p.pid for n, p in zip(agents.nodes, agents.procs)}
    finally:
        agents.stop()
        fanout.cleanup([])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--piece-size", default="16MiB")
    ap.add_argument("--rate", default=None, help="each agent in a namespace of its own behind this tbf egress "
                    "limit (1gbit: bench/fanout.py's links; needs root); default: loopback, no shaping")
    ap.add_argument("--dir", type=Path, default=Path("/dev/shm") if Path("/dev/shm").is_dir() else None,
                    help="where the agents' homes go (default: /dev/shm, a tmpfs, as bench/fanout.py's)")
    args = ap.parse_args()
    size = int(args.gib * GIB) // (1 << 20) << 20
    gib = size / GIB
    with tempfile.TemporaryDirectory(prefix="fleet-hopcpu-", dir=args.dir) as tmp:
        base = Path(tmp)
        model = base / "m.gguf"
        make_file(model, size)
        with (shaped(base, args.rate) if args.rate else on_loopback(base)) as (urls, pids):
            imported = subprocess.run([fleet_bin("fleet-agent"), "import", "--home", str(base / "src"), str(model),
                                       "--link", "--json", "--piece-size", args.piece_size],
                                      capture_output=True, text=True, env=agent_env(), check=True, timeout=600)
            digest = json.loads(imported.stdout)["digest"]
            print(f"model {gib:.2f} GiB in pieces of {args.piece_size}; {args.rate or 'loopback, no shaping'}; "
                  f"load average {os.getloadavg()[0]:.2f}; {os.cpu_count()} cores", flush=True)
            per_role: dict[str, list[float]] = {n: [] for n in pids}
            for run in range(args.runs):
                took, spent = chain(urls, pids, digest)
                for n, s in spent.items():
                    per_role[n].append(s / gib)
                sha = floor_sha256(model) / gib
                write, sync = (x / gib for x in floor_write(model, base / "write.out"))
                send, recv = (x / gib for x in floor_socket(model))
                print(f"run {run + 1}: chain {took:5.2f} s wall ({size / took / 1e6:.0f} MB/s); agents' CPU-s/GiB: "
                      + "  ".join(f"{n} {s / gib:.2f}" for n, s in spent.items())
                      + f"; load {os.getloadavg()[0]:.2f}", flush=True)
                print(f"       floor CPU-s/GiB: sha256 {sha:.2f}, write {write:.2f} + fsync {sync:.2f}, sendfile {send:.2f}, "
                      f"recv_into {recv:.2f} (loopback); a middle hop's floor (recv, sha256, write, send) "
                      f"{recv + sha + write + sync + send:.2f}, a tail's {recv + sha + write + sync:.2f}", flush=True)
            if args.runs > 1:
                print("median CPU-s/GiB over the runs: " + "  ".join(f"{n} {statistics.median(v):.2f}"
                                                                      for n, v in per_role.items())
                      + "; lowest: " + "  ".join(f"{n} {min(v):.2f}" for n, v in per_role.items()))


if __name__ == "__main__":
    main()
