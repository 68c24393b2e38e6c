"""fleet plan and apply against real agents on loopback, with the tiny models, as a user runs them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Iterator

import httpx
import pytest

from reconciler.state.store import StateStore
from tests.agents import SECRET, agent_env, free_port
from tests.conftest import fleet_bin
from tests.fleets import Fleet, chat, import_model, three_node_fleet
from tests.models import gguf_missing_tensor, random_gguf, tiny_gguf

pytestmark = pytest.mark.e2e
AUTH = {"Authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    with three_node_fleet(tmp_path_factory.mktemp("fleet")) as f:
        yield f


def test_plan_apply_then_no_changes(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet))
    plan = fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 2, plan.stderr
    for line in ("replicate replica.tiny@a", "replicate replica.tiny@b", "start server.chat@a",
                 "start server.chat@b", "Plan: 2 to replicate, 2 to start, 0 to replace, 0 to stop, 0 to delete."):
        assert line in plan.stdout
    applied = fleet.run("apply", "--auto-approve")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "Apply complete: 4 actions." in applied.stdout
    states = fleet.states()
    for n in ("a", "b"):
        assert fleet.digests["tiny"] in [w["digest"] for w in states[n]["weights"]]
        assert [s["state"] for s in states[n]["servers"]] == ["running"]
    again = fleet.run("plan", "--detailed-exitcode")
    assert again.returncode == 0 and "No changes." in again.stdout


def test_changed_settings_replace_the_servers(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet, context=128))
    plan = fleet.run("plan", "--detailed-exitcode", "--json")
    assert plan.returncode == 2
    data = json.loads(plan.stdout)
    assert [(c["action"], c["address"]) for c in data["changes"]] == [("replace", "server.chat@a"),
                                                                      ("replace", "server.chat@b")]
    assert "context_length 256 → 128" in data["changes"][0]["reason"]
    assert fleet.run("apply", "--auto-approve").returncode == 0
    assert fleet.run("plan", "--detailed-exitcode").returncode == 0


def test_a_saved_plan_is_refused_after_a_config_edit(fleet: Fleet) -> None:
    planfile = fleet.base / "plan.json"
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet, context=200))
    assert fleet.run("plan", "-o", str(planfile)).returncode == 0
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet, context=199))
    applied = fleet.run("apply", str(planfile))
    assert applied.returncode == 6, applied.stdout + applied.stderr
    assert "stale_plan" in applied.stderr and "changed since the plan was made" in applied.stderr
    assert [s["settings"]["context_length"] for s in fleet.states()["a"]["servers"]] == [128]


def test_a_saved_plan_is_refused_after_a_node_changed(fleet: Fleet) -> None:
    planfile = fleet.base / "plan2.json"
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet))  # running, whatever ran before this test
    assert fleet.run("apply", "--auto-approve").returncode == 0
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet, context=200))
    assert fleet.run("plan", "-o", str(planfile)).returncode == 0
    httpx.delete(f"{fleet.agents['b'].url}/v1/servers/chat@b", headers=AUTH, timeout=60).raise_for_status()
    applied = fleet.run("apply", str(planfile))
    assert applied.returncode == 6 and "node 'b' changed" in applied.stderr
    fresh = fleet.base / "plan3.json"
    assert fleet.run("plan", "-o", str(fresh)).returncode == 0
    done = fleet.run("apply", str(fresh))  # a fresh saved plan applies exactly, without asking
    assert done.returncode == 0, done.stdout + done.stderr
    assert fleet.run("plan", "--detailed-exitcode").returncode == 0


def test_removing_the_cluster_stops_its_servers(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a, b]")
    plan = fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 2
    assert "stop server.chat@a" in plan.stdout and "stop server.chat@b" in plan.stdout
    assert fleet.run("apply", "--auto-approve").returncode == 0
    assert all(s["servers"] == [] for s in fleet.states().values())


def test_gguf_on_a_remote_node_is_refused_and_nothing_happens(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a, b]\n  tiny-q: [a]",
                clusters=f"  q: {{model: tiny-q, members: [a], port: {fleet.server_port}}}")
    before = fleet.states()
    plan = fleet.run("plan", "--detailed-exitcode")
    assert plan.returncode == 4
    assert "llamacpp_remote_unsupported" in plan.stderr and "server.q@a" in plan.stderr
    applied = fleet.run("apply", "--auto-approve")
    assert applied.returncode == 4
    after = fleet.states()
    for n in before:
        assert [w["digest"] for w in after[n]["weights"]] == [w["digest"] for w in before[n]["weights"]]
        assert after[n]["servers"] == before[n]["servers"]


def test_apply_without_a_terminal_asks_for_auto_approve(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a]")
    applied = fleet.run("apply")
    assert applied.returncode == 64 and "--auto-approve" in applied.stderr  # a usage error (exit codes: README)


def test_a_held_lock_names_its_holder_and_unlock_releases_it(fleet: Fleet) -> None:
    store = StateStore(fleet.state_dir)
    lock, _ = store.applies.acquire("fleet apply (held by the test)")  # this process is alive: not taken over
    try:
        applied = fleet.run("apply", "--auto-approve")
        assert applied.returncode == 5
        assert "held by the test" in applied.stderr and f"pid {os.getpid()}" in applied.stderr
        assert f"fleet unlock {lock.id}" in applied.stderr
    finally:
        unlocked = subprocess.run([fleet_bin(), "unlock", lock.id, "--state-dir", str(fleet.state_dir)],
                                  capture_output=True, text=True, timeout=60)
        assert unlocked.returncode == 0 and store.applies.holder() is None
        store.close()


def test_a_killed_apply_leaves_a_lock_the_next_apply_takes_over(fleet: Fleet) -> None:
    big = fleet.base / "models" / "big.gguf"
    big.write_bytes(random_gguf((192 << 20) + 4))
    digest = import_model(fleet.agents["cp"], big)
    fleet.write(replicas="  tiny: [a]\n  big: [b]",
                extra_models=f'  big: {{format: gguf, digest: "{digest}", source: cp}}')
    proc = subprocess.Popen([fleet_bin(), "apply", "--auto-approve", "-f", str(fleet.file)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=agent_env(FLEET_STATE_DIR=str(fleet.state_dir)))
    deadline = time.monotonic() + 60
    while True:  # kill it mid-replication
        progress = fleet.agents["b"].get(f"/v1/weights/{digest}")
        if progress.status_code == 200 and progress.json().get("bytes_done", 0) > 0:
            break
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    with StateStore(fleet.state_dir) as store:
        assert store.applies.holder() is not None  # the dead apply's lock is still there
    applied = fleet.run("apply", "--auto-approve")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    assert "took over the lock of a process that is gone" in applied.stderr
    assert fleet.run("plan", "--detailed-exitcode").returncode == 0
    # big was this test's own: its last copies go only when the file says so (delete_last_copy)
    fleet.write(replicas="  tiny: [a]")
    fleet.file.write_text(fleet.file.read_text() + f'delete_last_copy: ["{digest}"]\n')
    assert fleet.run("apply", "--auto-approve").returncode == 0


def test_a_failed_action_gives_exit_7_and_skips_its_dependents(fleet: Fleet) -> None:
    digest = import_model(fleet.agents["cp"], gguf_missing_tensor(fleet.base / "models", "broken.gguf"))
    fleet.write(replicas="  tiny: [a]", extra_models=f'  broken: {{format: gguf, digest: "{digest}", source: cp}}',
                clusters=f"  bad: {{model: broken, members: [cp], port: {fleet.server_port}}}\n"
                         f"  good: {{model: tiny-q, members: [cp], port: {free_port('127.0.0.2')}}}")
    applied = fleet.run("apply", "--auto-approve")
    assert applied.returncode == 7, applied.stdout + applied.stderr
    assert "✗ start server.bad@cp: [server_failed]" in applied.stdout and "broken.gguf" in applied.stdout
    assert "✓ start server.good@cp" in applied.stdout  # what does not depend on the failure finishes
    fleet.write(replicas="  tiny: [a]")  # the fix: drop the broken cluster and model; the next apply converges
    fleet.file.write_text(fleet.file.read_text() + f'delete_last_copy: ["{digest}"]\n')  # its only copy
    assert fleet.run("apply", "--auto-approve").returncode == 0
    assert fleet.run("plan", "--detailed-exitcode").returncode == 0


def test_a_recorded_observation_plans_offline_like_the_live_fleet(fleet: Fleet) -> None:
    fleet.write(replicas="  tiny: [a, b]", clusters=chat(fleet, "[b]"))
    snapshot = fleet.base / "snapshot.json"
    assert fleet.run("observe", "-o", str(snapshot)).returncode == 0
    live = json.loads(fleet.run("plan", "--json").stdout)
    offline = subprocess.run([fleet_bin(), "plan", "--json", "-f", str(fleet.file), "--observed", str(snapshot)],
                             capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert offline.returncode == 0, offline.stderr  # no secret, no network: the snapshot is enough
    assert json.loads(offline.stdout)["changes"] == live["changes"] and live["changes"]
