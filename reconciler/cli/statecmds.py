"""`fleet nodes`, `fleet alerts`, `fleet unlock`: read (or release) what the state directory keeps
and print it (or, under --json, one document: schemas/nodes.schema.json, schemas/alerts.schema.json);
nodes are read as typed observations (reconciler/core/observed.py)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from reconciler.fleetfile import config
from reconciler.cli.exitcodes import Exit
from reconciler.core.desired import NodeSpec
from reconciler.planning.notes import build_findings, rate_text
from reconciler.core.observed import ObservedNode, node_from_state
from reconciler.cli.outcome import Failure, print_json
from reconciler.cli.render import JSON_FORMAT_VERSION, console
from reconciler.state.backend import ENV as STATE_URL_ENV, Store, open_state, resolve
from reconciler.state.sql import StateError


def open_store(state_dir: str | None, url: str | None = None, in_file: str | None = None) -> Store:
    """The state store (--state URL, else --state-dir, else $FLEET_STATE_URL, else the fleet file's
    control_plane.state, else the default directory); one that cannot be opened is a refusal with
    its code (state_backend.py), not a bug."""
    try:
        return open_state(resolve(url, state_dir, in_file))
    except StateError as exc:
        raise Failure(Exit.INVALID_CONFIG, exc.code, str(exc), hint=exc.hint or "") from None


def _open(args: argparse.Namespace, path: str | None = None) -> Store:
    """The store of --state, --state-dir or $FLEET_STATE_URL, else of the fleet file's
    control_plane.state (read only then, and only if the file is there)."""
    in_file, url = None, getattr(args, "state", None)
    if not (url or args.state_dir or os.environ.get(STATE_URL_ENV)) and path and Path(path).is_file():
        loaded = config.load(path)
        in_file = loaded.desired.control_plane.state if loaded.desired is not None else None
    return open_store(args.state_dir, url, in_file)


def cmd_unlock(args: argparse.Namespace) -> int:
    with _open(args) as store:
        holder = store.applies.holder()
        if holder is None:
            console(stderr=True).print("no lock is held")
            return Exit.OK
        if holder.id != args.lock_id:
            raise Failure(Exit.LOCKED, "lock_held", f"the lock is held by {holder.describe()}, not {args.lock_id}",
                          hint=f"if that process is gone for good: fleet unlock {holder.id}")
        if not store.applies.releasable(holder):
            raise Failure(Exit.LOCKED, "lock_held", f"the lock is held by {holder.describe()}, whose session "
                          "with the shared state store is still open: the lock ends with it",
                          hint="stop that apply (its lock goes the moment its connection does)")
        store.applies.release(holder.id)
    console(stderr=True).print(f"released the lock of {holder.describe()}")
    return Exit.OK


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f}"


def _links(seen: ObservedNode, specs: dict[str, NodeSpec]) -> str:
    """The rates the node measured on its recent fetches, per peer (by name when the file has it)."""
    names = {f"[{s.address}]:{s.agent_port}" if ":" in s.address else f"{s.address}:{s.agent_port}": n
             for n, s in specs.items()}
    rates = (seen.state or {}).get("link_rates") or []
    return ", ".join(f"{names.get(r['peer'], r['peer'])} {rate_text(r['bytes_per_s'])} ({r['samples']})"
                     for r in rates) or "-"


def _gpu_servers(seen: ObservedNode, position: int, free: int, total: int) -> str:
    index = seen.gpu_ids[position][0] if position < len(seen.gpu_ids) else position
    held = [f"{sid.rpartition('@')[0]} {_gib(b)}" for sid, srv in seen.servers.items() for i, _, b in srv.gpus
            if i == index and srv.state in ("starting", "running")]
    return f"{index}: {_gib(free)}/{_gib(total)}" + (f" ({', '.join(held)})" if held else "")


def _columns(name: str, seen: ObservedNode | None, spec: NodeSpec | None, wide: bool,
             specs: dict[str, NodeSpec] | None = None) -> list[str]:
    """GPUS, MODELS and, when wide, ADDRESS … LINKS of one node ("-" where nothing was seen)."""
    if seen is None:
        seen = ObservedNode(name)
    gpus = ", ".join(f"{_gib(free)}/{_gib(total)}" for _, free, total in seen.gpus)
    if wide and seen.gpus:  # each GPU by index, with the servers its agent gave it and what each reserves
        gpus = ", ".join(_gpu_servers(seen, i, free, total) for i, (_, free, total) in enumerate(seen.gpus))
    models = ", ".join((w.name or w.digest[7:19]) + (f"[{w.layers}]" if w.slice_of else "")
                       for w in seen.weights.values())
    row = [gpus or "-", models or "-"]
    if wide:
        row += [f"{spec.address}:{spec.agent_port}" if spec else "-", seen.identity or "-",
                seen.agent_version or "-", (seen.accelerator or "-") + (" (MISMATCH)" if build_findings(seen) else ""),
                ", ".join(seen.windows) or "always", _links(seen, specs or {})]
    return row


def _adapter(seen: ObservedNode | None, sid: str) -> str:
    """" +adapter NAME" for a server that merges a LoRA adapter, as its agent reports its settings."""
    server = seen.servers.get(sid) if seen is not None else None
    adapter = (server.settings.get("adapter") if server is not None else None) or {}
    return f" +adapter {adapter.get('name')}" if isinstance(adapter, dict) and adapter.get("name") else ""


def cmd_nodes(args: argparse.Namespace, path: str) -> int:
    from rich.table import Table

    with _open(args, path) as store:
        nodes, rows, alerts = store.serve.nodes(), store.serve.server_rows(), store.serve.alerts()
    loaded = config.load(path) if Path(path).is_file() else None  # for addresses, when the file is here
    specs = loaded.desired.nodes if loaded is not None and loaded.desired is not None else {}
    if args.json:
        print_json({"format_version": JSON_FORMAT_VERSION, "nodes": nodes, "servers": rows, "alerts": alerts})
        return Exit.OK
    if not nodes:
        console(stderr=True).print("no node has been seen yet: `fleet serve` records what its heartbeat finds")
        return Exit.OK
    table = Table(box=None, pad_edge=False)
    for col in ["NODE", "STATUS", "LAST SEEN", "GPUS (FREE/TOTAL GiB)", "MODELS", "SERVERS"] + (
            ["ADDRESS", "IDENTITY", "VERSION", "VARIANT", "WINDOWS", "LINKS IN (FETCHES)"] if args.wide else []):
        table.add_column(col, overflow="fold" if args.wide else "ellipsis", no_wrap=not args.wide)
    failures = []
    for n in nodes:
        # The last state a node reported is kept while it is offline: shown for what it held.
        seen = node_from_state(n["name"], n["state"]) if n["state"] else None
        gpus, models, *wide = _columns(n["name"], seen, specs.get(n["name"]), args.wide, specs)
        servers = ", ".join(f"{r['cluster']}:{r['state']}" + (_adapter(seen, r["id"]) if args.wide else "")
                            for r in rows if r["node"] == n["name"])
        table.add_row(n["name"], n["status"], n["last_seen"] or "never", gpus, models, servers or "-", *wide)
        if n["error"]:
            failures.append(f"{n['name']}: {n['error']}")
        for found in build_findings(seen) if seen is not None else []:
            failures.append(f"{n['name']} ({found.get('check')}): {found['message']} Install {found.get('install')}.")
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
    with _open(args, path) as store:
        alerts: list[dict[str, Any]] = store.serve.alerts(include_cleared=args.all)
    if args.json:
        print_json(alerts)
        return Exit.OK
    if not alerts:
        console(stderr=False).print("no alerts" if not args.all else "no alerts recorded")
    for a in alerts:
        state = f"cleared {a['cleared_at']}" if a["cleared_at"] else "OPEN"
        console(stderr=False).print(f"{a['kind']} {a['node']} raised {a['raised_at']} ({state}): {a['cause']}",
                                    markup=False)
    return Exit.OK
