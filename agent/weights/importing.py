"""Importing a local model into the store: an HF directory or one GGUF file, each file read once for
its prefix digests (whose running hash ends as its sha256), each safetensors tensor's sha256 and the copy (plain, hard-linked, or sealed under the
node's key: agent/weights/sealed.py), then committed as any model is. The original is never modified.

Only the model's own bytes are read: every file is a regular file (never a device, FIFO or socket),
a symbolic link is followed only when it resolves inside the model directory (or, for a snapshot of
the Hugging Face cache, `models--*/snapshots/REV`, into that repository's `blobs/`, where the cache's
own links point) and only to a regular file, and each header is checked against its format before
anything is copied (agent/weights/headers.py). What is refused is an ImportRefused: a stable code,
the path, and why."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from wire import manifest as mf
from wire import pieces

from agent.weights.headers import HeaderError, load_json, read_gguf, read_safetensors
from agent.weights.sealed import Key, SealWriter, manifest_block
from agent.weights.store import CHUNK, Store, StoreError

_SKIP_DIRS = {".git", ".cache", "__pycache__"}


class ImportRefused(StoreError):
    """A model directory or file refused, with a stable code: symlink_outside_model,
    not_a_regular_file, invalid_json, invalid_safetensors, invalid_gguf, invalid_adapter."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _kind(mode: int) -> str:
    return ("directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "socket" if stat.S_ISSOCK(mode)
            else "character device" if stat.S_ISCHR(mode) else "block device" if stat.S_ISBLK(mode) else "special file")


def _roots(src: Path) -> list[Path]:
    """Where the model directory's links may point: inside it, and for a Hugging Face cache snapshot
    (models--ORG--NAME/snapshots/REV) its repository's blobs/."""
    roots = [src]
    if src.parent.name == "snapshots" and src.parent.parent.name.startswith("models--"):
        roots.append(src.parent.parent / "blobs")
    return roots


def _model_files(src: Path) -> list[tuple[str, Path, os.stat_result]]:
    """(relative path, the real path to read, its stat) of every file of the model directory `src`
    (already resolved), in path order; ImportRefused for a link out of it or anything not a regular file."""
    roots, out = _roots(src), []

    def walk(folder: Path, rel: str) -> None:
        with os.scandir(folder) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            path, name = Path(entry.path), rel + entry.name
            if entry.is_dir(follow_symlinks=False):
                if entry.name not in _SKIP_DIRS:
                    walk(path, name + "/")
                continue
            if entry.is_symlink():
                real = Path(os.path.realpath(path))
                if not any(real.is_relative_to(r) for r in roots):
                    raise ImportRefused("symlink_outside_model", f"{path} is a symbolic link to {real}, outside the "
                                        f"model directory {src}: refused (nothing outside the model is imported)")
                try:
                    st = os.stat(real)
                except OSError as exc:
                    raise ImportRefused("not_a_regular_file", f"{path} is a symbolic link to {real}, which cannot "
                                        f"be read: {exc.strerror or exc}") from None
                if not stat.S_ISREG(st.st_mode):
                    raise ImportRefused("not_a_regular_file", f"{path} is a symbolic link to a {_kind(st.st_mode)} "
                                        f"({real}): only regular files are imported")
                out.append((name, real, st))
                continue
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode):
                raise ImportRefused("not_a_regular_file", f"{path} is a {_kind(st.st_mode)}: only regular files "
                                    "are imported")
            out.append((name, path, st))

    walk(src, "")
    return out


def _open(path: Path, seen: os.stat_result) -> BinaryIO:
    """`path` opened for reading, refused unless it is still the regular file `seen` (no link swapped in
    since: O_NOFOLLOW, and the same inode; O_NONBLOCK, so that a FIFO put there cannot hang the import)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ImportRefused("not_a_regular_file", f"{path} cannot be opened as a regular file: "
                            f"{exc.strerror or exc}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (seen.st_dev, seen.st_ino):
        os.close(fd)
        raise ImportRefused("not_a_regular_file", f"{path} changed while it was imported (now a "
                            f"{'regular file' if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)} of another inode)")
    return os.fdopen(fd, "rb")


def _checked(err: HeaderError) -> ImportRefused:
    return ImportRefused(err.code, str(err))


def default_name(src: Path) -> str:
    """The name a model is imported under when none is given: a file's stem, a directory's name."""
    return src.stem if src.is_file() else src.resolve().name


def import_model(store: Store, src: Path, name: str, *, link: bool = False,
             encrypt: bool = False, piece_bytes: int | None = None) -> tuple[str, dict[str, Any]]:
    """Hash and store a local model (an HF directory, or one .gguf file). With
    `encrypt`, every file of it is sealed under the store's key (none is kept in plaintext)."""
    if encrypt and (store.key is None or link):
        raise StoreError("an encrypted import needs the node's weights key (--key-file or "
                         "$FLEET_WEIGHTS_KEY_FILE) and copies (no --link)")
    src = src.resolve()  # the path the operator named is followed: it is theirs to choose
    try:
        st = os.stat(src)
    except FileNotFoundError:
        raise StoreError(f"{src} does not exist") from None
    layers = None
    adapter: dict[str, Any] = {}
    tensors: dict[str, list[dict[str, Any]]] = {}
    if stat.S_ISDIR(st.st_mode):
        found = _model_files(src)
        rels = [rel for rel, _, _ in found]
        peft = "config.json" not in rels and "adapter_config.json" in rels
        if peft and "adapter_model.safetensors" not in rels:
            raise StoreError(f"{src} is a PEFT adapter without adapter_model.safetensors (a pickled "
                             "adapter_model.bin is never imported: save it with safe_serialization)")
        if not peft and ("config.json" not in rels or not any(r.endswith(".safetensors") for r in rels)):
            raise StoreError(f"{src} is not a safetensors model directory (it needs config.json and "
                             "*.safetensors files) nor a PEFT adapter (adapter_config.json and "
                             "adapter_model.safetensors)")
        fmt = "peft" if peft else "safetensors"
        # Every header checked before a byte is copied: a bad last shard is found at once.
        for rel, path, seen in found:
            if rel == "config.json":
                with _open(path, seen) as fh:
                    try:
                        config = load_json(fh, src / rel)
                    except HeaderError as exc:
                        raise _checked(exc) from None
                layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
            elif peft and rel == "adapter_config.json":
                with _open(path, seen) as fh:
                    try:
                        adapter = mf.adapter_block(load_json(fh, src / rel))
                    except HeaderError as exc:
                        raise _checked(exc) from None
                    except mf.ManifestError as exc:
                        raise ImportRefused("invalid_adapter", f"{src / rel}: {exc}") from None
            elif rel.endswith(".safetensors"):
                with _open(path, seen) as fh:
                    try:
                        _, tensors[rel] = read_safetensors(fh, seen.st_size, src / rel)
                    except HeaderError as exc:
                        raise _checked(exc) from None
    elif stat.S_ISREG(st.st_mode):
        try:
            read_gguf(src, st.st_size)
        except HeaderError as exc:
            if exc.code == "invalid_gguf" and "no GGUF magic" in str(exc):
                raise StoreError(f"{src} is not a GGUF file (no GGUF magic); a safetensors model is "
                                 "imported as its directory") from None
            raise _checked(exc) from None
        found, fmt = [(src.name, src, st)], "gguf"
    else:
        raise ImportRefused("not_a_regular_file", f"{src} is a {_kind(st.st_mode)}: a model is a GGUF file or a "
                            "safetensors directory")
    entries, blobs = [], {}
    for rel, path, seen in found:
        entry, stored = _import_file(store, path, seen, mf.safe_relpath(rel), tensors.get(rel), link=link,
                                     key=store.key if encrypt else None,
                                     piece_bytes=piece_bytes or pieces.sized(seen.st_size))
        entries.append(entry)
        blobs[rel] = stored
    manifest = {"version": mf.MANIFEST_VERSION, "format": fmt, "layers": layers, "slice": None,
                "files": entries}
    if fmt == "peft":
        manifest["adapter"] = adapter
    if encrypt and store.key is not None:
        manifest["encryption"] = manifest_block(store.key)
    digest = mf.digest_of(manifest)
    store.commit(digest, manifest, blobs, name)
    return digest, manifest

def _import_file(store: Store, path: Path, seen: os.stat_result, rel: str, tensors: list[dict[str, Any]] | None,
                 *, link: bool, key: Key | None = None, piece_bytes: int) -> tuple[dict[str, Any], str]:
    """The file's manifest entry (its plaintext's hashes) and the sha256 it is stored under."""
    size = seen.st_size
    prefixes = pieces.PrefixHasher(piece_bytes)  # one running hash: each piece's prefix, then the whole file
    tensors = tensors or []
    tmp = store.partial / f".import-{os.getpid()}-{hashlib.sha256(rel.encode()).hexdigest()[:16]}"
    with _open(path, seen) as fh, (open(os.devnull, "wb") if link else open(tmp, "wb")) as raw:
        seal = SealWriter(raw, key, rel) if key is not None else None
        out: Any = seal if seal is not None else raw
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
        if pos != size:
            tmp.unlink(missing_ok=True)
            raise ImportRefused("not_a_regular_file", f"{path} changed while it was imported ({pos:,} bytes read, "
                                f"{size:,} expected)")
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
        now = os.stat(dest)
        if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):  # something else was put at `path`
            dest.unlink()
            raise ImportRefused("not_a_regular_file", f"{path} changed while it was imported (another file "
                                "was put there)")
    else:
        os.replace(tmp, dest)
    entry: dict[str, Any] = {"path": rel, "size": size, "sha256": sha,
                             **pieces.prefix_fields(size, listed, piece_bytes)}
    if rel.endswith(".safetensors"):
        entry["tensors"] = tensors
    return entry, stored or sha

