"""The saved plan's check before the apply lock (reconciler/applying/planfile.check: schema,
references, dependency graph), timed on plans of N changes in one chain (each depends on the one
before: the worst case of the old round-by-round check, quadratic), and the graph check's steps.

    .venv/bin/python -m bench.saved_plan [N ...]     (default: 1000 4000 20000)
"""

from __future__ import annotations

import sys
import time
from typing import Any

from reconciler.applying import planfile

DIGEST = "sha256:" + "ab" * 32


def chain(n: int) -> dict[str, Any]:
    changes = [{"action": "replicate", "address": f"replica.m{i}@a", "node": "a", "reason": "",
                "depends_on": [f"replica.m{i - 1}@a"] if i else [], "drift": False,
                "details": {"digest": DIGEST, "peer": "cp", "bytes": 1, "model": f"m{i}", "format": "gguf"}} for i in range(n)]
    return {"format_version": "1.0", "config_file": "fleet.yaml", "config_digest": DIGEST, "fingerprints": {},
            "targets": [], "errored": False, "summary": {"replicate": n, "start": 0, "replace": 0, "stop": 0,
                                                         "delete": 0},
            "changes": changes, "diagnostics": []}


def main(sizes: list[int]) -> None:
    for n in sizes:
        plan = chain(n)
        began = time.perf_counter()
        problems = planfile.check(plan, {"a", "cp"})
        whole = time.perf_counter() - began
        began = time.perf_counter()
        cycle, steps = planfile.dependency_cycle(plan["changes"])
        graph = time.perf_counter() - began
        assert problems == [] and cycle == []
        print(f"{n:>7,} changes in a chain: check {whole:6.3f} s (graph {graph:.3f} s, {steps:,} steps, "
              f"{steps / n:.1f} a change)")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1000, 4000, 20000])
