"""Serving encrypted weights from memory only: before a server on an encrypted model starts, the agent
decrypts each of the model's files into an anonymous in-memory file (memfd, sealed read-only) and
gives the engine a directory of links to them; nothing decrypted ever reaches a disk.

Why the agent decrypts, not the worker: the key stays in the one process that already holds it,
never crosses a process boundary, and is never in reach of an engine's code or its HTTP server. The
worker inherits its own model's memfds and no other (the launcher's keep_fds), at the numbers they
have in the agent (its environment names them: sealed.MEMFDS_ENV), and the links say
`NAME -> /proc/self/fd/N`, which the kernel resolves inside the worker, so engines load the plaintext as the files they expect: llama.cpp mmaps the GGUF straight from
the memfd's pages, PyTorch reads config, tokenizer and safetensors as from a directory. Another
process following the links finds its own descriptors, not these; the agent itself is not dumpable
once it holds a key (sealed.guard_process), so /proc/AGENT/fd is closed to other workers too. Each
start has its own links directory, so a server stopped while decrypting and started again under the
same id never shares or removes the new one's. The memfds are closed, and the links removed, once
PyTorch has loaded (it holds the weights itself) and when a llama.cpp server's process ends. Each
file's plaintext is hashed on the way and checked against the manifest: the digest pins what is
served, and a file swapped for another one sealed under the same key is refused as surely as a
flipped byte, which the cipher finds."""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Awaitable, Callable, Protocol, Sequence

import trio

from wire import manifest as mf
from wire.state import WeightsEntry

from agent.weights.sealed import KEY_FILE_ENV, Key, Unsealable, unseal
from agent.weights.store import Store, StoreError

KEY_MISSING = "encrypted_key_missing"
TAMPERED = "encrypted_weights_tampered"
UNSEAL_FAILED = "encrypted_unseal_failed"
INSUFFICIENT_MEMORY = "insufficient_memory"
_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL


class Starting(Protocol):
    """The server being started, as the supervisor keeps it (agent.serving.supervisor.Server)."""

    id: str
    state: str
    reason: str | None


class Refusal(Exception):
    """Why an encrypted model is not served: a stable code first, then the model and its key id."""


class Abandoned(Exception):
    """The server was stopped while its model was being decrypted: nothing more to do for it."""


@dataclass(slots=True)
class Opened:
    """One start's decrypted model: its own links directory, the engine's path in it, the memfds."""

    links: Path
    path: str
    fds: list[int] = field(default_factory=list)


def mem_available() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is none to read)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _never() -> None:
    return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def decrypt_to_memfd(path: Path, key: Key, rel: str, size: int, sha256: str,
                     keep_going: Callable[[], None] = _never) -> int:
    """A read-only memfd holding the plaintext of one sealed file, checked against its manifest entry;
    `keep_going` is asked before each chunk and raises to stop."""
    fd = os.memfd_create(f"fleet:{rel}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        whole = hashlib.sha256()
        with open(path, "rb") as fh:
            for chunk in unseal(fh, os.fstat(fh.fileno()).st_size, key, rel):
                keep_going()
                whole.update(chunk)
                _write_all(fd, chunk)
        if whole.hexdigest() != sha256 or os.fstat(fd).st_size != size:
            raise Unsealable(f"{rel}: decrypts to sha256 {whole.hexdigest()}, the manifest says {sha256}")
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _what(entry: WeightsEntry) -> str:
    return f"model {entry['name'] or '?'} ({entry['digest']})"


class Unsealer:
    """Opens encrypted models for the servers that serve them, and closes them when those end."""

    def __init__(self, store: Store, runtime: Path,
                 available: Callable[[], int | None] = mem_available) -> None:
        self.store = store
        self.runtime = runtime  # the agent's servers/ directory: each start's links, next to its log
        self.available = available  # the memory free for plaintext (bytes; None: unknown)

    def prepare(self, sid: str, entry: WeightsEntry) -> Opened:
        """Where this start's links will be (made by `open`, named afresh for every start) and what
        the engine is told to load: the directory (safetensors) or the file's link (gguf)."""
        links = self.runtime / f"{sid}.{secrets.token_hex(6)}.sealed"
        return Opened(links, str(links / Path(entry["path"]).name if entry["format"] == "gguf" else links))

    def check_key(self, entry: WeightsEntry) -> Key:
        """The key that opens the model, or Refusal naming the model and the key id it needs."""
        how = entry.get("encryption")
        if how is None:
            raise ValueError(f"model {entry['digest']} is not encrypted")
        key = self.store.key
        if key is None:
            raise Refusal(f"{KEY_MISSING}: {_what(entry)} is encrypted under key {how['key_id']}, and this agent "
                          f"holds no weights key (fleet-agent serve --key-file PATH, or ${KEY_FILE_ENV}); not started")
        if key.id != how["key_id"]:
            raise Refusal(f"{KEY_MISSING}: {_what(entry)} is encrypted under key {how['key_id']}, but this agent "
                          f"holds key {key.id}; not started")
        return key

    def open(self, opened: Opened, entry: WeightsEntry, keep_going: Callable[[], None] = _never) -> None:
        """Decrypt every file of the model into memfds and link them for the engine (blocking: a
        thread); `keep_going` is asked between chunks and raises to stop (fds closed, links removed)."""
        keep_going()
        key = self.check_key(entry)
        manifest = self.store.load_manifest(entry["digest"])
        need = sum(int(f["size"]) for f in manifest["files"])
        free = self.available()
        if free is not None and need > free:
            raise Refusal(f"{INSUFFICIENT_MEMORY}: {_what(entry)} is decrypted into memory: it needs {need} bytes, "
                          f"and {free} are available (MemAvailable); not started")
        model_dir = self.store.model_dir(entry["digest"])
        opened.links.mkdir(mode=0o700)  # fresh per start: an existing one is someone else's
        try:
            for f in manifest["files"]:
                keep_going()
                rel = mf.safe_relpath(f["path"])
                try:
                    fd = decrypt_to_memfd(model_dir / rel, key, rel, f["size"], f["sha256"], keep_going)
                except Unsealable as exc:
                    raise Refusal(f"{TAMPERED}: {_what(entry)} is not served: {exc}") from None
                except OSError as exc:  # reading the sealed file, or writing memory (ENOMEM, ENOSPC)
                    raise Refusal(f"{UNSEAL_FAILED}: {_what(entry)}: {rel}: {exc.strerror or exc}") from None
                opened.fds.append(fd)
                link = opened.links / rel
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(f"/proc/self/fd/{fd}")  # the worker's own copy, same number
        except BaseException:
            self.close(opened)
            raise

    def close(self, opened: Opened) -> None:
        fds, opened.fds = opened.fds, []
        for fd in fds:
            os.close(fd)
        shutil.rmtree(opened.links, ignore_errors=True)

    async def run(self, server: Starting, opened: Opened, entry: WeightsEntry,
                  supervise: Callable[[Sequence[int]], Awaitable[None]]) -> None:
        """Decrypt (in a thread: the API keeps answering), then supervise the server as any other,
        handing it the memfds; a missing or wrong key, weights that do not decrypt, or no memory or
        links for them fail the server at once, no retry. A stop meanwhile abandons the decryption
        at the next chunk; an agent shutting down cancels it there too."""
        def keep_going() -> None:
            trio.from_thread.check_cancelled()
            if server.state != "starting":
                raise Abandoned

        try:
            await trio.to_thread.run_sync(self.open, opened, entry, keep_going, abandon_on_cancel=False)
        except Abandoned:
            return
        except Refusal as exc:
            self._fail(server, str(exc))
            return
        except (OSError, StoreError) as exc:  # the links directory, the manifest
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            self._fail(server, f"{UNSEAL_FAILED}: {_what(entry)}: {why}")
            return
        try:
            if server.state == "starting":  # not stopped while decrypting
                async with trio.open_nursery() as nursery:
                    if entry["format"] == "safetensors":
                        nursery.start_soon(self._release_once_loaded, server, opened)
                    await supervise(tuple(opened.fds))
                    nursery.cancel_scope.cancel()
        finally:
            self.close(opened)

    @staticmethod
    def _fail(server: Starting, reason: str) -> None:
        if server.state == "starting":  # a stopped server stays stopped
            server.state, server.reason = "failed", reason

    async def _release_once_loaded(self, server: Starting, opened: Opened) -> None:
        """PyTorch has the weights in its own tensors once it answers (or maps the memfd's pages,
        which a mapping keeps): the agent's descriptors would only hold a second copy in memory.
        llama.cpp's worker opens its GGUF again later (the vocabulary, on first use), so it keeps them."""
        while server.state == "starting":
            await trio.sleep(0.1)
        if server.state == "running":
            self.close(opened)
