"""Link rates the agent measured on its own fetches, kept per peer (bounded) and across restarts."""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable
from urllib.parse import urlsplit

from wire.state import LinkRate

log = logging.getLogger("fleet-agent")

KEEP = 8  # the last fetches from each peer: recent enough to follow a link that changed
PEERS = 64  # the peers remembered, the least recently used forgotten first
MIN_BYTES = 1 << 20  # a fetch smaller than this measures round trips and fsyncs, not the link


@dataclass(frozen=True, slots=True)
class Sample:
    bytes: int
    seconds: float
    at: str  # ISO 8601, UTC: when the fetch ended


def peer_key(peer: str) -> str:
    """A peer as the planner names it too: "HOST:PORT" (the agent is asked with a URL)."""
    parts = urlsplit(peer if "//" in peer else f"//{peer}")
    host = parts.hostname or peer
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{parts.port}" if parts.port else host


class Rates:
    """The recent fetches from each peer; `path` keeps them across restarts (None: in memory only).
    Written whole after every recorded fetch (a few kilobytes, once a fetch): cheap next to the fetch."""

    def __init__(self, path: Path | None, *, keep: int = KEEP, peers: int = PEERS,
                 clock: Callable[[], datetime] = lambda: datetime.now(timezone.utc)) -> None:
        self.path, self.keep, self.peers, self.clock = path, keep, peers, clock
        self.samples: dict[str, deque[Sample]] = {}
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
            for peer, items in saved.items():
                self.samples[str(peer)] = deque((Sample(int(s["bytes"]), float(s["seconds"]), str(s["at"]))
                                                 for s in items if s["seconds"] > 0 and s["bytes"] > 0),
                                                maxlen=self.keep)
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # Measurements are a help to the planner, never a reason for the agent not to start.
            log.warning("link rates in %s unreadable (%s); starting without them", path, exc)
            self.samples = {}

    def record(self, peer: str, nbytes: int, seconds: float) -> bool:
        """One fetch ended well: `nbytes` crossed the link from `peer` in `seconds` (from the ask to
        the file committed, as a replication takes). False when too small to say anything."""
        if nbytes < MIN_BYTES or seconds <= 0:
            return False
        key = peer_key(peer)
        kept = self.samples.pop(key, None) or deque(maxlen=self.keep)
        kept.append(Sample(nbytes, seconds, self.clock().isoformat(timespec="seconds")))
        self.samples[key] = kept  # most recently used last
        while len(self.samples) > self.peers:
            del self.samples[next(iter(self.samples))]
        self._save()
        return True

    def _save(self) -> None:
        if self.path is None:
            return
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({p: [{"bytes": s.bytes, "seconds": s.seconds, "at": s.at}
                                           for s in kept] for p, kept in self.samples.items()}), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("could not keep link rates in %s: %s", self.path, exc)

    def seconds_for(self, peer: str, nbytes: int) -> float | None:
        """How long `nbytes` from `peer` take at its recent rate; None with no measurement yet."""
        kept = self.samples.get(peer_key(peer))
        if not kept:
            return None
        return nbytes * sum(s.seconds for s in kept) / sum(s.bytes for s in kept)

    def to_json(self) -> list[LinkRate]:
        """Per peer, the rate of its recent fetches taken together (their bytes over their seconds:
        the estimator of how long the next bytes take, which an average of rates is not)."""
        out: list[LinkRate] = []
        for peer in sorted(self.samples):
            kept = self.samples[peer]
            if not kept:
                continue
            total, seconds = sum(s.bytes for s in kept), sum(s.seconds for s in kept)
            out.append({"peer": peer, "bytes_per_s": round(total / seconds), "samples": len(kept),
                        "last_bytes_per_s": round(kept[-1].bytes / kept[-1].seconds), "measured_at": kept[-1].at})
        return out
