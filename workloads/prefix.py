"""Longest common prefixes and the transition they imply: one implementation for every layer.

Agent sessions resend an ever-growing history, so "how much of the previous prompt does this one share" is
asked everywhere: by the generator and the importers (to label a request's ``transition``), by the hashers (to
reuse the hashes of a shared prefix) and by the cache simulator (to reuse the blocks of a shared prefix).
The inputs come in two shapes, and each gets the fast path it allows:

* numpy arrays (token ids, block ids): one vectorised comparison (``np.flatnonzero`` of the mismatch mask);
* Python lists (chained hashes, often sharing the very same int objects): one C-level slice comparison for
  the common "b extends a" case, else a binary search over slice equality.

``classify_transition`` is the one rule that turns a common prefix into ``first``/``append``/``edit``/
``reset``/``compaction`` (docs/workloads.md); token traces and block-id traces differ only in how much of
the parent's end may change and still count as an append (``append_slack``).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Collection, Sequence

import numpy as np

#: vLLM's default KV block size in tokens (GPU): the granularity prefixes are hashed, cached and compared at
#: wherever neither the server nor the trace says another.  Here, in the lowest layer, because the trace
#: statistics need it as much as the cache model does.
DEFAULT_BLOCK_SIZE = 16



class Transition(StrEnum):
    """How a request's prompt relates to its session parent's: the one vocabulary of the trace's ``transition``
    column, which generators, importers and the recorder write and the trace reader, the statistics and the
    cache-break attribution read. A ``StrEnum`` so a member *is* its on-disk string (Parquet cells, JSON keys
    and comparisons with plain strings stay as they were)."""

    FIRST = "first"  # the session's first request: no parent
    APPEND = "append"  # the parent's prompt (and answer) unchanged, new content after it
    EDIT = "edit"  # at least half of the parent's prompt kept, something in it changed
    RESET = "reset"  # less than half kept
    COMPACTION = "compaction"  # the history policy replaced the history by a summary


def common_prefix_len(a: Sequence | np.ndarray, b: Sequence | np.ndarray) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (vectorised when either is an array)."""
    m = min(len(a), len(b))
    if m == 0:
        return 0
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        diff = np.flatnonzero(np.asarray(a[:m]) != np.asarray(b[:m]))
        return int(diff[0]) if len(diff) else m
    if a[:m] == b[:m]:
        return m
    lo, hi = 0, m - 1  # answer in [lo, hi]; a[:lo] == b[:lo] holds, a[:m] != b[:m]
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def leading_run(keys: Sequence, present: Collection, *, chained: bool = False) -> int:
    """Length of the leading run of ``keys`` found in ``present`` (a cache lookup stops at the first miss).

    With ``chained`` the caller promises membership is monotone along ``keys`` (chained ids in a cache that
    never evicts: an id stands for its whole prefix), and a binary search finds the boundary; otherwise one
    C-level scan (``map`` of ``__contains__``), which is also right for pools that evict inner blocks.
    """
    if chained:
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if keys[mid] in present:
                lo = mid + 1
            else:
                hi = mid
        return lo
    flags = list(map(present.__contains__, keys))
    try:
        return flags.index(False)
    except ValueError:
        return len(flags)


def classify_transition(common: int, parent_len: int, *, hint: str | None = None, append_slack: int = 0
                        ) -> Transition:
    """Transition of a prompt relative to its parent's: ``append`` when at most ``append_slack`` units of the
    parent's end are not shared (tokens: 0; block ids: 1, a re-rendered last block), ``edit`` when at least
    half of the parent is shared, else ``reset``; a ``compaction`` hint from the history policy wins."""
    if hint == Transition.COMPACTION:
        return Transition.COMPACTION
    if parent_len - common <= append_slack:
        return Transition.APPEND
    return Transition.EDIT if common * 2 >= parent_len else Transition.RESET


def transition_from(parent: Sequence | np.ndarray | None, child: Sequence | np.ndarray, *,
                    hint: str | None = None, append_slack: int = 0) -> Transition:
    """:func:`classify_transition` of ``child`` against ``parent`` (``first`` when there is none)."""
    if parent is None:
        return Transition.FIRST
    return classify_transition(common_prefix_len(parent, child), len(parent), hint=hint, append_slack=append_slack)
