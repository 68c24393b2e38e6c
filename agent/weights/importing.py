"""Importing a local model into the store: an HF directory or one GGUF file, each file read once for
its prefix digests (whose running hash ends as its sha256), each safetensors tensor's sha256 and the copy (plain, hard-linked, or sealed under the
node's key: agent/weights/sealed.py), then committed as any model is. The original is never modified."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from wire import manifest as mf
from wire import pieces

from agent.weights.sealed import Key, SealWriter, manifest_block
from agent.weights.store import CHUNK, Store, StoreError

_SKIP_DIRS = {".git", ".cache", "__pycache__"}


def import_model(store: Store, src: Path, name: str, *, link: bool = False,
             encrypt: bool = False, piece_bytes: int | None = None) -> tuple[str, dict[str, Any]]:
    """Hash and store a local model (an HF directory, or one .gguf file). With
    `encrypt`, every file of it is sealed under the store's key (none is kept in plaintext)."""
    if encrypt and (store.key is None or link):
        raise StoreError("an encrypted import needs the node's weights key (--key-file or "
                         "$FLEET_WEIGHTS_KEY_FILE) and copies (no --link)")
    src = src.resolve()
    if src.is_dir():
        files = sorted(p for p in src.rglob("*") if p.is_file()
                       and not _SKIP_DIRS.intersection(p.relative_to(src).parts[:-1]))
        rels = [p.relative_to(src).as_posix() for p in files]
        if "config.json" not in rels or not any(r.endswith(".safetensors") for r in rels):
            raise StoreError(f"{src} is not a safetensors model directory (it needs config.json and "
                             "*.safetensors files)")
        fmt = "safetensors"
    elif src.is_file():
        with open(src, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise StoreError(f"{src} is not a GGUF file (no GGUF magic); a safetensors model is "
                                 "imported as its directory")
        files, rels, fmt = [src], [src.name], "gguf"
    else:
        raise StoreError(f"{src} does not exist")
    entries, blobs = [], {}
    for path, rel in zip(files, rels):
        entry, stored = _import_file(store, path, mf.safe_relpath(rel), link=link,
                                          key=store.key if encrypt else None,
                                          piece_bytes=piece_bytes or pieces.sized(path.stat().st_size))
        entries.append(entry)
        blobs[rel] = stored
    layers = None
    if fmt == "safetensors":
        try:
            layers = json.loads((src / "config.json").read_text()).get("num_hidden_layers")
        except ValueError as exc:
            raise StoreError(f"{src / 'config.json'} is not JSON: {exc}") from None
    manifest = {"version": mf.MANIFEST_VERSION, "format": fmt, "layers": layers, "slice": None,
                "files": entries}
    if encrypt and store.key is not None:
        manifest["encryption"] = manifest_block(store.key)
    digest = mf.digest_of(manifest)
    store.commit(digest, manifest, blobs, name)
    return digest, manifest

def _import_file(store: Store, path: Path, rel: str, *, link: bool,
             key: Key | None = None, piece_bytes: int) -> tuple[dict[str, Any], str]:
    """The file's manifest entry (its plaintext's hashes) and the sha256 it is stored under."""
    size = path.stat().st_size
    prefixes = pieces.PrefixHasher(piece_bytes)  # one running hash: each piece's prefix, then the whole file
    tensors: list[dict[str, Any]] = []
    tmp = store.partial / f".import-{os.getpid()}-{hashlib.sha256(rel.encode()).hexdigest()[:16]}"
    with open(path, "rb") as fh, (open(os.devnull, "wb") if link else open(tmp, "wb")) as raw:
        seal = SealWriter(raw, key, rel) if key is not None else None
        out: Any = seal if seal is not None else raw
        if rel.endswith(".safetensors"):
            try:
                _, tensors = mf.read_safetensors_index(fh, size)
            except mf.ManifestError as exc:
                raise StoreError(f"{path}: {exc}") from None
            fh.seek(0)
        # One pass: the prefix digests and whole-file hash, each tensor's hash, and the copy.
        bounds = iter(tensors)
        cur = next(bounds, None)
        th = hashlib.sha256()
        pos = 0
        while chunk := fh.read(CHUNK):
            prefixes.update(chunk)
            out.write(chunk)
            view, at = memoryview(chunk), pos
            while cur is not None and at < pos + len(chunk):
                lo = max(cur["begin"], at) - pos
                hi = min(cur["end"], pos + len(chunk)) - pos
                if lo < hi:
                    th.update(view[lo:hi])
                if cur["end"] <= pos + len(chunk):
                    cur["sha256"] = th.hexdigest()
                    th = hashlib.sha256()
                    at = cur["end"]
                    cur = next(bounds, None)
                else:
                    break
            pos += len(chunk)
        stored = seal.finish() if seal is not None else None
        if not link:
            raw.flush()
            os.fsync(raw.fileno())
    for t in tensors:  # zero-length tensors never met a byte
        t.setdefault("sha256", hashlib.sha256(b"").hexdigest())
    listed, sha = prefixes.finish()
    dest = store.sealed_path(stored) if stored is not None else store.blob_path(sha)
    if dest.exists():
        tmp.unlink(missing_ok=True)
    elif link:
        os.link(path, dest)
    else:
        os.replace(tmp, dest)
    entry: dict[str, Any] = {"path": rel, "size": size, "sha256": sha,
                             **pieces.prefix_fields(size, listed, piece_bytes)}
    if rel.endswith(".safetensors"):
        entry["tensors"] = tensors
    return entry, stored or sha

