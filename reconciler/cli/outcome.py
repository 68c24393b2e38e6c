"""How a command ends when it cannot do its job: a Failure (exit code, stable code, message,
diagnostics), shown to people as text on stderr or to machines as the error document
(schemas/error.schema.json) on stdout."""

from __future__ import annotations

import json
from typing import Any, Sequence

from wire.command_line import error_document as wire_error_document

from reconciler.core.diagnostics import Diagnostic
from reconciler.cli.render import console, diagnostics_json, print_diagnostics


class Failure(Exception):
    """End the command with `exit` (reconciler/cli/exitcodes.py). `code` is stable (invalid_config,
    lock_held, stale_plan, ...); `diagnostics` are the problems behind it, `source_text` the fleet
    file they point into."""

    def __init__(self, exit: int, code: str, message: str, diagnostics: Sequence[Diagnostic] = (),
                 *, hint: str = "", source_text: str | None = None) -> None:
        super().__init__(message)
        self.exit, self.code, self.message, self.hint = exit, code, message, hint
        self.diagnostics, self.source_text = tuple(diagnostics), source_text

    def document(self, command: str) -> dict[str, Any]:
        return error_document(command, self.exit, self.code, self.message, self.diagnostics, self.hint)

    def show(self, *, as_json: bool, command: str) -> None:
        """The error document on stdout under --json; for people, on stderr, either way (a CI log
        shows why without opening the document)."""
        from rich.markup import escape  # here: a command that ends well under --json loads no rich

        if as_json:
            print_json(self.document(command))
        err = console(stderr=True)
        print_diagnostics(err, self.diagnostics, self.source_text)
        err.print(f"[red]✗[/] {escape(self.message)}")
        if self.hint:
            err.print(f"  hint: {self.hint}", markup=False)


def error_document(command: str, exit: int, code: str, message: str, diagnostics: Sequence[Diagnostic] = (),
                   hint: str = "") -> dict[str, Any]:
    return wire_error_document(command, exit, code, message, hint, diagnostics_json(diagnostics))


def print_json(document: Any) -> None:
    print(json.dumps(document, indent=2), flush=True)
