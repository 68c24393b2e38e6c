"""The README's first command: `fleet demo` does fleet's whole job and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import fleet_bin

pytestmark = pytest.mark.e2e


def processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline:
            found.append(f"{pid}: {cmdline}")
    return found


def test_demo_runs_the_whole_job_and_cleans_up(tmp_path: Path) -> None:
    demo_dir = tmp_path / "demo"
    home_cache = Path.home() / ".cache"
    before = set(home_cache.iterdir()) if home_cache.exists() else set()
    # Its own addresses, so it can run beside the other tests.
    proc = subprocess.run([fleet_bin(), "demo", "--dir", str(demo_dir), "--first-address", "127.0.0.30"],
                          capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for expected in ("replicate replica.tiny@gpu-a", "start server.chat@gpu-b",
                     "Plan: 2 to replicate, 3 to start, 0 to replace, 0 to stop, 0 to delete.",
                     "Apply complete: 5 actions.", "No changes.", "chunks streamed through http://127.0.0.30:",
                     "NODE", "gpu-a", "chat:running", "stopped every process the demo started"):
        assert expected in out, expected
    streamed = next(line for line in out.splitlines() if "chunks streamed through" in line)
    assert int(streamed.split("[")[1].split()[0]) > 0
    assert processes_mentioning(str(demo_dir)) == []  # no agent, worker or server left behind
    after = set(home_cache.iterdir()) if home_cache.exists() else set()
    assert after == before  # engines' caches went under the demo directory
    assert (demo_dir / "fleet.yaml").exists() and (demo_dir / "state").is_dir()
