"""The control plane's state directory, one SQLite file (WAL: `fleet apply` and `fleet serve` share
it): the apply lock and the history of applies (ApplyLedger), and what `fleet serve` last saw, node
status, a row per cluster member, alerts (ServeRecord), which `fleet nodes` and `fleet alerts` read."""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import platformdirs

SCHEMA = """
CREATE TABLE IF NOT EXISTS lock (
  one INTEGER PRIMARY KEY CHECK (one = 1),
  id TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, user TEXT NOT NULL,
  since TEXT NOT NULL, command TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS nodes (
  name TEXT PRIMARY KEY, status TEXT NOT NULL, last_seen TEXT, error TEXT, state TEXT, checked TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS server_rows (
  id TEXT PRIMARY KEY, cluster TEXT NOT NULL, node TEXT NOT NULL, model TEXT NOT NULL, port INTEGER NOT NULL,
  state TEXT NOT NULL, reason TEXT, updated TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS alerts (
  id INTEGER PRIMARY KEY AUTOINCREMENT, node TEXT NOT NULL, kind TEXT NOT NULL, cause TEXT NOT NULL,
  raised_at TEXT NOT NULL, cleared_at TEXT
);
CREATE TABLE IF NOT EXISTS drains (
  server_id TEXT PRIMARY KEY, node TEXT NOT NULL, cluster TEXT NOT NULL, lock_id TEXT NOT NULL,
  phase TEXT NOT NULL, grace_s REAL NOT NULL, asked_at TEXT NOT NULL,
  seen TEXT, in_flight INTEGER, updated TEXT
);
CREATE INDEX IF NOT EXISTS open_alerts ON alerts (node, kind) WHERE cleared_at IS NULL;
CREATE TABLE IF NOT EXISTS applies (
  id INTEGER PRIMARY KEY AUTOINCREMENT, started TEXT NOT NULL, finished TEXT,
  config_digest TEXT, summary TEXT, results TEXT
);
"""


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


class LockHeld(Exception):
    def __init__(self, holder: Holder) -> None:
        super().__init__(f"another apply holds the lock: {holder.describe()}")
        self.holder = holder


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class StateStore:
    """The file (fleet.sqlite under the state directory; the schema is kept compatible) and its two halves."""

    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "fleet.sqlite"
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.applies = ApplyLedger(self.db)
        self.serve = ServeRecord(self.db)
        self.drains = DrainRows(self.db)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ApplyLedger:
    """The apply lock (one holder at a time, taken over from a dead process on the same host) and
    the history of applies with each action's result."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def acquire(self, command: str) -> tuple[Holder, Holder | None]:
        """(our lock, the dead holder we took over from, if any). Raises LockHeld."""
        me = Holder(uuid.uuid4().hex[:12], socket.gethostname(), os.getpid(), getpass.getuser(),
                    datetime.now(timezone.utc).isoformat(timespec="seconds"), command)
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT id, host, pid, user, since, command FROM lock").fetchone()
            taken_over = None
            if row is not None:
                holder = Holder(*row)
                if holder.host == me.host and not _alive(holder.pid):
                    taken_over = holder
                    self.db.execute("DELETE FROM lock")
                else:
                    raise LockHeld(holder)
            self.db.execute("INSERT INTO lock VALUES (1, ?, ?, ?, ?, ?, ?)",
                            (me.id, me.host, me.pid, me.user, me.since, me.command))
            self.db.execute("COMMIT")
            return me, taken_over
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def release(self, lock_id: str) -> bool:
        return self.db.execute("DELETE FROM lock WHERE id = ?", (lock_id,)).rowcount == 1

    def holder(self) -> Holder | None:
        row = self.db.execute("SELECT id, host, pid, user, since, command FROM lock").fetchone()
        return Holder(*row) if row else None

    def record_apply(self, started: str, config_digest: str, summary: str, results: list[dict[str, Any]]) -> None:
        self.db.execute("INSERT INTO applies (started, finished, config_digest, summary, results) VALUES (?,?,?,?,?)",
                        (started, datetime.now(timezone.utc).isoformat(timespec="seconds"), config_digest, summary,
                         json.dumps(results)))


class ServeRecord:
    """What the heartbeat of `fleet serve` last saw: each node's status and state, a row per
    cluster member, and alerts raised and cleared."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One commit (one fsync) for many writes: a heartbeat writes a row per node and member."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def put_node(self, name: str, status: str, when: str, *, state: dict[str, Any] | None, error: str | None) -> None:
        if state is not None:
            self.db.execute("INSERT INTO nodes (name, status, last_seen, error, state, checked) VALUES (?,?,?,?,?,?) "
                            "ON CONFLICT(name) DO UPDATE SET status=excluded.status, last_seen=excluded.last_seen, "
                            "error=NULL, state=excluded.state, checked=excluded.checked",
                            (name, status, when, None, json.dumps(state), when))
        else:
            self.db.execute("INSERT INTO nodes (name, status, error, checked) VALUES (?,?,?,?) "
                            "ON CONFLICT(name) DO UPDATE SET status=excluded.status, error=excluded.error, "
                            "checked=excluded.checked", (name, status, error, when))

    def nodes(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT name, status, last_seen, error, state, checked FROM nodes ORDER BY name")
        return [{"name": r[0], "status": r[1], "last_seen": r[2], "error": r[3],
                 "state": json.loads(r[4]) if r[4] else None, "checked": r[5]} for r in rows]

    def put_server_row(self, row: dict[str, Any], when: str) -> None:
        self.db.execute("INSERT INTO server_rows (id, cluster, node, model, port, state, reason, updated) "
                        "VALUES (:id, :cluster, :node, :model, :port, :state, :reason, :updated) "
                        "ON CONFLICT(id) DO UPDATE SET cluster=excluded.cluster, node=excluded.node, "
                        "model=excluded.model, port=excluded.port, state=excluded.state, reason=excluded.reason, "
                        "updated=excluded.updated", {**row, "updated": when})

    def server_rows(self) -> list[dict[str, Any]]:
        rows = self.db.execute("SELECT id, cluster, node, model, port, state, reason, updated FROM server_rows "
                               "ORDER BY cluster, id")
        keys = ("id", "cluster", "node", "model", "port", "state", "reason", "updated")
        return [dict(zip(keys, r)) for r in rows]

    def touch_online(self, when: str) -> None:
        """Every node online was seen now (the heartbeat writes a node's row only when it changed)."""
        self.db.execute("UPDATE nodes SET last_seen=?, checked=? WHERE status='online'", (when, when))

    def touch_rows(self, when: str) -> None:
        self.db.execute("UPDATE server_rows SET updated=?", (when,))

    def open_alert_keys(self) -> set[tuple[str, str]]:
        return {(r[0], r[1]) for r in self.db.execute("SELECT node, kind FROM alerts WHERE cleared_at IS NULL")}

    def set_alert(self, node: str, kind: str, cause: str, when: str) -> bool:
        """Raise the alert, or bring an open one's cause up to date; True when it was raised now."""
        if self.open_alert(node, kind) is None:
            self.raise_alert(node, kind, cause, when)
            return True
        self.db.execute("UPDATE alerts SET cause=? WHERE node=? AND kind=? AND cleared_at IS NULL AND cause != ?",
                        (cause, node, kind, cause))
        return False

    def open_alert(self, node: str, kind: str) -> dict[str, Any] | None:
        r = self.db.execute("SELECT id, cause, raised_at FROM alerts WHERE node=? AND kind=? AND cleared_at IS NULL",
                            (node, kind)).fetchone()
        return {"id": r[0], "cause": r[1], "raised_at": r[2]} if r else None

    def raise_alert(self, node: str, kind: str, cause: str, when: str) -> None:
        if self.open_alert(node, kind) is None:
            self.db.execute("INSERT INTO alerts (node, kind, cause, raised_at) VALUES (?,?,?,?)", (node, kind, cause, when))

    def clear_alert(self, node: str, kind: str, when: str) -> bool:
        return self.db.execute("UPDATE alerts SET cleared_at=? WHERE node=? AND kind=? AND cleared_at IS NULL",
                               (when, node, kind)).rowcount > 0

    def alerts(self, include_cleared: bool = False) -> list[dict[str, Any]]:
        sql = "SELECT id, node, kind, cause, raised_at, cleared_at FROM alerts"
        sql += "" if include_cleared else " WHERE cleared_at IS NULL"
        keys = ("id", "node", "kind", "cause", "raised_at", "cleared_at")
        return [dict(zip(keys, r)) for r in self.db.execute(sql + " ORDER BY id")]


@dataclass(frozen=True, slots=True)
class Drain:
    """A member taken out of routing by an apply (phase `drain`), then handed back (`admit`); what
    `fleet serve` last said of it (`seen`: draining, drained, admitted) and its requests in flight."""

    server_id: str
    node: str
    cluster: str
    lock_id: str
    phase: str
    grace_s: float
    asked_at: str
    seen: str | None = None
    in_flight: int | None = None


class DrainRows:
    """The drains table, the SQLite side of reconciler/drain.py's DrainBoard: `fleet apply` writes a
    row, `fleet serve` sees it at once by watching PRAGMA data_version (which moves on every commit
    of another connection, and costs a few microseconds to read), acts, and answers in the row."""

    COLUMNS = "server_id, node, cluster, lock_id, phase, grace_s, asked_at, seen, in_flight"

    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db
        self._version: int | None = None

    def ask(self, drain: Drain) -> None:
        self.db.execute("INSERT OR REPLACE INTO drains (server_id, node, cluster, lock_id, phase, grace_s, asked_at) "
                        "VALUES (?,?,?,?,?,?,?)", (drain.server_id, drain.node, drain.cluster, drain.lock_id,
                                                   drain.phase, drain.grace_s, drain.asked_at))

    def set_phase(self, server_id: str, phase: str) -> None:
        self.db.execute("UPDATE drains SET phase=?, seen=NULL, in_flight=NULL WHERE server_id=?", (phase, server_id))

    def get(self, server_id: str) -> Drain | None:
        row = self.db.execute(f"SELECT {self.COLUMNS} FROM drains WHERE server_id=?", (server_id,)).fetchone()
        return Drain(*row) if row else None

    def remove(self, server_id: str) -> None:
        self.db.execute("DELETE FROM drains WHERE server_id=?", (server_id,))

    def changed(self) -> bool:
        """Whether another process committed since the last call (the first call says True)."""
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        changed, self._version = version != self._version, version
        return bool(changed)

    def active(self) -> list[Drain]:
        """Drains asked by the apply that holds the lock now: one left by an apply that died (or
        whose lock was released) is ignored, so that no member stays out of routing for good."""
        rows = [Drain(*r) for r in self.db.execute(f"SELECT {self.COLUMNS} FROM drains ORDER BY server_id")]
        if not rows:
            return []
        lock = self.db.execute("SELECT id, host, pid FROM lock").fetchone()
        if lock is None or (lock[1] == socket.gethostname() and not _alive(lock[2])):
            return []
        return [d for d in rows if d.lock_id == lock[0]]

    def answer(self, server_id: str, seen: str, in_flight: int, when: str) -> None:
        self.db.execute("UPDATE drains SET seen=?, in_flight=?, updated=? WHERE server_id=?",
                        (seen, in_flight, when, server_id))
