"""The `fleet` command: parses the arguments (reconciler/cli/arguments.py), runs one command, and ends
with the exit code of the contract (reconciler/cli/exitcodes.py); with --json, every ending prints one
JSON document on stdout, usage errors and bugs included."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Sequence

from wire.command_line import UsageError, json_asked

from reconciler.cli.arguments import build_parser, config_path
from reconciler.cli.exitcodes import Exit

__all__ = ["build_parser", "main", "run"]


def cmd_validate(args: argparse.Namespace) -> int:
    from reconciler.fleetfile import config
    from reconciler.cli.render import JSON_FORMAT_VERSION, console, diagnostics_json, print_diagnostics

    path = config_path(args)
    loaded = config.load(path)
    errors = sum(1 for d in loaded.diagnostics if d.is_error)
    warnings = len(loaded.diagnostics) - errors
    valid = loaded.ok
    if args.json:
        print(json.dumps({"format_version": JSON_FORMAT_VERSION, "valid": valid, "error_count": errors,
                          "warning_count": warnings, "diagnostics": diagnostics_json(loaded.diagnostics)},
                         indent=2))
    else:
        print_diagnostics(console(stderr=True), loaded.diagnostics, loaded.text)
        if valid:
            d = loaded.desired
            assert d is not None
            summary = (f"{path} is valid: {len(d.nodes)} nodes, {len(d.models)} models, "
                       f"{len(d.replicas)} replicas, {len(d.clusters)} clusters")
            if warnings:
                summary += f" ({warnings} warning{'s' if warnings != 1 else ''})"
            console(stderr=False).print(f"[green]✓[/] {summary}")
        else:
            console(stderr=True).print(
                f"[red]✗[/] {path}: {errors} error{'s' if errors != 1 else ''}"
                + (f", {warnings} warning{'s' if warnings != 1 else ''}" if warnings else ""))
    return Exit.OK if valid else Exit.INVALID_CONFIG


def cmd_completion(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    sys.stdout.write(shellcode(["fleet"], shell=args.shell))
    return Exit.OK


def _dispatch(args: argparse.Namespace) -> int:
    name: str = args.command
    if name == "validate":
        return cmd_validate(args)
    if name == "completion":
        return cmd_completion(args)
    if name == "demo":
        from reconciler.cli.demo import cmd_demo  # imported on use: the demo pulls in nothing the other commands need

        return cmd_demo(args)
    if name in ("unlock", "nodes", "alerts"):  # the state directory's tables: nothing of plan's
        from reconciler.cli import statecmds

        if name == "unlock":
            return statecmds.cmd_unlock(args)
        return int(getattr(statecmds, f"cmd_{name}")(args, config_path(args)))
    from reconciler.cli import commands

    return int(getattr(commands, f"cmd_{name}")(args, config_path(args)))


def _usage_error(exc: UsageError, argv: Sequence[str]) -> int:
    if json_asked(argv):
        from reconciler.cli.outcome import error_document, print_json

        print_json(error_document(exc.prog, Exit.USAGE, "usage", exc.message, hint=exc.hint))
    sys.stderr.write(exc.text())
    return Exit.USAGE


def run(argv: Sequence[str] | None = None) -> int:
    """Parse and run one command; its exit code. Usage errors and a command's Failure are answered
    here (text on stderr, or the error document on stdout under --json); bugs propagate to main."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except UsageError as exc:
        return _usage_error(exc, argv)
    if args.command is None:  # bare `fleet`: the help, and the usage code (nothing was done)
        parser.print_help(sys.stderr)
        return Exit.USAGE
    from reconciler.cli.outcome import Failure

    try:
        return _dispatch(args)
    except Failure as failure:
        failure.show(as_json=bool(getattr(args, "json", False)), command=f"fleet {args.command}")
        return failure.exit


def _last_words(argv: Sequence[str], code: str, exit: Exit, message: str) -> None:
    """What a --json caller gets when the command died before it could answer."""
    if json_asked(argv):
        from reconciler.cli.outcome import error_document, print_json

        command = next((f"fleet {a}" for a in argv if not a.startswith("-")), "fleet")
        try:
            print_json(error_document(command, exit, code, message))
        except OSError:
            pass  # stdout itself is gone (a closed pipe): the exit code is all that is left


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "_ARGCOMPLETE" in os.environ:  # the shell asks for completions: answer them and exit
        import argcomplete

        argcomplete.autocomplete(build_parser())
    try:
        code = run(args)
    except KeyboardInterrupt:
        print("\nfleet: interrupted", file=sys.stderr)
        _last_words(args, "interrupted", Exit.INTERRUPTED, "interrupted (Ctrl-C)")
        code = Exit.INTERRUPTED
    except BrokenPipeError:
        # The reader of stdout left (`fleet plan | head`): point stdout at /dev/null so that the
        # flush at exit does not fail a second time (the Python documentation's recipe).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = Exit.FAILURE
    except Exception as exc:  # a bug: say so plainly; the traceback only when asked for
        if os.environ.get("FLEET_DEBUG"):
            traceback.print_exc()
        message = f"internal error: {type(exc).__name__}: {exc}"
        print(f"fleet: {message}\nThis is a bug in fleet. Run again with FLEET_DEBUG=1 for the traceback and "
              "report it.", file=sys.stderr)
        _last_words(args, "internal_error", Exit.FAILURE, message)
        code = Exit.FAILURE
    sys.exit(code)
