"""Predicted load curve from the scheduler model: hit rate, TTFT/e2e percentiles, preemptions and KV usage
per closed-loop concurrency level, with the eviction cliff and the SLO capacity read off it.

Definitions (the same rule the live sweep applies to measured cells, so predicted and measured capacities
compare like for like): a level *meets the SLO* when its TTFT p90 is at most the SLO and nothing was
preempted; the *capacity* is the highest level below the first failing one.  The *cliff* is the first level
whose token hit rate is more than ``cliff_drop_pp`` percentage points below the lowest level's.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Sequence

from kvscope.harness.cachemodel.calibration import StepCostModel
from kvscope.harness.cachemodel.scheduler import ScheduleRun, SchedulerConfig, SessionTiming, run_scheduler
from kvscope.harness.cachemodel.sim_types import SimRequest

if TYPE_CHECKING:
    import pandas as pd

DEFAULT_LEVELS = (1, 2, 4, 8, 16, 32)
#: Replay-informed with token pacing: step costs at this share of the calibration's (see replay_informed).
PACED_COST_SCALE = 0.5


@dataclass(frozen=True)
class LevelPrediction:
    concurrency: int
    requests: int
    token_hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    e2e_p50_s: float
    e2e_p90_s: float
    preemptions: int
    kv_usage_mean: float
    kv_usage_max: float
    makespan_s: float
    simulate_s: float


def _pct(values: list[float], q: float) -> float:
    import numpy as np

    return float(np.percentile(values, q)) if values else math.nan


def summarize_run(run: ScheduleRun, concurrency: int, simulate_s: float = 0.0) -> LevelPrediction:
    done = [r for r in run.results if r.fits and not math.isnan(r.done_s)]
    prompt = sum(r.prompt_tokens for r in run.results)
    cached = sum(r.cached_tokens for r in run.results)
    ttft = [r.ttft_s for r in done]
    e2e = [r.e2e_s for r in done]
    return LevelPrediction(concurrency, len(run.results), cached / prompt if prompt else 0.0,
                           _pct(ttft, 50), _pct(ttft, 90), _pct(ttft, 99), _pct(e2e, 50), _pct(e2e, 90),
                           run.preemptions, run.kv_usage_mean, run.kv_usage_max, run.makespan_s, simulate_s)


def prompt_blocks_only(requests: Sequence[SimRequest], block_size: int) -> list[SimRequest]:
    """The requests with their output blocks' content unknown (never hit): what a recorded-mode replay, which
    sends the trace's assistant tokens rather than the server's, lets vLLM reuse."""
    from dataclasses import replace

    return [replace(r, hashes=r.hashes[: r.prompt_tokens // block_size]) for r in requests]


def predict_levels(requests: Sequence[SimRequest], config: SchedulerConfig, cost: StepCostModel,
                   levels: Sequence[int] = DEFAULT_LEVELS, *, time_scale: float = 1.0,
                   mode: str = "recorded") -> list[LevelPrediction]:
    """One closed-loop scheduler run per concurrency level.  ``mode`` as in replay: ``recorded`` (prompts carry
    the trace's assistant tokens, so output blocks never hit) or ``live`` (they carry the server's own output,
    which the trace's output tokens stand for)."""
    if mode not in ("recorded", "live"):
        raise ValueError(f"mode {mode!r}: recorded or live")
    if mode == "recorded":
        requests = prompt_blocks_only(requests, config.block_size)
    out = []
    for c in levels:
        t0 = time.perf_counter()
        run = run_scheduler(requests, config, cost, SessionTiming(concurrency=int(c), time_scale=time_scale))
        out.append(summarize_run(run, int(c), time.perf_counter() - t0))
    return out


def find_cliff(rows: Sequence[LevelPrediction], cliff_drop_pp: float = 5.0) -> int | None:
    """First level whose hit rate is more than ``cliff_drop_pp`` points below the lowest level's."""
    if not rows:
        return None
    base = rows[0].token_hit_rate
    for r in rows[1:]:
        if (base - r.token_hit_rate) * 100.0 > cliff_drop_pp:
            return r.concurrency
    return None


def find_capacity(rows: Sequence[LevelPrediction], slo_ttft_ms: float) -> int | None:
    """Highest level before the first that misses the SLO (TTFT p90 above it, or any preemption)."""
    best = None
    for r in rows:
        if math.isnan(r.ttft_p90_s) or r.ttft_p90_s * 1000.0 > slo_ttft_ms or r.preemptions:
            break
        best = r.concurrency
    return best


def predicted_curve(requests: Sequence[SimRequest], config: SchedulerConfig, cost: StepCostModel,
                    levels: Sequence[int] = DEFAULT_LEVELS, *, time_scale: float = 1.0,
                    mode: str = "recorded") -> "pd.DataFrame":
    """The predicted curve as a DataFrame (one row per level, the columns of :class:`LevelPrediction`),
    for notebooks that plot it beside the measured sweep."""
    import pandas as pd

    return pd.DataFrame([asdict(r) for r in predict_levels(requests, config, cost, levels,
                                                           time_scale=time_scale, mode=mode)])


def replay_informed(requests: Sequence[SimRequest], arrivals_s: Sequence[float], output_tokens: Sequence[int],
                    config: SchedulerConfig, cost: StepCostModel,
                    done_s: Sequence[float] | None = None,
                    token_times_s: Sequence[Sequence[float]] | None = None) -> ScheduleRun:
    """Predict a real run's per-request ``cached_tokens`` from its send times (``sent_s``).

    ``requests`` are the requests as sent (prompt hashes), ``output_tokens`` what the server generated.  The
    output tokens' content is taken as unknown (a recorded-mode replay sends the trace's assistant tokens, not
    the server's), so only prompt blocks can hit; each request arrives at its ``sent_s``, no session gating.
    With ``done_s`` (the run's departure times, same clock) each request also leaves when it left the server
    (see ``scheduler._Pinned``); with ``token_times_s`` too (when each output token reached the client), no
    decode step runs ahead of the run's own tokens, and the step costs are taken at
    :data:`PACED_COST_SCALE` of the calibration's.

    Why scale them down: pacing holds a model that runs ahead of the run, not one that lags behind it, so the
    model is made fast and the run's own token times set the pace.  On four quiet-machine 64-block runs at
    concurrency 8 the exact share was 85-92 % at the calibrated costs and 92-96 % at half of them (97-99 % ->
    99-100 % at 16, 97 -> 99 % at 32, 100 % kept at 1-4); a tenth or a third did about as well as a half.
    """
    from dataclasses import replace

    reqs = [replace(r, output_tokens=max(int(o), 1), gap_s=None)
            for r, o in zip(prompt_blocks_only(requests, config.block_size), output_tokens)]
    if token_times_s is not None:
        cost = cost.scaled(PACED_COST_SCALE)
    return run_scheduler(reqs, config, cost, SessionTiming(arrivals_s=list(arrivals_s),
                                                           done_s=None if done_s is None else list(done_s),
                                                           token_times_s=token_times_s))
