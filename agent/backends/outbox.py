"""What a batched engine's thread and the HTTP side share for one request: its tokens on their way
to the reader (at most `capacity` waiting: the engine sets the request aside rather than overfill
it), how it ended, and the sampling it asked for. Used by the PyTorch engine's and the llama.cpp
engine's decode loops alike (and the pipeline's, through the PyTorch engine's Job)."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

Notify = Callable[[Callable[[], None]], None]  # run a callback on the reader's event loop, from any thread
J = TypeVar("J")

# An idle engine waits for requests arriving with the first (a burst reaches it one HTTP request at a
# time, 1-10 ms apart on a busy machine) while the HTTP side reads one (`coming`) or they keep
# coming QUIET_S apart, GATHER_S at most: one prefill for all of them is one pass over the weights,
# not one more per straggler. A lone request pays QUIET_S.
QUIET_S, GATHER_S = 0.005, 0.05


@dataclass(frozen=True, slots=True)
class Params:
    """A request's sampling: at most `max_new` tokens; temperature 0 is greedy (the argmax)."""

    max_new: int
    temperature: float
    top_p: float
    seed: int | None


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


class Arrivals(Generic[J]):
    """Requests on their way from the HTTP side to an engine's thread, which takes them at its step
    boundaries, and the event that wakes it (`kicked`: a request, a reader that made room, a cancel).
    `put`, `kick` and `coming` come from other threads; `take` and `gather` run on the engine's."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[J] = queue.SimpleQueue()
        self.kicked = threading.Event()
        self.arrived = 0.0  # perf_counter of the latest put
        self.coming = 0  # requests the HTTP side is reading (changed on its loop only)

    def put(self, job: J) -> None:
        self.arrived = time.perf_counter()
        self._queue.put(job)
        self.kicked.set()

    def kick(self) -> None:
        self.kicked.set()

    def pending(self) -> int:
        return self._queue.qsize()

    def take(self, into: deque[J]) -> None:
        """Every request arrived so far, appended in order."""
        while True:
            try:
                into.append(self._queue.get_nowait())
            except queue.Empty:
                return

    def gather(self, into: deque[J]) -> None:
        """An idle engine's wait for a burst's others (QUIET_S, GATHER_S above), then `take`."""
        end = time.perf_counter() + GATHER_S
        while (now := time.perf_counter()) < end and (self.coming > 0 or now - self.arrived < QUIET_S):
            time.sleep(QUIET_S / 2)
        self.take(into)
