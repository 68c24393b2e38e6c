"""Workers a test starts itself (no agent), forked as an agent forks its own: from one fork server
per test process (the session's `forks` fixture, tests/conftest.py; agent/backends/forkserver.py),
so that each does not import PyTorch anew. `start` hands back what the tests ask of a process:
Popen's pid, poll, wait(timeout), send_signal, terminate and kill."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Mapping, Sequence

import trio

from agent.backends.forkserver import ForkedProcess, ForkServer


class Forked:
    """A worker forked from the fork server, with Popen's blocking methods."""

    def __init__(self, proc: ForkedProcess, argv: Sequence[str]) -> None:
        self.proc, self.args, self.pid = proc, list(argv), proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            time.sleep(0.02)
        return code

    def send_signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.proc.kill()


def start(forks: ForkServer, argv: Sequence[str], log: Path, env: Mapping[str, str] | None = None) -> Forked:
    """`argv` (a worker module run with this Python's -m) forked, its output appended to `log`, its
    environment this process's with `env` over it, and no GPU."""
    full = {**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    assert forks.forks(argv, full, ()), f"the fork server does not fork {argv[:3]}"
    proc = trio.run(forks.launch, argv, log, full)
    assert proc is not None, f"the fork server forks nothing: {forks.why_not}"
    return Forked(proc, argv)
