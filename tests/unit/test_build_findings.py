"""Engine builds that do not match the node's GPUs: what the agent reports (variant.findings) and the
warning the planner makes of it, naming the package to install."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.environment import llama_gpu_backend, state_findings
from reconciler.node_notes import build_warnings
from reconciler.observed import node_from_state

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
