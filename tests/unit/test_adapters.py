"""LoRA adapters (issue 29), in-process: what fleet.yaml may say of one (and the refusals, each with
its code and place), what `fleet-agent import` makes of a PEFT directory (a `peft` manifest naming
its base, modules and rank; a pickled or non-LoRA adapter refused), and the pure check that an
adapter fits its base, from the two manifests alone. The whole path on real processes:
tests/e2e/test_adapter.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.weights.importing import ImportRefused
from agent.weights.store import Store, StoreError
from reconciler.fleetfile import config
from wire import manifest as mf

D = {"m": "1", "g": "2", "lora": "3", "other": "4"}


def fleet(clusters: str, replicas: str = "  m: [a, b]\n  g: [cp]") -> config.Loaded:
    return config.load_text(f"""version: 1
control_plane: {{node: cp}}
nodes: {{cp: {{address: 10.0.0.1}}, a: {{address: 10.0.0.2}}, b: {{address: 10.0.0.3}}}}
models:
  m: {{format: safetensors, digest: "sha256:{D['m'] * 64}", source: cp, layers: 30}}
  g: {{format: gguf, digest: "sha256:{D['g'] * 64}", source: cp}}
  lora: {{format: peft, digest: "sha256:{D['lora'] * 64}", source: cp}}
  other: {{format: safetensors, digest: "sha256:{D['other'] * 64}", source: cp}}
replicas:
{replicas}
clusters:
{clusters}
""", "fleet.yaml")


def codes(loaded: config.Loaded) -> list[tuple[str, str]]:
    return [(d.code, d.address) for d in loaded.diagnostics]


def test_a_cluster_names_its_adapter_and_the_desired_state_carries_it() -> None:
    loaded = fleet("  tuned: {model: m, adapter: lora, members: [a, b], port: 9001}\n"
                   "  plain: {model: m, members: [a], port: 9002}")  # the adapter need not be listed under replicas
    assert loaded.ok and loaded.desired is not None, codes(loaded)
    assert loaded.desired.clusters["tuned"].adapter == "lora"
    assert loaded.desired.clusters["plain"].adapter is None


@pytest.mark.parametrize("cluster, expected", [
    ("  t: {model: g, adapter: lora, members: [cp], port: 9001}", ("adapter_gguf_unsupported", "clusters.t.adapter")),
    ("  t: {model: m, adapter: other, members: [cp], port: 9001}", ("not_an_adapter", "clusters.t.adapter")),
    ("  t: {model: m, adapter: nope, members: [cp], port: 9001}", ("unknown_model", "clusters.t.adapter")),
    ("  t: {model: lora, members: [cp], port: 9001}", ("model_is_adapter", "clusters.t.model")),
])
def test_what_cannot_be_served_is_refused_at_its_place(cluster: str, expected: tuple[str, str]) -> None:
    assert codes(fleet(cluster)) == [expected]


def test_a_pipeline_may_name_an_adapter() -> None:
    # Each stage merges the slice of it for its layers (tests/unit/test_adapter_slices.py): listed under no replicas.
    loaded = fleet("  t: {model: m, adapter: lora, members: [a, b], port: 9001, pipeline: true}",
                   '  m: [{node: a, layers: "0-14"}, {node: b, layers: "15-29"}]')
    assert loaded.ok and codes(loaded) == [], codes(loaded)
    assert loaded.desired is not None and loaded.desired.clusters["t"].adapter == "lora"


def peft_dir(path: Path, config_json: dict[str, object] | None = None, *, rows: int = 8) -> Path:
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps(config_json or {
        "peft_type": "LORA", "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M", "r": 2, "lora_alpha": 4,
        "target_modules": ["v_proj", "q_proj"]}))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(2, rows), f"{prefix}.lora_B.weight": torch.zeros(rows, 2)},
              str(path / "adapter_model.safetensors"))
    return path


def base_manifest(shape: list[int]) -> dict[str, object]:
    return {"format": "safetensors", "files": [{"path": "model.safetensors", "tensors": [
        {"name": "model.layers.0.self_attn.q_proj.weight", "shape": shape}]}]}


def test_an_imported_adapter_is_pinned_with_what_it_says_of_itself(tmp_path: Path) -> None:
    digest, manifest = Store(tmp_path / "home").import_model(peft_dir(tmp_path / "lora"), "lora")
    assert manifest["format"] == "peft" and mf.DIGEST_RE.match(digest)
    assert manifest["adapter"] == {"base_model": "HuggingFaceTB/SmolLM2-135M", "target_modules": ["q_proj", "v_proj"],
                                   "rank": 2, "alpha": 4}
    assert mf.validate(json.loads(mf.canonical(manifest))) == manifest  # as a peer checks it
    assert mf.adapter_base_problem(manifest, base_manifest([8, 8])) is None
    assert "does not fit the base's model.layers.0.self_attn.q_proj.weight [16, 16]" in str(
        mf.adapter_base_problem(manifest, base_manifest([16, 16])))
    assert "which the base does not have" in str(mf.adapter_base_problem(manifest, {"format": "safetensors", "files": [
        {"path": "model.safetensors", "tensors": [{"name": "model.layers.0.mlp.up_proj.weight", "shape": [8, 8]}]}]}))


def test_an_adapter_that_is_not_lora_or_is_pickled_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImportRefused, match="only LoRA adapters") as info:
        Store(tmp_path / "home").import_model(peft_dir(tmp_path / "ia3", {"peft_type": "IA3", "target_modules": ["k"]}),
                                              "ia3")
    assert info.value.code == "invalid_adapter"
    with pytest.raises(ImportRefused, match="target_modules") as info:
        Store(tmp_path / "home").import_model(peft_dir(tmp_path / "nomods", {"peft_type": "LORA", "r": 2,
                                                                               "lora_alpha": 2}), "nomods")
    assert info.value.code == "invalid_adapter"
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text("{}")
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(StoreError, match="adapter_model.bin is never imported"):
        Store(tmp_path / "home").import_model(pickled, "pickled")
