"""The batched engine: one thread runs every request of the worker through one decode loop.

Newcomers are prefilled together, each after the keys and values of its prompt's opening that
the prefix cache holds (the common opening of prompts arriving together prefilled once), and join
the running batch at the next step; each row keeps its
own sampling, stop tokens and limits; a row whose reader has fallen behind is set aside (its KV
cache kept) until the reader catches up, so a slow client stalls only its own request; a row
whose client left is dropped at the next step. Speculative decoding (a draft model or prompt
lookup) goes through transformers' generate, one request at a time.
"""

from __future__ import annotations

import secrets
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from agent.backends.outbox import Arrivals, End, Outbox, Params
from agent.backends.torch.layers import Rows, Stack
from agent.backends.torch.prefix import PREFIX_TOKENS, Prefill

PREFILL_TOKENS = 4096  # prompt tokens prefilled in one forward at most (a long prompt still goes alone)
@dataclass(eq=False)
class Job:
    """A request inside the engine."""

    prompt: list[int]
    params: Params
    outbox: Outbox
    made: int = 0
    next_token: int = -1
    cancelled: bool = False  # set by the reader's side: the client left, or a stop string matched
    ended: bool = False
    generator: torch.Generator | None = field(default=None, repr=False)

    def cancel(self) -> None:
        self.cancelled = True
        self.outbox.kick()  # the engine may be idle, holding this row aside for its reader

    def end(self, reason: str, last: list[int] | None = None, error: str | None = None,
            code: str = "engine_failed") -> None:
        self.ended = True
        self.outbox.put(last or [], End(reason, self.made, error, code))


class Engine:
    """The decode loop over a Stack, on its own thread. `submit` and `Job.cancel` are the only
    calls from other threads."""

    def __init__(self, stack: Stack, eos: set[int], max_batch: int = 16,
                 solo: Callable[[Job, Callable[[int], bool]], None] | None = None, threads: int | None = None,
                 prefix_tokens: int = PREFIX_TOKENS) -> None:
        self.stack, self.eos, self.max_batch, self.solo, self.threads = stack, frozenset(eos), max_batch, solo, threads
        self.prefill_tokens = PREFILL_TOKENS
        self.prefill = Prefill(stack, prefix_tokens)
        self._arrivals: Arrivals[Job] = Arrivals()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []  # the rows of self._rows, in order
        self._rows: Rows | None = None
        self._aside: dict[Job, Rows] = {}  # rows whose reader fell behind, and joiners not yet merged
        self.steps = 0  # for /health: decode steps run, the most rows in one, rows set aside for a slow reader
        self.widest = 0
        self.set_aside = 0
        self.prefill_s = 0.0  # seconds in prefill and in decode steps: where the engine's time goes
        self.decode_s = 0.0
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def kick(self) -> None:
        self._arrivals.kick()

    def stats(self) -> dict[str, float]:
        return {"steps": self.steps, "widest_step": self.widest, "set_aside": self.set_aside,
                "rows": len(self._active) + len(self._aside), "waiting": len(self._waiting) + self._arrivals.pending(),
                "prefill_s": round(self.prefill_s, 3), "decode_s": round(self.decode_s, 3), **self.prefill.stats()}

    def coming(self, n: int) -> None:
        self._arrivals.coming += n

    def submit(self, job: Job) -> None:
        self._arrivals.put(job)

    # The engine thread.

    def _loop(self) -> None:
        if self.threads:  # the intra-op thread count is per thread with some OpenMP builds: set it here too
            torch.set_num_threads(self.threads)
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
        for job in [j for j in self._waiting if j.cancelled]:
            self._waiting.remove(job)
            job.end("stop")
        if self.solo is not None:  # speculative: one request at a time, through generate
            if not self._waiting:
                return False
            job = self._waiting.popleft()
            try:
                self.solo(job, lambda tok: self._emit(job, tok))
            except Exception as exc:
                job.end("error", error=f"the engine failed: {type(exc).__name__}: {exc}")
                raise
            finally:
                if not job.ended:  # cancelled, or generate stopped on its own (its EOS, its limit)
                    job.end("length" if job.made >= job.params.max_new else "stop")
            return True
        if not self._active and self._waiting:
            self._arrivals.gather(self._waiting)
        self._admit()
        self._regroup()
        if not self._active:
            return bool(self._waiting) and len(self._aside) < self.max_batch
        self._step()
        return True

    def _admit(self) -> None:
        """Prefill every request that fits, together, and hand each its first token."""
        jobs: list[Job] = []
        tokens = 0
        while self._waiting and len(self._active) + len(self._aside) + len(jobs) < self.max_batch and (
                not jobs or tokens + len(self._waiting[0].prompt) <= self.prefill_tokens):
            job = self._waiting.popleft()
            tokens += len(job.prompt)
            job.generator = torch.Generator(device=self.stack.device)
            job.generator.manual_seed(job.params.seed if job.params.seed is not None else secrets.randbits(63))
            jobs.append(job)
        if not jobs:
            return
        t0 = time.perf_counter()
        prompts = [j.prompt for j in jobs]
        with torch.inference_mode():
            rows, logits = self.prefill(prompts)
        self.prefill_s += time.perf_counter() - t0
        for i, (job, tok) in enumerate(zip(jobs, self._pick(logits, jobs))):
            if not self._emit(job, tok):
                self._aside[job] = rows if len(jobs) == 1 else rows.take([i])
        self.prefill.keep(prompts, rows)  # after the first tokens went out: they need not wait for the copies

    def _regroup(self) -> None:
        """Rows whose reader is full go aside; rows set aside (or new) whose reader has room join;
        rows that ended or were cancelled leave. Only the rows that stay keep their cache."""
        keep, leave = [], []
        for i, job in enumerate(self._active):
            if job.cancelled:
                job.end("stop")
            elif job.outbox.waiting() >= job.outbox.capacity:
                leave.append(i)
            else:
                keep.append(i)
        for job in [j for j in self._aside if j.cancelled]:
            del self._aside[job]
            job.end("stop")
        joining = [j for j in self._aside if j.outbox.waiting() <= j.outbox.capacity // 2]
        if len(keep) == len(self._active) and not joining:
            return
        rows = self._rows
        for i in leave:
            assert rows is not None
            self._aside[self._active[i]] = rows.take([i])
            self.set_aside += 1
        parts = [rows.take(keep)] if rows is not None and keep and len(keep) < len(self._active) else (
            [rows] if rows is not None and keep else [])
        self._active = [self._active[i] for i in keep]
        for job in joining:
            parts.append(self._aside.pop(job))
            self._active.append(job)
        self._rows = Rows.cat(parts) if len(parts) > 1 else (parts[0] if parts else None)

    def _step(self) -> None:
        assert self._rows is not None
        t0 = time.perf_counter()
        with torch.inference_mode():
            logits = self.stack.decode(self._rows, [j.next_token for j in self._active])
        self.decode_s += time.perf_counter() - t0
        self.steps += 1
        self.widest = max(self.widest, len(self._active))
        done = [self._emit(job, tok) for job, tok in zip(self._active, self._pick(logits, self._active))]
        if any(done):
            keep = [i for i, d in enumerate(done) if not d]
            self._rows = self._rows.take(keep) if keep else None
            self._active = [self._active[i] for i in keep]

    def _pick(self, logits: torch.Tensor, jobs: list[Job]) -> list[int]:
        """Each row's next token by its own settings: argmax when greedy, else top-p sampling with
        the request's own generator (so that a seed gives the same tokens in any batch)."""
        picked: list[int] = logits.argmax(dim=-1).tolist()
        for i, job in enumerate(jobs):
            p = job.params
            if p.temperature <= 0:
                continue
            probs = torch.softmax(logits[i] / p.temperature, dim=-1)
            if p.top_p < 1.0:
                ordered, index = torch.sort(probs, descending=True)
                beyond = torch.cumsum(ordered, dim=-1) - ordered >= p.top_p  # keep the first token always
                ordered[beyond] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, index, ordered)
            picked[i] = int(torch.multinomial(probs, 1, generator=job.generator))
        return picked

    def _emit(self, job: Job, token: int) -> bool:
        """Hand `token` to the reader; True when the request has ended with it."""
        job.made += 1
        job.next_token = token
        if token in self.eos:
            job.end("stop")
            return True
        if job.made >= job.params.max_new:
            job.end("length", [token])
            return True
        job.outbox.put([token])
        return False

    def _fail_all(self, message: str) -> None:
        for job in [*self._active, *self._aside, *self._waiting]:
            if not job.ended:
                job.end("error", error=message)
        self._active, self._rows, self._aside, self._waiting = [], None, {}, deque()


class _Stop(Exception):
    """Ends generate() from inside its streamer."""


def speculative(model: Any, device: torch.device, pad_token_id: int | None, draft: Any = None,
                prompt_lookup: int | None = None) -> Callable[[Job, Callable[[int], bool]], None]:
    """The solo path: one request through transformers' generate with a draft model (assisted
    generation) or prompt lookup; each token goes to `emit`, which says when the request ended."""
    from transformers.generation.streamers import BaseStreamer

    def run(job: Job, emit: Callable[[int], bool]) -> None:
        class Push(BaseStreamer):
            prompt = True

            def put(self, value: torch.Tensor) -> None:
                if self.prompt:  # generate() first echoes the prompt
                    self.prompt = False
                    return
                for tok in value.reshape(-1).tolist():
                    while job.outbox.waiting() >= job.outbox.capacity:  # the reader is behind: wait for it
                        if job.cancelled:
                            raise _Stop
                        time.sleep(0.01)
                    if job.cancelled or emit(int(tok)):
                        raise _Stop

            def end(self) -> None:
                pass

        p = job.params
        kwargs: dict[str, Any] = {"max_new_tokens": p.max_new, "streamer": Push(), "pad_token_id": pad_token_id,
                                  "do_sample": p.temperature > 0}
        if p.temperature > 0:
            kwargs.update(temperature=p.temperature, top_p=p.top_p)
            torch.manual_seed(p.seed if p.seed is not None else secrets.randbits(63))
        if draft is not None:
            kwargs["assistant_model"] = draft
        elif prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        ids = torch.tensor([job.prompt], device=device)
        try:
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
        except _Stop:
            pass

    return run
