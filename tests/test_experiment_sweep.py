"""Experiment cell order (repeats interleaved across configurations), the sweep section, and the live sweep's
next-level decisions on synthetic measurements (no server)."""

from __future__ import annotations

import pytest
from kvscope.harness.analysis.capacity import LoadPoint
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.experiment.runner import describe_plan, plan_cells
from kvscope.harness.experiment.spec import ExperimentSpec, load_experiment_spec
from kvscope.harness.experiment.sweep import SweepState, plan_sweeps, point_from_cell
from kvscope.harness.results.schemas import CellEntry, CellHeadline

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
    assert ExperimentSpec.model_validate(BASE).repeats.max == 3


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
    assert cap.sentence().startswith("a holds 5 concurrent w sessions at TTFT p90 ≤ 250 ms (at 5: TTFT p90 50 ms, "
                                     "200 ms under the SLO); at 6 it breaks")


def test_bisections_are_bounded_and_a_fixed_sweep_runs_every_level():
    sw = _sweep(max_bisections=1)
    assert _run(sw, lambda c: 50 if c <= 5 else 400) == [1, 2, 4, 8, 6]
    assert sw.capacity().capacity == 4
    fixed = _sweep(adaptive=False)
    assert _run(fixed, lambda c: 50 if c <= 5 else 400) == [1, 2, 4, 8, 16]


def _entry(fields: dict) -> CellEntry:
    """A sweep cell's experiment.json entry with the given status, reason and headline figures."""
    head = fields.get("headline")
    return CellEntry(server="s", workload="w", load="c1", repeat=0, status=fields["status"], reason=fields.get("reason"),
                     headline=None if head is None else
                     CellHeadline(requests=1, errors=0, hit_rate=None, ttft_p50_s=None, req_per_s=None, **head))


def test_a_failed_cell_counts_as_past_the_ceiling_and_resume_continues():
    sw = _sweep()
    sw.record(point_from_cell(1, _entry({"status": "ok", "headline": {"ttft_p90_s": 0.05, "preemptions": 0}})))
    sw.record(point_from_cell(2, _entry({"status": "failed", "headline": {"ttft_p90_s": 0.05}})))  # replayed, failed
    assert sw.next_load() is None  # 1 passed, 2 failed: adjacent, nothing between
    assert sw.capacity().capacity == 1 and sw.capacity().ceiling == "slo"
    preempted = point_from_cell(4, _entry({"status": "ok", "headline": {"ttft_p90_s": 0.05, "preemptions": 2.0}}))
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
    sw.record(point_from_cell(1, _entry({"status": "ok", "headline": {"ttft_p90_s": 0.05}})))
    sw.record(point_from_cell(2, _entry({"status": "failed", "reason": "ServerError: no start"})), "ServerError: no start")
    assert sw.next_load() is None and sw.stopped == "ServerError: no start"
    assert sorted(sw.points) == [1] and sw.capacity().ceiling is None


# ---- the predicted curve beside the sweep (sweep.predict) --------------------------------------------------


def _predicting_sweep(tmp_path, slo_ms: float, levels=(1, 2, 6)):
    from kvscope.harness.results.loaders import load_calibration

    from tests.offline.test_scheduler import _calibration_file, _sessions_trace

    spec = ExperimentSpec.model_validate({**BASE, "sweep": {"levels": list(levels), "slo_ttft_p90_ms": slo_ms}})
    sw = plan_sweeps(spec)[0]
    cal = load_calibration(_calibration_file(tmp_path / "calibration.json", num_gpu_blocks=40))
    return sw, cal, _sessions_trace(tmp_path)


@pytest.mark.parametrize("slo_ms", [1e9, 30.0])
def test_a_sweeps_prediction_is_what_kvscope_capacity_says_at_every_level_it_measured(tmp_path, capsys, slo_ms):
    """The page's dashed curve and predicted capacity are `kvscope capacity`'s on the same trace and calibration,
    at every concurrency from the lowest to the highest swept level (not only the spec's and the bisected 3)."""
    import json

    from kvscope.harness.cli.main import main
    from kvscope.harness.experiment.sweep import predict_sweep
    from kvscope.harness.results.schemas import PredictedCapacity

    sw, cal, trace = _predicting_sweep(tmp_path, slo_ms)
    sw.record(LoadPoint(1, 0.02))
    sw.record(LoadPoint(3, 0.05, preemptions=2))  # a bisection level
    pred = PredictedCapacity.model_validate(predict_sweep(sw, trace, cal, "calibrations/a.json", time_scale=0,
                                                          mode="live"))
    assert [lv.load for lv in pred.levels] == [1, 2, 3, 4, 5, 6]
    out = tmp_path / "capacity.json"
    assert main(["capacity", str(trace), "--calibration", str(tmp_path / "calibration.json"), "--levels", "1,2,3,4,5,6",
                 "--time-scale", "0", "--mode", "live", "--slo-ttft-ms", str(slo_ms), "--json", str(out)]) == 0
    cli = json.loads(out.read_text())
    assert [lv.hit_rate for lv in pred.levels] == [r["token_hit_rate"] for r in cli["levels"]]
    assert [lv.preemptions for lv in pred.levels] == [r["preemptions"] for r in cli["levels"]]
    assert pred.capacity == cli["capacity_concurrency"] and pred.cliff == cli["cliff_concurrency"]
    assert pred.cliff is not None  # 6 sessions do not fit in 39 blocks
    if slo_ms < 1e6:  # a tight SLO is broken below the top level
        assert pred.capacity is None or pred.capacity < 6
    assert pred.calibration == "calibrations/a.json" and pred.skipped is None
    assert f"(measured: {int(sw.capacity().capacity)})" in pred.sentence


def test_no_prediction_is_made_where_the_model_cannot_make_one_and_each_says_why(tmp_path):
    from kvscope.harness.experiment.sweep import predict_sweep, prediction_skipped

    sw, cal, trace = _predicting_sweep(tmp_path, 250)
    assert prediction_skipped(sw.spec, speculative=False) is None
    assert "speculative decoding" in prediction_skipped(sw.spec, speculative=True)  # not one the model computes
    assert "off" in prediction_skipped(sw.spec.model_copy(update={"predict": False}), speculative=False)
    assert "session rates" in prediction_skipped(sw.spec.model_copy(update={"kind": "session_rate"}),
                                                 speculative=False)
    poor = predict_sweep(sw, trace, cal.model_copy(update={"fit_r2": -0.66}), "c.json", time_scale=0, mode="live")
    assert "R² -0.66" in poor["skipped"] and not poor.get("levels")


def test_the_concurrency_page_tables_pair_each_measured_level_with_the_prediction():
    from types import SimpleNamespace

    from kvscope.harness.analysis.pages import concurrency
    from kvscope.harness.results.schemas import CapacityEntry, CellEntry

    def cell(hit, p50):
        return CellEntry(server="a", workload="w", load="c1", repeat=0, status="ok", dir="cells/x",
                         headline={"requests": 10, "errors": 0, "hit_rate": hit, "ttft_p50_s": p50, "req_per_s": 1.0})

    entry = CapacityEntry(
        server="a", workload="w", kind="concurrency", slo_ttft_p90_ms=250, capacity=2, interpolated=None,
        ceiling="preemption", under_driven=[], sentence="a holds 2",
        points=[{"load": 1, "ttft_p90_s": 0.05, "preemptions": 0, "mean_sessions_in_flight": 1, "cell": "cells/a1"},
                {"load": 2, "ttft_p90_s": 0.1, "preemptions": 0, "mean_sessions_in_flight": 2, "cell": "cells/a2"},
                {"load": 4, "ttft_p90_s": 0.2, "preemptions": 3, "mean_sessions_in_flight": 4, "cell": "cells/a4"}],
        predicted={"calibration": "calibrations/a.json", "fit_r2": 0.9, "capacity": 4, "cliff": 4, "sentence": "s",
                   "levels": [{"load": c, "hit_rate": h, "ttft_p50_s": 0.01 * c, "ttft_p90_s": 0.02 * c,
                               "e2e_p50_s": 1.0, "preemptions": pre, "kv_usage_max": 0.5}
                              for c, h, pre in ((1, 0.8, 0), (2, 0.8, 0), (4, 0.6, 0), (8, 0.3, 5))]})
    skipped = CapacityEntry.model_validate({**entry.model_dump(), "server": "spec",
                                            "predicted": {"skipped": "speculative decoding is not modelled"}})
    res = SimpleNamespace(experiment=SimpleNamespace(
        capacity=[entry, skipped], cells={"a1": cell(0.81, 0.03), "a2": cell(0.79, 0.04), "a4": cell(0.5, 0.1)}))
    pm = concurrency.predicted_vs_measured(res)
    # the skipped sweep has its measured rows alone, no predicted curve
    assert set(pm[pm["source"] == "predicted"]["server"]) == {"a"}
    assert set(pm[pm["server"] == "spec"]["source"]) == {"measured"}
    pm = pm[pm["server"] == "a"]
    m = pm[pm["source"] == "measured"].set_index("concurrency")
    p = pm[pm["source"] == "predicted"].set_index("concurrency")
    assert list(m.index) == [1, 2, 4] and list(p.index) == [1, 2, 4, 8]
    assert m.loc[2, "hit_rate"] == 0.79 and m.loc[2, "ttft_p50_ms"] == pytest.approx(40)  # from the cell headline
    assert list(m["meets_slo"]) == [True, True, False]  # preempted at 4: past the ceiling
    assert list(p["meets_slo"]) == [True, True, True, False]
    caps = concurrency.capacity_predictions(res).set_index("server")
    assert caps.loc["a", "headline"] == "a on w: capacity predicted 4, measured 2" and caps.loc["a", "note"] == ""
    assert "speculative" in caps.loc["spec", "note"]
    assert caps.loc["a", "sentence"] == "a on w: s" and "no prediction (speculative" in caps.loc["spec", "sentence"]


# ---- an SLO relative to the server's own unloaded latency (sweep.slo_ttft_p90: 3x_unloaded) ------------------


def _relative_sweep(slo, levels=(1, 2, 4, 8), **extra) -> SweepState:
    spec = ExperimentSpec.model_validate({**BASE, "sweep": {"levels": list(levels), "slo_ttft_p90": slo, **extra}})
    return plan_sweeps(spec)[0]


@pytest.mark.parametrize("slo,needle", [
    ("3y_unloaded", "'3y_unloaded' is neither milliseconds"),
    ("1x_unloaded", "factor must be above 1"),
    ("-5", "neither milliseconds"),
])
def test_a_malformed_slo_is_a_one_line_error_naming_the_field(tmp_path, slo, needle):
    p = tmp_path / "s.yaml"
    p.write_text(f"name: x\nservers: {{a: {{}}}}\nworkloads: {{w: {{spec: chat}}}}\n"
                 f"sweep: {{levels: [1, 2], slo_ttft_p90: '{slo}'}}\n")
    with pytest.raises(ConfigError, match=needle) as err:
        load_experiment_spec(p)
    assert "slo_ttft_p90" in str(err.value) and "\n" not in str(err.value)
    p.write_text("name: x\nservers: {a: {}}\nworkloads: {w: {spec: chat}}\n"
                 "sweep: {levels: [1, 2], slo_ttft_p90: 3x_unloaded, slo_ttft_p90_ms: 250}\n")
    with pytest.raises(ConfigError, match="exactly one of slo_ttft_p90"):
        load_experiment_spec(p)


def test_milliseconds_written_as_text_are_the_absolute_slo():
    sw = _relative_sweep("250ms")
    assert sw.spec.slo_ttft_p90 is None and sw.spec.slo_ttft_p90_ms == 250
    assert _relative_sweep(300).spec.slo_ttft_p90_ms == 300


def test_a_relative_slo_resolves_from_the_lowest_level_and_the_answer_records_the_absolute_value():
    """A slow machine (479 ms alone): 250 ms says nothing there, 3x unloaded finds the knee."""
    from dataclasses import asdict

    from kvscope.harness.results.schemas import CapacityEntry

    sw = _relative_sweep("3x_unloaded", max_bisections=1)
    ttft = {1: 479, 2: 900, 3: 1300, 4: 1500, 8: 3000}
    assert _run(sw, lambda c: ttft[c]) == [1, 2, 4, 3]
    cap = sw.capacity()
    assert cap.slo_ttft_p90_ms == pytest.approx(1437) and cap.slo_unloaded_ttft_p90_ms == pytest.approx(479)
    assert cap.capacity == 3 and cap.ceiling == "slo"
    assert "TTFT p90 ≤ 3x unloaded (479 ms, measured at concurrency 1) = 1437 ms" in cap.sentence()
    entry = CapacityEntry.model_validate({**asdict(cap), "sentence": cap.sentence()})
    assert entry.slo_ttft_p90 == "3x_unloaded" and entry.slo_unloaded_source == "measured at concurrency 1"
    # the same machine, the same relative SLO: a 10x faster host finds the same knee
    fast = _relative_sweep("3x_unloaded", max_bisections=1)
    _run(fast, lambda c: ttft[c] / 10)
    assert fast.capacity().capacity == 3 and fast.capacity().slo_ttft_p90_ms == pytest.approx(143.7)


def test_when_no_level_meets_an_absolute_slo_the_sweep_still_maps_the_curve_up_to_the_kv_ceiling():
    spec = ExperimentSpec.model_validate({**BASE, "sweep": {"levels": [1, 2, 3, 4, 6, 8], "slo_ttft_p90_ms": 250}})
    sw = plan_sweeps(spec)[0]
    ran = []
    while (load := sw.next_load()) is not None:
        ran.append(load)
        sw.record(LoadPoint(load, (479 + 100 * load) / 1000, preemptions=3.0 if load >= 6 else 0.0))
    assert ran == [1, 2, 3, 4, 6]  # not only 1 (the old rule stopped there); 8 is past the first preemption
    cap = sw.capacity()
    assert cap.capacity is None
    s = cap.sentence()
    assert "at none of the measured loads" in s and "1: 579 ms, 2: 679 ms" in s and "6: preempts" in s
    assert s.endswith("KV ceiling: it preempts from 6")


def test_a_relative_slo_without_any_measured_level_falls_back_to_the_models_lowest_level():
    sw = _relative_sweep("2x_unloaded")
    cap = sw.capacity(unloaded_fallback=LoadPoint(1, 0.1))
    assert cap.slo_ttft_p90_ms == pytest.approx(200) and cap.slo_unloaded_source == "predicted from the calibration at concurrency 1"
    bare = sw.capacity()
    assert bare.slo_ttft_p90_ms is None and "not resolved" in bare.sentence()


def test_kvscope_capacity_resolves_a_relative_slo_from_its_predicted_lowest_level(tmp_path, capsys):
    import json

    from kvscope.harness.cli.main import main

    _, _, trace = _predicting_sweep(tmp_path, 250)
    out = tmp_path / "capacity.json"
    assert main(["capacity", str(trace), "--calibration", str(tmp_path / "calibration.json"), "--levels", "1,2,4",
                 "--time-scale", "0", "--mode", "live", "--slo-ttft-p90", "3x_unloaded", "--json", str(out)]) == 0
    cli = json.loads(out.read_text())
    lowest_ms = cli["levels"][0]["ttft_p90_s"] * 1000
    assert cli["slo_ttft_p90"] == "3x_unloaded" and cli["slo_unloaded_ttft_p90_ms"] == pytest.approx(lowest_ms)
    assert cli["slo_ttft_ms"] == pytest.approx(3 * lowest_ms)
    assert f"3x unloaded ({lowest_ms:.0f} ms, predicted at concurrency 1)" in capsys.readouterr().out


# ---- an n-gram configuration's sweep: planned from the drafts of the answers its first level generated ------


def _ngram_sweep_case(tmp_path, with_token_ids: bool = True):
    """A kvscope trace of 8 sessions, an n-gram server's calibration (a small pool: the curve has an edge) and the
    first level's cell: records whose generated answers repeat a motif of their prompt (so n-gram drafts hit),
    unlike the trace's own recorded answers (random: nothing to draft from)."""
    import time as _time
    from dataclasses import asdict
    from types import SimpleNamespace

    import numpy as np
    from kvscope.harness.results.records import RequestRecord, records_frame, write_records_parquet
    from kvscope.harness.results.schemas import CalibrationCost, CalibrationFile, CalibrationServer
    from kvscope.workloads.trace import TraceBuilder

    rng = np.random.default_rng(5)
    b = TraceBuilder()
    rid = 0
    for si in range(8):
        ids: list[int] = []
        for step in range(4):
            ids = ids + [b.add_segment(rng.integers(100, 900, 120).astype(np.int32), "user")]
            out = rng.integers(100, 900, 40).astype(np.int32)
            oid = b.add_segment(out, "assistant")
            b.add_request(session_id=f"s{si}", step=step, parent_request_id=-1 if step == 0 else rid - 1,
                          arrival_s=0.0, session_start_s=0.0, prompt_segment_ids=list(ids), output_segment_id=oid,
                          output_tokens=len(out), transition="first" if step == 0 else "append")
            rid += 1
            ids = ids + [oid]
    trace = b.build({"name": "t"}).write(tmp_path / "trace")
    records = []
    for r in range(rid):
        motif = (np.arange(7) * 31 + 100 + r).tolist()
        answer = (motif * 6)[:40]
        records.append(asdict(RequestRecord(request_id=r, session_id="s", step=0, sent_s=float(r), ttft_s=0.01,
                                            tpot_s=0.005, output_tokens=40,
                                            output_token_ids=answer if with_token_ids else [])))
    cell = tmp_path / "run" / "cells" / "c1"
    cell.mkdir(parents=True)
    write_records_parquet(cell, records_frame(records))
    cal = CalibrationFile(created_at=_time.time(),
                          server=CalibrationServer(block_size=16, num_gpu_blocks=60, max_num_seqs=8,
                                                   max_num_batched_tokens=512, max_model_len=2048,
                                                   speculation="ngram:k=4,min=2,max=4"),
                          cost=CalibrationCost(base_s=0.004, per_token_s=2e-5, per_seq_s=1e-4, per_context_token_s=0.0,
                                               request_overhead_s=0.002, per_prefill_pair_s=0.0, per_spec_step_s=3e-3,
                                               per_draft_token_s=3e-4),
                          fit_r2=0.95, fit_median_rel_error=0.05)
    spec = ExperimentSpec.model_validate({**BASE, "servers": {"ngram": {}}, "replay": {"time_scale": 0},
                                          "sweep": {"levels": [1, 4, 5, 6, 8], "slo_ttft_p90": "3x_unloaded"}})
    sw = plan_sweeps(spec)[0]
    run = SimpleNamespace(run_dir=tmp_path / "run", manifest=SimpleNamespace(traces={"w": str(trace)}), spec=spec)
    entry = CellEntry(server="ngram", workload="w", load="sweep-c1", repeat=0, status="ok", dir="cells/c1")
    return sw, cal, run, entry, trace


def test_an_ngram_sweep_is_planned_from_the_drafts_of_the_answers_its_first_level_generated(tmp_path, capsys):
    from kvscope.harness.analysis.capacity_prediction import predict_curve
    from kvscope.harness.experiment.runner import _plan_speculative_sweep, _plan_sweep
    from kvscope.harness.experiment.sweep import predict_sweep, prediction_skipped

    sw, cal, run, entry, trace = _ngram_sweep_case(tmp_path)
    assert prediction_skipped(sw.spec, speculative=True, speculation=cal.server.speculation) is None
    _plan_sweep(run, sw, cal, "calibrations/ngram.json", None)
    assert sw.awaiting_speculation and not sw.planned  # the curve waits for the first level's answers
    assert sw.next_load() == 1
    sw.record(LoadPoint(1, 0.05))
    _plan_speculative_sweep(run, sw, (cal, "calibrations/ngram.json", None), entry)
    assert sw.planned and not sw.awaiting_speculation, sw.plan_note
    # every request's drafts come from the generated answers (the motif), not the trace's random ones
    assert len(sw.speculation) == 32 and all(s.accepted_tokens > 20 for s in sw.speculation.values())
    plain = predict_curve(trace, cal, [1, 2], time_scale=0).rows
    assert sw.predicted_rows[0].e2e_p50_s < 0.6 * plain[0].e2e_p50_s  # ~4 tokens a verifying step
    nxt = sw.next_load()
    assert nxt is not None and nxt != 1 and nxt in [p.load for p in sw.predicted]
    assert sw.plan_record()["plan"] == "predicted"
    pred = predict_sweep(sw, trace, cal, "calibrations/ngram.json", time_scale=0, mode="recorded")
    assert pred.get("skipped") is None and [lv["load"] for lv in pred["levels"]] == list(range(1, 9))
    assert "speculative decoding" in capsys.readouterr().out


def test_an_ngram_sweep_whose_first_level_kept_no_tokens_climbs_the_ladder_and_says_why(tmp_path):
    from kvscope.harness.experiment.runner import _plan_speculative_sweep, _plan_sweep
    from kvscope.harness.experiment.sweep import predict_sweep

    sw, cal, run, entry, trace = _ngram_sweep_case(tmp_path, with_token_ids=False)
    _plan_sweep(run, sw, cal, "calibrations/ngram.json", None)
    sw.record(LoadPoint(1, 0.05))
    _plan_speculative_sweep(run, sw, (cal, "calibrations/ngram.json", None), entry)
    assert not sw.planned and "generated no tokens" in sw.plan_note
    assert sw.next_load() == 4  # the ladder
    assert "no measured level's generated tokens" in predict_sweep(sw, trace, cal, "c.json", time_scale=0,
                                                                  mode="recorded")["skipped"]
