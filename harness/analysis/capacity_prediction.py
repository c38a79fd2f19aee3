"""The predicted-capacity pipeline: a calibrated server and a trace in, the scheduler model's load curve, its
SLO capacity and its eviction cliff out.

Why one pipeline: ``kvscope capacity`` (the CLI) and an experiment's concurrency sweep (``sweep.predict``)
answer the same question — how many concurrent sessions this server holds for this trace — and their answers
are put beside each other and beside the measured sweep. Written twice, the fit check, the server model, the
trace read at the server's block size, or how the capacity is read off the curve could drift apart; here each
is written once, and the two callers differ only in the levels they ask for and how they word their output.
The capacity is read from the curve by the live sweep's own rule (:func:`~.capacity.capacity_from_points`
over :func:`~.capacity.predicted_points`), so a predicted capacity means what a measured one means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvscope.harness.analysis.capacity import Capacity, TtftSlo, capacity_from_points, predicted_points
from kvscope.harness.cachemodel.calibration import MIN_FIT_R2
from kvscope.harness.cachemodel.capacity_model import DEFAULT_CLIFF_DROP_PP, find_cliff, predict_levels
from kvscope.harness.cachemodel.gpu_predict import attach_speculation
from kvscope.harness.cachemodel.trace_io import load_trace

if TYPE_CHECKING:
    from kvscope.harness.cachemodel.capacity_model import LevelPrediction
    from kvscope.harness.cachemodel.scheduler import SchedulerConfig
    from kvscope.harness.cachemodel.speculative import RequestSpeculation
    from kvscope.harness.results.schemas import CalibrationFile


class CalibrationFitError(ValueError):
    """The calibration's step-cost fit explains too little of its timings to predict from."""

    def __init__(self, fit_r2: float, min_fit_r2: float) -> None:
        self.fit_r2, self.min_fit_r2 = fit_r2, min_fit_r2
        super().__init__(f"the calibration's step-cost fit is too poor to predict from (R² {fit_r2:.2f} < "
                         f"{min_fit_r2:g})")


@dataclass(frozen=True)
class PredictedCurve:
    """The scheduler model's rows (one `LevelPrediction` per concurrency level) and the server model behind
    them (the calibration's, with any what-if ``num_gpu_blocks``)."""

    rows: list[LevelPrediction]
    config: SchedulerConfig


def predict_curve(trace_dir: str | Path, cal: CalibrationFile, levels: Sequence[int], *,
                  num_gpu_blocks: int | None = None, time_scale: float = 1.0, mode: str = "recorded",
                  ensemble_runs: int | None = None, min_fit_r2: float = MIN_FIT_R2,
                  speculation: Mapping[int, RequestSpeculation] | None = None) -> PredictedCurve:
    """Run the trace through the scheduler model of the calibrated server at each closed-loop concurrency of
    ``levels`` (``predict_levels``: an ensemble with the calibration's timing noise near a full pool).
    ``speculation``: a speculative server's decode steps per request id (drafts and accepted tokens, the
    offline model's on the tokens it generated: :func:`~.speculative.generated_speculation`); a request
    without an entry decodes one token a step.
    :class:`CalibrationFitError` (before the trace is read) when the fit's R² is below ``min_fit_r2``."""
    if not cal.fit_r2 >= min_fit_r2:
        raise CalibrationFitError(cal.fit_r2, min_fit_r2)
    cfg = cal.scheduler_config(num_gpu_blocks)
    requests = load_trace(trace_dir, cfg.block_size).requests
    if speculation:
        requests = attach_speculation(requests, {rid: (s.drafted, s.accepted) for rid, s in speculation.items()})
    rows = predict_levels(requests, cfg, cal.cost_model(), levels, time_scale=time_scale, mode=mode,
                          timing_cv=cal.timing_cv, ensemble_runs=ensemble_runs)
    return PredictedCurve(rows, cfg)


def predicted_capacity(rows: Sequence[LevelPrediction], slo_ttft_p90: float | TtftSlo, *,
                       server: str = "server", workload: str = "trace",
                       cliff_drop_pp: float = DEFAULT_CLIFF_DROP_PP) -> tuple[Capacity, int | None]:
    """The capacity the curve's levels give at the SLO (absolute ms, or relative to the curve's own lowest
    level), and the eviction cliff: the first level whose hit rate is more than ``cliff_drop_pp`` points
    below the lowest level's (None: none within the levels)."""
    capacity = capacity_from_points(server, workload, "concurrency", predicted_points(rows), slo_ttft_p90,
                                    points_source="predicted")
    return capacity, find_cliff(rows, cliff_drop_pp)


__all__ = [
    "DEFAULT_CLIFF_DROP_PP",
    "CalibrationFitError",
    "PredictedCurve",
    "predict_curve",
    "predicted_capacity",
]
