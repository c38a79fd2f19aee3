"""kvscope's own version, as every result file records it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def kvscope_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    try:
        return version("kvscope")
    except PackageNotFoundError:
        return "unknown"
