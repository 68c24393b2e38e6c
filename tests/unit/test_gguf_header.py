"""fleet's GGUF header parser (agent/weights/headers.py _parse_gguf) against the `gguf` library's
own reader, which it replaced for speed (the reader decodes every metadata value, a vocabulary
element by element: seconds of CPU per import; bench/gguf_header.py): on a file with every kind of
metadata value, and on each cut of it, both agree, or both refuse."""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from agent.weights.headers import HeaderError, _parse_gguf, read_gguf
from tests.models import gguf_header, tiny_gguf


def rich_gguf(path: Path) -> Path:
    """Every kind of metadata value (scalars, a string, arrays of numbers, strings and arrays), a
    per-layer head_count_kv, an alignment of its own, three tensors of two types."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_custom_alignment(64)
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_head_count(2)
    w.add_array("llama.attention.head_count_kv", [1, 2])
    w.add_context_length(128)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("general.some_int64", -5)
    w.add_float64("general.some_float64", 0.25)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "</s>", "a", "héllo", ""])
    w.add_array("tokenizer.ggml.scores", [0.0, 1.5, -2.0, 3.0, 4.0])
    w.add_array("general.nested", [[1, 2], [3]])
    w.add_string("general.name", "rich")
    w.add_tensor("a", np.arange(16, dtype=np.float32).reshape(2, 8))
    w.add_tensor("b", np.ones(8, dtype=np.float16))
    w.add_tensor("c", np.zeros((3, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def counts(data: bytes) -> tuple[int, int]:
    return struct.unpack_from("<QQ", data, 8)


def ours(path: Path) -> Any:
    data = path.read_bytes()
    n_tensors, n_kv = counts(data)
    with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        architecture, shape, infos, alignment, data_offset = _parse_gguf(m, n_tensors, n_kv)
    return architecture, shape, infos, alignment, data_offset


def theirs(path: Path) -> Any:
    from gguf import GGUFReader

    from agent.weights.headers import SHAPE_KEYS

    reader = GGUFReader(str(path))
    arch = reader.get_field("general.architecture")
    shape = {}
    for key in reader.fields:
        if key.split(".", 1)[-1] in SHAPE_KEYS:
            value = reader.fields[key].contents()
            shape[key] = max(value) if isinstance(value, list) and value else value
    infos = [(t.name, len(t.shape), [int(d) for d in t.field.parts[3]], int(t.tensor_type), int(t.field.parts[5][0]))
             for t in reader.tensors]
    return (str(arch.contents()) if arch is not None else None, shape, infos, int(reader.alignment),
            int(reader.data_offset))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("gguf")
    one = base / "one.gguf"
    one.write_bytes(gguf_header(4096) + bytes(4096 - len(gguf_header(4096))))
    return {"rich": rich_gguf(base / "rich.gguf"), "tiny": tiny_gguf(base), "one": one}


@pytest.mark.parametrize("name", ["rich", "tiny", "one"])
def test_the_parse_is_the_readers(files: dict[str, Path], name: str) -> None:
    assert ours(files[name]) == theirs(files[name])


def test_the_rich_file_holds_what_it_was_made_for(files: dict[str, Path]) -> None:
    architecture, shape, infos, alignment, _ = ours(files["rich"])
    assert (architecture, alignment) == ("llama", 64)
    assert shape["llama.attention.head_count_kv"] == 2 and shape["llama.block_count"] == 2
    assert [name for name, *_ in infos] == ["a", "b", "c"]


def outcome(read: Any, path: Path) -> Any:
    try:
        return read(path)
    except Exception:
        return "refused"


def test_each_cut_of_the_file_is_refused(files: dict[str, Path], tmp_path: Path) -> None:
    """Cut anywhere before the end of its last tensor, the file is refused (read_gguf's HeaderError),
    as the reader refuses it: within its header by the parse; past the header (the padding, the
    tensors' data, which the parse does not read) by read_gguf's extents against the file's size."""
    from gguf import GGUFReader

    whole = files["rich"].read_bytes()
    data_end = max(int(t.data_offset) + int(t.n_bytes) for t in GGUFReader(str(files["rich"])).tensors)
    assert data_end < len(whole)  # the file's last padding: not needed, a cut there loses nothing
    cut = tmp_path / "cut.gguf"
    header_taken = []
    for end in range(25, data_end, 5):
        cut.write_bytes(whole[:end])
        with pytest.raises(HeaderError):
            read_gguf(cut, end)
        assert outcome(theirs, cut) == "refused", f"the reader took the file cut at {end}"
        if outcome(ours, cut) != "refused":
            header_taken.append(end)
    # The parse takes a cut file only once its header is whole: every cut from some point on.
    assert header_taken and header_taken == list(range(header_taken[0], data_end, 5))
    assert ours(files["rich"])[-1] - header_taken[0] < 64  # within the alignment's padding of the data


@pytest.mark.parametrize("was, now, words", [
    (b"\x01\x00\x00\x00\x00\x00\x00\x00b", b"\x01\x00\x00\x00\x00\x00\x00\x00a", "duplicated tensor"),
    (b"tokenizer.ggml.scores", b"tokenizer.ggml.tokens", "twice")])  # names of the same length
def test_a_tensor_or_a_key_twice_is_refused(files: dict[str, Path], tmp_path: Path, was: bytes, now: bytes,
                                            words: str) -> None:
    whole = files["rich"].read_bytes()
    assert whole.count(was) == 1
    twice = tmp_path / "twice.gguf"
    twice.write_bytes(whole.replace(was, now))
    with pytest.raises(ValueError, match=words):
        ours(twice)
    assert outcome(theirs, twice) == "refused"


def test_a_value_read_as_a_file_sized_array_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """llama.block_count (read, for the KV cache) as an array of a million values: refused by its
    count, not turned into a list as large as the file."""
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "big.gguf"), "llama")
    w.add_array("llama.block_count", [1] * 1_000_000)
    w.add_tensor("a", np.zeros(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "big.gguf"
    with pytest.raises(HeaderError, match="at most 65,536 are read"):
        read_gguf(path, path.stat().st_size)
