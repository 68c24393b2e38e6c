"""bench/worker_start: a torch worker's start, to its first 200 on /health, started as a new process
(exec'd: it imports PyTorch and transformers itself) against forked from the agent's fork server
(agent/backends/forkserver.py, which imported them once). Through the agent's own launcher
(ProcessLauncher), on the tiny random Llama or a model directory given; the two alternate, and the
fork server's own start (its imports, once per agent) is reported apart. Per start: wall seconds to
ready, and the worker's CPU seconds by then (its /proc stat: user + system).

    .venv/bin/python bench/worker_start.py [--model DIR] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.backends.launch import Process, ProcessLauncher, fork_server  # noqa: E402
from agent.backends.torch import spec as torch_spec  # noqa: E402
from agent.serving.registry import BACKENDS  # noqa: E402
from reconciler.agents.netutil import free_port  # noqa: E402

TICK = os.sysconf("SC_CLK_TCK")


def cpu_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


async def start(launcher: ProcessLauncher, model: Path, log: Path) -> tuple[float, float]:
    port = free_port("127.0.0.1")
    argv = torch_spec.command(str(model), "127.0.0.1", port, {}, lambda d, w: d).argv
    credential = "bench-credential"
    t0 = time.monotonic()
    proc: Process = await launcher.launch(argv, log, {"CUDA_VISIBLE_DEVICES": "", "FLEET_WORKER_CREDENTIAL": credential})
    try:
        while not await launcher.answers(f"http://127.0.0.1:{port}/health", credential):
            if proc.poll() is not None:
                raise SystemExit(f"the worker exited ({proc.poll()}): {log.read_text()[-2000:]}")
            await trio.sleep(0.05)
        return time.monotonic() - t0, cpu_of(proc.pid)
    finally:
        proc.kill()
        await proc.wait()


async def bench(model: Path, runs: int, work: Path) -> None:
    forks = fork_server(BACKENDS.values(), work / "forkserver.log")
    assert forks is not None, "no engine names what its fork server preloads"
    arms = {"new process": ProcessLauncher(), "forked": ProcessLauncher(forks)}
    seen: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        t0 = time.monotonic()
        await forks.launch([sys.executable, "-m", torch_spec.WORKER, "--help"], work / "help.log",
                           {"CUDA_VISIBLE_DEVICES": ""})  # the server's own start, apart
        assert forks.proc is not None and forks.why_not is None, forks.why_not
        server_wall, server_cpu = time.monotonic() - t0, cpu_of(forks.proc.pid)
        for k in range(runs):
            for name, launcher in (arms.items() if k % 2 == 0 else reversed(arms.items())):
                seen[name].append(await start(launcher, model, work / f"{name}-{k}.log"))
    finally:
        forks.close()
    print(f"{model.name}, {runs} starts each, alternated, load {os.getloadavg()[0]:.1f}")
    print(f"  fork server's own start (once per agent): {server_wall:.2f} s wall, {server_cpu:.2f} CPU-s")
    medians = {}
    for name, points in seen.items():
        wall, cpu = statistics.median(p[0] for p in points), statistics.median(p[1] for p in points)
        medians[name] = (wall, cpu)
        print(f"  {name:12s} to ready: {wall:5.2f} s wall, {cpu:5.2f} CPU-s (median; walls "
              f"{', '.join(f'{p[0]:.2f}' for p in points)})")
    (nw, nc), (fw, fc) = medians["new process"], medians["forked"]
    print(f"  forked / new process: wall {fw / nw:.2f}x, CPU {fc / nc:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.model is None:
            from tests.models import tiny_safetensors

            args.model = tiny_safetensors(work)
        trio.run(bench, args.model.resolve(), args.runs, work)


if __name__ == "__main__":
    main()
