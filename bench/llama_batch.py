"""bench/llama_batch: llama-cpp-python's own batched decoding (llama_batch over n sequences), in
process and without HTTP, for bench/engines (its `llama_cpp_batch` line): what fleet's batched
llama.cpp worker is held to at n streams (issue 34: at least 0.8x).

The same work as the worker's n streams, so that the ratio compares like with like: the prompts
are the ones bench/engines sends (its `content`: "Write a long story about TOPIC, number N.", each
its own), rendered by the GGUF's own chat template and tokenized as the worker does
(agent/backends/llama_cpp/batched.Served.tokens), not by the safetensors twin's tokenizer with a
shorter text (which gave ~42 prompt tokens a request against the worker's ~47: 11% less prefill
per token made); `--requests` rounds of n new prompts, each prefilled together and decoded greedy
to `--tokens` tokens, the cells cleared between rounds, as each of the worker's streams sends its
requests back to back; a context of 2,048 tokens per sequence in cells of its own, as the worker
runs. What it does not have: the time between a request's last token and the next request
(the HTTP round trip, and a step or two that a sequence sits out), which the worker's figure keeps
as part of serving. Besides tokens per wall second it gives tokens per CPU second of its thread:
on a machine shared with other work the wall figure moves with the neighbours, this one far less.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from tests.models import smollm2_gguf

CONTEXT = 2048  # tokens per sequence, as bench/engines gives every engine


class InProcess:
    """The bindings' own batched decoding, in process and without HTTP: n sequences in one
    llama_decode per step (one context, n_seq_max = n), greedy. What a llama.cpp worker built on
    llama_batch could reach. `run(n)` measures n sequences (the model loaded once)."""

    def __init__(self, args: argparse.Namespace, topics: list[str], content: Callable[[str], str]) -> None:
        import llama_cpp as L
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.args, self.topics, self.content, self.L = args, topics, content, L

        @L.llama_log_callback  # type: ignore[untyped-decorator]
        def quiet(level: int, text: bytes, user_data: object) -> None:
            pass
        self._quiet = quiet  # kept alive while llama.cpp may call it
        L.llama_log_set(quiet, ctypes.c_void_p())
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(str(smollm2_gguf()).encode(), L.llama_model_default_params())
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        source = ctypes.create_string_buffer(1 << 16)
        L.llama_model_meta_val_str(self.model, b"tokenizer.chat_template", source, 1 << 16)
        self.template: Any = Jinja2ChatFormatter(source.value.decode(), eos_token=self._text(L.llama_vocab_eos(self.vocab)),
                                                 bos_token=self._text(L.llama_vocab_bos(self.vocab)))

    def _text(self, token: int) -> str:
        return bytes(self.L.llama_vocab_get_text(self.vocab, token)).decode("utf-8", "replace")

    def prompt(self, topic: str) -> list[int]:
        """As the worker's Served.tokens: the GGUF's template, which writes the special tokens."""
        L = self.L
        data = self.template(messages=[{"role": "user", "content": self.content(topic)}]).prompt.encode()
        out = (L.llama_token * (len(data) + 8))()
        n = L.llama_tokenize(self.vocab, data, len(data), out, len(data) + 8, False, True)
        return list(out[:n])

    def run(self, n: int) -> Figures:
        import numpy as np

        L, args = self.L, self.args
        params = L.llama_context_default_params()
        # Each sequence a context of the engines' 2,048 tokens (bench/engines launches every worker so),
        # in cells of its own as the batched worker has them: a 512-token share per sequence measured
        # ~7% faster here than the worker's configuration, which the comparison would then count against it.
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = CONTEXT * n, 1024, 1024, n
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = args.threads or len(os.sched_getaffinity(0))
        ctx = L.llama_init_from_model(self.model, params)
        memory = L.llama_get_memory(ctx)
        batch = L.llama_batch_init(1024, 0, n)

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
                                                               ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
                    picked.append(int(logits.argmax()))
            return picked
        ttfts: list[float] = []
        prompt_tokens = 0
        t0, c0 = time.perf_counter(), time.thread_time()
        for k in range(args.requests):
            prompts = [self.prompt(self.topics[(s + k) % len(self.topics)]) for s in range(n)]
            prompt_tokens += sum(map(len, prompts))
            for s in range(n):
                L.llama_memory_seq_rm(memory, s, -1, -1)
            r0 = time.perf_counter()
            last = decode([(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)])
            ttfts.append(time.perf_counter() - r0)
            for step in range(args.tokens - 1):
                last = decode([(last[s], len(prompts[s]) + step, s, True) for s in range(n)])
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        made = n * args.tokens * args.requests
        return Figures(made / wall, statistics.median(ttfts), made / cpu, prompt_tokens / (n * args.requests),
                       os.getloadavg()[0])

    def close(self) -> None:
        self.L.llama_model_free(self.model)


@dataclass(frozen=True, slots=True)
class Figures:
    tps: float  # tokens per wall second
    ttft: float  # the first tokens' wall seconds (the prefill of every sequence's prompt), median over rounds
    cps: float  # tokens per CPU second of the decoding thread
    prompt: float  # prompt tokens a request
    load: float  # the load average when it ended


def line(n: int, one: Figures, many: Figures, label: str = "llama_cpp_batch") -> str:
    return (f"{label:<16} 1 sequence: {one.tps:5.1f} tok/s, TTFT {one.ttft * 1000:4.0f} ms | {n} sequences in one "
            f"batch: {many.tps:5.1f} tok/s ({many.tps / one.tps:4.2f}x), TTFT {many.ttft / one.ttft:4.1f}x, "
            f"{many.cps:5.1f} tok per CPU-s | {many.prompt:4.1f} prompt tokens a request (in process, no HTTP; "
            f"load {many.load:3.1f})")


def llama_batched(args: argparse.Namespace, topics: list[str],
                  content: Callable[[str], str]) -> tuple[float, float, float]:
    """The in-process arm alone, against one sequence through the same code: (1 sequence's tokens
    per second, n sequences' together, n sequences' tokens per CPU second of the decoding thread)."""
    arm = InProcess(args, topics, content)
    arm.run(1)  # warm-up
    one, many = arm.run(1), arm.run(args.streams)
    print(line(args.streams, one, many), flush=True)
    arm.close()
    return one.tps, many.tps, many.cps
