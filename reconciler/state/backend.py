"""Which state store a command uses, chosen by URL: `sqlite:///DIR` (the embedded default, the
state directory) or `postgresql://...` (shared by every machine that applies or serves), from
--state, --state-dir, FLEET_STATE_URL, control_plane.state or FLEET_STATE_DIR, in that order;
opened, and every reason it cannot be turned into a StateError with a stable code."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from reconciler.state.pg import redact
from reconciler.state.sql import Sql, StateError, StoreTooNew
from reconciler.state.drains import DrainRows
from reconciler.state.store import ApplyLedger, ServeRecord, StateStore, default_state_dir

ENV = "FLEET_STATE_URL"
SCHEMES = ("sqlite", "postgresql", "postgres")


class Store(Protocol):
    """Either store: the three halves over one connection (state_store.StateStore, state_pg.SharedStore)."""

    shared: bool
    applies: ApplyLedger
    serve: ServeRecord
    drains: DrainRows

    @property
    def sql(self) -> Sql: ...
    def close(self) -> None: ...
    def __enter__(self) -> Any: ...
    def __exit__(self, *exc: object) -> None: ...


def resolve(flag: str | None, state_dir: str | None, in_file: str | None = None) -> str:
    """The URL to open: the command line first, then the environment, then the fleet file."""
    if flag:
        return flag
    if state_dir:
        return sqlite_url(Path(state_dir))
    return os.environ.get(ENV) or in_file or sqlite_url(default_state_dir())


def sqlite_url(state_dir: Path) -> str:
    return f"sqlite:///{state_dir.absolute().as_posix().lstrip('/')}"


def check_url(url: str) -> str | None:
    """Why this URL cannot name a store (None: it can). A password is allowed here (from the
    environment); config.py refuses one written in fleet.yaml."""
    scheme = urlsplit(url).scheme
    if scheme not in SCHEMES:
        return (f"the state URL {redact(url)!r} is neither sqlite:///DIR nor postgresql://HOST/DB "
                f"(its scheme is {scheme or 'missing'!r})")
    if scheme == "sqlite" and not urlsplit(url).path.strip("/"):
        return f"the state URL {url!r} names no directory: sqlite:///ABSOLUTE/DIR"
    return None


def open_state(url: str) -> Store:
    """The store at `url`, migrated to this fleet's schema. Raises StateError."""
    problem = check_url(url)
    if problem is not None:
        raise StateError("state_url_invalid", problem,
                         hint=f"--state URL, {ENV}, or control_plane.state in fleet.yaml")
    parts = urlsplit(url)
    try:
        if parts.scheme == "sqlite":
            where = Path("/" + unquote(parts.path).lstrip("/"))
            try:
                return StateStore(where)
            except (OSError, sqlite3.Error) as exc:
                raise StateError("state_dir_unusable", f"cannot use the state directory {where}: {exc}",
                                 hint="give another with --state-dir DIR or FLEET_STATE_DIR") from None
        from reconciler.state.pg import SharedStore

        return SharedStore(url)
    except StoreTooNew as exc:
        raise StateError("state_too_new", str(exc), hint="every fleet that shares a store must be as new as the "
                         "newest that wrote it") from None
