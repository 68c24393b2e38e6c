"""The saved plan's dependency check (reconciler/applying/planfile.dependency_cycle) does work
linear in its changes and their dependencies: counted steps, not time (bench/saved_plan.py times
it). Before, a chain of N changes took N rounds over every change left."""

from __future__ import annotations

from typing import Any

from reconciler.applying.planfile import dependency_cycle


def changes(deps: dict[str, list[str]]) -> list[dict[str, Any]]:
    return [{"address": a, "depends_on": d} for a, d in deps.items()]


def test_a_chain_of_20000_changes_is_ordered_in_linear_steps() -> None:
    n = 20_000
    chain = changes({f"c{i}": [f"c{i - 1}"] if i else [] for i in range(n)})
    cycle, steps = dependency_cycle(chain)
    assert cycle == [] and steps <= 3 * n


def test_a_cycle_through_20000_changes_is_found_in_linear_steps_and_named_from_its_least() -> None:
    n = 20_000
    ring = changes({f"c{i:05}": [f"c{(i + 1) % n:05}"] for i in range(n)})
    cycle, steps = dependency_cycle(ring)
    assert len(cycle) == n + 1 and cycle[0] == cycle[-1] == "c00000" and cycle[1] == "c00001"
    assert steps <= 3 * n


def test_a_cycle_behind_a_tail_is_the_cycle_alone() -> None:
    cycle, _ = dependency_cycle(changes({"a": ["b"], "b": ["c"], "c": ["d"], "d": ["c"], "e": []}))
    assert cycle == ["c", "d", "c"]


def test_dependencies_on_changes_outside_the_plan_do_not_block() -> None:
    cycle, _ = dependency_cycle(changes({"a": ["elsewhere"], "b": ["a"]}))
    assert cycle == []
