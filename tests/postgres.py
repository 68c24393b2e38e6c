"""A real PostgreSQL for the tests: initdb in a temporary directory owned by `postgres`, started with
pg_ctl on a free loopback port, one per test session, stopped at the end; where the server is not
installed (or cannot be started) the tests that need it are skipped, saying why."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

BIN_DIRS = [Path(os.environ.get("FLEET_PG_BIN", "/usr/lib/postgresql/15/bin"))]


@dataclass(frozen=True, slots=True)
class Server:
    """A running server: `url()` names a fresh database on it (each test gets its own)."""

    host: str
    port: int
    base: Path

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{db}"

    def fresh_url(self) -> str:
        import psycopg

        name = "t_" + uuid.uuid4().hex[:12]
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")  # a name made here: nothing to quote
        return self.url(name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def why_not() -> str | None:
    """Why no server can be started here (None: it can)."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install -e '.[postgres]')"
    bindir = next((d for d in BIN_DIRS if (d / "initdb").exists()), None)
    if bindir is None:
        return f"PostgreSQL is not installed here (no initdb in {', '.join(map(str, BIN_DIRS))}; set FLEET_PG_BIN)"
    if os.geteuid() == 0 and shutil.which("runuser") is None:
        return "running as root without runuser: initdb refuses root"
    return None


def _as_postgres(argv: list[str]) -> list[str]:
    # initdb and postgres refuse to run as root; as another user they run as that user.
    return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv


def start() -> Iterator[Server]:
    """Start a server, yield it, stop it and remove its directory (a generator for a fixture)."""
    bindir = next(d for d in BIN_DIRS if (d / "initdb").exists())
    base = Path(tempfile.mkdtemp(prefix="fleet-pg-"))
    data, port = base / "data", _free_port()
    if os.geteuid() == 0:
        shutil.chown(base, "postgres", "postgres")
    try:
        subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres",
                                     "--no-sync", "-E", "UTF8"]), check=True, capture_output=True, timeout=120)
        opts = (f"-h 127.0.0.1 -p {port} -k {base} -c fsync=off -c synchronous_commit=off "
                "-c full_page_writes=off -c max_connections=200")
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(base / "log"), "-w",
                                     "-t", "60", "-o", opts, "start"]), check=True, capture_output=True, timeout=90)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        log = (base / "log").read_text(errors="replace")[-2000:] if (base / "log").exists() else ""
        shutil.rmtree(base, ignore_errors=True)
        raise RuntimeError(f"cannot start PostgreSQL: {exc}\n{getattr(exc, 'stderr', b'')!r}\n{log}") from None
    try:
        yield Server("127.0.0.1", port, base)
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)
