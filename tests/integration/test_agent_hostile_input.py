"""A real fleet-agent given input built to break its parsers: a Range of thousands of digits and a
JSON body nested 100,000 deep are answered with a JSON error and a stable code, never a 500; and a
client holding more connections than the agent's cap is answered 503."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.agents import SECRET, Agent, free_port
from tests.fleets import import_model
from tests.models import random_gguf

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

AUTH = {"Authorization": f"Bearer {SECRET}"}
DIGITS = "9" * 4400  # past Python's 4,300-digit limit on int(): a ValueError where it is converted
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    base = tmp_path_factory.mktemp("hostile")
    a = Agent("node-h", "127.0.0.2", free_port("127.0.0.2"), base / "h")
    try:
        yield a.start()
    finally:
        a.stop()


@pytest.fixture(scope="module")
def blob(agent: Agent, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, bytes]:
    src = tmp_path_factory.mktemp("blob") / "m.gguf"
    src.write_bytes(random_gguf(4100))
    digest = import_model(agent, src)
    sha = json.loads(agent.get(f"/v1/manifests/{digest}").content)["files"][0]["sha256"]
    return str(sha), src.read_bytes()


def _no_trace(r: httpx.Response) -> None:
    assert "Traceback" not in r.text and "ValueError" not in r.text and "RecursionError" not in r.text


@pytest.mark.parametrize("header", [f"bytes={DIGITS}-", f"bytes={DIGITS}-{DIGITS}", f"bytes=0-{DIGITS}x"],
                         ids=["start", "start-and-end", "unparseable"])
def test_a_range_of_thousands_of_digits_is_not_a_500(agent: Agent, blob: tuple[str, bytes], header: str) -> None:
    sha, data = blob
    r = httpx.get(f"{agent.url}/v1/blobs/{sha}", headers={**AUTH, "Range": header}, timeout=10)
    _no_trace(r)
    if header.endswith("x"):  # RFC 9110: a Range that does not parse is ignored
        assert r.status_code == 200 and r.content == data
        return
    assert r.status_code == 416, r.text
    assert r.headers["content-range"] == f"bytes */{len(data)}"
    assert r.json()["error"]["code"] == "range_not_satisfiable"


def test_huge_end_or_suffix_means_up_to_the_end(agent: Agent, blob: tuple[str, bytes]) -> None:
    sha, data = blob
    r = httpx.get(f"{agent.url}/v1/blobs/{sha}", headers={**AUTH, "Range": f"bytes=4-{DIGITS}"}, timeout=10)
    assert r.status_code == 206 and r.content == data[4:], r.text
    r = httpx.get(f"{agent.url}/v1/blobs/{sha}", headers={**AUTH, "Range": f"bytes=-{DIGITS}"}, timeout=10)
    assert r.status_code == 206 and r.content == data, r.text


@pytest.mark.parametrize("method,path", [("PUT", f"/v1/weights/{DIGEST}"), ("POST", "/v1/servers")],
                         ids=["put-weights", "post-servers"])
def test_a_body_nested_100000_deep_is_a_400(agent: Agent, method: str, path: str) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    r = httpx.request(method, agent.url + path, content=body,
                      headers={**AUTH, "Content-Type": "application/json"}, timeout=30)
    _no_trace(r)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_request"
    assert "nested too deeply" in r.json()["error"]["message"]
    assert agent.get("/v1/state").status_code == 200  # and the agent goes on answering


def test_connections_past_the_cap_are_answered_503_and_the_agent_keeps_serving(tmp_path: Path) -> None:
    """A client that holds every place with a request in flight (here 3, each an authenticated POST
    whose body never comes) leaves none: one more is answered 503 too_many_connections at once, the
    refusal is logged, and a connection given back is taken by the next client. Unbounded, such a
    client takes the descriptors the agent's own fetches and workers need. (Idle connections give
    their place to newer ones instead: tests/integration/test_agent_lockout.py.)"""
    a = Agent("node-c", "127.0.0.2", free_port("127.0.0.2"), tmp_path / "c", args=["--max-connections", "3"])
    a.start()
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            held.append(socket.create_connection((a.address, a.port), timeout=10))
            held[-1].sendall(f"POST /v1/servers HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {SECRET}\r\n"
                             "Content-Type: application/json\r\nContent-Length: 100\r\n"
                             "Expect: 100-continue\r\n\r\n{".encode())
            assert held[-1].recv(64).startswith(b"HTTP/1.1 100 "), "the request's head was not taken"
        r = httpx.get(a.url + "/healthz", timeout=10)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "too_many_connections" and "at most 3 connections" in r.json()["error"]["message"]
        assert r.headers["retry-after"] == "1"
        held.pop().close()
        deadline = time.monotonic() + 10
        while (r := httpx.get(a.url + "/healthz", timeout=10)).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the agent closes its end as soon as it reads the client's close
        assert r.status_code == 200, r.text
        assert time.monotonic() < deadline - 9, "the closed connection's place came back late"
    finally:
        for s in held:
            s.close()
        a.stop()
    assert "[too_many_connections]" in a.log() and "all 3 allowed are held" in a.log()


def test_max_connections_must_be_positive(tmp_path: Path) -> None:
    a = Agent("node-z", "127.0.0.2", free_port("127.0.0.2"), tmp_path / "z", args=["--max-connections", "0"])
    with pytest.raises(RuntimeError, match="exited with 3"):
        a.start(timeout=20)
    assert "--max-connections 0: expected 1 or more" in a.log()
