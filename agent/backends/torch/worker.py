"""Our own OpenAI-compatible worker for safetensors models on PyTorch/transformers: HTTP in front of
the batched engine (agent/backends/torch/engine.py).

`transformers serve` fits the plain case but takes no draft model (assisted generation), no
context length and no thread count, and will not serve a layer slice; this worker does, in one
process per server, with the same wire format (SSE chunks ending in `data: [DONE]`).

    python -m agent.backends.torch.worker --model DIR --host H --port P [--threads N]
        [--context-length N] [--draft DIR] [--prompt-lookup N] [--dtype D] [--max-batch N] [--prefix-cache N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import trio

from agent.auth import worker_guard
from agent.weights.sealed import guard_worker, held_memfds
from agent.backends import openai_wire as wire
from agent.backends.openai_app import Scheduler, create_app
from agent.backends.outbox import Outbox, Params
from agent.backends.torch.engine import Engine, Job, speculative
from agent.backends.torch.prefix import PREFIX_TOKENS

STREAM_BUFFER = 64  # tokens a reader may fall behind before its request waits for it
DTYPES = ("auto", "float32", "bfloat16", "float16")


class Served:
    """The model behind the worker: tokenizer, limits, and the engine that runs requests."""

    engine: Scheduler

    def __init__(self, model_dir: str, threads: int | None = None, context_length: int | None = None,
                 draft: str | None = None, prompt_lookup: int | None = None, dtype: str = "auto",
                 max_batch: int = 16, stream_buffer: int = STREAM_BUFFER, device: str = "auto",
                 prefix_cache: int = PREFIX_TOKENS, gpu_memory: list[int] | None = None,
                 adapter: str | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from agent.backends.torch.layers import Stack, Unsupported

        if threads:
            torch.set_num_threads(threads)
        if device == "cuda" and not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise SystemExit(f"wrong engine build: this server was given GPUs (tensor_parallel), but torch "
                             f"{torch.__version__} is {build} and sees no CUDA device. Install a CUDA build "
                             "of torch matching the driver (pip install torch --index-url "
                             "https://download.pytorch.org/whl/cu128), or set no tensor_parallel to serve on the CPU")
        spread = device == "cuda" and gpu_memory is not None and len(gpu_memory) > 1
        if spread and torch.cuda.device_count() < len(gpu_memory or ()):
            raise SystemExit(f"this server was given {len(gpu_memory or ())} GPUs, but torch sees "
                             f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                             f"{os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')})")
        self.device = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
        # CPUs without bfloat16 arithmetic run a bf16 model several times slower than in float32.
        chosen = "float32" if dtype == "auto" and self.device.type == "cpu" else dtype
        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": "auto" if chosen == "auto" else getattr(torch, chosen)}
        placed: dict[str, Any] = {}
        if spread:
            # The model spread over exactly the GPUs this server sees (CUDA_VISIBLE_DEVICES: its own,
            # numbered 0..N-1), layer by layer, each holding at most what was reserved for it there;
            # "balanced" evens the layers out, so every GPU keeps room for its share of the KV cache.
            placed = {"device_map": "balanced", "max_memory": dict(enumerate(gpu_memory or ()))}
        self.name = model_dir  # like llama.cpp, the engine names the model by its path
        self.created = int(time.time())
        self.stream_buffer = stream_buffer
        self.tokenizer: Any = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        loaded: Any = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True, **kwargs, **placed)
        model, info = loaded
        missing = sorted(info.get("missing_keys") or [])
        if missing:
            # transformers would fill these with random values and serve garbage without a word.
            raise SystemExit(f"{model_dir}: the weights lack {len(missing)} tensor(s) the model needs: "
                             + ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else ""))
        if adapter:
            model = merged(model, adapter)
        self.model = (model if placed else model.to(self.device)).eval()  # spread: placed by device_map
        try:
            stack = Stack(self.model)
        except Unsupported as exc:  # said in one line, as a load failure is (the agent keeps it as the reason)
            raise SystemExit(f"{model_dir}: {exc}") from None
        limit = getattr(self.model.config, "max_position_embeddings", None)
        self.context_length = min(context_length or limit or 2048, limit or context_length or 2048,
                                  stack.window or sys.maxsize)
        eos = {int(t) for t in _ids(self.model.generation_config.eos_token_id)} | {
            int(t) for t in _ids(self.tokenizer.eos_token_id)}
        solo = None
        if draft or prompt_lookup:
            draft_model: Any = None
            if draft:
                draft_model = AutoModelForCausalLM.from_pretrained(draft, **kwargs)
                draft_model = draft_model.to(self.device).eval()
            pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else min(eos, default=None)
            solo = speculative(self.model, self.device, pad, draft_model, None if draft else prompt_lookup)
        engine = Engine(stack, eos, max_batch=max_batch, solo=solo, threads=threads, prefix_tokens=prefix_cache)
        engine.start()
        self.engine = engine

    def tokens(self, ask: wire.Ask) -> list[int]:
        if not ask.chat:
            return list(self.tokenizer(ask.prompt)["input_ids"])
        if not getattr(self.tokenizer, "chat_template", None):
            raise wire.BadRequest("this model has no chat template; use /v1/completions with a prompt", "messages",
                                  "no_chat_template")
        messages = [{"role": role, "content": text} for role, text in ask.messages]
        try:
            ids: Any = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as exc:  # the template's own checks (roles, order) raise jinja errors
            raise wire.BadRequest(f"the model's chat template refused the messages: {exc}", "messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def job(self, ask: wire.Ask, ids: list[int]) -> Job:
        room = self.context_length - len(ids)
        if room <= 0:
            raise wire.BadRequest(f"This model's maximum context length is {self.context_length} tokens; the "
                                  f"{'messages' if ask.chat else 'prompt'} came to {len(ids)} tokens. Shorten it.",
                                  "messages" if ask.chat else "prompt", "context_length_exceeded")
        s = ask.sampling
        params = Params(max_new=min(s.max_tokens or room, room), temperature=s.temperature, top_p=s.top_p,
                        seed=s.seed)
        token = trio.lowlevel.current_trio_token()
        return Job(ids, params, Outbox(self.stream_buffer, token.run_sync_soon, self.engine.kick))


def _ids(value: Any) -> list[Any]:
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


def release_sealed() -> int:
    """Close the memfds of an encrypted model the agent handed over (agent/weights/unseal.py), once loaded:
    the tensors hold the weights now (or map those pages, which a mapping keeps), and the descriptors
    would keep a second copy of the plaintext in memory for the server's life. How many were closed."""
    fds = held_memfds()
    for fd in fds:
        os.close(fd)
    return len(fds)


def merged(model: Any, adapter_dir: str) -> Any:
    """`model` with the LoRA adapter in `adapter_dir` (PEFT's format) merged into its weights: peft's
    own merge, so the answers are those of peft's merged model; after it the model is a plain one."""
    try:
        from peft import PeftModel
    except ImportError:
        raise SystemExit("this server serves a LoRA adapter, which needs peft: "
                         "pip install 'inference-fleet[torch]'") from None
    try:
        return PeftModel.from_pretrained(model, adapter_dir, local_files_only=True).merge_and_unload()
    except (ValueError, RuntimeError, KeyError) as exc:  # a wrong base: shapes or modules that do not fit
        first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else type(exc).__name__
        raise SystemExit(f"{adapter_dir}: the adapter does not fit this model: {first}") from None


def main() -> None:
    ap = argparse.ArgumentParser(prog="torch_worker")
    ap.add_argument("--model", required=True)
    ap.add_argument("--host", required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--served-name", help="the model's name in answers and /v1/models (default: its path)")
    ap.add_argument("--threads", type=int)
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--draft")
    ap.add_argument("--adapter", help="a LoRA adapter directory (PEFT's format), merged into the model at load")
    ap.add_argument("--prompt-lookup", type=int)
    ap.add_argument("--dtype", choices=DTYPES, default="auto",
                    help="weights' dtype in memory; auto: float32 on CPU, the checkpoint's own on a GPU")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: a GPU when torch sees one; cuda: fail at load when it does not")
    ap.add_argument("--gpu-memory", type=lambda v: [int(b) for b in v.split(",")],
                    help="BYTES,BYTES,...: with --device cuda, spread the model over that many visible GPUs, "
                         "each holding at most its figure (transformers' device_map)")
    ap.add_argument("--max-batch", type=int, default=16, help="requests decoded together (more wait their turn)")
    ap.add_argument("--prefix-cache", type=int, default=PREFIX_TOKENS,
                    help="prompt tokens whose keys and values are kept for prompts that begin alike (0: none)")
    ap.add_argument("--stream-buffer", type=int, default=STREAM_BUFFER,
                    help="tokens a slow reader may fall behind before its request pauses")
    args = ap.parse_args()
    guard_worker()  # it will hold an encrypted model's plaintext: closed to the other workers
    served = Served(args.model, args.threads, args.context_length, args.draft, args.prompt_lookup, args.dtype,
                    args.max_batch, args.stream_buffer, args.device, args.prefix_cache,
                    args.gpu_memory, args.adapter)  # fails here, loudly
    served.name = args.served_name or served.name
    print(json.dumps({"event": "loaded", "model": args.model, "device": str(served.device),
                      "dtype": str(served.model.dtype).removeprefix("torch."),
                      "context_length": served.context_length}), file=sys.stderr, flush=True)
    release_sealed()

    from hypercorn.config import Config
    from hypercorn.trio import serve

    config = Config()
    config.bind = [f"{args.host}:{args.port}"]
    config.accesslog = None
    trio.run(serve, worker_guard(create_app(served)), config)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
