"""fleet.yaml checked against its JSON Schema, and the errors turned into diagnostics addressed by YAML path."""

from __future__ import annotations

import copy
import difflib
import json
import re
from functools import cache
from typing import TYPE_CHECKING, Any, Iterator

from reconciler.core.diagnostics import Diagnostic, error, format_path
from reconciler.fleetfile.source import Document
from reconciler.schemas import Validator, load_schema

if TYPE_CHECKING:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import ValidationError

_TYPE_NAMES = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
               "number": "a number", "boolean": "true or false", "null": "empty"}


@cache
def _validator() -> Draft202012Validator:
    return Validator(load_schema())


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "empty"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return f"the string {shown!r}"
    return f"{type(value).__name__} {value!r}"


def _resolve(subschema: Any) -> dict[str, Any]:
    root = load_schema()
    while isinstance(subschema, dict) and "$ref" in subschema and "description" not in subschema:
        ref = subschema["$ref"]
        if not ref.startswith("#/$defs/"):
            break
        subschema = root["$defs"][ref.removeprefix("#/$defs/")]
    return subschema if isinstance(subschema, dict) else {}


def _description(err: ValidationError) -> str:
    e: Any = err  # jsonschema types a parent as its own private error class
    while e is not None:
        desc = _resolve(e.schema).get("description")
        if desc:
            return str(desc)
        e = e.parent
    return ""


@cache
def _fast() -> Any:
    """The schema compiled to Python (fastjsonschema): the fast path for valid files, which at
    thousands of nodes is most of `fleet plan`'s start. Its keywords mean the same in draft 7;
    on any failure the generic 2020-12 validator below finds and explains every error."""
    import fastjsonschema

    return fastjsonschema.compile({**copy.deepcopy(load_schema()), "$schema": "http://json-schema.org/draft-07/schema#"})


def validate(doc: Document) -> list[Diagnostic]:
    from fastjsonschema import JsonSchemaException

    try:
        _fast()(doc.data)
        return []
    except JsonSchemaException:
        pass
    from jsonschema.exceptions import best_match  # only a file with errors pays for jsonschema

    diags: list[Diagnostic] = []
    for err in sorted(_validator().iter_errors(doc.data), key=lambda e: [str(p) for p in e.absolute_path]):
        if err.validator in ("oneOf", "anyOf") and err.context and isinstance(err.instance, (dict, list)):
            # A mapping or list took the structured branch (e.g. {node, layers}): report why that
            # branch failed, not that "it is not a string either".
            relevant = [e for e in err.context if e.validator != "type"]
            if relevant:
                err = best_match(relevant)
        diags.extend(_translate(doc, err))
    return diags


def _translate(doc: Document, err: ValidationError) -> list[Diagnostic]:
    path = tuple(err.absolute_path)
    where = format_path(path) or "the top level"
    instance = err.instance
    detail = _description(err)
    kind = err.validator
    value: Any = err.validator_value  # what the failing keyword asked for (the stubs say it may be unset)

    if kind == "additionalProperties" and isinstance(instance, dict):
        allowed = sorted(_resolve(err.schema).get("properties", {}))
        out = []
        for key in instance:
            if key in allowed:
                continue
            close = difflib.get_close_matches(key, allowed, n=1)
            hint = f"Did you mean {close[0]!r}? " if close else ""
            out.append(error("schema_violation", f"unknown field {key!r} in {where}",
                             f"{hint}Allowed here: {', '.join(allowed)}.",
                             address=format_path(path + (key,)),
                             range=doc.range(path + (key,), key=True)))
        return out
    if kind == "required" and isinstance(instance, dict):
        props = _resolve(err.schema).get("properties", {})
        out = []
        for key in value:
            if key in instance:
                continue
            field_desc = _resolve(props.get(key, {})).get("description", "")
            out.append(error("schema_violation", f"{where} is missing the required field {key!r}",
                             field_desc, address=format_path(path), range=doc.range(path, key=True)))
        return out
    if kind == "propertyNames":
        # jsonschema reports the offending key as the instance, at the mapping's path.
        key = str(instance)
        return [error("schema_violation", f"{key!r} is not a valid name in {where}", _description(err)
                      or "Names are 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit.",
                      address=format_path(path + (key,)), range=doc.range(path + (key,), key=True))]
    if kind == "type":
        names = [_TYPE_NAMES.get(t, str(t)) for t in (value if isinstance(value, list) else [value])]
        summary = f"{where} must be {' or '.join(names)}, not {_describe(instance)}"
    elif kind in ("const", "enum"):
        options = [value] if kind == "const" else list(value)
        summary = f"{where} must be {' or '.join(json.dumps(o) for o in options)}, not {_describe(instance)}"
    elif kind in ("pattern", "anyOf", "oneOf", "format"):
        summary = f"{where}: {_describe(instance)} is not valid here"
    elif kind in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        bound = {"minimum": "at least", "maximum": "at most", "exclusiveMinimum": "more than",
                 "exclusiveMaximum": "less than"}[kind]
        summary = f"{where} must be {bound} {value}, not {instance!r}"
    elif kind in ("minItems", "minProperties"):
        summary = f"{where} must not be empty"
    elif kind in ("minLength", "maxLength", "maxItems"):
        summary = f"{where}: {err.message}"
    else:
        summary = f"{where}: {err.message}"
    return [error("schema_violation", summary, detail, address=format_path(path), range=doc.range(path))]
