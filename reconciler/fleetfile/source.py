"""Read a fleet file: bytes → text → YAML values with the line/column of every key and value
(the YAML itself: reconciler/fleetfile/yamltree.py, imported only when a text is parsed)."""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reconciler.core.diagnostics import Diagnostic, Pos, SourceRange, error

YamlPath = tuple[str | int, ...]

# A fleet of thousands of nodes is well under 1 MiB; a file 16 times that is a mistake (a log,
# a model file), and reading it whole would be the first of several copies in memory.
MAX_BYTES = 16 * 1024 * 1024
# Anchors and aliases can expand a small file exponentially ("billion laughs"); a real fleet file
# of 10,000 nodes has about 100,000 YAML nodes.
MAX_NODES = 1_000_000
MAX_DEPTH = 64
# A number in a fleet file is a port, a count, a size or a timeout: 40 characters hold any of
# them. Longer is refused before it is converted (Python's int() refuses 4,301 digits with a
# ValueError, and a float of 5,000 digits is inf).
MAX_NUMBER_CHARS = 40


@dataclass(frozen=True, slots=True)
class Document:
    """A parsed fleet file. `marks` holds the range of each value by its YAML path, `key_marks`
    the range of the key that introduced it. Both are worked out on first use (_Marks): a valid
    file of 10,000 nodes never needs them, and recording a range for each of its 100,000 values
    was a third of reading it."""

    filename: str
    text: str
    data: Any
    _lazy: _Marks = field(repr=False, compare=False)

    @property
    def marks(self) -> dict[YamlPath, tuple[Pos, Pos]]:
        return self._lazy.tables()[0]

    @property
    def key_marks(self) -> dict[YamlPath, tuple[Pos, Pos]]:
        return self._lazy.tables()[1]

    def range(self, path: YamlPath, *, key: bool = False) -> SourceRange | None:
        """The range of the value at `path` (or of its key); the nearest enclosing one if absent."""
        marks, key_marks = self._lazy.tables()
        table = key_marks if key else marks
        p = tuple(path)
        while True:
            if p in table:
                start, end = table[p]
                return SourceRange(self.filename, start, end)
            if p in marks:
                start, end = marks[p]
                return SourceRange(self.filename, start, end)
            if not p:
                return None
            p = p[:-1]

    @classmethod
    def parsed(cls, filename: str, text: str, data: Any) -> Document:
        """The document `text` parsed to `data`; its marks are worked out from the text when asked."""
        return cls(filename, text, data, _Marks(text, filename))


class _Marks:
    """The ranges of a document's values and keys, recorded by composing its text again and
    walking the nodes the way the values were built (so each path names the same node), once,
    when first asked. The text is kept rather than the nodes: ~260,000 objects at 10,000 nodes
    that every later full collection would walk again."""

    def __init__(self, text: str, filename: str) -> None:
        self._text: str | None = text
        self._filename = filename
        self._tables: tuple[dict[YamlPath, tuple[Pos, Pos]], dict[YamlPath, tuple[Pos, Pos]]] = ({}, {})

    def tables(self) -> tuple[dict[YamlPath, tuple[Pos, Pos]], dict[YamlPath, tuple[Pos, Pos]]]:
        if self._text is not None:
            from reconciler.fleetfile.yamltree import marks  # PyYAML (~15 ms of start-up): only a file with problems asks

            self._tables, self._text = marks(self._text, self._filename), None
        return self._tables


def offset_pos(text: bytes, offset: int) -> Pos:
    line = text.count(b"\n", 0, offset) + 1
    column = offset - (text.rfind(b"\n", 0, offset) + 1) + 1
    return Pos(line, column)


def read_file(path: str | Path) -> tuple[str | None, list[Diagnostic]]:
    """The file's text, or a diagnostic saying in plain words why there is none."""
    p = Path(path)
    name = str(path)
    try:
        if p.is_dir():
            return None, [error("config_is_directory", f"{name} is a directory, not a fleet file",
                                "Give the fleet file itself, for example -f fleet.yaml.")]
        size = p.stat().st_size
        if size > MAX_BYTES:
            return None, [error(
                "config_too_large",
                f"{name} is {size / 1048576:.1f} MiB; a fleet file may be at most {MAX_BYTES // 1048576} MiB",
                "Is this the right file? A fleet of thousands of nodes fits in well under 1 MiB.")]
        with p.open("rb") as f:  # bounded: a pipe (`-f <(...)`) or a device has no size to check first
            raw = f.read(MAX_BYTES + 1)
        if len(raw) > MAX_BYTES:
            return None, [error(
                "config_too_large", f"{name} holds more than {MAX_BYTES // 1048576} MiB; a fleet file may be at "
                f"most {MAX_BYTES // 1048576} MiB", "Is this the right file? A fleet of thousands of nodes fits in "
                "well under 1 MiB.")]
    except FileNotFoundError:
        return None, [error("config_not_found", f"no such file: {name}",
                            "Give the fleet file with -f FILE (default: fleet.yaml in the current directory).")]
    except PermissionError:
        return None, [error("config_unreadable", f"permission denied reading {name}")]
    except OSError as exc:
        return None, [error("config_unreadable", f"cannot read {name}: {exc.strerror or exc}")]
    raw = raw[len(b"\xef\xbb\xbf"):] if raw.startswith(b"\xef\xbb\xbf") else raw
    nul = raw.find(b"\x00")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        nul = exc.start if nul < 0 else min(nul, exc.start)
        text = None
    if nul >= 0 or text is None:
        where = offset_pos(raw, nul)
        return None, [error("config_not_text",
                            f"{name} is not a UTF-8 text file (byte {nul} at line {where.line}, column {where.column})",
                            "A fleet file is YAML text. Is this a model or archive file?",
                            range=SourceRange(name, where, where))]
    return text, []


def parse(text: str, filename: str) -> tuple[Document | None, list[Diagnostic]]:
    """YAML text → Document. Syntax errors and duplicate keys are diagnostics with their place."""
    # PyYAML (~15 ms of every start) is imported here: a file validated before (desiredcache.py) is not parsed.
    from reconciler.fleetfile import yamltree

    # The node tree and the values are ~200,000 objects at 10,000 nodes, none in a cycle: the
    # cyclic collector, run again and again over the growing tree, took half the composing time.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return yamltree.parse(text, filename)
    finally:
        if collecting:
            gc.enable()
