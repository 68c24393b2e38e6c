"""bench/plan_scale: plan and apply against N agents (SIMULATED: one process hosts N real agent
HTTP apps on distinct loopback addresses, with simulated GPUs and weights and a launcher that
starts no engine). Prints plan wall time and the plan process's CPU per node, and apply time.

Targets (issue 6): plan of 1,000 nodes <= 3 s wall and <= 1.5 ms CPU per node; apply of 1,000
start actions <= 10 s and linear in N.

    .venv/bin/python bench/plan_scale.py [--sizes 100,1000] [--apply-sizes 1000,3000]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from tests.agents import agent_env, free_port, wait_healthy  # noqa: E402
from tests.conftest import fleet_bin  # noqa: E402

DIGEST = "sha256:" + "ab" * 32
FIRST = "127.1.0.1"


def fleet_file(path: Path, n: int, port: int, group: int = 10) -> None:
    first = ipaddress.IPv4Address(FIRST)
    lines = ["version: 1", "control_plane: {node: n0}", "nodes:"]
    lines += [f"  n{i}: {{address: {first + i}, agent_port: {port}}}" for i in range(n)]
    lines += ["models:", f'  m: {{format: safetensors, digest: "{DIGEST}", source: n0}}', "replicas:",
              "  m: [" + ", ".join(f"n{i}" for i in range(n)) + "]", "clusters:"]
    for k in range(0, n, group):
        members = ", ".join(f"n{i}" for i in range(k, min(n, k + group)))
        lines.append(f"  c{k // group}: {{model: m, members: [{members}], port: 9000}}")
    path.write_text("\n".join(lines) + "\n")


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, subprocess.CompletedProcess[str]]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, proc


def with_agents(base: Path, n: int, fn):  # type: ignore[no-untyped-def]
    gpus = base / "gpus.json"
    gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30}]))
    port = free_port(FIRST)
    sim = subprocess.Popen([fleet_bin("fleet-agent"), "simulate", "--dir", str(base / f"sim{n}"), "--count", str(n),
                            "--port", str(port), "--gpus", str(gpus), "--hold", f"{DIGEST}:safetensors:1000"],
                           env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert sim.stdout is not None
        sim.stdout.readline()
        wait_healthy(f"http://{ipaddress.IPv4Address(FIRST) + (n - 1)}:{port}")
        fleet_file(base / f"fleet{n}.yaml", n, port)
        return fn(base / f"fleet{n}.yaml")
    finally:
        sim.terminate()
        sim.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100,1000")
    ap.add_argument("--apply-sizes", default="100,1000")
    args = ap.parse_args()
    env = agent_env()
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp:
        base = Path(tmp)
        # Python start-up and imports, measured alone, so the per-node cost can be told apart.
        wall0, cpu0, _ = timed([fleet_bin(), "--version"], env)
        print(f"fleet process start-up alone: {wall0:.2f} s wall, {cpu0 * 1000:.0f} ms CPU")
        for n in [int(x) for x in args.sizes.split(",") if x]:
            def plan(path: Path) -> None:
                wall, cpu, proc = timed([fleet_bin(), "plan", "--json", "-f", str(path)], env)
                data = json.loads(proc.stdout)
                assert data["summary"]["start"] == n, data["diagnostics"][:3]
                print(f"plan  N={n:5d}: {wall:6.2f} s wall, CPU {cpu * 1000 / n:6.3f} ms/node "
                      f"({(cpu - cpu0) * 1000 / n:.3f} ms/node beyond start-up); {n} starts planned")
            with_agents(base, n, plan)
        for n in [int(x) for x in args.apply_sizes.split(",") if x]:
            def apply(path: Path) -> None:
                wall, cpu, proc = timed([fleet_bin(), "apply", "--auto-approve", "-f", str(path),
                                         "--state-dir", str(base / f"state{n}")], env)
                assert proc.returncode == 0, proc.stderr[-2000:]
                print(f"apply N={n:5d}: {wall:6.2f} s wall for plan + {n} start actions "
                      f"({wall / n * 1000:.2f} ms per action)")
            with_agents(base, n, apply)


if __name__ == "__main__":
    main()
