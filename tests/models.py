"""Tiny real models for tests, made once per session and cached (a second or so each)."""

from __future__ import annotations

from pathlib import Path

from agent.testmodel import Shape, make_gguf, make_safetensors


def tiny_safetensors(base: Path) -> Path:
    out = base / "tiny-llama"
    if not (out / "model.safetensors").exists():
        make_safetensors(out, Shape())
    return out


def tiny_gguf(base: Path) -> Path:
    out = base / "tiny-llama.gguf"
    if not out.exists():
        make_gguf(out, Shape())
    return out
