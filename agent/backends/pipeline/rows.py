"""A stage's rows: the KV caches of the batches it holds, changed by the same operations in the
same order on every stage (so a row is at the same index of the same batch everywhere), one step
of the stage's layers over a batch, and on the last stage each row's sampling.

Operations, as they travel in a step's header (rows are request ids, batches small integers):
  ["keep", b, [rows]]          batch b keeps these rows, in this order (none: b is gone)
  ["carve", src, dst, [rows]]  batch dst is a copy of these rows of src (src is unchanged)
  ["join", dst, [b1, b2, ..]]  batch dst holds the rows of b1, b2, ... in order (they are gone)
What runs after them:
  {"k": "p", "b": b, "rows": [..], "len": [..], "s": [[temperature, top_p, seed], ..]}  prefill
  {"k": "d", "b": b}  one decode step
"""

from __future__ import annotations

import time
from typing import Any

import torch

from agent.backends.torch.layers import Rows, Stack


class Ledger:
    """The batches of one stage: their caches and, in order, the request each row belongs to."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.caches: dict[int, Rows] = {}
        self.members: dict[int, list[int]] = {}
        self.busy_ns = 0  # time in this stage's own arithmetic (embedding, layers): the rest is waiting

    def apply(self, ops: list[list[Any]]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "keep":
                self._keep(int(op[1]), [int(r) for r in op[2]])
            elif kind == "carve":
                src, dst, rows = int(op[1]), int(op[2]), [int(r) for r in op[3]]
                where = self.members[src]
                self.caches[dst] = self.caches[src].take([where.index(r) for r in rows])
                self.members[dst] = rows
            elif kind == "join":
                dst, parts = int(op[1]), [int(p) for p in op[2]]
                caches = [self.caches.pop(p) for p in parts]
                members = [r for p in parts for r in self.members.pop(p)]
                self.caches[dst] = Rows.cat(caches) if len(caches) > 1 else caches[0]
                self.members[dst] = members
            else:
                raise ValueError(f"unknown row operation {kind!r}")

    def _keep(self, b: int, rows: list[int]) -> None:
        if not rows:
            self.caches.pop(b, None)  # the rows' keys and values are freed here
            self.members.pop(b, None)
            return
        where = self.members[b]
        if rows != where:
            self.caches[b] = self.caches[b].take([where.index(r) for r in rows])
            self.members[b] = rows

    def rows(self) -> int:
        """How many rows the stage holds (read from the HTTP thread: list() copies in one step)."""
        return sum(map(len, list(self.members.values())))

    def present(self) -> set[int]:
        return {r for m in self.members.values() for r in m}

    def embed_prompts(self, prompts: list[list[int]]) -> torch.Tensor:
        """The first stage's input for a prefill: the prompts left-padded to the longest, embedded."""
        t0 = time.perf_counter_ns()
        out = self.stack.embed_padded(prompts)
        self.busy_ns += time.perf_counter_ns() - t0
        return out

    def embed_tokens(self, tokens: list[int]) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        out = self.stack.embed(torch.tensor(tokens, dtype=torch.long, device=self.stack.device).unsqueeze(1))
        self.busy_ns += time.perf_counter_ns() - t0
        return out

    def prefill(self, b: int, rows: list[int], lengths: list[int], hidden: torch.Tensor) -> torch.Tensor:
        """New batch b of these rows, their prompts' hidden states [rows, longest, hidden] in (as
        Stack.fill pads and masks them for the whole model, so a row's arithmetic is the same)."""
        t0 = time.perf_counter_ns()
        cache, out = self.stack.fill(hidden, lengths)
        self.caches[b], self.members[b] = cache, list(rows)
        self.busy_ns += time.perf_counter_ns() - t0
        return out

    def decode(self, b: int, hidden: torch.Tensor) -> torch.Tensor:
        """One step of batch b: each row's newest token's hidden state [rows, 1, hidden] in."""
        t0 = time.perf_counter_ns()
        cache = self.caches[b]
        cache.reserve(1)
        cache.mask[:, cache.length] = True
        mask = cache.mask[:, None, None, :cache.length + 1]
        out = self.stack.run(hidden, cache, cache.positions.unsqueeze(1), mask)
        cache.length += 1
        cache.positions += 1
        self.busy_ns += time.perf_counter_ns() - t0
        return out

    def run(self, run: dict[str, Any], hidden: torch.Tensor) -> torch.Tensor:
        if run["k"] == "p":
            return self.prefill(int(run["b"]), run["rows"], run["len"], hidden)
        return self.decode(int(run["b"]), hidden)


class Sampler:
    """The last stage's per-request sampling: greedy, or top-p with the request's own generator
    seeded once (so that a seed gives the same tokens in any batch, as in the whole-model engine)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.params: dict[int, tuple[float, float, torch.Generator]] = {}

    def join(self, rows: list[int], sampling: list[list[Any]]) -> None:
        for rid, (temperature, top_p, seed) in zip(rows, sampling):
            generator = torch.Generator(device=self.device)
            generator.manual_seed(int(seed))
            self.params[rid] = (float(temperature), float(top_p), generator)

    def forget(self, present: set[int]) -> None:
        for rid in [r for r in self.params if r not in present]:
            del self.params[rid]

    def pick(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        picked: list[int] = logits.argmax(dim=-1).tolist()
        for i, rid in enumerate(rows):
            temperature, top_p, generator = self.params[rid]
            if temperature <= 0:
                continue
            probs = torch.softmax(logits[i] / temperature, dim=-1)
            if top_p < 1.0:
                ordered, index = torch.sort(probs, descending=True)
                beyond = torch.cumsum(ordered, dim=-1) - ordered >= top_p  # keep the first token always
                ordered[beyond] = 0.0
                probs = torch.zeros_like(probs).scatter_(0, index, ordered)
            picked[i] = int(torch.multinomial(probs, 1, generator=generator))
        return picked
