"""The shared state store on PostgreSQL (psycopg 3, imported only when a postgresql:// URL is used):
the same tables as the SQLite file, the apply lock as a session advisory lock, the leadership lock
of several `fleet serve` processes, and LISTEN/NOTIFY for what one process tells the others."""

from __future__ import annotations

import logging
import re
import sys
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

import trio

from reconciler.state.sql import Rows, Sql, StateError, migrate
from reconciler.state.drains import DrainRows
from reconciler.state.store import ApplyLedger, ServeRecord

if TYPE_CHECKING:
    import psycopg

log = logging.getLogger("fleet")

# Advisory locks are (class, object) pairs per database; the class is "flee" in ASCII.
KEY = 0x666C6565
APPLY, LEAD, MIGRATE = 1, 2, 3
LOCK_WAIT_MS = 500  # how long an apply waits for the lock before it is refused
APP_NAME = "fleet-apply:"  # the session holding the apply lock says its lock id in application_name
SERVE_NAME = "fleet-serve:"  # and each `fleet serve`'s main session says its name
CONNECT_TIMEOUT_S = 10
# The server ends a session whose client host vanished (power cut, partition) after about 25 s,
# and with it the locks it held: the default would wait two hours.
KEEPALIVE = ("SET tcp_keepalives_idle = 10", "SET tcp_keepalives_interval = 5", "SET tcp_keepalives_count = 3")


def redact(url: str) -> str:
    """The URL without its password (in the address or as ?password=), for messages and logs."""
    parts = urlsplit(url)
    if parts.password is None and "password=" not in parts.query:
        return url
    if parts.password is not None:
        parts = parts._replace(netloc=f"{parts.username or ''}:***@{parts.netloc.rsplit('@', 1)[1]}")
    return urlunsplit(parts._replace(query=re.sub(r"(^|&)password=[^&]*", r"\1password=***", parts.query)))


def _driver() -> Any:
    try:
        import psycopg
    except ImportError:
        raise StateError("postgres_driver_missing", "a postgresql:// state store needs psycopg 3, which is not "
                         "installed", hint="pip install 'inference-fleet[postgres]'") from None
    return psycopg


def store_errors() -> tuple[type[BaseException], ...]:
    """The driver's errors, once it is loaded (a SQLite store never loads it), and ours."""
    module = sys.modules.get("psycopg")
    return (module.Error, StateError) if module is not None else (StateError,)


def connect(url: str) -> psycopg.Connection[Any]:
    """A session of our own (autocommit: every statement commits unless in a transaction block)."""
    pg = _driver()
    try:
        conn: psycopg.Connection[Any] = pg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                                                        application_name="fleet")
        for statement in KEEPALIVE:
            conn.execute(statement)
    except pg.Error as exc:
        raise StateError("state_unreachable", f"cannot reach the state store {redact(url)}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}",
                         hint="check the URL, that the server runs, and the password (PGPASSWORD or ~/.pgpass)"
                         ) from None
    return conn


_PLACEHOLDER = re.compile(r"\?")


class PgSql:
    """A PostgreSQL session behind state_sql.Sql: `?` placeholders become psycopg's, the apply lock
    is an advisory lock of this session (it ends when the connection does, whatever killed its
    process), and a lock row's holder is gone when no session holding the lock says its id."""

    dialect = "postgresql"

    def __init__(self, conn: psycopg.Connection[Any], where: str) -> None:
        self.conn, self.where = conn, where
        self._queries: dict[str, str] = {}
        self._holding = False
        self.watch: Callable[[], bool] | None = None  # changed(): set by whoever listens (serve)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Rows:
        query = self._queries.get(sql)
        if query is None:
            query = self._queries[sql] = _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))
        try:
            return self.conn.execute(query, params)
        except _driver().OperationalError as exc:  # the session is gone (server restarted, network)
            text = str(exc).strip()
            raise StateError("state_lost", f"lost the connection to the state store {self.where}: "
                             f"{text.splitlines()[0] if text else type(exc).__name__}",
                             hint="run the command again once the store answers") from None

    def transaction(self) -> Any:
        return self.conn.transaction()

    def write_batch(self, batch: Sequence[tuple[str, Sequence[Any]]]) -> None:
        """One transaction, its statements pipelined: one round trip's wait, not one per statement."""
        with self.conn.transaction(), self.conn.pipeline():
            for query, params in batch:
                self.execute(query, params)

    def notify(self, channel: str) -> None:
        self.conn.execute(f"NOTIFY {channel}")

    def changed(self) -> bool:
        return True if self.watch is None else self.watch()

    def take_apply_lock(self, lock_id: str) -> bool:
        """Waits up to LOCK_WAIT_MS: a holder killed a moment ago has its session ended by the server
        a few milliseconds after its connection closed, and the next apply gets in then."""
        pg = _driver()
        try:
            with self.conn.transaction():
                self.conn.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT_MS}ms'")
                self.conn.execute(f"SELECT pg_advisory_lock({KEY}, {APPLY})")
            got = True
        except pg.errors.LockNotAvailable:
            got = False
        if got:
            self._holding = True
            self.execute("SELECT set_config('application_name', ?, false)", (APP_NAME + lock_id,))
        return got

    def drop_apply_lock(self) -> None:
        if self._holding:
            self.execute(f"SELECT pg_advisory_unlock({KEY}, {APPLY})")
            self.execute("SELECT set_config('application_name', 'fleet', false)")
            self._holding = False

    def confirm_apply_lock(self) -> None:
        # The session is the lock: a dead one raises StateError here (execute), and a live one holds it.
        held = self._holding and self.execute(
            f"SELECT EXISTS (SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND classid = {KEY} "
            f"AND objid = {APPLY} AND objsubid = 2 AND granted AND pid = pg_backend_pid())").fetchone()[0]
        if not held:
            raise StateError("lock_lost", f"this apply no longer holds the lock of {self.where}: nothing was applied",
                             hint="run the apply again")

    def holder_gone(self, lock_id: str, host: str, pid: int) -> bool:
        return not self.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid "
            f"WHERE l.locktype = 'advisory' AND l.classid = {KEY} AND l.objid = {APPLY} AND l.objsubid = 2 "
            "AND l.granted AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
            "AND a.application_name = ?)", (APP_NAME + lock_id,)).fetchone()[0]


    def name_serve(self, name: str) -> None:
        """This session is a `fleet serve`'s, known to the others by `name` while it lasts."""
        self.execute("SELECT set_config('application_name', ?, false)", (SERVE_NAME + name,))

    def other_serves(self) -> list[str]:
        return [r[0][len(SERVE_NAME):] for r in self.execute(
            "SELECT application_name FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE ? AND pid <> pg_backend_pid() ORDER BY 1", (SERVE_NAME + "%",))]


class SharedStore:
    """The store at a postgresql:// URL: ApplyLedger, ServeRecord and DrainRows as on SQLite, plus
    what only a shared store has: a leadership lock and notifications for `fleet serve`."""

    shared = True

    def __init__(self, url: str) -> None:
        self.url, self.where = url, redact(url)
        self.conn = connect(url)
        self.sql = PgSql(self.conn, self.where)
        migrate(self.sql, before=lambda sql: sql.execute(f"SELECT pg_advisory_xact_lock({KEY}, {MIGRATE})"))
        self.applies = ApplyLedger(self.sql)
        self.serve = ServeRecord(self.sql)
        self.drains = DrainRows(self.sql)

    def beat_record(self) -> ServeRecord:
        """For `fleet serve`: a ServeRecord on a connection of its own, its transactions sent from a
        worker thread (deferred), which a follower also reads the leader's rows through."""
        conn = connect(self.url)
        return ServeRecord(PgSql(conn, self.where), deferred=True)

    def leader_lock(self) -> LeaderLock:
        return LeaderLock(lambda: connect(self.url))

    def notifier(self) -> Notifier:
        return Notifier(lambda: connect(self.url), (ServeRecord.CHANNEL, DrainRows.CHANNEL))

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SharedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class LeaderLock:
    """Leadership of `fleet serve`'s heartbeat: an advisory lock on a connection of its own, so
    that it ends the moment the leader's process dies (its connection closes) and another takes it.
    Blocking calls: run them in a thread (serve/leader.py does)."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self.conn: psycopg.Connection[Any] | None = None

    def try_take(self) -> bool:
        """Whether this process leads now (a lost connection is a lost lead: False, and reconnect)."""
        pg = _driver()
        try:
            if self.conn is None or self.conn.closed:
                self.conn = self._connect()
            row = self.conn.execute(f"SELECT pg_try_advisory_lock({KEY}, {LEAD})").fetchone()
            return row is not None and bool(row[0])
        except (pg.Error, StateError):
            self.close()
            return False

    def held(self) -> bool:
        """Whether the lock's session is still there (the lock lives exactly as long)."""
        pg = _driver()
        try:
            return self.conn is not None and self.conn.execute("SELECT 1").fetchone() is not None
        except pg.Error:
            self.close()
            return False

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


class Notifier:
    """LISTEN on a connection of its own, in a worker thread (psycopg's async API is asyncio's, not
    trio's); trio tasks wait for a channel's next notification, or count what they have seen."""

    POLL_S = 0.5  # how often the thread looks whether it should stop
    RECONNECT_S = 1.0

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]], channels: Sequence[str]) -> None:
        self._connect, self.channels = connect, tuple(channels)
        self.counts: dict[str, int] = defaultdict(int)
        self._events: dict[str, trio.Event] = {}
        self._stop = threading.Event()

    def _fire(self, channel: str) -> None:
        self.counts[channel] += 1
        event = self._events.pop(channel, None)
        if event is not None:
            event.set()

    async def wait(self, channel: str, limit: float) -> None:
        """Until the channel's next notification, or `limit` seconds."""
        event = self._events.setdefault(channel, trio.Event())
        with trio.move_on_after(limit):
            await event.wait()

    def watcher(self, channel: str) -> Callable[[], bool]:
        """changed() for one consumer: whether a notification came since its last call (first: True)."""
        seen = [-1]

        def check() -> bool:
            now = self.counts[channel]
            moved, seen[0] = now != seen[0], now
            return moved

        return check

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled. A lost connection is said in the log and made again after
        RECONNECT_S; meanwhile every channel counts as changed, and consumers poll."""
        pg = _driver()
        token = trio.lowlevel.current_trio_token()
        started = False
        while True:
            try:
                conn = await trio.to_thread.run_sync(self._connect)
                for channel in self.channels:
                    conn.execute(f"LISTEN {channel}")
            except (StateError, pg.Error) as exc:
                if not started:
                    raise
                log.warning("cannot listen to the state store again (%s); retrying in %gs", exc, self.RECONNECT_S)
                await trio.sleep(self.RECONNECT_S)
                continue
            if not started:
                task_status.started()
                started = True
            for channel in self.channels:  # whatever happened while nobody listened
                self._fire(channel)
            try:
                # Abandoned on cancel: the thread sees _stop within POLL_S and closes its connection.
                await trio.to_thread.run_sync(self._listen, conn, token, abandon_on_cancel=True)
            except pg.Error as exc:
                log.warning("lost the state store's notifications (%s); listening again in %gs", exc,
                            self.RECONNECT_S)
                await trio.sleep(self.RECONNECT_S)
            finally:
                self._stop.set()
                self._stop = threading.Event()

    def _listen(self, conn: psycopg.Connection[Any], token: trio.lowlevel.TrioToken) -> None:
        stop = self._stop
        try:
            while not stop.is_set():
                for note in conn.notifies(timeout=self.POLL_S):
                    trio.from_thread.run_sync(self._fire, note.channel, trio_token=token)
        except trio.RunFinishedError:
            pass
        finally:
            conn.close()
