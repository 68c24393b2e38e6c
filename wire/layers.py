"""LayerRange: an inclusive range of a model's layer indices, parsed once from "FIRST-LAST" or "N"."""

from __future__ import annotations

import re
from dataclasses import dataclass

# The same grammar as schemas/fleet.schema.json#/$defs/layers: no sign, no leading zeros, at most
# five digits, so every accepted text has exactly one reading and one canonical spelling.
_LAYERS = re.compile(r"^(0|[1-9][0-9]{0,4})(?:-(0|[1-9][0-9]{0,4}))?$")


class LayerRangeError(ValueError):
    """A layer range that does not parse; `text` is what was given (possibly not a string)."""

    def __init__(self, message: str, text: object) -> None:
        super().__init__(message)
        self.text = text


@dataclass(frozen=True, slots=True, order=True)
class LayerRange:
    """Layers `first` to `last`, both included; ordered by first layer, then last."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if self.first < 0 or self.first > self.last:
            raise LayerRangeError(f"layer range {self.first}-{self.last} runs backwards"
                                  if self.first > self.last else f"layer {self.first} is negative",
                                  f"{self.first}-{self.last}")

    @classmethod
    def parse(cls, text: object) -> LayerRange:
        """"0-39" or "7" (one layer); LayerRangeError saying what is wrong otherwise."""
        m = _LAYERS.match(text) if isinstance(text, str) else None
        if m is None:
            raise LayerRangeError(f"invalid layer range {str(text)[:40]!r}: expected FIRST-LAST, e.g. 0-39", text)
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if first > last:
            raise LayerRangeError(f"layer range {text!r} runs backwards", text)
        return cls(first, last)

    @property
    def count(self) -> int:
        return self.last - self.first + 1

    def __contains__(self, layer: object) -> bool:
        return isinstance(layer, int) and self.first <= layer <= self.last

    def __str__(self) -> str:
        """"FIRST-LAST", or "N" for one layer: the spelling fleet.yaml and plans use."""
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"

    @property
    def span(self) -> str:
        """Always "FIRST-LAST", even for one layer: the spelling a slice manifest records (and hashes)."""
        return f"{self.first}-{self.last}"
