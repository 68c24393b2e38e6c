"""`fleet plan` against a stand-in agent on loopback that answers GET /v1/state with the bytes a
test gives it: every malformed weights, servers or fetches entry is a protocol error naming the node
and the field (exit 4, plan refused), never an internal error of the planner."""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

import fastjsonschema
import pytest

from reconciler.agents.client import _state_check
from tests.agents import SECRET, free_port
from tests.conftest import run_cli
from tests.unit.test_client import GOOD

# Starts real agent, worker or fleet processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

DIGEST = "sha256:" + "ab" * 32
WEIGHT = {"digest": DIGEST, "name": "tiny", "format": "gguf", "bytes": 1000, "layers": None, "slice": None,
          "path": "/home/store/models/x/tiny.gguf",
          "integrity": {"state": "verified", "checked_at": "2026-01-01T00:00:00+00:00", "file": None, "reason": None}}
SERVER = {"id": "chat@cp", "state": "running", "model": DIGEST, "backend": "llama_cpp", "host": "127.0.0.2",
          "port": 9001, "pid": 12, "settings": {}, "speculative": None, "uptime_s": 1.0, "reason": None, "exit": None}


class StandIn:
    """An agent that is not one: GET /v1/state answers `self.state` as JSON, whatever it holds."""

    def __init__(self, address: str, port: int) -> None:
        self.state: Any = GOOD
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps(outer.state).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((address, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[StandIn, Path]]:
    port = free_port("127.0.0.2")
    stand_in = StandIn("127.0.0.2", port)
    base = tmp_path_factory.mktemp("answers")
    fleet = base / "fleet.yaml"
    fleet.write_text(f"version: 1\ncontrol_plane: {{node: cp}}\nnodes:\n  cp: {{address: 127.0.0.2, agent_port: {port}}}\n"
                     f"models:\n  tiny: {{format: gguf, digest: \"{DIGEST}\", source: cp}}\n")
    try:
        yield stand_in, fleet
    finally:
        stand_in.server.shutdown()
        stand_in.server.server_close()


def state_with(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    state = copy.deepcopy({**GOOD, "weights": [WEIGHT], "servers": [SERVER], "fetches": []})
    change(state)
    return state


def plan(agent: tuple[StandIn, Path], state: Any) -> tuple[int, str]:
    stand_in, fleet = agent
    stand_in.state = state
    proc = run_cli("plan", "-f", str(fleet), env={"FLEET_CLUSTER_SECRET": SECRET,
                                                  "FLEET_STATE_DIR": str(fleet.parent / "state")})
    return proc.returncode, proc.stdout + proc.stderr


BAD = [
    ("weight-without-digest", lambda s: s["weights"][0].pop("digest"), "weights[0].digest",
     "a required field is missing"),
    ("server-without-id", lambda s: s["servers"][0].pop("id"), "servers[0].id", "a required field is missing"),
    ("strings-for-weights", lambda s: s.update(weights=["tiny", "other"]), "weights[0]", "is not of type 'object'"),
    ("weight-bytes-a-string", lambda s: s["weights"][0].update(bytes="1000"), "weights[0].bytes", "not of type"),
    ("digest-with-a-newline", lambda s: s["weights"][0].update(digest=DIGEST + "\n"), "weights[0].digest",
     "does not match"),
    ("slice-without-source", lambda s: s["weights"][0].update(slice={"layers": "0-1"}), "weights[0].slice.of",
     "a required field is missing"),
    ("integrity-state-unknown", lambda s: s["weights"][0]["integrity"].update(state="fine"),
     "weights[0].integrity.state", "is not one of"),
    ("server-port-a-string", lambda s: s["servers"][0].update(port="9001"), "servers[0].port", "not of type"),
    ("strings-for-servers", lambda s: s.update(servers=["chat@cp"]), "servers[0]", "is not of type 'object'"),
    ("fetch-without-digest", lambda s: s.update(fetches=[{"state": "fetching"}]), "fetches[0].digest",
     "a required field is missing"),
]


@pytest.mark.parametrize("change, field, problem", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_answer_is_a_protocol_error_naming_node_and_field(agent: tuple[StandIn, Path], change: Any,
                                                                field: str, problem: str) -> None:
    code, out = plan(agent, state_with(change))
    assert "internal error" not in out, out
    assert code == 4, out  # plan refused: the node's error is a plan error
    assert "error[agent_protocol_error]" in out and "node 'cp'" in out, out
    assert f"(field {field})" in out and problem in out, out


def test_a_good_answer_plans(agent: tuple[StandIn, Path]) -> None:
    code, out = plan(agent, state_with(lambda s: None))
    assert code == 0 and "agent_protocol_error" not in out, out


def test_the_compiled_fast_path_agrees_with_the_tightened_schema() -> None:
    """A full, good answer passes the compiled check (so the fast path is taken), and each bad one
    fails it too (the generic validator then names the field)."""
    _state_check()(state_with(lambda s: None))
    for _, change, _, _ in BAD:
        with pytest.raises(fastjsonschema.JsonSchemaException):
            _state_check()(state_with(change))
