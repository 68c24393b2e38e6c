"""Engine builds that do not match the node's GPUs: what the agent reports (variant.findings) and the
warning the planner makes of it, naming the package to install."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.machine.environment import llama_gpu_backend, state_findings
from reconciler.planning.notes import build_warnings
from reconciler.core.observed import node_from_state

CPU_TORCH = {"torch": {"version": "2.13.0+cpu", "build": "cpu"}, "llama_cpp": None}
CUDA_TORCH = {"torch": {"version": "2.13.0+cu128", "build": "cuda"}, "llama_cpp": None}


@pytest.mark.parametrize("libs, expected", [
    (["libllama.so", "libggml-base.so", "libggml-cpu.so"], False),
    (["libllama.so", "libggml-cpu.so", "libggml-cuda.so"], True),
    (["libllama.so", "libggml-hip.so.0"], True),
    (["README"], None),
], ids=["cpu-only", "cuda", "rocm", "no-library"])
def test_llama_gpu_backend_read_from_the_wheel_libraries(tmp_path: Path, libs: list[str], expected: bool | None) -> None:
    for name in libs:
        (tmp_path / name).write_bytes(b"")
    assert llama_gpu_backend(tmp_path) is expected


def test_state_findings_name_what_to_install() -> None:
    [cpu_beside_gpus] = state_findings(2, "", CPU_TORCH)
    assert cpu_beside_gpus["level"] == "error" and cpu_beside_gpus["check"] == "variant:torch"
    assert "download.pytorch.org/whl/cu128" in cpu_beside_gpus["install"]
    [cuda_without_gpus] = state_findings(0, "NVML unavailable", CUDA_TORCH)
    assert cuda_without_gpus["level"] == "warning" and "whl/cpu" in cuda_without_gpus["install"]
    assert state_findings(0, "", CPU_TORCH) == [] and state_findings(1, "", CUDA_TORCH) == []


def test_the_planner_warns_once_per_finding_at_the_node() -> None:
    findings = state_findings(2, "", CPU_TORCH)
    nodes = {"g": node_from_state("g", {"variant": {"accelerator": "cpu", "findings": findings}}),
             "a": node_from_state("a", {"variant": {"accelerator": "cpu"}})}
    [w] = build_warnings(nodes)
    assert w.code == "engine_build_mismatch" and w.address == "node.g" and not w.is_error
    assert "2 NVIDIA GPU(s) present but torch 2.13.0+cpu" in w.summary
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128" in w.detail


def test_nodes_wide_shows_a_mismatch_and_the_link_rates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from reconciler.cli import main as cli
    from reconciler.state.store import StateStore
    from tests.unit.test_tables import state

    s = state()
    s["variant"] = {"accelerator": "cpu", "findings": state_findings(1, "", CPU_TORCH)}
    s["link_rates"] = [{"peer": "10.0.0.1:7070", "bytes_per_s": 91_100_000, "samples": 3}]
    with StateStore(tmp_path) as store:
        with store.serve.transaction():
            store.serve.put_node("gpu-a", "online", "T1", state=s, error=None)
    fleet_file = tmp_path / "fleet.yaml"
    fleet_file.write_text("version: 1\ncontrol_plane: {node: cp}\nnodes:\n  cp: {address: 10.0.0.1}\n"
                          "  gpu-a: {address: 10.0.0.2}\nmodels: {}\n")
    assert cli.run(["nodes", "--wide", "--state-dir", str(tmp_path), "-f", str(fleet_file)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("gpu-a"))
    assert "cpu (MISMATCH)" in row and "cp 91.1 MB/s (3)" in row
    assert "gpu-a (variant:torch): 1 NVIDIA GPU(s) present but torch 2.13.0+cpu" in out
    assert "pip install torch --index-url https://download.pytorch.org/whl/cu128" in out
