"""Diagnostics: user problems as values with a stable code and a place, returned, never raised."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Pos:
    """A position in a source file; line and column are 1-based."""

    line: int
    column: int

    def to_json(self) -> dict[str, int]:
        return {"line": self.line, "column": self.column}


@dataclass(frozen=True, slots=True)
class SourceRange:
    filename: str
    start: Pos
    end: Pos

    def to_json(self) -> dict[str, Any]:
        return {"filename": self.filename, "start": self.start.to_json(), "end": self.end.to_json()}

    def __str__(self) -> str:
        return f"{self.filename}:{self.start.line}:{self.start.column}"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    """One problem. `code` is a stable string and part of the interface; `address` is a YAML path
    such as `clusters.chat.members[1]` (empty for the file as a whole)."""

    severity: Severity
    code: str
    summary: str
    detail: str = ""
    address: str = ""
    range: SourceRange | None = None

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def to_json(self) -> dict[str, Any]:
        return {
            "severity": self.severity.value,
            "code": self.code,
            "summary": self.summary,
            "detail": self.detail,
            "address": self.address,
            "range": self.range.to_json() if self.range else None,
        }


def error(code: str, summary: str, detail: str = "", address: str = "",
          range: SourceRange | None = None) -> Diagnostic:
    return Diagnostic(Severity.ERROR, code, summary, detail, address, range)


def warning(code: str, summary: str, detail: str = "", address: str = "",
            range: SourceRange | None = None) -> Diagnostic:
    return Diagnostic(Severity.WARNING, code, summary, detail, address, range)


def has_errors(diags: list[Diagnostic] | tuple[Diagnostic, ...]) -> bool:
    return any(d.is_error for d in diags)


def format_path(path: tuple[str | int, ...]) -> str:
    """('clusters', 'chat', 'members', 1) -> 'clusters.chat.members[1]'."""
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out:
            out += f".{part}"
        else:
            out = str(part)
    return out
