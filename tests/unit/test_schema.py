"""The JSON Schema is itself valid, documented, and agrees with an independent validator."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

from jsonschema import Draft202012Validator

from reconciler.schemas import load_schema
from tests.conftest import ROOT

SCHEMA = ROOT / "schemas" / "fleet.schema.json"


def test_schema_is_valid_2020_12() -> None:
    schema = load_schema()
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    Draft202012Validator.check_schema(schema)


def _properties(node: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    if isinstance(node, dict):
        for name, sub in node.get("properties", {}).items():
            yield f"{path}.{name}", sub
        for key, sub in node.items():
            yield from _properties(sub, f"{path}/{key}")
    elif isinstance(node, list):
        for i, sub in enumerate(node):
            yield from _properties(sub, f"{path}[{i}]")


def test_every_field_has_a_description() -> None:
    schema = load_schema()
    missing = [path for path, sub in _properties(schema)
               if "description" not in sub and "description" not in
               schema["$defs"].get(sub.get("$ref", "").removeprefix("#/$defs/"), {})]
    assert missing == []


def test_objects_reject_unknown_fields() -> None:
    schema = load_schema()
    for name in ("node", "model", "cluster", "settings", "speculative"):
        assert schema["$defs"][name]["additionalProperties"] is False, name
    assert schema["additionalProperties"] is False


def test_example_names_the_schema_for_editors() -> None:
    first = (ROOT / "fleet.yaml.example").read_text().splitlines()[0]
    assert first == "# yaml-language-server: $schema=./schemas/fleet.schema.json"


def _check_jsonschema() -> str:
    exe = Path(sys.executable).parent / "check-jsonschema"
    found = str(exe) if exe.exists() else shutil.which("check-jsonschema")
    assert found, "check-jsonschema is a test dependency: pip install -e '.[dev]'"
    return found


def test_independent_validator_accepts_the_example_and_the_schema() -> None:
    tool = _check_jsonschema()
    meta = subprocess.run([tool, "--check-metaschema", str(SCHEMA)], capture_output=True, text=True)
    assert meta.returncode == 0, meta.stdout + meta.stderr
    proc = subprocess.run([tool, "--default-filetype", "yaml", "--schemafile", str(SCHEMA),
                           str(ROOT / "fleet.yaml.example")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_independent_validator_rejects_schema_mistakes() -> None:
    """Each broken example is rejected, each named with its error (one run over the five: a run of
    check-jsonschema costs half a second to start)."""
    files = [ROOT / "examples" / "broken" / f"{name}.yaml"
             for name in ("unknown-field", "bad-digest", "wrong-type", "window-format", "missing-field")]
    proc = subprocess.run([_check_jsonschema(), "--schemafile", str(SCHEMA), *map(str, files)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert [f.name for f in files if f"{f}::$" not in proc.stdout] == [], proc.stdout + proc.stderr
