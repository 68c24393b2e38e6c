"""The content-addressed weight store under the agent's home: blobs by sha256, manifests by model
digest, and a model directory of hard links that engines load. A model is present only once its
manifest is written, which happens last, after every file is complete, verified and fsynced. What
the last verification of a model found (agent/weights/verify.py) is kept beside it, so that a model found
corrupt stays corrupt across restarts until it is fetched again or passes a verification. An
encrypted model's files (agent/weights/sealed.py) are kept apart, under sealed/ by their ciphertext's
sha256, where the blob route that serves peers never looks; its manifest is the plaintext's."""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Protocol

from host.process import alive
from wire import manifest as mf
from wire.state import Architecture, Encryption, Integrity, WeightsEntry

from agent.weights import architecture
from agent.weights.sealed import Key

CHUNK = 1 << 20
# What a process writes before renaming it into place, with its pid: an import's copy, a model
# directory being linked or replaced, a JSON file being written.
_LEFTOVER = re.compile(r"^\.(?:import-(\d+)-[0-9a-f]+|(?:tmp|old)-[0-9a-f]{64}-(\d+)|.+\.(\d+)-\d+\.tmp)\Z")


class StoreError(Exception):
    """A name that is not a digest, a model not held, or a model that cannot be imported."""


class WeightStore(Protocol):
    """What the agent's routes and workers ask of the weight store (Store, or a simulation's stand-in)."""

    def blob_path(self, sha: str) -> Path: ...

    def is_present(self, digest: str) -> bool: ...

    def manifest_bytes(self, digest: str) -> bytes: ...

    def entry(self, digest: str) -> WeightsEntry: ...

    def entries(self) -> list[WeightsEntry]: ...

    def digests(self) -> Iterator[str]: ...

    def delete(self, digest: str) -> None: ...


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, value: Any) -> None:
    """Replace `path` with `value` as JSON, whole or not at all, durably."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(value, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


UNVERIFIED: Integrity = {"state": "unverified", "checked_at": None, "file": None, "reason": None}


def _hex(sha: str) -> str:
    if not mf.HEX_RE.match(sha):
        raise StoreError(f"invalid sha256 {sha[:80]!r}: expected 64 lowercase hex digits")
    return sha


class Store:
    def __init__(self, home: Path, key: Key | None = None) -> None:
        self.key = key  # the node's weights key, for encrypted models (None: this agent holds none)
        self.root = home / "store"
        self.blobs = self.root / "blobs"
        self.sealed = self.root / "sealed"  # encrypted models' files: never served to peers
        self.manifests = self.root / "manifests"
        self.models = self.root / "models"
        self.partial = self.root / "partial"
        self.meta = self.root / "meta"
        for d in (self.blobs, self.sealed, self.manifests, self.models, self.partial, self.meta):
            d.mkdir(parents=True, exist_ok=True)
        # digest -> the model's architecture (or None), for models committed before it was kept in
        # their meta (commit reads it there); a model's bytes never change under its digest
        self._architecture: dict[str, Architecture | None] = {}

    def sweep(self) -> list[Path]:
        """Remove what a process that died left half-written: nothing can resume it (a fetch's
        .part file can, and is kept). Returns what was removed."""
        removed = []
        for d in (self.partial, self.models, self.meta):
            for p in d.iterdir():
                m = _LEFTOVER.match(p.name)
                if m is None or alive(int(next(g for g in m.groups() if g))):
                    continue
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
        return removed

    # ---- paths (every name from outside goes through check_digest / HEX_RE first) ----

    def blob_path(self, sha: str) -> Path:
        return self.blobs / _hex(sha)

    def manifest_path(self, digest: str) -> Path:
        return self.manifests / f"{mf.check_digest(digest)}.json"

    def model_dir(self, digest: str) -> Path:
        return self.models / mf.check_digest(digest)

    def sealed_path(self, sha: str) -> Path:
        return self.sealed / _hex(sha)

    def has_blob(self, sha: str) -> bool:
        return self.blob_path(sha).is_file()

    def is_sealed(self, digest: str) -> bool:
        """Whether the model's files are encrypted (its meta says so; it is written before the manifest)."""
        return bool(self._meta(digest).get("sealed"))

    def _meta(self, digest: str) -> dict[str, Any]:
        try:
            found = json.loads((self.meta / f"{mf.check_digest(digest)}.json").read_text())
        except (OSError, ValueError):
            return {}
        return found if isinstance(found, dict) else {}

    def file_blob(self, digest: str, sha: str) -> Path:
        """Where a file of `digest` is kept: its blob, or its sealed file for an encrypted model."""
        return self.sealed_path(sha) if self.is_sealed(digest) else self.blob_path(sha)

    def is_present(self, digest: str) -> bool:
        return self.manifest_path(digest).is_file()

    def manifest_bytes(self, digest: str) -> bytes:
        try:
            return self.manifest_path(digest).read_bytes()
        except FileNotFoundError:
            raise StoreError(f"model {digest} is not held here") from None

    def load_manifest(self, digest: str) -> dict[str, Any]:
        return json.loads(self.manifest_bytes(digest))  # type: ignore[no-any-return]

    # ---- integrity: what the last verification found ----

    def _integrity_path(self, digest: str) -> Path:
        return self.meta / f"{mf.check_digest(digest)}.integrity.json"

    def integrity(self, digest: str) -> Integrity:
        try:
            found = json.loads(self._integrity_path(digest).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return UNVERIFIED.copy()
        if not isinstance(found, dict) or found.get("state") not in ("verified", "corrupt"):
            return UNVERIFIED.copy()
        return {"state": found["state"], "checked_at": found.get("checked_at"), "file": found.get("file"),
                "reason": found.get("reason")}

    def is_corrupt(self, digest: str) -> bool:
        return self.integrity(digest)["state"] == "corrupt"

    def record(self, digest: str, problems: list[tuple[str, str]]) -> Integrity:
        """Keep what a verification of `digest` found: nothing (verified), or its bad files as
        (path, reason). A bad file's blob is unlinked as well, so that peers are not served it and
        the next fetch of the model fetches it again instead of finding it held."""
        model_dir, blobs = self.model_dir(digest), self.file_blobs(digest)
        bad = {path for path, _ in problems}
        for path, sha in blobs.items():
            held, blob = model_dir / mf.safe_relpath(path), self.file_blob(digest, sha)
            if path in bad:
                if blob.exists() and (not held.exists() or os.path.samefile(blob, held)):
                    blob.unlink(missing_ok=True)
            elif not blob.exists() and held.exists():  # found bad once, good again: peers may have it back
                try:
                    os.link(held, blob)
                except FileExistsError:
                    pass
        first = problems[0] if problems else (None, None)
        result: Integrity = {"state": "corrupt" if problems else "verified", "checked_at": now(),
                             "file": first[0], "reason": first[1]}
        if len(problems) > 1:
            result["reason"] = f"{first[1]} (and {len(problems) - 1} more file(s): " \
                               f"{', '.join(p for p, _ in problems[1:4])}{'…' if len(problems) > 4 else ''})"
        write_json(self._integrity_path(digest), result)
        return result

    # ---- writing ----

    def commit(self, digest: str, manifest: dict[str, Any], file_blobs: dict[str, str], name: str) -> None:
        """Make a model present: link its directory, then write its manifest (the presence mark)."""
        body = mf.canonical(manifest)
        if mf.digest_of(manifest) != digest:
            raise StoreError(f"manifest does not hash to {digest}")
        sealed = manifest.get("encryption") is not None
        blob = self.sealed_path if sealed else self.blob_path
        # An earlier sealing of the same model: its files have their own nonces, so no one else's.
        resealed = set(self.file_blobs(digest).values()) - set(file_blobs.values()) if sealed else set()
        final = self.model_dir(digest)
        if not self._linked(final, file_blobs, blob):
            tmp = self.models / f".tmp-{digest[7:]}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            for path, sha in file_blobs.items():
                dest = tmp / mf.safe_relpath(path)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(blob(sha), dest)
            if final.exists():  # a model fetched again (it was found corrupt): the old links go
                old = self.models / f".old-{digest[7:]}-{os.getpid()}"
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
        meta: dict[str, Any] = {"name": name, "files": file_blobs, "committed_at": now()}
        if sealed:
            meta["sealed"] = True
        else:
            # Read here, where the model comes in (an import, or a fetch in its worker thread), and
            # kept: gguf's reader parses the whole metadata (a vocabulary of 49,152 tokens took 7 s
            # at load 1.5, 11.8 s at load 6), which on the state's path held the agent's event loop
            # past the control plane's 10 s limit: the node was unreachable right after an import.
            meta["architecture"] = architecture.read(manifest["format"], self._weights_path(final, manifest))
        write_json(self.meta / f"{digest[7:]}.json", meta)
        # Every byte was just hashed on its way in: the model is verified as of now.
        write_json(self._integrity_path(digest), {"state": "verified", "checked_at": now(), "file": None,
                                                  "reason": None})
        tmp_manifest = self.manifests / f".{digest[7:]}.tmp"
        with open(tmp_manifest, "wb") as fh:
            fh.write(body)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp_manifest, self.manifest_path(digest))
        fsync_dir(self.manifests)
        for sha in resealed:
            self.sealed_path(sha).unlink(missing_ok=True)

    def _linked(self, model_dir: Path, file_blobs: dict[str, str], blob: Any) -> bool:
        """Whether `model_dir` holds exactly the links to these blobs (not, say, a corrupt file's)."""
        try:
            return all(os.path.samefile(model_dir / path, blob(sha)) for path, sha in file_blobs.items())
        except OSError:
            return False

    def delete(self, digest: str) -> None:
        path = self.manifest_path(digest)
        if not path.exists():
            raise StoreError(f"model {digest} is not held here")
        path.unlink()  # first: from here on the model is not reported present
        fsync_dir(self.manifests)
        shutil.rmtree(self.model_dir(digest), ignore_errors=True)
        (self.meta / f"{digest[7:]}.json").unlink(missing_ok=True)
        self._integrity_path(digest).unlink(missing_ok=True)
        referenced = {sha for d in self.digests() for sha in self.file_blobs(d).values()}
        for kept in (self.blobs, self.sealed):
            for blob in kept.iterdir():
                if blob.name not in referenced:
                    blob.unlink(missing_ok=True)

    # ---- reading ----

    def digests(self) -> Iterator[str]:
        for p in sorted(self.manifests.glob("*.json")):
            if mf.HEX_RE.match(p.stem):
                yield f"sha256:{p.stem}"

    def file_blobs(self, digest: str) -> dict[str, str]:
        files = self._meta(digest).get("files")
        return files if isinstance(files, dict) else {}

    def entry(self, digest: str) -> WeightsEntry:
        m = self.load_manifest(digest)
        meta = self._meta(digest)
        name = meta.get("name", "")
        path = self._weights_path(self.model_dir(digest), m)
        out: WeightsEntry = {"digest": digest, "name": name, "format": m["format"],
                             "bytes": sum(f["size"] for f in m["files"]), "layers": m.get("layers"),
                             "slice": m.get("slice"), "path": str(path), "integrity": self.integrity(digest)}
        how = m.get("encryption")
        if how is None:  # an encrypted model's headers are sealed: its architecture is not read
            arch: Architecture | None
            if "architecture" in meta:
                arch = meta["architecture"]
            else:  # committed before commit kept it: read once in this process
                if digest not in self._architecture:
                    self._architecture[digest] = architecture.read(m["format"], path)
                arch = self._architecture[digest]
            if arch is not None:
                out["architecture"] = arch
        if how is not None:
            out["encryption"] = Encryption(cipher=how["cipher"], key_id=how["key_id"],
                                           key_held=self.key is not None and self.key.id == how["key_id"])
        return out

    @staticmethod
    def _weights_path(model_dir: Path, manifest: dict[str, Any]) -> Path:
        """The GGUF file, or a safetensors model's directory."""
        return model_dir / manifest["files"][0]["path"] if manifest["format"] == "gguf" else model_dir

    def entries(self) -> list[WeightsEntry]:
        return [self.entry(d) for d in self.digests()]

    # ---- import (agent/weights/importing.py) ----

    def import_model(self, src: Path, name: str, *, link: bool = False, encrypt: bool = False,
                     piece_bytes: int | None = None) -> tuple[str, dict[str, Any]]:
        """Hash and store a local model (an HF directory, or one .gguf file); never modifies it. With
        `encrypt`, every file of it is sealed under the store's key (none is kept in plaintext)."""
        from agent.weights.importing import import_model

        return import_model(self, src, name, link=link, encrypt=encrypt, piece_bytes=piece_bytes)
