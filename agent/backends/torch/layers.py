"""A decoder model as the batched engine drives it: embed, a range of layers over a row-batched KV
cache, norm and head, as separate steps (a pipeline stage runs only its range).

Rows of a batch are left-padded so that every row's newest token sits in the same column; rows
join (`Rows.cat`) and leave (`Rows.take`) between steps, and the explicit mask and per-row
positions keep each row's arithmetic what it would be alone.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from agent.backends.torch.prefix import Hit, Prefix

HEADROOM = 64  # spare columns per (re)allocation, so that decoding rarely reallocates


class Unsupported(Exception):
    """The model is not laid out as the engine needs (Llama-like: embed, layers, norm, head)."""


class Rows:
    """The keys and values of some rows over layers [first, first + n): per layer one tensor
    [rows, kv_heads, capacity, head_dim], filled up to `length`. `mask[r, c]` says whether column c
    holds a token of row r (False: left padding); `positions[r]` is row r's next position."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                 positions: torch.Tensor, length: int, first: int) -> None:
        self.keys, self.values, self.mask, self.positions = keys, values, mask, positions
        self.length, self.first = length, first

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    @property
    def capacity(self) -> int:
        return int(self.mask.shape[1])

    @staticmethod
    def empty(first: int, layers: int, rows: int, kv_heads: int, head_dim: int, capacity: int,
              dtype: torch.dtype, device: torch.device, zero: bool = True,
              devices: Sequence[torch.device] | None = None) -> Rows:
        """Rows of this shape; `zero=False` leaves the keys and values uninitialised, for a caller
        that writes every column below `length` (no column at or past `length` is ever read, and a
        padding column below it must hold finite values: the mask hides it by adding -inf).
        `devices`: each layer's keys and values on its own (a model spread over GPUs by device_map
        keeps each layer's cache where the layer runs); the mask and positions stay on `device`."""
        new = torch.zeros if zero else torch.empty
        where = list(devices) if devices is not None else [device] * layers

        def kv(i: int) -> torch.Tensor:
            return new(rows, kv_heads, capacity, head_dim, dtype=dtype, device=where[i])
        return Rows([kv(i) for i in range(layers)], [kv(i) for i in range(layers)],
                    torch.zeros(rows, capacity, dtype=torch.bool, device=device),
                    torch.zeros(rows, dtype=torch.long, device=device), 0, first)

    def _like(self, rows: int, capacity: int, zero: bool = True) -> Rows:
        k = self.keys[0]
        return Rows.empty(self.first, len(self.keys), rows, k.shape[1], k.shape[3], capacity, k.dtype,
                          self.mask.device, zero, [t.device for t in self.keys])

    def reserve(self, columns: int) -> None:
        """Room for `columns` more tokens without reallocating during a forward."""
        need = self.length + columns
        if need <= self.capacity:
            return
        grown = self._like(self.size, need + max(HEADROOM, self.length // 2), zero=False)  # [:length] copied
        for old, new in zip(self.keys + self.values, grown.keys + grown.values):
            new[:, :, :self.length] = old[:, :, :self.length]
        grown.mask[:, :self.length] = self.mask[:, :self.length]
        self.keys, self.values, self.mask = grown.keys, grown.values, grown.mask

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The transformers cache protocol: store this layer's new keys and values, return all so far."""
        i = layer_idx - self.first
        end = self.length + key_states.shape[2]
        self.keys[i][:, :, self.length:end] = key_states
        self.values[i][:, :, self.length:end] = value_states
        return self.keys[i][:, :, :end], self.values[i][:, :, :end]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def take(self, rows: list[int]) -> Rows:
        """A new Rows with these rows, in this order, without the columns that none of them uses."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        mask = self.mask[index, :self.length]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else self.length
        width = self.length - start
        out = self._like(len(rows), width + HEADROOM, zero=False)  # [:width] copied, padding included
        for old, new in zip(self.keys + self.values, out.keys + out.values):
            new[:, :, :width] = old[index.to(old.device), :, start:self.length]
        out.mask[:, :width] = mask[:, start:]
        out.positions = self.positions[index].clone()
        out.length = width
        return out

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        """All rows of `parts`, in order, right-aligned on the longest (the others left-padded)."""
        width = max(p.length for p in parts)
        out = parts[0]._like(sum(p.size for p in parts), width + HEADROOM)
        row = 0
        for p in parts:
            pad, end = width - p.length, row + p.size
            for old, new in zip(p.keys + p.values, out.keys + out.values):
                new[row:end, :, pad:width] = old[:, :, :p.length]
            out.mask[row:end, pad:width] = p.mask[:, :p.length]
            out.positions[row:end] = p.positions
            row = end
        out.length = width
        return out


@dataclass(frozen=True, slots=True)
class Opening:
    """Tokens that several prompts of a burst begin with, computed in the same forward as their
    tails: `tokens` after what `hit` holds of them; `follow[r]` says whether tail r comes after it."""

    tokens: list[int]
    hit: Hit | None
    follow: list[bool]


class Stack:
    """Layers [first, last) of a Llama-like causal LM (embed_tokens, rotary_emb, layers, norm,
    lm_head), run step by step over a Rows cache. `first == 0` embeds; `last == n_layers` applies
    the final norm and the head."""

    def __init__(self, model: Any, first: int = 0, last: int | None = None) -> None:
        inner = getattr(model, "model", None)
        parts = ("embed_tokens", "layers", "norm", "rotary_emb")
        if inner is None or not all(hasattr(inner, p) for p in parts) or not hasattr(model, "lm_head"):
            raise Unsupported(f"{type(model).__name__} is not laid out as the engine needs (model.embed_tokens, "
                              "model.layers, model.norm, model.rotary_emb, lm_head)")
        config = model.config
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise Unsupported(f"{config.model_type}: layers of kinds {sorted(kinds)}; the batched engine runs "
                              "full-attention layers only")
        window = getattr(config, "sliding_window", None)
        # A sliding window changes nothing while every sequence fits in it: the context is capped there.
        self.window: int | None = window if window and getattr(config, "use_sliding_window", True) else None
        self.model, self.inner, self.config = model, inner, config
        self.n_layers = len(inner.layers)
        self.first, self.last = first, self.n_layers if last is None else last
        self.layers = list(inner.layers)[self.first:self.last]
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        self.heads = int(config.num_attention_heads)
        self._per_token: int | None = None  # the layers' multiply-adds x 2 per token, counted on first use
        params = inspect.signature(type(self.layers[0]).forward).parameters if self.layers else {}
        # transformers 5 renamed the layers' cache argument; the old name still works but warns.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        # Where each layer runs: one device, or several where device_map spread the model over GPUs.
        self.devices = [_device_of(layer, self.device) for layer in self.layers]

    def rows(self, n: int, capacity: int, zero: bool = True) -> Rows:
        return Rows.empty(self.first, len(self.layers), n, self.kv_heads, self.head_dim, capacity, self.dtype,
                          self.device, zero, self.devices)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.inner.embed_tokens(ids)
        return out

    def run(self, hidden: torch.Tensor, rows: Rows, position_ids: torch.Tensor,
            mask: torch.Tensor | None) -> torch.Tensor:
        """This stack's layers over `hidden` [rows, q, hidden]; their keys and values go into
        `rows` at columns [length, length + q) (the caller advances `length` afterwards)."""
        position_embeddings = self.inner.rotary_emb(hidden, position_ids)
        extra = {self.cache_arg: rows}
        for layer in self.layers:
            out = layer(hidden, attention_mask=mask, position_ids=position_ids, use_cache=True,
                        position_embeddings=position_embeddings, **extra)
            hidden = out[0] if isinstance(out, tuple) else out
        return hidden

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of each row's last position, in float32: [rows, vocab]."""
        logits: torch.Tensor = self.model.lm_head(self.inner.norm(hidden[:, -1:, :]))
        return logits[:, -1, :].float()

    def embed_padded(self, prompts: list[list[int]]) -> torch.Tensor:
        """The prompts left-padded to the longest, embedded: [prompts, longest, hidden]."""
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long, device=self.device)
        for r, p in enumerate(prompts):
            ids[r, width - len(p):] = torch.tensor(p, dtype=torch.long, device=self.device)
        return self.embed(ids)

    def fill(self, hidden: torch.Tensor, lengths: list[int],
             known: Sequence[Hit | None] | None = None) -> tuple[Rows, torch.Tensor]:
        """New rows, one per prompt, through this stack's layers: `hidden` [rows, longest, hidden]
        holds row r's `lengths[r]` new tokens, left-padded, and `known[r]` the keys and values of
        the tokens before them (copied in, not computed again). Row r's known tokens end at column
        K (the longest known), its new ones at K + longest; the columns between are padding that
        the mask hides, and the positions keep each row's arithmetic what it would be alone."""
        device = self.device
        n, width = len(lengths), max(lengths)
        hits = list(known) if known is not None else [None] * n
        before = [h.length if h is not None else 0 for h in hits]
        start = max(before)
        total = start + width
        # Columns [start, total) are all written by the forward (padding queries too); only the
        # padding before a shorter known opening needs zeros.
        rows = self.rows(n, total + HEADROOM, zero=False)
        if start:
            for kv in rows.keys + rows.values:
                kv[:, :, :start].zero_()
        positions = torch.zeros(n, width, dtype=torch.long, device=device)
        for r, (hit, k, length) in enumerate(zip(hits, before, lengths)):
            if hit is not None:
                for new, old in zip(rows.keys + rows.values, hit.prefix.keys + hit.prefix.values):
                    new[r, :, start - k:start] = old[0, :, :k]
                rows.mask[r, start - k:start] = True
            positions[r, width - length:] = torch.arange(k, k + length, device=device)
            rows.mask[r, total - length:total] = True
        mask: torch.Tensor | None = None  # one prompt from its start: plain causal attention
        if n > 1 or start:
            causal = torch.ones(width, total, dtype=torch.bool, device=device).tril(diagonal=start)
            # A padding query attends to itself only: a row with nothing to attend to would be NaN.
            own = torch.zeros(width, total, dtype=torch.bool, device=device)
            own[:, start:] = torch.eye(width, dtype=torch.bool, device=device)
            mask = (causal & rows.mask[:, None, None, :total]) | own
        rows.length = start  # the new keys and values go after the known ones
        out = self.run(hidden, rows, positions, mask)
        rows.length = total
        rows.positions = torch.tensor([k + length for k, length in zip(before, lengths)], dtype=torch.long,
                                      device=device)
        return rows, out

    # The whole model in one place (first == 0 and last == n_layers): what the engine calls.

    def prefill_many(self, prompts: list[list[int]],
                     known: Sequence[Hit | None] | None = None) -> tuple[Rows, torch.Tensor]:
        """Several new rows in one forward: one pass over the weights instead of one per prompt
        (prefill is compute-bound on a CPU, so this is what keeps the first token of a burst of
        requests close to that of one); each prompt's tokens that `known` covers are not computed
        again. Packed end to end or left-padded to the longest, whichever computes less. Also the
        logits of each row's next token."""
        hits: list[Hit | None] = list(known) if known is not None else [None] * len(prompts)
        tails = [p[h.length:] if h is not None else p for p, h in zip(prompts, hits)]
        if len(prompts) > 1 and self._packing_pays(tails, hits):
            return self.pack(tails, hits)
        rows, hidden = self.fill(self.embed_padded(tails), [len(t) for t in tails], hits)
        return rows, self.head(hidden)

    def cost(self, tokens: int, pairs: int) -> int:
        """The FLOPs of computing `tokens` tokens with `pairs` (query, key) pairs of attention:
        the layers' weights cost 2 x their parameters per token, attention 4 x heads x head_dim
        per pair (masked pairs too: they are computed all the same)."""
        if self._per_token is None:
            self._per_token = 2 * sum(p.numel() for layer in self.layers for p in layer.parameters())
        return tokens * self._per_token + pairs * 4 * self.heads * self.head_dim * len(self.layers)

    def _packing_pays(self, tails: list[list[int]], hits: list[Hit | None]) -> bool:
        """Whether packing computes less than padding: packed, every query meets every key of
        the burst; padded, every row is as long as the longest."""
        before = [h.length if h is not None else 0 for h in hits]
        width, start = max(map(len, tails)), max(before)
        queries = sum(map(len, tails))
        keys = queries + sum(length for _, length in _distinct(hits))
        return self.cost(queries, queries * keys) < self.cost(len(tails) * width, len(tails) * width * (start + width))

    def pack(self, tails: list[list[int]], hits: list[Hit | None],
             opening: Opening | None = None) -> tuple[Rows, torch.Tensor]:
        """New rows, one per prompt, through one forward over the tails laid end to end in a
        single row (no padding computed): the distinct known openings first, then `opening`'s new
        tokens (an opening several tails share, computed in this same forward), then the tails;
        the mask lets each segment see its own known columns and its own earlier tokens only, and
        the positions are each prompt's own. The keys and values are then laid out as decoding
        wants them: rows right-aligned, known columns then tail. Also each row's next-token logits."""
        device, n = self.device, len(tails)
        spans = _distinct([*hits, opening.hit if opening is not None else None])  # each known opening once
        where: dict[tuple[int, int], int] = {}  # (id(prefix), length) -> its first column in the line
        known = 0
        for prefix, length in spans:
            where[(id(prefix), length)] = known
            known += length

        def cols(hit: Hit | None) -> torch.Tensor:
            at = where[(id(hit.prefix), hit.length)] if hit is not None else 0
            return torch.arange(at, at + (hit.length if hit is not None else 0), device=device)
        segments: list[tuple[list[int], torch.Tensor]] = []  # (tokens computed now, the line columns they see first)
        shared = cols(None)
        if opening is not None:  # its followers see its known columns and all of its new ones
            segments.append((opening.tokens, cols(opening.hit)))
            shared = torch.cat([segments[0][1], torch.arange(known, known + len(opening.tokens), device=device)])
        segments += [(tail, shared if opening is not None and opening.follow[r] else cols(hit))
                     for r, (tail, hit) in enumerate(zip(tails, hits))]
        queries = sum(len(t) for t, _ in segments)
        total = known + queries
        line = self.rows(1, total + 1, zero=False)  # the column past the end: zeros, for the padding below
        for kv in line.keys + line.values:
            kv[:, :, total].zero_()
        for prefix, length in spans:
            at = where[(id(prefix), length)]
            for new, old in zip(line.keys + line.values, prefix.keys + prefix.values):
                new[0, :, at:at + length] = old[0, :, :length]
        mask = torch.zeros(queries, total, dtype=torch.bool, device=device)
        positions = torch.empty(queries, dtype=torch.long, device=device)
        outs = segments[len(segments) - n:]  # the tails: the rows that come out
        width = max(len(before) + len(tail) for tail, before in outs)
        gather = torch.full((n, width), total, dtype=torch.long, device=device)  # [row, column] <- line column
        q, lasts = 0, []
        for i, (tail, before) in enumerate(segments):
            k, m = len(before), len(tail)
            mask[q:q + m].index_fill_(1, before, True)
            mask[q:q + m, known + q:known + q + m] = torch.ones(m, m, dtype=torch.bool, device=device).tril()
            positions[q:q + m] = torch.arange(k, k + m, device=device)
            if i >= len(segments) - n:
                r = i - (len(segments) - n)
                gather[r, width - m - k:width - m] = before
                gather[r, width - m:] = torch.arange(known + q, known + q + m, device=device)
                lasts.append(q + m - 1)
            q += m
        ids = torch.tensor([t for tail, _ in segments for t in tail], dtype=torch.long, device=device)
        line.length = known
        hidden = self.run(self.embed(ids[None]), line, positions[None], mask[None, None])
        logits = self.head(hidden[0, lasts].unsqueeze(1))
        rows = self.rows(n, width + HEADROOM, zero=False)  # every column below `width` is gathered
        flat = gather.reshape(-1)
        for new, old in zip(rows.keys + rows.values, line.keys + line.values):
            new[:, :, :width] = old[0].index_select(1, flat.to(old.device)).view(old.shape[1], n, width, -1).transpose(0, 1)
        rows.mask[:, :width] = gather != total
        rows.positions = torch.tensor([len(before) + len(tail) for tail, before in outs], dtype=torch.long,
                                      device=device)
        rows.length = width
        return rows, logits

    def decode(self, rows: Rows, tokens: list[int]) -> torch.Tensor:
        """One step: each row's next token in; the logits of the token after it out."""
        rows.reserve(1)
        x = torch.tensor(tokens, dtype=torch.long, device=self.device).unsqueeze(1)
        rows.mask[:, rows.length] = True
        mask = rows.mask[:, None, None, :rows.length + 1]
        hidden = self.run(self.embed(x), rows, rows.positions.unsqueeze(1), mask)
        rows.length += 1
        rows.positions += 1
        return self.head(hidden)


def _device_of(layer: Any, default: torch.device) -> torch.device:
    """The device of a layer's weights (`default` for a layer without any)."""
    weight = next(layer.parameters(), None)
    return weight.device if weight is not None else default


def _distinct(hits: Sequence[Hit | None]) -> list[tuple[Prefix, int]]:
    """The known openings of `hits`, each (prefix, length) once, in order of first use."""
    seen: dict[tuple[int, int], tuple[Prefix, int]] = {}
    for h in hits:
        if h is not None:
            seen.setdefault((id(h.prefix), h.length), (h.prefix, h.length))
    return list(seen.values())
