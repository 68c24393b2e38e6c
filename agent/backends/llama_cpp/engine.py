"""The batched llama.cpp engine: one GGUF model, one context of `parallel` sequences, and one thread
running every request of the worker through one decode loop on llama-cpp-python's low-level API.

Each step is one `llama_decode` of the oldest newcomer's chunk of its prompt (its first token sent
at once), then one of the running rows' next tokens (a long prompt goes in chunks over several
steps, so the rows already running keep their pace). A request gets a sequence of its
own (its KV cells) when it is admitted and gives it back, cells freed, when it ends, is
cancelled or its client leaves. A row whose reader has fallen behind is left out of the steps
(its cells kept) until the reader catches up, as the PyTorch engine does
(agent/backends/torch/engine.py; the two share agent/backends/outbox.py). Greedy rows take the
argmax of their logits (what a lone sequence would); sampled rows go through llama.cpp's own
sampler chain (top-p, temperature, a seeded draw), one chain per request. With prompt lookup on,
a greedy row's step carries the tokens that followed the last match of its latest tokens in its
own text as a draft; the ones the model agrees with are kept, the rest's cells removed.
"""

from __future__ import annotations

import ctypes
import heapq
import math
import os
import secrets
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import llama_cpp as L
import numpy as np

from agent.backends.outbox import Arrivals, End, Outbox, Params

PREFILL_CHUNK = 256  # prompt tokens one step takes at most, beside the running rows' next tokens
MAX_PARALLEL = 16  # sequences by default at most (fewer when their KV cache would not fit)
MIN_PREFIX = 8  # prompt tokens in common with the cached prompt worth copying rather than computing
ABORTED = 2  # llama_decode's answer when the abort callback stopped it
KV_SHARE = 4  # the default `parallel` keeps every sequence's whole KV cache under 1/KV_SHARE of free memory


@dataclass(eq=False)
class Job:
    """A request inside the engine."""

    prompt: list[int]
    params: Params
    outbox: Outbox
    made: int = 0
    cancelled: bool = False  # set by the reader's side: the client left, or a stop string matched
    ended: bool = False
    seq: int = -1  # its sequence in the context, once admitted
    fed: int = 0  # prompt tokens in its KV cells
    pos: int = 0  # tokens in its KV cells
    next_token: int = -1
    aside: bool = False
    sampler: Any = None
    answer: list[int] = field(default_factory=list)  # what it made so far (prompt lookup looks there too)

    def cancel(self) -> None:
        self.cancelled = True
        self.outbox.kick()  # the engine may be idle, holding this row aside for its reader


def _fits_parallel(model: Any, context_length: int) -> int:
    """Sequences whose whole KV cache (f16 keys and values, every layer) fits in a quarter of the
    memory free now, between 1 and MAX_PARALLEL."""
    import psutil

    heads, heads_kv = max(L.llama_model_n_head(model), 1), L.llama_model_n_head_kv(model)
    per_token = L.llama_model_n_layer(model) * 2 * heads_kv * (L.llama_model_n_embd(model) // heads) * 2
    budget = psutil.virtual_memory().available // KV_SHARE
    return int(max(1, min(MAX_PARALLEL, budget // max(per_token * context_length, 1))))


class Model:
    """The GGUF model, its vocabulary and one context of `parallel` sequences of `context_length`
    tokens each; `speculative` draft tokens per greedy row and step (0: none)."""

    def __init__(self, path: str, context_length: int | None = None, parallel: int | None = None,
                 threads: int | None = None, chunk: int = PREFILL_CHUNK, gpu_layers: int | None = None,
                 main_gpu: int | None = None, tensor_split: list[float] | None = None, lookup: int = 0,
                 flash_attn: bool = False, prefix_cache: bool = False, verbose: bool = False) -> None:
        if not verbose:
            L.llama_log_set(_quiet, ctypes.c_void_p())
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        if gpu_layers is not None:
            mp.n_gpu_layers = gpu_layers
        if main_gpu is not None:
            mp.main_gpu = main_gpu
        if tensor_split:
            self._split = (ctypes.c_float * L.llama_max_devices())(*tensor_split)  # kept alive with the model
            mp.tensor_split = self._split
        model = L.llama_model_load_from_file(path.encode(), mp)
        if not model:
            raise SystemExit(f"llama.cpp could not load the model {os.path.basename(path)}{_said()}")
        self.model = model
        self.vocab = L.llama_model_get_vocab(model)
        self.n_vocab = int(L.llama_vocab_n_tokens(self.vocab))
        train = int(L.llama_model_n_ctx_train(model)) or 2048
        # A context_length set is what the cluster asked for, past the training length too (llama.cpp
        # warns and allows it, as its server does); unset, llama_cpp.server's default n_ctx.
        wanted = context_length or min(2048, train)
        self.prefix_cache = prefix_cache
        most = int(L.llama_max_parallel_sequences()) - (1 if prefix_cache else 0)
        self.parallel = max(1, min(parallel or _fits_parallel(model, wanted), most))
        self.lookup = max(0, lookup)
        self.chunk = max(1, chunk)
        cp = L.llama_context_default_params()
        # With the prefix cache, one more sequence holds the latest prompt for the next to copy its
        # opening from (the chat template's system prompt, the words users' prompts begin with): a
        # copy in a unified cache tags the cells with one more sequence, it does not move them. A
        # context's worth of cells for each sequence, that one's included: a request always finds
        # its room. Off by default: in a unified cache a row's attention runs over cells that other
        # sequences hold too (masked), and the sums' order changes with them: SmolLM2's greedy
        # answers then differ from the single-sequence path's after some tokens (2 of 5 prompts at
        # 48 tokens), though the cache halved the prompt tokens computed (bench/engines).
        seqs = self.parallel + (1 if prefix_cache else 0)
        cp.n_ctx = wanted * seqs
        cp.n_seq_max = seqs
        cp.n_batch = cp.n_ubatch = self.chunk + self.parallel * (1 + self.lookup)
        cp.n_threads = cp.n_threads_batch = threads or max((os.cpu_count() or 2) // 2, 1)  # as llama_cpp.server
        # Off unless asked, as llama-cpp-python's Llama has it: the greedy answers are then the ones
        # its single-sequence path gives (flash attention's sums differ in the last bits, enough to
        # change an argmax now and then).
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.kv_unified = prefix_cache  # else each sequence its own `wanted` cells
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            raise SystemExit(f"llama.cpp could not make a context of {self.parallel} x {wanted} tokens{_said()}")
        self.ctx = ctx
        self.memory = L.llama_get_memory(ctx)
        self.context_length = min(wanted, int(L.llama_n_ctx_seq(ctx)))
        self.batch = L.llama_batch_init(cp.n_batch, 0, 1)
        self.n_batch = int(cp.n_batch)
        self.eos = int(L.llama_vocab_eos(self.vocab))
        self.bos = int(L.llama_vocab_bos(self.vocab))
        self.add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        self._pieces: dict[int, bytes] = {}
        self.abort_check: Any = None  # the engine's abort callback (Engine), kept alive with the context

    # The vocabulary (any thread: these read the vocabulary only).

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """As llama-cpp-python's Llama.tokenize with special=True (control tokens in the text parsed)."""
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            out = (L.llama_token * room)()
            n = L.llama_tokenize(self.vocab, data, len(data), out, room, add_special, True)
            if n >= 0:
                return list(out[:n])
            room = -n
        raise RuntimeError("llama_tokenize failed")

    def piece(self, token: int) -> bytes:
        """The token's bytes as text (control tokens: none)."""
        known = self._pieces.get(token)
        if known is None:
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
            known = self._pieces[token] = buf.raw[:max(n, 0)]
        return known

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        """What agent/backends/torch/text.py asks of a tokenizer."""
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        if token < 0:
            return ""
        raw = L.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    def is_end(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def meta(self, key: str) -> str | None:
        size = 1 << 16
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = L.llama_model_meta_val_str(self.model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1
        return None


LOG_ERROR, LOG_CONT = 4, 5  # ggml_log_level: its errors, and a line continuing the one before
_errors: deque[str] = deque(maxlen=8)  # llama.cpp's latest error lines, for the reason a load failed with
_last_level = 0


@L.llama_log_callback  # type: ignore[untyped-decorator]
def _quiet(level: int, text: bytes, user_data: object) -> None:
    """llama.cpp's log kept off stderr, but for its error lines: a failed load says why in them."""
    global _last_level
    level = _last_level if level == LOG_CONT else level
    _last_level = level
    if level == LOG_ERROR:
        line = text[:1000].decode("utf-8", "replace").strip()
        if line:
            _errors.append(line)


def _said() -> str:
    """llama.cpp's own words for the failure just met, if it logged any (": " and the lines)."""
    return (": " + "; ".join(_errors)) if _errors else ""


class Engine:
    """The decode loop over a Model, on its own thread. `submit`, `coming`, `kick` and `Job.cancel`
    are the only calls from other threads."""

    def __init__(self, model: Model) -> None:
        self.m = model
        self._arrivals: Arrivals[Job] = Arrivals()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []  # admitted, in order: prefilling or decoding
        # The free sequences, lowest first (a heap): the running rows keep to the lowest numbers, so
        # that a step's tokens in sequence order are one run of consecutive sequences (see _step).
        self._free = list(range(model.parallel))
        self.steps = 0
        self.widest = 0
        self.set_aside = 0
        self.freed = 0  # sequences given back (their cells removed)
        self.prefills = 0  # prompt chunks computed (each a llama_decode of its own)
        self.prefill_tokens = 0
        self.prefill_cpu_s = 0.0  # the process's CPU seconds in steps, shared out by their tokens
        self.decode_cpu_s = 0.0
        self.drafted = 0
        self.accepted = 0
        self.prefix_hits = 0
        self.prefix_hit_tokens = 0
        self.aborted = 0  # the rows' decodes abandoned for a newcomer's prompt (see _step)
        # While a step of rows alone runs: until when a newcomer may stop it (its first half, by the
        # last step's time: past it, finishing costs the newcomer less than stopping costs the rows).
        self._abort_until = 0.0
        self._stopped = False  # the last step of rows was stopped: the next one is not
        self._rows_s = 0.0  # the last step of rows, in seconds (what more prompts in a step may take)
        self._prompt_s_per_token = 0.0  # the last prompt chunk's seconds per token
        # llama.cpp asks this after each node of the graph it computes (a few hundred times a
        # decode): a Python callback, under the GIL for a moment each time; alternated with none in
        # one process, a step of 7 rows cost the same within the machine's noise (~90-110 ms).
        check = L.ggml_abort_callback(self._abort_wanted)
        L.llama_set_abort_callback(model.ctx, check, None)
        model.abort_check = check  # alive as long as the context (after it is set: the one before is freed)
        self._cache_seq = model.parallel if model.prefix_cache else -1
        self._cached: list[int] = []  # the prompt the cache sequence holds
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        self._arrivals.kick()

    def coming(self, n: int) -> None:
        self._arrivals.coming += n

    def submit(self, job: Job) -> None:
        self._arrivals.put(job)

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "widest_step": self.widest, "set_aside": self.set_aside,
                "rows": len(self._running), "waiting": len(self._waiting) + self._arrivals.pending(),
                "parallel": self.m.parallel, "free_sequences": len(self._free), "sequences_freed": self.freed,
                "prefills": self.prefills, "prefill_tokens": self.prefill_tokens, "prefix_hits": self.prefix_hits, "prefix_hit_tokens": self.prefix_hit_tokens,
                "prefill_cpu_s": round(self.prefill_cpu_s, 3), "decode_cpu_s": round(self.decode_cpu_s, 3),
                "drafted": self.drafted, "accepted": self.accepted, "aborted_steps": self.aborted}

    def _abort_wanted(self, _data: object) -> bool:
        """llama.cpp's abort callback (the engine thread, inside llama_decode): stop a step of rows
        alone in its first half when a request has come that a free sequence can take."""
        return (self._abort_until > 0 and self._arrivals.pending() > 0 and bool(self._free)
                and time.perf_counter() < self._abort_until)

    # The engine thread.

    def _loop(self) -> None:
        while True:
            self._arrivals.kicked.clear()  # before looking, so that a kick after the look is not lost
            try:
                worked = self._once()
            except Exception as exc:  # a bug or the device failing: the requests in flight fail, the loop goes on
                traceback.print_exc(file=sys.stderr)
                self._fail_all(f"the engine failed: {type(exc).__name__}: {exc}")
                worked = True
            if not worked:
                self._arrivals.kicked.wait()

    def _once(self) -> bool:
        self._arrivals.take(self._waiting)
        if not self._running and self._waiting:
            self._arrivals.gather(self._waiting)
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            self._end(job, "stop")
        for job in [j for j in self._running if j.cancelled]:
            self._end(job, "stop")
        while self._waiting and self._free:
            job = self._waiting.popleft()
            job.seq = heapq.heappop(self._free)
            self._reuse(job)
            job.sampler = self._sampler(job.params)
            self._running.append(job)
        return self._step()

    def _reuse(self, job: Job) -> None:
        """Copy the opening the job's prompt shares with the cached one (the last token is always
        computed: its logits give the first token)."""
        if self._cache_seq < 0:
            return
        n, most = 0, min(len(self._cached), len(job.prompt) - 1)
        while n < most and self._cached[n] == job.prompt[n]:
            n += 1
        if n < MIN_PREFIX:
            return
        L.llama_memory_seq_cp(self.m.memory, self._cache_seq, job.seq, 0, n)
        job.fed = job.pos = n
        self.prefix_hits += 1
        self.prefix_hit_tokens += n

    def _keep(self, job: Job) -> None:
        """The cache sequence holds this prompt now, as llama-cpp-python's Llama keeps its last one."""
        if self._cache_seq < 0 or self._cached == job.prompt:
            return
        L.llama_memory_seq_rm(self.m.memory, self._cache_seq, -1, -1)
        L.llama_memory_seq_cp(self.m.memory, job.seq, self._cache_seq, 0, len(job.prompt))
        self._cached = list(job.prompt)

    def _sampler(self, p: Params) -> Any:
        if p.temperature <= 0:
            return None  # greedy: the argmax, as one sequence alone would take it
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        if p.top_p < 1.0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_top_p(p.top_p, 1))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(p.temperature))
        seed = (p.seed if p.seed is not None else secrets.randbits(32)) & 0xFFFFFFFF
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed if seed != 0xFFFFFFFF else 0))
        return chain

    def _draft(self, job: Job, room: int) -> list[int]:
        """Prompt lookup: what followed the latest occurrence of the row's last two tokens (or last
        one) in its own prompt and answer so far, up to `room` tokens."""
        if not self.m.lookup or job.sampler is not None or room <= 0:
            return []
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        text = np.array(job.prompt + job.answer, dtype=np.intc)
        found = LlamaPromptLookupDecoding.find_candidate_pred_tokens(text, 2, min(self.m.lookup, room))
        return [int(t) for t in found]

    def _step(self) -> bool:
        """The newcomers' prompt chunks, then the decoding rows' next tokens.

        Prompts first, each one's first token sent as soon as it is computed: a newcomer waits for
        the step in flight and the prompts before its own, not for the rows' tokens too. And few
        prompts a step, in the order they came: the oldest newcomer's, then more only while their
        time (at the last prompts' pace per token) stays within the rows' last step. A step that
        took every waiting prompt ran as long as all of them, the requests that came meanwhile were
        admitted together in the next, and requests admitted in one step end in one step and come
        back together: on this CPU (a prompt of ~45 tokens ~4x a step of 7 rows) eight staggered
        streams merged that way into one burst within a round or two, their first tokens waiting
        for each other's prompts (bench/engines' staggered streams, RESULTS.md). One prompt a step
        here, so requests that arrive together leave a step apart; where a step of rows costs what
        several prompts do (a GPU, whose step hardly grows with its rows), a step takes several,
        and a burst's last first token does not wait for a step of rows between each two.

        And a newcomer does not wait for a step of rows alone: one that arrives in its first half
        stops it (llama.cpp's abort callback, checked between the graph's nodes), its cells are
        removed and the rows go again after the newcomer's prompt. A request mostly arrives just
        after a step began (its client's previous answer ended with the step before), so what is
        thrown away is a few milliseconds of a ~100 ms step; without it, a request that ended one step
        after another's came back while the other's prompt ran and waited for it, every round.
        The rows that follow prompts in their step are not stopped: the rows would lose the step
        that the prompts' rows take, and rows that lose a step with a newcomer end with it (the
        burst of a first round merged into three streams that came back together)."""
        c0 = time.process_time()
        filled = 0  # prompt chunks computed this step
        spent = 0.0
        for job in [j for j in self._running if j.fed < len(j.prompt)]:
            take = min(self.m.chunk, len(job.prompt) - job.fed)
            if filled and spent + take * self._prompt_s_per_token > self._rows_s:
                break
            # Each prompt chunk in a llama_decode of its own: with the rows, llama.cpp's split_equal
            # would cut a prompt at the rows' one token each, where a prompt alone goes whole, and a
            # micro-batch of another size rounds otherwise: greedy answers then part from the
            # single-sequence path's at a near tie (tests/integration/test_llama_cpp_worker.py).
            # Alone, a prompt of up to PREFILL_CHUNK tokens is computed as llama-cpp-python's Llama
            # computes it.
            last, t0 = len(job.prompt) - 1, time.perf_counter()
            self._decode([(job.prompt[p], p, job.seq, p == last) for p in range(job.fed, job.fed + take)])
            took = time.perf_counter() - t0
            spent += took
            self._prompt_s_per_token = took / take
            filled += 1
            job.fed += take
            job.pos = job.fed
            self.prefills += 1
            self.prefill_tokens += take
            if job.fed == len(job.prompt):
                self._keep(job)
                self._emit(job, self._pick(job, take - 1))
        c1 = time.process_time()
        rows: list[tuple[Job, list[int]]] = []  # decoding rows in this step, with their drafts
        for job in self._running:
            if job.fed < len(job.prompt):
                continue
            waiting = job.outbox.waiting()
            if not job.aside and waiting >= job.outbox.capacity:
                job.aside = True
                self.set_aside += 1
            elif job.aside and waiting <= job.outbox.capacity // 2:
                job.aside = False
            if not job.aside:
                room = min(job.params.max_new - job.made - 1, self.m.context_length - job.pos - 1)
                rows.append((job, self._draft(job, room)))
        if not rows and not filled:
            return False  # every row is aside (or none): wait for a reader or a request
        # The decoding rows in one llama_decode, in sequence order: with cells of its own for each
        # sequence, llama.cpp cuts a batch into micro-batches of consecutive sequences, taken in the
        # batch's order (split_equal), each a pass over the weights. In the order the rows were
        # admitted, their sequences handed out and given back last in first out, a step at 8 streams
        # was 3.7 passes (7 when the order ran backwards, as it did every other round of requests),
        # against 1 now (bench/engines, LLAMA_BATCH_DEBUG).
        if rows:
            rows.sort(key=lambda row: row[0].seq)
            items: list[tuple[int, int, int, bool]] = []
            first: dict[Job, int] = {}  # each row's first item in the batch
            for job, draft in rows:
                first[job] = len(items)
                items += [(t, job.pos + k, job.seq, True) for k, t in enumerate([job.next_token, *draft])]
            t0 = time.perf_counter()
            # Not right after a stop either: a request that came and went before its step (its client
            # left at once) would stop the steps of rows again and again, and none would end.
            stepped = self._decode(items, abortable=not filled and not self._stopped)
            if stepped:
                self._rows_s = time.perf_counter() - t0
                for job, draft in rows:
                    self._advance(job, first[job], draft)
            else:
                # A newcomer stopped it: what llama.cpp kept of it removed, the rows where they were;
                # the next step takes the newcomer's prompt, then these tokens again.
                for job, _ in rows:
                    L.llama_memory_seq_rm(self.m.memory, job.seq, job.pos, -1)
                self.aborted += 1
            self._stopped = not stepped
        c2 = time.process_time()
        self.prefill_cpu_s += c1 - c0
        self.decode_cpu_s += c2 - c1
        self.steps += 1
        self.widest = max(self.widest, len(rows))
        return True

    def _advance(self, job: Job, base: int, draft: list[int]) -> None:
        """The row's tokens from this step: the one after its next token, then each draft token the
        model agreed with, and the one after the last of those; the cells of the rest removed."""
        job.pos += 1
        self.drafted += len(draft)
        for k in range(len(draft) + 1):
            token = self._pick(job, base + k)
            if self._emit(job, token) or k == len(draft) or token != draft[k]:
                break
            job.pos += 1  # the draft token is the row's own next token: its cells stay
            self.accepted += 1
        if draft and not job.ended:
            L.llama_memory_seq_rm(self.m.memory, job.seq, job.pos, -1)

    def _decode(self, items: list[tuple[int, int, int, bool]], abortable: bool = False) -> bool:
        """False when the abort callback stopped it (only an `abortable` decode: the rows')."""
        b = self.m.batch
        b.n_tokens = len(items)
        for i, (token, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, out
            b.seq_id[i][0] = seq
        if abortable:
            self._abort_until = time.perf_counter() + (self._rows_s / 2 if self._rows_s else math.inf)
        try:
            rc = L.llama_decode(self.m.ctx, b)
        finally:
            self._abort_until = 0.0
        if rc == ABORTED and abortable:
            return False
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        return True

    def _pick(self, job: Job, i: int) -> int:
        if job.sampler is not None:
            return int(L.llama_sampler_sample(job.sampler, self.m.ctx, i))
        logits = np.ctypeslib.as_array(ctypes.cast(L.llama_get_logits_ith(self.m.ctx, i),
                                                   ctypes.POINTER(ctypes.c_float)), shape=(self.m.n_vocab,))
        return int(logits.argmax())

    def _emit(self, job: Job, token: int) -> bool:
        """Hand `token` to the reader; True when the request has ended with it."""
        job.next_token = token
        if self.m.is_end(token):  # not counted, as llama-cpp-python counts an answer's tokens
            self._end(job, "stop")
            return True
        job.made += 1
        if job.made >= job.params.max_new:
            self._end(job, "length", [token])
            return True
        job.answer.append(token)
        job.outbox.put([token])
        return False

    def _end(self, job: Job, reason: str, last: list[int] | None = None, error: str | None = None,
             code: str = "engine_failed") -> None:
        """The request is over: its sequence's cells removed and the sequence free for the next."""
        if job.seq >= 0:
            L.llama_memory_seq_rm(self.m.memory, job.seq, -1, -1)
            heapq.heappush(self._free, job.seq)
            self.freed += 1
            job.seq = -1
        if job.sampler is not None:
            L.llama_sampler_free(job.sampler)
            job.sampler = None
        if job in self._running:
            self._running.remove(job)
        job.ended = True
        job.outbox.put(last or [], End(reason, job.made, error, code))

    def _fail_all(self, message: str) -> None:
        for job in [*self._running, *self._waiting]:
            if not job.ended:
                self._end(job, "error", error=message)
        self._waiting = deque()
