"""Availability windows ("19:00-07:00", local time, may cross midnight): parsing and status at an instant."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, time, timedelta

from .state import Availability

_WINDOW = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])-([01][0-9]|2[0-3]):([0-5][0-9])$")
_DAY = timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Window:
    start: time
    end: time

    @classmethod
    def parse(cls, text: str) -> Window:
        m = _WINDOW.match(text.strip())
        if not m:
            raise ValueError(f"invalid window {text!r}: expected HH:MM-HH:MM on a 24-hour clock, e.g. 19:00-07:00")
        h1, m1, h2, m2 = (int(g) for g in m.groups())
        return cls(time(h1, m1), time(h2, m2))

    @property
    def length(self) -> timedelta:
        """Equal start and end mean the whole day."""
        delta = (datetime.combine(datetime.min, self.end) - datetime.combine(datetime.min, self.start)) % _DAY
        return delta or _DAY

    def __str__(self) -> str:
        return f"{self.start:%H:%M}-{self.end:%H:%M}"


def status(windows: tuple[Window, ...], now: datetime) -> Availability:
    """Whether `now` (an aware local time) lies inside a window, when that stretch ends, and when the
    next window starts. No windows: always available. Windows that touch or overlap are merged."""
    if not windows:
        return {"windows": [], "always": True, "inside": True, "current_ends_at": None, "next_starts_at": None}
    spans = sorted((start, start + w.length) for w in windows
                   for day in (-1, 0, 1, 2)
                   for start in [datetime.combine(now.date() + timedelta(days=day), w.start, now.tzinfo)])
    ends_at: datetime | None = None
    for start, end in spans:  # sorted by start: the first span holding `now`, then what chains onto it
        if ends_at is None:
            if start <= now < end:
                ends_at = end
        elif start <= ends_at < end:
            ends_at = end
    inside = ends_at is not None
    upcoming = [s for s, _ in spans if s > now and (ends_at is None or s > ends_at)]
    return {
        "windows": [str(w) for w in windows],
        "always": False,
        "inside": inside,
        "current_ends_at": ends_at.isoformat() if ends_at else None,
        "next_starts_at": min(upcoming).isoformat() if upcoming else None,
    }
