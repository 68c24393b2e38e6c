"""Serving encrypted weights from memory only: before a server on an encrypted model starts, the agent
decrypts each of the model's files into an anonymous in-memory file (memfd, sealed read-only) and
gives the engine a directory of links to them; nothing decrypted ever reaches a disk.

Why the agent decrypts, not the worker: the key stays in the one process that already holds it,
never crosses a process boundary, and is never in reach of an engine's code or its HTTP server. The
worker finds the plaintext through `/proc/AGENT_PID/fd/N` links (same user; the kernel resolves them
to the memfd), so engines load it as the files they expect: llama.cpp mmaps the GGUF straight from
the memfd's pages, PyTorch reads config, tokenizer and safetensors as from a directory. The memfds
are closed, and the links removed, once PyTorch has loaded (it holds the weights itself) and when a
llama.cpp server's process ends. Each file's plaintext is hashed on the way and checked against the
manifest: the digest pins what is served, and a file swapped for another one sealed under the same
key is refused as surely as a flipped byte, which the cipher finds."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import trio

from wire import manifest as mf
from wire.state import WeightsEntry

from .sealed import KEY_FILE_ENV, Key, Unsealable, unseal
from .store import Store

KEY_MISSING = "encrypted_key_missing"
TAMPERED = "encrypted_weights_tampered"
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class Starting(Protocol):
    """The server being started, as the supervisor keeps it (agent.workers.Server)."""

    id: str
    state: str
    reason: str | None


class Refusal(Exception):
    """Why an encrypted model is not served: a stable code first, then the model and its key id."""


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def decrypt_to_memfd(path: Path, key: Key, rel: str, size: int, sha256: str) -> int:
    """A read-only memfd holding the plaintext of one sealed file, checked against its manifest entry."""
    fd = os.memfd_create(f"fleet:{rel}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        whole = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in unseal(fh, os.fstat(fh.fileno()).st_size, key, rel):
                whole.update(chunk)
                _write_all(fd, chunk)
        if whole.hexdigest() != sha256 or os.fstat(fd).st_size != size:
            raise Unsealable(f"{rel}: decrypts to sha256 {whole.hexdigest()}, the manifest says {sha256}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


class Unsealer:
    """Opens encrypted models for the servers that serve them, and closes them when those end."""

    def __init__(self, store: Store, runtime: Path) -> None:
        self.store = store
        self.runtime = runtime  # the agent's servers/ directory: each server's links, next to its log

    def _links(self, sid: str) -> Path:
        return self.runtime / f"{sid}.sealed"

    def model_path(self, sid: str, entry: WeightsEntry) -> str:
        """What the engine is told to load: the directory of links (safetensors) or the file's link
        (gguf), made by `run` before the process starts."""
        if entry["format"] == "gguf":
            return str(self._links(sid) / Path(entry["path"]).name)
        return str(self._links(sid))

    def check_key(self, entry: WeightsEntry) -> Key:
        """The key that opens the model, or Refusal naming the model and the key id it needs."""
        how = entry.get("encryption")
        if how is None:
            raise ValueError(f"model {entry['digest']} is not encrypted")
        what = f"model {entry['name'] or '?'} ({entry['digest']})"
        key = self.store.key
        if key is None:
            raise Refusal(f"{KEY_MISSING}: {what} is encrypted under key {how['key_id']}, and this agent holds no "
                          f"weights key (fleet-agent serve --key-file PATH, or ${KEY_FILE_ENV}); not started")
        if key.id != how["key_id"]:
            raise Refusal(f"{KEY_MISSING}: {what} is encrypted under key {how['key_id']}, but this agent holds key "
                          f"{key.id}; not started")
        return key

    def open(self, sid: str, entry: WeightsEntry) -> list[int]:
        """Decrypt every file of the model into memfds and link them for the engine (blocking: a thread)."""
        key = self.check_key(entry)
        digest = entry["digest"]
        manifest = self.store.load_manifest(digest)
        model_dir = self.store.model_dir(digest)
        links = self._links(sid)
        shutil.rmtree(links, ignore_errors=True)
        links.mkdir(mode=0o700, parents=True)
        fds: list[int] = []
        try:
            for f in manifest["files"]:
                rel = mf.safe_relpath(f["path"])
                try:
                    fd = decrypt_to_memfd(model_dir / rel, key, rel, f["size"], f["sha256"])
                except Unsealable as exc:
                    raise Refusal(f"{TAMPERED}: model {entry['name'] or '?'} ({digest}) is not served: {exc}") from None
                except OSError as exc:
                    raise Refusal(f"{TAMPERED}: model {entry['name'] or '?'} ({digest}): {rel} cannot be read: "
                                  f"{exc.strerror or exc}") from None
                fds.append(fd)
                link = links / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f"/proc/{os.getpid()}/fd/{fd}")
        except BaseException:
            self.close(sid, fds)
            raise
        return fds

    def close(self, sid: str, fds: list[int]) -> None:
        for fd in fds:
            os.close(fd)
        shutil.rmtree(self._links(sid), ignore_errors=True)

    async def run(self, server: Starting, entry: WeightsEntry, supervise: Callable[[], Awaitable[None]]) -> None:
        """Decrypt (in a thread: the API keeps answering), then supervise the server as any other;
        a missing or wrong key, or weights that do not decrypt, fail the server at once, no retry."""
        try:
            fds = await trio.to_thread.run_sync(self.open, server.id, entry)
        except Refusal as exc:
            server.state, server.reason = "failed", str(exc)
            return
        try:
            if server.state == "starting":  # not stopped while decrypting
                async with trio.open_nursery() as nursery:
                    if entry["format"] == "safetensors":
                        nursery.start_soon(self._release_once_loaded, server, fds)
                    await supervise()
                    nursery.cancel_scope.cancel()
        finally:
            self.close(server.id, fds)

    async def _release_once_loaded(self, server: Starting, fds: list[int]) -> None:
        """PyTorch has the weights in its own tensors once it answers (or maps the memfd's pages,
        which a mapping keeps): the agent's descriptors would only hold a second copy in memory.
        llama.cpp's worker opens its GGUF again later (the vocabulary, on first use), so it keeps them."""
        while server.state == "starting":
            await trio.sleep(0.1)
        if server.state == "running":
            self.close(server.id, fds)
            fds.clear()
