"""fleet: a declarative reconciler for fleets of GPU inference machines (the control plane)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fleet")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
