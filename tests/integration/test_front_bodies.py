"""`fleet serve` as a process, sent bodies it must not take in: a flood of large POSTs without an
API key (401 from the head, the body never read), bodies over the limit with a key (413 from
Content-Length before reading, and while reading a chunked one), the limit as a setting, and
`/v1/models` naming clusters, never the nodes that serve them. (Before: 20 clients posting 31 MiB
without a key grew fleet serve from 58 to 709 MB, the 401 came only after each body was read
whole, and the memory stayed held after they left; the limit was 32 MiB; `/v1/models` listed
each cluster's member nodes to any key holder.)

The fleet is test_front_limits.py's (simulated agents cp and gpu-a, chat@gpu-a started by a real
`fleet apply`, a stand-in worker streaming `t0 t1 ...`)."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time

import httpx
import pytest

from tests.agents import agent_env
from tests.conftest import fleet_bin
from tests.integration.test_front_limits import KEYS, Fleet, Served, fleet, streamed_text  # noqa: F401 (fixture)

pytestmark = pytest.mark.e2e

KEY = "k-body"
BIG = 31 << 20  # the hostile review's body
LIMIT = 4 << 20  # http1.Limits.max_body's default


def with_keys(fleet: Fleet, env: dict[str, str] | None = None) -> Served:
    return fleet.serve(f", api_keys_env: {KEYS}", env={KEYS: KEY, **(env or {})})


def address(served: Served) -> tuple[str, int]:
    host, port = served.base.removeprefix("http://").split(":")
    return host, int(port)


def head(length: int | None, key: str | None = None, path: str = "/v1/chat/completions") -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if length is None else b"Content-Length: %d\r\n" % length
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    return b"POST %s HTTP/1.1\r\nHost: fleet\r\nContent-Type: application/json\r\n%s%s\r\n" % (
        path.encode(), auth, framing)


def post_big(served: Served, request_head: bytes, *, chunked: bool = False) -> tuple[int, bytes]:
    """Send `request_head`, then up to BIG bytes of body as fast as the server takes them; (bytes
    of body the client got into its socket before the server closed, what it answered)."""
    sock = socket.create_connection(address(served), timeout=10)
    sent = 0
    try:
        sock.sendall(request_head)
        piece = b'{"model": "chat", "messages": [{"role": "user", "content": "' + b"x" * (64 << 10)
        try:
            while sent < BIG:
                part = piece[:BIG - sent]  # never past the Content-Length
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                sent += len(part)
        except OSError:  # reset or broken pipe: the server closed without reading the rest
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return sent, answer
    finally:
        sock.close()


def error_of(answer: bytes) -> tuple[int, str]:
    status = int(answer.split(b" ", 2)[1])
    body = json.loads(answer.partition(b"\r\n\r\n")[2])
    assert body["error"]["type"] == "fleet_error", body  # the router's JSON error shape
    return status, body["error"]["code"]


def test_a_flood_without_a_key_is_refused_from_the_head_and_no_body_is_taken_in(fleet: Fleet) -> None:
    served = with_keys(fleet)
    try:
        assert streamed_text(served, headers={"Authorization": f"Bearer {KEY}"}) == "t0 t1 t2 "
        baseline = served.rss_mb()
        results: list[tuple[int, bytes]] = []
        peak = [baseline]
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], served.rss_mb())
                time.sleep(0.02)

        def client() -> None:
            results.append(post_big(served, head(BIG)))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        clients = [threading.Thread(target=client) for _ in range(20)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
        done.set()
        watcher.join(5)
        assert len(results) == 20
        for sent, answer in results:
            assert sent < BIG // 2, f"the client sent {sent} of {BIG} bytes: the server read the body"
            assert error_of(answer) == (401, "invalid_api_key"), answer[:300]
        after = served.rss_mb()
        print(f"RSS {baseline:.0f} MB, peak {peak[0]:.0f} MB, after {after:.0f} MB")
        # 20 x 31 MiB read whole was +650 MB; what is left is a few lingering reads of 64 KiB.
        assert peak[0] - baseline < 40, f"RSS {baseline:.0f} MB -> {peak[0]:.0f} MB"
        assert after - baseline < 20, f"RSS {baseline:.0f} MB -> {after:.0f} MB after"
        assert streamed_text(served, headers={"Authorization": f"Bearer {KEY}"}) == "t0 t1 t2 "
        assert httpx.get(served.base + "/healthz", timeout=5).status_code == 200  # open without a key
    finally:
        served.stop()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_and_is_not_read_past_it(fleet: Fleet, chunked: bool) -> None:
    served = with_keys(fleet)
    try:
        sent, answer = post_big(served, head(None if chunked else BIG, KEY), chunked=chunked)
        assert error_of(answer) == (413, "body_too_large"), answer[:300]
        assert f"over {LIMIT} bytes".encode() in answer
        # From Content-Length nothing of it is read; a chunked one is read up to the limit.
        assert sent < BIG // 2, f"the client sent {sent} of {BIG} bytes"
        assert streamed_text(served, headers={"Authorization": f"Bearer {KEY}"}) == "t0 t1 t2 "
    finally:
        served.stop()


def test_the_body_limit_is_a_setting_and_a_bad_one_refuses_to_serve(fleet: Fleet) -> None:
    served = with_keys(fleet, {"FLEET_MAX_REQUEST_BODY": "2048"})
    try:
        auth = {"Authorization": f"Bearer {KEY}"}
        over = httpx.post(served.base + "/v1/chat/completions", headers=auth, timeout=10,
                          json={"model": "chat", "messages": [{"role": "user", "content": "x" * 3000}]})
        assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large", over.text
        assert "over 2048 bytes" in over.json()["error"]["message"]
        assert streamed_text(served, headers=auth) == "t0 t1 t2 "  # a small one still goes through
    finally:
        served.stop()
    path = fleet.write()
    for value in ("4 MiB", "-1", "0x400", "12", "9" * 40):
        done = subprocess.run([fleet_bin(), "serve", "-f", str(path), "--state-dir", str(fleet.base / "refused")],
                              capture_output=True, text=True, timeout=60,
                              env=agent_env(FLEET_MAX_REQUEST_BODY=value))
        assert done.returncode == 3, (value, done.stderr)  # exit 3: serving refused, said why
        assert "FLEET_MAX_REQUEST_BODY" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_models_names_clusters_not_the_nodes_that_serve_them(fleet: Fleet) -> None:
    served = with_keys(fleet)
    try:
        r = httpx.get(served.base + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=5)
        assert r.status_code == 200, r.text
        assert [m["id"] for m in r.json()["data"]] == ["chat"]
        assert "gpu-a" not in r.text and "members" not in r.text, r.text
        unauthorized = httpx.get(served.base + "/v1/models", timeout=5)
        assert unauthorized.status_code == 401 and unauthorized.json()["error"]["code"] == "invalid_api_key"
    finally:
        served.stop()


def test_pipelined_requests_before_an_unkeyed_one_are_answered_then_it_is_refused(fleet: Fleet) -> None:
    """Two keyed requests pipelined on one connection are both answered; an unkeyed one after
    them, parsed in the same read, is refused once they are, and ends the connection."""
    served = with_keys(fleet)
    try:
        body = json.dumps({"model": "chat", "max_tokens": 2, "stream": True}).encode()
        keyed = head(len(body), KEY) + body
        with socket.create_connection(address(served), timeout=10) as sock:
            sock.sendall(keyed + keyed + head(len(body)) + body)
            got = b""
            while chunk := sock.recv(65536):
                got += chunk
        assert got.count(b"HTTP/1.1 200 OK") == 2 and got.count(b"data: [DONE]") == 2, got[-500:]
        assert got.count(b"HTTP/1.1 401") == 1 and got.rstrip().endswith(b"}"), got[-300:]
    finally:
        served.stop()
