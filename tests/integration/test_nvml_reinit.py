"""NVML is initialised once per probe, and again after the driver is reloaded under a running agent
(#35): the stand-in libnvidia-ml.so.1 of test_nvml_probe.py, whose `epoch` line stands for the
driver's load (a process initialised under another answers Uninitialized to every call until it
shuts NVML down and initialises it again, as a real one does after `rmmod nvidia; modprobe nvidia`),
and which logs each nvmlInit. The probe runs in a process of its own that reads on each line the
test sends it, so one NvmlProbe is asked several times, as an agent asks it on every state request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_nvml_probe import GIB, H100, L4, answers, libdir, nvml_env

# It builds the stand-in and runs the probe in its own process.
pytestmark = pytest.mark.e2e

__all__ = ["libdir"]  # the fixture, imported to be used here

READER = """
import json, sys
from agent.machine import inventory
probe = inventory.default_probe()
for _ in sys.stdin:
    gpus = [g.to_json() for g in probe.gpus()]
    print(json.dumps({"class": type(probe).__name__, "uuids": [g["uuid"] for g in gpus], "note": probe.note}),
          flush=True)
"""


def epoch(path: Path, n: int, gpus: list[tuple[str, str, int, int, int]]) -> None:
    answers(path, gpus=gpus)
    path.write_text(path.read_text() + f"epoch {n}\n")


def test_nvml_is_initialised_once_and_again_after_the_driver_is_reloaded(libdir: Path, tmp_path: Path) -> None:
    file, inits = tmp_path / "nvml.txt", tmp_path / "inits.log"
    both = [(*H100, 70 * GIB, 0), (*L4, 23 * GIB, 0)]
    epoch(file, 1, both)
    proc = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **nvml_env(libdir, file), "FAKE_NVML_INITS": str(inits)})
    assert proc.stdin is not None and proc.stdout is not None

    def read() -> dict:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write("read\n")
        proc.stdin.flush()
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        return json.loads(line)  # type: ignore[no-any-return]

    try:
        for _ in range(3):
            got = read()
            assert got["class"] == "NvmlProbe" and got["uuids"] == [H100[1], L4[1]], got
        assert inits.read_text().splitlines() == ["init"]  # once, not on every read

        epoch(file, 2, both)  # the driver reloaded under the running process
        got = read()
        assert got["uuids"] == [H100[1], L4[1]] and got["note"] == "", got  # re-initialised, GPUs back at once
        assert inits.read_text().splitlines() == ["init", "init"]
        assert read()["uuids"] == [H100[1], L4[1]]
        assert len(inits.read_text().splitlines()) == 2

        answers(file, init=9, count=9, gpus=both)  # the driver unloaded: no GPUs, and why
        file.write_text(file.read_text() + "epoch 3\n")
        got = read()
        assert got["uuids"] == [] and "Driver Not Loaded" in got["note"] and "Uninitialized" in got["note"], got
        epoch(file, 3, both)  # loaded again: the next read initialises again
        assert read()["uuids"] == [H100[1], L4[1]]
    finally:
        proc.stdin.close()
        proc.wait(30)
