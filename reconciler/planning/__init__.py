"""The pure planner: `plan(desired, observed)` and its parts (weights, fan-out chains, pipeline
groups, ordering, per-node notes, settings diffs), and the `Plan` it returns."""
