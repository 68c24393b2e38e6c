"""The registry of server backends (agent/backends/: one launch spec per engine, llama.cpp for GGUF,
PyTorch for safetensors, a PyTorch pipeline stage for a slice), picked by name or by the format a
whole model is stored in."""

from __future__ import annotations

from typing import Mapping

from agent.backends.launch import LaunchSpec
from agent.backends.llama_cpp import spec as llama_cpp
from agent.backends.pipeline import spec as pipeline
from agent.backends.torch import spec as torch

BACKENDS: Mapping[str, LaunchSpec] = {spec.name: spec for spec in (llama_cpp.SPEC, torch.SPEC, pipeline.SPEC)}
PIPELINE = pipeline.NAME  # picked by name, for a start that places a slice in a pipeline


def for_format(fmt: str, specs: Mapping[str, LaunchSpec] = BACKENDS) -> LaunchSpec | None:
    """The backend of `specs` serving whole models stored in `fmt`, or None when none does."""
    return next((spec for spec in specs.values() if spec.format == fmt and spec.name != PIPELINE), None)
