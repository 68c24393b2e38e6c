"""Prefill after the known opening of each prompt: a cache of prompt openings' keys and values.

A chat model's prompts share their opening (the chat template's system prompt, a conversation's
earlier turns): the keys and values of a token depend on the tokens before it only, so those of a
prompt's first m tokens serve any later prompt that begins with the same m tokens. The engine
keeps each prompt it prefilled (and the common opening of prompts that arrived together) in a
least-recently-used cache bounded by a number of tokens, and prefills of a newcomer only what
follows the longest cached match. Memory: per cached token, 2 x layers x kv_heads x head_dim
values (SmolLM2-135M in float32: 46 KB; 2,048 tokens: 94 MB); an entry is a copy of its own, so
a prefix held by several entries counts once in each.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
import time
from typing import Sequence

import torch

from agent.backends.torch.layers import Opening, Rows, Stack

PREFIX_TOKENS = 2048  # tokens the cache holds at most, all entries together (0: no cache)
SHARE_MIN = 16  # prompt tokens a separate forward for a common opening must save (its own pass over the weights)


@dataclass(frozen=True, slots=True)
class Prefix:
    """The keys and values of `tokens`, per layer [1, kv_heads, len(tokens), head_dim]."""

    tokens: tuple[int, ...]
    keys: list[torch.Tensor] = field(repr=False)
    values: list[torch.Tensor] = field(repr=False)


@dataclass(frozen=True, slots=True)
class Hit:
    """The first `length` tokens of a prompt are those of `prefix`: their keys and values are known."""

    prefix: Prefix
    length: int


def common(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Prefixes by their tokens, least recently used first; at most `capacity` tokens in all."""

    def __init__(self, capacity: int = PREFIX_TOKENS) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[tuple[int, ...], Prefix] = OrderedDict()
        self.tokens = 0  # held now
        self.hits = 0  # prompts that found a cached prefix, and the prompt tokens that were not computed again
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, prompt: Sequence[int], limit: int) -> Hit | None:
        """The entry sharing the longest opening with `prompt`, up to `limit` tokens (the caller
        keeps at least the prompt's last token to compute: its logits are the first answer)."""
        best: Hit | None = None
        for prefix in self._entries.values():
            n = min(common(prompt, prefix.tokens), limit)
            if n and (best is None or n > best.length):
                best = Hit(prefix, n)
        if best is not None:
            self._entries.move_to_end(best.prefix.tokens)
        return best

    def count(self, tokens: int) -> None:
        """A prompt's first `tokens` tokens were not computed for it (statistics only: a lookup
        for the shared opening is not a hit)."""
        if tokens:
            self.hits += 1
            self.hit_tokens += tokens

    def keep(self, tokens: Sequence[int], rows: Rows, row: int) -> None:
        """Keep row `row` of `rows` (all its columns, which hold exactly `tokens`) as an entry.
        An entry that begins with these tokens already serves them; entries that these tokens
        begin with are served by the new one and go."""
        key = tuple(tokens)
        if not key or len(key) > self.capacity:
            return
        for have in self._entries:
            if len(have) >= len(key) and have[:len(key)] == key:
                self._entries.move_to_end(have)
                return
        for have in [h for h in self._entries if key[:len(h)] == h]:
            self._drop(have)
        used = rows.mask[row, :rows.length].nonzero().squeeze(1)
        assert used.numel() == len(key), "the row does not hold exactly these tokens"
        # index_select copies: the entry shares no memory with rows that go on decoding
        self._entries[key] = Prefix(key, [k[row:row + 1].index_select(2, used.to(k.device)) for k in rows.keys],
                                    [v[row:row + 1].index_select(2, used.to(v.device)) for v in rows.values])
        self.tokens += len(key)
        while self.tokens > self.capacity:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)


class Prefill:
    """The engine's prefills: one forward over the prompts that arrived together, each after what
    the cache holds of it. Prompts that begin alike have their common opening computed once
    (8 chat requests: the system prompt once, not 8 times): in the same packed forward as what
    follows it in each prompt, or, when that costs more (long prompts: packed, every query meets
    every key), in a forward of its own first, into the cache."""

    def __init__(self, stack: Stack, capacity: int = PREFIX_TOKENS) -> None:
        self.stack = stack
        self.cache = PrefixCache(capacity) if capacity > 0 else None
        self.forwards = 0  # prefill forwards, the prompt tokens they computed (not the cache's), their CPU time
        self.computed = 0
        self.cpu_s = 0.0

    def __call__(self, prompts: list[list[int]]) -> tuple[Rows, torch.Tensor]:
        """New rows for the prompts, in order, and the logits of each one's first answer token."""
        c0 = time.thread_time()  # the engine thread's own CPU time: what the prompts cost, whatever the machine's load
        try:
            return self._run(prompts)
        finally:
            self.cpu_s += time.thread_time() - c0

    def _run(self, prompts: list[list[int]]) -> tuple[Rows, torch.Tensor]:
        cache, stack = self.cache, self.stack
        hits: list[Hit | None] = [None] * len(prompts)
        if cache is not None:
            shared = min([min(map(len, prompts)) - 1, *(common(prompts[0], p) for p in prompts[1:])])
            if len(prompts) > 1 and shared > 0:
                hit = cache.find(prompts[0], shared)
                done = hit.length if hit is not None else 0
                if (len(prompts) - 1) * (shared - done) >= SHARE_MIN:
                    hits = [cache.find(p, len(p) - 1) for p in prompts]
                    follow = [h is None or h.length < shared for h in hits]  # the rest hold more of theirs
                    if self._merge_pays(prompts, hits, follow, shared, done):
                        return self._merged(prompts, hits, Opening(prompts[0][done:shared], hit, follow), shared)
                    opening = prompts[0][:shared]
                    rows, _ = stack.fill(stack.embed_padded([opening[done:]]), [shared - done], [hit])
                    cache.keep(opening, rows, 0)
                    self.forwards += 1
                    self.computed += shared - done
            hits = [cache.find(p, len(p) - 1) for p in prompts]
            for h in hits:
                cache.count(h.length if h is not None else 0)
        self.forwards += 1
        self.computed += sum(len(p) - (h.length if h is not None else 0) for p, h in zip(prompts, hits))
        return stack.prefill_many(prompts, hits)

    def _merge_pays(self, prompts: list[list[int]], hits: list[Hit | None], follow: list[bool], shared: int,
                    done: int) -> bool:
        """Whether computing the common opening in the tails' own forward (every query then meets
        every key of the burst) costs less than a forward of its own first (one more pass over the
        weights, worth SHARE_MIN tokens) and the tails after it."""
        cost, opening = self.stack.cost, shared - done
        tails = [len(p) - (shared if f else h.length if h is not None else 0) for p, h, f in zip(prompts, hits, follow)]
        known = done + sum(h.length for h, f in zip(hits, follow) if h is not None and not f)
        queries = opening + sum(tails)
        merged = cost(queries, queries * (known + queries))
        width, after = max(tails), sum(tails)
        separate = cost(opening + SHARE_MIN, opening * shared) + min(
            cost(after, after * (after + known + opening)), cost(len(tails) * width, len(tails) * width * (
                max([shared, *(h.length for h in hits if h is not None)]) + width)))
        return merged < separate

    def _merged(self, prompts: list[list[int]], hits: list[Hit | None], opening: Opening,
                shared: int) -> tuple[Rows, torch.Tensor]:
        """One forward for the opening and the tails after it (and after what the cache holds of
        the prompts that do not follow it). The prompts' entries, kept once their first tokens are
        out, serve the opening from then on."""
        assert self.cache is not None
        tails = [p[shared:] if f else p[h.length:] if h is not None else p for p, h, f in zip(prompts, hits, opening.follow)]
        known: list[Hit | None] = [None if f else h for h, f in zip(hits, opening.follow)]
        for h, f in zip(hits, opening.follow):  # a follower does not compute the opening again, as with a hit
            self.cache.count(shared if f else h.length if h is not None else 0)
        self.forwards += 1
        self.computed += len(opening.tokens) + sum(map(len, tails))
        return self.stack.pack(tails, known, opening)

    def keep(self, prompts: list[list[int]], rows: Rows) -> None:
        """Keep the prompts that `rows` holds (row i holds prompts[i]) for those that follow."""
        if self.cache is not None:
            for i, prompt in enumerate(prompts):
                self.cache.keep(prompt, rows, i)

    def stats(self) -> dict[str, float]:
        cache = self.cache
        return {"prefills": self.forwards, "prefill_tokens": self.computed, "prefill_cpu_s": round(self.cpu_s, 3),
                "prefix_hits": cache.hits if cache else 0, "prefix_hit_tokens": cache.hit_tokens if cache else 0,
                "prefix_cached_tokens": cache.tokens if cache else 0}
