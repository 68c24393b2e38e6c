"""fleet's JSON Schemas (fleet.yaml, an agent's state, a saved plan, the error document), found in
the installed package or the source tree, and the one validator class every one of them is checked
with. Used by the fleet file, the agent client, the saved-plan check and the caches alike."""

from __future__ import annotations

import json
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError
# jsonschema (~60 ms of start-up) and fastjsonschema are imported where a document is checked: a
# fleet file validated before (cache/desired.py) and an agent's unchanged state (a 304) check nothing.


def schema_path(name: str) -> Path:
    """Where a schema file lives: inside the installed package, or in the source tree's schemas/."""
    packaged = resources.files("reconciler").joinpath("_schemas", name)
    if packaged.is_file():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "schemas" / name


@cache
def load_schema(name: str = "fleet.schema.json") -> dict[str, Any]:
    schema: dict[str, Any] = json.loads(schema_path(name).read_text(encoding="utf-8"))
    return schema


@cache
def _python_regex(pattern: str) -> re.Pattern[str]:
    return re.compile(re.sub(r"(?<!\\)\$", r"\\Z", pattern))


def _ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[ValidationError]:
    r"""`pattern` as JSON Schema means it (ECMA-262: `$` is the end of the string). jsonschema hands
    it to Python's re, where `$` also matches before a final newline (a digest with a newline
    after it passed); fastjsonschema reads `$` as \Z, and so does this: both validators agree."""
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _python_regex(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


@cache
def _validator_class() -> type[Draft202012Validator]:
    from jsonschema import Draft202012Validator, validators

    return validators.extend(Draft202012Validator, {"pattern": _ecma_pattern})  # type: ignore[no-any-return,no-untyped-call]


def Validator(schema: dict[str, Any]) -> Draft202012Validator:
    """The generic validator for every schema of fleet's (fleet.yaml, agent state, plan files); named
    like the class it builds, which it was before jsonschema was imported only where used."""
    return _validator_class()(schema)
