"""Property: whatever is done to a valid fleet file, validate answers 0 or 3 with placed diagnostics."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastjsonschema

from reconciler.cli import main as cli
from reconciler.fleetfile import config, schema
from tests.conftest import ROOT

EXAMPLE_TEXT = (ROOT / "fleet.yaml.example").read_text()
EXAMPLE = yaml.safe_load(EXAMPLE_TEXT)

JUNK = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                 st.text(max_size=20), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


PATHS = _paths(EXAMPLE)[1:]


@st.composite
def mutated_data(draw: st.DrawFn) -> str:
    import copy

    data = copy.deepcopy(EXAMPLE)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent: Any = data
        try:
            for part in path[:-1]:
                parent = parent[part]
            op = draw(st.sampled_from(["delete", "replace", "rename"]))
            if op == "delete":
                del parent[path[-1]]
            elif op == "replace":
                parent[path[-1]] = draw(JUNK)
            elif isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = parent.pop(path[-1])
        except (KeyError, IndexError, TypeError):
            pass  # an earlier mutation removed or retyped this path
    return yaml.safe_dump(data, sort_keys=False)


@st.composite
def mutated_text(draw: st.DrawFn) -> bytes:
    raw = EXAMPLE_TEXT.encode()
    op = draw(st.sampled_from(["truncate", "insert", "overwrite"]))
    at = draw(st.integers(0, len(raw)))
    if op == "truncate":
        return raw[:at]
    junk = draw(st.binary(min_size=1, max_size=8) | st.sampled_from([b"\t", b":", b"- ", b"{", b"&a", b"*a", b"\n  "]))
    return raw[:at] + junk + raw[at + (len(junk) if op == "overwrite" else 0):]


def _check(tmp: Path, content: bytes) -> None:
    f = tmp / "fleet.yaml"
    f.write_bytes(content)
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.run(["validate", "-f", str(f)])
    assert code in (0, 3), err.getvalue()
    assert "Traceback" not in err.getvalue()
    loaded = config.load(f)
    assert (code == 0) == loaded.ok
    if loaded.document is not None:  # the compiled fast path agrees with the 2020-12 validator
        try:
            schema._fast()(loaded.document.data)
            fast_ok = True
        except fastjsonschema.JsonSchemaException:
            fast_ok = False
        assert fast_ok == (not list(schema._validator().iter_errors(loaded.document.data)))
    for d in loaded.diagnostics:
        assert d.code and d.summary
        assert d.range is not None, d  # a mutated file always has text to point into
        assert d.range.start.line >= 1 and d.range.start.column >= 1


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=mutated_data())
def test_structural_mutations(tmp_path: Path, content: str) -> None:
    _check(tmp_path, content.encode())


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=mutated_text())
def test_byte_mutations(tmp_path: Path, content: bytes) -> None:
    _check(tmp_path, content)
