"""fleet: a declarative reconciler for fleets of GPU inference machines (the control plane)."""

from wire import __version__

__all__ = ["__version__"]
