"""Simulated agents for the scale benches (bench/plan_scale, bench/heartbeat): N agents on
consecutive loopback addresses, split over a few `fleet-agent simulate` processes so that the
simulation can use more than one core, and what the machine was doing while a figure was taken."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from tests.agents import agent_env, free_port, wait_healthy
from tests.conftest import fleet_bin

DIGEST = "sha256:" + "ab" * 32
FIRST = "127.1.0.1"


def addresses(n: int, processes: int = 2) -> list[str]:
    """The n agents' addresses in the order a fleet file lists them: alternating between the
    simulator processes (each hosts a consecutive range). fleet asks its agents in the file's
    order, at most 64 at a time: in the ranges' own order all of them were on one simulator
    process at a time, so the simulation used one core where 10,000 agents are 10,000 machines."""
    first = ipaddress.IPv4Address(FIRST)
    share = -(-n // max(1, processes))
    return [str(first + k * share + j) for j in range(share) for k in range(max(1, processes)) if k * share + j < n]


def machine() -> str:
    """Cores and load average: on a shared machine a figure means little without them."""
    one, five, _ = os.getloadavg()
    return f"{os.cpu_count()} cores, load average {one:.1f} (1 min) {five:.1f} (5 min)"


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def simulated(base: Path, n: int, processes: int = 2) -> Iterator[tuple[int, list[int]]]:
    """(the agents' port, the simulator pids) for n agents from FIRST, each holding DIGEST."""
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
    first = ipaddress.IPv4Address(FIRST)
    port = free_port(FIRST)
    if n < 1:
        raise ValueError(f"a simulated fleet needs at least one agent, not {n}")
    share = -(-n // max(1, processes))
    procs = []
    try:
        started = time.perf_counter()
        for k, at in enumerate(range(0, n, share)):
            count = min(share, n - at)
            procs.append(subprocess.Popen(
                [fleet_bin("fleet-agent"), "simulate", "--dir", str(base / f"sim{n}-{k}"), "--first", str(first + at),
                 "--count", str(count), "--port", str(port), "--gpus", str(gpus),
                 "--hold", f"{DIGEST}:safetensors:1000"],
                env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True))
        for proc, at in zip(procs, range(0, n, share)):
            assert proc.stdout is not None
            proc.stdout.readline()
            wait_healthy(f"http://{first + min(n, at + share) - 1}:{port}", timeout=1800)
        print(f"  {n} simulated agents in {len(procs)} processes up in {time.perf_counter() - started:.0f} s")
        yield port, [p.pid for p in procs]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def touch_gpus(base: Path, free: int) -> None:
    """Every simulated agent's GPUs report `free` bytes free from now on (within a second)."""
    (base / "gpus.json").write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                                 "memory_free_bytes": free}]))
