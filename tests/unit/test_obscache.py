"""The cache of observed states (reconciler/cache/observed.py) and the 304 that confirms one: an agent app
in process (its real routes, an injected clock, simulated GPUs in a file) answered through the
client's own reader; the cache file read and written on disk, whole, damaged and foreign."""

from __future__ import annotations

import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import trio

from agent.app import assemble, create_app
from agent.machine.identity import Identity
from agent.machine.inventory import SimulatedGpus
from agent.backends.launch import ProcessLauncher
from reconciler.cache import observed as obscache
from reconciler.agents.client import AgentClient
from reconciler.core.desired import ControlPlaneSpec, Desired, NodeSpec
from reconciler.cache.observed import ObservationCache
from reconciler.agents.observe import observe
from reconciler.core.observed import Observed, ObservedNode, node_from_state
from tests.memory_transport import Answer, MemoryTransport, asgi
from wire import live

SECRET = "s" * 16
START = (40 << 30) + (128 << 20)  # mid-way through a 256 MiB step of the generation's
NODE = NodeSpec(name="n", address="127.0.0.1", agent_port=7070)
DESIRED = Desired(1, ControlPlaneSpec("n"), {"n": NODE}, {}, (), {})


class Agent:
    """An agent app in process whose clock and GPUs' free memory the test moves; every request's
    head and every answer's status are kept."""

    def __init__(self, tmp: Path) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        self.now = datetime(2026, 11, 30, 12, 0, tzinfo=timezone(timedelta(hours=2)))
        self.gpus = tmp / "gpus.json"
        self.free(START)
        ident = Identity(id="a" * 32, name="n", enrolled_at="2026-01-01T00:00:00+00:00", agent_version="t")
        ctx = assemble(tmp / "home", ident, SECRET.encode(), "t", SimulatedGpus(self.gpus), ProcessLauncher(),
                       clock=lambda: self.now, verify_every_s=None)
        self.app = asgi(create_app(ctx))
        self.asked: list[tuple[bytes, int]] = []

    def free(self, free: int) -> None:
        self.gpus.write_text(json.dumps([{"name": "SIMULATED H100", "memory_total_bytes": 80 << 30,
                                          "memory_free_bytes": free}]))

    async def answer(self, request: bytes) -> bytes:
        response = await self.app(request)
        self.asked.append((request, int(response.split(b" ", 2)[1])))
        return response


def run(answer: Answer, held: dict[str, ObservedNode] | None = None) -> Observed:
    async def go() -> Observed:
        async with AgentClient(SECRET, transport=MemoryTransport(answer)) as client:
            return await observe(DESIRED, client, held=held, bring_up=True)
    return trio.run(go)


def settled(state: dict[str, Any] | None) -> dict[str, Any]:
    """The state less what the host moves under the test (its disk's and memory's free bytes)."""
    assert state is not None
    s: dict[str, Any] = json.loads(json.dumps(state))
    s["inventory"]["disk"]["free_bytes"] = s["inventory"]["memory"]["available_bytes"] = None
    return s


def test_a_confirmed_state_brought_up_is_what_a_whole_answer_says(tmp_path: Path) -> None:
    agent = Agent(tmp_path)
    first = run(agent.answer).nodes["n"]
    assert first.ok and first.generation
    agent.now += timedelta(hours=1)
    agent.free(START - (100 << 20))  # within the generation's 256 MiB step: not news, but moved
    warm = run(agent.answer, {"n": first}).nodes["n"]
    assert agent.asked[-1][1] == 304 and b'if-none-match: "' + first.generation.encode() in agent.asked[-1][0].lower()
    whole = run(agent.answer).nodes["n"]
    assert agent.asked[-1][1] == 200
    assert warm.generation == whole.generation == first.generation
    assert warm.observed_at == whole.observed_at == agent.now.isoformat()
    assert warm.gpus == whole.gpus == (("SIMULATED H100", START - (100 << 20), 80 << 30),)
    assert settled(warm.state) == settled(whole.state)
    assert warm.weights is first.weights  # nothing parsed again


def test_a_generation_the_agent_does_not_confirm_is_asked_for_whole(tmp_path: Path) -> None:
    agent = Agent(tmp_path)
    first = run(agent.answer).nodes["n"]
    agent.free(20 << 30)  # 20 GiB less free: news
    seen = run(agent.answer, {"n": first}).nodes["n"]
    assert [status for _, status in agent.asked[1:]] == [200]
    assert seen.generation != first.generation and seen.gpus[0][1] == 20 << 30


def test_a_304_without_the_moving_values_is_asked_again_whole(tmp_path: Path) -> None:
    agent = Agent(tmp_path)
    first = run(agent.answer).nodes["n"]

    async def old_agent(request: bytes) -> bytes:
        if b"if-none-match" in request.lower():  # an agent from before fleet-live: a bare 304
            agent.asked.append((request, 304))
            return b'HTTP/1.1 304 Not Modified\r\netag: "' + (first.generation or "").encode() + b'"\r\n\r\n'
        return await agent.answer(request)

    agent.now += timedelta(minutes=5)
    seen = run(old_agent, {"n": first}).nodes["n"]
    assert [status for _, status in agent.asked[1:]] == [304, 200]
    assert b"if-none-match" not in agent.asked[-1][0].lower()
    assert seen.observed_at == agent.now.isoformat()


@pytest.mark.parametrize("header", ["", "nonsense", json.dumps(["t", 1, 2, [3, 4], []]),  # two GPUs for one
                                    json.dumps(["t", True, 2, [3], []]), json.dumps(["t", 1, -2, [3], []]),
                                    json.dumps(["t", 1, 2, [3], ["x"]]), "[" * 20000])
def test_moving_values_that_do_not_fit_the_state_are_not_used(header: str) -> None:
    state = {"inventory": {"gpus": [{"memory_free_bytes": 1}]}, "servers": []}
    values = live.decode(header.encode())
    assert values is None or not live.fits(state, values)


def observed_once(tmp_path: Path) -> Observed:
    return run(Agent(tmp_path / "agent").answer)


def test_the_cache_keeps_the_states_for_the_next_run_only_for_its_user(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = ObservationCache(tmp_path / "cache" / "observed" / "f.bin", warnings.append)
    seen = observed_once(tmp_path)
    cache.save(DESIRED, seen)
    assert os.stat(cache.path).st_mode & 0o777 == 0o600 and os.stat(cache.path.parent).st_mode & 0o777 == 0o700
    held = cache.load(DESIRED)
    assert held["n"] == seen.nodes["n"] and held["n"].generation == seen.nodes["n"].generation
    assert held["n"].state == seen.nodes["n"].state and not warnings
    moved = Desired(1, ControlPlaneSpec("n"), {"n": NodeSpec(name="n", address="127.0.0.9", agent_port=7070)},
                    {}, (), {})
    assert cache.load(moved) == {}  # held for another address: not this node's


@pytest.mark.parametrize("damage, why", [
    (lambda b: b[:-10], "checksum"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum"),
    (lambda b: b"something else\n" + b, "not a cache of fleet's"),
    (lambda b: b.replace(obscache.TAG, b"cpython-99 marshal 9\n"), "another Python"),
    (lambda b: b"", "not a cache of fleet's"),
])
def test_a_damaged_or_foreign_cache_is_ignored_with_a_warning(tmp_path: Path, damage: Any, why: str) -> None:
    warnings: list[str] = []
    cache = ObservationCache(tmp_path / "c" / "f.bin", warnings.append)
    cache.save(DESIRED, observed_once(tmp_path))
    cache.path.write_bytes(damage(cache.path.read_bytes()))
    assert cache.load(DESIRED) == {}
    assert len(warnings) == 1 and why in warnings[0] and str(cache.path) in warnings[0]


def test_a_cache_others_may_read_is_ignored_with_a_warning(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = ObservationCache(tmp_path / "c" / "f.bin", warnings.append)
    cache.save(DESIRED, observed_once(tmp_path))
    cache.path.chmod(0o644)
    assert cache.load(DESIRED) == {} and "others may read or write it" in warnings[0]


def test_no_cache_is_no_warning_and_off_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    warnings: list[str] = []
    monkeypatch.setenv(obscache.DIR_ENV, str(tmp_path))
    cache = ObservationCache.for_file("fleet.yaml", warnings.append)
    assert cache is not None and cache.path.is_relative_to(tmp_path)
    assert cache.load(DESIRED) == {} and not warnings
    monkeypatch.setenv(obscache.OFF_ENV, "off")
    assert ObservationCache.for_file("fleet.yaml", warnings.append) is None


def test_an_unwritable_cache_is_a_warning_not_a_failure(tmp_path: Path) -> None:
    warnings: list[str] = []
    (tmp_path / "file").write_text("")
    cache = ObservationCache(tmp_path / "file" / "f.bin", warnings.append)  # its directory is a file
    cache.save(DESIRED, observed_once(tmp_path))
    assert len(warnings) == 1 and "cannot keep the observed states" in warnings[0]


def test_the_cache_is_not_written_again_when_every_state_is_the_one_held(tmp_path: Path) -> None:
    warnings: list[str] = []
    cache = ObservationCache(tmp_path / "c" / "f.bin", warnings.append)
    seen = observed_once(tmp_path)
    cache.save(DESIRED, seen)
    held = cache.load(DESIRED)
    before = os.stat(cache.path).st_ino
    cache.save(DESIRED, seen, held)
    assert os.stat(cache.path).st_ino == before  # not replaced
    node = seen.nodes["n"]
    assert node.state is not None
    changed = Observed({"n": node_from_state("n", {**node.state, "generation": "another"})})
    cache.save(DESIRED, changed, held)
    assert os.stat(cache.path).st_ino != before and cache.load(DESIRED)["n"].generation == "another"
    assert not warnings


RICH: dict[str, Any] = {
    "identity": {"id": "b" * 32, "name": "gpu-a", "enrolled_at": "2026-01-01T00:00:00+00:00"},
    "agent_version": "0.1.0", "variant": {"accelerator": "cuda", "torch": "2.4.0"},
    "inventory": {"cores": {"logical": 2, "usable": 2}, "memory": {"total_bytes": 1 << 34, "available_bytes": 1 << 33},
                  "disk": {"path": "/srv/fleet", "free_bytes": (40 << 30) + (128 << 20), "total_bytes": 1 << 40,
                           "reserve_bytes": 1 << 30},
                  "gpus": [{"index": 0, "name": "H100", "uuid": "GPU-1", "memory_total_bytes": 80 << 30,
                            "memory_free_bytes": (70 << 30) + (128 << 20)}],
                  "gpu_source": "nvml", "gpu_note": "", "simulated": False},
    "availability": {"windows": ["19:00-07:00"], "always": False, "inside": True,
                     "current_ends_at": "2026-12-01T07:00:00+01:00", "next_starts_at": "2026-12-01T19:00:00+01:00"},
    "observed_at": "2026-11-30T23:00:00+01:00",
    "weights": [{"digest": "sha256:" + "a" * 64, "name": "m", "format": "gguf", "bytes": 1000, "layers": None,
                 "slice": None, "path": "/srv/fleet/m", "integrity": {"state": "verified", "checked_at": None,
                                                                      "file": None, "reason": None}}],
    "fetches": [{"digest": "sha256:" + "c" * 64, "state": "fetching", "peer": "http://10.0.0.3:7070", "layers": None,
                 "bytes_total": 10, "bytes_done": 5, "bytes_fetched": 5, "rate_bytes_per_s": 1, "error": None}],
    "servers": [{"id": "chat@gpu-a", "state": "running", "model": "sha256:" + "a" * 64, "backend": "llama.cpp",
                 "host": "0.0.0.0", "port": 9000, "pid": 42, "settings": {"ctx": 4096, "nested": {"a": [1, 2]}},
                 "speculative": None, "uptime_s": 12.5, "reason": None, "exit": None}],
    "link_rates": [{"peer": "10.0.0.3:7070", "bytes_per_s": 100, "samples": 2, "last_bytes_per_s": 90,
                    "measured_at": "2026-11-30T22:00:00+00:00"}],
}
MOVING = {("observed_at",), ("inventory", "memory", "available_bytes"), ("servers", 0, "uptime_s")}
STEPPED = {("inventory", "disk", "free_bytes"), ("inventory", "gpus", 0, "memory_free_bytes")}


def leaves(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in leaves(v, path + (k,))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in leaves(v, path + (i,))]
    return [path]


def changed(state: dict[str, Any], path: tuple[Any, ...], by: int = 1) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(state))
    *parents, last = path
    at: Any = out
    for p in parents:
        at = at[p]
    value = at[last]
    at[last] = (not value if isinstance(value, bool) else value + by if isinstance(value, (int, float))
                else "other" if value is None else value + "x")
    return out


@pytest.mark.parametrize("path", leaves(RICH), ids=lambda p: ".".join(map(str, p)))
def test_any_change_but_the_moving_values_is_another_generation(path: tuple[Any, ...]) -> None:
    """What a 304 spares the control plane is exactly what wire/live.py brings: every other field
    of the state, changed, names another generation (agent/app.generation, as GET /v1/state uses it)."""
    from agent.api.context import STEP, generation

    if path in MOVING:
        assert generation(changed(RICH, path)) == generation(RICH)  # type: ignore[arg-type]
        values = live.decode(live.encode(changed(RICH, path)))
        assert values is not None and live.brought_up(RICH, values) == changed(RICH, path)
    elif path in STEPPED:
        assert generation(changed(RICH, path, 100 << 20)) == generation(RICH)  # type: ignore[arg-type]
        assert generation(changed(RICH, path, STEP)) != generation(RICH)  # type: ignore[arg-type]
        values = live.decode(live.encode(changed(RICH, path, 100 << 20)))
        assert values is not None and live.brought_up(RICH, values) == changed(RICH, path, 100 << 20)
    else:
        assert generation(changed(RICH, path)) != generation(RICH)  # type: ignore[arg-type]


def test_a_state_brought_up_leaves_the_held_one_as_it_was_and_shares_what_did_not_move() -> None:
    held = json.loads(json.dumps(RICH))
    moved = changed(RICH, ("inventory", "gpus", 0, "memory_free_bytes"), 100 << 20)
    values = live.decode(live.encode(moved))
    assert values is not None and live.brought_up(held, values) == moved and held == RICH
    same = live.decode(live.encode(RICH))
    assert same is not None
    up = live.brought_up(held, same)
    assert up == RICH and up["inventory"]["gpus"][0] is held["inventory"]["gpus"][0]  # not copied: nothing moved


def test_a_server_or_a_model_more_or_less_is_another_generation() -> None:
    from agent.api.context import generation

    for key in ("weights", "fetches", "servers", "link_rates"):
        fewer = {**RICH, key: []}
        more = {**RICH, key: RICH[key] * 2}
        assert len({generation(RICH), generation(fewer), generation(more)}) == 3, key  # type: ignore[arg-type]


def test_an_agent_from_before_fleet_live_is_asked_plainly_from_the_next_run_on(tmp_path: Path) -> None:
    """Its bare 304 confirms nothing usable (the state is asked for again whole): two requests per
    warm run. After one, the cache asks it plainly, one request a run, while its version stays."""
    agent = Agent(tmp_path / "agent")

    async def old_agent(request: bytes) -> bytes:
        head, _, body = (await agent.answer(request)).partition(b"\r\n\r\n")
        lines = [line for line in head.split(b"\r\n") if not line.lower().startswith(b"fleet-live:")]
        return b"\r\n".join(lines) + b"\r\n\r\n" + body

    warnings: list[str] = []
    cache = ObservationCache(tmp_path / "c" / "f.bin", warnings.append)

    def plan() -> list[tuple[bool, int]]:
        """One run as fleet plan makes it (commands._observe): each request (asked about a
        generation?) and its status."""
        before = len(agent.asked)
        held = cache.load(DESIRED)
        bare: set[str] = set()

        async def go() -> Observed:
            async with AgentClient(SECRET, transport=MemoryTransport(old_agent)) as client:
                return await observe(DESIRED, client, held=held, bring_up=True, bare=bare)
        seen = trio.run(go)
        assert seen.nodes["n"].ok
        cache.save(DESIRED, seen, held, bare)
        return [(b"if-none-match" in r.lower(), s) for r, s in agent.asked[before:]]

    assert plan() == [(False, 200)]
    generation = cache.load(DESIRED)["n"].generation
    assert generation and not cache.plain
    assert plan() == [(True, 304), (False, 200)]
    inode = os.stat(cache.path).st_ino
    assert plan() == [(False, 200)] and plan() == [(False, 200)]
    assert os.stat(cache.path).st_ino == inode and not warnings  # nothing new: not written again
    assert cache.load(DESIRED) == {} and cache.plain == {"n": ("t", generation)}
    upgraded = node_from_state("n", {"generation": "h" * 32, "agent_version": "2"})
    cache.save(DESIRED, Observed({"n": upgraded}), {})
    assert cache.load(DESIRED) == {"n": upgraded} and not cache.plain  # another version: asked about its generation
