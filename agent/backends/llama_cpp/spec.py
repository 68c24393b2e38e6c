"""The llama.cpp launch spec: GGUF models served by llama-cpp-python's OpenAI-compatible server, with
fleet's OpenAI edges around it (agent/backends/llama_cpp/worker.py; same options as the server's)."""

from __future__ import annotations

import sys
from typing import Any

from agent.backends.launch import Command, LaunchSpec, ModelPath


def command(path: str, host: str, port: int, s: dict[str, Any], _paths: ModelPath) -> Command:
    argv = [sys.executable, "-m", "agent.backends.llama_cpp.worker", "--model", path, "--host", host, "--port", str(port)]
    if s.get("served_name"):  # what /v1/models and every answer's `model` say: the cluster, not a path
        argv += ["--model_alias", str(s["served_name"])]
    if s.get("context_length"):
        argv += ["--n_ctx", str(s["context_length"])]
    if s.get("threads"):
        argv += ["--n_threads", str(s["threads"])]
    if s.get("batch_size"):
        argv += ["--n_batch", str(s["batch_size"])]
    if isinstance(s.get("tensor_parallel"), int) and s["tensor_parallel"] > 0:
        argv += ["--n_gpu_layers", "-1"]
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
                           "how": "llama-cpp-python's server drafts only by prompt lookup; a separate "
                                  "draft model is recorded but not used"}
    return Command(tuple(argv), speculative)


SPEC = LaunchSpec(name="llama_cpp", format="gguf",
                  modules=("llama_cpp", "uvicorn", "fastapi", "sse_starlette", "starlette_context",
                           "pydantic_settings"),
                  extra="gguf", health="/v1/models", command=command)
