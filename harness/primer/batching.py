"""Static vs continuous batching in decode steps (one token per active slot per step)."""

from __future__ import annotations

import heapq
import random
from typing import Sequence


def seed_output_lengths(n: int = 32, lo: int = 5, hi: int = 100, seed: int = 1) -> list[int]:
    """The seed document's lengths: ``random.seed(seed); [random.randint(lo, hi) for _ in range(n)]``."""
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def static_batching_steps(lengths: Sequence[int], slots: int) -> int:
    """Each batch of ``slots`` requests lasts as long as its longest request."""
    return sum(max(lengths[i:i + slots]) for i in range(0, len(lengths), slots))


def continuous_batching_steps(lengths: Sequence[int], slots: int) -> int:
    """Each request goes to the slot that frees first; the makespan in steps."""
    heap = [0] * slots
    for n in lengths:
        heapq.heapreplace(heap, heap[0] + n)
    return max(heap)


def lower_bound_steps(lengths: Sequence[int], slots: int) -> float:
    return sum(lengths) / slots


def compare(lengths: Sequence[int], slots: int) -> dict:
    return {
        "tokens": sum(lengths),
        "slots": slots,
        "static_steps": static_batching_steps(lengths, slots),
        "continuous_steps": continuous_batching_steps(lengths, slots),
        "lower_bound_steps": lower_bound_steps(lengths, slots),
    }
