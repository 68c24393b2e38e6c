"""fleet-agent: runs on every machine that computes; reports what it has, does what it is told."""

from wire import __version__

__all__ = ["__version__"]
