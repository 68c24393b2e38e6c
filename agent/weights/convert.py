"""GGUF file -> safetensors model directory (config, tokenizer with its chat template, weights) that
the PyTorch engine serves: a user holding only a GGUF can run it on PyTorch too.

transformers dequantises the GGUF on load (`gguf_file=`); we drop the quantiser it leaves attached
(the weights are plain tensors by then) and save the result in the dtype asked for. Local files
only: nothing is fetched.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")
GGUF_MAGIC = b"GGUF"


class ConvertError(Exception):
    """A conversion refused or failed, said in one line (no traceback for the user)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def architecture(gguf_file: Path) -> str:
    """The file's `general.architecture`, read from its header; ConvertError if it is no GGUF."""
    try:
        with open(gguf_file, "rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ConvertError("unreadable", f"cannot read {gguf_file}: {exc.strerror or exc}") from None
    if magic != GGUF_MAGIC:
        raise ConvertError("not_gguf", f"{gguf_file} is not a GGUF file (it does not start with 'GGUF')")
    try:
        # headers.py's walk of the header, not gguf.GGUFReader's: transformers parses the file with
        # the reader three more times as it loads it, SmolLM2's 3.7 CPU-s each.
        from agent.weights.headers import gguf_architecture

        arch = gguf_architecture(gguf_file)
        if arch is None:
            raise ConvertError("not_gguf", f"{gguf_file} names no architecture (general.architecture)")
        return arch
    except ConvertError:
        raise
    except Exception as exc:  # a truncated or corrupt file: the parser's own words, in one line
        raise ConvertError("not_gguf", f"{gguf_file} is not a readable GGUF file: {type(exc).__name__}: "
                                       f"{str(exc).splitlines()[0] if str(exc) else ''}") from None


def supported_architectures() -> list[str]:
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(str(a) for a in GGUF_SUPPORTED_ARCHITECTURES)


def _check_out(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConvertError("output_exists", f"{out} already exists and is not an empty directory; "
                                            "choose a new path (nothing is overwritten)")


def _unquantise(model: Any) -> None:
    # After dequantisation the tensors are plain; the quantiser left attached would make
    # save_pretrained refuse (GGUF is "not serialisable") or record a quantisation that is gone.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model, "quantization_method"):
        model.quantization_method = None
    for attr in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(model.config, attr):
            delattr(model.config, attr)
    if hasattr(model.config, "_is_quantized"):
        model.config._is_quantized = False


def convert(gguf_file: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write the safetensors twin of `gguf_file` into `out` (new or empty), atomically: a failure
    leaves no partial directory behind."""
    if dtype not in DTYPES:
        raise ConvertError("bad_dtype", f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    gguf_file, out = Path(gguf_file), Path(out)
    if not gguf_file.is_file():
        raise ConvertError("not_found", f"{gguf_file} is not a file")
    _check_out(out)
    arch = architecture(gguf_file)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ConvertError("not_installed", f"converting needs torch, transformers and gguf "
                                            f"(pip install 'inference-fleet[torch,gguf]'): {exc}") from None
    known = supported_architectures()
    if arch not in known:
        raise ConvertError("unknown_architecture", f"{gguf_file}: architecture {arch!r} is not one transformers "
                                                   f"converts from GGUF ({', '.join(known)})")
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    for_all = 0o777 & ~umask  # mkdtemp makes it private; the result is an ordinary directory
    try:
        where, name = str(gguf_file.parent), gguf_file.name
        try:
            tokenizer: Any = AutoTokenizer.from_pretrained(where, gguf_file=name, local_files_only=True)
            model: Any = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, local_files_only=True,
                                                              dtype=getattr(torch, dtype))
        except (ValueError, KeyError, OSError, RuntimeError, NotImplementedError) as exc:
            raise ConvertError("load_failed", f"transformers could not load {gguf_file}: {type(exc).__name__}: "
                                              f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
        _unquantise(model)
        model.config.dtype = dtype
        model.save_pretrained(str(work), safe_serialization=True)
        tokenizer.save_pretrained(str(work))
        for path in [work, *work.iterdir()]:
            os.chmod(path, for_all if path.is_dir() else for_all & 0o666)
        _check_out(out)  # again: something may have appeared while we worked
        if out.exists():
            out.rmdir()
        os.rename(work, out)
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return out
