"""The one percentile definition kvscope uses: numpy's default ``linear`` method (Hyndman & Fan's type 7).

Why one definition, and why this one. summary.json's latency figures (``latency.ttft_s.p50`` …), the early-stop
rule that reads them and the A/B engine's bootstrap all speak of "TTFT p50"; with two definitions (the A/B
engine once used the inverted CDF) ``ttft_p50_s`` was one number in the verdict table and another in the
stopping rule. summary.json has always been written with ``np.percentile``'s linear interpolation, so keeping
it leaves every result file as it was; the A/B engine's weighted percentiles follow it.

:func:`weighted_percentiles` is the bootstrap's form: a draw gives every sorted value an integer weight (how
often its unit was resampled), and the draw's percentile is :func:`percentiles` of the values repeated by their
weights, computed without repeating them. ``tests/test_ab.py`` checks that equality bit for bit, and
``tests/test_metric_identity.py`` that the A/B engine, the stopping rule and summary.json state one figure.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

#: numpy's name of the definition (``np.percentile(..., method=PERCENTILE_METHOD)``).
PERCENTILE_METHOD = "linear"


def percentiles(values: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """The percentiles ``qs`` (0-100) of ``values`` (no NaN), one per q."""
    return np.percentile(values, qs, method=PERCENTILE_METHOD)


#: Sorted values per block of the two-level search: the draws' cumulative weights are summed per block of this
#: many values, and only inside the block that holds a position cumulated value by value.
PERCENTILE_BLOCK = 64


def weighted_percentiles(sorted_values: np.ndarray, weights: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Per draw, the percentiles of the sorted values repeated by their integer weights: (len(qs), k).

    ``weights`` is (n, k): the weight of each sorted value in each of k draws (value-major, so a block of values
    is contiguous). A draw with total weight N has, as ``np.percentile`` would on its N repeated values, the
    virtual index h = (N - 1) q / 100 and the value ``lerp(x[floor h], x[floor h + 1], h - floor h)``, where
    x[i] (0-based, in the repeated values) is the smallest sorted value whose cumulative weight reaches i + 1.
    Those two positions are found in two levels instead of one cumulative sum over all n values per draw
    (numpy's cumulative sum is not vectorised): weights are summed per block of :data:`PERCENTILE_BLOCK`
    values (a vectorised reduction), the block holding each position is found on the block sums, and the values
    are cumulated only inside that block. Integer weights keep the sums exact. A draw of total weight 0 has no
    percentile (NaN)."""
    n, k = weights.shape
    q_frac = np.true_divide(np.asarray(qs, dtype=float), 100)
    block = PERCENTILE_BLOCK
    blocks = -(-n // block)
    padded = np.zeros((blocks * block, k), dtype=weights.dtype)
    padded[:n] = weights
    exact = np.int64 if padded.dtype.kind in "iu" else None
    cum_blocks = np.cumsum(padded.reshape(blocks, block, k).sum(axis=1, dtype=exact), axis=0)  # (blocks, k)
    total = cum_blocks[-1].astype(np.float64)  # (k,)
    virtual = (total - 1.0)[None, :] * q_frac[:, None]  # (Q, k), as numpy's linear method computes it
    previous = np.floor(virtual)
    gamma = virtual - previous
    last = total[None, :] - 1.0
    above = virtual >= last
    previous = np.where(above, last, np.maximum(previous, 0.0))
    following = np.where(above, last, previous + 1.0)
    # 1-based targets: the smallest sorted position whose cumulative weight reaches them
    targets = np.concatenate([previous, following]) + 1.0  # (2Q, k)
    in_block = np.minimum((cum_blocks[None, :, :] < targets[:, None, :]).sum(axis=1), blocks - 1)  # (2Q, k)
    draws = np.arange(k)
    before = np.where(in_block > 0, cum_blocks[np.maximum(in_block - 1, 0), draws[None, :]], 0)
    first = in_block * block
    inside = padded[first[:, :, None] + np.arange(block)[None, None, :], draws[None, :, None]]  # (2Q, k, block)
    reached = before[:, :, None] + np.cumsum(inside, axis=2) < targets[:, :, None]
    pos = np.clip(first + reached.sum(axis=2), 0, n - 1)
    values = sorted_values[pos]
    a, b = values[: len(q_frac)], values[len(q_frac):]
    out = _lerp(a, b, gamma)
    return np.where(total[None, :] > 0, out, np.nan)


def _lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between neighbours (``numpy.lib._function_base_impl._lerp``), operation for
    operation, so a weighted percentile equals ``np.percentile``'s to the last bit."""
    diff_b_a = b - a
    out = a + diff_b_a * t
    return np.where(t >= 0.5, b - diff_b_a * (1 - t), out)
