"""A pipeline stage's part of a LoRA adapter merged into its weights at load: the slice of the
adapter for the stage's layers (wire/manifest.py make_adapter_slice), in PEFT's format.

The whole-model worker merges with peft itself (PeftModel.from_pretrained(...).merge_and_unload()).
A stage cannot: it holds a renumbered part of the model, while the adapter's config (its rank and
alpha patterns) names the whole model's modules. So the stage merges as peft's LoRA Linear layer
does, weight by weight under the whole model's names, before the layers are renumbered: each
weight W += (B @ A) * scaling, scaling = alpha / r (alpha / sqrt(r) with rsLoRA), r and alpha from
the config's patterns as peft matches them, A and B in float32 when the model is in float16 or
bfloat16 (peft's autocast of adapter weights) and in the model's dtype otherwise.
tests/unit/test_adapter_slices.py holds the result to peft's merge_and_unload, tensor for tensor."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from wire.layers import LayerRange
from wire.manifest import ADAPTER_FILE, layer_of

_TENSOR = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight\Z")
# What a plain LoRA merge cannot honour: refused in so many words, never merged differently.
_UNMERGED = {"use_dora": "DoRA", "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)", "lora_bias": "a LoRA bias",
             "layer_replication": "layer replication", "modules_to_save": "modules saved whole",
             "trainable_token_indices": "trainable tokens"}


class AdapterError(Exception):
    """The adapter cannot be merged into this stage, in one line."""


def _pattern(patterns: Any, module: str, default: Any) -> Any:
    """The value of the first key of `patterns` that names `module` as peft matches it
    (peft.utils.other.get_pattern_key: the key, after any dotted prefix, at the name's end)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def merge(weights: dict[str, torch.Tensor], adapter_dir: Path, layers: LayerRange) -> int:
    """Merge the adapter in `adapter_dir` into `weights` (the stage's tensors, by the whole model's
    names) in place; the number of weights changed. AdapterError when it does not fit."""
    from safetensors import safe_open

    try:
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"{adapter_dir} has no usable adapter_config.json: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise AdapterError(f"{adapter_dir} is not a LoRA adapter")
    unmerged = [what for key, what in _UNMERGED.items() if config.get(key) not in (None, False, [], {})]
    if unmerged:
        raise AdapterError(f"{adapter_dir}: a pipeline stage merges plain LoRA only, not {', '.join(unmerged)}")
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(adapter_dir / ADAPTER_FILE), framework="pt") as fh:
        for name in fh.keys():
            m = _TENSOR.match(name)
            if m is None:
                raise AdapterError(f"{adapter_dir}: {name} is not a LoRA A or B matrix")
            if layer_of(name) not in layers:
                raise AdapterError(f"{adapter_dir}: {name} is outside this stage's layers {layers}")
            pairs.setdefault(m.group(1), {})[m.group(2)] = fh.get_tensor(name)
    for module, ab in sorted(pairs.items()):
        target = f"{module}.weight"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{adapter_dir}: {module} has lora_{''.join(ab)} without its pair")
        if target not in weights:
            raise AdapterError(f"{adapter_dir}: it adapts {target}, which this stage does not hold")
        w = weights[target]
        r = _pattern(config.get("rank_pattern"), module, config.get("r"))
        alpha = _pattern(config.get("alpha_pattern"), module, config.get("lora_alpha"))
        a, b = ab["A"], ab["B"]
        if not isinstance(r, int) or not isinstance(alpha, (int, float)) or r <= 0:
            raise AdapterError(f"{adapter_dir}: no usable r and lora_alpha for {module}")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r or (b.shape[0], a.shape[1]) != w.shape:
            raise AdapterError(f"{adapter_dir}: {module}'s A {list(a.shape)} and B {list(b.shape)} (rank {r}) do not "
                               f"fit its weight {list(w.shape)}")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        dtype = torch.float32 if w.dtype in (torch.float16, torch.bfloat16) else w.dtype
        delta = (b.to(w.device, dtype) @ a.to(w.device, dtype)) * scaling
        w += delta  # as peft's merge: base_layer.weight.data += delta_weight
    return len(pairs)
