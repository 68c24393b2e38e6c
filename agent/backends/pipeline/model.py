"""A pipeline stage's model: the layers of its slice (renumbered from 0), the embeddings on the
first stage, the final norm and head on the last; built on the meta device so that no other
parameter is ever allocated, then given the slice's tensors."""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from wire.layers import LayerRange
from wire.manifest import layer_of

from agent.backends.pipeline import lora
from agent.backends.torch.layers import Stack, Unsupported

_LAYER = re.compile(r"((?:^|\.)(?:layers|h|blocks|blk)\.)(\d+)\.")
EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"


class LoadError(Exception):
    """The slice cannot serve as this stage, in one line."""


@dataclass(frozen=True, slots=True)
class SliceModel:
    stack: Stack
    layers: LayerRange
    total_layers: int
    config: Any
    hidden_size: int

    @property
    def embeds(self) -> bool:
        return self.layers.first == 0

    @property
    def heads(self) -> bool:
        return self.layers.last == self.total_layers - 1


def choose_dtype(name: str, device: torch.device, config: Any) -> torch.dtype:
    """As the whole-model worker: auto is float32 on a CPU (bf16 arithmetic is slow on most), the
    checkpoint's own dtype on a GPU."""
    if name != "auto":
        return getattr(torch, name)  # type: ignore[no-any-return]
    if device.type == "cpu":
        return torch.float32
    saved = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(saved, torch.dtype):
        return saved
    return getattr(torch, str(saved)) if isinstance(saved, str) and hasattr(torch, str(saved)) else torch.float32


def read_config(model_dir: Path) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise LoadError(f"{model_dir} has no usable config.json: {exc}") from None


def load_slice(model_dir: Path, layers: LayerRange, device: torch.device, dtype_name: str = "auto",
               adapter_dir: Path | None = None) -> SliceModel:
    """The stage serving `layers` from `model_dir` (a slice holding at least those layers, or the
    whole model: only what the stage needs is read), with the LoRA adapter in `adapter_dir` (the
    slice of it for those layers) merged into its weights."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = read_config(model_dir)
    total = int(config.num_hidden_layers)
    if layers.last >= total:
        raise LoadError(f"layers {layers} are outside the model, which has {total} (0-{total - 1})")
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir} holds no .safetensors file")
    first, last = layers.first == 0, layers.last == total - 1
    where: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                where[name] = f
    held = {n for n in (layer_of(k) for k in where) if n is not None}
    if not set(range(layers.first, layers.last + 1)) <= held:
        raise LoadError(f"{model_dir} holds layers {_spans(held)}, not all of {layers}")
    # A model saved without lm_head ties it to the embeddings, which the last stage then holds.
    head = HEAD if HEAD in where or not getattr(config, "tie_word_embeddings", False) else EMBED
    needs = ({EMBED} if first else set()) | ({NORM, head} if last else set())
    missing = sorted(needs - set(where))
    if missing:
        raise LoadError(f"{model_dir} lacks {', '.join(missing)}, which the stage serving layers {layers} needs")
    wanted = [k for k in where if layer_of(k) in layers or k in needs]
    dtype = choose_dtype(dtype_name, device, config)

    sub = copy.deepcopy(config)
    sub.num_hidden_layers = layers.count
    if getattr(sub, "layer_types", None):
        sub.layer_types = list(sub.layer_types)[layers.first:layers.last + 1]
    with torch.device("meta"):
        model: Any = AutoModelForCausalLM.from_config(sub, dtype=dtype)  # type: ignore[no-untyped-call]
    loaded: dict[str, torch.Tensor] = {}
    for k in wanted:
        with safe_open(str(where[k]), framework="pt", device=str(device)) as fh:
            loaded[k] = fh.get_tensor(k).to(dtype)
    if adapter_dir is not None:  # by the whole model's names, as the adapter's config names them
        try:
            lora.merge(loaded, adapter_dir, layers)
        except lora.AdapterError as exc:
            raise LoadError(str(exc)) from None
    state = {_LAYER.sub(lambda m: f"{m.group(1)}{int(m.group(2)) - layers.first}.", k, count=1): t
             for k, t in loaded.items()}
    if last and HEAD not in state:
        state[HEAD] = state[EMBED]  # tied: the embeddings are the head
    model.load_state_dict(state, strict=False, assign=True)
    inner = model.model
    if not first:
        inner.embed_tokens = None
    if not last:
        inner.norm = None
        model.lm_head = None
    with torch.device(device):  # its buffers are computed, not stored: the meta copies are empty
        inner.rotary_emb = type(inner.rotary_emb)(sub)
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise LoadError(f"the stage's model still lacks {', '.join(empty[:6])} after loading {model_dir} "
                        f"({type(model).__name__} is not laid out as the pipeline needs)")
    model.eval()
    try:
        stack = Stack(model)
    except Unsupported as exc:
        raise LoadError(str(exc)) from None
    return SliceModel(stack, layers, total, config, int(config.hidden_size))


def _spans(held: set[int]) -> str:
    if not held:
        return "none"
    out, ordered = [], sorted(held)
    start = prev = ordered[0]
    for n in ordered[1:] + [None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(str(LayerRange(start, prev)))
        if n is not None:
            start = prev = n
    return ", ".join(out)
