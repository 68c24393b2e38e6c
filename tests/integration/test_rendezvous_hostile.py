"""A pipeline's rendezvous port against an outsider: real stage processes of the tiny Llama, given
their group's secret as their agents give it (derived from the cluster secret, in the environment),
and an outsider who knows the group id (`fleet plan` prints it) connecting to the store with
torch.distributed.TCPStore. It cannot read the stages' keys, and its writes of the group's fail
key (before: every stage ended within ~4 s, the router quoting the text) end nothing. A stage
without the secret never joins, and what a failure says is a code each stage renders itself."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from agent.backends.forkserver import ForkServer
from agent.backends.launch import BadSettings
from agent.backends.pipeline.group import BEAT_S, SENTENCES, Fault, GroupSpec
from agent.backends.pipeline.spec import PIPELINE_KEY_ENV, check_details, group_key
from tests import forked
from tests.agents import SECRET
from tests.integration.test_pipeline_stage import ADDRESSES, Pipeline, details
from tests.models import sliced, tiny_safetensors

# Starts real stage processes: kept out of the quick suite (-m "not e2e").
pytestmark = pytest.mark.e2e

GROUP = "0123456789abcdef"  # what details() names the group, as a plan would print it
INJECTED = "pwned: see http://10.0.0.9:8080/admin and /var/log/fleet/secret.log"


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_safetensors(tmp_path_factory.mktemp("models"))


def outsider(port: int) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(ADDRESSES[0], port, 1, False, timeout=timedelta(seconds=5), wait_for_workers=False)


def test_an_outsider_cannot_read_the_keys_nor_end_the_group(models: Path, tmp_path: Path, forks: ForkServer,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    spans = ["0-1", "2-3"]
    monkeypatch.setenv(PIPELINE_KEY_ENV, group_key(SECRET.encode(), GROUP))  # what each stage's agent gives it
    p = Pipeline(forks, sliced(models, spans, models.parent), spans, tmp_path)
    try:
        store = outsider(p.port + 1)
        guessed = [f"{GROUP}/{name}/{r}" for name in ("joined", "beat", "dtype") for r in range(2)]
        assert not any(store.check([k]) for k in guessed)
        for key in (f"{GROUP}/fail", "fail", f"{GROUP}/pg/fail"):
            store.set(key, INJECTED)
            store.compare_set(key, "", INJECTED)
        time.sleep(12 * BEAT_S)  # every stage looks at the group's fail key each beat
        assert [proc.poll() for proc in p.procs] == [None, None]
        for i in range(2):
            assert httpx.get(p.stage_url(i) + "/health", timeout=10).status_code == 200
        r = httpx.post(p.url + "/v1/completions", json={"prompt": "The fleet", "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert INJECTED not in p.output(0) + p.output(1)
    finally:
        p.stop()


def test_a_stage_without_the_groups_secret_never_joins(models: Path, tmp_path: Path, forks: ForkServer,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spans = ["0-1", "2-3"]
    dirs = sliced(models, spans, models.parent)
    monkeypatch.setenv(PIPELINE_KEY_ENV, group_key(SECRET.encode(), GROUP))
    p = Pipeline(forks, dirs[:1], spans, tmp_path, "--join-timeout", "20", wait=False)
    wrong = {**os.environ, PIPELINE_KEY_ENV: group_key(b"another-cluster-secret-0123", GROUP)}
    argv = [sys.executable, "-m", "agent.backends.pipeline.stage", "--model", str(dirs[1]), "--host", ADDRESSES[1],
            "--port", str(p.port), "--pipeline", json.dumps(details(spans, 1, p.port)), "--threads", "1",
            "--join-timeout", "20", "--reason-file", str(tmp_path / "intruder.reason")]
    intruder = forked.start(forks, argv, tmp_path / "intruder.log", wrong)
    try:
        assert p.exits(120) == [3]
        assert p.reasons[0].read_text().strip() == (
            f"pipeline group {GROUP} did not form within 20 s: pipeline stage 1 (node node1, "
            f"{ADDRESSES[1]}:{p.port}, layers 2-3) never joined")
        assert intruder.wait(120) == 3
    finally:
        intruder.kill()
        intruder.wait()
        p.stop()


def test_a_posted_failure_is_a_code_rendered_by_each_stage_never_text() -> None:
    spec = GroupSpec.parse(details(["0-1", "2-3"], 0, 9000), 9000)
    silent = Fault("silent", (1,), 2.0)
    assert Fault.decode(silent.encode().encode(), spec) == silent
    assert silent.render(spec) == f"pipeline stage 1 (node node1, {ADDRESSES[1]}:9000, layers 2-3) stopped " \
                                  "answering: no heartbeat for 2 s"
    for raw in (INJECTED, json.dumps({"code": INJECTED, "ranks": [0], "seconds": 1}),
                json.dumps({"code": "silent", "ranks": [7], "seconds": 1}),
                json.dumps({"code": "silent", "ranks": [1], "seconds": INJECTED}),
                json.dumps({"code": "silent", "ranks": [1], "seconds": 1e300}), "[" * 100_000):
        fault = Fault.decode(raw.encode(), spec)
        assert fault == Fault("unreadable")
        assert fault.render(spec) == f"pipeline group {GROUP} failed (its failure record could not be read)"
    assert all("{" not in s.replace("{stage}", "").replace("{stages}", "").replace("{seconds:g}", "")
               .replace("{group}", "").replace("{address}", "").replace("{port}", "") for s in SENTENCES.values())


def test_the_groups_secret_is_per_group_and_per_cluster_and_the_store_is_the_first_stages() -> None:
    assert group_key(SECRET.encode(), GROUP) != group_key(SECRET.encode(), GROUP[::-1])
    assert group_key(SECRET.encode(), GROUP) != group_key(b"another-cluster-secret-0123", GROUP)
    assert GROUP not in group_key(SECRET.encode(), GROUP)
    moved = {**details(["0-1", "2-3"], 1, 9000), "rendezvous": {"address": ADDRESSES[1], "port": 9001}}
    with pytest.raises(BadSettings, match="must be stage 0's address"):
        check_details(moved)


def test_agents_hand_their_stages_the_groups_secret_and_nothing_else_shows_it(models: Path, tmp_path: Path,
                                                                             forks: ForkServer) -> None:
    """Two agents' Workers (sharing the cluster secret) start a group: it forms, the secret is in
    neither the stages' command lines nor the agents' state, and an outsider sees none of its keys."""
    import trio

    from agent.api.server import Spawner
    from agent.backends.launch import ProcessLauncher
    from agent.serving.supervisor import Workers
    from agent.weights.store import Store
    from reconciler.agents.netutil import free_port
    from tests.models import hold_slices

    spans = ["0-1", "2-3"]
    stores = [Store(tmp_path / f"node{i}") for i in range(2)]
    digests = [hold_slices(stores[i], models, spans)[i] for i in range(2)]
    port = free_port(*ADDRESSES[:2])
    key = group_key(SECRET.encode(), GROUP)

    async def main() -> None:
        spawner = Spawner()
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            workers = [Workers(tmp_path / f"node{i}", stores[i], spawner, ProcessLauncher(forks), ADDRESSES[i],
                               secret=SECRET.encode()) for i in range(2)]
            servers = [w.start({"id": "big", "model": digests[i], "port": port, "settings": {"threads": 1},
                                "pipeline": details(spans, i, port)}) for i, w in enumerate(workers)]
            with trio.fail_after(180):
                while any(s.state == "starting" for s in servers):
                    await trio.sleep(0.1)
            assert [s.state for s in servers] == ["running", "running"], [s.reason for s in servers]
            for s in servers:
                assert key not in " ".join(s.argv) and key not in json.dumps(s.to_json())
                assert PIPELINE_KEY_ENV not in s.log.read_text()  # no warning: the stage was given its secret
            store = outsider(port + 1)
            assert not any(store.check([f"{GROUP}/{name}/{r}"]) for name in ("joined", "beat") for r in range(2))
            for w in workers:
                await w.stop_all()

    trio.run(main)
