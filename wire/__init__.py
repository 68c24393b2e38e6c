"""fleet's shared contracts: the values and wire formats both the control plane and the agent speak.

Pure: imports neither `reconciler` nor `agent`, and no I/O library (tests/unit/test_boundaries.py)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fleet")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
