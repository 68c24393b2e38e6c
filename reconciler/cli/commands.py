"""`fleet observe`, `plan`, `apply`, `serve`: load, observe, plan, show, execute, and exit codes;
under --json one document on stdout whatever happens (a refusal is a Failure: reconciler/cli/outcome.py).
(`nodes`, `alerts` and `unlock` read the state directory: reconciler/cli/statecmds.py.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from reconciler.fleetfile import config
from reconciler.agents.client import AgentClient
from reconciler.core.diagnostics import Diagnostic, error
from reconciler.cli.exitcodes import Exit
from reconciler.core.desired import Desired
from reconciler.cache.desired import DesiredCache
from reconciler.cache.observed import ObservationCache
from reconciler.agents.observe import kept_to_the_end, observe
from reconciler.core.observed import Observed, from_snapshot
from reconciler.cli.outcome import Failure, print_json
from reconciler.planning.plan import Plan
from reconciler.planning.planner import plan as make_plan
from reconciler.cli.render import JSON_FORMAT_VERSION, console, print_diagnostics, print_lines, print_plan, result_line

if TYPE_CHECKING:
    from reconciler.applying.drain import Drainer
    from reconciler.applying.execute import Result
    from reconciler.state.store import ApplyLedger
# What only apply and serve use (the executor, its progress, the state store, saved plans) is
# imported where they use it: 0.025-0.03 s of every plan's start.


def _load(path: str) -> config.Loaded:
    cache = DesiredCache.for_file(path, _warn)
    loaded = config.load(path) if cache is None else cache.load(path)
    if not loaded.ok:
        errors = sum(1 for d in loaded.diagnostics if d.is_error)
        raise Failure(Exit.INVALID_CONFIG, "invalid_config",
                      f"{path} is not valid ({errors} error{'s' if errors != 1 else ''}): run `fleet validate -f "
                      f"{path}`", loaded.diagnostics, source_text=loaded.text)
    return loaded


def _secret() -> str:
    secret = os.environ.get("FLEET_CLUSTER_SECRET", "")
    if len(secret.encode()) < 16:
        raise Failure(Exit.INVALID_CONFIG, "no_cluster_secret",
                      "FLEET_CLUSTER_SECRET is not set (or shorter than 16 bytes): the control plane needs the "
                      "cluster secret its agents were started with")
    return secret


async def _observe(desired: Desired, timeout: float, secret: str, cache: ObservationCache | None = None) -> Observed:
    """Every agent asked; with a cache, those whose state it holds asked for news only (obscache.py)."""
    held = cache.load(desired) if cache is not None else {}
    bare: set[str] = set()  # agents from before fleet-live: asked plainly from the next run on
    async with AgentClient(secret, timeout=timeout) as client:
        seen = await observe(desired, client, timeout=timeout, held=held, bring_up=True, bare=bare)
    if cache is not None:
        cache.save(desired, seen, held, bare)
    return seen


def _warn(message: str) -> None:
    from rich.markup import escape  # rich is imported by what prints for people (render.py)

    console(stderr=True).print(f"[yellow]warning:[/] {escape(message)}")


def _cache(loaded: config.Loaded) -> ObservationCache | None:
    return ObservationCache.for_file(loaded.filename, _warn)


def _write(path: str, text: str, what: str) -> None:
    try:
        Path(path).write_text(text + "\n")
    except OSError as exc:
        raise Failure(Exit.INVALID_CONFIG, "cannot_write", f"cannot write {what} to {path}: {exc}") from None


def cmd_observe(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    assert loaded.desired is not None
    observed = trio.run(_observe, loaded.desired, args.timeout, _secret(), _cache(loaded))
    text = json.dumps(observed.to_snapshot(), indent=2)
    if args.out:
        _write(args.out, text, "the snapshot")
        bad = [n for n, o in observed.nodes.items() if not o.ok]
        console(stderr=True).print(f"observed {len(observed.nodes)} nodes into {args.out}"
                                   + (f"; no answer from {', '.join(bad)}" if bad else ""))
    else:
        print(text)
    return Exit.OK


def _plan(loaded: config.Loaded, args: argparse.Namespace) -> Plan:
    assert loaded.desired is not None
    if getattr(args, "observed", None):
        try:
            observed = from_snapshot(json.loads(Path(args.observed).read_text()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise Failure(Exit.INVALID_CONFIG, "unreadable_snapshot",
                          f"cannot read the snapshot {args.observed}: {exc}") from None
    else:
        with kept_to_the_end():
            observed = trio.run(_observe, loaded.desired, args.timeout, _secret(), _cache(loaded))
    warnings = tuple(d for d in loaded.diagnostics if not d.is_error)
    with kept_to_the_end():  # the plan too lives until the command ends
        p = make_plan(loaded.desired, observed, targets=tuple(args.target or ()),
                      config_digest=loaded.digest or "", config_file=loaded.filename)
    return replace(p, diagnostics=warnings + p.diagnostics)  # the planner's plan, the file's warnings first


def plan_json(document: dict[str, Any]) -> str:
    """The plan document as JSON, indented to its second level and each change (fingerprint,
    diagnostic) on a line of its own: json's indenting encoder is pure Python, 0.23 s of CPU for
    10,000 changes against 0.06 s for its C one, which only writes compact JSON."""
    def member(value: Any) -> str:
        if isinstance(value, list) and value:
            return "[\n" + ",\n".join(f"    {json.dumps(v)}" for v in value) + "\n  ]"
        if isinstance(value, dict) and value:
            return "{\n" + ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in value.items()) + "\n  }"
        return json.dumps(value)
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {member(v)}" for k, v in document.items()) + "\n}"


def cmd_plan(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    p = _plan(loaded, args)
    if args.out:
        _write(args.out, plan_json(p.to_json()), "the plan")
    code = Exit.PLAN_REFUSED if p.errored else Exit.CHANGES if p.changes and args.detailed_exitcode else Exit.OK
    if args.json:
        print(plan_json(p.to_json()), flush=True)
        return code
    print_plan(console(stderr=False), p)  # a refused plan prints nothing here: its errors say it all
    print_diagnostics(console(stderr=True), p.diagnostics, None)
    if p.errored:
        console(stderr=True).print("[red]✗ plan refused:[/] fix the errors above; nothing will be applied.")
    elif args.out:
        console(stderr=True).print(f"saved to {args.out}: apply exactly this plan with `fleet apply {args.out}`")
    return code


def _stale(saved: Plan, loaded: config.Loaded, args: argparse.Namespace) -> tuple[list[Diagnostic], Plan]:
    """Why the saved plan may not run now (nothing when it may), and a fresh plan made now against
    the same file, nodes and targets: the saved plan runs only if its changes are exactly the fresh one's."""
    from reconciler.applying import planfile

    reasons = []
    fresh = _plan(loaded, argparse.Namespace(**{**vars(args), "observed": None, "target": list(saved.targets)}))
    for node in sorted(saved.touched_nodes() | set(saved.fingerprints)):
        before, now = saved.fingerprints.get(node), fresh.fingerprints.get(node)
        if before != now:
            reasons.append(error("stale_plan", f"node {node!r} changed since the plan was made (its models or "
                                 "servers differ" + (", or it does not answer now)" if now is None else ")"),
                                 planfile.REMAKE, address=f"node.{node}"))
    return reasons + planfile.differences(saved, fresh), fresh


def cmd_apply(args: argparse.Namespace, path: str) -> int:
    from reconciler.applying.drain import Drainer
    from reconciler.state.sql import StateError
    from reconciler.state.store import LockHeld
    from reconciler.cli.statecmds import open_store

    loaded = _load(path)
    if args.planfile and getattr(args, "target", None):
        raise Failure(Exit.USAGE, "usage", "--target does not go with a saved plan: it applies the targets "
                      "it was made with", hint="make the plan with them: fleet plan --target ADDRESS -o FILE")
    saved = _read_plan(args.planfile, loaded) if args.planfile else None
    # The lock covers planning too: two applies planning at once would both plan the same work.
    with open_store(args.state_dir, getattr(args, "state", None),
                    loaded.desired.control_plane.state if loaded.desired else None) as store:
        ledger = store.applies
        try:
            lock, taken = ledger.acquire(" ".join(["fleet", *sys.argv[1:]]))
        except LockHeld as exc:
            raise Failure(Exit.LOCKED, "lock_held", str(exc),
                          hint=f"if that process is gone for good: fleet unlock {exc.holder.id}") from None
        if taken is not None:
            console(stderr=True).print(f"[yellow]warning:[/] took over the lock of a process that is gone: "
                                       f"{taken.describe()}")
        try:
            return _apply_locked(loaded, args, ledger, Drainer(store.drains, lock.id), saved)
        except StateError as exc:  # a shared store lost mid-apply (state_pg.py)
            raise Failure(Exit.INVALID_CONFIG, exc.code, str(exc), hint=exc.hint or "") from None
        finally:
            ledger.release(lock.id)


def _read_plan(path: str, loaded: config.Loaded) -> Plan:
    """The saved plan, checked before the lock is taken and anything runs: its schema, the nodes it
    names, its dependency graph (a cycle would wait forever, holding the lock)."""
    from reconciler.applying import planfile

    assert loaded.desired is not None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
        raise Failure(Exit.INVALID_CONFIG, "unreadable_plan", f"cannot read the saved plan {path}: {exc}",
                      hint="make one with: fleet plan -o FILE") from None
    # The nodes it names are checked against the file it was made from; made from another, it is stale.
    same_file = isinstance(data, dict) and data.get("config_digest") == loaded.digest
    problems = planfile.check(data, loaded.desired.nodes if same_file else None)
    if [d.code for d in problems] == ["plan_errored"]:  # refused when made: refused now, as `fleet plan` was
        raise Failure(Exit.PLAN_REFUSED, "plan_errored", f"the saved plan {path} was refused when it was made; "
                      "nothing was applied", problems, hint="fix what refused it, then: fleet plan -o FILE")
    if problems:
        raise Failure(Exit.INVALID_CONFIG, "invalid_plan", f"the saved plan {path} is not a valid plan "
                      f"({len(problems)} error{'s' if len(problems) != 1 else ''}); nothing was applied", problems,
                      hint="make one with: fleet plan -o FILE")
    saved = Plan.from_json(data)
    if not same_file:
        raise Failure(Exit.STALE_PLAN, "stale_plan", f"the saved plan {path} is stale; nothing was applied", [error(
            "stale_plan", f"{loaded.filename} changed since the plan was made (config digest "
            f"{saved.config_digest[:19]}… → {(loaded.digest or '')[:19]}…)", planfile.REMAKE)])
    return saved


def _saved_plan(saved: Plan, loaded: config.Loaded, args: argparse.Namespace) -> Plan:
    reasons, fresh = _stale(saved, loaded, args)
    if reasons:
        raise Failure(Exit.STALE_PLAN, "stale_plan", f"the saved plan {args.planfile} is stale; nothing was applied",
                      reasons)
    # The same changes: the fresh plan's diagnostics are the ones that hold now (a file's are text).
    return fresh


def _confirm() -> str | None:
    """Ask on the terminal; None for 'yes', else why not. The question goes to stderr, so that
    stdout keeps nothing but the plan (or, under --json, the document)."""
    if not sys.stdin.isatty():
        raise Failure(Exit.USAGE, "confirmation_needed", "apply needs confirmation, and there is no terminal to "
                      "ask on", hint="pass --auto-approve, or apply a saved plan (fleet plan -o FILE; fleet apply FILE)")
    sys.stdout.flush()
    sys.stderr.write("\nApply these changes? Only 'yes' is accepted: ")
    sys.stderr.flush()
    answer = sys.stdin.readline()
    if not answer:
        return "the input ended (Ctrl-D) before an answer"
    if answer.strip() != "yes":
        return f"the answer was {answer.strip()!r}, not 'yes'"
    return None


def _apply_locked(loaded: config.Loaded, args: argparse.Namespace, ledger: ApplyLedger,
                  drains: Drainer | None = None, saved: Plan | None = None) -> int:
    from rich.markup import escape  # rich is imported by what prints for people (render.py)

    err = console(stderr=True)
    people = console(stderr=args.json)  # under --json, stdout carries the document alone
    p = _saved_plan(saved, loaded, args) if saved is not None else _plan(loaded, args)
    print_plan(people, p)
    print_diagnostics(err, p.diagnostics, None)
    if p.errored:
        err.print("[red]✗ plan refused:[/] fix the errors above; nothing was applied.")
        return _applied(args, p, "refused", Exit.PLAN_REFUSED, "plan refused: nothing was applied")
    if not p.changes:
        return _applied(args, p, "no_changes", Exit.OK, "no changes: the fleet matches the configuration")
    if not args.planfile and not args.auto_approve:
        declined = _confirm()
        if declined is not None:
            err.print(f"\n[yellow]✗[/] Apply cancelled: {escape(declined)}; nothing changed.")
            return _applied(args, p, "cancelled", Exit.CANCELLED, f"apply cancelled: {declined}; nothing changed")
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    desired = loaded.desired
    assert desired is not None
    ledger.confirm()  # still the lock's holder after the question (a shared store's session may have ended)
    results = trio.run(_execute, desired, p, args, _secret(), drains)
    ledger.record_apply(started, p.config_digest, p.summary(), [asdict(r) for r in results])
    print_lines(people, [result_line(r) for r in results])
    failed = [r for r in results if r.status != "done"]
    if failed:
        err.print(f"[red]✗ {len(failed)} of {len(results)} actions did not complete.[/] Run `fleet apply` "
                  "again once the causes above are fixed: it converges.")
        return _applied(args, p, "failed", Exit.APPLY_FAILED,
                        f"{len(failed)} of {len(results)} actions did not complete", results)
    people.print(f"[green]Apply complete:[/] {len(results)} actions.")
    return _applied(args, p, "applied", Exit.OK, f"apply complete: {len(results)} actions", results)


def _applied(args: argparse.Namespace, p: Plan, outcome: str, code: Exit, message: str,
             results: list[Result] | None = None) -> int:
    """The apply document (schemas/apply.schema.json) under --json; the exit code either way."""
    if args.json:
        print_json({"format_version": JSON_FORMAT_VERSION, "outcome": outcome, "exit_code": int(code),
                    "message": message, "plan": p.to_json(), "results": [asdict(r) for r in results or ()]})
    return code


async def _execute(desired: Desired, p: Plan, args: argparse.Namespace, secret: str,
                   drains: Drainer | None = None) -> list[Result]:
    from reconciler.applying.execute import Executor
    from reconciler.applying.progress import ApplyProgress

    with ApplyProgress(console(stderr=True)) as progress:
        async with AgentClient(secret, timeout=args.timeout) as client:
            return await Executor(desired, client, parallelism=args.parallelism, progress=progress,
                                  drains=drains).run(p)


def cmd_serve(args: argparse.Namespace, path: str) -> int:
    import logging

    from reconciler.serve.run import ServeRefused, serve
    from reconciler.state.pg import SharedStore
    from reconciler.cli.statecmds import open_store

    loaded = _load(path)
    desired = loaded.desired
    assert desired is not None
    logging.basicConfig(level=logging.INFO, format="fleet serve: %(message)s", stream=sys.stderr)
    secret = _secret()
    store = open_store(args.state_dir, getattr(args, "state", None), desired.control_plane.state)
    try:
        trio.run(lambda: serve(desired, secret, store.serve, interval=args.interval, misses=args.misses,
                               timeout=args.timeout, drains=store.drains,
                               shared=store if isinstance(store, SharedStore) else None))
    except ServeRefused as exc:
        raise Failure(Exit.INVALID_CONFIG, "serve_refused", str(exc)) from None
    except OSError as exc:
        # Like fleet-agent's port in use: the environment makes serving pointless (exit 3, said why).
        raise Failure(Exit.INVALID_CONFIG, "cannot_listen", f"cannot listen on {desired.control_plane.listen}: "
                      f"{exc.strerror or exc}") from None
    finally:
        store.close()
    return Exit.OK
