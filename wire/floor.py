"""The pace every bulk body between agents is held to, by the end that sends it and the end that
receives it alike: FLOOR_BYTES (or what is left of the body) within every FLOOR_S seconds.

A peer that stops, or drips a byte a minute, would otherwise hold a fetch, a thread or a
connection for as long as it likes; at this floor a body's life is bounded by its length (a GiB
in at most ~17 hours, a stalled one in a minute). The receiver (agent/transfer/peerhttp.py) gives up on a
sender under it (`peer_too_slow`, the fetch resumes); the sender (agent/transfer/blobs.py) cuts a reader
under it (`blob_reader_too_slow`). A floor is far below any link fleet is used on (1 MiB a minute
is 140 bit/s): only a peer that is gone, stuck or hostile meets it."""

from __future__ import annotations

from typing import Callable

FLOOR_BYTES = 1 << 20
FLOOR_S = 60.0


def pace(patience: float = FLOOR_S) -> str:
    """The floor in words, for errors and logs: "under 1 MiB in 60 s"."""
    return f"under {FLOOR_BYTES >> 20} MiB in {patience:g} s"


class Floor:
    """`want` bytes held to FLOOR_BYTES (or the rest) in every `patience` seconds of `clock` (the
    caller's: time.monotonic in a receiving thread, trio's in an event loop).

    `left()` is how long the next wait may last; `got(n)` counts n bytes moved and, once a floor's
    worth has since the window opened, opens the next one; `pause(s)` leaves out s seconds the
    peer was not waited for (a forwarded file's upstream, whose own bounds apply)."""

    def __init__(self, want: int, patience: float, clock: Callable[[], float]) -> None:
        self.want, self.have, self.patience, self._clock = want, 0, patience, clock
        self.due = clock() + patience
        self._mark = min(want, FLOOR_BYTES)

    def left(self) -> float:
        return self.due - self._clock()

    def got(self, n: int) -> None:
        self.have += n
        if self.have >= self._mark:
            self.due, self._mark = self._clock() + self.patience, min(self.want, self.have + FLOOR_BYTES)

    def pause(self, seconds: float) -> None:
        self.due += seconds
