"""Fetcher.discard: what a failed fetch kept for a resume is removed, unless a running fetch writes it too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.transfer.fetch import Fetcher, Job
from agent.weights.store import Store


def fetcher(tmp_path: Path) -> Fetcher:
    def spawn(*_: Any) -> None:
        raise AssertionError("no fetch is started here")
    return Fetcher(Store(tmp_path / "store"), "secret", spawn, reserve=0)


def part(f: Fetcher, name: str, size: int) -> Path:
    p = f.store.partial / name
    p.write_bytes(b"x" * size)
    return p


def test_a_failed_fetchs_parts_go_but_one_a_running_fetch_shares_stays(tmp_path: Path) -> None:
    f = fetcher(tmp_path)
    own, shared = part(f, "a" * 64 + ".part", 3000), part(f, "b" * 64 + ".part", 500)
    f.jobs["sha256:" + "1" * 64] = Job(digest="sha256:" + "1" * 64, peer="http://p", name="m", state="failed",
                                       parts=[own, shared, f.store.partial / ("c" * 64 + ".part")])
    f.jobs["sha256:" + "2" * 64] = Job(digest="sha256:" + "2" * 64, peer="http://p", name="n", parts=[shared])
    assert f.discard("sha256:" + "1" * 64) == 3000  # a part already gone is no error
    assert not own.exists() and shared.exists()
    assert "sha256:" + "1" * 64 not in f.jobs
    assert f.discard("sha256:" + "1" * 64) is None  # forgotten: nothing to discard


def test_only_a_failed_fetch_is_discarded(tmp_path: Path) -> None:
    f = fetcher(tmp_path)
    kept = part(f, "d" * 64 + ".part", 10)
    for state in ("fetching", "present"):
        f.jobs["sha256:" + "3" * 64] = Job(digest="sha256:" + "3" * 64, peer="http://p", name="m", state=state,
                                           parts=[kept])
        assert f.discard("sha256:" + "3" * 64) is None
        assert kept.exists() and "sha256:" + "3" * 64 in f.jobs
    assert f.discard("sha256:" + "4" * 64) is None
