"""Fetching weights from a peer: one job per digest, streamed to a partial file while hashing,
verified piece by piece as it lands (a bad piece is discarded and named: piece_corrupt), forwarded
to peers as it is verified (agent/transfer/forward.py), checked whole, fsynced, renamed; resumed with a
Range request from the last good piece on disk. The disk work
that is not the transfer itself (re-hashing what a resume finds, fsync, commit) runs in a worker
thread: the agent answers /v1/state meanwhile. A fetch never eats the disk's reserve; a disk that
fills anyway fails it as disk_full, naming the node and the free space, and removes the partial."""

from __future__ import annotations

import errno
import hashlib
import json
import re
import shutil
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import trio

from wire import manifest as mf
from wire import pieces
from wire.layers import LayerRange
from wire.state import FetchJob

from agent.transfer.forward import Partial, Partials
from agent.transfer.partfile import FetchError, LocalWrite, Take, install, open_part, rehash, write_pieced
from agent.transfer.peerhttp import PeerError, get, get_bytes
from agent.transfer.rates import Rates
from agent.weights.store import Store

DEFAULT_RESERVE = 1 << 30  # kept free on the store's disk unless --disk-reserve says otherwise ...
RESERVE_FRACTION = 10  # ... or a tenth of a smaller disk
# A peer in a chain may be asked before it has begun its own fetch (the executor starts a chain
# at once): its 404 is waited out this long, then is final.
PEER_START_S = 30.0
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?)(i?)b?\s*\Z", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from "1GiB", "500MB", "0" (ValueError otherwise): powers of 1024 with `i`, 1000 without."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r} is not a size: write bytes, or a number with KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    power = " kmgt".index(m.group(2).lower() or " ")
    return int(float(m.group(1)) * (1024 if m.group(3) else 1000) ** power)


def default_reserve(path: Path) -> int:
    return min(DEFAULT_RESERVE, shutil.disk_usage(path).total // RESERVE_FRACTION)


@dataclass
class Job:
    digest: str
    peer: str
    name: str
    source_digest: str | None = None
    layers: LayerRange | None = None
    peer_hostname: str | None = None  # the name the peer's TLS certificate is checked against (else its address)
    state: str = "fetching"  # fetching → present | failed
    bytes_total: int = 0
    bytes_done: int = 0  # verified or on disk, counting what a resume found
    bytes_fetched: int = 0  # crossed the wire in this job
    error: str | None = None
    code: str | None = None  # a failure's stable code: disk_full, fetch_failed, ...
    resumable: bool = False  # failed keeping what arrived: asking again resumes (the executor does)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    manifest: bytes | None = None  # verified against the digest: served to peers that chain from here
    partials: list[tuple[str, Partial]] = field(default_factory=list)
    parts: list[Path] = field(default_factory=list)  # the partial files it writes (kept for a resume)

    def to_json(self) -> FetchJob:
        elapsed = (self.finished or time.monotonic()) - self.started
        return {"digest": self.digest, "state": self.state, "peer": self.peer,
                "layers": None if self.layers is None else str(self.layers),
                "bytes_total": self.bytes_total, "bytes_done": self.bytes_done,
                "bytes_fetched": self.bytes_fetched,
                "rate_bytes_per_s": round(self.bytes_fetched / elapsed) if elapsed > 0 else 0,
                "error": self.error, "code": self.code, "resumable": self.resumable,
                "bytes_forwarded": sum(p.served for _, p in self.partials)}


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
                 ssl_context: ssl.SSLContext | None = None, *, node: str = "", reserve: int | None = None) -> None:
        self.store = store
        self.secret = secret
        self.spawn = spawn
        self.ssl_context = ssl_context
        self.node = node  # this agent's name, for messages read on the control plane
        self.reserve = default_reserve(store.root) if reserve is None else reserve
        self.jobs: dict[str, Job] = {}
        self._locks: dict[str, trio.Lock] = {}
        self._claims: dict[str, int] = {}  # bytes each running job has still to write
        self.partials = Partials()  # files being fetched, served to peers as they are verified
        # Each fetch's rate per peer, kept across restarts: the planner estimates replications with them.
        self.rates = Rates(store.root / "link-rates.json" if store.root.is_dir() else None)

    def request(self, digest: str, peer: str, name: str = "", source_digest: str | None = None,
                layers: LayerRange | None = None, peer_hostname: str | None = None) -> Job:
        """Start a fetch, or join the one already running for this digest."""
        job = self.jobs.get(digest)
        if job is not None and job.state == "fetching":
            return job
        job = Job(digest=digest, peer=peer.rstrip("/"), name=name, source_digest=source_digest, layers=layers,
                  peer_hostname=peer_hostname)
        self.jobs[digest] = job
        self.spawn(self._run, job)
        return job

    def active(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state == "fetching"]

    def discard(self, digest: str) -> int | None:
        """Forget a fetch of `digest` that failed and remove the partial files it kept for a resume:
        the bytes removed, or None when no such fetch is known. A partial file a running fetch
        writes too (the same file in another model) is left to it."""
        job = self.jobs.get(digest)
        if job is None or job.state != "failed":
            return None
        busy = {part for running in self.active() for part in running.parts}
        removed = 0
        for part in job.parts:
            if part in busy:
                continue
            try:
                size = part.stat().st_size
                part.unlink()
            except FileNotFoundError:
                continue
            removed += size
        del self.jobs[digest]
        return removed

    def manifest_of(self, digest: str) -> bytes | None:
        """The verified manifest of a model being fetched here, for a peer chained from this node."""
        job = self.jobs.get(digest)
        return job.manifest if job is not None and job.state == "fetching" else None

    async def _run(self, job: Job) -> None:
        try:
            await self._fetch(job)
            job.state = "present"
            self.rates.record(job.peer, job.bytes_fetched, time.monotonic() - job.started)
        except (FetchError, PeerError, mf.ManifestError) as exc:
            job.state, job.error = "failed", str(exc)
            job.code = exc.code if isinstance(exc, (FetchError, PeerError)) else "fetch_failed"
            job.resumable = isinstance(exc, PeerError) and exc.resumable
        except Exception as exc:  # a bug: keep it visible in the job, never kill the agent
            job.state, job.error = "failed", f"internal error: {type(exc).__name__}: {exc}"
            job.code = "internal_error"
        finally:
            self._claims.pop(job.digest, None)
            for sha, partial in job.partials:
                if partial.verified < partial.size:
                    partial.failed = job.error or "the fetch ended"
                self.partials.drop(sha, partial)
            job.finished = time.monotonic()

    async def _manifest(self, job: Job, digest: str) -> dict[str, Any]:
        deadline = trio.current_time() + PEER_START_S
        while True:
            try:
                body = await get_bytes(job.peer, f"/v1/manifests/{digest}", self.secret, ssl_context=self.ssl_context,
                                       server_hostname=job.peer_hostname)
                break
            except PeerError as exc:
                if exc.answer_code == "encrypted_not_served":  # final: the plan's error, met on the node
                    raise FetchError(f"node {self.node!r} cannot fetch {digest} from peer {job.peer}: the peer holds "
                                     "it encrypted at rest, and encrypted weights never leave the node that holds "
                                     "their key", "encrypted_remote_unsupported") from None
                if exc.status != 404:
                    raise
                if trio.current_time() > deadline:
                    raise FetchError(f"peer {job.peer} neither holds nor is fetching {digest} after "
                                     f"{PEER_START_S:.0f} s: {exc}", "peer_not_holding") from None
                await trio.sleep(0.1)
        if "sha256:" + hashlib.sha256(body).hexdigest() != digest:
            raise FetchError(f"peer {job.peer} served a manifest that does not hash to {digest}")
        try:
            manifest = mf.validate(json.loads(body))
        except ValueError as exc:
            raise FetchError(f"peer {job.peer} served a bad manifest for {digest}: {exc}") from None
        if manifest.get("encryption") is not None:  # its bytes stay on the node holding its key
            raise FetchError(f"{digest} is encrypted at rest on {job.peer}: encrypted weights never leave the node "
                             "that holds their key", "encrypted_remote_unsupported")
        return manifest

    def _part(self, job: Job, f: dict[str, Any]) -> Path:
        if f.get("assembled"):
            return self.store.partial / f"{job.digest[7:]}-{hashlib.sha256(f['path'].encode()).hexdigest()[:16]}.part"
        return self.store.partial / f"{f['sha256']}.part"

    def _claim(self, job: Job, manifest: dict[str, Any]) -> None:
        """Refuse a fetch that would leave less than the reserve free, counting what the other
        running fetches have still to write (they checked the same free space)."""
        needed = 0
        for f in manifest["files"]:
            if not f.get("assembled") and self.store.has_blob(f["sha256"]):
                continue
            part = self._part(job, f)
            have = part.stat().st_size if part.exists() else 0
            needed += f["size"] - (have if have <= f["size"] else 0)
        free = shutil.disk_usage(self.store.root).free
        others = sum(n for d, n in self._claims.items() if d != job.digest)
        if free - others - needed < self.reserve:
            pending = f", {others:,} of them promised to fetches running" if others else ""
            raise FetchError(f"disk full on node {self.node!r}: fetching {job.digest} needs {needed:,} more bytes "
                             f"under {self.store.root}, which has {free:,} bytes free{pending} and keeps "
                             f"{self.reserve:,} in reserve (fleet-agent serve --disk-reserve)", "disk_full")
        self._claims[job.digest] = needed

    def _disk_error(self, exc: OSError, part: Path) -> FetchError:
        part.unlink(missing_ok=True)  # nothing to resume onto a disk that cannot take it: give the space back
        free = shutil.disk_usage(self.store.root).free
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return FetchError(f"disk full on node {self.node!r} while writing {part.name}: {free:,} bytes free under "
                              f"{self.store.root} (reserve {self.reserve:,}); the partial file was removed",
                              "disk_full")
        return FetchError(f"cannot write {part} on node {self.node!r}: {exc.strerror or exc}; the partial file "
                          "was removed", "disk_error")

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
        job.parts = [self._part(job, f) for f in manifest["files"]
                     if f.get("assembled") or not self.store.has_blob(f["sha256"])]
        self._claim(job, manifest)
        if job.layers is None:  # a whole model's files are forwarded to peers chained from here
            for f in manifest["files"]:
                if not self.store.has_blob(f["sha256"]):
                    want = Partial(self._part(job, f), f["size"], lambda: job.bytes_done, self.node)
                    if self.partials.add(f["sha256"], want) is want:  # else another fetch writes (and forwards) it
                        job.partials.append((f["sha256"], want))
            job.manifest = mf.canonical(manifest)
        forwarded = dict(job.partials)
        blobs: dict[str, str] = {}
        for f in manifest["files"]:
            if f.get("assembled"):
                header = mf.slice_header(f["tensors"])
                segments = [Segment("the slice header", len(header), f["header_sha256"], data=header)]
                segments += [Segment(f"tensor {t['name']}", t["end"] - t["begin"], t["sha256"],
                                     blob=t["source"]["sha256"], begin=t["source"]["begin"]) for t in f["tensors"]]
                blobs[f["path"]] = await self._assemble(job, self._part(job, f), segments, f["path"])
            else:
                blobs[f["path"]] = f["sha256"]
                lock = self._locks.setdefault(f["sha256"], trio.Lock())
                async with lock:
                    if self.store.has_blob(f["sha256"]):
                        job.bytes_done += f["size"]
                        continue
                    partial = forwarded.get(f["sha256"])
                    if pieces.listed(f) and partial is not None:
                        await self._assemble_pieced(job, self._part(job, f), f, partial)
                        continue
                    seg = Segment(f"file {f['path']}", f["size"], f["sha256"], blob=f["sha256"])
                    await self._assemble(job, self._part(job, f), [seg], f["path"])
                    if partial is not None:  # no pieces: forwarded once whole and verified
                        partial.path, partial.verified = self.store.blob_path(f["sha256"]), f["size"]
        try:
            await trio.to_thread.run_sync(self.store.commit, job.digest, manifest, blobs, job.name)
        except OSError as exc:
            no_room = exc.errno in (errno.ENOSPC, errno.EDQUOT)
            raise FetchError(f"{'disk full' if no_room else 'disk error'} on node {self.node!r} while storing "
                             f"{job.digest}: {exc.strerror or exc}", "disk_full" if no_room else "disk_error") from None

    async def _assemble(self, job: Job, part: Path, segments: list[Segment], path: str) -> str:
        """Write `segments` into `part`, keeping and re-hashing what an earlier attempt left there;
        verify each segment; move the file into the store. Returns its sha256."""
        try:
            return await self._write(job, part, segments, path)
        except LocalWrite as exc:
            raise self._disk_error(exc.error, part) from None
        except OSError as exc:  # the peer's own errors arrive as PeerError: an OSError here is our disk's
            raise self._disk_error(exc, part) from None

    async def _assemble_pieced(self, job: Job, part: Path, f: dict[str, Any], partial: Partial) -> None:
        """A file with a piece list: each piece checked as it lands and then published to `partial`
        (served to peers), the whole file checked at the end; a bad piece is cut off and named."""
        async def download(path: str, first: int, last: int, take: Take) -> int:
            return await get(job.peer, path, self.secret, take, start=first, end=last, ssl_context=self.ssl_context,
                             server_hostname=job.peer_hostname)

        try:
            await write_pieced(job, part, f, partial, download, self.store.blob_path(f["sha256"]), self.node)
        except LocalWrite as exc:
            raise self._disk_error(exc.error, part) from None
        except OSError as exc:
            raise self._disk_error(exc, part) from None

    async def _write(self, job: Job, part: Path, segments: list[Segment], path: str) -> str:
        total = sum(s.size for s in segments)
        # A whole file is one segment whose hash is the file's: hash it once, not twice.
        whole = hashlib.sha256() if len(segments) > 1 else None
        fh, have = await trio.to_thread.run_sync(open_part, part, total)
        with fh:
            pos = 0
            for seg in segments:
                h = hashlib.sha256()
                hashers = [h] if whole is None else [h, whole]
                kept = max(0, min(seg.size, have - pos))
                if kept:  # what is already on disk: re-hashed off the event loop, fetched again never
                    await trio.to_thread.run_sync(rehash, fh, pos, kept, hashers)
                job.bytes_done += kept
                if kept < seg.size:
                    fh.seek(pos + kept)

                    def take(chunk: bytes | bytearray | memoryview) -> None:
                        try:
                            fh.write(chunk)
                        except OSError as exc:
                            raise LocalWrite(exc) from None
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
                                      ssl_context=self.ssl_context, server_hostname=job.peer_hostname)
                        finally:
                            fh.flush()  # what arrived is kept for a resume (unless the disk is full)
                actual = h.hexdigest()
                if actual != seg.sha256:
                    fh.truncate(pos)  # the bad bytes are never kept
                    fh.flush()
                    if pos == 0:
                        part.unlink(missing_ok=True)
                    raise FetchError(f"digest mismatch in {seg.what} of {path} from peer {job.peer}: expected "
                                     f"sha256 {seg.sha256}, received {actual}; the bytes were discarded")
                pos += seg.size
            sha = whole.hexdigest() if whole is not None else segments[0].sha256
            await trio.to_thread.run_sync(install, fh, part, self.store.blob_path(sha))
        return sha


