"""`fleet observe`, `plan`, `apply`, `unlock`: load, observe, plan, show, execute, and exit codes."""

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
from .observed import from_snapshot
from .plan import Plan
from .planner import plan as make_plan
from .render import console, print_diagnostics, print_plan
from .store import LockHeld, Store, default_state_dir


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


async def _observe(desired: Desired, timeout: float) -> dict[str, Any]:
    async with AgentClient(_secret(), timeout=timeout) as client:
        return await observe(desired, client, timeout=timeout)


def cmd_observe(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    assert loaded.desired is not None
    snapshot = trio.run(_observe, loaded.desired, args.timeout)
    text = json.dumps(snapshot, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
        bad = [n for n, e in snapshot["nodes"].items() if e["error"]]
        console(stderr=True).print(f"observed {len(snapshot['nodes'])} nodes into {args.out}"
                                   + (f"; no answer from {', '.join(bad)}" if bad else ""))
    else:
        print(text)
    return Exit.OK


def _plan(loaded: config.Loaded, args: argparse.Namespace) -> Plan:
    assert loaded.desired is not None
    if getattr(args, "observed", None):
        try:
            snapshot = json.loads(Path(args.observed).read_text())
        except (OSError, ValueError) as exc:
            console(stderr=True).print(f"[red]error:[/] cannot read the snapshot {args.observed}: {exc}")
            raise Stop(Exit.FAILURE) from None
    else:
        snapshot = trio.run(_observe, loaded.desired, args.timeout)
    observed = from_snapshot(snapshot)
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


def _report(results: list[Result]) -> None:
    out = console(stderr=False)
    for r in results:
        mark = {"done": "[green]✓[/]", "failed": "[red]✗[/]", "skipped": "[yellow]-[/]"}[r.status]
        out.print(f"{mark} {r.action} {r.address}: {r.message} ({r.seconds:.1f}s)")


def cmd_apply(args: argparse.Namespace, path: str) -> int:
    loaded = _load(path)
    err = console(stderr=True)
    # The lock covers planning too: two applies planning at once would both plan the same work.
    store = Store(Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        lock, taken = store.acquire(" ".join(["fleet", *sys.argv[1:]]))
    except LockHeld as exc:
        err.print(f"[red]error[lock_held]:[/] {exc}\n  = If that process is gone for good: fleet unlock {exc.holder.id}")
        store.close()
        return Exit.LOCKED
    if taken is not None:
        err.print(f"[yellow]warning:[/] took over the lock of a process that is gone: {taken.describe()}")
    try:
        return _apply_locked(loaded, args, store)
    finally:
        store.release(lock.id)
        store.close()


def _apply_locked(loaded: config.Loaded, args: argparse.Namespace, store: Store) -> int:
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
    store.record_apply(started, p.config_digest, p.summary(), [asdict(r) for r in results])
    _report(results)
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

    async with AgentClient(_secret(), timeout=args.timeout) as client:
        return await Executor(desired, client, parallelism=args.parallelism, progress=progress).run(p)


def cmd_unlock(args: argparse.Namespace) -> int:
    store = Store(Path(args.state_dir) if args.state_dir else default_state_dir())
    holder = store.holder()
    if holder is None:
        console(stderr=True).print("no lock is held")
        return Exit.OK
    if holder.id != args.lock_id:
        console(stderr=True).print(f"[red]error:[/] the lock is held by {holder.describe()}, not {args.lock_id}")
        return Exit.FAILURE
    store.release(holder.id)
    console(stderr=True).print(f"released the lock of {holder.describe()}")
    return Exit.OK


def cmd_serve(args: argparse.Namespace, path: str) -> int:
    import logging

    from .serve.run import ServeRefused, serve

    loaded = _load(path)
    desired = loaded.desired
    assert desired is not None
    logging.basicConfig(level=logging.INFO, format="fleet serve: %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per heartbeat request is noise
    store = Store(Path(args.state_dir) if args.state_dir else default_state_dir())
    try:
        trio.run(lambda: serve(desired, _secret(), store, interval=args.interval, misses=args.misses,
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


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def cmd_nodes(args: argparse.Namespace, path: str) -> int:
    from rich.table import Table

    store = Store(Path(args.state_dir) if args.state_dir else default_state_dir())
    nodes, rows, alerts = store.nodes(), store.server_rows(), store.alerts()
    store.close()
    loaded = config.load(path) if Path(path).is_file() else None  # for addresses, when the file is here
    specs = loaded.desired.nodes if loaded is not None and loaded.desired is not None else {}
    if args.json:
        print(json.dumps({"nodes": nodes, "servers": rows, "alerts": alerts}, indent=2))
        return Exit.OK
    if not nodes:
        console(stderr=True).print("no node has been seen yet: `fleet serve` records what its heartbeat finds")
        return Exit.OK
    table = Table(box=None, pad_edge=False)
    for col in ["NODE", "STATUS", "LAST SEEN", "GPUS (FREE/TOTAL GiB)", "MODELS", "SERVERS"] + (
            ["ADDRESS", "IDENTITY", "VERSION", "VARIANT", "WINDOWS"] if args.wide else []):
        table.add_column(col, overflow="fold" if args.wide else "ellipsis", no_wrap=not args.wide)
    failures = []
    for n in nodes:
        st = n["state"] or {}
        inv = st.get("inventory", {})
        gpus = ", ".join(f"{_gib(g['memory_free_bytes'])}/{_gib(g['memory_total_bytes'])}" for g in inv.get("gpus", []))
        models = ", ".join((w.get("name") or w["digest"][7:19]) + (f"[{w['slice']['layers']}]" if w.get("slice") else "")
                           for w in st.get("weights", []))
        servers = ", ".join(f"{r['cluster']}:{r['state']}" for r in rows if r["node"] == n["name"])
        row = [n["name"], n["status"], n["last_seen"] or "never", gpus or "-", models or "-", servers or "-"]
        if args.wide:
            avail = st.get("availability", {})
            spec = specs.get(n["name"])
            row += [f"{spec.address}:{spec.agent_port}" if spec else "-", st.get("identity", {}).get("id", "-"), st.get("agent_version", "-"),
                    st.get("variant", {}).get("accelerator", "-"),
                    ", ".join(avail.get("windows", [])) or "always"]
        table.add_row(*row)
        if n["error"]:
            failures.append(f"{n['name']}: {n['error']}")
    for r in rows:
        if r["reason"] and r["state"] not in ("running",):
            failures.append(f"{r['id']} ({r['state']}): {r['reason']}")
    out = console(stderr=False)
    if not out.is_terminal:
        out.width = 250  # a pipe or CI log: do not squeeze the table into 80 columns
    out.print(table)
    for a in alerts:
        out.print(f"[red]ALERT[/] {a['kind']} {a['node']} since {a['raised_at']}: {a['cause']}")
    if args.wide and failures:
        out.print("\nfailures, in full:")
        for f in failures:
            out.print(f"  {f}", markup=False)
    return Exit.OK


def cmd_alerts(args: argparse.Namespace, path: str) -> int:
    store = Store(Path(args.state_dir) if args.state_dir else default_state_dir())
    alerts = store.alerts(include_cleared=args.all)
    store.close()
    if args.json:
        print(json.dumps(alerts, indent=2))
        return Exit.OK
    if not alerts:
        console(stderr=False).print("no alerts" if not args.all else "no alerts recorded")
    for a in alerts:
        state = f"cleared {a['cleared_at']}" if a["cleared_at"] else "OPEN"
        console(stderr=False).print(f"{a['kind']} {a['node']} raised {a['raised_at']} ({state}): {a['cause']}",
                                    markup=False)
    return Exit.OK
