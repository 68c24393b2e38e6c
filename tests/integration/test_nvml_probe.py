"""The NVML probe at its boundary: pynvml's own loading path (CDLL("libnvidia-ml.so.1") by name) finds a
stand-in library built here from tests/integration/fake_nvml.c, which answers the calls NvmlProbe makes
with nvml.h's signatures and return codes, from a file re-read on every call. Nothing in pynvml or fleet
is patched: the probe runs in its own process (the class directly, and a real `fleet-agent serve` without
--simulate-gpus) with LD_LIBRARY_PATH naming the stand-in's directory. fleet reads no MIG state (a MIG
device is not a GPU it assigns), so there are no MIG answers to stand in for."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.agents import Agent, free_port

pytestmark = pytest.mark.e2e  # starts real agent processes (and the probe in its own)

GIB = 1 << 30
SOURCE = Path(__file__).with_name("fake_nvml.c")
H100 = ("NVIDIA H100 80GB HBM3", "GPU-6f0b1c2e-0000-4000-8000-000000000000", 80 * GIB)
L4 = ("NVIDIA L4", "GPU-6f0b1c2e-0001-4000-8000-000000000001", 24 * GIB)


@pytest.fixture(scope="module")
def libdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler (cc) to build the NVML stand-in: apt-get install build-essential")
    out = tmp_path_factory.mktemp("nvml")
    subprocess.run([cc, "-shared", "-fPIC", "-Wall", "-Werror", "-O1", "-o", str(out / "libnvidia-ml.so.1"),
                    str(SOURCE)], check=True, capture_output=True, text=True, timeout=120)
    return out


def answers(path: Path, *, init: int = 0, count: int = 0, gpus: Sequence[tuple[str, str, int, int, int]] = ()) -> Path:
    """Write what the stand-in answers: (name, uuid, total, free, rc) per GPU, in index order."""
    lines = [f"init {init}", f"count {count}"] + [f"gpu|{n}|{u}|{t}|{f}|{rc}" for n, u, t, f, rc in gpus]
    path.write_text("\n".join(lines) + "\n")
    return path


def nvml_env(libdir: Path, file: Path) -> dict[str, str]:
    return {"LD_LIBRARY_PATH": str(libdir), "FAKE_NVML_FILE": str(file)}


PROBE = """
import json
from agent.machine import inventory
probe = inventory.default_probe()
gpus = [g.to_json() for g in probe.gpus()]
print(json.dumps({"class": type(probe).__name__, "source": probe.source, "gpus": gpus, "note": probe.note}))
"""


def probe(libdir: Path, file: Path) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **nvml_env(libdir, file)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_probe_reads_each_gpu_through_pynvml(libdir: Path, tmp_path: Path) -> None:
    file = answers(tmp_path / "nvml.txt", gpus=[(*H100, 70 * GIB, 0), (*L4, 23 * GIB, 0)])
    got = probe(libdir, file)
    assert got["class"] == "NvmlProbe" and got["source"] == "nvml" and got["note"] == ""
    assert got["gpus"] == [
        {"index": 0, "name": H100[0], "uuid": H100[1], "memory_total_bytes": 80 * GIB, "memory_free_bytes": 70 * GIB},
        {"index": 1, "name": L4[0], "uuid": L4[1], "memory_total_bytes": 24 * GIB, "memory_free_bytes": 23 * GIB}]


def test_a_lost_gpu_is_left_out_and_named(libdir: Path, tmp_path: Path) -> None:
    file = answers(tmp_path / "nvml.txt", gpus=[(*H100, 70 * GIB, 15), (*L4, 23 * GIB, 0)])
    got = probe(libdir, file)
    assert [g["uuid"] for g in got["gpus"]] == [L4[1]]
    assert got["gpus"][0]["index"] == 1  # NVML's index, not its place in the answer
    assert got["note"] == "left out, NVML did not answer for them: GPU 0: GPU is lost"


def test_a_driver_that_fails_to_initialise_gives_no_gpus_and_says_why(libdir: Path, tmp_path: Path) -> None:
    got = probe(libdir, answers(tmp_path / "nvml.txt", init=9, gpus=[(*H100, 70 * GIB, 0)]))
    assert got == {"class": "NoGpus", "source": "none", "gpus": [], "note": "NVML unavailable: Driver Not Loaded"}


def test_a_count_that_fails_leaves_none(libdir: Path, tmp_path: Path) -> None:
    got = probe(libdir, answers(tmp_path / "nvml.txt", count=15, gpus=[(*H100, 70 * GIB, 0)]))
    assert got["class"] == "NvmlProbe" and got["gpus"] == []
    assert got["note"] == "NVML could not count the GPUs: GPU is lost"


def test_agent_state_follows_nvml_and_has_the_simulated_shape(libdir: Path, tmp_path: Path) -> None:
    """A real agent without --simulate-gpus reports what NVML answers now (free memory that changes, a GPU
    that disappears), and its inventory has exactly the shape of an agent whose GPUs are simulated."""
    file = answers(tmp_path / "nvml.txt", gpus=[(*H100, 70 * GIB, 0), (*L4, 23 * GIB, 0)])
    sim = tmp_path / "gpus.json"
    sim.write_text(json.dumps([{"index": i, "name": n, "uuid": u, "memory_total_bytes": t, "memory_free_bytes": f}
                               for i, (n, u, t, f) in enumerate([(*H100, 70 * GIB), (*L4, 23 * GIB)])]))
    port = free_port("127.0.0.2", "127.0.0.3")
    real = Agent("nvml-node", "127.0.0.2", port, tmp_path / "real", env=nvml_env(libdir, file))
    simulated = Agent("sim-node", "127.0.0.3", port, tmp_path / "sim", args=["--simulate-gpus", str(sim)])
    try:
        real.start()
        simulated.start()
        inv = real.get("/v1/state").json()["inventory"]
        assert inv["gpu_source"] == "nvml" and inv["simulated"] is False and inv["gpu_note"] == ""
        assert [(g["uuid"], g["memory_free_bytes"]) for g in inv["gpus"]] == [(H100[1], 70 * GIB), (L4[1], 23 * GIB)]

        sim_inv = simulated.get("/v1/state").json()["inventory"]
        assert sim_inv["gpu_source"] == "simulated"
        assert set(inv) == set(sim_inv)
        assert inv["gpus"] == sim_inv["gpus"]  # same keys, same values, same types
        assert {k: type(v) for k, v in inv.items()} == {k: type(v) for k, v in sim_inv.items()}

        answers(file, gpus=[(*H100, 12 * GIB, 0), (*L4, 23 * GIB, 0)])  # another process took 58 GiB
        inv = real.get("/v1/state").json()["inventory"]
        assert [g["memory_free_bytes"] for g in inv["gpus"]] == [12 * GIB, 23 * GIB]

        answers(file, gpus=[(*H100, 12 * GIB, 0), (*L4, 23 * GIB, 15)])  # GPU 1 fell off the bus
        inv = real.get("/v1/state").json()["inventory"]
        assert [g["uuid"] for g in inv["gpus"]] == [H100[1]]
        assert inv["gpu_note"] == "left out, NVML did not answer for them: GPU 1: GPU is lost"
    finally:
        real.stop()
        simulated.stop()


def test_agent_whose_driver_fails_to_initialise_serves_without_gpus(libdir: Path, tmp_path: Path) -> None:
    file = answers(tmp_path / "nvml.txt", init=9, gpus=[(*H100, 70 * GIB, 0)])
    port = free_port("127.0.0.4")
    agent = Agent("no-driver", "127.0.0.4", port, tmp_path / "a", env=nvml_env(libdir, file))
    try:
        inv = agent.start().get("/v1/state").json()["inventory"]
        assert inv["gpus"] == [] and inv["gpu_source"] == "none"
        assert inv["gpu_note"] == "NVML unavailable: Driver Not Loaded"
    finally:
        agent.stop()
