"""The TTFT p90 interval over sessions (`results.percentiles.session_bootstrap_interval`), checked against
traffic whose true percentile is known: the capacity sentence calls an edge "within noise" from it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvscope.harness.results.percentiles import session_bootstrap_interval


def _run(rng: np.random.Generator, sessions: int, per_session: int, spread: float) -> tuple[np.ndarray, np.ndarray]:
    """One cell's TTFTs: exponential around 20 ms, each session scaled by its own lognormal effect (its place in
    the closed loop, its prompts), so requests within a session are correlated."""
    effect = rng.lognormal(0.0, spread, sessions)
    values = np.concatenate([rng.exponential(0.02, per_session) * e for e in effect])
    return values, np.repeat([f"s{i}" for i in range(sessions)], per_session)


@pytest.mark.parametrize("sessions,spread,floor", [(4, 0.3, 0.90), (8, 0.3, 0.90), (16, 0.3, 0.90), (8, 0.6, 0.85)])
def test_the_interval_covers_the_true_p90_about_as_often_as_it_says(sessions, spread, floor):
    """Nominal 95 %: over 300 simulated cells the interval holds the population's p90 in at least 90 % of them
    with moderate session effects (lognormal sigma 0.3) and 85 % with strong ones (0.6: a session 1.8x slower
    at one sigma); measured over 600 cells: 93-94 % and 88-91 %. The draws' own 2.5-97.5th percentiles held it
    in 73-86 % at 4-8 sessions, which fails this test. Never above 99 %: an interval that wide says nothing."""
    rng = np.random.default_rng(sessions * 10 + int(spread * 10))
    population = np.concatenate([rng.exponential(0.02, 50) * e for e in rng.lognormal(0.0, spread, 20_000)])
    truth = np.percentile(population, 90)
    held = 0
    for seed in range(300):
        values, ids = _run(rng, sessions, 30, spread)
        lo, hi = session_bootstrap_interval(values, ids, 90, draws=500, seed=seed)
        held += lo <= truth <= hi
    assert floor <= held / 300 <= 0.99, held / 300


def test_sessions_not_requests_are_the_unit():
    """Thirty requests that all come from two sessions are two observations: the interval is far wider than
    the same requests read as thirty independent sessions would give."""
    rng = np.random.default_rng(3)
    values, ids = _run(rng, 2, 30, 0.6)
    by_session = session_bootstrap_interval(values, ids, 90)
    as_requests = session_bootstrap_interval(values, [str(i) for i in range(len(values))], 90)
    assert by_session is not None and as_requests is not None
    assert by_session[1] - by_session[0] > 2 * (as_requests[1] - as_requests[0])


def test_one_session_gives_no_interval_and_nan_is_ignored():
    assert session_bootstrap_interval(np.array([0.1, 0.2, 0.3]), ["a", "a", "a"], 90) is None
    assert session_bootstrap_interval(np.array([0.1, np.nan]), ["a", "b"], 90) is None
    lo, hi = session_bootstrap_interval(np.array([0.1, np.nan, 0.2, 0.3]), ["a", "b", "b", "c"], 90)
    assert 0.0 <= lo <= np.percentile([0.1, 0.2, 0.3], 90) <= hi


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(0.001, 5.0), min_size=4, max_size=60), st.integers(2, 6))
def test_the_interval_holds_the_point_estimate_and_is_never_negative(values, sessions):
    ids = [f"s{i % sessions}" for i in range(len(values))]
    got = session_bootstrap_interval(np.array(values), ids, 90, draws=200)
    if len(set(ids)) < 2:
        assert got is None
        return
    lo, hi = got
    assert 0.0 <= lo <= np.percentile(values, 90) <= hi + 1e-12
