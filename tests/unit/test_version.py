"""The version fleet reports is the one its package was built with (pyproject reads wire/__init__.py)."""

from __future__ import annotations

import importlib.metadata

import wire


def test_the_installed_metadata_says_the_version_wire_says() -> None:
    assert importlib.metadata.version("inference-fleet") == wire.__version__
