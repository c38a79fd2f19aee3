"""`prediction.json` (`kvscope predict --out`): a trace's predicted serving on a named GPU and model.

Why a file: a prediction is an answer other stages read as data (the report's "On your GPU" section, the
validation against published measurements, a notebook); like every kvscope result it is a typed, versioned
pydantic model, so a field this kvscope does not know fails at write time and a file of another version is
refused with one line.  Every figure in it is *predicted*: the step costs, efficiency factors and memory plan
it came from are in the file beside it.

Layout (version 1): the deployment (GPU, model, TP, memory plan, server settings, the efficiency factors or
the calibration used), the speculative configuration if any, one row per request at the chosen load
(``requests``), the run's totals (``run``), the load curve over concurrency or request rate (``load_curve``)
with the eviction cliff and the SLO capacity read off it, and the cost at a GPU-hour price.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Literal, get_type_hints

from kvscope.harness.cachemodel.gpu_predict import RequestPrediction
from kvscope.harness.common.errors import KvscopeError
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.pricing.gpu_cost import ServingCost
from kvscope.workloads.versioned_file import VersionedFile, read_versioned, write_versioned
from pydantic import BaseModel, ConfigDict, create_model

PREDICTION_NAME = "prediction.json"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


#: The per-request times the model leaves NaN for a request it never served; the file writes them as null.
_TIMES = ("ttft_s", "tpot_s", "itl_s", "e2e_s")

#: One row per request: the model's own record (:class:`~kvscope.harness.cachemodel.gpu_predict.RequestPrediction`,
#: whose fields say what each is), as file fields, so the two cannot drift apart.
PredictedRequest = create_model(
    "PredictedRequest", __base__=_Strict, __module__=__name__,
    **{name: (hint | None if name in _TIMES else hint, ...)  # type: ignore[call-overload]
       for name, hint in get_type_hints(RequestPrediction).items()})


def predicted_request(r: RequestPrediction) -> PredictedRequest:  # type: ignore[valid-type]
    """The file row of one predicted request (NaN times as null)."""
    row = asdict(r)
    return PredictedRequest(**{**row, **{k: nan_to_none(row[k]) for k in _TIMES}})


class RunSummary(_Strict):
    """The run at the chosen load (``concurrency`` sessions, or the trace's own arrivals when None)."""

    concurrency: int | None
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    token_hit_rate: float
    makespan_s: float
    busy_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    ttft_p99_s: float | None
    tpot_mean_s: float | None
    tpot_p90_s: float | None
    itl_mean_s: float | None
    e2e_mean_s: float | None
    e2e_p90_s: float | None
    preemptions: int
    kv_usage_mean: float
    kv_usage_max: float
    #: Share of requests meeting the SLO (TTFT and TPOT), and such requests per second.
    goodput_share: float
    goodput_requests_per_s: float


class LoadPoint(_Strict):
    """One load level: ``load`` is a concurrency (closed loop) or a multiple of the trace's request rate."""

    load: float
    token_hit_rate: float
    ttft_p50_s: float | None
    ttft_p90_s: float | None
    tpot_p50_s: float | None
    e2e_p50_s: float | None
    output_tokens_per_s: float
    goodput_share: float
    preemptions: int
    kv_usage_max: float
    meets_slo: bool
    #: CPU seconds the scheduler model took for this load.
    simulate_s: float


class Deployment(_Strict):
    gpu: str
    gpu_name: str
    gpu_source: str | None
    model: str
    params_total: int
    params_active: int
    tp: int
    weight_dtype: str
    kv_cache_dtype: str
    weight_gib_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    available_kv_gib_per_gpu: float
    num_gpu_blocks: int
    kv_cache_tokens: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float


class StepModel(_Strict):
    """Where the step costs came from: the roofline with these factors, or a calibration file."""

    kind: Literal["roofline", "calibration"]
    mfu: float | None = None
    bandwidth_efficiency: float | None = None
    step_overhead_ms: float | None = None
    allreduce_latency_us: float | None = None
    request_overhead_ms: float | None = None
    source: str


class Slo(_Strict):
    ttft_ms: float | None
    tpot_ms: float | None


class PredictionFile(VersionedFile):
    FORMAT = "kvscope-prediction"
    SUPPORTED_VERSIONS = (1,)

    format: Literal["kvscope-prediction"] = "kvscope-prediction"
    version: int = 1
    predicted: Literal[True] = True
    trace: str
    load_kind: Literal["concurrency", "rate_multiplier"]
    deployment: Deployment
    step_model: StepModel
    speculative: str | None = None
    slo: Slo
    run: RunSummary
    load_curve: list[LoadPoint]
    #: First load whose hit rate is more than ``cliff_drop_pp`` points below the lowest load's; None if none.
    eviction_cliff_load: float | None
    cliff_drop_pp: float
    #: Highest load of the curve meeting the SLO (TTFT p90 and TPOT p50 within it, no preemption).
    slo_capacity_load: float | None
    cost: ServingCost | None
    requests: list[PredictedRequest]  # type: ignore[valid-type]
    predict_s: float


def write_prediction_file(path: str | Path, data: PredictionFile) -> Path:
    return write_versioned(Path(path), data)


def load_prediction_file(path: str | Path) -> PredictionFile:
    return read_versioned(Path(path), PredictionFile, KvscopeError)
