"""The keys and values of prompt prefixes, kept for the prompts that begin the same way.

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
from typing import Sequence

import torch

from .torch_layers import Rows

PREFIX_TOKENS = 2048  # tokens the cache holds at most, all entries together (0: no cache)


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

    def count(self, hit: Hit | None) -> None:
        """A prefill used `hit` (statistics only: a lookup for the shared opening is not a hit)."""
        if hit is not None:
            self.hits += 1
            self.hit_tokens += hit.length

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
        self._entries[key] = Prefix(key, [k[row:row + 1].index_select(2, used) for k in rows.keys],
                                    [v[row:row + 1].index_select(2, used) for v in rows.values])
        self.tokens += len(key)
        while self.tokens > self.capacity:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)
