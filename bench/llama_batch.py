"""bench/llama_batch: llama-cpp-python's own batched decoding (llama_batch over n sequences), in
process and without HTTP, for bench/engines (its `llama_cpp_batch` line)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

from tests.models import smollm2_gguf, smollm2_safetensors

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 2048  # tokens per sequence, as bench/engines gives every engine


def llama_batched(args: argparse.Namespace, topics: list[str]) -> tuple[float, float]:
    """The bindings' own batched decoding, in process and without HTTP: n sequences in one
    llama_decode per step (one context, n_seq_max = n), greedy. What a llama.cpp worker built on
    llama_batch could reach, against one sequence through the same code: (1 sequence's tokens per
    second, n sequences' together)."""
    import ctypes

    import llama_cpp as L
    import numpy as np
    from transformers import AutoTokenizer

    twin = smollm2_safetensors(ROOT / ".pytest_cache" / "d" / "fleet-models", "float32")
    tok: Any = AutoTokenizer.from_pretrained(str(twin))
    @L.llama_log_callback  # type: ignore[untyped-decorator]
    def quiet(level: int, text: bytes, user_data: object) -> None:
        pass
    L.llama_log_set(quiet, ctypes.c_void_p())
    L.llama_backend_init()
    model = L.llama_model_load_from_file(str(smollm2_gguf()).encode(), L.llama_model_default_params())
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))

    def run(n: int) -> tuple[float, float]:
        params = L.llama_context_default_params()
        # Each sequence a context of the engines' 2,048 tokens (bench/engines launches every worker so),
        # in cells of its own as the batched worker has them: a 512-token share per sequence measured
        # ~7% faster here than the worker's configuration, which the comparison would then count against it.
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = CONTEXT * n, 1024, 1024, n
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = args.threads or len(os.sched_getaffinity(0))
        ctx = L.llama_init_from_model(model, params)
        batch = L.llama_batch_init(1024, 0, n)
        prompts = [list(tok.apply_chat_template([{"role": "user", "content": f"Write a long story about {t}."}],
                                                add_generation_prompt=True, tokenize=True)["input_ids"])
                   for t in topics[:n]]

        def decode(items: list[tuple[int, int, int, bool]]) -> list[int]:
            batch.n_tokens = len(items)
            for i, (token, pos, seq, out) in enumerate(items):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, out
                batch.seq_id[i][0] = seq
            assert L.llama_decode(ctx, batch) == 0
            picked = []
            for i, (_, _, _, out) in enumerate(items):
                if out:
                    logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(ctx, i),
                                                               ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
                    picked.append(int(logits.argmax()))
            return picked
        t0 = time.perf_counter()
        last = decode([(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
        ttft = time.perf_counter() - t0
        for step in range(args.tokens - 1):
            last = decode([(last[s], len(prompts[s]) + step, s, True) for s in range(n)])
        wall = time.perf_counter() - t0
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        return n * args.tokens / wall, ttft

    run(1)  # warm-up
    tps1, ttft1 = run(1)
    tpsn, ttftn = run(args.streams)
    print(f"{'llama_cpp_batch':<14} 1 sequence: {tps1:5.1f} tok/s, TTFT {ttft1 * 1000:4.0f} ms | {args.streams} sequences "
          f"in one batch: {tpsn:5.1f} tok/s ({tpsn / tps1:4.2f}x), TTFT {ttftn / ttft1:4.1f}x "
          "(in process, no HTTP)", flush=True)
    L.llama_model_free(model)
    return tps1, tpsn
