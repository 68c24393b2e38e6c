"""What the agent checks of a start before anything runs: its settings (the plan schema's, to the
same verdict), the GPUs it names (present now, by index and uuid), what it reserves on them against
what this agent's other servers and processes that are not fleet's hold (`gpu_overcommitted`), and
the environment the worker gets (CUDA_VISIBLE_DEVICES). In-process: the real Workers over the
simulated launcher (no process), a real store and simulated GPUs from a file."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Awaitable, Callable

import pytest
import trio

from agent.api.server import Spawner
from agent.backends.launch import gpu_environment
from agent.machine.inventory import Gpu, SimulatedGpus
from agent.serving.supervisor import SETTINGS_KEYS, RequestRefused, Workers, check_gpus, check_settings
from agent.simulation.simulate import SimulatedLauncher
from agent.weights.store import Store
from reconciler.schemas import Validator, load_schema
from tests.models import tiny_gguf

GIB = 1 << 30
HOST = "127.0.0.2"


def plan_settings_schema() -> dict[str, Any]:
    plan = load_schema("plan.schema.json")
    return {**plan["$defs"]["settings"], "$defs": plan["$defs"]}


def test_the_agent_knows_exactly_the_settings_the_plan_schema_does() -> None:
    assert set(SETTINGS_KEYS) == set(plan_settings_schema()["properties"])


SETTINGS = [
    None, {}, {"threads": 2, "context_length": 4096}, {"tensor_parallel": 2, "startup_timeout_s": 0.5},
    {"speculative": {"mode": "prompt_lookup", "tokens": 3}},
    {"speculative": {"mode": "draft", "draft": "small", "draft_digest": "sha256:" + "d" * 64}},
    [], "fast", 3, {"threads": 0}, {"threads": "2"}, {"threads": True}, {"threads": 1.5}, {"bogus": 1},
    {"startup_timeout_s": 0}, {"startup_timeout_s": "10"}, {"speculative": []}, {"speculative": {}},
    {"speculative": {"mode": "beam"}}, {"speculative": {"mode": "draft", "extra": 1}},
    {"speculative": {"mode": "draft", "draft_digest": "sha256:xyz"}}, {"speculative": {"mode": "draft", "tokens": 0}},
    {"speculative": {"mode": "draft", "draft": ""}}, {"tensor_parallel": -1},
    {"adapter": {"name": "lora", "digest": "sha256:" + "a" * 64}}, {"adapter": {"name": "lora"}},
    {"adapter": {"name": "", "digest": "sha256:" + "a" * 64}}, {"adapter": "lora"},
    {"adapter": {"name": "lora", "digest": "sha256:" + "a" * 64, "scale": 2}},
]


@pytest.mark.parametrize("settings", SETTINGS, ids=[json.dumps(s) for s in SETTINGS])
def test_settings_get_the_plan_schemas_verdict(settings: Any) -> None:
    schema_ok = settings is None or Validator(plan_settings_schema()).is_valid(settings)
    try:
        check_settings(settings)
        agent_ok = True
    except RequestRefused as exc:
        agent_ok = False
        assert (exc.status, exc.code) == (400, "bad_settings")
        assert exc.message.startswith("settings")  # names the place
    assert agent_ok == schema_ok


def test_a_list_for_settings_is_refused_naming_what_it_got() -> None:
    with pytest.raises(RequestRefused, match=r"^settings: must be an object, not list \[\]$") as info:
        check_settings([])
    assert info.value.code == "bad_settings"


GPUS = [Gpu(0, "NVIDIA H100", "GPU-aaaa", 80 * GIB, 79 * GIB).to_json(),
        Gpu(1, "NVIDIA H100", "GPU-bbbb", 80 * GIB, 80 * GIB).to_json()]


@pytest.mark.parametrize("gpus, status, code, words", [
    ({"index": 0}, 400, "bad_gpus", "must be a list"),
    ([{"index": 0, "uuid": "GPU-aaaa"}], 400, "bad_gpus", "exactly index, uuid and bytes"),
    ([{"index": -1, "uuid": "GPU-aaaa", "bytes": 1}], 400, "bad_gpus", "gpus[0]: index must be"),
    ([{"index": 0, "uuid": "GPU-aaaa", "bytes": True}], 400, "bad_gpus", "bytes an integer"),
    ([{"index": 0, "uuid": "GPU-aaaa", "bytes": 1}, {"index": 0, "uuid": "GPU-aaaa", "bytes": 1}], 400, "bad_gpus",
     "named twice"),
    ([{"index": 2, "uuid": "GPU-cccc", "bytes": 1}], 409, "gpu_not_found", "no GPU 2 now (its GPUs: 0 (GPU-aaaa), 1"),
    ([{"index": 1, "uuid": "GPU-aaaa", "bytes": 1}], 409, "gpu_not_found", "GPU 1 of this node is GPU-bbbb, not GPU-aaaa"),
], ids=["not-a-list", "missing-bytes", "negative-index", "bool-bytes", "twice", "no-such-index", "uuid-differs"])
def test_gpus_a_start_names_are_checked_against_the_inventory(gpus: Any, status: int, code: str, words: str) -> None:
    with pytest.raises(RequestRefused) as info:
        check_gpus(gpus, GPUS)
    assert (info.value.status, info.value.code) == (status, code)
    assert words in info.value.message


def test_gpus_present_by_index_and_uuid_are_kept_in_order() -> None:
    named = [{"index": 1, "uuid": "GPU-bbbb", "bytes": 5}, {"index": 0, "uuid": "GPU-aaaa", "bytes": 7}]
    assert check_gpus(named, GPUS) == named
    assert check_gpus(None, GPUS) == [] and check_gpus([], []) == []


def test_the_worker_sees_exactly_its_gpus_or_none() -> None:
    two = [{"index": 1, "uuid": "GPU-bbbb", "bytes": 5}, {"index": 0, "uuid": "GPU-aaaa", "bytes": 7}]
    assert gpu_environment(two) == {"CUDA_VISIBLE_DEVICES": "GPU-bbbb,GPU-aaaa"}
    assert gpu_environment([]) == {"CUDA_VISIBLE_DEVICES": ""}  # a CPU server never lands on GPU 0
    assert gpu_environment([], legacy_gpu_ask=True) == {}  # tensor_parallel from a planner that names none


def gpu_file(path: Path, gpus: list[dict[str, Any]]) -> Path:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(gpus))
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def gpus_now(probe: SimulatedGpus) -> list[Any]:
    return [g.to_json() for g in probe.gpus()]  # as POST /v1/servers hands them to the workers


def run(home: Path, fn: Callable[[Workers, SimulatedGpus, str], Awaitable[None]], gpus: list[dict[str, Any]]) -> None:
    store = Store(home)
    digest, _ = store.import_model(tiny_gguf(home / "models"), "m")
    probe = SimulatedGpus(gpu_file(home / "gpus.json", gpus))

    async def main() -> None:
        spawner = Spawner()
        async with trio.open_nursery() as nursery:
            spawner.nursery = nursery
            workers = Workers(home, store, spawner, SimulatedLauncher(), HOST)
            probe.loaded = workers.reserved
            with trio.fail_after(30):
                await fn(workers, probe, digest)
            await workers.stop_all()

    trio.run(main)


TWO = [{"name": "NVIDIA L4", "uuid": "GPU-l4-0", "memory_total_bytes": 24 * GIB, "memory_free_bytes": 23 * GIB},
       {"name": "NVIDIA L4", "uuid": "GPU-l4-1", "memory_total_bytes": 24 * GIB}]


def share(index: int, gib: float) -> dict[str, Any]:
    return {"index": index, "uuid": f"GPU-l4-{index}", "bytes": int(gib * GIB)}


def test_servers_share_a_gpu_while_they_fit_and_the_next_is_refused_naming_it(tmp_path: Path) -> None:
    async def go(workers: Workers, probe: SimulatedGpus, digest: str) -> None:
        a = workers.start({"id": "a@n", "model": digest, "port": 9001, "gpus": [share(0, 10)]}, gpus_now(probe))
        b = workers.start({"id": "b@n", "model": digest, "port": 9002, "gpus": [share(0, 12)]}, gpus_now(probe))
        assert a.env == {"CUDA_VISIBLE_DEVICES": "GPU-l4-0"} and b.env == {"CUDA_VISIBLE_DEVICES": "GPU-l4-0"}
        # 1 GiB held by a process that is not fleet's, 22 GiB reserved by a and b: 1 GiB is left.
        assert [g.memory_free_bytes for g in probe.gpus()] == [1 * GIB, 24 * GIB]
        with pytest.raises(RequestRefused) as info:
            workers.start({"id": "c@n", "model": digest, "port": 9003, "gpus": [share(0, 1.5)]}, gpus_now(probe))
        assert (info.value.status, info.value.code) == (409, "gpu_overcommitted")
        assert info.value.message == (
            "GPU 0 (GPU-l4-0, NVIDIA L4) cannot take 1.50 GiB for c@n: of its 24.00 GiB, fleet's servers reserve "
            "22.00 GiB (a@n 10.00 GiB, b@n 12.00 GiB) and processes that are not fleet's hold 1.00 GiB, leaving "
            "1.00 GiB; plan again")
        assert "c@n" not in workers.servers
        # What does fit still starts, on the other GPU.
        c = workers.start({"id": "c@n", "model": digest, "port": 9003, "gpus": [share(1, 1.5)]}, gpus_now(probe))
        assert c.to_json()["gpus"] == [share(1, 1.5)]
        await workers.stop("a@n")  # a's share is free again
        workers.start({"id": "d@n", "model": digest, "port": 9004, "gpus": [share(0, 10)]}, gpus_now(probe))
        assert workers.reserved() == {"GPU-l4-0": 22 * GIB, "GPU-l4-1": int(1.5 * GIB)}

    run(tmp_path, go, TWO)


def test_a_tensor_parallel_start_names_as_many_gpus_and_the_engine_splits_over_them(tmp_path: Path) -> None:
    async def go(workers: Workers, probe: SimulatedGpus, digest: str) -> None:
        with pytest.raises(RequestRefused, match="tensor_parallel is 2 but gpus names 1") as info:
            workers.start({"id": "a@n", "model": digest, "port": 9001, "settings": {"tensor_parallel": 2},
                           "gpus": [share(0, 4)]}, gpus_now(probe))
        assert info.value.code == "bad_gpus"
        s = workers.start({"id": "a@n", "model": digest, "port": 9001, "settings": {"tensor_parallel": 2},
                           "gpus": [share(1, 4), share(0, 4)]}, gpus_now(probe))
        assert s.env == {"CUDA_VISIBLE_DEVICES": "GPU-l4-1,GPU-l4-0"}
        # llama.cpp splits in proportion to each GPU's free memory at the start: 24 and 23 GiB.
        at = s.argv.index("--n_gpu_layers")
        assert s.argv[at:at + 7] == ["--n_gpu_layers", "-1", "--main_gpu", "0", "--tensor_split", "0.5106", "0.4894"]
        cpu = workers.start({"id": "cpu@n", "model": digest, "port": 9002}, gpus_now(probe))
        assert cpu.env == {"CUDA_VISIBLE_DEVICES": ""} and "gpus" not in cpu.to_json()
        assert "--n_gpu_layers" not in cpu.argv

    run(tmp_path, go, TWO)


def test_a_gpu_the_file_no_longer_lists_is_gone_from_the_next_answer(tmp_path: Path) -> None:
    async def go(workers: Workers, probe: SimulatedGpus, digest: str) -> None:
        workers.start({"id": "a@n", "model": digest, "port": 9001, "gpus": [share(1, 4)]}, gpus_now(probe))
        assert [g.memory_free_bytes for g in probe.gpus()] == [23 * GIB, 20 * GIB]
        gpu_file(probe.path, [{**TWO[1], "index": 1}])
        assert [(g.index, g.uuid, g.memory_free_bytes) for g in probe.gpus()] == [(1, "GPU-l4-1", 20 * GIB)]
        with pytest.raises(RequestRefused, match="no GPU 0 now") as info:
            workers.start({"id": "b@n", "model": digest, "port": 9002, "gpus": [share(0, 1)]}, gpus_now(probe))
        assert info.value.code == "gpu_not_found"

    run(tmp_path, go, TWO)


def test_simulated_free_memory_never_falls_below_zero(tmp_path: Path) -> None:
    path = gpu_file(tmp_path / "g.json", [{"name": "x", "uuid": "GPU-x", "memory_total_bytes": 8 * GIB,
                                          "memory_free_bytes": 2 * GIB}])
    probe = SimulatedGpus(path, loaded=lambda: {"GPU-x": 5 * GIB, "GPU-elsewhere": 1})
    assert probe.gpus() == [Gpu(0, "x", "GPU-x", 8 * GIB, 0)]
