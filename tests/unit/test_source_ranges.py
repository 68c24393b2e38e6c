"""The ranges of a fleet file's values, worked out on first use, and the collector around reading."""

from __future__ import annotations

import gc

import pytest

from reconciler.fleetfile import config
from reconciler.agents.observe import kept_to_the_end
from reconciler.fleetfile.source import Document, parse

TRICKY = """\
base: &base {agent_port: 7071, labels: [a, b]}
nodes:
  n1:
    <<: *base
    address: 10.0.0.1
  n2: {<<: [{agent_port: 7072}, *base], address: 10.0.0.2}
list:
  - x
  - {k: v, k2: [1, 2]}
  - *base
dup: {a: 1, a: 2}
"""


def parsed(text: str) -> Document:
    doc, _ = parse(text, "t.yaml")
    assert doc is not None
    return doc


def at(doc: Document, *path: str | int, key: bool = False) -> tuple[int, int, int, int]:
    r = doc.range(path, key=key)
    assert r is not None and r.filename == "t.yaml"
    return r.start.line, r.start.column, r.end.line, r.end.column


# Taken from the reader before ranges were worked out on first use (it recorded them as it built
# the values): the same for these and for every golden case's fleet.yaml.
@pytest.mark.parametrize(("path", "key", "expected"), [
    (("nodes", "n1", "address"), False, (5, 14, 5, 22)),
    (("nodes", "n1", "address"), True, (5, 5, 5, 12)),
    # A merged value keeps the place it was written: the anchor's mapping.
    (("nodes", "n1", "agent_port"), False, (1, 26, 1, 30)),
    (("nodes", "n1", "labels", 1), False, (1, 44, 1, 45)),
    # Of two merged mappings the earlier wins, and so does the place of its value.
    (("nodes", "n2", "agent_port"), False, (6, 26, 6, 30)),
    (("list", 1, "k2", 0), False, (9, 17, 9, 18)),
    (("list", 2, "agent_port"), False, (1, 26, 1, 30)),
    # The first of two duplicate keys is the one kept, and its value's place.
    (("dup", "a"), False, (11, 10, 11, 11)),
    # A path that is not there: its nearest enclosing value.
    (("nodes", "n3", "address"), False, (3, 3, 7, 1)),
])
def test_ranges_are_where_the_values_and_keys_are_written(path: tuple[str | int, ...], key: bool,
                                                           expected: tuple[int, int, int, int]) -> None:
    assert at(parsed(TRICKY), *path, key=key) == expected


def test_the_tables_match_the_ranges_and_are_worked_out_once() -> None:
    doc = parsed(TRICKY)
    marks = doc.marks
    assert doc.marks is marks and doc.key_marks is doc.key_marks
    assert marks[("list", 0)][0].line == 8 and doc.key_marks[("dup", "a")][0].column == 7
    # Every value built has a range, and nothing else does.
    def paths(value: object, path: tuple[str | int, ...]) -> set[tuple[str | int, ...]]:
        out = {path}
        if isinstance(value, dict):
            for k, v in value.items():
                out |= paths(v, path + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                out |= paths(v, path + (i,))
        return out
    assert set(marks) == paths(doc.data, ())


def test_an_error_in_a_valid_looking_file_points_at_its_place() -> None:
    text = "version: 1\ncontrol_plane: {node: cp}\nnodes:\n  cp: {address: 127.0.0.1, agent_port: many}\n"
    loaded = config.load_text(text, "t.yaml")
    (diag,) = [d for d in loaded.diagnostics if d.code == "schema_violation"]
    assert diag.range is not None
    assert (diag.range.start.line, diag.range.start.column) == (4, 40)  # `many`


@pytest.mark.parametrize("enabled", [True, False])
def test_reading_leaves_the_collector_as_it_found_it(enabled: bool) -> None:
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        parsed(TRICKY)
        assert gc.isenabled() is enabled
        assert parse("a: [\n", "t.yaml")[0] is None  # a syntax error on the way out too
        assert gc.isenabled() is enabled
    finally:
        gc.enable() if was else gc.disable()


def test_a_one_shot_observation_is_frozen_and_the_collector_runs_again() -> None:
    before = gc.get_freeze_count()
    try:
        with kept_to_the_end():
            assert not gc.isenabled()
            kept = [{"state": i} for i in range(1000)]
        assert gc.isenabled()
        assert gc.get_freeze_count() >= before + len(kept)
    finally:
        gc.unfreeze()
