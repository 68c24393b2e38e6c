"""Loopback addresses for tests that listen: each call a block of consecutive addresses that no other
call of the run is given (all of 127.0.0.0/8 reaches this machine on Linux), so that tests never
share an address whatever xdist runs beside them, and pick their ports on it with free_port."""

from __future__ import annotations

import itertools
import os

_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)  # xdist's worker, gw0..
_BLOCKS = itertools.count()


def loopback(count: int = 1) -> list[str]:
    """`count` consecutive loopback addresses (`fleet-agent simulate --first` and `fleet demo
    --first-address` take consecutive ones) in a block of this process's own:
    127.(100 + xdist worker).(block).(1..count)."""
    block = next(_BLOCKS)
    if not 1 <= count <= 254 or block > 255 or _WORKER > 155:
        raise ValueError(f"no block of {count} loopback addresses left (block {block}, worker {_WORKER})")
    return [f"127.{100 + _WORKER}.{block}.{k}" for k in range(1, count + 1)]
