"""Open-loop arrival times: the one sampler behind generated session starts and replay's ``--session-rate``.

Poisson arrivals have exponential gaps; ``gamma`` keeps the mean gap ``1/rate`` and sets the coefficient of
variation (``cv > 1`` is burstier than Poisson). The first session starts at 0.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

ArrivalProcess = Literal["poisson", "gamma"]


def arrival_gaps_s(rng: np.random.Generator, n: int, rate_per_s: float, process: ArrivalProcess = "poisson",
                   cv: float = 1.0) -> np.ndarray:
    """``n`` inter-arrival gaps (seconds) with mean ``1/rate_per_s``."""
    if process == "poisson":
        return rng.exponential(1.0 / rate_per_s, n)
    shape = 1.0 / cv**2
    return rng.gamma(shape, 1.0 / (rate_per_s * shape), n)


def arrival_offsets_s(rng: np.random.Generator, n: int, rate_per_s: float, process: ArrivalProcess = "poisson",
                      cv: float = 1.0) -> np.ndarray:
    """Start offsets (seconds) of ``n`` arrivals, the first at 0."""
    gaps = arrival_gaps_s(rng, n, rate_per_s, process, cv)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])
