"""kvscope's own version, as every result file records it."""

from __future__ import annotations


def kvscope_version() -> str:
    """The installed distribution's version ("unknown" when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvscope")
    except PackageNotFoundError:
        return "unknown"
