"""Model manifests (pure): the canonical form and digest, safetensors indexes, and layer slices.

A manifest lists a model's files with size and sha256 (and, above one piece, the digests a
receiver checks as bytes land: wire/pieces.py); for safetensors files also each tensor (name,
dtype, shape, byte range, sha256). The model's digest is the sha256 of the canonical JSON.
A slice manifest is computed from the full manifest alone, so the control plane can promise a
slice's digest without reading any weights. An encrypted model's manifest is its plaintext's, plus
`encryption` (cipher, chunk size, the key's id; never the key): its digest pins the model's bytes
and how they are sealed, not one sealing's random nonces (agent/weights/sealed.py)."""

from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any, BinaryIO

from . import pieces
from .layers import LayerRange

MANIFEST_VERSION = 1
ENCRYPTION_CIPHER = "aes-256-gcm"  # the only cipher of an encrypted model (agent/weights/sealed.py)
# \Z, not $: under re.match `$` also matches before a final newline, and "sha256:…\n" would pass.
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
HEX_RE = re.compile(r"^[0-9a-f]{64}\Z")
_LAYER_OF = re.compile(r"(?:^|\.)(?:layers|h|blocks|blk)\.(\d+)\.")
# The files a tokenizer is loaded from (transformers' names, sentencepiece's, a chat template kept
# beside them): only a pipeline's first stage tokenises, so only the first slice holds them.
_TOKENIZER_FILE = re.compile(r"^(?:tokenizer[^/]*|special_tokens_map\.json|added_tokens\.json|vocab\.[^/]+|"
                             r"merges\.txt|chat_template\.(?:jinja|json)|spiece\.model|sentencepiece[^/]*)$")
MAX_HEADER = 100 * 1024 * 1024
SLICE_FILE = "model.safetensors"
ADAPTER_FILE = "adapter_model.safetensors"  # a PEFT adapter's tensors, and a slice of them
_LORA_MATRIX = re.compile(r"\.lora_[AB]\.weight\Z")


class ManifestError(ValueError):
    pass


def canonical(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def digest_of(manifest: dict[str, Any]) -> str:
    return "sha256:" + hashlib.sha256(canonical(manifest)).hexdigest()


def check_digest(text: str) -> str:
    """The hex part of a `sha256:<64 hex>` digest, or ManifestError saying what is wrong."""
    if not DIGEST_RE.match(text):
        raise ManifestError(f"invalid digest {text[:80]!r}: expected 'sha256:' and 64 lowercase hex digits")
    return text[7:]


def safe_relpath(path: Any) -> str:
    """A relative path inside a model, refused if it could escape the store or is not portable."""
    if not isinstance(path, str) or not path or len(path) > 1024 or "\x00" in path or "\\" in path:
        raise ManifestError(f"unsafe file path {str(path)[:80]!r} in manifest")
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") or len(p) > 255 for p in parts):
        raise ManifestError(f"unsafe file path {path[:80]!r} in manifest: must be relative, without '..'")
    return path


def read_safetensors_index(fh: BinaryIO, size: int) -> tuple[int, list[dict[str, Any]]]:
    """(data start, tensors ordered by offset) from a safetensors file's header."""
    head = fh.read(8)
    if len(head) != 8:
        raise ManifestError("file too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise ManifestError(f"safetensors header length {n} is impossible for a {size}-byte file")
    try:
        header = json.loads(fh.read(n))
    except ValueError as exc:
        raise ManifestError(f"safetensors header is not JSON: {exc}") from None
    start = 8 + n
    tensors = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            b, e = info["data_offsets"]
            tensors.append({"name": name, "dtype": info["dtype"], "shape": list(info["shape"]),
                            "begin": start + int(b), "end": start + int(e)})
        except (KeyError, TypeError, ValueError):
            raise ManifestError(f"safetensors header entry {name!r} is malformed") from None
    tensors.sort(key=lambda t: (t["begin"], t["end"]))
    pos = start
    for t in tensors:
        if t["begin"] != pos or t["end"] < t["begin"]:
            raise ManifestError(f"tensor {t['name']!r} does not start where the previous one ends")
        pos = t["end"]
    if pos != size:
        raise ManifestError(f"tensor data ends at byte {pos} but the file has {size} bytes (truncated?)")
    return start, tensors


def layer_of(tensor_name: str) -> int | None:
    m = _LAYER_OF.search(tensor_name)
    return int(m.group(1)) if m else None


def is_tokenizer_file(path: str) -> bool:
    return bool(_TOKENIZER_FILE.match(path.rsplit("/", 1)[-1]))


def slice_header(tensors: list[dict[str, Any]]) -> bytes:
    """The safetensors header of a slice file: tensors in name order, packed, padded to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        size = t["end"] - t["begin"]
        entries[t["name"]] = {"dtype": t["dtype"], "shape": t["shape"], "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


def _assembled(path: str, picked: list[dict[str, Any]]) -> dict[str, Any]:
    """A slice's one file: the tensors `picked` (each with its `source` range) in name order, packed
    after their header."""
    picked.sort(key=lambda t: t["name"])
    header = slice_header(picked)
    offset = len(header)
    tensors = []
    for t in picked:
        size = t["end"] - t["begin"]
        tensors.append({"name": t["name"], "dtype": t["dtype"], "shape": t["shape"], "begin": offset,
                        "end": offset + size, "sha256": t["sha256"], "source": t["source"]})
        offset += size
    return {"path": path, "size": offset, "assembled": True, "header_sha256": hashlib.sha256(header).hexdigest(),
            "tensors": tensors}


def make_slice(full: dict[str, Any], full_digest: str, layers: LayerRange) -> dict[str, Any]:
    """The manifest of layers FIRST-LAST of a safetensors model: the auxiliary files (config in every
    slice, the tokenizer in the first only: a pipeline tokenises on its first stage), the tensors of
    those layers, the embeddings if it is the first slice, the final norm and output head if it is
    the last (the embeddings too when they are the head: a model without lm_head ties them),
    assembled into one safetensors file. A LoRA adapter (format peft) is sliced by the same layers
    (make_adapter_slice): the stage serving them merges those tensors only."""
    if full.get("format") == "peft":
        return make_adapter_slice(full, full_digest, layers)
    if full.get("format") != "safetensors":
        raise ManifestError("only safetensors models can be sliced by layers")
    if full.get("encryption"):
        raise ManifestError("an encrypted model is served whole, on the node holding its key; it is not sliced")
    if full.get("slice"):
        raise ManifestError("a slice is sliced from the full model's manifest, not from another slice")
    total = full.get("layers")
    if not isinstance(total, int):
        raise ManifestError("the model's manifest does not say how many layers it has (config.json "
                            "num_hidden_layers)")
    if layers.last >= total:
        raise ManifestError(f"layers {layers} are outside the model, which has {total} (0-{total - 1})")
    first, last = layers.first == 0, layers.last == total - 1
    tensors_of = [t for f in full["files"] for t in f.get("tensors", ())]
    tied = not any(t["name"].startswith("lm_head.") for t in tensors_of if layer_of(t["name"]) is None)
    aux, picked = [], []
    for f in full["files"]:
        if "tensors" not in f:
            # The slice is one file (no shard index); the tokenizer goes with the first slice only.
            if not f["path"].endswith(".safetensors.index.json") and (first or not is_tokenizer_file(f["path"])):
                aux.append({k: f[k] for k in ("path", "size", "sha256")})
            continue
        for t in f["tensors"]:
            n = layer_of(t["name"])
            keep = (n in layers) if n is not None else (
                (first or (last and tied)) if "embed" in t["name"] else last)
            if keep:
                picked.append({**t, "source": {"sha256": f["sha256"], "begin": t["begin"], "end": t["end"]}})
    assembled = _assembled(SLICE_FILE, picked)
    return {"version": MANIFEST_VERSION, "format": "safetensors", "layers": layers.count,
            "slice": {"of": full_digest, "layers": layers.span, "total_layers": total},
            "files": sorted(aux + [assembled], key=lambda f: f["path"])}


def make_adapter_slice(full: dict[str, Any], full_digest: str, layers: LayerRange) -> dict[str, Any]:
    """The manifest of the part of a LoRA adapter (format peft) that a pipeline stage serving layers
    FIRST-LAST merges: every file but the tensors (adapter_config.json in each slice) and the
    lora_A/lora_B matrices of those layers, assembled into one adapter_model.safetensors. Pure, from
    the adapter's manifest alone, so the plan promises its digest as it promises a model slice's.
    ManifestError for a tensor a stage cannot merge: one outside the decoder layers (the embeddings,
    the head: their stage is not told by the layers alone) or other than LoRA's two matrices (DoRA's
    magnitudes, a LoRA bias, a module saved whole)."""
    if full.get("encryption"):
        raise ManifestError("an encrypted adapter is served whole, on the node holding its key; it is not sliced")
    if full.get("slice"):
        raise ManifestError("a slice is sliced from the full adapter's manifest, not from another slice")
    aux, picked = [], []
    for f in full["files"]:
        if "tensors" not in f:
            aux.append({k: f[k] for k in ("path", "size", "sha256")})
            continue
        for t in f["tensors"]:
            name = str(t["name"])
            n = layer_of(name)
            if n is None:
                raise ManifestError(f"it adapts {name.split('.lora_')[0].removeprefix('base_model.model.')}, "
                                    "outside the decoder layers: a pipeline's stages merge only their layers' "
                                    "LoRA tensors")
            if not _LORA_MATRIX.search(name):
                raise ManifestError(f"its tensor {name} is not a LoRA A or B matrix: a pipeline's stages merge "
                                    "plain LoRA only (not DoRA, a LoRA bias or modules saved whole)")
            if n in layers:
                picked.append({**t, "source": {"sha256": f["sha256"], "begin": t["begin"], "end": t["end"]}})
    assembled = _assembled(ADAPTER_FILE, picked)
    return {"version": MANIFEST_VERSION, "format": "peft", "layers": layers.count,
            "slice": {"of": full_digest, "layers": layers.span}, "adapter": full["adapter"],
            "files": sorted(aux + [assembled], key=lambda f: f["path"])}


def adapter_block(config: Any, *, stored: bool = False) -> dict[str, Any]:
    """What a PEFT adapter's manifest says of it (`adapter`): the base it was made on (as its
    adapter_config.json names it), the modules it adapts, its rank and alpha; from the config found
    at import, or (`stored`) checked as a manifest holds it. ManifestError when it is no LoRA adapter."""
    if not isinstance(config, dict):
        raise ManifestError("adapter_config.json is not a JSON object")
    if not stored and config.get("peft_type") != "LORA":
        raise ManifestError(f"peft_type is {str(config.get('peft_type'))[:40]!r}: only LoRA adapters are merged")
    base = config.get("base_model" if stored else "base_model_name_or_path")
    modules = config.get("target_modules")
    if isinstance(modules, str):  # PEFT's regular expression form
        modules = [modules]
    rank, alpha = config.get("rank" if stored else "r"), config.get("alpha" if stored else "lora_alpha")
    if base is not None and not (isinstance(base, str) and len(base) <= 1024):
        raise ManifestError("base_model_name_or_path must be a string of at most 1,024 characters")
    if not (isinstance(modules, list) and 0 < len(modules) <= 1024
            and all(isinstance(m, str) and 0 < len(m) <= 256 for m in modules)):
        raise ManifestError("target_modules must name 1-1,024 modules")
    for what, v in (("r" if not stored else "rank", rank), ("lora_alpha" if not stored else "alpha", alpha)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1 << 20):
            raise ManifestError(f"{what} must be a positive number")
    return {"base_model": base, "target_modules": sorted(modules), "rank": rank, "alpha": alpha}


def adapter_base_problem(adapter: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Why the LoRA adapter of manifest `adapter` cannot be merged into the model of manifest `base`
    (None: it can): each lora_A/lora_B pair must adapt a weight the base has, of the shape it fits
    (A: rank x in_features, B: out_features x rank). Pure: from the two manifests alone."""
    if base.get("format") != "safetensors":
        return f"the base is {base.get('format')}, not a safetensors model"
    shapes = {t["name"]: t["shape"] for f in base["files"] for t in f.get("tensors", ())}
    for f in adapter["files"]:
        for t in f.get("tensors", ()):
            name, shape = str(t["name"]), t["shape"]
            part = ".lora_A." if ".lora_A." in name else ".lora_B." if ".lora_B." in name else None
            if part is None or len(shape) != 2:
                continue
            target = name.split(part)[0].removeprefix("base_model.model.") + ".weight"
            have = shapes.get(target)
            if have is None:
                return f"it adapts {target}, which the base does not have"
            want = have[1] if part == ".lora_A." else have[0]
            got = shape[1] if part == ".lora_A." else shape[0]
            if len(have) != 2 or got != want:
                return (f"its {name} {shape} does not fit the base's {target} {have}")
    return None


def validate(manifest: Any) -> dict[str, Any]:
    """Check a manifest from a peer before acting on it: shapes, hex digests, safe paths."""
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION:
        raise ManifestError("not a version-1 manifest")
    if manifest.get("format") not in ("safetensors", "gguf", "peft"):
        raise ManifestError(f"unknown model format {str(manifest.get('format'))[:40]!r}")
    if manifest["format"] == "peft":
        adapter_block(manifest.get("adapter"), stored=True)
    how = manifest.get("encryption")
    if how is not None and (not isinstance(how, dict) or how.get("cipher") != ENCRYPTION_CIPHER
                            or not isinstance(how.get("key_id"), str) or not isinstance(how.get("chunk_bytes"), int)):
        raise ManifestError(f"unknown encryption {str(how)[:80]!r}: expected {ENCRYPTION_CIPHER} with key_id and chunk_bytes")
    files = manifest.get("files")
    if not isinstance(files, list) or not files:
        raise ManifestError("manifest lists no files")
    seen = set()
    for f in files:
        if not isinstance(f, dict):
            raise ManifestError("manifest file entry is not an object")
        path = safe_relpath(f.get("path"))
        if path in seen:
            raise ManifestError(f"file {path!r} listed twice")
        seen.add(path)
        if not isinstance(f.get("size"), int) or f["size"] < 0:
            raise ManifestError(f"file {path!r} has no valid size")
        if not f.get("assembled") and not HEX_RE.match(str(f.get("sha256", ""))):
            raise ManifestError(f"file {path!r} has no valid sha256")
        wrong = pieces.check_entry(f, HEX_RE)
        if wrong is not None:
            raise ManifestError(f"file {path!r}: {wrong}")
        for t in f.get("tensors", []):
            if not HEX_RE.match(str(t.get("sha256", ""))) or not (0 <= t.get("begin", -1) <= t.get("end", -1)):
                raise ManifestError(f"tensor {str(t.get('name'))[:80]!r} of {path!r} is malformed")
            src = t.get("source")
            if src is not None and (not HEX_RE.match(str(src.get("sha256", "")))
                                    or src.get("end", -1) - src.get("begin", 0) != t["end"] - t["begin"]):
                raise ManifestError(f"tensor {str(t.get('name'))[:80]!r} has a malformed source range")
    return manifest
