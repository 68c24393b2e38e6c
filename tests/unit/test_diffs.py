"""Settings differences as the plan shows them: one line per leaf, by path (deepdiff underneath)."""

from __future__ import annotations

from typing import Any

import pytest

from reconciler.planning.diffs import settings_diff

CASES: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
    ("equal", {"context_length": 4096}, {"context_length": 4096}, []),
    ("scalar", {"context_length": 4096, "threads": 8}, {"context_length": 8192, "threads": 8},
     ["context_length 4096 → 8192"]),
    ("added and removed", {"threads": 8}, {"batch_size": 4}, ["batch_size unset → 4", "threads 8 → unset"]),
    ("nested by its path", {"speculative": {"mode": "draft", "tokens": 4}},
     {"speculative": {"mode": "draft", "tokens": 8}}, ["speculative.tokens 4 → 8"]),
    ("a nested mapping added, leaf by leaf", {}, {"speculative": {"mode": "ngram", "tokens": 8}},
     ["speculative.mode unset → ngram", "speculative.tokens unset → 8"]),
    ("a list item", {"stop": ["a", "b"]}, {"stop": ["a", "c", "d"]}, ["stop[1] b → c", "stop[2] unset → d"]),
    ("null is unset", {"threads": None}, {}, []),
    ("a type change says so", {"threads": 1}, {"threads": "1"}, ["threads 1 → '1'"]),
]


@pytest.mark.parametrize("old, new, lines", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_settings_diff(old: dict[str, Any], new: dict[str, Any], lines: list[str]) -> None:
    assert settings_diff(old, new) == lines
