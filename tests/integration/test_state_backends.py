"""The state store on both backends, from one suite: the apply lock and its holder, migrations of an
older store and refusal of a newer one, alerts raised once, drains that count only while their
apply lives; on PostgreSQL also a lock that ends with its session, NOTIFY, and leadership."""

from __future__ import annotations

import functools
import sqlite3
import time
from pathlib import Path
from typing import Awaitable, Callable, Iterator

import pytest
import trio

from reconciler.state.backend import Store, open_state, sqlite_url
from reconciler.state.sql import StateError
from reconciler.state.sql import LATEST
from reconciler.state.store import Drain, LockHeld, ServeRecord
from tests.postgres import Server

Opener = Callable[[], Store]


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(dialect, URL of a fresh store): a state directory, or a fresh database on the session's server."""
    if request.param == "sqlite":
        yield "sqlite", sqlite_url(tmp_path / "state")
    else:
        server: Server = request.getfixturevalue("postgres")
        yield "postgresql", server.fresh_url()


@pytest.fixture
def opened(backend: tuple[str, str]) -> Iterator[Opener]:
    stores: list[Store] = []

    def open_one() -> Store:
        stores.append(open_state(backend[1]))
        return stores[-1]

    yield open_one
    for s in stores:
        s.close()


def test_one_apply_holds_the_lock_and_the_refused_one_is_told_who(opened: Opener) -> None:
    a, b = opened(), opened()
    lock, taken = a.applies.acquire("fleet apply plan.json")
    assert taken is None
    with pytest.raises(LockHeld) as refused:
        b.applies.acquire("fleet apply")
    assert refused.value.holder == lock and "fleet apply plan.json" in str(refused.value)
    assert b.applies.holder() == lock
    assert a.applies.release(lock.id)
    mine, _ = b.applies.acquire("fleet apply")
    assert b.applies.holder() == mine


def test_postgresql_lock_ends_with_its_session(backend: tuple[str, str], opened: Opener) -> None:
    if backend[0] != "postgresql":
        pytest.skip("SQLite's lock is a row checked by PID on one host (tests/e2e/test_plan_apply.py)")
    holder = opened()
    lock, _ = holder.applies.acquire("fleet apply (killed)")
    waiter = opened()
    assert not waiter.applies.releasable(lock)
    holder.close()  # what a SIGKILL does to the connection
    mine, taken = waiter.applies.acquire("fleet apply")
    assert taken == lock and mine.id != lock.id


def test_an_older_store_is_migrated_and_a_newer_one_refused(backend: tuple[str, str], opened: Opener,
                                                          tmp_path: Path) -> None:
    dialect, url = backend
    if dialect == "sqlite":  # a store as fleet wrote it before the version table, two open alerts alike
        path = tmp_path / "state"
        path.mkdir()
        db = sqlite3.connect(path / "fleet.sqlite")
        db.executescript("CREATE TABLE lock (one INTEGER PRIMARY KEY, id TEXT, host TEXT, pid INTEGER, user TEXT, "
                         "since TEXT, command TEXT); CREATE TABLE alerts (id INTEGER PRIMARY KEY AUTOINCREMENT, "
                         "node TEXT NOT NULL, kind TEXT NOT NULL, cause TEXT NOT NULL, raised_at TEXT NOT NULL, "
                         "cleared_at TEXT); INSERT INTO alerts (node, kind, cause, raised_at) VALUES "
                         "('a', 'node_offline', 'x', 'T1'), ('a', 'node_offline', 'y', 'T2');")
        db.commit()
        db.close()
        store = opened()
        assert [(x["cause"], x["raised_at"]) for x in store.serve.alerts()] == [("x", "T1")]
    else:
        store = opened()
    assert store.sql.execute("SELECT version FROM schema_version").fetchall() == [(LATEST,)]
    store.sql.execute("UPDATE schema_version SET version = ?", (LATEST + 1,))
    with pytest.raises(StateError) as refused:
        opened()
    assert refused.value.code == "state_too_new" and f"schema version {LATEST + 1}" in str(refused.value)
    assert "upgrade fleet" in str(refused.value)


def test_an_alert_is_open_once_whoever_raises_it(opened: Opener) -> None:
    a, b = opened().serve, opened().serve
    with a.transaction():
        a.raise_alert("n1", "node_offline", "E: down", "T1")
    b.raise_alert("n1", "node_offline", "E: down", "T2")
    # The second writer may not see the first's row before it inserts: the store keeps one anyway.
    b.sql.execute("INSERT INTO alerts (node, kind, cause, raised_at) VALUES (?,?,?,?) "
                  "ON CONFLICT (node, kind) WHERE cleared_at IS NULL DO NOTHING", ("n1", "node_offline", "E", "T3"))
    assert [(x["node"], x["raised_at"]) for x in b.alerts()] == [("n1", "T1")]
    assert b.clear_alert("n1", "node_offline", "T4") and not a.clear_alert("n1", "node_offline", "T5")


def test_node_rows_written_by_one_are_read_by_another(opened: Opener) -> None:
    writer, reader = opened().serve, opened().serve
    with writer.transaction():
        writer.put_node("n1", "online", "T1", state={"servers": []}, error=None)
        writer.put_server_row({"id": "c@n1", "cluster": "c", "node": "n1", "model": "m", "port": 1,
                               "state": "running", "reason": None}, "T1")
    assert reader.node_states() == [("n1", "online", '{"servers": []}')]
    assert [r["state"] for r in reader.server_rows()] == ["running"]


def test_drains_count_only_while_their_apply_holds_the_lock(opened: Opener) -> None:
    apply, serve = opened(), opened()
    lock, _ = apply.applies.acquire("fleet apply")
    apply.drains.ask(Drain("c@n1", "n1", "c", lock.id, "drain", 30.0, "T1"))
    assert [d.server_id for d in serve.drains.active()] == ["c@n1"]
    apply.applies.release(lock.id)
    assert serve.drains.active() == []


def test_postgresql_notifies_a_committed_beat(backend: tuple[str, str], opened: Opener) -> None:
    if backend[0] != "postgresql":
        pytest.skip("SQLite has no notifications: serve polls PRAGMA data_version")
    from reconciler.state.pg import SharedStore

    listener, writer = opened(), opened()
    assert isinstance(listener, SharedStore)
    notifier = listener.notifier()
    seen: list[float] = []

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(notifier.run)
            changed = notifier.watcher(ServeRecord.CHANNEL)
            changed()
            with writer.serve.transaction():
                writer.serve.touch_online("T1")  # stamps only: nobody is told
            with trio.move_on_after(0.3):
                await notifier.wait(ServeRecord.CHANNEL, 0.3)
            assert not changed()
            start = trio.current_time()
            with writer.serve.transaction():
                writer.serve.put_node("n1", "offline", "T2", state=None, error="E")
            await notifier.wait(ServeRecord.CHANNEL, 5)
            seen.append(trio.current_time() - start)
            assert changed()
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert seen[0] < 1.0, seen


def test_postgresql_leadership_passes_when_the_leader_goes(backend: tuple[str, str], opened: Opener) -> None:
    if backend[0] != "postgresql":
        pytest.skip("one fleet serve per SQLite store")
    from reconciler.state.pg import SharedStore

    store = opened()
    assert isinstance(store, SharedStore)
    first, second = store.leader_lock(), store.leader_lock()
    assert first.try_take() and first.held()
    assert not second.try_take()
    first.close()  # the leader's process dies: its connection with it
    gone = time.monotonic()
    while not second.try_take():  # the server ends the session a few milliseconds after the socket
        assert time.monotonic() - gone < 1.0
        time.sleep(0.005)


def test_a_bad_url_is_a_coded_refusal(tmp_path: Path) -> None:
    for url, code in (("mysql://x/y", "state_url_invalid"), ("sqlite:///", "state_url_invalid"),
                      ("postgresql://nobody@127.0.0.1:1/none", "state_unreachable")):
        with pytest.raises(StateError) as refused:
            open_state(url)
        assert refused.value.code == code, (url, refused.value)




def _fleet(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    from reconciler.cli.main import run

    code = run(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_the_commands_find_the_store_named_in_the_fleet_file(backend: tuple[str, str], opened: Opener,
                                                            tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEET_STATE_URL", raising=False)
    opened().serve.raise_alert("gpu-a", "node_offline", "E: down", "T1")
    path = tmp_path / "fleet.yaml"
    path.write_text(f"version: 1\ncontrol_plane: {{node: cp, state: '{backend[1]}'}}\n"
                    "nodes:\n  cp: {address: 127.0.0.2}\n")
    code, out, err = _fleet(capsys, "alerts", "-f", str(path))
    assert code == 0 and "node_offline gpu-a raised T1 (OPEN)" in out, out + err
    code, out, _ = _fleet(capsys, "alerts", "--state", backend[1])
    assert code == 0 and "gpu-a" in out


def test_a_password_in_the_fleet_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fleet.yaml"
    for url in ("postgresql://fleet:hunter2@db/fleet", "postgresql://fleet@db/fleet?password=hunter2"):
        path.write_text(f"version: 1\ncontrol_plane: {{node: cp, state: '{url}'}}\nnodes:\n  cp: {{address: 127.0.0.2}}\n")
        code, out, err = _fleet(capsys, "validate", "-f", str(path))
        assert code == 3 and "state_password_in_file" in out + err and "control_plane.state" in out + err


def test_unlock_refuses_a_lock_whose_session_lives(backend: tuple[str, str], opened: Opener,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    lock, _ = opened().applies.acquire("fleet apply (still running)")
    code, out, err = _fleet(capsys, "unlock", lock.id, "--state", backend[1])
    if backend[0] == "sqlite":  # the row is the lock: released, as fleet unlock always did
        assert code == 0 and "released the lock" in err
    else:
        assert code == 5 and "still open" in err and "still running" in err, err


def test_postgresql_beat_writes_wait_for_the_flush(backend: tuple[str, str], opened: Opener) -> None:
    if backend[0] != "postgresql":
        pytest.skip("SQLite writes a beat at once, on the event loop (it costs no round trips)")
    from reconciler.state.pg import SharedStore

    store, reader = opened(), opened()
    assert isinstance(store, SharedStore)
    record = store.beat_record()
    with record.transaction():
        record.put_node("n1", "online", "T1", state={"servers": []}, error=None)
        record.raise_alert("n2", "node_offline", "E: down", "T1")
    assert reader.serve.node_states() == [] and reader.serve.alerts() == []  # kept, not sent
    trio.run(record.flush)
    assert reader.serve.node_states() == [("n1", "online", '{"servers": []}')]
    assert [a["node"] for a in reader.serve.alerts()] == ["n2"]
    record.sql.write_batch([])  # nothing kept: nothing sent, and the connection still usable


def test_a_drain_meets_serve_through_the_store(backend: tuple[str, str], opened: Opener) -> None:
    """apply's Drainer and serve's DrainWatcher, each on its own connection, as fleet serve wires
    them (serve/run.py): on PostgreSQL woken by NOTIFY, on SQLite looking every 250 ms when idle."""
    from reconciler.applying.drain import Drainer
    from reconciler.planning.plan import Action, Change
    from reconciler.serve.drains import DrainWatcher
    from reconciler.serve.heartbeat import View
    from reconciler.serve.run import SQLITE_IDLE_S
    from reconciler.state.pg import SharedStore
    from reconciler.state.store import DrainRows

    apply, serve = opened(), opened()
    lock, _ = apply.applies.acquire("fleet apply")
    view, refreshed, seen_after = View(), [], []
    notes: list[str] = []
    change = Change(Action.REPLACE, "server.chat@a", "a", "changed", details={"server_id": "chat@a", "cluster": "chat"})

    async def refresh(nodes: object) -> None:
        refreshed.append(nodes)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            wait: Callable[[float], Awaitable[None]]
            if isinstance(serve, SharedStore):
                notifier = serve.notifier()
                await nursery.start(notifier.run)
                serve.sql.watch = notifier.watcher(DrainRows.CHANNEL)
                wait = lambda limit: notifier.wait(DrainRows.CHANNEL, limit)  # noqa: E731
            else:
                wait = lambda limit: trio.sleep(SQLITE_IDLE_S)  # noqa: E731
            watcher = DrainWatcher(serve.drains, view, lambda sid: 0, refresh, wait=wait)
            await nursery.start(watcher.run)
            await trio.sleep(0.3)  # idle: the watcher waits
            asked = trio.current_time()
            drainer = Drainer(apply.drains, lock.id, poll_s=0.01)
            async with drainer.around(change, notes.append):
                seen_after.append(trio.current_time() - asked)
                assert "chat@a" in view.draining
            assert "chat@a" not in view.draining and refreshed == [["a"]]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert notes == ["draining chat@a: 0 request(s) in flight, new ones go to the other members",
                     "drained chat@a: no request in flight", "chat@a is back in routing"]
    print(f"{backend[0]}: drain asked to drained and acknowledged in {seen_after[0] * 1000:.0f} ms")
    limit = 0.25 if backend[0] == "postgresql" else SQLITE_IDLE_S + 0.25
    assert seen_after[0] < limit, seen_after


def test_psycopg_is_loaded_only_for_a_postgresql_url(tmp_path: Path) -> None:
    """The core install has no psycopg: a SQLite store never imports it, and a postgresql:// URL
    without it is a coded refusal naming the extra (the import made to fail in a fresh interpreter)."""
    import subprocess
    import sys

    script = ("import sys\nfrom reconciler.cli.main import run\n"
              f"code = run(['alerts', '--state-dir', {str(tmp_path)!r}])\n"
              "assert code == 0 and 'psycopg' not in sys.modules, (code, [m for m in sys.modules if 'psyco' in m])\n"
              "sys.modules['psycopg'] = None  # as if not installed\n"
              "sys.exit(run(['alerts', '--json', '--state', 'postgresql://fleet@127.0.0.1:1/fleet']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stdout + done.stderr
    assert '"code": "postgres_driver_missing"' in done.stdout and "inference-fleet[postgres]" in done.stdout, done.stdout


def test_with_two_serves_drained_waits_for_the_followers_requests(backend: tuple[str, str], opened: Opener) -> None:
    """The leader answers for all: a member is drained once the follower, which took it out of
    routing too, has no request in flight on it either."""
    if backend[0] != "postgresql":
        pytest.skip("one fleet serve per SQLite store")
    from reconciler.applying.drain import Drainer
    from reconciler.planning.plan import Action, Change
    from reconciler.serve.drains import DrainWatcher
    from reconciler.serve.heartbeat import View
    from reconciler.state.pg import SharedStore

    apply, leader, follower = opened(), opened(), opened()
    assert isinstance(leader, SharedStore) and isinstance(follower, SharedStore)
    leader.sql.name_serve("leader")
    follower.sql.name_serve("follower")
    lock, _ = apply.applies.acquire("fleet apply")
    views, flying = (View(), View()), {"follower": 1}
    change = Change(Action.REPLACE, "server.chat@a", "a", "changed", details={"server_id": "chat@a", "cluster": "chat"})
    notes: list[str] = []

    async def refresh(nodes: object) -> None:
        pass

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            for store, view, name in ((leader, views[0], "leader"), (follower, views[1], "follower")):
                counted: Callable[[str], int] = functools.partial(lambda who, sid: flying.get(who, 0), name)
                leads: Callable[[], bool] = functools.partial(lambda who: who == "leader", name)
                watcher = DrainWatcher(store.drains, view, counted, refresh, answers=leads, name=name)
                await nursery.start(watcher.run)

            async def finish() -> None:
                await trio.sleep(0.5)
                flying["follower"] = 0

            nursery.start_soon(finish)
            started = trio.current_time()
            async with Drainer(apply.drains, lock.id, poll_s=0.01).around(change, notes.append):
                assert "chat@a" in views[0].draining and "chat@a" in views[1].draining
                assert trio.current_time() - started >= 0.5  # waited for the follower's request
            await trio.sleep(0.2)
            assert "chat@a" not in views[1].draining  # the follower routes to it again once admitted
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert notes[0].startswith("draining chat@a: "), notes  # acknowledged before the follower's count came
    assert notes[1:] == ["drained chat@a: no request in flight", "chat@a is back in routing"]


def test_an_apply_whose_session_ended_is_told_before_it_applies(backend: tuple[str, str], opened: Opener) -> None:
    apply, other = opened(), opened()
    lock, _ = apply.applies.acquire("fleet apply")
    apply.applies.confirm()  # held: nothing to say
    if backend[0] == "sqlite":
        return  # the row is the lock until released
    other.sql.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ?",
                      ("fleet-apply:" + lock.id,))
    with pytest.raises(StateError) as lost:
        apply.applies.confirm()
    assert lost.value.code == "state_lost" and "lost the connection to the state store" in str(lost.value)
    assert not apply.applies.release(lock.id)  # nothing left to release: the lock went with the session
    mine, taken = other.applies.acquire("fleet apply")
    assert taken == lock


def test_a_password_never_reaches_a_message() -> None:
    from reconciler.state.pg import redact

    assert redact("postgresql://fleet:hunter2@db:5432/fleet") == "postgresql://fleet:***@db:5432/fleet"
    assert redact("postgresql://fleet@db/fleet?sslmode=require&password=hunter2") == \
        "postgresql://fleet@db/fleet?sslmode=require&password=***"
    assert redact("sqlite:///var/lib/fleet") == "sqlite:///var/lib/fleet"
    with pytest.raises(StateError) as refused:
        open_state("postgresql://fleet:hunter2@127.0.0.1:1/fleet")
    assert "hunter2" not in str(refused.value) and refused.value.code == "state_unreachable"
