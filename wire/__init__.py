"""fleet's shared contracts: the values and wire formats both the control plane and the agent speak.

Pure: imports neither `reconciler` nor `agent`, and no I/O library (tests/unit/test_boundaries.py)."""

# Written here, not looked up: importlib.metadata.version scans sys.path for dist-info on every
# command (~36 ms of CPU, --version included); pyproject.toml reads this line (hatch version).
__version__ = "0.1.0"

__all__ = ["__version__"]
