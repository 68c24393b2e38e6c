"""The agent's own API refuses new work outside its availability window (409 with a stable code
naming the window), whoever asks; inside it, the same requests go on. In process, at chosen instants."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import pytest
import trio

from agent.app import assemble, create_app
from agent.machine.identity import Identity
from agent.machine.inventory import NoGpus
from agent.backends.launch import ProcessLauncher
from wire.windows import Window

TZ = timezone(timedelta(hours=2))
DIGEST = "sha256:" + "3" * 64
AUTH = {"Authorization": "Bearer " + "s" * 16}


def ask(tmp_path: Path, now: datetime, method: str, path: str, body: dict[str, object]) -> httpx.Response:
    ident = Identity(id="a" * 32, name="gpu-a", enrolled_at="2026-01-01T00:00:00+00:00", agent_version="t")
    ctx = assemble(tmp_path, ident, b"s" * 16, "t", NoGpus("none"), ProcessLauncher(),
                   windows=(Window.parse("19:00-07:00"),), clock=lambda: now, verify_every_s=None)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(ctx)), base_url="http://a") as c:
            return await c.request(method, path, json=body, headers=AUTH)
    return trio.run(go)


@pytest.mark.parametrize("method, path, body", [
    ("PUT", f"/v1/weights/{DIGEST}", {"peer": "not a url"}),
    ("POST", "/v1/servers", {"id": "chat@gpu-a", "model": DIGEST, "port": 9001}),
], ids=["fetch", "start"])
def test_new_work_is_refused_outside_the_window_only(tmp_path: Path, method: str, path: str,
                                                     body: dict[str, object]) -> None:
    r = ask(tmp_path, datetime(2026, 11, 30, 12, 0, tzinfo=TZ), method, path, body)
    assert r.status_code == 409 and r.json()["error"]["code"] == "outside_availability_window"
    assert r.json()["error"]["message"] == ("gpu-a is outside its availability window (19:00-07:00) at its local "
                                            "time 12:00; no new work starts before 2026-11-30T19:00:00+02:00")
    inside = ask(tmp_path, datetime(2026, 11, 30, 23, 30, tzinfo=TZ), method, path, body)
    # Inside, the request goes on to its own checks (a bad peer; a model not held).
    assert inside.json()["error"]["code"] in ("bad_peer", "model_not_held"), inside.text


def test_a_fetch_that_would_end_after_the_window_closes_is_refused(tmp_path: Path) -> None:
    """At 06:50 with the window closing at 07:00, 1 GB at the 1 MB/s this agent measured from the
    peer takes ~17 min: refused (the planner's figure, sent as `bytes`); 100 MB takes 100 s: fetched."""
    from agent.transfer.rates import Rates

    (tmp_path / "store").mkdir()
    Rates(tmp_path / "store" / "link-rates.json").record("http://10.0.0.1:7070", 50_000_000, 50.0)
    now = datetime(2026, 11, 30, 6, 50, tzinfo=TZ)
    r = ask(tmp_path, now, "PUT", f"/v1/weights/{DIGEST}", {"peer": "http://10.0.0.1:7070", "bytes": 1_000_000_000})
    assert r.status_code == 409 and r.json()["error"]["code"] == "replication_exceeds_window", r.text
    assert r.json()["error"]["message"] == (
        "fetching 1,000,000,000 bytes from http://10.0.0.1:7070 takes ~1000 s at the rate gpu-a measured, ending "
        "07:06, after its availability window (19:00-07:00) closes at 07:00")
    fits = ask(tmp_path, now, "PUT", f"/v1/weights/{DIGEST}", {"peer": "http://10.0.0.1:7070", "bytes": 100_000_000})
    assert fits.status_code == 202, fits.text
