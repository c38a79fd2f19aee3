"""The live load sweep of an experiment: which level to run next, and each measured cell as a load point.

Why a state object per (server, workload): the next level depends on what the earlier ones measured (stop at
the first failure, then bisect), so the runner asks each sweep for its next load after every cell and
round-robins over the sweeps (all servers are up at once by default, so sweeps of different configurations
interleave like the grid's repeats). A relative SLO (``slo_ttft_p90: 3x_unloaded``) is resolved from the
sweep's own lowest level once it is measured, before any pass/fail decision needs it. While no level has
passed, a failing level does not stop an adaptive sweep: it climbs on until the server preempts (its KV
ceiling) or the levels run out, so a machine too slow for an absolute SLO still gets its latency-against-load
curve and KV ceiling rather than one point. The decision itself — pass/fail, bisection, capacity — is the pure logic
of `kvscope.harness.analysis.capacity`, which the report reads as well. A resumed run rebuilds the points from
the cells already recorded, so `--resume` continues a sweep where it stopped.

With ``sweep.predict`` (the default) each swept vLLM configuration is calibrated just before its sweep and
:func:`predict_sweep` runs the scheduler model (``kvscope capacity``'s) on the sweep's trace at the same levels,
so experiment.json — and the report's concurrency page — hold the predicted curve beside the measured one,
with both capacities read by the same rule.

With ``sweep.plan: predicted`` (the default) that curve is computed before the first level and chooses the
levels (`analysis.capacity.next_planned_level`): the unloaded one, those around the predicted edge, a bounded
search where the measurement disagrees, and one level past the measured edge. A full climb spends most of its
cells far below the edge; the model is cheap and usually within a level of it. Without a curve (session rates,
no calibration, speculative decoding whose drafts the offline model cannot compute) the sweep climbs its
ladder as above, and the record says why.

An n-gram server's curve needs each request's drafts and accepted tokens, which depend on the answers that
server generates (the offline model, ``kvscope speculate``, computes them exactly from the tokens): its sweep
measures its first level (the unloaded one) before the curve, computes every request's steps from that
cell's generated tokens (:func:`sweep_speculation`), and is planned from there like any other; its calibration
was taken on the speculative server itself, whose decode samples carry their drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from kvscope.harness.analysis.capacity import (
    Capacity,
    LevelPlan,
    LoadPoint,
    capacity_from_points,
    full_climb_levels,
    kv_ceiling,
    mean_in_flight,
    measured_bracket,
    next_bisection_load,
    next_planned_level,
    plan_from_prediction,
    point_meets_slo,
    predicted_points,
)
from kvscope.harness.analysis.capacity_prediction import predict_curve, predicted_capacity
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results.percentiles import session_bootstrap_interval
from kvscope.harness.experiment.spec import ExperimentSpec, SweepSpec, sweep_level

if TYPE_CHECKING:
    from kvscope.harness.results.schemas import CalibrationFile, CellEntry

__all__ = ["SweepState", "cell_load_figures", "plan_sweeps", "point_from_cell", "predict_sweep", "predicted_curve",
           "prediction_skipped", "sweep_speculation"]

#: The prediction covers every concurrency between the lowest and the highest swept level when there are at
#: most this many (the quickstart's 1-8: 8 model runs, 0.1 s); wider sweeps get their own levels only.
MAX_PREDICTED_LEVELS = 64


@dataclass
class SweepState:
    """One configuration's sweep on one workload: the levels measured so far and what comes next."""

    server: str
    workload: str
    spec: SweepSpec
    points: dict[float, LoadPoint] = field(default_factory=dict)
    bisections: int = 0
    stopped: str | None = None  # why the sweep ended early (a cell that never replayed: no server, …)
    #: ``sweep.plan: predicted``: the scheduler model's curve (its levels as load points), set before the first
    #: level; None: the sweep climbs its ladder (``levels``), and ``plan_note`` says why where a plan was asked.
    predicted: list[LoadPoint] | None = None
    predicted_rows: list[Any] | None = None  # the curve's LevelPredictions, reused for the record
    plan_note: str | None = None
    order: list[float] = field(default_factory=list)  # levels in the order they were measured
    #: A speculative configuration's decode steps per request id (the offline model on the tokens the server
    #: generated at the first level measured), which its predicted curve needs; None until then.
    speculation: dict[int, Any] | None = None
    #: The curve waits for the first level's generated tokens (``plan: predicted`` on a speculative server).
    awaiting_speculation: bool = False

    def set_prediction(self, rows: list[Any] | None, why_not: str | None = None) -> None:
        """The predicted curve that plans this sweep's levels, or why there is none (then: the ladder)."""
        if rows:
            self.predicted_rows, self.predicted = rows, predicted_points(rows)
        else:
            self.plan_note = why_not or "no predicted curve"

    @property
    def planned(self) -> bool:
        """Whether the predicted curve chooses the levels (else the ladder of ``levels``)."""
        return self.spec.plan == "predicted" and bool(self.predicted)

    def level_plan(self) -> LevelPlan | None:
        """The levels the predicted curve says decide the capacity, at the SLO resolved so far (None before a
        relative SLO's unloaded level answered)."""
        slo = self.slo_ms()
        if not self.planned or slo is None:
            return None
        return plan_from_prediction(self.predicted or [], slo, unloaded=self.spec.ttft_slo.unloaded_factor is not None)

    def level_name(self, load: float) -> str:
        return sweep_level(self.spec.kind, load).name or ""

    def next_load(self) -> float | None:
        """The next load to run, or None when the sweep is done."""
        if self.stopped:
            return None
        slo = self.slo_ms()
        points = list(self.points.values())
        if self.planned:
            plan = self.level_plan()
            if plan is None:  # a relative SLO: its unloaded level first
                plan = LevelPlan(tuple(p.load for p in self.predicted or []), None, None, ())
            return next_planned_level(plan, points, slo, self.spec.max_bisections)
        failed = slo is not None and any(not point_meets_slo(p, slo) for p in points)
        if failed and not any(point_meets_slo(p, slo) for p in points):  # type: ignore[arg-type]
            # nothing passed yet: climb on for the curve and the KV ceiling, unless the server preempts already
            # or a level got no answer at all (a higher one would not either)
            failed = kv_ceiling(points) is not None or any(p.ttft_p90_s is None for p in points)
        if not (self.spec.adaptive and failed):
            for level in self.spec.levels:
                if level not in self.points:
                    return level
        if not self.spec.adaptive or self.bisections >= self.spec.max_bisections:
            return None
        nxt = next_bisection_load(points, slo, self.spec.kind)  # type: ignore[arg-type]
        return nxt if nxt is not None and nxt not in self.points else None

    def record(self, point: LoadPoint | None, why: str | None = None) -> None:
        """Add a measured level; None (the cell never replayed) ends the sweep without a point."""
        if point is None:
            self.stopped = why or "a sweep cell did not run"
            return
        if point.load not in self.spec.levels:
            self.bisections += 1
        self.points[point.load] = point
        self.order.append(point.load)

    def plan_record(self) -> dict[str, Any]:
        """How the levels were chosen, for experiment.json (`SweepPlanEntry`): the predicted edge, the levels
        measured, the measured edge and the live cells a full climb would have cost more."""
        points = list(self.points.values())
        slo = self.slo_ms()
        measured = list(dict.fromkeys(self.order))
        base: dict[str, Any] = {"plan": "predicted" if self.planned else "ladder", "measured": measured,
                                "reason": None if self.planned else (self.plan_note if self.spec.plan == "predicted"
                                                                     else "sweep.plan is ladder")}
        edge = None
        if slo is not None:
            cands = sorted({*(p.load for p in self.predicted or []), *self.spec.levels, *self.points})
            lo, hi = measured_bracket(cands, points, slo)
            edge = cands[hi] if hi < len(cands) and (lo >= 0 or hi == 0) else None
        base["measured_edge"] = edge
        plan = self.level_plan()
        if not self.planned:
            base["sentence"] = (f"{self.server} on {self.workload}: measured {_levels(measured)} "
                                f"(ladder{'' if not base['reason'] else ': ' + base['reason']})")
            return base
        if plan is None or slo is None:
            base["sentence"] = (f"{self.server} on {self.workload}: measured {_levels(measured)}; the unloaded level "
                                "did not answer, so the SLO could not be resolved to plan the rest")
            return base
        full = full_climb_levels(plan.candidates, points, slo)
        saved = full - len(measured)
        what = "no edge within the levels" if plan.predicted_edge is None else f"edge {plan.predicted_edge:g}"
        got = "no edge within the levels" if edge is None else f"edge {edge:g}"
        sentence = (f"{self.server} on {self.workload}: predicted {what}, measured {got}; measured "
                    f"{_levels(measured)}: {len(measured)} of the {full} levels a full climb measures "
                    f"({saved} live cell{'s' if abs(saved) != 1 else ''} saved)")
        return {**base, "candidates": list(plan.candidates), "predicted_capacity": plan.predicted_capacity,
                "predicted_edge": plan.predicted_edge, "targets": list(plan.targets), "full_climb": full,
                "live_cells_saved": saved, "sentence": sentence}

    def capacity(self, unloaded_fallback: LoadPoint | None = None) -> Capacity:
        """The answer so far; ``unloaded_fallback`` (the scheduler model's lowest level) resolves a relative SLO
        when no level was measured."""
        return capacity_from_points(self.server, self.workload, self.spec.kind, list(self.points.values()),
                                    self.spec.ttft_slo, unloaded_fallback=unloaded_fallback,
                                    fallback_source="predicted from the calibration")

    def slo_ms(self) -> float | None:
        """The absolute TTFT p90 objective (a relative one resolved from the lowest measured level)."""
        return self.capacity().slo_ttft_p90_ms


def _levels(loads: list[float]) -> str:
    return ", ".join(f"{x:g}" for x in loads) if loads else "no level"


def plan_sweeps(spec: ExperimentSpec) -> list[SweepState]:
    if spec.sweep is None:
        return []
    return [SweepState(s, w, spec.sweep) for s in (spec.sweep.servers or list(spec.servers))
            for w in (spec.sweep.workloads or list(spec.workloads))]


def cell_load_figures(cell_dir: Path, interval: bool = True) -> tuple[float | None, tuple[float, float] | None]:
    """A replayed cell's mean sessions in flight (its records' send and completion times) and, with
    ``interval``, the 95 % bootstrap interval of its TTFT p90 over its sessions (answered requests only), from
    one read of its requests.parquet; (None, None) without records."""
    path = cell_dir / "requests.parquet"
    if not path.exists():
        return None, None
    rec = pd.read_parquet(path, columns=["session_id", "sent_s", "done_s", "ttft_s"])
    in_flight = mean_in_flight(rec["session_id"].tolist(), rec["sent_s"].to_numpy(float), rec["done_s"].to_numpy(float))
    if not interval:
        return in_flight, None
    answered = rec.dropna(subset=["ttft_s"])
    return in_flight, session_bootstrap_interval(answered["ttft_s"].to_numpy(float),
                                                 answered["session_id"].astype(str).tolist(), 90)


def point_from_cell(load: float, entry: CellEntry) -> LoadPoint | None:
    """A sweep cell's manifest entry as a load point; a cell that replayed and failed (overload errors,
    timeouts) fails the SLO; one that never replayed (the server did not start) is no measurement: None."""
    head = entry.headline
    if head is None:
        return None if entry.status != "ok" else LoadPoint(load=load, ttft_p90_s=None, preemptions=0.0,
                                                           mean_sessions_in_flight=None, cell=entry.dir)
    ok = entry.status == "ok"
    return LoadPoint(load=load, ttft_p90_s=head.ttft_p90_s if ok else None, preemptions=float(head.preemptions or 0),
                     mean_sessions_in_flight=head.mean_sessions_in_flight, cell=entry.dir,
                     ttft_p90_interval_s=head.ttft_p90_interval_s if ok else None)


def prediction_skipped(spec: SweepSpec, *, speculative: bool, speculation: str | None = None) -> str | None:
    """Why a sweep gets no predicted curve before anything is measured (None: calibrate and predict).
    ``speculative``: the configuration decodes speculatively (``Backend.speculative_decoding``);
    ``speculation``: as a spec the offline model computes (``Backend.speculation``: n-gram), else None."""
    if not spec.predict:
        return "sweep.predict is off"
    if spec.kind != "concurrency":
        return "the scheduler model predicts closed-loop concurrency levels, not session rates"
    if speculative and not speculation:
        return ("this speculative decoding is not modelled: its drafts cannot be computed from the tokens "
                "(the offline model computes n-gram)")
    return None


def sweep_speculation(trace_dir: Path, cal: CalibrationFile, cell_dir: Path, *, mode: str) -> dict[int, Any]:
    """A speculative server's decode steps per request of the sweep's trace: the offline model
    (``cal.server.speculation``) on the tokens the server generated in one measured cell (its records'
    ``output_token_ids``).  Why from a cell and not the trace: n-gram drafts against the server's own answer,
    and the trace's recorded answers are another model's.  At temperature 0 a request's answer does not depend
    on the load, so the first level measured serves every level; a request that cell did not answer decodes
    one token a step.  Empty where the records keep no token ids."""
    # deferred, as every use of the scheduler model here: a sweep without speculation never loads them
    from kvscope.harness.analysis.speculative import generated_speculation
    from kvscope.harness.cachemodel.spec_predict import parse_speculative
    from kvscope.harness.results.records import read_records
    from kvscope.workloads.trace import Trace

    cfg = parse_speculative(cal.server.speculation or "").offline_config()
    return generated_speculation(Trace.read(trace_dir), read_records(cell_dir), cfg, live=mode == "live",
                                 max_model_len=cal.server.max_model_len)


def curve_levels(state: SweepState) -> list[int]:
    """The concurrencies the predicted curve covers: every one from the lowest to the highest swept level (or,
    for a sweep wider than :data:`MAX_PREDICTED_LEVELS`, the spec's levels and every level measured)."""
    levels = sorted({int(x) for x in state.spec.levels} | {int(x) for x in state.points})
    if levels[-1] - levels[0] <= MAX_PREDICTED_LEVELS:  # every level in between: the model is cheap, and the
        levels = list(range(levels[0], levels[-1] + 1))  # predicted capacity then has the resolution of one
    return levels


def predicted_curve(state: SweepState, trace_dir: Path, cal: CalibrationFile, *, time_scale: float,
                    mode: str) -> list[Any]:
    """The scheduler model's `LevelPrediction` per level of :func:`curve_levels` for the sweep's trace; the
    same rows plan a ``sweep.plan: predicted`` sweep before it starts and are recorded beside it after.
    `CalibrationFitError` (a ValueError) when the calibration's fit is too poor to predict from."""
    # deferred, as every use of the scheduler model here: a sweep without ``predict`` never loads it
    return predict_curve(trace_dir, cal, curve_levels(state), time_scale=time_scale, mode=mode,
                         speculation=state.speculation).rows


def predict_sweep(state: SweepState, trace_dir: Path, cal: CalibrationFile, calibration_rel: str, *,
                  time_scale: float, mode: str) -> dict[str, Any]:
    """The scheduler model's curve for this sweep (:func:`curve_levels`; the rows that planned it where they
    cover every level measured), with the capacity read by the live rule (`capacity_from_points`) and the
    eviction cliff; a dict of `PredictedCapacity` for experiment.json.  Why every level: a bisecting sweep
    measures few of them, and a prediction limited to those said 4 on the quickstart where its own curve at 5
    passes (measured: 6)."""
    base = {"calibration": calibration_rel, "fit_r2": cal.fit_r2}
    if cal.server.speculation and not state.speculation:
        return {**base, "skipped": "speculative decoding: no measured level's generated tokens to compute the "
                                   "drafts from"}
    rows = state.predicted_rows
    if rows is None or [r.concurrency for r in rows] != curve_levels(state):
        try:
            rows = predicted_curve(state, trace_dir, cal, time_scale=time_scale, mode=mode)
        except ValueError as exc:
            return {**base, "skipped": str(exc)}

    def num(x: float) -> float | None:
        return nan_to_none(x, float)  # NaN (no request finished) -> null

    points = predicted_points(rows)
    live = state.capacity(unloaded_fallback=points[0] if points else None)
    # the measured sweep's absolute SLO (a relative one resolved from its lowest level), so both capacities
    # answer the same objective; the model's own lowest level only where nothing was measured
    slo = live.slo_ttft_p90_ms
    cap, cliff = predicted_capacity(rows, slo if slo is not None else 0.0, server=state.server,
                                    workload=state.workload)
    measured = live.capacity
    held = "none of the levels" if cap.capacity is None else f"{int(cap.capacity)} concurrent sessions"
    sentence = (f"the scheduler model, calibrated on {state.server} before the sweep, predicts {held} at "
                f"{live.slo_text()}" + ("" if measured is None else f" (measured: {int(measured)})")
                + (f"; eviction cliff at {cliff}" if cliff else "; no eviction cliff within the levels"))
    return {**base, "capacity": cap.capacity, "cliff": cliff, "sentence": sentence,
            "levels": [{"load": float(r.concurrency), "hit_rate": r.token_hit_rate, "ttft_p50_s": num(r.ttft_p50_s),
                        "ttft_p90_s": num(r.ttft_p90_s), "e2e_p50_s": num(r.e2e_p50_s),
                        "preemptions": float(r.preemptions), "kv_usage_max": r.kv_usage_max, "runs": r.runs,
                        "preemptions_p10": r.preemptions_p10, "preemptions_p50": r.preemptions_p50,
                        "preemptions_p90": r.preemptions_p90}
                       for r in rows]}
