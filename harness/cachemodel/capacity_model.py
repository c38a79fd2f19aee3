"""Predicted load curve from the scheduler model: hit rate, TTFT/e2e percentiles, preemptions and KV usage
per closed-loop concurrency level, with the eviction cliff read off it.

A level whose pool comes near full is predicted by an *ensemble*: :data:`ENSEMBLE_RUNS` runs of the scheduler
model, each with the host's timing noise (:class:`~.scheduler.TimingNoise`, its size measured by the
calibration), and the level reports their mean, with the spread of the preemption count.  Why: which request
is running when the pool runs dry turns on step and arrival times milliseconds apart, so one noise-free run
gives one draw of a chaotic count (on the validation trace: 9 or 20 preemptions at concurrency 16 as one cost
coefficient doubled; 14 or 26 at 32 as the lag went from 8 to 24 ms).  Against 12 measured runs a level on
the validation server (64 blocks, 422-request agent trace, three server sessions), five calibrations'
ensembles came within 15 % of the measured mean preemptions at 8, 16 and 32 (benchmarks/README.md, "An
ensemble for the counts").  A level far from the pool's limit is not perturbed (one run): noise cannot make a
pool run dry that never came near it.

The *capacity* is read from these rows by the live sweep's own rule (``analysis.capacity``), the *cliff* here:
the first level whose token hit rate is more than ``cliff_drop_pp`` percentage points below the lowest
level's.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.scheduler import (ScheduleRun, SchedulerConfig, SessionTiming, TimingNoise,
                                                   run_scheduler)
from kvscope.harness.cachemodel.sim_types import SimRequest

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
#: Replay-informed with token pacing: step costs at this share of the calibration's (see replay_informed).
PACED_COST_SCALE = 0.5
#: Runs of a level's ensemble (seeds 0..N-1, so a prediction is reproducible) ...
ENSEMBLE_RUNS = 16
#: ... at most this many prompt tokens simulated a level, summed over the runs: a simulation's cost grows with
#: the prompt tokens it walks, so the full-size 100-session agent preset (621 M prompt tokens) gets one run
#: and a level stays within seconds, while a 422-request validation trace (0.4 M) gets all 16 (timings:
#: benchmarks/README.md, "Figures the design notes cite").
ENSEMBLE_TOKEN_BUDGET = 600_000_000
#: A level whose noise-free run preempted nothing and never held more than this share of the pool is one run.
ENSEMBLE_KV_THRESHOLD = 0.9
#: Timing noise (coefficient of variation of a step's and of a request's lag) when the calibration has none.
DEFAULT_TIMING_CV = 0.15
#: Hit-rate drop (percentage points below the lowest level) that marks the eviction cliff by default.
DEFAULT_CLIFF_DROP_PP = 5.0


@dataclass(frozen=True)
class LevelPrediction:
    """One concurrency level: means over the level's runs (one, or an ensemble), and the spread of the
    preemption count over them."""

    concurrency: int
    requests: int
    token_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    #: Mean preemptions a run.
    preemptions: float
    kv_usage_mean: float
    kv_usage_max: float
    makespan_s: float
    simulate_s: float
    #: Runs behind the means: 1 (noise-free) or the ensemble (:func:`ensemble_size`).
    runs: int = 1
    #: 10th / 50th / 90th percentile of the runs' preemption counts: where one measured run may land.
    preemptions_p10: float = 0.0
    preemptions_p50: float = 0.0
    preemptions_p90: float = 0.0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def _one_run(run: ScheduleRun) -> dict[str, float]:
    done = [r for r in run.results if r.fits and not math.isnan(r.done_s)]
    prompt = sum(r.prompt_tokens for r in run.results)
    cached = sum(r.cached_tokens for r in run.results)
    ttft = [r.ttft_s for r in done]
    e2e = [r.e2e_s for r in done]
    return {"token_hit_rate": cached / prompt if prompt else 0.0, "ttft_p50_s": _pct(ttft, 50),
            "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99), "e2e_p50_s": _pct(e2e, 50),
            "e2e_p90_s": _pct(e2e, 90), "preemptions": float(run.preemptions), "kv_usage_mean": run.kv_usage_mean,
            "kv_usage_max": run.kv_usage_max, "makespan_s": run.makespan_s}


def summarize_runs(runs: Sequence[ScheduleRun], concurrency: int, simulate_s: float = 0.0) -> LevelPrediction:
    """One level from its runs: each figure the mean over the runs (a NaN percentile where a run finished
    nothing stays NaN), the preemption count's percentiles beside its mean."""
    per = [_one_run(r) for r in runs]
    mean = {k: statistics.fmean(p[k] for p in per) for k in per[0]}
    counts = [p["preemptions"] for p in per]
    return LevelPrediction(concurrency, len(runs[0].results), simulate_s=simulate_s, runs=len(runs),
                           preemptions_p10=_pct(counts, 10), preemptions_p50=_pct(counts, 50),
                           preemptions_p90=_pct(counts, 90), **mean)


def prompt_blocks_only(requests: Sequence[SimRequest], block_size: int) -> list[SimRequest]:
    """The requests with their output blocks' content unknown (never hit): what a recorded-mode replay, which
    sends the trace's assistant tokens rather than the server's, lets vLLM reuse."""
    return [replace(r, hashes=r.hashes[: r.prompt_tokens // block_size]) for r in requests]


def predict_levels(requests: Sequence[SimRequest], config: SchedulerConfig, cost: StepCostModel,
                   levels: Sequence[int] = DEFAULT_LEVELS, *, time_scale: float = 1.0,
                   mode: str = "recorded", timing_cv: float | None = None,
                   ensemble_runs: int | None = None) -> list[LevelPrediction]:
    """Closed-loop scheduler runs per concurrency level.  ``mode`` as in replay: ``recorded`` (prompts carry
    the trace's assistant tokens, so output blocks never hit) or ``live`` (they carry the server's own output,
    which the trace's output tokens stand for).  ``timing_cv`` is the host's timing noise (the calibration's
    ``timing_cv``; None: :data:`DEFAULT_TIMING_CV`).  ``ensemble_runs``: the runs of a level near a full pool
    (None: :func:`ensemble_size`; 1: the noise-free run alone)."""
    if mode not in ("recorded", "live"):
        raise ValueError(f"mode {mode!r}: recorded or live")
    if mode == "recorded":
        requests = prompt_blocks_only(requests, config.block_size)
    cv = DEFAULT_TIMING_CV if timing_cv is None else timing_cv
    if ensemble_runs is None:
        ensemble_runs = ensemble_size(sum(r.prompt_tokens for r in requests))
    out = []
    for c in levels:
        t0 = time.perf_counter()
        timing = SessionTiming(concurrency=int(c), time_scale=time_scale)
        runs = [run_scheduler(requests, config, cost, timing)]
        near_full = runs[0].preemptions > 0 or runs[0].kv_usage_max > ENSEMBLE_KV_THRESHOLD
        if ensemble_runs > 1 and near_full and cv > 0 and config.num_gpu_blocks is not None:
            runs = [run_scheduler(requests, config, cost, timing, noise=TimingNoise(cv, cv, seed))
                    for seed in range(ensemble_runs)]
        out.append(summarize_runs(runs, int(c), time.perf_counter() - t0))
    return out


def ensemble_size(prompt_tokens: int) -> int:
    """Runs of a level near a full pool for a trace of this many prompt tokens: :data:`ENSEMBLE_RUNS`, fewer
    where they would simulate more than :data:`ENSEMBLE_TOKEN_BUDGET` tokens (never fewer than one)."""
    return max(1, min(ENSEMBLE_RUNS, ENSEMBLE_TOKEN_BUDGET // max(prompt_tokens, 1)))


def find_cliff(rows: Sequence[LevelPrediction], cliff_drop_pp: float = DEFAULT_CLIFF_DROP_PP) -> int | None:
    """First level whose hit rate is more than ``cliff_drop_pp`` points below the lowest level's."""
    if not rows:
        return None
    base = rows[0].token_hit_rate
    for r in rows[1:]:
        if (base - r.token_hit_rate) * 100.0 > cliff_drop_pp:
            return r.concurrency
    return None


def replay_informed(requests: Sequence[SimRequest], arrivals_s: Sequence[float], output_tokens: Sequence[int],
                    config: SchedulerConfig, cost: StepCostModel,
                    done_s: Sequence[float] | None = None,
                    token_times_s: Sequence[Sequence[float]] | None = None,
                    output_blocks_known: bool = False) -> ScheduleRun:
    """Predict a real run's per-request ``cached_tokens`` from its send times (``sent_s``).

    ``requests`` are the requests as sent (prompt hashes), ``output_tokens`` what the server generated.  The
    output tokens' content is taken as unknown (a recorded-mode replay sends the trace's assistant tokens, not
    the server's), so only prompt blocks can hit, unless ``output_blocks_known``: then ``requests`` carry the
    hashes of the tokens the server really generated (the replay's own, ``replay/predict.py``), which a
    live-mode replay's next prompt does reuse.  Each request arrives at its ``sent_s``, no session gating.
    With ``done_s`` (the run's departure times, same clock) each request also leaves when it left the server
    (see ``scheduler._Pinned``); with ``token_times_s`` too (when each output token reached the client), no
    decode step runs ahead of the run's own tokens, and the step costs are taken at
    :data:`PACED_COST_SCALE` of the calibration's.

    Why scale them down: pacing holds a model that runs ahead of the run, not one that lags behind it, so the
    model is made fast and the run's own token times set the pace.  On four quiet-machine 64-block runs at
    concurrency 8 the exact share was 85-92 % at the calibrated costs and 92-96 % at half of them (97-99 % ->
    99-100 % at 16, 97 -> 99 % at 32, 100 % kept at 1-4); a tenth or a third did about as well as a half.
    """
    known = list(requests) if output_blocks_known else prompt_blocks_only(requests, config.block_size)
    reqs = [replace(r, output_tokens=max(int(o), 1), gap_s=None) for r, o in zip(known, output_tokens)]
    if token_times_s is not None:
        cost = cost.scaled(PACED_COST_SCALE)
    return run_scheduler(reqs, config, cost, SessionTiming(arrivals_s=list(arrivals_s),
                                                           done_s=None if done_s is None else list(done_s),
                                                           token_times_s=token_times_s))
