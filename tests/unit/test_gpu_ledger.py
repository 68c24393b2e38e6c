"""The planner's per-GPU ledger and VRAM estimate (reconciler/planning/gpus.py), beside the golden
cases (tests/cases/gpu-*) that show them in whole plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from reconciler.cache.observed import OFF_ENV
from reconciler.cli import main as cli
from reconciler.core.observed import ObservedNode, ObservedServer
from reconciler.fleetfile import config
from reconciler.planning.gpus import ENGINE_OVERHEAD, Arch, Estimates, Ledger, estimate, manifest_arch
from tests.golden import CASES, run_case, snapshot
from wire.plan_details import ServerSettings

GIB = 1 << 30


def test_the_kv_cache_is_sized_from_the_architecture_and_the_settings() -> None:
    # Llama-3-8B: 32 layers, 8 KV heads of 128, an f16 cache: 128 KiB a token.
    arch = Arch(32, 8 * 128, 2, "as reported")
    v = estimate("safetensors", 15 * GIB, arch, {"context_length": 8192}, 2)
    assert v["kv_cache_bytes"] == 32 * 2 * 1024 * 2 * 8192 * 16  # 16 sequences: the torch engine's batch
    assert v["overhead_bytes"] == 2 * ENGINE_OVERHEAD
    assert v["total_bytes"] == v["weights_bytes"] + v["kv_cache_bytes"] + v["overhead_bytes"]
    assert "32 layers x 2 x 1024 KV width x 2-byte cache x 8,192 tokens x 16 sequences" in v["basis"]
    # llama.cpp: the batched worker's sequences on GPUs (its --parallel there), the default context
    one = estimate("gguf", 15 * GIB, arch, {}, 1)
    assert one["kv_cache_bytes"] == 32 * 2 * 1024 * 2 * 2048 * 16 and "default" in one["basis"]
    stage = estimate("safetensors", 5 * GIB, arch, {}, 1, layers=8)  # a stage caches only its layers
    assert stage["kv_cache_bytes"] == 8 * 2 * 1024 * 2 * 2048 * 16


def test_a_plans_estimates_are_estimate_worked_out_once_for_what_it_reads() -> None:
    # Placement and the assignment ask the same sums: one answer for the format, weights, architecture,
    # context length, sequences, GPU count and layers; settings estimate() does not read do not count.
    arch = Arch(32, 8 * 128, 2, "as reported")
    estimates = Estimates()
    asks: list[tuple[str, int, Arch | None, ServerSettings, int, int | None]] = [
        ("safetensors", 15 * GIB, arch, {}, 1, None), ("safetensors", 15 * GIB, arch, {"context_length": 8192}, 1, None),
        ("safetensors", 15 * GIB, arch, {"parallel": 4}, 2, None), ("gguf", 15 * GIB, None, {}, 1, None),
        ("safetensors", 5 * GIB, arch, {}, 1, 8)]
    for fmt, weights, a, settings, gpus, layers in asks:
        got = estimates(fmt, weights, a, settings, gpus, layers)
        assert got == estimate(fmt, weights, a, settings, gpus, layers)
        assert estimates(fmt, weights, a, ServerSettings(**settings, threads=8), gpus, layers) is got
    assert estimates("safetensors", 15 * GIB, arch, {}, 2) != estimates("safetensors", 15 * GIB, arch, {}, 1)


def test_without_an_architecture_the_estimate_says_what_it_assumed() -> None:
    v = estimate("safetensors", 10 * GIB, None, {}, 1)
    assert v["kv_cache_bytes"] == 2 * GIB and "architecture not reported" in v["basis"]


def test_the_kv_width_is_read_from_a_full_manifests_k_projection() -> None:
    manifest = {"layers": 30, "files": [{"path": "model.safetensors", "tensors": [
        {"name": "model.layers.0.self_attn.q_proj.weight", "dtype": "BF16", "shape": [576, 576]},
        {"name": "model.layers.0.self_attn.k_proj.weight", "dtype": "BF16", "shape": [192, 576]}]}]}
    arch = manifest_arch(manifest)
    assert arch is not None and (arch.layers, arch.kv_width, arch.elem_bytes) == (30, 192, 2)
    assert manifest_arch({"layers": 30, "files": []}) is None


def node(*gpus: tuple[int, int], servers: dict[str, ObservedServer] | None = None) -> ObservedNode:
    return ObservedNode("a", gpus=tuple(("GPU", free, total) for free, total in gpus),
                        gpu_ids=tuple((i, f"GPU-{i}") for i in range(len(gpus))), servers=servers or {})


def test_others_are_what_is_used_beyond_fleets_reservations_and_a_replace_gives_its_share_back() -> None:
    held = ObservedServer("chat@a", "running", "sha256:x", 9000, {}, gpus=((0, "GPU-0", 60 * GIB),))
    ledger = Ledger({"a": node((15 * GIB, 80 * GIB), servers={"chat@a": held})})
    (g,) = ledger.gpus("a")
    assert (g.fleet, g.others, g.after) == (60 * GIB, 5 * GIB, 15 * GIB)
    assert ledger.assign("a", "code@a", 20 * GIB, 1, None).shares is None
    ledger.release("a", "chat@a")
    got = ledger.assign("a", "chat@a", 70 * GIB, 1, None).shares
    assert got == [{"index": 0, "uuid": "GPU-0", "bytes": 70 * GIB}] and g.after == 5 * GIB


def test_a_reset_ledger_is_what_the_agents_figures_alone_make() -> None:
    """Placement tries candidates on the plan's ledger, then resets it for the assignment."""
    held = ObservedServer("chat@a", "running", "sha256:x", 9000, {}, gpus=((0, "GPU-0", 60 * GIB),))
    nodes = {"a": node((15 * GIB, 80 * GIB), (50 * GIB, 80 * GIB), servers={"chat@a": held})}

    def figures(ledger: Ledger) -> list[tuple[int, int, int]]:
        return [(g.fleet, g.others, g.after) for g in ledger.gpus("a")]
    tried = Ledger(nodes)
    tried.release("a", "chat@a")
    assert tried.assign("a", "code@a", 40 * GIB, 1, None).shares is not None
    assert tried.assign("a", "big@a", 76 * GIB, 1, None).shares is None and tried.to_json()
    tried.reset()
    fresh = Ledger(nodes)
    assert figures(tried) == figures(fresh) and tried.to_json() == fresh.to_json() == []
    assert tried.assign("a", "code@a", 40 * GIB, 1, None) == fresh.assign("a", "code@a", 40 * GIB, 1, None)
    assert tried.to_json() == fresh.to_json()


def test_best_fit_ties_go_to_the_lower_index_and_the_same_inputs_give_the_same_gpus() -> None:
    def pick() -> list[int]:
        ledger = Ledger({"a": node((40 * GIB, 80 * GIB), (30 * GIB, 80 * GIB), (30 * GIB, 80 * GIB))})
        return [s["index"] for s in ledger.assign("a", "c@a", 20 * GIB, 1, None).shares or []]
    assert pick() == pick() == [1]


def test_a_plans_json_carries_each_part_of_the_estimate() -> None:
    plan = run_case(CASES / "gpu-kv-cache-from-architecture")
    (start,) = plan.changes
    vram = start.details["vram"]
    assert vram["kv_cache_bytes"] == 32 * 2 * 8 * 128 * 2 * 32768 * 16 == 64 * GIB
    assert "8 KV heads x 128, as its agent reports" in vram["basis"]
    assert start.details["gpus"] == [{"index": 0, "uuid": "GPU-0", "bytes": vram["total_bytes"]}]
    assert [row["index"] for row in plan.to_json()["gpus"]] == [0]  # the GPU it reserves on, not GPU 1


def test_fleet_plan_prints_the_gpus_it_reserves_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The command's plan is the planner's, GPU rows and all (`fleet plan` once rebuilt it without them)."""
    monkeypatch.setenv(OFF_ENV, "off")
    case = CASES / "gpu-kv-cache-from-architecture"
    loaded = config.load(case / "fleet.yaml")
    observed = tmp_path / "observed.json"
    observed.write_text(json.dumps(snapshot(loaded.document.data,  # type: ignore[union-attr]
                                            yaml.safe_load((case / "observed.yaml").read_text()))))
    args = ["plan", "-f", str(case / "fleet.yaml"), "--observed", str(observed)]
    cli.run([*args, "--json"])
    rows = json.loads(capsys.readouterr().out)["gpus"]
    assert rows == run_case(case).to_json()["gpus"] and [row["index"] for row in rows] == [0]
    cli.run(args)
    assert "GPUs of the nodes this plan starts servers on:" in capsys.readouterr().out


def test_nodes_wide_shows_each_gpus_servers() -> None:
    from reconciler.cli.statecmds import _columns

    servers = {"chat@a": ObservedServer("chat@a", "running", "sha256:x", 9000, {}, gpus=((1, "GPU-1", 60 * GIB),)),
               "old@a": ObservedServer("old@a", "failed", "sha256:x", 9001, {}, gpus=((1, "GPU-1", 9 * GIB),))}
    seen = node((80 * GIB, 80 * GIB), (15 * GIB, 80 * GIB), servers=servers)
    assert _columns("a", seen, None, True)[0] == "0: 80.0/80.0, 1: 15.0/80.0 (chat 60.0)"
    assert _columns("a", seen, None, False)[0] == "80.0/80.0, 15.0/80.0"


FLEET = """version: 1
control_plane: {node: cp}
nodes:
  cp: {address: 10.0.0.1}
  gpu-a: {address: 10.0.0.2, labels: {pool: h100}}
  gpu-b: {address: 10.0.0.3}
models:
  llama: {format: safetensors, digest: "sha256:1111111111111111111111111111111111111111111111111111111111111111", source: cp}
  qwen: {format: gguf, digest: "sha256:2222222222222222222222222222222222222222222222222222222222222222", source: cp}
clusters:
"""


def codes(clusters: str) -> list[tuple[str, str]]:
    from reconciler.fleetfile import config

    loaded = config.load_text(FLEET + clusters, "fleet.yaml")
    return [(d.code, d.address) for d in loaded.diagnostics]


def test_fleet_validate_checks_placement_and_pins_offline() -> None:
    assert codes("  chat: {model: llama, members: {count: 2, nodes: [gpu-a, gpu-b]}, port: 9001}\n") == []
    assert codes("  chat: {model: llama, members: {count: 2, labels: {pool: h100}}, port: 9001}\n") == [
        ("placement_too_few_candidates", "clusters.chat.members.count")]
    assert codes("  code: {model: qwen, members: {count: 2}, port: 9001}\n") == [
        ("placement_too_few_candidates", "clusters.code.members.count")]  # GGUF: the control plane's node only
    assert codes("  chat: {model: llama, members: {count: 1, nodes: [gpu-x]}, port: 9001}\n")[0] == (
        "unknown_node", "clusters.chat.members.nodes[0]")
    assert codes("  chat: {model: llama, members: {count: 1}, port: 9001, pipeline: true}\n") == [
        ("placement_pipeline_unsupported", "clusters.chat.members")]
    assert codes("  chat: {model: llama, members: [cp], port: 9001, settings: {gpus: {gpu-b: [0]}}}\n") == [
        ("gpus_not_a_member", "clusters.chat.settings.gpus.gpu-b")]
    assert codes("  chat: {model: llama, members: [cp], port: 9001, settings: {gpus: [0], tensor_parallel: 2}}\n") == [
        ("gpus_tensor_parallel_mismatch", "clusters.chat.settings.gpus")]
    assert [c for c, _ in codes("  chat: {model: llama, members: {cuont: 1}, port: 9001}\n")] == ["schema_violation"]


def test_placement_is_the_same_on_every_run_and_stays_once_applied() -> None:
    first = run_case(CASES / "placement-two-members")
    assert first == run_case(CASES / "placement-two-members")
    assert [c.node for c in first.changes if c.action.value == "start"] == ["gpu-a", "gpu-c"]
    # placement-stable is what applying it leaves (gpu-b now the emptiest): nothing moves
    assert run_case(CASES / "placement-stable").changes == ()
