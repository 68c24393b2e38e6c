"""Launch specs: settings in, the engine's command line and the speculative outcome out."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from agent.serving.registry import BACKENDS, for_format
from agent.backends.launch import BadSettings

PY = sys.executable
MODEL, HOST, PORT = "/s/models/m", "10.0.0.2", 9000
DRAFT = "sha256:" + "d" * 64


def paths(digest: str, what: str) -> str:
    assert what == "draft model"
    return f"/s/models/{digest[7:15]}"


CASES: list[tuple[str, str, dict[str, Any], list[str], dict[str, Any] | None]] = [
    ("llama-plain", "llama_cpp", {},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000"], None),
    ("llama-all-settings", "llama_cpp", {"context_length": 4096, "threads": 8, "batch_size": 256, "tensor_parallel": 2},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000", "--n_ctx", "4096",
      "--n_threads", "8", "--n_batch", "256", "--n_gpu_layers", "-1"], None),
    ("llama-tensor-parallel-zero-stays-on-cpu", "llama_cpp", {"tensor_parallel": 0},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000"], None),
    ("llama-prompt-lookup", "llama_cpp", {"speculative": {"mode": "prompt_lookup", "tokens": 3}},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000", "--draft_model",
      "prompt-lookup-decoding", "--draft_model_num_pred_tokens", "3"],
     {"mode": "prompt_lookup", "tokens": 3, "applied": True, "how": "llama.cpp prompt-lookup decoding"}),
    ("llama-draft-recorded-not-used", "llama_cpp", {"speculative": {"mode": "draft", "draft_digest": DRAFT}},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000"],
     {"mode": "draft", "draft_digest": DRAFT, "applied": False,
      "how": "fleet's llama.cpp workers draft only by prompt lookup; a separate draft model is recorded but not used"}),
    ("llama-parallel", "llama_cpp", {"parallel": 4},
     [PY, "-m", "agent.backends.llama_cpp.batched", "--model", MODEL, "--host", HOST, "--port", "9000", "--parallel",
      "4"], None),
    ("torch-plain", "torch", {},
     [PY, "-m", "agent.backends.torch.worker", "--model", MODEL, "--host", HOST, "--port", "9000"], None),
    ("torch-context-threads-ignores-batch", "torch", {"context_length": 512, "threads": 2, "batch_size": 64},
     [PY, "-m", "agent.backends.torch.worker", "--model", MODEL, "--host", HOST, "--port", "9000",
      "--context-length", "512", "--threads", "2"], None),
    ("torch-prompt-lookup-default-tokens", "torch", {"speculative": {"mode": "prompt_lookup"}},
     [PY, "-m", "agent.backends.torch.worker", "--model", MODEL, "--host", HOST, "--port", "9000",
      "--prompt-lookup", "10"],
     {"mode": "prompt_lookup", "applied": True, "how": "transformers prompt-lookup decoding"}),
    ("torch-draft", "torch", {"speculative": {"mode": "draft", "draft_digest": DRAFT}},
     [PY, "-m", "agent.backends.torch.worker", "--model", MODEL, "--host", HOST, "--port", "9000",
      "--draft", "/s/models/dddddddd"],
     {"mode": "draft", "draft_digest": DRAFT, "applied": True, "how": "transformers assisted generation"}),
]


@pytest.mark.parametrize("backend, settings, argv, speculative", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_settings_become_the_engines_command_line(backend: str, settings: dict[str, Any], argv: list[str],
                                                  speculative: dict[str, Any] | None) -> None:
    command = BACKENDS[backend].command(MODEL, HOST, PORT, settings, paths)
    assert list(command.argv) == argv
    assert command.speculative == speculative


def test_the_llama_cpp_server_app_stays_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_LLAMA_WORKER", "server")
    argv = BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {"parallel": 4, "threads": 2}, paths).argv
    assert list(argv) == [PY, "-m", "agent.backends.llama_cpp.worker", "--model", MODEL, "--host", HOST, "--port",
                          "9000", "--n_threads", "2"]  # the server app takes no --parallel
    monkeypatch.setenv("FLEET_LLAMA_WORKER", "fast")
    with pytest.raises(BadSettings, match="FLEET_LLAMA_WORKER='fast' names no llama.cpp worker: batched or server"):
        BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {}, paths)


def test_a_draft_without_its_digest_is_bad_settings() -> None:
    with pytest.raises(BadSettings, match="draft_digest"):
        BACKENDS["torch"].command(MODEL, HOST, PORT, {"speculative": {"mode": "draft"}}, paths)


def test_each_format_has_its_engine() -> None:
    assert for_format("gguf") is BACKENDS["llama_cpp"]
    assert for_format("safetensors") is BACKENDS["torch"]
    assert for_format("onnx") is None
    assert {spec.health for spec in BACKENDS.values()} == {"/v1/models", "/health"}


GPU_A = {"index": 1, "uuid": "GPU-aaaa", "bytes": 6 << 30, "free_bytes": 30 << 30}
GPU_B = {"index": 0, "uuid": "GPU-bbbb", "bytes": 6 << 30, "free_bytes": 10 << 30}


def test_llama_cpp_offloads_to_its_gpus_and_splits_by_their_free_memory() -> None:
    one = BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {"gpus": [GPU_A]}, paths)
    # The sequences the plan reserved KV cache for on its GPUs (GPU_SEQUENCES), then GPU 0: the first it sees
    assert list(one.argv)[9:] == ["--parallel", "16", "--n_gpu_layers", "-1", "--main_gpu", "0"]
    two = BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {"tensor_parallel": 2, "gpus": [GPU_A, GPU_B]}, paths)
    assert list(two.argv)[9:] == ["--parallel", "16", "--n_gpu_layers", "-1", "--main_gpu", "0",
                                  "--tensor_split", "0.7500", "0.2500"]
    cpu = BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {}, paths)
    assert "--parallel" not in cpu.argv  # on a CPU node the worker sizes itself to the memory free


def test_llama_cpp_tensor_split_parses_as_the_engine_reads_it() -> None:
    """The argv through llama-cpp-python's own argument reader (the worker's): a list of floats."""
    llama_cli = pytest.importorskip("llama_cpp.server.cli")
    from llama_cpp.server.settings import ModelSettings

    argv = list(BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {"gpus": [GPU_A, GPU_B, GPU_B]}, paths).argv)
    import argparse

    parser = argparse.ArgumentParser()
    llama_cli.add_args_from_model(parser, ModelSettings)
    args, _ = parser.parse_known_args(argv[3:])
    assert args.tensor_split == [0.6, 0.2, 0.2] and args.main_gpu == 0 and args.n_gpu_layers == -1


def test_torch_on_one_gpu_and_spread_over_several_by_their_reservations() -> None:
    one = BACKENDS["torch"].command(MODEL, HOST, PORT, {"gpus": [GPU_A]}, paths)
    assert list(one.argv)[9:] == ["--device", "cuda"]
    two = BACKENDS["torch"].command(MODEL, HOST, PORT, {"tensor_parallel": 2, "gpus": [GPU_A, GPU_B]}, paths)
    assert list(two.argv)[9:] == ["--device", "cuda", "--gpu-memory", f"{6 << 30},{6 << 30}"]


def test_parallel_is_the_requests_each_engine_decodes_together() -> None:
    llama = BACKENDS["llama_cpp"].command(MODEL, HOST, PORT, {"parallel": 4, "gpus": [GPU_A]}, paths)
    assert list(llama.argv).count("--parallel") == 1 and list(llama.argv)[list(llama.argv).index("--parallel") + 1] == "4"
    torch = BACKENDS["torch"].command(MODEL, HOST, PORT, {"parallel": 4}, paths)
    assert list(torch.argv)[list(torch.argv).index("--max-batch") + 1] == "4"
