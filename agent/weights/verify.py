"""Integrity at rest: the models the store holds re-hashed against their manifests (whole files by
sha256 and each safetensors tensor; a slice's assembled file by its header and each tensor), one
model at a time per agent, in a worker thread so that the API keeps answering; at start and every
period (fleet-agent serve --verify-every), and on demand (POST /v1/weights/{digest}/verify). An
encrypted model's files are decrypted on the way (every chunk's tag checked, the plaintext hashed
against the manifest; nothing kept) when the agent holds its key, and checked against the
ciphertext's sha256 they are stored under when it does not."""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Protocol

import trio

from wire import manifest as mf
from wire.state import Integrity

from agent.weights.sealed import Key, Unsealable, unseal
from agent.weights.store import CHUNK, Store, StoreError

log = logging.getLogger("fleet-agent")

DEFAULT_PERIOD_S = 24 * 3600.0
_PERIOD = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([smhd])\s*\Z")

Problem = tuple[str, str]  # (the file as the manifest names it, what is wrong with it)


def parse_period(text: str) -> float | None:
    """Seconds from "24h", "30m", "90s", "7d"; None for "off" (or 0): no verification but on demand."""
    if text.strip().lower() in ("off", "0", "never"):
        return None
    m = _PERIOD.match(text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"{text!r} is not a period: write a number with s, m, h or d (24h), or off")
    return float(m.group(1)) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def check(store: Store, digest: str) -> list[Problem]:
    """Every file of a held model that does not match its manifest (blocking: run it in a thread)."""
    manifest = store.load_manifest(digest)
    model_dir = store.model_dir(digest)
    problems: list[Problem] = []
    how = manifest.get("encryption")
    key = store.key if how is not None and store.key is not None and store.key.id == how["key_id"] else None
    stored = store.file_blobs(digest)
    for f in manifest["files"]:
        path = model_dir / mf.safe_relpath(f["path"])
        try:
            if how is None:
                problem = _check_file(path, f)
            elif key is not None:
                problem = _check_sealed(path, f, key)
            else:  # no key here: the ciphertext is checked against the sha256 it was stored under
                whole, _ = _scan(_chunks(path), [])
                problem = None if whole == stored.get(f["path"]) else \
                    f"its sealed bytes hash to {whole}, stored as {stored.get(f['path'])}"
        except FileNotFoundError:
            problem = "the file is missing"
        except OSError as exc:
            problem = f"the file cannot be read: {exc.strerror or exc}"
        if problem:
            problems.append((f["path"], problem))
    return problems


def _check_file(path: Path, f: dict[str, Any]) -> str | None:
    size = path.stat().st_size
    if size != f["size"]:
        return f"it has {size:,} bytes where the manifest says {f['size']:,}"
    return _check_plain(_chunks(path), size, f)


def _check_sealed(path: Path, f: dict[str, Any], key: Key) -> str | None:
    """Decrypt (every chunk's tag checked) and check the plaintext as a plain file's: a plaintext of
    another size shows as a whole-file hash that differs."""
    with open(path, "rb") as fh:
        try:
            return _check_plain(unseal(fh, os.fstat(fh.fileno()).st_size, key, f["path"]), f["size"], f)
        except Unsealable as exc:
            return str(exc).removeprefix(f"{f['path']}: ")


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            yield chunk


def _check_plain(chunks: Iterable[bytes], size: int, f: dict[str, Any]) -> str | None:
    spans = [(f"tensor {t['name']}", t["begin"], t["end"], t["sha256"]) for t in f.get("tensors", ())]
    if f.get("assembled"):  # a slice's own file: no whole-file hash in the manifest, but every byte in a span
        header_end = spans[0][1] if spans else size
        spans.insert(0, ("the slice header", 0, header_end, f["header_sha256"]))
    whole, bad = _scan(chunks, spans)
    if bad is not None:
        return f"{bad} does not match its sha256 in the manifest"
    if not f.get("assembled") and whole != f["sha256"]:
        return f"its sha256 is {whole}, the manifest says {f['sha256']}"
    return None


def _scan(chunks: Iterable[bytes], spans: list[tuple[str, int, int, str]]) -> tuple[str, str | None]:
    """One pass over a file's bytes: its sha256, and the first span (what, begin, end, sha256) whose
    bytes do not hash to its sha256."""
    whole, h = hashlib.sha256(), hashlib.sha256()
    spans = sorted(spans, key=lambda s: (s[1], s[2]))
    i, pos, bad = 0, 0, None
    for chunk in chunks:
        whole.update(chunk)
        end, view = pos + len(chunk), memoryview(chunk)
        while i < len(spans) and spans[i][1] < end:
            what, begin, stop, sha = spans[i]
            lo, hi = max(begin, pos), min(stop, end)
            if lo < hi:
                h.update(view[lo - pos:hi - pos])
            if stop > end:
                break
            if bad is None and h.hexdigest() != sha:
                bad = what
            h, i = hashlib.sha256(), i + 1
        pos = end
    for what, _, _, sha in spans[i:]:  # empty spans at the very end
        if bad is None and h.hexdigest() != sha:
            bad = what
        h = hashlib.sha256()
    return whole.hexdigest(), bad


class Job(Protocol):
    state: str


class Fetching(Protocol):
    """What the verifier asks of the fetcher (agent/transfer/fetch.py): the jobs by digest, to leave
    alone a model being fetched again (the fetch verifies every byte)."""

    @property
    def jobs(self) -> Mapping[str, Job]: ...


# Told of a model found corrupt (its digest, what was found), before verify() returns: the workers
# (agent/serving/supervisor.py Workers.model_corrupt) fail every server on it at once, so that its
# engine's mapping of the corrupt file answers no one again and the state shows them failed.
OnCorrupt = Callable[[str, Integrity], Awaitable[None]]


class Verifier:
    """Verifies held models one at a time (the disk is shared with fetches and engines) and keeps
    the result in the store, where the state, the workers and the fetcher read it; a model found
    corrupt is handed to `on_corrupt` before the verification returns."""

    def __init__(self, store: Store, fetcher: Fetching, on_corrupt: OnCorrupt | None = None) -> None:
        self.store = store
        self.fetcher = fetcher
        self.on_corrupt = on_corrupt
        self._one_at_a_time = trio.Lock()

    async def verify(self, digest: str) -> Integrity:
        """Verify one held model now (after any verification running); StoreError if not held."""
        async with self._one_at_a_time:
            if not self.store.is_present(digest):
                raise StoreError(f"model {digest} is not held here")
            job = self.fetcher.jobs.get(digest)
            if job is not None and job.state == "fetching":
                return self.store.integrity(digest)  # being fetched again: the fetch verifies every byte
            problems = await trio.to_thread.run_sync(check, self.store, digest)
            if self.fetcher.jobs.get(digest) is not job or not self.store.is_present(digest):
                return self.store.integrity(digest)  # fetched again or deleted meanwhile: what we read is gone
            found = await trio.to_thread.run_sync(self.store.record, digest, problems)
        if found["state"] == "corrupt":
            log.warning("model %s is corrupt: %s: %s; its servers are failed, and none starts on it until it "
                        "is fetched again", digest, found["file"], found["reason"])
            if self.on_corrupt is not None:
                await self.on_corrupt(digest, found)
        return found

    async def run(self, period_s: float) -> None:
        """Verify everything held now, then again every `period_s` seconds."""
        while True:
            for digest in list(self.store.digests()):
                try:
                    await self.verify(digest)
                except StoreError:
                    continue  # deleted meanwhile
                except Exception as exc:  # a bug or a disk error: said, and never the agent's end
                    log.warning("could not verify %s: %s: %s", digest, type(exc).__name__, exc)
            await trio.sleep(period_s)
