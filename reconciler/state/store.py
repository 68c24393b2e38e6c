"""The control plane's state, in one store shared by `fleet apply` and `fleet serve`: the apply lock
and the history of applies (ApplyLedger), what `fleet serve` last saw, node status, a row per
cluster member, alerts (ServeRecord), and the drains between the two (DrainRows, state_drains.py).
Written once over state_sql.Sql; StateStore is the embedded SQLite file, state_pg.SharedStore the
PostgreSQL one."""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Sequence

import platformdirs
import trio

from reconciler.state.drains import Drain as Drain, DrainRows as DrainRows
from reconciler.state.sql import Sql, SqliteSql, StateError, migrate

HOLDER = 'id, host, pid, "user", since, command'
HOLDER_WAIT_S = 2.0  # PostgreSQL: how long a refused apply waits for the holder's row to name it


def default_state_dir() -> Path:
    return Path(os.environ.get("FLEET_STATE_DIR") or platformdirs.user_state_dir("fleet"))


@dataclass(frozen=True, slots=True)
class Holder:
    id: str
    host: str
    pid: int
    user: str
    since: str
    command: str

    def describe(self) -> str:
        return f"{self.user}@{self.host} pid {self.pid} since {self.since}, running `{self.command}` (lock id {self.id})"


# A holder that has the lock but has not written its row yet (it does so at once: seen only if
# it died in between, or the store is very slow).
UNNAMED = Holder("?", "?", 0, "?", "?", "an apply that has not written its name yet")


class LockHeld(Exception):
    def __init__(self, holder: Holder) -> None:
        super().__init__(f"another apply holds the lock: {holder.describe()}")
        self.holder = holder


class StateStore:
    """The embedded store: fleet.sqlite under the state directory (WAL), its schema migrated on open."""

    shared = False

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "fleet.sqlite"
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.sql = SqliteSql(self.db, str(self.path))
        migrate(self.sql)
        self.applies = ApplyLedger(self.sql)
        self.serve = ServeRecord(self.sql)
        self.drains = DrainRows(self.sql)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ApplyLedger:
    """The apply lock (one holder at a time; on SQLite taken over from a dead process on the same
    host, on PostgreSQL an advisory lock that ends with its holder's connection) and the history
    of applies with each action's result."""

    def __init__(self, sql: Sql) -> None:
        self.sql = sql

    def acquire(self, command: str) -> tuple[Holder, Holder | None]:
        """(our lock, the dead holder we took over from, if any). Raises LockHeld."""
        me = Holder(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), getpass.getuser(),
                    datetime.now(timezone.utc).isoformat(timespec="seconds"), command)
        if not self.sql.take_apply_lock(me.id):
            raise LockHeld(self._named_holder())
        try:
            with self.sql.transaction():
                row = self.sql.execute(f"SELECT {HOLDER} FROM lock").fetchone()
                taken_over = None
                if row is not None:
                    holder = Holder(*row)
                    if not self.sql.holder_gone(holder.id, holder.host, holder.pid):
                        raise LockHeld(holder)
                    taken_over = holder
                    self.sql.execute("DELETE FROM lock")
                self.sql.execute(f"INSERT INTO lock (one, {HOLDER}) VALUES (1, ?, ?, ?, ?, ?, ?)",
                                 (me.id, me.host, me.pid, me.user, me.since, me.command))
        except BaseException:
            self.sql.drop_apply_lock()
            raise
        return me, taken_over

    def _named_holder(self) -> Holder:
        """Who holds the lock we could not take: its row, once written (the advisory lock is taken a
        moment before the row names its holder)."""
        deadline = time.monotonic() + HOLDER_WAIT_S
        while True:
            row = self.sql.execute(f"SELECT {HOLDER} FROM lock").fetchone()
            if row is not None and not self.sql.holder_gone(row[0], row[1], row[2]):
                return Holder(*row)
            if time.monotonic() >= deadline:
                return UNNAMED
            time.sleep(0.02)

    def release(self, lock_id: str) -> bool:
        try:
            released = self.sql.execute("DELETE FROM lock WHERE id = ?", (lock_id,)).rowcount == 1
            self.sql.drop_apply_lock()
        except StateError:  # the session is gone, and the advisory lock with it: nothing to release
            return False
        return released

    def confirm(self) -> None:
        """Raises StateError if this process no longer holds the lock it took: on PostgreSQL, if its
        session ended (another apply may hold the lock now). SQLite's row stays until released."""
        self.sql.confirm_apply_lock()

    def holder(self) -> Holder | None:
        row = self.sql.execute(f"SELECT {HOLDER} FROM lock").fetchone()
        return Holder(*row) if row else None

    def releasable(self, holder: Holder) -> bool:
        """Whether `fleet unlock` can free this holder's lock: always on SQLite (the row is the lock);
        on PostgreSQL only once its session has ended (until then the session holds it)."""
        return self.sql.dialect == "sqlite" or self.sql.holder_gone(holder.id, holder.host, holder.pid)

    def record_apply(self, started: str, config_digest: str, summary: str, results: list[dict[str, Any]]) -> None:
        self.sql.execute("INSERT INTO applies (started, finished, config_digest, summary, results) VALUES (?,?,?,?,?)",
                         (started, datetime.now(timezone.utc).isoformat(timespec="seconds"), config_digest, summary,
                          json.dumps(results)))


class ServeRecord:
    """What the heartbeat of `fleet serve` last saw: each node's status and state, a row per
    cluster member, and alerts raised and cleared. A transaction that changed more than the
    seen-at stamps tells other processes (PostgreSQL: NOTIFY fleet_serve, at its commit).
    `deferred` (PostgreSQL under serve): a transaction's writes are kept and sent by `flush()`
    from a worker thread, so that a beat's round trips (0.4 s for 1,000 changed nodes on a local
    server: bench/state_backends.py) never hold the event loop; a write then returns no count."""

    CHANNEL = "fleet_serve"

    def __init__(self, sql: Sql, *, deferred: bool = False) -> None:
        self.sql, self.deferred = sql, deferred
        self._depth = 0
        self._dirty = False
        self._batch: list[tuple[str, Sequence[Any]]] = []
        self._ready: list[tuple[str, Sequence[Any]]] = []

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One commit (one fsync) for many writes: a heartbeat writes a row per node and member."""
        if self.deferred:
            self._depth += 1
            try:
                yield
                if self._dirty:
                    self._batch.append((f"NOTIFY {self.CHANNEL}", ()))
                self._ready.extend(self._batch)
            finally:
                self._depth -= 1
                self._batch, self._dirty = [], False
            return
        with self.sql.transaction():
            self._depth += 1
            try:
                yield
                if self._dirty:
                    self.sql.notify(self.CHANNEL)
            finally:
                self._depth -= 1
                self._dirty = False

    async def flush(self) -> None:
        """Commit what deferred transactions kept (nothing to do otherwise), off the event loop."""
        if self._ready:
            batch, self._ready = self._ready, []
            await trio.to_thread.run_sync(self.sql.write_batch, batch)

    def _exec(self, query: str, params: Sequence[Any]) -> int:
        """The rows changed (1 when deferred: not known until flushed)."""
        if self.deferred and self._depth:
            self._batch.append((query, params))
            return 1
        return int(self.sql.execute(query, params).rowcount)

    def _wrote(self) -> None:
        if self._depth:
            self._dirty = True
        else:
            self.sql.notify(self.CHANNEL)

    def tune_for_serve(self) -> None:
        """Each beat commits from the event loop: SQLite in WAL mode with synchronous=NORMAL drops the
        commit's fsync, which stalled every stream for it on each beat (4 ms median, 12 ms max
        measured); the file stays consistent, and a power cut loses at most the last beat's rows.
        PostgreSQL: the same trade, made for this session only."""
        if self.sql.dialect == "sqlite":
            self.sql.execute("PRAGMA synchronous=NORMAL")
        else:
            self.sql.execute("SET synchronous_commit = off")

    def put_node(self, name: str, status: str, when: str, *, state: dict[str, Any] | None, error: str | None) -> None:
        if state is not None:
            self._exec("INSERT INTO nodes (name, status, last_seen, error, state, checked) VALUES (?,?,?,?,?,?) "
                             "ON CONFLICT(name) DO UPDATE SET status=excluded.status, last_seen=excluded.last_seen, "
                             "error=NULL, state=excluded.state, checked=excluded.checked",
                             (name, status, when, None, json.dumps(state), when))
        else:
            self._exec("INSERT INTO nodes (name, status, error, checked) VALUES (?,?,?,?) "
                             "ON CONFLICT(name) DO UPDATE SET status=excluded.status, error=excluded.error, "
                             "checked=excluded.checked", (name, status, error, when))
        self._wrote()

    def nodes(self) -> list[dict[str, Any]]:
        rows = self.sql.execute("SELECT name, status, last_seen, error, state, checked FROM nodes ORDER BY name")
        return [{"name": r[0], "status": r[1], "last_seen": r[2], "error": r[3],
                 "state": json.loads(r[4]) if r[4] else None, "checked": r[5]} for r in rows]

    def node_states(self) -> list[tuple[str, str, str | None]]:
        """(name, status, the state as stored): what a following `fleet serve` routes from."""
        return [(r[0], r[1], r[2]) for r in self.sql.execute("SELECT name, status, state FROM nodes ORDER BY name")]

    def put_server_row(self, row: dict[str, Any], when: str) -> None:
        self._exec("INSERT INTO server_rows (id, cluster, node, model, port, state, reason, updated) "
                         "VALUES (?,?,?,?,?,?,?,?) "
                         "ON CONFLICT(id) DO UPDATE SET cluster=excluded.cluster, node=excluded.node, "
                         "model=excluded.model, port=excluded.port, state=excluded.state, reason=excluded.reason, "
                         "updated=excluded.updated", (row["id"], row["cluster"], row["node"], row["model"],
                                                      row["port"], row["state"], row["reason"], when))
        self._wrote()

    def server_rows(self) -> list[dict[str, Any]]:
        rows = self.sql.execute("SELECT id, cluster, node, model, port, state, reason, updated FROM server_rows "
                                "ORDER BY cluster, id")
        keys = ("id", "cluster", "node", "model", "port", "state", "reason", "updated")
        return [dict(zip(keys, r)) for r in rows]

    def touch_online(self, when: str) -> None:
        """Every node online was seen now (the heartbeat writes a node's row only when it changed)."""
        self._exec("UPDATE nodes SET last_seen=?, checked=? WHERE status='online'", (when, when))

    def touch_rows(self, when: str) -> None:
        self._exec("UPDATE server_rows SET updated=?", (when,))

    def open_alert_keys(self) -> set[tuple[str, str]]:
        return {(r[0], r[1]) for r in self.sql.execute("SELECT node, kind FROM alerts WHERE cleared_at IS NULL")}

    def set_alert(self, node: str, kind: str, cause: str, when: str) -> bool:
        """Raise the alert, or bring an open one's cause up to date; True when it was raised now."""
        if self.open_alert(node, kind) is None:
            self.raise_alert(node, kind, cause, when)
            return True
        if self._exec("UPDATE alerts SET cause=? WHERE node=? AND kind=? AND cleared_at IS NULL AND cause != ?",
                      (cause, node, kind, cause)):
            self._wrote()
        return False

    def open_alert(self, node: str, kind: str) -> dict[str, Any] | None:
        r = self.sql.execute("SELECT id, cause, raised_at FROM alerts WHERE node=? AND kind=? AND cleared_at IS NULL",
                             (node, kind)).fetchone()
        return {"id": r[0], "cause": r[1], "raised_at": r[2]} if r else None

    def raise_alert(self, node: str, kind: str, cause: str, when: str) -> None:
        # The store keeps one open alert per node and kind (schema version 2): a second writer's
        # insert does nothing.
        if self.open_alert(node, kind) is None:
            self._exec("INSERT INTO alerts (node, kind, cause, raised_at) VALUES (?,?,?,?) "
                             "ON CONFLICT (node, kind) WHERE cleared_at IS NULL DO NOTHING", (node, kind, cause, when))
            self._wrote()

    def clear_alert(self, node: str, kind: str, when: str) -> bool:
        cleared = self._exec("UPDATE alerts SET cleared_at=? WHERE node=? AND kind=? AND cleared_at IS NULL",
                             (when, node, kind)) > 0
        if cleared:
            self._wrote()
        return cleared

    def alerts(self, include_cleared: bool = False) -> list[dict[str, Any]]:
        sql = "SELECT id, node, kind, cause, raised_at, cleared_at FROM alerts"
        sql += "" if include_cleared else " WHERE cleared_at IS NULL"
        keys = ("id", "node", "kind", "cause", "raised_at", "cleared_at")
        return [dict(zip(keys, r)) for r in self.sql.execute(sql + " ORDER BY id")]
