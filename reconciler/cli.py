"""The `fleet` command: parses arguments, calls the core, prints, and sets the exit code."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from typing import Callable, Sequence

from . import __version__, config
from .exitcodes import Exit
from .render import JSON_FORMAT_VERSION, console, diagnostics_json, print_diagnostics

DEFAULT_CONFIG = "fleet.yaml"

EXIT_CODES_HELP = """exit codes (the same for every command):
  0  success; for plan: no changes        4  plan refused: at least one plan error
  1  unexpected failure                   5  another apply holds the lock
  2  plan --detailed-exitcode: changes    6  saved plan is stale
  3  invalid configuration                7  apply ran and some actions failed"""


def _config_path(args: argparse.Namespace) -> str:
    return args.file or getattr(args, "path", None) or os.environ.get("FLEET_CONFIG") or DEFAULT_CONFIG


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", nargs="?", metavar="FILE", help=argparse.SUPPRESS)
    p.add_argument("-f", "--file", metavar="FILE",
                   help=f"the fleet file (default: $FLEET_CONFIG, else ./{DEFAULT_CONFIG})")


def cmd_validate(args: argparse.Namespace) -> int:
    path = _config_path(args)
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


def _commands(name: str) -> Callable[[argparse.Namespace], int]:
    def run_command(args: argparse.Namespace) -> int:
        from . import commands, tables

        try:
            if name == "unlock":
                return tables.cmd_unlock(args)
            module = tables if name in ("nodes", "alerts") else commands
            return int(getattr(module, f"cmd_{name}")(args, _config_path(args)))
        except commands.Stop as stop:
            return stop.code
    return run_command


def _demo(args: argparse.Namespace) -> int:
    from .demo import cmd_demo  # imported on use: the demo pulls in nothing the other commands need

    return cmd_demo(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fleet",
        description="Declarative reconciler for fleets of GPU inference machines. Describe nodes, "
                    "models, replicas and clusters in fleet.yaml; fleet checks it, plans the changes "
                    "against what the node agents report, and applies them.",
        epilog=EXIT_CODES_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"fleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("validate", help="check a fleet file offline (schema and references)",
                       description="Check a fleet file without contacting any node: the JSON Schema "
                                   "(schemas/fleet.schema.json), then references and conflicts. "
                                   "Exit 0 when valid (warnings allowed), 3 when not.",
                       epilog="example:\n  fleet validate -f fleet.yaml --json > validate.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    p.set_defaults(func=cmd_validate)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("-f", "--file", metavar="FILE",
                       help=f"the fleet file (default: $FLEET_CONFIG, else ./{DEFAULT_CONFIG})")
        p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                       help="seconds each agent may take to answer (default 10)")

    p = sub.add_parser("observe", help="record what every agent reports, for planning offline",
                       description="Ask every node's agent for its state and write a snapshot that "
                                   "`fleet plan --observed FILE` plans against with no network.")
    common(p)
    p.add_argument("-o", "--out", metavar="FILE", help="write the snapshot here (default: stdout)")
    p.set_defaults(func=_commands("observe"))

    p = sub.add_parser("plan", help="diff fleet.yaml against the agents and print the ordered plan",
                       description="Observe every node, diff against the fleet file and print the plan. "
                                   "Exit 0: no changes; 2 (with --detailed-exitcode): changes; 3: invalid "
                                   "file; 4: plan refused by errors.",
                       epilog="CI:\n  fleet plan --detailed-exitcode --json -o plan.json > plan-output.json",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    common(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (schemas/plan.schema.json)")
    p.add_argument("-o", "--out", metavar="PLANFILE", help="save the plan; `fleet apply PLANFILE` applies exactly it")
    p.add_argument("--observed", metavar="SNAPSHOT", help="plan against a snapshot from `fleet observe -o`")
    p.add_argument("--detailed-exitcode", action="store_true", help="exit 2 when there are changes")
    p.add_argument("--target", action="append", metavar="ADDRESS",
                   help="limit the plan to this address and what it depends on (repeatable)")
    p.set_defaults(func=_commands("plan"))

    p = sub.add_parser("apply", help="carry out the plan (or a saved one)",
                       description="Plan and apply, or apply a saved plan after checking that neither the "
                                   "fleet file nor any node it touches changed (exit 6 if they did). Exit 7 "
                                   "when some actions failed; running again converges.")
    common(p)
    p.add_argument("planfile", nargs="?", metavar="PLANFILE", help="a plan saved by `fleet plan -o`")
    p.add_argument("--auto-approve", action="store_true", help="do not ask for confirmation")
    p.add_argument("--parallelism", type=int, default=10, metavar="N", help="independent actions at once (10)")
    p.add_argument("--target", action="append", metavar="ADDRESS", help="limit the plan (repeatable)")
    p.add_argument("--state-dir", metavar="DIR", help="where the lock and history live "
                                                      "(default: $FLEET_STATE_DIR or the user state dir)")
    p.set_defaults(func=_commands("apply"))

    p = sub.add_parser("serve", help="run the control plane: heartbeat, alerts and the client router",
                       description="Poll every agent on an interval, keep node status, server rows and "
                                   "node_offline alerts in the store, and serve OpenAI-compatible client "
                                   "traffic on control_plane.listen, relayed to a running member.")
    common(p)
    p.add_argument("--state-dir", metavar="DIR", help="the store (default: $FLEET_STATE_DIR or the user state dir)")
    p.add_argument("--interval", type=float, default=30.0, metavar="S", help="seconds between heartbeats (30)")
    p.add_argument("--misses", type=int, default=2, metavar="N",
                   help="missed beats before a node_offline alert (2)")
    p.set_defaults(func=_commands("serve"))

    p = sub.add_parser("nodes", help="one line per node, from the store `fleet serve` keeps")
    p.add_argument("-f", "--file", metavar="FILE", help=argparse.SUPPRESS)
    p.add_argument("--wide", action="store_true", help="add address, identity, version, variant, windows and "
                                                       "every failure reason in full")
    p.add_argument("--json", action="store_true")
    p.add_argument("--state-dir", metavar="DIR")
    p.set_defaults(func=_commands("nodes"))

    p = sub.add_parser("alerts", help="open alerts (--all: cleared ones too)")
    p.add_argument("-f", "--file", metavar="FILE", help=argparse.SUPPRESS)
    p.add_argument("--all", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--state-dir", metavar="DIR")
    p.set_defaults(func=_commands("alerts"))

    p = sub.add_parser("demo", help="run fleet's whole job on this machine: agents, models, plan, apply, serve",
                       description="Start three real agents on loopback addresses, make tiny real models, "
                                   "write and show a fleet file, plan, apply, serve, and stream an answer "
                                   "through the control plane. Needs no network and no GPU. Stops every "
                                   "process it started; writes only under its directory.")
    p.add_argument("--dir", metavar="DIR", help="keep everything in DIR (default: a temporary directory, removed)")
    p.add_argument("--first-address", default="127.0.0.2", metavar="ADDR",
                   help="the first of three consecutive loopback addresses (default 127.0.0.2)")
    p.set_defaults(func=_demo)

    p = sub.add_parser("unlock", help="release an apply lock whose holder is gone for good")
    p.add_argument("lock_id", metavar="ID", help="the lock id printed by the refused apply")
    p.add_argument("--state-dir", metavar="DIR", help="where the lock lives")
    p.set_defaults(func=_commands("unlock"))
    return parser


def run(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func: Callable[[argparse.Namespace], int] | None = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return Exit.FAILURE
    return int(func(args))


def main(argv: Sequence[str] | None = None) -> None:
    try:
        code = run(argv)
    except KeyboardInterrupt:
        print("fleet: interrupted", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        code = Exit.FAILURE
    except Exception as exc:  # a bug: say so plainly; the traceback only when asked for
        if os.environ.get("FLEET_DEBUG"):
            traceback.print_exc()
        print(f"fleet: internal error: {type(exc).__name__}: {exc}\n"
              "This is a bug in fleet. Run again with FLEET_DEBUG=1 for the traceback and report it.",
              file=sys.stderr)
        code = Exit.FAILURE
    sys.exit(code)
