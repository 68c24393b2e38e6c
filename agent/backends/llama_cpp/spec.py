"""The llama.cpp launch spec: GGUF models served by fleet's batched llama.cpp worker
(agent/backends/llama_cpp/batched.py), or, with FLEET_LLAMA_WORKER=server in the agent's
environment, by llama-cpp-python's OpenAI-compatible server with fleet's OpenAI edges around it
(agent/backends/llama_cpp/worker.py). Both take the same options (the server's names)."""

from __future__ import annotations

import os
import sys
from typing import Any

from wire.plan_details import GPU_SEQUENCES

from agent.backends.launch import BadSettings, Command, LaunchSpec, ModelPath

WORKER_ENV = "FLEET_LLAMA_WORKER"  # batched (the default) or server: which llama.cpp worker the agent starts
WORKERS = {"batched": "agent.backends.llama_cpp.batched", "server": "agent.backends.llama_cpp.worker"}


def worker_module() -> str:
    chosen = os.environ.get(WORKER_ENV) or "batched"
    if chosen not in WORKERS:
        raise BadSettings(f"{WORKER_ENV}={chosen!r} names no llama.cpp worker: {' or '.join(WORKERS)}")
    return WORKERS[chosen]


def split_fractions(free: list[int]) -> list[str]:
    """llama.cpp's --tensor_split: each GPU's share, in proportion to its free memory (equal shares
    where none reports any), written with 4 decimals (llama.cpp normalises them)."""
    total = sum(max(0, f) for f in free)
    if total <= 0:
        return [f"{1 / len(free):.4f}"] * len(free)
    return [f"{max(0, f) / total:.4f}" for f in free]


def command(path: str, host: str, port: int, s: dict[str, Any], _paths: ModelPath) -> Command:
    module = worker_module()
    argv = [sys.executable, "-m", module, "--model", path, "--host", host, "--port", str(port)]
    if s.get("served_name"):  # what /v1/models and every answer's `model` say: the cluster, not a path
        argv += ["--model_alias", str(s["served_name"])]
    if s.get("context_length"):
        argv += ["--n_ctx", str(s["context_length"])]
    if s.get("threads"):
        argv += ["--n_threads", str(s["threads"])]
    if s.get("batch_size"):
        argv += ["--n_batch", str(s["batch_size"])]
    if s.get("parallel") and module == WORKERS["batched"]:  # sequences decoded together (default: what fits)
        argv += ["--parallel", str(s["parallel"])]
    elif s.get("gpus") and module == WORKERS["batched"]:
        # On GPUs, the sequences the plan reserved KV cache for (its estimate), not what a quarter
        # of the host's free memory would hold: what the context allocates is what was reserved.
        argv += ["--parallel", str(GPU_SEQUENCES)]
    gpus = s.get("gpus") or []
    if gpus:  # the worker sees exactly these (CUDA_VISIBLE_DEVICES), numbered 0..N-1 in this order
        argv += ["--n_gpu_layers", "-1", "--main_gpu", "0"]
        if len(gpus) > 1:  # the layers split in proportion to each GPU's free memory at the start
            argv += ["--tensor_split", *split_fractions([int(g["free_bytes"]) for g in gpus])]
    elif isinstance(s.get("tensor_parallel"), int) and s["tensor_parallel"] > 0:
        argv += ["--n_gpu_layers", "-1"]  # a start naming no GPUs (an older control plane): all offloaded
    spec = s.get("speculative")
    speculative = None
    if spec:
        if spec.get("mode") == "prompt_lookup":
            argv += ["--draft_model", "prompt-lookup-decoding"]
            if spec.get("tokens"):
                argv += ["--draft_model_num_pred_tokens", str(spec["tokens"])]
            speculative = {**spec, "applied": True, "how": "llama.cpp prompt-lookup decoding"}
        else:
            speculative = {**spec, "applied": False,
                           "how": "fleet's llama.cpp workers draft only by prompt lookup; a separate "
                                  "draft model is recorded but not used"}
    return Command(tuple(argv), speculative)


SPEC = LaunchSpec(name="llama_cpp", format="gguf",
                  modules=("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context",
                           "pydantic_settings"),
                  extra="gguf", health="/v1/models", command=command)
