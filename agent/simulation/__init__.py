"""Agents without machines, for benches and tests: many simulated agents in one process
(`simulate`, on net's server) and tiny real models (`testmodel`)."""
