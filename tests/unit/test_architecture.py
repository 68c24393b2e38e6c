"""A held model's architecture in its weights entry (agent/weights/architecture.py): read from the tiny
model's own config.json and GGUF metadata once, kept, and what the planner sizes the KV cache from."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from jsonschema import Draft202012Validator

from agent.simulation.testmodel import Shape
from agent.weights import architecture
from agent.weights.store import Store
from reconciler.planning.gpus import DEFAULT_CONTEXT, SEQUENCES
from tests.golden import run_case
from tests.models import tiny_gguf, tiny_safetensors

SHAPE = Shape()
ROOT = Path(__file__).resolve().parents[2]


def test_config_values_each_with_its_fallback() -> None:
    assert architecture.from_config({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                     "head_dim": 128, "torch_dtype": "bfloat16"}) == \
        {"layers": 32, "kv_heads": 8, "head_dim": 128, "kv_dtype_bytes": 2}
    # no num_key_value_heads: every head has its own K and V; no head_dim: hidden_size / heads
    assert architecture.from_config({"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768,
                                     "torch_dtype": "float32"}) == \
        {"layers": 12, "kv_heads": 12, "head_dim": 64, "kv_dtype_bytes": 4}
    assert architecture.from_config({"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4,
                                                     "hidden_size": 64}})["layers"] == 2  # type: ignore[index]
    for bad in ({"num_attention_heads": 4, "hidden_size": 64},  # no layers
                {"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 64},  # heads do not divide
                {"num_hidden_layers": True, "num_attention_heads": 4, "hidden_size": 64},
                {"num_hidden_layers": -1, "num_attention_heads": 4, "hidden_size": 64},
                {"num_hidden_layers": 2**40, "num_attention_heads": 4, "hidden_size": 64}, [], "x"):
        assert architecture.from_config(bad) is None, bad


def test_gguf_fields_with_key_length_or_embedding_over_heads() -> None:
    fields = {"general.architecture": "qwen2", "qwen2.block_count": 24, "qwen2.attention.head_count": 14,
              "qwen2.attention.head_count_kv": 2, "qwen2.embedding_length": 896}
    assert architecture.from_gguf_fields(fields) == {"layers": 24, "kv_heads": 2, "head_dim": 64, "kv_dtype_bytes": 2}
    assert architecture.from_gguf_fields({**fields, "qwen2.attention.key_length": 128})["head_dim"] == 128  # type: ignore[index]
    assert architecture.from_gguf_fields({k: v for k, v in fields.items() if k != "qwen2.block_count"}) is None


def test_the_state_carries_each_held_models_architecture_read_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    st, _ = store.import_model(tiny_safetensors(tmp_path), "tiny")
    gg, _ = store.import_model(tiny_gguf(tmp_path), "tiny-gguf")
    want = {"layers": SHAPE.layers, "kv_heads": SHAPE.kv_heads, "head_dim": SHAPE.head_dim}
    assert store.entry(st)["architecture"] == {**want, "kv_dtype_bytes": 4}  # torch_dtype float32
    assert store.entry(gg)["architecture"] == {**want, "kv_dtype_bytes": 2}  # llama.cpp's f16 cache
    schema = json.loads((ROOT / "schemas" / "agent-state.schema.json").read_text())
    weights_item = schema["properties"]["weights"]["items"]
    for entry in store.entries():
        Draft202012Validator(weights_item).validate(entry)
    # Read as the model came in and kept in its meta: with the model's own headers gone (they never
    # change under its digest), the state still says it, in a fresh process too, so the state's path
    # never parses a GGUF's metadata (seconds for a real vocabulary, on the agent's event loop).
    config = store.model_dir(st) / "config.json"
    config.unlink()
    gguf = Path(store.entry(gg)["path"])
    gguf.write_bytes(b"")  # the blob's own inode: its headers are gone
    fresh = Store(tmp_path / "home")
    assert fresh.entry(st)["architecture"] == {**want, "kv_dtype_bytes": 4}
    assert fresh.entry(gg)["architecture"] == {**want, "kv_dtype_bytes": 2}
    # A model committed before the meta kept it is read once in the process (and then kept there)
    meta = tmp_path / "home" / "store" / "meta" / f"{st[7:]}.json"
    assert meta.is_file(), sorted((tmp_path / "home").rglob("meta/*"))
    kept = json.loads(meta.read_text())
    del kept["architecture"]
    meta.write_text(json.dumps(kept))
    assert "architecture" not in Store(tmp_path / "home").entry(st)  # config.json is gone: nothing to read


def test_a_plans_vram_estimate_sizes_the_kv_cache_from_the_agents_report(tmp_path: Path) -> None:
    store = Store(tmp_path / "home")
    digest, _ = store.import_model(tiny_safetensors(tmp_path), "tiny")
    entry = store.entry(digest)
    case = tmp_path / "case"
    case.mkdir()
    (case / "fleet.yaml").write_text(yaml.safe_dump({
        "version": 1, "control_plane": {"node": "cp"},
        "nodes": {"cp": {"address": "10.0.0.1"}, "gpu-a": {"address": "10.0.0.2"}},
        "models": {"tiny": {"format": "safetensors", "digest": digest, "source": "cp"}},
        "replicas": {"tiny": ["gpu-a"]},
        "clusters": {"chat": {"model": "tiny", "members": ["gpu-a"], "port": 9001}}}))
    held = {"model": "tiny", "bytes": entry["bytes"], "architecture": entry["architecture"]}
    (case / "observed.yaml").write_text(yaml.safe_dump({"nodes": {
        "cp": {"weights": [held]}, "gpu-a": {"weights": [held], "gpus": ["8G"]}}}))
    (start,) = run_case(case).changes
    vram = start.details["vram"]
    per_token = SHAPE.layers * 2 * SHAPE.kv_heads * SHAPE.head_dim * 4
    assert vram["kv_cache_bytes"] == per_token * DEFAULT_CONTEXT * SEQUENCES["safetensors"]
    assert f"{SHAPE.kv_heads} KV heads x {SHAPE.head_dim}, as its agent reports" in vram["basis"]
    assert vram["weights_bytes"] == entry["bytes"]
