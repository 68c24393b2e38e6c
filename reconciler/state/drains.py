"""The drains table between `fleet apply` and `fleet serve` (reconciler/applying/drain.py's DrainBoard and
serve/drains.py's WatchBoard): a member asked out of routing around its replacement, serve's
answers in the row, and, on a shared store, each following serve's requests in flight on it."""

from __future__ import annotations

from dataclasses import dataclass

from reconciler.state.sql import Sql


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
    """The drains table, reconciler/applying/drain.py's DrainBoard: `fleet apply` writes a row, `fleet serve`
    sees it at once (SQLite: PRAGMA data_version, polled; PostgreSQL: NOTIFY fleet_drains), acts,
    and answers in the row."""

    CHANNEL = "fleet_drains"
    COLUMNS = "server_id, node, cluster, lock_id, phase, grace_s, asked_at, seen, in_flight"

    def __init__(self, sql: Sql) -> None:
        self.sql = sql

    def ask(self, drain: Drain) -> None:
        self.sql.execute("INSERT INTO drains (server_id, node, cluster, lock_id, phase, grace_s, asked_at) "
                         "VALUES (?,?,?,?,?,?,?) ON CONFLICT(server_id) DO UPDATE SET node=excluded.node, "
                         "cluster=excluded.cluster, lock_id=excluded.lock_id, phase=excluded.phase, "
                         "grace_s=excluded.grace_s, asked_at=excluded.asked_at, seen=NULL, in_flight=NULL, "
                         "updated=NULL", (drain.server_id, drain.node, drain.cluster, drain.lock_id,
                                          drain.phase, drain.grace_s, drain.asked_at))
        self.sql.notify(self.CHANNEL)

    def set_phase(self, server_id: str, phase: str) -> None:
        self.sql.execute("UPDATE drains SET phase=?, seen=NULL, in_flight=NULL WHERE server_id=?", (phase, server_id))
        self.sql.notify(self.CHANNEL)

    def get(self, server_id: str) -> Drain | None:
        row = self.sql.execute(f"SELECT {self.COLUMNS} FROM drains WHERE server_id=?", (server_id,)).fetchone()
        return Drain(*row) if row else None

    def remove(self, server_id: str) -> None:
        self.sql.execute("DELETE FROM drains WHERE server_id=?", (server_id,))
        if self.sql.dialect != "sqlite":  # only a shared store has other serves' answers
            self.sql.execute("DELETE FROM drain_answers WHERE server_id=?", (server_id,))
        self.sql.notify(self.CHANNEL)

    def changed(self) -> bool:
        """Whether another process committed since the last call (the first call says True)."""
        return self.sql.changed()

    def active(self) -> list[Drain]:
        """Drains asked by the apply that holds the lock now: one left by an apply that died (or
        whose lock was released) is ignored, so that no member stays out of routing for good."""
        rows = [Drain(*r) for r in self.sql.execute(f"SELECT {self.COLUMNS} FROM drains ORDER BY server_id")]
        if not rows:
            return []
        lock = self.sql.execute("SELECT id, host, pid FROM lock").fetchone()
        if lock is None or self.sql.holder_gone(lock[0], lock[1], lock[2]):
            return []
        return [d for d in rows if d.lock_id == lock[0]]

    def answer_for(self, serve: str, drain: Drain, in_flight: int, when: str) -> None:
        """A following `fleet serve`'s requests in flight on a drained member (it routes none there),
        for the drain of this apply (an answer to an earlier drain of the member counts for nothing)."""
        self.sql.execute("INSERT INTO drain_answers (server_id, serve, lock_id, in_flight, updated) "
                         "VALUES (?,?,?,?,?) ON CONFLICT(server_id, serve) DO UPDATE SET lock_id=excluded.lock_id, "
                         "in_flight=excluded.in_flight, updated=excluded.updated",
                         (drain.server_id, serve, drain.lock_id, in_flight, when))

    def others_in_flight(self, drain: Drain) -> int | None:
        """Requests in flight on the member at the other live `fleet serve` processes; None while
        one of them has not answered yet (it may not have taken the member out of routing)."""
        others = self.sql.other_serves()
        if not others:
            return 0
        answers = dict(self.sql.execute("SELECT serve, in_flight FROM drain_answers WHERE server_id=? AND lock_id=?",
                                        (drain.server_id, drain.lock_id)).fetchall())
        if any(serve not in answers for serve in others):
            return None
        return sum(int(answers[serve]) for serve in others)

    def answer(self, server_id: str, seen: str, in_flight: int, when: str) -> None:
        self.sql.execute("UPDATE drains SET seen=?, in_flight=?, updated=? WHERE server_id=?",
                         (seen, in_flight, when, server_id))
