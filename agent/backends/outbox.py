"""What a batched engine's thread and the HTTP side share for one request: its tokens on their way
to the reader (at most `capacity` waiting: the engine sets the request aside rather than overfill
it) and how it ended. Used by the PyTorch engine's and the llama.cpp engine's decode loops alike."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

Notify = Callable[[Callable[[], None]], None]  # run a callback on the reader's event loop, from any thread


@dataclass(frozen=True, slots=True)
class End:
    """How a request ended: `reason` is stop, length or error (then `error` says what went wrong,
    and `code` is the stable code a client gets with it)."""

    reason: str
    completion_tokens: int
    error: str | None = None
    code: str = "engine_failed"


class Outbox:
    """One request's tokens on their way from the engine thread to its reader, at most `capacity`
    waiting: the engine sets the request aside rather than overfill it (backpressure, no loss)."""

    def __init__(self, capacity: int, notify: Notify, kick: Callable[[], None]) -> None:
        self.capacity = capacity
        self._notify, self._kick = notify, kick
        self._lock = threading.Lock()
        self._tokens: list[int] = []
        self._end: End | None = None
        self._ready: Any = None  # the reader's trio.Event, touched only on the reader's loop

    # Engine side (any thread).

    def waiting(self) -> int:
        with self._lock:
            return len(self._tokens)

    def put(self, tokens: list[int], end: End | None = None) -> None:
        with self._lock:
            self._tokens.extend(tokens)
            if end is not None:
                self._end = end
        try:
            self._notify(self._wake)
        except RuntimeError:  # the reader's loop is gone (shutting down): nobody to tell
            pass

    def kick(self) -> None:
        self._kick()

    def _wake(self) -> None:
        if self._ready is not None:
            self._ready.set()

    # Reader side (the trio loop).

    async def get(self) -> tuple[list[int], End | None]:
        """The tokens so far (possibly none) and the end once it came; waits while there is neither."""
        import trio

        while True:
            with self._lock:
                tokens, end = self._tokens, self._end
                if tokens or end is not None:
                    self._tokens = []
                    break
            self._ready = trio.Event()  # replaced before each look: a put after the look sets this one
            await self._ready.wait()
        self._kick()  # the engine may be waiting for this reader to make room
        return tokens, end
