"""Tiny real models for tests, made once per session and cached (a second or so each)."""

from __future__ import annotations

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
