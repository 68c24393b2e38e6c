"""`fleet-agent convert` as a user runs it: a GGUF becomes the same weights as safetensors, with
tokenizer and chat template; refusals are one line and exit 3, leaving nothing behind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.conftest import fleet_bin
from tests.models import tiny_gguf, tiny_safetensors


def convert(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([fleet_bin("fleet-agent"), "convert", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.e2e  # loads transformers in a process of its own: seconds
def test_a_gguf_becomes_the_same_model_in_safetensors(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    out = tmp_path / "twin"
    done = convert(str(tiny_gguf(tmp_path / "src")), str(out), "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert "<|assistant|>" in ((out / "chat_template.jinja").read_text() if (out / "chat_template.jinja").exists()
                               else (out / "tokenizer_config.json").read_text())
    original = load_file(str(tiny_safetensors(tmp_path / "src") / "model.safetensors"))
    twin = load_file(str(out / "model.safetensors"))
    assert sorted(twin) == sorted(original)
    for name, tensor in original.items():  # Q and K rows come back from llama.cpp's order too
        assert (twin[name] == tensor).all(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".twin.")], "a work directory was left"


def unknown_architecture(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "no-such-arch")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("case", ["not-gguf", "missing", "out-not-empty",
                                  pytest.param("unknown-arch", marks=pytest.mark.e2e)])
def test_refusals_are_one_line_and_exit_3(tmp_path: Path, case: str) -> None:
    out = tmp_path / "out"
    src = tmp_path / "model.gguf"
    if case == "not-gguf":
        src.write_text("hello")
    elif case == "out-not-empty":
        src.write_bytes(b"GGUF")
        out.mkdir()
        (out / "keep").write_text("mine")
    elif case == "unknown-arch":
        unknown_architecture(src)
    done = convert(str(src), str(out))
    assert done.returncode == 3 and "Traceback" not in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("fleet-agent"), done.stderr
    expected = {"not-gguf": "is not a GGUF file", "missing": "is not a file", "out-not-empty": "already exists",
                "unknown-arch": "architecture 'no-such-arch' is not one transformers converts"}[case]
    assert expected in done.stderr
    assert (sorted(p.name for p in out.iterdir()) == ["keep"]) if case == "out-not-empty" else not out.exists()
