"""What the control plane and the agent both ask of this machine's operating system: helpers too
low-level for `wire` (which stays pure), imported by `reconciler` and `agent` alike, importing
neither (tests/unit/test_boundaries.py)."""
