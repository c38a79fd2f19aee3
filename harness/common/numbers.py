"""Missing numbers at the edge of a result file: one rule for what counts as "no value".

Why one function: a mean over no finished request, a percentile of an empty column or a pandas cell with no
value all arrive as NaN (numpy's, Python's or pandas' ``NA``), and JSON has no NaN. Every writer of a result
file, finding or table cell turns them into ``None`` (``null``) the same way here, so a reader never meets a
NaN in one file and a ``null`` in the next for the same missing figure. No pandas import: the check works on
pandas' scalars without loading it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def nan_to_none(x: Any, cast: Callable[[Any], T] | None = None, *, infinite: bool = False) -> T | Any | None:
    """``None`` where ``x`` is a missing number (``None``, a NaN of any float type, pandas' ``NA``/``NaT``;
    with ``infinite=True`` also ±inf), else ``x`` — or ``cast(x)`` (``float``, ``int``: a plain Python number
    from a numpy or pandas scalar)."""
    if x is None:
        return None
    try:
        if x != x:  # noqa: PLR0124 -- NaN and NaT are the only scalars unequal to themselves
            return None
    except TypeError:  # pandas' NA: its comparisons are NA, whose truth value is undefined
        return None
    if infinite:
        try:
            if not math.isfinite(x):
                return None
        except TypeError:  # not a number (a string, a list): left as it is
            pass
    return x if cast is None else cast(x)


__all__ = ["nan_to_none"]
