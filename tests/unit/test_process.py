"""host/process.alive: a pid is alive only if a process here has it; a pid no process can have is
not (0 and below would signal process groups, a huge one overflows the kernel's type), so the
agent's store sweeps what such a name left rather than failing to start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from agent.weights.store import Store
from host.process import alive


def test_only_a_pid_a_process_has_is_alive() -> None:
    assert alive(os.getpid()) and alive(1)  # ours, and init's (another user's: refused, not unknown)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    assert not alive(int(done.stdout))  # exited and reaped (its pid is not reused within the test)
    for pid in (0, -1, -os.getpgid(0), 2**31, 99999999999, 2**64):
        assert not alive(pid), pid


def test_the_store_sweeps_a_leftover_named_with_an_impossible_pid(tmp_path: Path) -> None:
    store = Store(tmp_path)
    for name in (".import-99999999999-ab", ".import-0-cd", f".import-{os.getpid()}-ef"):
        (store.partial / name).mkdir()
    removed = store.sweep()
    assert sorted(p.name for p in removed) == [".import-0-cd", ".import-99999999999-ab"]
    assert [p.name for p in store.partial.iterdir()] == [f".import-{os.getpid()}-ef"]
