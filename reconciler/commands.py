"""`fleet observe`, `plan`, `apply`, `serve`: load, observe, plan, show, execute, and exit codes.
(`nodes`, `alerts` and `unlock` read the state directory: reconciler/tables.py.)"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import trio

from . import config
from .client import AgentClient
from .diagnostics import error
from .execute import Executor, Result
from .exitcodes import Exit
from .model import Desired
from .observe import observe
from .observed import Observed, from_snapshot
from .plan import Plan
from .planner import plan as make_plan
from .render import console, print_diagnostics, print_plan, result_line
from .state_store import ApplyLedger, LockHeld, StateStore, default_state_dir


class Stop(Exception):
    """End the command with this exit code, after the message was printed."""

    def __init__(self, code: int) -> None:
        self.code = code


def _load(path: str) -> config.Loaded:
    loaded = config.load(path)
    if not loaded.ok:
        print_diagnostics(console(stderr=True), loaded.diagnostics, loaded.text)
        console(stderr=True).print(f"[red]✗[/] {path} is not valid: run `fleet validate -f {path}`")
        raise Stop(Exit.INVALID_CONFIG)
    return loaded


def _secret() -> str:
    secret = os.environ.get("FLEET_CLUSTER_SECRET", "")
    if len(secret.encode()) < 16:
        console(stderr=True).print("[red]error:[/] FLEET_CLUSTER_SECRET is not set (or shorter than 16 bytes): "
                                   "the control plane needs the cluster secret its agents were started with")
        raise Stop(Exit.FAILURE)
    return secret


async def _observe(desired: Desired, timeout: float) -> Observed:
    async with AgentClient(_secret(), timeout=timeout) as client:
        return await observe(desired, client, timeout=timeout)


def cmd_observe(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    assert loaded.desired is not None
    observed = trio.run(_observe, loaded.desired, args.timeout)
    text = json.dumps(observed.to_snapshot(), indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
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
        except (OSError, ValueError) as exc:
            console(stderr=True).print(f"[red]error:[/] cannot read the snapshot {args.observed}: {exc}")
            raise Stop(Exit.FAILURE) from None
    else:
        observed = trio.run(_observe, loaded.desired, args.timeout)
    warnings = tuple(d for d in loaded.diagnostics if not d.is_error)
    p = make_plan(loaded.desired, observed, targets=tuple(args.target or ()),
                  config_digest=loaded.digest or "", config_file=loaded.filename)
    return Plan(p.changes, warnings + p.diagnostics, p.config_digest, p.config_file, p.fingerprints, p.targets)


def cmd_plan(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    p = _plan(loaded, args)
    if args.out:
        Path(args.out).write_text(json.dumps(p.to_json(), indent=2) + "\n")
    if args.json:
        print(json.dumps(p.to_json(), indent=2))
    else:
        print_plan(console(stderr=False), p)
        print_diagnostics(console(stderr=True), p.diagnostics, None)
        if args.out and not p.errored:
            console(stderr=True).print(f"saved to {args.out}: apply exactly this plan with `fleet apply {args.out}`")
    if p.errored:
        if not args.json:
            console(stderr=True).print("[red]✗ plan refused:[/] fix the errors above; nothing will be applied.")
        return Exit.PLAN_REFUSED
    if p.changes and args.detailed_exitcode:
        return Exit.CHANGES
    return Exit.OK


def _stale(saved: Plan, loaded: config.Loaded, args: argparse.Namespace) -> list[str]:
    reasons = []
    if saved.config_digest != loaded.digest:
        reasons.append(f"{loaded.filename} changed since the plan was made "
                       f"(config digest {saved.config_digest[:19]}… → {(loaded.digest or '')[:19]}…)")
    fresh = _plan(loaded, argparse.Namespace(**{**vars(args), "observed": None, "target": list(saved.targets)}))
    for node in sorted(saved.touched_nodes() | set(saved.fingerprints)):
        before, now = saved.fingerprints.get(node), fresh.fingerprints.get(node)
        if before != now:
            reasons.append(f"node {node!r} changed since the plan was made (its models or servers differ"
                           + (", or it does not answer now)" if now is None else ")"))
    return reasons


def cmd_apply(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    err = console(stderr=True)
    # The lock covers planning too: two applies planning at once would both plan the same work.
    with StateStore(Path(args.state_dir) if args.state_dir else default_state_dir()) as store:
        ledger = store.applies
        try:
            lock, taken = ledger.acquire(" ".join(["fleet", *sys.argv[1:]]))
        except LockHeld as exc:
            err.print(f"[red]error[lock_held]:[/] {exc}\n  = If that process is gone for good: "
                      f"fleet unlock {exc.holder.id}")
            return Exit.LOCKED
        if taken is not None:
            err.print(f"[yellow]warning:[/] took over the lock of a process that is gone: {taken.describe()}")
        try:
            return _apply_locked(loaded, args, ledger)
        finally:
            ledger.release(lock.id)


def _apply_locked(loaded: config.Loaded, args: argparse.Namespace, ledger: ApplyLedger) -> int:
    err = console(stderr=True)
    if args.planfile:
        try:
            saved = Plan.from_json(json.loads(Path(args.planfile).read_text()))
        except (OSError, ValueError, KeyError) as exc:
            err.print(f"[red]error:[/] cannot read the saved plan {args.planfile}: {exc}")
            return Exit.FAILURE
        reasons = _stale(saved, loaded, args)
        if reasons:
            print_diagnostics(err, [error("stale_plan", r, "Make a new plan: fleet plan -o FILE") for r in reasons],
                              None)
            return Exit.STALE_PLAN
        p = saved
    else:
        p = _plan(loaded, args)
    print_plan(console(stderr=False), p)
    print_diagnostics(err, p.diagnostics, None)
    if p.errored:
        err.print("[red]✗ plan refused:[/] fix the errors above; nothing was applied.")
        return Exit.PLAN_REFUSED
    if not p.changes:
        return Exit.OK
    if not args.planfile and not args.auto_approve:
        if not sys.stdin.isatty():
            err.print("[red]error:[/] apply needs confirmation, and there is no terminal to ask on: pass "
                      "--auto-approve, or apply a saved plan (fleet plan -o FILE; fleet apply FILE)")
            return Exit.FAILURE
        answer = input("\nApply these changes? Only 'yes' is accepted: ")
        if answer.strip() != "yes":
            err.print("Apply cancelled; nothing changed.")
            return Exit.OK
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    desired = loaded.desired
    assert desired is not None
    results = trio.run(_execute, desired, p, args)
    ledger.record_apply(started, p.config_digest, p.summary(), [asdict(r) for r in results])
    out = console(stderr=False)
    for r in results:
        out.print(result_line(r))
    failed = [r for r in results if r.status != "done"]
    if failed:
        err.print(f"[red]✗ {len(failed)} of {len(results)} actions did not complete.[/] Run `fleet apply` "
                  "again once the causes above are fixed: it converges.")
        return Exit.APPLY_FAILED
    console(stderr=False).print(f"[green]Apply complete:[/] {len(results)} actions.")
    return Exit.OK


async def _execute(desired: Desired, p: Plan, args: argparse.Namespace) -> list[Result]:
    out = console(stderr=True)

    def progress(event: str, data: dict[str, Any]) -> None:
        if event == "started":
            out.print(f"  … {data['change'].action.value} {data['change'].address}")
        elif event == "retry":
            out.print(f"  ↻ {data['change'].action.value} {data['change'].address}: retry {data['attempt']} "
                      f"after {data['error']}", markup=False)

    async with AgentClient(_secret(), timeout=args.timeout) as client:
        return await Executor(desired, client, parallelism=args.parallelism, progress=progress).run(p)


def cmd_serve(args: argparse.Namespace, path: str) -> int:
    import logging

    from .serve.run import ServeRefused, serve

    loaded = _load(path)
    desired = loaded.desired
    assert desired is not None
    logging.basicConfig(level=logging.INFO, format="fleet serve: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per relayed request is noise
    store = StateStore(Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        trio.run(lambda: serve(desired, _secret(), store.serve, interval=args.interval, misses=args.misses,
                               timeout=args.timeout))
    except ServeRefused as exc:
        console(stderr=True).print(f"[red]error:[/] {exc}")
        return Exit.INVALID_CONFIG
    except OSError as exc:
        console(stderr=True).print(f"[red]error:[/] cannot listen on {desired.control_plane.listen}: "
                                   f"{exc.strerror or exc}")
        return Exit.FAILURE
    finally:
        store.close()
    return Exit.OK
