"""agent/transfer/rates.py: recent fetch rates per peer, bounded, kept across restarts, never fatal."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

from agent.transfer.rates import MIN_BYTES, Rates, peer_key

MB = 1_000_000


def clock() -> datetime:
    return datetime(2026, 12, 1, 1, 0, tzinfo=timezone.utc)


def test_rate_is_bytes_over_seconds_of_the_last_few(tmp_path: Path) -> None:
    r = Rates(tmp_path / "rates.json", keep=3, clock=clock)
    for seconds in (1.0, 100.0, 2.0, 2.0, 4.0):  # the slow one falls out of the last three
        assert r.record("http://10.0.0.1:7070/", 100 * MB, seconds)
    [rate] = r.to_json()
    assert rate == {"peer": "10.0.0.1:7070", "bytes_per_s": 300 * MB // 8, "samples": 3,
                    "last_bytes_per_s": 25 * MB, "measured_at": "2026-12-01T01:00:00+00:00"}


def test_too_small_a_fetch_measures_nothing(tmp_path: Path) -> None:
    r = Rates(tmp_path / "rates.json")
    assert not r.record("http://10.0.0.1:7070", MIN_BYTES - 1, 0.01) and not r.record("10.0.0.1:7070", MB * 9, 0)
    assert r.to_json() == [] and not (tmp_path / "rates.json").exists()


def test_peers_are_bounded_least_recent_first_and_kept_across_restarts(tmp_path: Path) -> None:
    r = Rates(tmp_path / "rates.json", peers=2, clock=clock)
    for host in ("a", "b", "a", "c"):
        r.record(f"https://{host}:7070", 10 * MB, 1.0)
    assert [x["peer"] for x in r.to_json()] == ["a:7070", "c:7070"]
    assert Rates(tmp_path / "rates.json", peers=2).to_json() == r.to_json()


def test_an_unreadable_file_starts_empty(tmp_path: Path) -> None:
    (tmp_path / "rates.json").write_text("{not json")
    assert Rates(tmp_path / "rates.json").to_json() == []
    (tmp_path / "rates.json").write_text('{"a:1": [{"bytes": "x"}]}')
    assert Rates(tmp_path / "rates.json").to_json() == []


def test_peer_key_matches_the_planners_address_and_port() -> None:
    assert peer_key("http://10.0.0.2:7070") == "10.0.0.2:7070"
    assert peer_key("https://[fd00::1]:7443/") == "[fd00::1]:7443"
    assert peer_key("node-a:7070") == "node-a:7070"
