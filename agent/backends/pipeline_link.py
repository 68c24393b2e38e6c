"""Messages between a pipeline's stages over torch.distributed point-to-point: a step goes forward
from stage to stage (a small frame, then the hidden states), the sampled tokens go from the last
stage back to the first.

Gloo's send waits until the receiver has posted its receive, so every send here is non-blocking
(isend, its buffers kept until it completes): a stage only ever blocks in a receive, and every
receive has a bounded timeout. Messages between two stages arrive in the order they were sent."""

from __future__ import annotations

import json
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

FRAME = 32  # int64 words: seq, header bytes, rows, q, then the header itself when it fits
INLINE = (FRAME - 4) * 8
MAX_PENDING = 64  # sends not yet taken by their receiver before this stage waits for the oldest


class LinkError(Exception):
    """A receive or send to `peer` failed: `detail` says how (closed, or silent past the timeout)."""

    def __init__(self, peer: int, detail: str) -> None:
        super().__init__(detail)
        self.peer, self.detail = peer, detail


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
        return f"nothing arrived within {timeout_s:g} s"
    if "closed" in text or "reset" in text or "Broken pipe" in text:
        return "its connection closed"
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    return first[:300]


class Link:
    """This stage's ends: from the previous stage (or, on stage 0, from the last) and to the next
    (or, on the last, to stage 0). `sent` counts the bytes this stage put on the wire, by kind."""

    def __init__(self, rank: int, world_size: int, device: torch.device, dtype: torch.dtype, hidden_size: int,
                 timeout_s: float, device_transport: bool) -> None:
        self.rank, self.world_size = rank, world_size
        self.prev = world_size - 1 if rank == 0 else rank - 1
        self.next = 0 if rank == world_size - 1 else rank + 1
        self.device, self.dtype, self.hidden_size = device, dtype, hidden_size
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        # NCCL carries device tensors itself; gloo carries host memory only.
        self.wire_device = device if device_transport else torch.device("cpu")
        self.sent = {"frames": 0, "headers": 0, "activations": 0, "tokens": 0, "messages": 0}
        self._pending: deque[tuple[Any, tuple[torch.Tensor, ...]]] = deque()

    # Sending (never blocks on the receiver, up to MAX_PENDING messages).

    def _isend(self, tensor: torch.Tensor, kind: str) -> None:
        try:
            work = dist.isend(tensor, self.next)
        except RuntimeError as exc:
            raise LinkError(self.next, _detail(exc, self.timeout_s)) from None
        self.sent[kind] += tensor.numel() * tensor.element_size()
        self.sent["messages"] += 1
        self._pending.append((work, (tensor,)))
        self._reap()

    def _reap(self) -> None:
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()
        while len(self._pending) > MAX_PENDING:
            work, _ = self._pending.popleft()
            self._wait(work, self.next)

    def _wait(self, work: Any, peer: int) -> None:
        try:
            work.wait(self.timeout)
        except RuntimeError as exc:
            raise LinkError(peer, _detail(exc, self.timeout_s)) from None

    def send_step(self, seq: int, raw: bytes, hidden: torch.Tensor | None) -> None:
        rows, q = (int(hidden.shape[0]), int(hidden.shape[1])) if hidden is not None else (0, 0)
        frame = torch.zeros(FRAME, dtype=torch.int64)
        frame[:4] = torch.tensor([seq, len(raw), rows, q])
        if len(raw) <= INLINE:
            padded = raw + b"\0" * (-len(raw) % 8)
            if padded:
                frame[4:4 + len(padded) // 8] = torch.frombuffer(bytearray(padded), dtype=torch.int64)
        self._isend(frame, "frames")
        if len(raw) > INLINE:
            self._isend(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "headers")
        if hidden is not None:
            self._isend(hidden.to(self.wire_device).contiguous(), "activations")

    def send_tokens(self, seq: int, ids: list[int]) -> None:
        self._isend(torch.tensor([seq, len(ids), *ids], dtype=torch.int64), "tokens")

    # Receiving (each bounded by the timeout).

    def _recv(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            work = dist.irecv(tensor, self.prev)
        except RuntimeError as exc:
            raise LinkError(self.prev, _detail(exc, self.timeout_s)) from None
        self._wait(work, self.prev)
        return tensor

    def recv_step(self) -> Step:
        frame = self._recv(torch.empty(FRAME, dtype=torch.int64))
        seq, size, rows, q = (int(v) for v in frame[:4])
        if size <= INLINE:
            raw = frame[4:].numpy().tobytes()[:size]
        else:
            raw = self._recv(torch.empty(size, dtype=torch.uint8)).numpy().tobytes()
        hidden = None
        if rows:
            hidden = self._recv(torch.empty(rows, q, self.hidden_size, dtype=self.dtype, device=self.wire_device))
            hidden = hidden.to(self.device)
        return Step(seq, raw, hidden)

    def recv_tokens(self, n: int) -> tuple[int, list[int]]:
        """The tokens of a step of `n` rows (stage 0 knows how many it sent)."""
        got = self._recv(torch.empty(2 + n, dtype=torch.int64)).tolist()
        if got[1] != n:
            raise LinkError(self.prev, f"answered {got[1]} tokens for a step of {n} rows")
        return int(got[0]), [int(t) for t in got[2:]]

    def stats(self) -> dict[str, int]:
        return {f"sent_{k}": v for k, v in self.sent.items()}
