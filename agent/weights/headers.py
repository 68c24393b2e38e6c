"""The headers an import reads, each bounded before it allocates and checked against its format:
a model's config.json, a safetensors file's header, a GGUF file's header (_parse_gguf: the `gguf`
library's reader decoded every metadata value, SmolLM2's 49,152-token vocabulary element by element,
seconds of CPU per import or fetch). A HeaderError names the file, what is wrong, and a stable code; a hostile file never gets
further than its header, nor costs more than its bounds.

The bounds (README, Bounds):
- config.json: at most MAX_JSON_BYTES, nested at most MAX_JSON_DEPTH deep.
- safetensors: a header of at most MAX_SAFETENSORS_HEADER bytes (the format's own limit is 100 MB;
  a real file's is well under 1 MiB), at most MAX_TENSORS tensors, dtypes from the format's list,
  shapes of at most MAX_DIMS integers whose bytes are the tensor's extent, integer offsets that tile
  the data exactly, names of at most MAX_NAME bytes without a path separator or control character.
- GGUF: versions 2 and 3, at most MAX_TENSORS tensors and MAX_GGUF_KV metadata keys (and no more
  than the file's bytes could hold), a general.architecture, every tensor of a known type, at most
  4 dimensions, aligned, and inside the file."""

from __future__ import annotations

import json
import mmap
import struct
from pathlib import Path
from typing import Any, BinaryIO

MAX_JSON_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
MAX_SAFETENSORS_HEADER = 16 << 20
MAX_TENSORS = 65_536
MAX_GGUF_KV = 65_536
MAX_DIMS = 16
MAX_NAME = 1024
GGUF_VERSIONS = (2, 3)
GGUF_MAX_DIMS = 4  # GGML_MAX_DIMS

# The format's dtypes (safetensors' Dtype) and the bits of one element of each.
SAFETENSORS_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
    "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64,
    "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}


class HeaderError(Exception):
    """A header refused: `code` is stable (invalid_json, invalid_safetensors, invalid_gguf)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def _depth(value: Any) -> int:
    """How deep `value` nests (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


def load_json(fh: BinaryIO, path: Path) -> Any:
    """A small JSON file (a model's config.json): at most MAX_JSON_BYTES, at most MAX_JSON_DEPTH deep."""
    data = fh.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise HeaderError("invalid_json", f"{path} is larger than {MAX_JSON_BYTES:,} bytes: not a model's "
                                          "config")
    try:
        value = json.loads(data)
    except RecursionError:  # json's decoder stops at the interpreter's depth: a few hundred levels, nothing held
        raise HeaderError("invalid_json", f"{path} is nested more than {MAX_JSON_DEPTH} levels deep") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer over Python's 4,300 digits
        raise HeaderError("invalid_json", f"{path} is not JSON: {str(exc)[:200]}") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise HeaderError("invalid_json", f"{path} is nested more than {MAX_JSON_DEPTH} levels deep")
    return value


class _TooMany(Exception):
    pass


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_name(name: str) -> str | None:
    if not name or len(name.encode()) > MAX_NAME:
        return f"has {'an empty' if not name else 'a too long'} name (at most {MAX_NAME} bytes)"
    if "/" in name or "\\" in name or name in (".", "..") or any(ord(c) < 32 or ord(c) == 127 for c in name):
        return "has a name with a path separator, '.' or '..', or a control character"
    return None


def read_safetensors(fh: BinaryIO, size: int, path: Path) -> tuple[int, list[dict[str, Any]]]:
    """(data start, tensors ordered by offset: name, dtype, shape, begin, end as file offsets) of a
    safetensors file `size` bytes long, checked against the format."""

    def bad(message: str) -> HeaderError:
        return HeaderError("invalid_safetensors", f"{path}: {message}")

    head = fh.read(8)
    if len(head) != 8:
        raise bad("too short for a safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_SAFETENSORS_HEADER:
        raise bad(f"its header claims {n:,} bytes; at most {MAX_SAFETENSORS_HEADER:,} are read")
    if 8 + n > size:
        raise bad(f"its header claims {n:,} bytes of a {size:,}-byte file (truncated?)")
    raw = fh.read(n)
    if len(raw) != n or not raw.startswith(b"{"):
        raise bad("its header is not a JSON object")
    objects = 0

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal objects
        objects += 1
        if objects > MAX_TENSORS + 2:  # one per tensor, the metadata, the header: stop before building more
            raise _TooMany
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:  # json keeps the last; a loader that kept the first would read other bytes
                raise bad(f"its header names {key[:80]!r} twice")
            out[key] = value
        return out

    try:
        header = json.loads(raw, object_pairs_hook=pairs)
    except _TooMany:
        raise bad(f"its header holds more than {MAX_TENSORS:,} tensors") from None
    except RecursionError:
        raise bad("its header is nested too deep for a safetensors header") from None
    except ValueError as exc:  # not UTF-8, not JSON, or an integer over Python's 4,300 digits
        raise bad(f"its header is not JSON: {str(exc)[:200]}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise bad("its __metadata__ is not an object of strings")
    if len(header) > MAX_TENSORS:
        raise bad(f"its header holds more than {MAX_TENSORS:,} tensors")
    start, data = 8 + n, size - 8 - n
    tensors = []
    for name, info in header.items():
        wrong = _check_name(name)
        if wrong is None:
            wrong = _check_tensor(info)
        if wrong is not None:
            raise bad(f"tensor {name[:80]!r} {wrong}")
        b, e = info["data_offsets"]
        if e > data:
            raise bad(f"tensor {name[:80]!r} ends at byte {e:,} of {data:,} bytes of data (truncated?)")
        tensors.append({"name": name, "dtype": info["dtype"], "shape": list(info["shape"]),
                        "begin": start + b, "end": start + e})
    tensors.sort(key=lambda t: (t["begin"], t["end"]))
    pos = start
    for t in tensors:
        if t["begin"] != pos:
            raise bad(f"tensor {t['name'][:80]!r} does not start where the previous one ends")
        pos = t["end"]
    if pos != size:
        raise bad(f"its tensors' data ends at byte {pos:,} but the file has {size:,} bytes")
    return start, tensors


def _check_tensor(info: Any) -> str | None:
    """What is wrong with one tensor's entry, or None."""
    if not isinstance(info, dict):
        return "is not an object"
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_BITS:
        return f"has dtype {str(dtype)[:20]!r}, not one of the format's ({', '.join(SAFETENSORS_BITS)})"
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        return f"has shape {str(shape)[:80]}: not a list of at most {MAX_DIMS} non-negative integers"
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        return f"has data_offsets {str(offsets)[:80]}: not two integers BEGIN <= END"
    elements = 1
    for d in shape:
        elements *= d
    bits = elements * SAFETENSORS_BITS[dtype]
    if bits % 8 or bits // 8 != offsets[1] - offsets[0]:
        return (f"has shape {shape} of {dtype} ({bits / 8:,.0f} bytes) but data_offsets of "
                f"{offsets[1] - offsets[0]:,} bytes")
    return None


SHAPE_KEYS = ("block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
              "attention.key_length")  # {arch}.KEY


def read_gguf(path: Path, size: int) -> dict[str, Any]:
    """Check a GGUF file's header: {"architecture", "tensors", "version", "shape"} (shape: the
    metadata the KV cache is sized by, agent/weights/architecture.py, read by the same parse). The
    fixed header is read first, so that no count the file claims is believed past its size."""

    def bad(message: str) -> HeaderError:
        return HeaderError("invalid_gguf", f"{path}: {message}")

    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24 or head[:4] != b"GGUF":
        raise bad("too short for a GGUF header" if head[:4] == b"GGUF" else "not a GGUF file (no GGUF magic)")
    version, n_tensors, n_kv = struct.unpack("<IQQ", head[4:])
    if version not in GGUF_VERSIONS:
        raise bad(f"GGUF version {version} (fleet reads little-endian versions {' and '.join(map(str, GGUF_VERSIONS))})")
    room = size - 24
    # The smallest a tensor's info can be: name length, one dimension count, type, offset (24 bytes);
    # a metadata entry: key length, type, a one-byte value (13 bytes).
    if n_tensors > MAX_TENSORS or n_tensors * 24 > room:
        raise bad(f"it claims {n_tensors:,} tensors (at most {MAX_TENSORS:,}, and a {size:,}-byte file holds fewer)")
    if n_kv > MAX_GGUF_KV or n_kv * 13 > room:
        raise bad(f"it claims {n_kv:,} metadata keys (at most {MAX_GGUF_KV:,}, and a {size:,}-byte file holds fewer)")
    if n_tensors == 0:
        raise bad("it holds no tensors (a header alone is no model)")
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
            architecture, shape, infos, alignment, data_offset = _parse_gguf(data, n_tensors, n_kv)
    except Exception as exc:  # a truncated or corrupt header, in one line
        words = str(exc).splitlines()[0][:200] if str(exc) else ""
        raise bad(f"not a readable GGUF file (truncated or corrupt): {type(exc).__name__}: {words}") from None
    if not architecture:
        raise bad("it names no architecture (general.architecture)")
    extents = []
    for name, n_dims, dims, raw_type, offset in infos:
        what = GGMLQuantizationType(raw_type)  # _parse_gguf refused an unknown type already
        block, type_size = GGML_QUANT_SIZES[what]
        elements = 1
        for d in dims:
            elements *= d
        if not 1 <= n_dims <= GGUF_MAX_DIMS or any(d < 0 for d in dims) or not dims or dims[0] % block:
            raise bad(f"tensor {name[:80]!r} has shape {dims[:8]} of {what.name}: not 1 to {GGUF_MAX_DIMS} "
                      f"dimensions, the first a multiple of {block}")
        if offset % alignment:
            raise bad(f"tensor {name[:80]!r} starts at offset {offset:,}, not a multiple of the alignment {alignment}")
        begin, end = data_offset + offset, data_offset + offset + elements // block * type_size
        if end > size:
            raise bad(f"tensor {name[:80]!r} ends at byte {end:,} of a {size:,}-byte file (truncated?)")
        extents.append((begin, end, name))
    extents.sort()
    for (_, prev_end, prev), (begin, _, name) in zip(extents, extents[1:]):
        if begin < prev_end:
            raise bad(f"tensors {prev[:80]!r} and {name[:80]!r} overlap")
    return {"architecture": architecture, "tensors": len(infos), "version": version,
            "shape": {"general.architecture": architecture, **shape}}


# GGUF metadata value types (gguf's GGUFValueType): the fixed-size ones by struct format.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY, _GGUF_UINT32 = 8, 9, 4
_GGUF_MAX_NESTING = 8  # an array of arrays of ...: no real file nests at all
_GGUF_MAX_KEPT = 65_536  # elements of an array read_gguf decodes (per-layer values: one per layer)
_GGUF_DEFAULT_ALIGNMENT = 32


class _Cursor:
    """Reads little-endian values from a GGUF file's bytes, never past them."""

    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.pos, self.size = data, 24, len(data)

    def take(self, n: int) -> int:
        """Skip n bytes; where they began."""
        at = self.pos
        if n < 0 or at + n > self.size:
            raise ValueError(f"{n:,} bytes at offset {at:,} run past the end of the file ({self.size:,} bytes)")
        self.pos = at + n
        return at

    def unpack(self, fmt: str) -> Any:
        return struct.unpack_from("<" + fmt, self.data, self.take(struct.calcsize("<" + fmt)))[0]

    def string(self, keep: bool = True) -> str:
        n = self.unpack("Q")
        at = self.take(n)
        return self.data[at:at + n].decode("utf-8") if keep else ""

    def value(self, kind: int, keep: bool, depth: int = 0) -> Any:
        """A metadata value of type `kind`: decoded where `keep`, else skipped (None)."""
        if kind in _GGUF_SCALARS:
            return self.unpack(_GGUF_SCALARS[kind]) if keep else self.take(struct.calcsize(_GGUF_SCALARS[kind]))
        if kind == _GGUF_STRING:
            return self.string(keep)
        if kind != _GGUF_ARRAY:
            raise ValueError(f"unknown metadata value type {kind}")
        if depth >= _GGUF_MAX_NESTING:
            raise ValueError(f"arrays nested more than {_GGUF_MAX_NESTING} deep")
        item, count = self.unpack("I"), self.unpack("Q")
        if keep and count > _GGUF_MAX_KEPT:  # a value fleet reads (a per-layer count): never a file's worth
            raise ValueError(f"an array of {count:,} values where at most {_GGUF_MAX_KEPT:,} are read")
        if item in _GGUF_SCALARS:  # one read for the whole array
            fmt = _GGUF_SCALARS[item]
            at = self.take(count * struct.calcsize(fmt))
            return list(struct.unpack_from(f"<{count}{fmt}", self.data, at)) if keep else None
        if item == _GGUF_STRING and not keep:  # a vocabulary: each length read, nothing decoded
            data, pos, size, unpack = self.data, self.pos, self.size, struct.Struct("<Q").unpack_from
            for _ in range(count):
                if pos + 8 > size:
                    raise ValueError(f"a string's length at offset {pos:,} runs past the end of the file")
                pos += 8 + unpack(data, pos)[0]
                if pos > size:
                    raise ValueError(f"a string ending at offset {pos:,} runs past the end of the file ({size:,} bytes)")
            self.pos = pos
            return None
        if count > self.size - self.pos:  # each element takes a byte at least
            raise ValueError(f"an array of {count:,} elements at offset {self.pos:,} runs past the end of the file")
        values = [self.value(item, keep, depth + 1) for _ in range(count)]
        return values if keep else None


def _parse_gguf(data: mmap.mmap, n_tensors: int, n_kv: int) -> tuple[
        str | None, dict[str, Any], list[tuple[str, int, list[int], int, int]], int, int]:
    """The metadata and tensor infos after a GGUF's fixed header (as gguf.GGUFReader parses them,
    values decoded only where read_gguf needs them): (architecture, shape, [(name, n_dims, dims, type,
    offset)], alignment, data_offset). Raises ValueError on anything the reader refuses: a key twice,
    an unknown value or tensor type, a tensor name twice, a bad general.alignment, a read past the
    end of the file."""
    from gguf import GGMLQuantizationType

    cur = _Cursor(data)
    architecture: str | None = None
    alignment = _GGUF_DEFAULT_ALIGNMENT
    shape: dict[str, Any] = {}
    keys: set[str] = set()
    for _ in range(n_kv):
        key = cur.string()
        if key in keys:
            raise ValueError(f"metadata key {key[:80]!r} twice")
        keys.add(key)
        kind = cur.unpack("I")
        wanted = key in ("general.architecture", "general.alignment") or key.split(".", 1)[-1] in SHAPE_KEYS
        value = cur.value(kind, wanted)
        if key == "general.architecture":
            architecture = value if isinstance(value, str) else None
        elif key == "general.alignment":
            if kind != _GGUF_UINT32:
                raise ValueError("bad type for general.alignment")
            if value == 0 or value & (value - 1):
                raise ValueError("invalid alignment: must be a non-zero power of two")
            alignment = value
        elif wanted:
            # head_count_kv may be a per-layer array (some architectures): its largest sizes the cache
            shape[key] = max(value) if isinstance(value, list) and value else value
    infos, names = [], set()
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.unpack("I")
        if n_dims > GGUF_MAX_DIMS:  # before its dimensions are read: a claim is not a list to build
            raise ValueError(f"tensor {name[:80]!r} has {n_dims:,} dimensions (at most {GGUF_MAX_DIMS})")
        at = cur.take(8 * n_dims)
        dims = list(struct.unpack_from(f"<{n_dims}Q", data, at))
        raw_type, offset = cur.unpack("I"), cur.unpack("Q")
        if name in names:
            raise ValueError(f"found duplicated tensor with name {name[:80]}")
        names.add(name)
        GGMLQuantizationType(raw_type)  # ValueError: not a known type
        infos.append((name, n_dims, dims, raw_type, offset))
    data_offset = cur.pos + (-cur.pos % alignment)
    return architecture, shape, infos, alignment, data_offset


def gguf_architecture(path: Path) -> str | None:
    """A GGUF file's general.architecture (None where it names none), its header walked as
    read_gguf walks it (what gguf.GGUFReader refuses raises ValueError) but no tensor's extent
    checked: what `fleet-agent convert` asks before transformers loads the file."""
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if len(data) < 24 or data[:4] != b"GGUF":
            raise ValueError("too short for a GGUF header" if data[:4] == b"GGUF" else "no GGUF magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, 4)
        if version not in GGUF_VERSIONS:
            raise ValueError(f"GGUF version {version} (readable: {' and '.join(map(str, GGUF_VERSIONS))})")
        if n_tensors > MAX_TENSORS or n_kv > MAX_GGUF_KV:
            raise ValueError(f"it claims {n_tensors:,} tensors and {n_kv:,} metadata keys "
                             f"(at most {MAX_TENSORS:,} and {MAX_GGUF_KV:,})")
        return _parse_gguf(data, n_tensors, n_kv)[0]
