"""Speculative decoding: expected tokens per target pass and the rejection-sampling rule.

With i.i.d. acceptance ``a`` and ``k`` draft tokens a target pass yields ``(1-a^(k+1))/(1-a)`` tokens
(the accepted run plus the bonus/resampled token).  The acceptance rule accepts ``x ~ q`` with
``min(1, p/q)`` and otherwise resamples from ``max(0, p-q)`` normalised; its output is exactly ``p``.
"""

from __future__ import annotations

import numpy as np


def expected_tokens_per_pass(a: float, k: int) -> float:
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def acceptance_probabilities(p: np.ndarray | list, q: np.ndarray | list) -> np.ndarray:
    p, q = np.asarray(p, float), np.asarray(q, float)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)


def residual_distribution(p: np.ndarray | list, q: np.ndarray | list) -> np.ndarray:
    p, q = np.asarray(p, float), np.asarray(q, float)
    r = np.maximum(0.0, p - q)
    s = r.sum()
    return r / s if s > 0 else p.copy()


def speculative_output_distribution(p: np.ndarray | list, q: np.ndarray | list) -> np.ndarray:
    """Distribution of the token emitted by one accept/resample step: ``q*acc + P(reject)*residual``."""
    q_ = np.asarray(q, float)
    acc = acceptance_probabilities(p, q)
    reject_mass = float(np.sum(q_ * (1.0 - acc)))
    return q_ * acc + reject_mass * residual_distribution(p, q)


def is_exact(p: np.ndarray | list, q: np.ndarray | list, atol: float = 1e-12) -> bool:
    return bool(np.allclose(speculative_output_distribution(p, q), np.asarray(p, float), atol=atol))


def sample_speculative(p: np.ndarray | list, q: np.ndarray | list, n: int, seed: int = 0) -> np.ndarray:
    """Monte Carlo of the rule (draft ``x~q``, accept or resample); returns empirical frequencies."""
    rng = np.random.default_rng(seed)
    p_, q_ = np.asarray(p, float), np.asarray(q, float)
    acc = acceptance_probabilities(p_, q_)
    res = residual_distribution(p_, q_)
    x = rng.choice(len(q_), size=n, p=q_)
    keep = rng.random(n) < acc[x]
    y = np.where(keep, x, rng.choice(len(res), size=n, p=res))
    return np.bincount(y, minlength=len(p_)) / n
