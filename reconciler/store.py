"""The control plane's SQLite store: the apply lock and apply history (WAL: safe beside `fleet serve`)."""

from __future__ import annotations

import getpass
import json
import os
import socket
import sqlite3
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import platformdirs

SCHEMA = """
CREATE TABLE IF NOT EXISTS lock (
  one INTEGER PRIMARY KEY CHECK (one = 1),
  id TEXT NOT NULL, host TEXT NOT NULL, pid INTEGER NOT NULL, user TEXT NOT NULL,
  since TEXT NOT NULL, command TEXT NOT NULL
);
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


class Store:
    def __init__(self, state_dir: Path) -> None:
        state_dir.mkdir(parents=True, exist_ok=True)
        self.path = state_dir / "fleet.sqlite"
        self.db = sqlite3.connect(self.path, timeout=10, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

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
