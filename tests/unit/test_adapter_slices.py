"""A LoRA adapter on a pipeline (issue 29), in-process: the slice of an adapter for a stage's layers
(wire.manifest.make_slice of a peft manifest: those layers' tensors, the config in every slice, a
digest from the manifest alone), what no stage can merge refused, the plan promising each stage its
part (fetched before the stage starts) and the stage's merge equal to peft's merge_and_unload of the
whole model, tensor for tensor, on the tiny Llama. On real processes: tests/e2e/test_adapter_pipeline.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from agent.weights.store import Store
from reconciler.core.observed import from_snapshot
from reconciler.fleetfile import config
from reconciler.planning.planner import plan
from wire import manifest as mf
from wire.layers import LayerRange

from tests.golden import snapshot
from tests.models import hold_slices, make_adapter, tiny_safetensors

SPANS = ["0-1", "2-3"]  # the tiny Llama's 4 layers over two stages


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("adapter-slices")
    model = tiny_safetensors(base)
    make_adapter(model, base / "lora")
    store = Store(base / "home")
    model_digest, model_manifest = store.import_model(model, "tiny", link=True)
    lora_digest, lora_manifest = store.import_model(base / "lora", "lora", link=True)
    return {"base": base, "model": model, "lora": base / "lora", "model_digest": model_digest,
            "model_manifest": model_manifest, "lora_digest": lora_digest, "lora_manifest": lora_manifest}


def tensors(manifest: dict[str, Any]) -> set[str]:
    return {t["name"] for f in manifest["files"] for t in f.get("tensors", ())}


def test_each_slice_holds_its_layers_tensors_and_the_config(made: dict[str, Any]) -> None:
    full, digest = made["lora_manifest"], made["lora_digest"]
    every = tensors(full)
    assert len(every) == 4 * 2 * 2  # 4 layers x (q, v) x (A, B)
    config_file = next(f for f in full["files"] if f["path"] == "adapter_config.json")
    seen: set[str] = set()
    for span in SPANS:
        part = mf.make_slice(full, digest, LayerRange.parse(span))
        assert part["format"] == "peft" and part["slice"] == {"of": digest, "layers": LayerRange.parse(span).span}
        assert part["adapter"] == full["adapter"]
        names = tensors(part)
        assert names == {n for n in every if mf.layer_of(n) in LayerRange.parse(span)}, sorted(names)
        assert not names & seen
        seen |= names
        assert {k: v for k, v in next(f for f in part["files"] if f["path"] == "adapter_config.json").items()} == \
            {k: config_file[k] for k in ("path", "size", "sha256")}
        assert next(f for f in part["files"] if f["path"] == mf.ADAPTER_FILE)["assembled"]
        # The digest is the manifest's alone: the same from a copy read back, as an agent computes it.
        again = mf.make_slice(json.loads(mf.canonical(full)), digest, LayerRange.parse(span))
        assert mf.digest_of(again) == mf.digest_of(part)
        assert mf.validate(json.loads(mf.canonical(part))) == part
    assert seen == every
    assert len({mf.digest_of(mf.make_slice(full, digest, LayerRange.parse(s))) for s in SPANS}) == 2


@pytest.mark.parametrize("name, why", [
    ("base_model.model.lm_head.lora_A.weight", "adapts lm_head, outside the decoder layers"),
    ("base_model.model.model.layers.1.self_attn.q_proj.lora_magnitude_vector", "is not a LoRA A or B matrix"),
    ("base_model.model.model.layers.1.self_attn.q_proj.lora_B.bias", "is not a LoRA A or B matrix"),
])
def test_a_tensor_no_stage_can_merge_is_refused(made: dict[str, Any], name: str, why: str) -> None:
    full = copy.deepcopy(made["lora_manifest"])
    f = next(f for f in full["files"] if f["path"] == mf.ADAPTER_FILE)
    f["tensors"].append({**f["tensors"][-1], "name": name})
    with pytest.raises(mf.ManifestError, match=why):
        mf.make_slice(full, made["lora_digest"], LayerRange.parse("0-1"))


def planned(made: dict[str, Any], lora_manifest: dict[str, Any] | None) -> Any:
    text = f"""version: 1
control_plane: {{node: cp}}
nodes: {{cp: {{address: 10.0.0.1}}, a: {{address: 10.0.0.2}}, b: {{address: 10.0.0.3}}}}
models:
  tiny: {{format: safetensors, digest: "{made['model_digest']}", source: cp, layers: 4}}
  lora: {{format: peft, digest: "{made['lora_digest']}", source: cp}}
replicas:
  tiny: [{{node: a, layers: "0-1"}}, {{node: b, layers: "2-3"}}]
clusters:
  t: {{model: tiny, adapter: lora, members: [a, b], port: 9001, pipeline: {{rendezvous_port: 9101}}}}
"""
    loaded = config.load_text(text, "fleet.yaml")
    assert loaded.ok and loaded.desired is not None, [(d.code, d.summary) for d in loaded.diagnostics]
    snap = snapshot(loaded.document.data, {"nodes": {"cp": {"weights": ["tiny", "lora"]}, "a": {}, "b": {}}})  # type: ignore[union-attr]
    snap["manifests"] = {made["model_digest"]: made["model_manifest"]}
    if lora_manifest is not None:
        snap["manifests"][made["lora_digest"]] = lora_manifest
    return plan(loaded.desired, from_snapshot(snap))


def test_the_plan_promises_each_stage_its_part_of_the_adapter(made: dict[str, Any]) -> None:
    p = planned(made, made["lora_manifest"])
    assert not [d for d in p.diagnostics if d.severity == "error"], [d.summary for d in p.diagnostics]
    changes = {c.address: c for c in p.changes}
    for node, span in zip(("a", "b"), SPANS):
        part = mf.make_slice(made["lora_manifest"], made["lora_digest"], LayerRange.parse(span))
        fetch = changes[f"replica.lora[{span}]@{node}"].details
        assert (fetch["digest"], fetch["layers"], fetch["source_digest"]) == (
            mf.digest_of(part), span, made["lora_digest"]), fetch
        assert fetch["bytes"] == sum(f["size"] for f in part["files"])
        start = changes[f"server.t@{node}"]
        assert start.details["settings"]["adapter"] == {"name": "lora", "digest": mf.digest_of(part)}
        assert f"replica.lora[{span}]@{node}" in start.depends_on and f"replica.tiny[{span}]@{node}" in start.depends_on
    assert "replica.lora@a" not in changes and "replica.lora@b" not in changes  # never the whole adapter


def test_an_adapter_no_stage_can_merge_is_a_plan_error_at_the_cluster(made: dict[str, Any]) -> None:
    full = copy.deepcopy(made["lora_manifest"])
    f = next(f for f in full["files"] if f["path"] == mf.ADAPTER_FILE)
    f["tensors"].append({**f["tensors"][-1], "name": "base_model.model.lm_head.lora_A.weight", "shape": [4, 64]})
    p = planned(made, full)
    assert [(d.code, d.address) for d in p.diagnostics if d.severity == "error"] == [
        ("adapter_pipeline_unsupported", "clusters.t.adapter")], [d.summary for d in p.diagnostics]
    assert "lm_head" in next(d.summary for d in p.diagnostics if d.code == "adapter_pipeline_unsupported")
    assert not [c for c in p.changes if c.address.startswith("server.")]  # the group is not planned
    unknown = planned(made, None)  # no node reported the adapter's manifest: no digest can be promised
    assert ("source_missing", "replica.lora[0-1]@a") in [(d.code, d.address) for d in unknown.diagnostics]
    assert not [c for c in unknown.changes if c.address.startswith("server.")]


def test_a_stage_merges_its_part_as_peft_merges_the_whole_model(made: dict[str, Any]) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from agent.backends.pipeline.model import load_slice

    whole: Any = AutoModelForCausalLM.from_pretrained(made["model"], dtype=torch.float32, local_files_only=True)
    merged = PeftModel.from_pretrained(whole, str(made["lora"])).merge_and_unload().state_dict()
    base = Store(made["base"] / "stages")
    models = [base.model_dir(d) for d in hold_slices(base, made["model"], SPANS)]
    adapters = Store(made["base"] / "adapter-stages")
    parts = [adapters.model_dir(d) for d in hold_slices(adapters, made["lora"], SPANS)]
    changed = 0
    for span, model_dir, adapter_dir in zip(SPANS, models, parts):
        layers = LayerRange.parse(span)
        stage = load_slice(model_dir, layers, torch.device("cpu"), "float32", adapter_dir)
        plain = load_slice(model_dir, layers, torch.device("cpu"), "float32")
        mine, before = stage.stack.model.state_dict(), plain.stack.model.state_dict()
        for name, tensor in mine.items():
            n = mf.layer_of(name)
            whole_name = name if n is None else name.replace(f"layers.{n}.", f"layers.{n + layers.first}.", 1)
            assert torch.equal(tensor, merged[whole_name]), name  # peft's merge, bit for bit
            changed += not torch.equal(tensor, before[name])
    assert changed == 4 * 2  # q and v of every layer, merged by one stage or the other
    with pytest.raises(Exception, match="outside this stage's layers"):
        load_slice(models[0], LayerRange.parse(SPANS[0]), torch.device("cpu"), "float32", parts[1])
