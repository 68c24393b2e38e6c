"""Running a fleet day to day, on real agents, real engines and the real `fleet serve` and `fleet
apply` processes: drift seen by the heartbeat and cleared by an apply; a settings change on a
two-member cluster replaced one member at a time under client load, with no failed request."""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from tests.agents import SECRET, free_port
from tests.fleets import Fleet, chat, start_serve, stop_serve, three_node_fleet

pytestmark = pytest.mark.e2e

INTERVAL = 1.0  # seconds between beats: the drift test counts beats, not seconds


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Fleet, str]]:
    with three_node_fleet(tmp_path_factory.mktemp("day")) as f:
        listen = f"127.0.0.2:{free_port('127.0.0.2')}"
        f.write(replicas="  tiny: [a, b]", listen=listen, clusters=chat(f, "[a, b]", context=256))
        applied = f.run("apply", "--auto-approve")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        proc = start_serve(f, listen, interval=INTERVAL)
        try:
            yield f, f"http://{listen}"
        finally:
            stop_serve(proc)


def beats(base: str) -> int:
    return int(httpx.get(f"{base}/healthz", timeout=10).json()["beats"])


def drift(f: Fleet) -> list[dict[str, Any]]:
    alerts = json.loads(f.run("alerts", "--json", "--all").stdout)
    return [a for a in alerts if a["kind"] == "drift"]


def wait_beats(base: str, until: Any, limit: int) -> int:
    """Beats until `until()` holds; fails past `limit` beats."""
    start = beats(base)
    while not until():
        assert beats(base) - start <= limit, f"not within {limit} beats"
        time.sleep(0.1)
    return beats(base) - start


def test_a_server_stopped_behind_fleets_back_is_drift_until_applied(served: tuple[Fleet, str]) -> None:
    f, base = served
    assert wait_beats(base, lambda: all(a["cleared_at"] for a in drift(f)), 2) <= 2  # the apply matched the file
    before = len(drift(f))
    # Stopped through the agent's own API with the cluster secret: fleet is not told.
    stopped = httpx.delete(f"{f.agents['a'].url}/v1/servers/chat@a", headers={"Authorization": f"Bearer {SECRET}"},
                           timeout=30)
    assert stopped.status_code == 200, stopped.text
    open_alert = lambda: [a for a in drift(f)[before:] if a["cleared_at"] is None]  # noqa: E731
    wait_beats(base, open_alert, 2)
    (alert,) = open_alert()
    assert alert["node"] == "fleet"
    assert "Plan: 0 to replicate, 1 to start, 0 to replace, 0 to stop, 0 to delete." in alert["cause"]
    assert "start server.chat@a" in alert["cause"] and "chat@b" not in alert["cause"]
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    assert 'fleet_pending_changes{action="start"} 1.0' in metrics
    # The control plane acted on nothing: the server is still not there.
    assert all(s["id"] != "chat@a" or s["state"] != "running" for s in f.states()["a"]["servers"])
    applied = f.run("apply", "--auto-approve")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    wait_beats(base, lambda: not open_alert(), 2)
    assert drift(f)[before]["cleared_at"] is not None
    assert 'fleet_pending_changes{action="start"} 0.0' in httpx.get(f"{base}/metrics", timeout=10).text


class Load:
    """Streamed and non-streamed requests in a loop through the router, one thread each, every
    answer checked whole: a failure is a non-200, a transport error, or a stream that does not end
    with [DONE] or carries an error event."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.stop = threading.Event()
        self.ok = {"stream": 0, "plain": 0}
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self.loop, args=(stream,)) for stream in (True, False)]

    def loop(self, stream: bool) -> None:
        body = {"model": "chat", "messages": [{"role": "user", "content": "Say something"}], "max_tokens": 12,
                "temperature": 0, "stream": stream}
        with httpx.Client(timeout=120) as client:
            while not self.stop.is_set():
                try:
                    if stream:
                        with client.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                            text = r.read().decode()
                        good = r.status_code == 200 and text.rstrip().endswith("data: [DONE]") and '"error"' not in text
                    else:
                        r = client.post(f"{self.base}/v1/chat/completions", json=body)
                        text = r.text
                        good = r.status_code == 200 and bool(r.json()["choices"][0]["message"]["content"] is not None)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    good, text = False, f"{type(exc).__name__}: {exc}"
                if good:
                    self.ok["stream" if stream else "plain"] += 1
                else:
                    self.failures.append(f"{'stream' if stream else 'plain'}: {text[-400:]}")

    def wait_for(self, more: int, timeout: float = 60) -> None:
        """Until each loop has had `more` more answers, each checked whole (or has failed)."""
        start, deadline = dict(self.ok), time.monotonic() + timeout
        while any(self.ok[k] - start[k] < more for k in start) and not self.failures:
            assert time.monotonic() < deadline, (start, self.ok)
            time.sleep(0.05)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def test_a_settings_change_replaces_one_member_at_a_time_with_no_failed_request(served: tuple[Fleet, str]) -> None:
    f, base = served
    if drift(f) and any(a["cleared_at"] is None for a in drift(f)):  # the test before left it applied
        assert f.run("apply", "--auto-approve").returncode == 0
    pids = {n: next(s["pid"] for s in f.states()[n]["servers"] if s["id"] == f"chat@{n}") for n in ("a", "b")}
    f.write(replicas="  tiny: [a, b]", listen=base.removeprefix("http://"), clusters=chat(f, "[a, b]", context=512))
    with Load(base) as load:
        load.wait_for(4)  # both members serve before the change
        during = dict(load.ok)
        applied = f.run("apply", "--auto-approve")
        load.wait_for(4)  # and after it
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert load.failures == [], load.failures[:5]
    assert during["stream"] > 0 and during["plain"] > 0
    assert load.ok["stream"] > during["stream"] and load.ok["plain"] > during["plain"]
    # One at a time: a drained, replaced and admitted before b was drained.
    lines = [line for line in applied.stderr.splitlines() if "⇄" in line]
    order = [(m, n) for line in lines for m in ("draining", "back in routing") for n in ("chat@a", "chat@b")
             if m in line and n in line]
    assert order == [("draining", "chat@a"), ("back in routing", "chat@a"), ("draining", "chat@b"),
                     ("back in routing", "chat@b")], applied.stderr
    after = {n: next(s for s in f.states()[n]["servers"] if s["id"] == f"chat@{n}") for n in ("a", "b")}
    assert all(after[n]["settings"]["context_length"] == 512 and after[n]["pid"] != pids[n] for n in after)
    assert "replace server.chat@a" in applied.stdout and "context_length 256 → 512" in applied.stdout
