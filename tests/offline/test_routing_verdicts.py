"""The routing page's cost verdicts (`analysis.pages.routing.cost_verdicts`) on per-session costs whose truth is
known: an A/A pair (a policy of the same expected cost as all-large, each session's cost moved by independent
noise) must not be called cheaper or dearer, and a policy 30 % cheaper must be found once there are enough
sessions. The percentile bootstrap it used before decided 13 % of A/A pairs at 4 sessions (the quickstart's
count); the paired t interval decides about 2 %."""

from __future__ import annotations

import numpy as np
import pytest
from kvscope.harness.analysis.pages.routing import REFERENCE, cost_verdicts


def _verdicts(rng: np.random.Generator, sessions: int, effect: float, trials: int, noise: float = 0.3) -> dict:
    """Verdict shares over ``trials`` pairs: all-large's per-session cost lognormal around 2 cents, the policy's
    that cost times ``effect`` times mean-one lognormal noise (its own routing decisions per session)."""
    words: list[str] = []
    for _ in range(trials):
        ref = rng.lognormal(0.0, 0.5, sessions) * 0.02
        policy = ref * effect * np.exp(rng.normal(-noise ** 2 / 2, noise, sessions))
        per = {("w", REFERENCE): {f"s{i}": ref[i] for i in range(sessions)},
               ("w", "rule"): {f"s{i}": policy[i] for i in range(sessions)}}
        words.append(str(cost_verdicts(None, per)["verdict"].iloc[0]))
    return {w: words.count(w) / trials for w in set(words)}


@pytest.mark.parametrize("sessions", [3, 4, 8, 16])
def test_an_aa_pair_is_rarely_decided(sessions):
    shares = _verdicts(np.random.default_rng(sessions), sessions, 1.0, 1000)
    wrong = shares.get("better", 0.0) + shares.get("worse", 0.0)
    assert wrong <= 0.05, shares  # measured about 0.02 at every count


@pytest.mark.parametrize("sessions,power", [(8, 0.5), (16, 0.85)])
def test_a_policy_30_percent_cheaper_is_found(sessions, power):
    shares = _verdicts(np.random.default_rng(100 + sessions), sessions, 0.7, 500)
    assert shares.get("worse", 0.0) == 0.0
    assert shares.get("better", 0.0) >= power, shares  # measured 0.65 at 8 sessions, 0.93 at 16


def test_identical_costs_are_equivalent_and_two_sessions_give_no_verdict():
    same = {("w", REFERENCE): {"a": 0.01, "b": 0.02, "c": 0.03}, ("w", "same"): {"a": 0.01, "b": 0.02, "c": 0.03}}
    assert cost_verdicts(None, same)["verdict"].tolist() == ["equivalent"]
    two = {("w", REFERENCE): {"a": 0.01, "b": 0.02}, ("w", "half"): {"a": 0.005, "b": 0.01}}
    assert cost_verdicts(None, two)["verdict"].tolist() == ["inconclusive"]
