"""The doctor's checks as pure functions: variant mismatches and writable directories."""

from __future__ import annotations

from pathlib import Path

from agent.machine.environment import cache_dirs, variant_findings, writable

CPU_TORCH = {"torch": {"version": "2.13.0+cpu", "build": "cpu"}, "llama_cpp": "0.3.16", "transformers": "4.57"}
CUDA_TORCH = {"torch": {"version": "2.13.0+cu128", "build": "cuda"}, "llama_cpp": "0.3.16", "transformers": "4.57"}


def by_check(findings: list) -> dict:
    return {f.check: f for f in findings}


def test_gpu_with_cpu_torch_is_an_error_naming_the_fix() -> None:
    f = by_check(variant_findings(2, "", CPU_TORCH))["variant:torch"]
    assert f.level == "error" and "2.13.0+cpu" in f.message and "CUDA build of torch" in f.message


def test_cuda_torch_without_gpu_is_a_warning() -> None:
    f = by_check(variant_findings(0, "NVML Shared Library Not Found", CUDA_TORCH))["variant:torch"]
    assert f.level == "warning" and "NVML Shared Library Not Found" in f.message


def test_matching_builds_are_ok() -> None:
    assert by_check(variant_findings(1, "", CUDA_TORCH, True))["variant:torch"].level == "ok"
    assert by_check(variant_findings(0, "", CPU_TORCH))["variant:torch"].level == "ok"


def test_llama_without_offload_on_a_gpu_node_names_the_rebuild() -> None:
    f = by_check(variant_findings(1, "", CUDA_TORCH, False))["variant:llama_cpp"]
    assert f.level == "error" and "-DGGML_CUDA=on" in f.message


def test_missing_engines_name_the_extra() -> None:
    found = by_check(variant_findings(0, "", {"torch": None, "llama_cpp": None}))
    assert "inference-fleet[torch]" in found["variant:torch"].message
    assert "inference-fleet[gguf]" in found["variant:llama_cpp"].message


def test_writable_checks_the_nearest_existing_parent(tmp_path: Path) -> None:
    assert writable(tmp_path / "not" / "yet") is None
    blocker = tmp_path / "file"
    blocker.write_text("")
    reason = writable(blocker / "sub")
    assert reason is not None and "not a directory" in reason


def test_cache_dirs_follow_the_environment(tmp_path: Path) -> None:
    dirs = cache_dirs({"XDG_CACHE_HOME": str(tmp_path), "HF_HOME": "/data/hf"})
    assert dirs["HF_HOME"] == Path("/data/hf")
    assert dirs["TORCH_HOME"] == tmp_path / "torch"
    assert dirs["LLAMA_CACHE"] == tmp_path / "llama.cpp"
