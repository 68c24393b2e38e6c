"""Weights encrypted at rest: the node's key (a file, never the environment nor the network), the
process guard of whoever holds it, and the sealed file format, AES-256-GCM in chunks (`cryptography`).

A sealed file is a 20-byte header (magic, a random 8-byte nonce prefix, the chunk size) and then the
plaintext in chunks of that size, each encrypted with its own nonce (the prefix and the chunk's
index) and its tag appended. Each chunk's associated data binds the header, the file's path in the
model, the chunk's index and whether it is the last one, so that chunks cannot be reordered, dropped,
truncated at a chunk boundary, or moved into another file or another model's file without failing
authentication. An empty file is one final chunk of nothing (its tag alone)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Mapping

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from wire import manifest as mf

CIPHER = mf.ENCRYPTION_CIPHER
CHUNK_BYTES = 1 << 20
MAGIC = b"FLTGCM01"
HEADER = struct.Struct(">8s8sI")  # magic, nonce prefix, chunk size
TAG_BYTES = 16
MAX_CHUNK = 64 << 20
KEY_FILE_ENV = "FLEET_WEIGHTS_KEY_FILE"
# In a worker's environment: the numbers of the encrypted model's memfds it was handed (comma-separated).
MEMFDS_ENV = "FLEET_SEALED_FDS"
MAX_MEMFDS = 1024
# The key itself in the environment is refused: /proc/PID/environ keeps it for the process's life,
# whatever os.environ.pop does, and every worker started before the pop would inherit it.
KEY_ENV = "FLEET_WEIGHTS_KEY"
MAX_KEY_FILE = 4096
PR_SET_DUMPABLE = 4
_HEX_KEY = re.compile(rb"^\s*([0-9a-fA-F]{64})\s*\Z")


class KeyProblem(Exception):
    """A key that cannot be used: unreadable, the wrong size, or readable by others."""


class Unsealable(Exception):
    """A sealed file that does not decrypt: tampered, truncated, corrupt, or another key's."""


@dataclass(frozen=True, slots=True)
class Key:
    """The node's weights key; `id` names it in manifests, states and errors (never the key itself)."""

    secret: bytes
    id: str

    def __repr__(self) -> str:  # never in a log or a traceback
        return f"Key(id={self.id!r})"


def key_id(secret: bytes) -> str:
    """A short, one-way name for a key: 16 hex digits of a domain-separated sha256."""
    return hashlib.sha256(b"fleet weights key id\0" + secret).hexdigest()[:16]


def make_key(secret: bytes) -> Key:
    if len(secret) != 32:
        raise KeyProblem(f"a weights key is 32 bytes (AES-256), not {len(secret)}")
    return Key(secret, key_id(secret))


def parse_key(raw: bytes, where: str) -> Key:
    """32 raw bytes, or 64 hex digits (surrounding whitespace ignored)."""
    m = _HEX_KEY.match(raw)
    if m:
        return make_key(bytes.fromhex(m.group(1).decode()))
    if len(raw) == 32:
        return make_key(raw)
    raise KeyProblem(f"{where} holds no weights key: expected 32 raw bytes or 64 hex digits, found {len(raw)} bytes "
                     "(make one with: head -c 32 /dev/urandom > KEYFILE; chmod 600 KEYFILE)")


def read_key_file(path: Path) -> Key:
    """The key in a regular file of this user's, readable by no one else, of a key's size."""
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read(MAX_KEY_FILE + 1)
    except OSError as exc:
        raise KeyProblem(f"cannot read the weights key file {path}: {exc.strerror or exc}") from None
    if st.st_uid != os.geteuid():
        raise KeyProblem(f"the weights key file {path} belongs to uid {st.st_uid}, not to this agent's user "
                         f"(uid {os.geteuid()}); chown it")
    if st.st_mode & 0o077:
        raise KeyProblem(f"the weights key file {path} is readable by others (mode {st.st_mode & 0o777:o}); "
                         f"chmod 600 {path}")
    if len(raw) > MAX_KEY_FILE:
        raise KeyProblem(f"the weights key file {path} is over {MAX_KEY_FILE} bytes: not a key file")
    return parse_key(raw, f"the weights key file {path}")


def load_key(path: str | None, environ: Mapping[str, str]) -> Key | None:
    """The node's key: --key-file, else $FLEET_WEIGHTS_KEY_FILE; None when none is given. A key in
    $FLEET_WEIGHTS_KEY is refused (see KEY_ENV)."""
    if environ.get(KEY_ENV):
        raise KeyProblem(f"${KEY_ENV} is not read: a key in the environment stays readable in /proc/PID/environ "
                         f"for the agent's whole life; put it in a file (chmod 600) and give --key-file PATH or "
                         f"${KEY_FILE_ENV}, and unset ${KEY_ENV}")
    chosen = path or environ.get(KEY_FILE_ENV)
    return read_key_file(Path(chosen)) if chosen else None


def guard_process() -> bool:
    """Make this process undumpable (Linux prctl PR_SET_DUMPABLE 0) once it holds a key: no process of
    its user without CAP_SYS_PTRACE (a worker, say) can then read its /proc/PID/{environ,mem}, open
    its /proc/PID/fd/N (the memfds of decrypted models) or ptrace it, and it never dumps core. Root
    and the ptrace-capable still can. False where the platform has no such guard."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_DUMPABLE, 0): {os.strerror(err)}")
    return True


def held_memfds(environ: Mapping[str, str] = os.environ) -> list[int]:
    """This process's descriptors that are an encrypted model's memfds (agent/weights/unseal.py names them
    fleet:PATH): in a worker, the ones the agent handed over, at the numbers its environment names
    (MEMFDS_ENV, which the launcher writes), each checked to be such a memfd."""
    out = []
    for text in environ.get(MEMFDS_ENV, "").split(",")[:MAX_MEMFDS]:
        if not (text.isascii() and text.isdigit() and len(text) <= 9):
            continue
        try:
            if os.readlink(f"/proc/self/fd/{text}").startswith("/memfd:fleet:"):
                out.append(int(text))
        except OSError:  # not open (any more)
            continue
    return out


def guard_worker() -> bool:
    """In a worker, first thing: undumpable (guard_process) when it was handed an encrypted model's
    memfds, as it will hold the plaintext (an exec makes every process dumpable again): the other
    workers of the agent's user can then neither read its memory nor open its descriptors."""
    return bool(held_memfds()) and guard_process()


def manifest_block(key: Key, chunk: int = CHUNK_BYTES) -> dict[str, object]:
    """What a manifest says of an encrypted model: how, and under which key (by id)."""
    return {"cipher": CIPHER, "chunk_bytes": chunk, "key_id": key.id}


def _aad(header: bytes, rel: str, index: int, final: bool) -> bytes:
    return header + rel.encode() + b"\0" + struct.pack(">QB", index, final)


def _nonce(prefix: bytes, index: int) -> bytes:
    return prefix + struct.pack(">I", index)


class SealWriter:
    """Encrypts one file's plaintext into `out` as it is written; `finish` writes the last chunk.
    `sha256` is the ciphertext's, the name the sealed blob is stored under."""

    def __init__(self, out: BinaryIO, key: Key, rel: str, chunk: int = CHUNK_BYTES) -> None:
        self.out, self.rel, self.chunk = out, rel, chunk
        self.aead = AESGCM(key.secret)
        self.header = HEADER.pack(MAGIC, os.urandom(8), chunk)
        self.prefix = self.header[8:16]
        self.sha256 = hashlib.sha256()
        self.pending = bytearray()
        self.index = 0
        self._put(self.header)

    def _put(self, data: bytes) -> None:
        self.out.write(data)
        self.sha256.update(data)

    def _seal(self, plain: bytes, final: bool) -> None:
        if self.index >= 1 << 32:
            raise ValueError("file too large for one sealed file (2^32 chunks)")
        self._put(self.aead.encrypt(_nonce(self.prefix, self.index), plain,
                                    _aad(self.header, self.rel, self.index, final)))
        self.index += 1

    def write(self, data: bytes) -> None:
        self.pending += data
        # Keep at least one byte back: the last chunk is sealed as final by finish().
        while len(self.pending) > self.chunk:
            self._seal(bytes(self.pending[:self.chunk]), False)
            del self.pending[:self.chunk]

    def finish(self) -> str:
        self._seal(bytes(self.pending), True)
        self.pending.clear()
        return self.sha256.hexdigest()


def unseal(fh: BinaryIO, size: int, key: Key, rel: str) -> Iterator[bytes]:
    """The plaintext of the sealed file `fh` (`size` bytes), chunk by chunk; Unsealable at the first
    chunk that does not authenticate, naming it."""
    header = fh.read(HEADER.size)
    if len(header) != HEADER.size:
        raise Unsealable(f"{rel}: {size} bytes is too short for a sealed file")
    magic, prefix, chunk = HEADER.unpack(header)
    if magic != MAGIC or not 0 < chunk <= MAX_CHUNK:
        raise Unsealable(f"{rel}: not a sealed file (bad header)")
    aead = AESGCM(key.secret)
    body = size - HEADER.size
    count = max(1, -(-body // (chunk + TAG_BYTES)))
    if body < TAG_BYTES or (count > 1 and body - (count - 1) * (chunk + TAG_BYTES) < TAG_BYTES):
        raise Unsealable(f"{rel}: truncated: {body} bytes cannot be whole chunks of {chunk} bytes and their tags")
    for index in range(count):
        sealed = fh.read(chunk + TAG_BYTES)
        try:
            yield aead.decrypt(_nonce(prefix, index), sealed, _aad(header, rel, index, index == count - 1))
        except InvalidTag:
            raise Unsealable(f"{rel}: chunk {index} of {count} fails authentication (tampered, corrupt, or sealed "
                             "under another key)") from None


def seal_bytes(plain: bytes, key: Key, rel: str, chunk: int = CHUNK_BYTES) -> bytes:
    """A whole sealed file in memory (tests and small files)."""
    import io

    out = io.BytesIO()
    w = SealWriter(out, key, rel, chunk)
    w.write(plain)
    w.finish()
    return out.getvalue()
