"""How a command ends when it cannot do its job: a Failure (exit code, stable code, message,
diagnostics), shown to people as text on stderr or to machines as the error document
(schemas/error.schema.json) on stdout."""

from __future__ import annotations

import json
from typing import Any, Sequence, TypedDict

from rich.markup import escape

from .diagnostics import Diagnostic
from .render import JSON_FORMAT_VERSION, console, diagnostics_json, print_diagnostics


class ErrorBody(TypedDict):
    code: str
    message: str
    hint: str


class ErrorDocument(TypedDict):
    format_version: str
    command: str
    exit_code: int
    error: ErrorBody
    diagnostics: list[dict[str, Any]]


class Failure(Exception):
    """End the command with `exit` (reconciler/exitcodes.py). `code` is stable (invalid_config,
    lock_held, stale_plan, ...); `diagnostics` are the problems behind it, `source_text` the fleet
    file they point into."""

    def __init__(self, exit: int, code: str, message: str, diagnostics: Sequence[Diagnostic] = (),
                 *, hint: str = "", source_text: str | None = None) -> None:
        super().__init__(message)
        self.exit, self.code, self.message, self.hint = exit, code, message, hint
        self.diagnostics, self.source_text = tuple(diagnostics), source_text

    def document(self, command: str) -> ErrorDocument:
        return error_document(command, self.exit, self.code, self.message, self.diagnostics, self.hint)

    def show(self, *, as_json: bool, command: str) -> None:
        if as_json:
            print_json(self.document(command))
            return
        err = console(stderr=True)
        print_diagnostics(err, self.diagnostics, self.source_text)
        err.print(f"[red]✗[/] {escape(self.message)}")
        if self.hint:
            err.print(f"  hint: {self.hint}", markup=False)


def error_document(command: str, exit: int, code: str, message: str, diagnostics: Sequence[Diagnostic] = (),
                   hint: str = "") -> ErrorDocument:
    return {"format_version": JSON_FORMAT_VERSION, "command": command, "exit_code": int(exit),
            "error": {"code": code, "message": message, "hint": hint},
            "diagnostics": diagnostics_json(diagnostics)}


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2), flush=True)
