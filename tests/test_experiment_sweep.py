"""Experiment cell order (repeats interleaved across configurations), the sweep section, and the live sweep's
next-level decisions on synthetic measurements (no server)."""

from __future__ import annotations

import pytest

from kvscope.harness.analysis.capacity import LoadPoint
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment.runner import describe_plan, plan_cells
from kvscope.harness.experiment.spec import ExperimentSpec, load_experiment_spec
from kvscope.harness.experiment.sweep import SweepState, plan_sweeps, point_from_cell

BASE = {"name": "x", "servers": {"a": {}, "b": {}}, "workloads": {"w": {"spec": "chat"}}}


def test_cells_run_repeat_major_so_the_arms_interleave():
    spec = ExperimentSpec.model_validate({**BASE, "repeats": 3})
    assert [c.name for c in plan_cells(spec)] == ["a__w__c1__r0", "b__w__c1__r0", "a__w__c1__r1", "b__w__c1__r1",
                                                  "a__w__c1__r2", "b__w__c1__r2"]
    assert "repeat-major" in describe_plan(spec) and "stay up" in describe_plan(spec)
    one = ExperimentSpec.model_validate({**BASE, "repeats": 2, "servers_up": "one", "between_repeats": "restart"})
    assert [c.name for c in plan_cells(one)] == ["a__w__c1__r0", "a__w__c1__r1", "b__w__c1__r0", "b__w__c1__r1"]
    assert "not interleaved" in describe_plan(one) and "fresh server process" in describe_plan(one)


def test_repeats_default_to_three():
    assert ExperimentSpec.model_validate(BASE).repeats == 3


@pytest.mark.parametrize("sweep,needle", [
    ("{levels: [1, 2.5], slo_ttft_p90_ms: 250}", "whole numbers"),
    ("{levels: [1, 2], slo_ttft_p90_ms: 250, servers: [c]}", "sweep.servers: unknown c"),
    ("{levels: [1, 1], slo_ttft_p90_ms: 250}", "distinct"),
    ("{levels: [2, 4]}", "slo_ttft_p90_ms"),
])
def test_bad_sweep_sections_are_one_line_errors(tmp_path, sweep, needle):
    p = tmp_path / "s.yaml"
    p.write_text(f"name: x\nservers: {{a: {{}}}}\nworkloads: {{w: {{spec: chat}}}}\nsweep: {sweep}\n")
    with pytest.raises(ConfigError, match=needle) as err:
        load_experiment_spec(p)
    assert str(p) in str(err.value)


def _sweep(adaptive: bool = True, max_bisections: int = 3) -> SweepState:
    spec = ExperimentSpec.model_validate({**BASE, "sweep": {"levels": [16, 1, 2, 4, 8], "slo_ttft_p90_ms": 250,
                                                            "adaptive": adaptive,
                                                            "max_bisections": max_bisections}})
    return plan_sweeps(spec)[0]


def _run(sw: SweepState, ttft_ms_at) -> list[float]:
    ran = []
    while (load := sw.next_load()) is not None:
        ran.append(load)
        sw.record(LoadPoint(load, ttft_ms_at(load) / 1000))
    return ran


def test_adaptive_sweep_stops_at_the_first_failure_then_bisects_to_the_ceiling():
    sw = _sweep()
    ran = _run(sw, lambda c: 50 if c <= 5 else 400)
    assert ran == [1, 2, 4, 8, 6, 5]  # 16 never runs; 6 then 5 close the gap between 4 and 8
    cap = sw.capacity()
    assert cap.capacity == 5 and cap.ceiling == "slo"
    assert cap.sentence().startswith("a holds 5 concurrent w sessions at TTFT p90 ≤ 250 ms; at 6 it breaks")


def test_bisections_are_bounded_and_a_fixed_sweep_runs_every_level():
    sw = _sweep(max_bisections=1)
    assert _run(sw, lambda c: 50 if c <= 5 else 400) == [1, 2, 4, 8, 6]
    assert sw.capacity().capacity == 4
    fixed = _sweep(adaptive=False)
    assert _run(fixed, lambda c: 50 if c <= 5 else 400) == [1, 2, 4, 8, 16]


def test_a_failed_cell_counts_as_past_the_ceiling_and_resume_continues():
    sw = _sweep()
    sw.record(point_from_cell(1, {"status": "ok", "headline": {"ttft_p90_s": 0.05, "preemptions": 0}}))
    sw.record(point_from_cell(2, {"status": "failed", "headline": {"ttft_p90_s": 0.05}}))  # replayed, failed
    assert sw.next_load() is None  # 1 passed, 2 failed: adjacent, nothing between
    assert sw.capacity().capacity == 1 and sw.capacity().ceiling == "slo"
    preempted = point_from_cell(4, {"status": "ok", "headline": {"ttft_p90_s": 0.05, "preemptions": 2.0}})
    assert preempted.preemptions == 2.0


def test_a_sweep_only_workload_stays_out_of_the_grid_and_must_be_swept():
    wl = {"w": {"spec": "chat"}, "big": {"spec": "chat", "sessions": 8, "sweep_only": True}}
    spec = ExperimentSpec.model_validate({**BASE, "workloads": wl, "repeats": 1,
                                          "sweep": {"levels": [1, 2], "slo_ttft_p90_ms": 250, "workloads": ["big"]}})
    assert {c.workload for c in plan_cells(spec)} == {"w"}
    assert {s.workload for s in plan_sweeps(spec)} == {"big"}
    with pytest.raises(ValueError, match="sweep_only: name them in sweep.workloads"):
        ExperimentSpec.model_validate({**BASE, "workloads": wl})


def test_a_cell_that_never_replayed_stops_the_sweep_without_a_measurement():
    sw = _sweep()
    sw.record(point_from_cell(1, {"status": "ok", "headline": {"ttft_p90_s": 0.05}}))
    sw.record(point_from_cell(2, {"status": "failed", "reason": "ServerError: no start"}), "ServerError: no start")
    assert sw.next_load() is None and sw.stopped == "ServerError: no start"
    assert sorted(sw.points) == [1] and sw.capacity().ceiling is None
