"""The pure capacity logic on synthetic load curves (harness/analysis/capacity.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvscope.harness.analysis.capacity import (LoadPoint, capacity_from_points, interpolated_crossing,
                                               TtftSlo, mean_in_flight, next_bisection_load, point_meets_slo)


def curve(loads, knee: float, slope_ms: float = 40.0, base_ms: float = 50.0) -> list[LoadPoint]:
    """TTFT p90 flat below the knee, rising linearly above it."""
    return [LoadPoint(x, (base_ms + max(0.0, x - knee) * slope_ms) / 1000) for x in loads]


def test_capacity_is_the_highest_measured_load_meeting_the_slo_and_names_the_ceiling():
    pts = curve([1, 2, 4, 8, 16], knee=4, slope_ms=60)  # 50, 50, 50, 290, 770 ms
    cap = capacity_from_points("baseline", "agent", "concurrency", pts, 250)
    assert cap.capacity == 4 and cap.ceiling == "slo"
    assert 4 < cap.interpolated < 8
    assert cap.sentence() == ("baseline holds 4 concurrent agent sessions at TTFT p90 ≤ 250 ms (at 4: TTFT p90 50 ms, "
                              "200 ms under the SLO); at 8 it breaks the SLO (TTFT p90 290 ms, 40 ms over the SLO: the "
                              "latency criterion decided); each level ran once")


def test_preemption_fails_a_level_even_within_the_latency_slo():
    pts = [LoadPoint(1, 0.05), LoadPoint(2, 0.06), LoadPoint(4, 0.07, preemptions=3)]
    cap = capacity_from_points("s", "w", "concurrency", pts, 250)
    assert cap.capacity == 2 and cap.ceiling == "preemption"
    assert not point_meets_slo(pts[2], 250)


def test_no_ceiling_within_the_levels_and_nothing_passing_are_said_so():
    cap = capacity_from_points("s", "w", "concurrency", curve([1, 2, 4], knee=10), 250)
    assert cap.capacity == 4 and cap.ceiling is None and "at least" in cap.sentence()
    none = capacity_from_points("s", "w", "session_rate", [LoadPoint(0.5, 0.9), LoadPoint(1.0, None)], 250)
    assert none.capacity is None and "none of the measured loads" in none.sentence()


def test_the_ladder_bisects_below_an_under_driven_pass():
    # 1 holds, 5 met the SLO with 4.1 in flight, 6 fails: the next level is between 1 and 5, not "done"
    pts = [LoadPoint(1, 0.02, 0, 1.0), LoadPoint(5, 0.03, 0, 4.1), LoadPoint(6, 0.2, 2, 4.5)]
    assert next_bisection_load(pts, 75, "concurrency") == 3


def test_bisection_closes_the_gap_to_adjacent_concurrencies():
    measured = curve([1, 2, 4, 8, 16], knee=5, slope_ms=100)  # true ceiling: 6 passes (150 ms), 7 fails (250+)
    truth = {x: p for x, p in ((q.load, q) for q in curve(range(1, 17), knee=5, slope_ms=100))}
    seen = {p.load: p for p in measured}
    while (nxt := next_bisection_load(list(seen.values()), 240, "concurrency")) is not None:
        assert nxt not in seen
        seen[nxt] = truth[nxt]
    assert capacity_from_points("s", "w", "concurrency", list(seen.values()), 240).capacity == 6
    assert len(seen) <= 7  # five levels plus at most two bisection steps


def test_bisection_on_session_rate_stops_at_the_resolution():
    pts = [LoadPoint(0.5, 0.1), LoadPoint(1.0, 0.3)]
    nxt = next_bisection_load(pts, 250, "session_rate", rate_resolution=0.1)
    assert nxt == 0.75
    assert next_bisection_load([LoadPoint(0.95, 0.1), LoadPoint(1.0, 0.3)], 250, "session_rate") is None
    assert next_bisection_load([LoadPoint(1, 0.3)], 250, "concurrency") is None  # nothing passed: no bracket


@given(st.lists(st.floats(0.001, 2.0), min_size=2, max_size=8), st.floats(10, 1000))
def test_capacity_is_always_a_measured_passing_load_above_every_other_passing_one(ttfts, slo):
    pts = [LoadPoint(float(i + 1), t) for i, t in enumerate(ttfts)]
    cap = capacity_from_points("s", "w", "concurrency", pts, slo)
    passing = [p.load for p in pts if p.ttft_p90_s * 1000 <= slo]
    assert cap.capacity == (max(passing) if passing else None)
    if cap.interpolated is not None:
        assert min(p.load for p in pts) <= cap.interpolated <= max(p.load for p in pts)


def test_interpolated_crossing_hits_a_linear_margin_exactly():
    pts = [LoadPoint(2, 0.150), LoadPoint(4, 0.350)]
    assert interpolated_crossing(pts, 250) == pytest.approx(3.0)


def test_mean_in_flight_and_under_driven_levels_are_flagged():
    # two sessions back to back (never overlapping): one in flight on average, though the level asked for 2
    assert mean_in_flight(["a", "a", "b"], [0, 1, 2], [1, 2, 4]) == pytest.approx(1.0)
    assert mean_in_flight(["a", "b"], [0, 0], [4, 4]) == pytest.approx(2.0)
    pts = [LoadPoint(2, 0.05, mean_sessions_in_flight=1.0), LoadPoint(4, 0.05, mean_sessions_in_flight=3.9)]
    assert capacity_from_points("s", "w", "concurrency", pts, 250).under_driven == [2]


def quickstart_sweep() -> list[LoadPoint]:
    """The quickstart's baseline sweep (experiment 20261205-113415): level 5 passed with 4.10 of 5 sessions in
    flight (the 8-session trace ran dry), 6 and 7 preempted; plus a driven level 4 the planned search now adds."""
    return [LoadPoint(1, 0.0251, 0, 1.0), LoadPoint(4, 0.0300, 0, 3.89), LoadPoint(5, 0.0312, 0, 4.10),
            LoadPoint(6, 0.1486, 2, 4.47), LoadPoint(7, 0.2753, 3, 5.44)]


def test_an_under_driven_pass_does_not_count_toward_the_capacity_and_is_named():
    # the old rule said "holds 5": level 5 only ever had 4.1 sessions in flight
    slo = TtftSlo(unloaded_factor=3.0, number="3")
    cap = capacity_from_points("baseline", "agent-sweep", "concurrency", quickstart_sweep(), slo)
    assert cap.capacity == 4 and cap.ceiling == "preemption" and cap.under_driven == [5, 6, 7]
    s = cap.sentence()
    assert s.startswith("baseline holds 4 concurrent agent-sweep sessions at TTFT p90 ≤ 3x unloaded (25 ms, "
                        "measured at concurrency 1) = 75 ms (at 4: TTFT p90 30 ms, 45 ms under the SLO, 3.9 sessions "
                        "in flight); 5 met the SLO with only 4.1 sessions in flight on average (under-driven: below "
                        "4.5, the level less 10 %), so it does not count; at 6 it preempts (2 preemptions, TTFT p90 "
                        "149 ms, 73 ms over the SLO, 4.5 sessions in flight (under-driven): both criteria fail)"), s
    # without the driven level 4 nothing between 1 and 6 holds: the answer is 1, never the under-driven 5
    without_4 = [p for p in quickstart_sweep() if p.load != 4]
    assert capacity_from_points("baseline", "w", "concurrency", without_4, slo).capacity == 1
    # an under-driven *failure* still fails: fewer sessions than asked already broke it
    failing = [LoadPoint(1, 0.02, 0, 1.0), LoadPoint(4, 0.03, 0, 3.9), LoadPoint(5, 0.031, 1, 4.16)]
    cap = capacity_from_points("ngram", "w", "concurrency", failing, slo)
    assert cap.capacity == 4 and cap.ceiling == "preemption"
    assert cap.sentence().endswith("at 5 it preempts (1 preemption, TTFT p90 31 ms, 29 ms under the SLO, 4.2 "
                                   "sessions in flight (under-driven): the preemption criterion decided); each "
                                   "level ran once (one preemption decides this edge)")


def test_an_open_loop_level_is_never_under_driven():
    pts = [LoadPoint(0.5, 0.05, 0, 0.2), LoadPoint(1.0, 0.06, 0, 0.3)]
    cap = capacity_from_points("s", "w", "session_rate", pts, 250)
    assert cap.capacity == 1.0 and cap.under_driven == []


def test_a_predicted_level_is_read_by_its_median_run_not_its_worst():
    from kvscope.harness.analysis.capacity import predicted_points
    from kvscope.harness.cachemodel.capacity_model import LevelPrediction

    def level(c: int, p50: float, p90: float, ttft_p90_s: float = 0.1) -> LevelPrediction:
        return LevelPrediction(c, 100, 0.8, 0.05, ttft_p90_s, 0.2, 1.0, 2.0, p90 / 4, 0.5, 0.9, 10.0, 0.1,
                               runs=16, preemptions_p10=0.0, preemptions_p50=p50, preemptions_p90=p90)

    rows = [level(2, 0, 0), level(4, 0, 2), level(6, 3, 9), level(8, 0, 0, ttft_p90_s=float("nan"))]
    points = predicted_points(rows)
    assert [p.preemptions for p in points] == [0, 0, 3, 0] and points[3].ttft_p90_s is None
    cap = capacity_from_points("s", "w", "concurrency", points, slo_ttft_p90_ms=250)
    assert cap.capacity == 4 and cap.ceiling == "preemption"  # a few runs preempting at 4 do not fail it


def _with_intervals(pts: list[LoadPoint], intervals: dict[float, tuple[float, float]]) -> list[LoadPoint]:
    return [LoadPoint(p.load, p.ttft_p90_s, p.preemptions, p.mean_sessions_in_flight, p.cell,
                      intervals.get(p.load)) for p in pts]


def test_an_edge_inside_run_to_run_noise_is_said_to_be_and_a_clear_one_too():
    """The deciding levels' 95 % intervals over sessions: where the SLO (250 ms) lies inside one, a repeat may
    move the capacity, and the sentence says so; where both stay on their side, it says the edge is clear."""
    pts = curve([1, 2, 4, 8], knee=4, slope_ms=60)  # 50, 50, 50, 290 ms
    noisy = capacity_from_points("b", "w", "concurrency", _with_intervals(pts, {4: (0.04, 0.06), 8: (0.2, 0.4)}),
                                 250)
    assert noisy.capacity == 4 and noisy.noisy_edge_levels() == [8]
    assert noisy.sentence().endswith("; the edge is within run-to-run noise: the SLO lies inside the TTFT p90's "
                                     "95 % interval over sessions (200-400 ms at 8), so a repeat may move the "
                                     "capacity by a level")
    capacity_side = capacity_from_points("b", "w", "concurrency",
                                         _with_intervals(pts, {4: (0.03, 0.26), 8: (0.27, 0.31)}), 250)
    assert capacity_side.noisy_edge_levels() == [4]
    clear = capacity_from_points("b", "w", "concurrency", _with_intervals(pts, {4: (0.04, 0.06), 8: (0.26, 0.32)}),
                                 250)
    assert clear.noisy_edge_levels() == []
    assert clear.sentence().endswith("; the edge is clear of run-to-run noise: the TTFT p90's 95 % interval over "
                                     "sessions stays on its side of the SLO (40-60 ms at 4, 260-320 ms at 8)")
    # a preemption decides by a count: its level's latency interval does not make the edge noisy
    preempting = [LoadPoint(1, 0.05), LoadPoint(2, 0.06, cell=None, ttft_p90_interval_s=(0.05, 0.07)),
                  LoadPoint(4, 0.2, preemptions=2, ttft_p90_interval_s=(0.1, 0.3))]
    by_count = capacity_from_points("s", "w", "concurrency", preempting, 250)
    assert by_count.noisy_edge_levels() == [] and by_count.sentence().endswith("side of the SLO (50-70 ms at 2)")
    # files written before the interval existed: nothing claimed either way
    assert capacity_from_points("b", "w", "concurrency", pts, 250).noisy_edge_levels() is None
