"""A saved plan file (`fleet apply PLANFILE`): checked before anything runs (schemas/plan.schema.json,
its references, its dependency graph), then compared field by field with a fresh plan."""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any, Collection

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, best_match

from reconciler.core.diagnostics import Diagnostic, error, format_path
from reconciler.planning.plan import Change, Plan
from reconciler.schemas import Validator, load_schema

REMAKE = "Make a new plan: fleet plan -o FILE"
_TYPES = {"object": "a mapping", "array": "a list", "string": "a string", "integer": "an integer",
          "number": "a number", "boolean": "true or false", "null": "null"}


@cache
def _validator() -> Draft202012Validator:
    return Validator(load_schema("plan.schema.json"))


@cache
def _fast() -> tuple[Any, dict[str, Any]]:
    """The plan schema compiled to Python (fastjsonschema), as the fleet file's is: the plan without
    its changes' details, and one validator a change for each action, its `allOf` branch (`if
    action is X then ...`) taken from the schema file. The generic validator took ~1 ms a change
    (20,000 changes: 20 s before the lock), and fastjsonschema over the whole plan a fifth of that
    (each `if` that fails formats an exception); the generic one runs only on what these refuse."""
    import fastjsonschema

    root = copy.deepcopy(load_schema("plan.schema.json"))
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "$defs": root["$defs"]}
    item = root["properties"]["changes"]["items"]
    branches = item.pop("allOf")
    by_action = {}
    for action in item["properties"]["action"]["enum"]:
        then = [b["then"] for b in branches if b["if"]["properties"]["action"].get("const") == action]
        by_action[action] = fastjsonschema.compile({**draft7, **item, "allOf": then})
    root["properties"]["changes"]["items"] = {"type": "object", "required": ["action"],
                                              "properties": {"action": item["properties"]["action"]}}
    return fastjsonschema.compile({**root, **draft7}), by_action


def _schema_errors(data: Any) -> list[ValidationError]:
    """Every schema error of a saved plan, by JSON path: the generic validator's, but it looks only
    at the plan without its changes and at the changes the compiled validators refused."""
    from fastjsonschema import JsonSchemaException

    whole, by_action = _fast()
    try:
        whole(data)
    except JsonSchemaException:
        return sorted(_validator().iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    refused = []
    for i, change in enumerate(data["changes"]):
        try:
            by_action[change["action"]](change)
        except JsonSchemaException:
            refused.append(i)
    if not refused:
        return []
    root = load_schema("plan.schema.json")
    one = _validator().evolve(schema={**root["properties"]["changes"]["items"], "$defs": root["$defs"]})
    errors = []
    for i in refused:
        for err in one.iter_errors(data["changes"][i]):
            err.path.extendleft((i, "changes"))  # as if found in the whole plan (relative_path is a deque)
            errors.append(err)
    return sorted(errors, key=lambda e: [str(p) for p in e.absolute_path])


def check(data: Any, nodes: Collection[str] | None) -> list[Diagnostic]:
    """Every problem of a saved plan's JSON, each with a stable code and its JSON path as address;
    [] when it is a plan whose changes can be run at all (whether they should is `differences`).
    `nodes` are the nodes the fleet file declares (None: not checked)."""
    errors = _schema_errors(data)
    if errors:
        return list(dict.fromkeys(_schema_error(e) for e in errors))  # one per missing field says them all
    changes: list[dict[str, Any]] = data["changes"]
    return _refused(data) or _references(changes, nodes) or _cycles(changes)


def _refused(data: dict[str, Any]) -> list[Diagnostic]:
    """A plan that was refused when it was made (a plan error: `errored`, or an error among its
    diagnostics) is never applied, even where a fresh plan has the same changes: what refused it
    was judged against that plan, and a hand-edited `errored` is no fix."""
    errors = [d for d in data["diagnostics"] if isinstance(d, dict) and d.get("severity") == "error"]
    if not data["errored"] and not errors:
        return []
    said = f": {errors[0].get('code')} ({errors[0].get('summary')})" if errors else ""
    if len(errors) > 1:
        said += f" and {len(errors) - 1} more"
    return [error("plan_errored", "the saved plan was refused when it was made" + (said or " (errored: true)"),
                  "A refused plan is never applied. Fix what refused it, then make a new plan: fleet plan -o FILE",
                  address="errored" if data["errored"] else "diagnostics")]


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _schema_error(err: ValidationError) -> Diagnostic:
    if err.validator in ("anyOf", "oneOf") and err.context:
        err = best_match(err.context)
    path = tuple(err.absolute_path)
    where = format_path(path) or "the plan's top level"
    value: Any = err.validator_value
    instance = err.instance
    if err.validator == "required" and isinstance(instance, dict):
        missing = [k for k in value if k not in instance]
        summary = f"{where} is missing the required field{'s' if len(missing) > 1 else ''} " + \
            ", ".join(repr(k) for k in missing)
    elif err.validator == "additionalProperties" and isinstance(instance, dict):
        known = set(err.schema.get("properties", {})) if isinstance(err.schema, dict) else set()
        extra = [k for k in instance if k not in known]
        summary = f"unknown field{'s' if len(extra) > 1 else ''} {', '.join(repr(k) for k in extra)} in {where}"
    elif err.validator == "type":
        names = [_TYPES.get(t, str(t)) for t in (value if isinstance(value, list) else [value])]
        summary = f"{where} must be {' or '.join(names)}, not {_show(instance)}"
    elif err.validator in ("const", "enum"):
        options = [value] if err.validator == "const" else list(value)
        summary = f"{where} must be {' or '.join(json.dumps(o) for o in options)}, not {_show(instance)}"
    elif err.validator == "pattern":
        summary = f"{where}: {_show(instance)} is not valid here"
    else:
        summary = f"{where}: {err.message}"
    detail = err.schema.get("description", "") if isinstance(err.schema, dict) else ""
    return error("schema_violation", summary, str(detail), address=format_path(path))


def _references(changes: list[dict[str, Any]], nodes: Collection[str] | None) -> list[Diagnostic]:
    """Each change on a declared node, fetching from a declared node, once, and depending only on
    other changes of the plan."""
    diags: list[Diagnostic] = []
    first: dict[str, int] = {}
    for i, c in enumerate(changes):
        if c["address"] in first:
            diags.append(error("duplicate_change", f"change {c['address']} is in the plan twice (changes[{first[c['address']]}] "
                               f"and changes[{i}])", REMAKE, address=f"changes[{i}].address"))
        first.setdefault(c["address"], i)
    declared = f"Declared nodes: {', '.join(sorted(nodes or ())) or 'none'}. {REMAKE}"
    for i, c in enumerate(changes):
        peer = c["details"].get("peer")
        if nodes is not None and c["node"] not in nodes:
            diags.append(error("unknown_node", f"change {c['address']} is on node {c['node']!r}, which the fleet file "
                               "does not declare", declared, address=f"changes[{i}].node"))
        if nodes is not None and peer is not None and peer not in nodes:
            diags.append(error("unknown_node", f"change {c['address']} fetches from node {peer!r}, which the fleet "
                               "file does not declare", declared, address=f"changes[{i}].details.peer"))
        for j, dep in enumerate(c["depends_on"]):
            if dep == c["address"]:
                diags.append(error("dependency_cycle", f"change {c['address']} depends on itself: it could never "
                                   "run", REMAKE, address=f"changes[{i}].depends_on[{j}]"))
            elif dep not in first:
                diags.append(error("unknown_dependency", f"change {c['address']} depends on {dep}, which is not a "
                                   "change of this plan", REMAKE, address=f"changes[{i}].depends_on[{j}]"))
    return diags


def _cycles(changes: list[dict[str, Any]]) -> list[Diagnostic]:
    """A dependency cycle (the executor would wait on it forever), named change by change."""
    cycle, _ = dependency_cycle(changes)
    if not cycle:
        return []
    index = next(i for i, c in enumerate(changes) if c["address"] == cycle[0])
    return [error("dependency_cycle", "the changes depend on each other in a cycle: " + " → ".join(cycle),
                  f"None of them could ever run. {REMAKE}", address=f"changes[{index}].depends_on")]


def dependency_cycle(changes: list[dict[str, Any]]) -> tuple[list[str], int]:
    """A cycle among the changes' dependencies ([] if none: they can all run), and the steps it took,
    linear in the changes and their dependencies (Kahn's order, then one walk): the check before
    the lock was quadratic (a round per change of a chain: 20,000 changes took over 120 s).
    The cycle starts at its least address and is closed (`a → b → a`)."""
    steps = 0
    deps = {c["address"]: set(c["depends_on"]) for c in changes}
    waiting_on = {a: len(ds & deps.keys()) for a, ds in deps.items()}
    needed_by: dict[str, list[str]] = {}
    for a, ds in deps.items():
        for d in ds:
            steps += 1
            if d in deps:
                needed_by.setdefault(d, []).append(a)
    ready = [a for a, n in waiting_on.items() if n == 0]
    while ready:
        steps += 1
        for after in needed_by.get(ready.pop(), ()):
            steps += 1
            waiting_on[after] -= 1
            if waiting_on[after] == 0:
                ready.append(after)
    left = {a for a, n in waiting_on.items() if n > 0}
    if not left:
        return [], steps
    # Every change left waits on another one left: walking from any of them comes back round.
    seen: dict[str, int] = {}
    walk = [min(left)]
    while walk[-1] not in seen:
        steps += 1
        seen[walk[-1]] = len(walk) - 1
        walk.append(min(deps[walk[-1]] & left))
    cycle = walk[seen[walk[-1]]:]
    first = cycle.index(min(cycle[:-1]))
    return cycle[first:-1] + cycle[:first] + [cycle[first]], steps


def differences(saved: Plan, fresh: Plan) -> list[Diagnostic]:
    """What makes the saved plan's changes other than a fresh plan's (everything the executor would
    do, their order, and their reasons): each a stale_plan diagnostic at the change's address."""
    theirs = {c.address: c for c in fresh.changes}
    mine = {c.address for c in saved.changes}
    out: list[Diagnostic] = []
    for c in saved.changes:
        f = theirs.get(c.address)
        if f is None:
            out.append(error("stale_plan", f"change {c.action.value} {c.address} in the saved plan is not in a fresh "
                             "plan", REMAKE, address=c.address))
            continue
        for what in _fields(c, f):
            out.append(error("stale_plan", f"change {c.address}: {what}", REMAKE, address=c.address))
    for f in fresh.changes:
        if f.address not in mine:
            out.append(error("stale_plan", f"a fresh plan has change {f.action.value} {f.address}, which the saved "
                             f"plan does not ({f.reason})", REMAKE, address=f.address))
    if not out and [c.address for c in saved.changes] != [c.address for c in fresh.changes]:
        out.append(error("stale_plan", "the saved plan's changes are in another order than a fresh plan's",
                         REMAKE))
    return out


def _fields(saved: Change, fresh: Change) -> list[str]:
    out = []
    for name in ("action", "node", "depends_on", "drift", "reason"):
        a, b = getattr(saved, name), getattr(fresh, name)
        a, b = (a.value, b.value) if name == "action" else (list(a), list(b)) if name == "depends_on" else (a, b)
        if a != b:
            out.append(f"{name} differs (saved {_show(a)}, fresh {_show(b)})")
    # A replication's estimate moves with every fetch measured: not a reason to make the plan again
    # (a fresh estimate past the window is a plan error of its own).
    out += [f"details{path} differs (saved {_show(a)}, fresh {_show(b)})"
            for path, a, b in _diff({**saved.details, "estimate": None}, {**fresh.details, "estimate": None}, "")]
    return out


_ABSENT = "(absent)"


def _diff(a: Any, b: Any, path: str) -> list[tuple[str, Any, Any]]:
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(a.keys() | b.keys(), key=str)
                for d in _diff(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _diff(x, y, f"{path}[{i}]")]
    # 300 and 300.0 are one value to the executor (JSON makes no difference between them)
    same = a == b and type(a) is type(b) or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                             and not isinstance(a, bool) and not isinstance(b, bool) and a == b)
    return [] if same else [(path, a, b)]
