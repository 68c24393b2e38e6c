"""Messages between a pipeline's stages over torch.distributed point-to-point: a step goes forward
from stage to stage, the sampled tokens go from the last stage back to the first.

A step is one message: a 256-byte frame (sequence number, sizes, the header when it fits) and, in
the same buffer, the rest of the header and the hidden states, up to `capacity` bytes; a bigger
step (a long prompt's prefill) sends what follows the frame as a second message of its exact size.
Over NCCL the hidden states always travel on their own, on the device.

On an idle machine a message costs ~0.1 ms; on a loaded one each costs wake-ups, so there is one
per step and hop, and each stage keeps its next receive posted (into the other of two buffers)
before it works on the current one, so that a sender never waits for it. Gloo's send waits until
the receiver has posted its receive, so every send here is non-blocking (isend, its buffer kept
until done): a stage only ever blocks in a receive, and every receive has a bounded timeout."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

FRAME = 256  # bytes: 5 int64 (seq, header bytes, rows, q, split) then the header when it fits
META = 5
INLINE = FRAME - 8 * META
STEP_TAG, REST_TAG, TOKENS_TAG = 0, 1, 2
MIN_CAPACITY = 64 * 1024  # a step's buffer holds at least this much past the frame
INLINE_ROWS = 32  # ... and at least this many rows of hidden states (a decode step of 32 rows)
MAX_REPLY = 4096  # tokens in one reply at most (rows of one step)
MAX_PENDING = 64  # sends not yet taken by their receiver before this stage waits for the oldest


SILENT, CLOSED = "silent", "closed"  # LinkError.detail for the two usual ways a peer is lost


class LinkError(Exception):
    """A receive or send to `peer` failed: `detail` says how (CLOSED, SILENT past `timeout_s`, or
    the first line of what torch said)."""

    def __init__(self, peer: int, detail: str, timeout_s: float = 0.0) -> None:
        super().__init__(detail)
        self.peer, self.detail, self.timeout_s = peer, detail, timeout_s


@dataclass(frozen=True, slots=True)
class Step:
    """One message on its way forward: its header (row operations, what to run) and hidden states."""

    seq: int
    raw: bytes  # the header as it came, passed on unchanged
    hidden: torch.Tensor | None

    @property
    def header(self) -> dict[str, Any]:
        out: dict[str, Any] = json.loads(self.raw)
        return out


def _detail(exc: BaseException, timeout_s: float) -> str:
    text = str(exc)
    if "Timed out" in text or "timed out" in text or "Timeout" in text:
        return SILENT
    if "closed" in text or "reset" in text or "Broken pipe" in text:
        return CLOSED
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


def _pad8(n: int) -> int:
    return n + (-n % 8)


class Link:
    """This stage's ends: from the previous stage (on stage 0: from the last) and to the next (on
    the last: to stage 0). Hidden states cross as `wire_dtype` (what every stage computes in, else
    float32). `sent` counts the bytes this stage put on the wire, by kind."""

    def __init__(self, rank: int, world_size: int, device: torch.device, dtype: torch.dtype, wire_dtype: torch.dtype,
                 hidden_size: int, timeout_s: float, device_transport: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.prev = world_size - 1 if rank == 0 else rank - 1
        self.next = 0 if rank == world_size - 1 else rank + 1
        self.device, self.dtype, self.wire_dtype, self.hidden_size = device, dtype, wire_dtype, hidden_size
        self.row_bytes = hidden_size * torch.empty((), dtype=wire_dtype).element_size()
        # NCCL carries device tensors itself; gloo carries host memory only.
        self.device_transport = device_transport
        self.capacity = FRAME + max(MIN_CAPACITY, INLINE_ROWS * self.row_bytes)  # the same on every stage
        self.timeout, self.timeout_s = timedelta(seconds=timeout_s), timeout_s
        self.sent = {"frames": 0, "headers": 0, "activations": 0, "tokens": 0, "messages": 0}
        self._pending: deque[tuple[Any, torch.Tensor]] = deque()
        self._buffers: list[torch.Tensor] = []
        self._posted: Any = None
        if rank > 0:
            self._buffers = [torch.empty(self.capacity, dtype=torch.uint8) for _ in range(2)]
            self._posted = self._irecv(self._buffers[0], STEP_TAG)
        else:
            self._buffers = [torch.empty(2 + MAX_REPLY, dtype=torch.int64) for _ in range(2)]
            self._posted = self._irecv(self._buffers[0], TOKENS_TAG)

    # Sending: never blocks on the receiver, up to MAX_PENDING messages.

    def _isend(self, tensor: torch.Tensor, tag: int, counts: dict[str, int]) -> None:
        try:
            work = dist.isend(tensor, self.next, tag=tag)
        except RuntimeError as exc:
            raise LinkError(self.next, _detail(exc, self.timeout_s), self.timeout_s) from None
        for kind, n in counts.items():
            self.sent[kind] += n
        self.sent["messages"] += 1
        self._pending.append((work, tensor))
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()
        while len(self._pending) > MAX_PENDING:
            self._wait(self._pending.popleft()[0], self.next)

    def send_step(self, seq: int, raw: bytes, hidden: torch.Tensor | None) -> None:
        rows, q = (int(hidden.shape[0]), int(hidden.shape[1])) if hidden is not None else (0, 0)
        inline = len(raw) <= INLINE
        parts: list[torch.Tensor] = []  # what follows the frame, on the host
        counts = {"frames": FRAME, "headers": 0 if inline else _pad8(len(raw)), "activations": 0}
        if not inline:
            parts.append(torch.frombuffer(bytearray(raw + b"\0" * (-len(raw) % 8)), dtype=torch.uint8))
        device_hidden = None
        if hidden is not None:
            wire = hidden.to(self.wire_dtype).contiguous()
            counts["activations"] = wire.numel() * wire.element_size()
            if self.device_transport:
                device_hidden = wire
            else:
                parts.append(wire.cpu().reshape(-1).view(torch.uint8))
        rest = sum(int(p.numel()) for p in parts)
        split = FRAME + rest > self.capacity
        meta = torch.tensor([seq, len(raw), rows, q, int(split)], dtype=torch.int64).view(torch.uint8)
        head = torch.zeros(FRAME, dtype=torch.uint8)
        head[:8 * META] = meta
        if inline and raw:
            head[8 * META:8 * META + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        if split:
            self._isend(head, STEP_TAG, {"frames": FRAME})
            self._isend(torch.cat(parts), REST_TAG, {k: v for k, v in counts.items() if k != "frames"})
        else:
            self._isend(torch.cat([head, *parts]) if parts else head, STEP_TAG, counts)
        if device_hidden is not None:
            self._isend(device_hidden, REST_TAG, {})

    def send_tokens(self, seq: int, ids: list[int]) -> None:
        out = torch.tensor([seq, len(ids), *ids], dtype=torch.int64)
        self._isend(out, TOKENS_TAG, {"tokens": out.numel() * 8})

    # Receiving: each bounded by the timeout; the next message's receive is posted first.

    def _irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        try:
            return dist.irecv(tensor, self.prev, tag=tag)
        except RuntimeError as exc:
            raise LinkError(self.prev, _detail(exc, self.timeout_s), self.timeout_s) from None

    def _wait(self, work: Any, peer: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise LinkError(peer, _detail(exc, self.timeout_s), self.timeout_s) from None

    def _next(self, tag: int) -> torch.Tensor:
        """The buffer the posted receive filled; the receive after it is posted into the other."""
        self._wait(self._posted, self.prev)
        done, self._buffers = self._buffers[0], self._buffers[::-1]
        self._posted = self._irecv(self._buffers[0], tag)
        return done

    def _exact(self, tensor: torch.Tensor) -> torch.Tensor:
        self._wait(self._irecv(tensor, REST_TAG), self.prev)
        return tensor

    def recv_step(self) -> Step:
        buf = self._next(STEP_TAG)
        seq, size, rows, q, split = (int(v) for v in buf[:8 * META].view(torch.int64))
        inline = size <= INLINE
        n_hidden = rows * q * self.row_bytes if rows and not self.device_transport else 0
        n_rest = (0 if inline else _pad8(size)) + n_hidden
        rest = self._exact(torch.empty(n_rest, dtype=torch.uint8)) if split else buf[FRAME:FRAME + n_rest]
        raw = (buf[8 * META:8 * META + size] if inline else rest[:size]).numpy().tobytes()
        hidden = None
        if rows and self.device_transport:
            wire = self._exact(torch.empty(rows, q, self.hidden_size, dtype=self.wire_dtype, device=self.device))
            hidden = wire.to(self.dtype)
        elif rows:
            at = 0 if inline else _pad8(size)
            wire = rest[at:at + n_hidden].view(self.wire_dtype).reshape(rows, q, self.hidden_size)
            # A copy: the buffer takes the message after next.
            hidden = wire.to(self.device, self.dtype, copy=True)
        return Step(seq, raw, hidden)

    def recv_tokens(self, n: int) -> tuple[int, list[int]]:
        """The tokens of a step of `n` rows (stage 0 knows how many it sent)."""
        buf = self._next(TOKENS_TAG)
        seq, count = int(buf[0]), int(buf[1])
        if count != n:
            raise LinkError(self.prev, f"answered {count} tokens for a step of {n} rows")
        return seq, [int(t) for t in buf[2:2 + n].tolist()]

    def stats(self) -> dict[str, int]:
        return {f"sent_{k}": v for k, v in self.sent.items()}
