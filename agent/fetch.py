"""Fetching weights from a peer: one job per digest, streamed to a partial file while hashing,
verified, fsynced, renamed; resumed with a Range request from whatever is on disk."""

from __future__ import annotations

import hashlib
import json
import os
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from wire import manifest as mf
from wire.layers import LayerRange
from wire.state import FetchJob

from .peerhttp import PeerError, get, get_bytes
from .store import CHUNK, Store, fsync_dir


class FetchError(Exception):
    pass


@dataclass
class Job:
    digest: str
    peer: str
    name: str
    source_digest: str | None = None
    layers: LayerRange | None = None
    state: str = "fetching"  # fetching → present | failed
    bytes_total: int = 0
    bytes_done: int = 0  # verified or on disk, counting what a resume found
    bytes_fetched: int = 0  # crossed the wire in this job
    error: str | None = None
    resumable: bool = False  # failed keeping what arrived: asking again resumes (the executor does)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None

    def to_json(self) -> FetchJob:
        elapsed = (self.finished or time.monotonic()) - self.started
        return {"digest": self.digest, "state": self.state, "peer": self.peer,
                "layers": None if self.layers is None else str(self.layers),
                "bytes_total": self.bytes_total, "bytes_done": self.bytes_done,
                "bytes_fetched": self.bytes_fetched,
                "rate_bytes_per_s": round(self.bytes_fetched / elapsed) if elapsed > 0 else 0,
                "error": self.error, "resumable": self.resumable}


@dataclass(frozen=True, slots=True)
class Segment:
    """A piece of an output file: bytes we have (`data`) or a byte range of a peer's blob."""

    what: str
    size: int
    sha256: str
    data: bytes | None = None
    blob: str | None = None
    begin: int = 0


class Fetcher:
    def __init__(self, store: Store, secret: str, spawn: Callable[..., None],
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.store = store
        self.secret = secret
        self.spawn = spawn
        self.ssl_context = ssl_context
        self.jobs: dict[str, Job] = {}
        self._locks: dict[str, trio.Lock] = {}

    def request(self, digest: str, peer: str, name: str = "", source_digest: str | None = None,
                layers: LayerRange | None = None) -> Job:
        """Start a fetch, or join the one already running for this digest."""
        job = self.jobs.get(digest)
        if job is not None and job.state == "fetching":
            return job
        job = Job(digest=digest, peer=peer.rstrip("/"), name=name, source_digest=source_digest, layers=layers)
        self.jobs[digest] = job
        self.spawn(self._run, job)
        return job

    def active(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state == "fetching"]

    async def _run(self, job: Job) -> None:
        try:
            await self._fetch(job)
            job.state = "present"
        except (FetchError, PeerError, mf.ManifestError) as exc:
            job.state, job.error = "failed", str(exc)
            job.resumable = isinstance(exc, PeerError) and exc.resumable
        except Exception as exc:  # a bug: keep it visible in the job, never kill the agent
            job.state, job.error = "failed", f"internal error: {type(exc).__name__}: {exc}"
        finally:
            job.finished = time.monotonic()

    async def _manifest(self, job: Job, digest: str) -> dict[str, Any]:
        body = await get_bytes(job.peer, f"/v1/manifests/{digest}", self.secret, ssl_context=self.ssl_context)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise FetchError(f"peer {job.peer} served a manifest that does not hash to {digest}")
        try:
            return mf.validate(json.loads(body))
        except ValueError as exc:
            raise FetchError(f"peer {job.peer} served a bad manifest for {digest}: {exc}") from None

    async def _fetch(self, job: Job) -> None:
        if job.layers is not None:
            if job.source_digest is None:
                raise FetchError("a slice needs the digest of the full model it is cut from (source_digest)")
            full = await self._manifest(job, job.source_digest)
            manifest = mf.make_slice(full, job.source_digest, job.layers)
            if mf.digest_of(manifest) != job.digest:
                raise FetchError(f"layers {job.layers} of {job.source_digest} have digest "
                                 f"{mf.digest_of(manifest)}, not the {job.digest} asked for")
        else:
            manifest = await self._manifest(job, job.digest)
        job.bytes_total = sum(f["size"] for f in manifest["files"])
        blobs: dict[str, str] = {}
        for f in manifest["files"]:
            if f.get("assembled"):
                header = mf.slice_header(f["tensors"])
                segments = [Segment("the slice header", len(header), f["header_sha256"], data=header)]
                segments += [Segment(f"tensor {t['name']}", t["end"] - t["begin"], t["sha256"],
                                     blob=t["source"]["sha256"], begin=t["source"]["begin"]) for t in f["tensors"]]
                part = self.store.partial / f"{job.digest[7:]}-{hashlib.sha256(f['path'].encode()).hexdigest()[:16]}.part"
                blobs[f["path"]] = await self._assemble(job, part, segments, f["path"])
            else:
                blobs[f["path"]] = f["sha256"]
                lock = self._locks.setdefault(f["sha256"], trio.Lock())
                async with lock:
                    if self.store.has_blob(f["sha256"]):
                        job.bytes_done += f["size"]
                        continue
                    seg = Segment(f"file {f['path']}", f["size"], f["sha256"], blob=f["sha256"])
                    await self._assemble(job, self.store.partial / f"{f['sha256']}.part", [seg], f["path"])
        self.store.commit(job.digest, manifest, blobs, job.name)

    async def _assemble(self, job: Job, part: Path, segments: list[Segment], path: str) -> str:
        """Write `segments` into `part`, keeping and re-hashing what an earlier attempt left there;
        verify each segment; move the file into the store. Returns its sha256."""
        total = sum(s.size for s in segments)
        have = part.stat().st_size if part.exists() else 0
        if have > total:
            have = 0
        # A whole file is one segment whose hash is the file's: hash it once, not twice.
        whole = hashlib.sha256() if len(segments) > 1 else None
        with open(part, "r+b" if part.exists() else "w+b") as fh:
            fh.truncate(have)
            pos = 0
            for seg in segments:
                h = hashlib.sha256()
                hashers = [h] if whole is None else [h, whole]
                kept = max(0, min(seg.size, have - pos))
                fh.seek(pos)
                left = kept
                while left:  # what is already on disk: re-hash locally, fetch nothing
                    chunk = fh.read(min(CHUNK, left))
                    if not chunk:
                        break
                    for x in hashers:
                        x.update(chunk)
                    left -= len(chunk)
                job.bytes_done += kept
                if kept < seg.size:
                    fh.seek(pos + kept)

                    def take(chunk: bytes | bytearray | memoryview) -> None:
                        fh.write(chunk)
                        for x in hashers:
                            x.update(chunk)
                        job.bytes_done += len(chunk)
                        job.bytes_fetched += len(chunk)

                    if seg.data is not None:
                        take(seg.data[kept:])
                        job.bytes_fetched -= seg.size - kept
                    else:
                        try:
                            await get(job.peer, f"/v1/blobs/{seg.blob}", self.secret, take,
                                      start=seg.begin + kept, end=seg.begin + seg.size - 1,
                                      ssl_context=self.ssl_context)
                        finally:
                            fh.flush()
                actual = h.hexdigest()
                if actual != seg.sha256:
                    fh.truncate(pos)  # the bad bytes are never kept
                    fh.flush()
                    if pos == 0:
                        part.unlink(missing_ok=True)
                    raise FetchError(f"digest mismatch in {seg.what} of {path} from peer {job.peer}: expected "
                                     f"sha256 {seg.sha256}, received {actual}; the bytes were discarded")
                pos += seg.size
            fh.flush()
            os.fsync(fh.fileno())
        sha = whole.hexdigest() if whole is not None else segments[0].sha256
        dest = self.store.blob_path(sha)
        os.replace(part, dest)
        fsync_dir(dest.parent)
        return sha
