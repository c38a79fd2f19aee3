"""A sweep planned from the scheduler model's curve (``sweep.plan: predicted``), driven by a stubbed curve and a
stubbed server (no vLLM): which levels it measures, that its evidence brackets the measured edge from both sides
and goes one level past it, that it never measures more than a full climb when the prediction is right, and
that a wrong prediction costs at most the bounded search."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvscope.harness.analysis.capacity import (
    LoadPoint,
    full_climb_levels,
    next_planned_level,
    plan_from_prediction,
    point_meets_slo,
)
from kvscope.harness.experiment.spec import ExperimentSpec
from kvscope.harness.experiment.sweep import plan_sweeps

SLO_MS = 250.0
PASS_S, FAIL_S = 0.05, 0.5


def _curve(n: int, passes) -> list[LoadPoint]:
    """Levels 1..n, each passing (50 ms) or failing (500 ms, or preempting) by ``passes(level)``."""
    return [LoadPoint(float(c), PASS_S if passes(c) else FAIL_S, 0.0 if passes(c) or c % 2 else 1.0)
            for c in range(1, n + 1)]


def _drive(n: int, predicted_edge: int, true_edge: int, max_extra: int, unloaded: bool = False,
           true_passes=None) -> tuple[list[float], list[LoadPoint], object]:
    """Run the plan to its end: levels below ``*_edge`` pass, the rest fail."""
    plan = plan_from_prediction(_curve(n, lambda c: c < predicted_edge), SLO_MS, unloaded=unloaded)
    passes = true_passes or (lambda c: c < true_edge)
    truth = {p.load: p for p in _curve(n, passes)}
    measured: list[LoadPoint] = []
    order: list[float] = []
    while (level := next_planned_level(plan, measured, SLO_MS, max_extra)) is not None:
        assert level not in order, f"{level} measured twice: {order}"
        assert len(order) <= n
        order.append(level)
        measured.append(truth[level])
    return order, measured, plan


def test_a_right_prediction_measures_the_edge_from_both_sides_and_one_past_it():
    order, measured, plan = _drive(8, predicted_edge=6, true_edge=6, max_extra=3, unloaded=True)
    assert plan.predicted_capacity == 5 and plan.predicted_edge == 6 and plan.targets == (1, 5, 6, 7)
    assert order == [1, 5, 6, 7]
    assert full_climb_levels(plan.candidates, measured, SLO_MS) == 7  # 1..7: three live cells saved


def test_a_wrong_prediction_searches_down_to_the_measured_edge_and_past_it():
    # the quickstart's baseline: predicted to hold 5, preempts at 5
    order, measured, plan = _drive(8, predicted_edge=6, true_edge=5, max_extra=3, unloaded=True)
    assert order == [1, 5, 4, 6]  # 6 and 7 wait until 5 failed; 4, next to it, passes; then one past the edge
    assert full_climb_levels(plan.candidates, measured, SLO_MS) == 6
    order, _, _ = _drive(8, predicted_edge=7, true_edge=3, max_extra=3, unloaded=True)
    assert order == [1, 6, 5, 3, 2, 4]  # next to the failure, then bisection between 1 and 5, then past the edge
    order, _, _ = _drive(8, predicted_edge=3, true_edge=7, max_extra=3, unloaded=True)
    assert order == [1, 2, 3, 4, 5, 7, 6, 8]  # too pessimistic: next to the passing level above the edge, then bisect


def test_an_under_driven_pass_is_searched_below_like_a_failure():
    # the quickstart's baseline: 5 met the SLO with 4.1 of 5 sessions in flight, 6 and 7 preempt. The old plan
    # measured 1, 5, 6, 7 and called the capacity 5; the level below the under-driven one is measured instead
    plan = plan_from_prediction(_curve(8, lambda c: c < 6), SLO_MS, unloaded=True)
    truth = {1: LoadPoint(1, PASS_S, 0, 1.0), 4: LoadPoint(4, PASS_S, 0, 3.9), 5: LoadPoint(5, PASS_S, 0, 4.1),
             6: LoadPoint(6, FAIL_S, 2, 4.5), 7: LoadPoint(7, FAIL_S, 3, 5.4)}
    measured: list[LoadPoint] = []
    while (level := next_planned_level(plan, measured, SLO_MS, 3)) is not None:
        measured.append(truth[level])
    assert [p.load for p in measured] == [1, 5, 4, 6]


def test_the_search_is_bounded():
    order, _, _ = _drive(64, predicted_edge=60, true_edge=3, max_extra=2, unloaded=True)
    assert order == [1, 59, 58, 29]  # two extra levels, then it stops with the edge between 1 and 29


def test_no_edge_within_the_levels_and_an_edge_at_the_bottom():
    order, _, plan = _drive(6, predicted_edge=99, true_edge=99, max_extra=3)
    assert plan.predicted_edge is None and order == [6]  # every level passes: the top one says so
    order, _, plan = _drive(6, predicted_edge=1, true_edge=1, max_extra=3)
    assert plan.predicted_capacity is None and order == [1, 2]  # the lowest fails: it and one past it


def test_a_relative_slo_measures_the_unloaded_level_first():
    plan = plan_from_prediction(_curve(8, lambda c: c < 6), SLO_MS, unloaded=True)
    assert next_planned_level(plan, [], None, 3) == 1  # before the SLO is resolved: the unloaded level
    assert next_planned_level(plan, [LoadPoint(1, None)], None, 3) is None  # nothing answered: no SLO, stop


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 40), predicted_edge=st.integers(1, 42), true_edge=st.integers(1, 42),
       unloaded=st.booleans())
def test_the_plan_brackets_the_edge_and_a_right_one_never_costs_more_than_a_climb(n, predicted_edge, true_edge,
                                                                                 unloaded):
    budget = math.ceil(math.log2(n + 1)) + 1  # a probe next to the disagreeing level, then bisections
    order, measured, plan = _drive(n, predicted_edge, true_edge, budget, unloaded)
    ok = {p.load: point_meets_slo(p, SLO_MS) for p in measured}
    capacity = min(true_edge - 1, n)
    if capacity >= 1:
        assert ok.get(capacity) is True, (order, capacity)  # the highest passing level was measured ...
    if capacity + 1 <= n:
        assert ok.get(capacity + 1) is False, (order, capacity)  # ... the failing one just above it ...
    if capacity + 2 <= n:
        assert capacity + 2 in ok, order  # ... and the level past the edge
    assert len(order) <= len(plan.targets) + budget + 1
    full = full_climb_levels(plan.candidates, measured, SLO_MS)
    assert full == min(capacity + 2, n)
    if predicted_edge == true_edge:
        assert len(order) <= full, (order, full)


@settings(max_examples=200, deadline=None)
@given(verdicts=st.lists(st.booleans(), min_size=1, max_size=30), predicted_edge=st.integers(1, 32),
       max_extra=st.integers(0, 6))
def test_on_any_measured_curve_the_plan_ends_without_repeating_a_level(verdicts, predicted_edge, max_extra):
    """Noisy measurements (a level passing above one that failed) still end, within the bound."""
    n = len(verdicts)
    order, measured, plan = _drive(n, predicted_edge, 0, max_extra, true_passes=lambda c: verdicts[c - 1])
    assert len(order) <= min(n, len(plan.targets) + max_extra + 1 + 1)
    ok = {p.load: point_meets_slo(p, SLO_MS) for p in measured}
    best = max((lv for lv, good in ok.items() if good), default=0)
    above = [lv for lv, good in ok.items() if not good and lv > best]
    if len(set(order) - set(plan.targets)) < max_extra:  # the search did not run out: the bracket is closed
        assert best == n or (above and min(above) == best + 1), (order, verdicts)


# ---- the sweep state that runs it ---------------------------------------------------------------------------


class _Row:
    """The fields of a `LevelPrediction` that the plan reads."""

    def __init__(self, c: int, ok: bool):
        self.concurrency, self.ttft_p90_s, self.preemptions_p50 = c, 0.05 if ok else 0.5, 0.0


def _state(**sweep):
    spec = ExperimentSpec.model_validate({"name": "x", "servers": {"a": {}}, "workloads": {"w": {"spec": "chat"}},
                                          "sweep": {"levels": [1, 2, 4, 8], "slo_ttft_p90_ms": SLO_MS, **sweep}})
    return plan_sweeps(spec)[0]


def test_the_sweep_state_follows_the_plan_and_records_the_cells_it_saved():
    sw = _state()
    assert sw.spec.plan == "predicted"
    sw.set_prediction([_Row(c, c <= 5) for c in range(1, 9)])
    ran = []
    while (load := sw.next_load()) is not None:
        ran.append(load)
        sw.record(LoadPoint(load, PASS_S if load <= 5 else FAIL_S))
    assert ran == [5, 6, 7]  # an absolute SLO needs no unloaded level
    rec = sw.plan_record()
    assert rec["plan"] == "predicted" and rec["measured"] == [5, 6, 7] and rec["measured_edge"] == 6
    assert rec["full_climb"] == 7 and rec["live_cells_saved"] == 4
    assert "predicted edge 6, measured edge 6" in rec["sentence"] and "(4 live cells saved)" in rec["sentence"]
    from kvscope.harness.results.schemas import SweepPlanEntry

    SweepPlanEntry.model_validate(rec)


def test_without_a_curve_the_sweep_climbs_its_ladder_and_says_why():
    sw = _state()
    sw.set_prediction(None, "speculative decoding is not modelled")
    ran = []
    while (load := sw.next_load()) is not None:
        ran.append(load)
        sw.record(LoadPoint(load, PASS_S if load <= 5 else FAIL_S))
    assert ran == [1, 2, 4, 8, 6, 5]
    rec = sw.plan_record()
    assert rec["plan"] == "ladder" and rec["reason"] == "speculative decoding is not modelled"
    assert rec.get("live_cells_saved") is None and rec["measured_edge"] == 6


def test_a_fixed_grid_is_a_ladder_and_asking_for_both_is_an_error():
    assert _state(adaptive=False).spec.plan == "ladder"
    with pytest.raises(ValueError, match="plan: predicted chooses its own levels"):
        _state(adaptive=False, plan="predicted")


def test_a_version_1_experiment_file_reads_as_a_ladder_sweep(tmp_path):
    import json

    from kvscope.harness.experiment.spec import ExperimentSpec as Spec
    from kvscope.harness.results.loaders import load_experiment_file

    spec = _state().spec.model_dump(exclude={"plan"})
    data = {"format": "kvscope-experiment", "version": 1, "experiment": "x", "run_id": "r", "spec_path": "s.yaml",
            "created_at": 0.0, "spec": {"name": "x", "servers": {"a": {}}, "workloads": {"w": {"spec": "chat"}},
                                        "sweep": spec}}
    (tmp_path / "experiment.json").write_text(json.dumps(data))
    read = load_experiment_file(tmp_path, Spec)
    assert read.version == 2 and read.spec.sweep.plan == "ladder"


def test_a_relative_slo_plans_from_the_unloaded_level_it_measured_first():
    sw = _state(slo_ttft_p90="3x_unloaded", slo_ttft_p90_ms=None)
    sw.set_prediction([_Row(c, c <= 5) for c in range(1, 9)])  # 50 ms up to 5, 500 ms above
    assert sw.next_load() == 1
    sw.record(LoadPoint(1, 0.04))  # 3x 40 ms = 120 ms: the curve's 50 ms pass, its 500 ms fail
    ran = [1.0]
    while (load := sw.next_load()) is not None:
        ran.append(load)
        sw.record(LoadPoint(load, 0.05 if load <= 3 else 0.5))  # the server breaks earlier than predicted
    assert ran == [1, 5, 4, 2, 3]  # 5 fails, 4 next to it fails, bisect (2, 3 pass); 5 is already past the edge
    rec = sw.plan_record()
    assert rec["measured_edge"] == 4 and sw.capacity().capacity == 3 and rec["full_climb"] == 5
    assert rec["live_cells_saved"] == 0


def test_a_planned_sweep_whose_unloaded_level_never_answers_stops_and_says_so():
    sw = _state(slo_ttft_p90="3x_unloaded", slo_ttft_p90_ms=None)
    sw.set_prediction([_Row(c, c <= 5) for c in range(1, 9)])
    sw.record(LoadPoint(sw.next_load(), None))
    assert sw.next_load() is None
    assert "did not answer" in sw.plan_record()["sentence"]
