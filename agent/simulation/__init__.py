"""Agents without machines, for benches and tests: many simulated agents in one process
(`simulate`, `simhttp`) and tiny real models (`testmodel`)."""
