"""The PyTorch launch spec: safetensors models served by agent.backends.torch.worker (transformers)."""

from __future__ import annotations

import sys
from typing import Any

from agent.backends.launch import BadSettings, Command, LaunchSpec, ModelPath


WORKER = "agent.backends.torch.worker"
# What every torch worker imports before it serves (a fork server imports it once for all of them):
# PyTorch, transformers' loading and the Llama family's code (fleet's test models, SmolLM2, and most
# open models served; another family's worker imports its own), the worker's HTTP server and engine.
# Never the worker module itself: run again as __main__, it would be a second copy of it.
PRELOAD = ("torch", "transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama",
           "transformers.generation.streamers", "tokenizers", "safetensors.torch", "hypercorn.config",
           "hypercorn.trio", "agent.auth", "agent.weights.sealed", "agent.backends.openai_app",
           "agent.backends.outbox", "agent.backends.torch.engine")


def command(path: str, host: str, port: int, s: dict[str, Any], paths: ModelPath) -> Command:
    argv = [sys.executable, "-m", WORKER, "--model", path, "--host", host,
            "--port", str(port)]
    if s.get("served_name"):  # what /v1/models and every answer's `model` say: the cluster, not a path
        argv += ["--served-name", str(s["served_name"])]
    if s.get("context_length"):
        argv += ["--context-length", str(s["context_length"])]
    if s.get("threads"):
        argv += ["--threads", str(s["threads"])]
    if s.get("parallel"):  # requests decoded together (the engine's batch)
        argv += ["--max-batch", str(s["parallel"])]
    adapter = s.get("adapter")
    if isinstance(adapter, dict):  # a LoRA adapter held here, merged by the worker at load
        argv += ["--adapter", paths(str(adapter.get("digest")), "adapter")]
    gpus = s.get("gpus") or []
    if gpus:
        # The plan gave it GPUs: a build that cannot use them fails, not runs slow. The worker sees
        # exactly these (CUDA_VISIBLE_DEVICES) and, given more than one, spreads the model over them
        # with transformers' device_map, each GPU holding at most what was reserved on it.
        argv += ["--device", "cuda"]
        if len(gpus) > 1:
            argv += ["--gpu-memory", ",".join(str(int(g["bytes"])) for g in gpus)]
    elif isinstance(s.get("tensor_parallel"), int) and s["tensor_parallel"] > 0:
        argv += ["--device", "cuda"]  # a start naming no GPUs (an older control plane)
    spec = s.get("speculative")
    speculative = None
    if spec:
        if spec.get("mode") == "prompt_lookup":
            argv += ["--prompt-lookup", str(spec.get("tokens") or 10)]
            speculative = {**spec, "applied": True, "how": "transformers prompt-lookup decoding"}
        else:
            draft_digest = spec.get("draft_digest")
            if not isinstance(draft_digest, str):
                raise BadSettings("speculative draft needs draft_digest: the draft model's digest")
            argv += ["--draft", paths(draft_digest, "draft model")]
            speculative = {**spec, "applied": True, "how": "transformers assisted generation"}
    return Command(tuple(argv), speculative)


SPEC = LaunchSpec(name="torch", format="safetensors", modules=("torch", "transformers"), extra="torch",
                  health="/health", command=command, worker=WORKER, preload=PRELOAD)
