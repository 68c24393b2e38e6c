"""A held model's architecture, as far as the planner's VRAM estimate needs it (its KV cache per token):
layers, KV heads, head size and the cache's element bytes (`architecture` in a weights entry of GET
/v1/state; reconciler/core/observed.py reads it, reconciler/planning/gpus.py sizes the cache from it).

Read from the model's own headers, bounded as an import bounds them (agent/weights/headers.py):
config.json for safetensors (num_hidden_layers, num_key_value_heads or else num_attention_heads,
head_dim or else hidden_size / num_attention_heads, torch_dtype: the dtype the torch worker loads and
caches in), the GGUF metadata for GGUF ({arch}.block_count, {arch}.attention.head_count_kv or else
head_count, {arch}.attention.key_length or else embedding_length / head_count; llama.cpp's cache is
f16 by default: 2 bytes). None where a value is missing, not a positive integer, or the file cannot be
read: the planner then keeps its rule for a model whose architecture nothing reported."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from wire.state import Architecture

from agent.weights.headers import HeaderError, load_json, read_gguf

DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}
LLAMA_CPP_CACHE_BYTES = 2  # llama.cpp's default KV cache type, f16
MAX_VALUE = 1 << 20  # no real model has a million layers, heads or a head that wide


def _positive(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_VALUE:
        return None
    return value


def _whole(layers: Any, kv_heads: Any, head_dim: Any, elem: int) -> Architecture | None:
    n, heads, width = _positive(layers), _positive(kv_heads), _positive(head_dim)
    if n is None or heads is None or width is None:
        return None
    return {"layers": n, "kv_heads": heads, "head_dim": width, "kv_dtype_bytes": elem}


def from_config(config: Any) -> Architecture | None:
    """From a transformers config.json's values (a multimodal model's text_config where it has one)."""
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("text_config"), dict) and "num_hidden_layers" not in config:
        config = config["text_config"]
    heads = _positive(config.get("num_attention_heads"))
    kv_heads = config.get("num_key_value_heads", heads)
    head_dim = config.get("head_dim")
    if head_dim is None and heads is not None and _positive(config.get("hidden_size")) is not None:
        head_dim = config["hidden_size"] // heads if config["hidden_size"] % heads == 0 else None
    dtype = config.get("torch_dtype", config.get("dtype"))
    return _whole(config.get("num_hidden_layers"), kv_heads, head_dim,
                  DTYPE_BYTES.get(dtype, 2) if isinstance(dtype, str) else 2)


def from_gguf_fields(fields: dict[str, Any]) -> Architecture | None:
    """From a GGUF file's metadata: {key: value}, general.architecture among them."""
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        return None
    heads = _positive(fields.get(f"{arch}.attention.head_count"))
    kv_heads = fields.get(f"{arch}.attention.head_count_kv", heads)
    head_dim = fields.get(f"{arch}.attention.key_length")
    width = _positive(fields.get(f"{arch}.embedding_length"))
    if head_dim is None and heads is not None and width is not None and width % heads == 0:
        head_dim = width // heads
    return _whole(fields.get(f"{arch}.block_count"), kv_heads, head_dim, LLAMA_CPP_CACHE_BYTES)


def _gguf_fields(path: Path) -> dict[str, Any]:
    """The metadata the cache is sized by, from read_gguf's one parse (its bounds first: no count the
    file claims is believed past its size)."""
    shape: dict[str, Any] = read_gguf(path, os.stat(path).st_size)["shape"]
    return shape


def read(fmt: str, path: Path) -> Architecture | None:
    """The architecture of the model at `path` (a safetensors directory, or a .gguf file); None where
    it cannot be told. Never raises: a weights entry is listed in every state."""
    try:
        if fmt == "safetensors":
            config = path / "config.json"
            if not config.is_file():
                return None
            with open(config, "rb") as fh:
                return from_config(load_json(fh, config))
        if fmt == "gguf":
            return from_gguf_fields(_gguf_fields(path))
    except (OSError, HeaderError):
        return None
    except Exception:  # the gguf reader's own errors on a file read_gguf passed: no architecture, as unknown
        return None
    return None
