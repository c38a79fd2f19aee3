"""Predict a workload on a named GPU and model: KV pool, step costs, per-request latencies, load curve.

API (what ``kvscope predict`` and the published-measurement validation call)::

    from kvscope.harness.cachemodel.gpu_predict import (ServerSettings, plan_deployment, predict_workload,
                                                        synthetic_requests)
    reqs = synthetic_requests(input_tokens=[1000] * 64, output_tokens=[200] * 64,
                              arrivals_s=[i / 4 for i in range(64)])       # or a trace's SimRequests
    dep = plan_deployment("h100-sxm", "llama-3.1-8b", tp=1,
                          settings=ServerSettings(max_num_seqs=256, max_num_batched_tokens=8192))
    out = predict_workload(reqs, dep)                  # arrivals as given (open loop) ...
    out = predict_workload(reqs, dep, concurrency=16)  # ... or a closed loop of 16 sessions/requests
    out.requests[0].ttft_s, out.requests[0].tpot_s, out.requests[0].e2e_s, out.requests[0].cached_tokens
    out.output_tokens_per_s, out.makespan_s

* ``plan_deployment`` checks the TP degree against the heads, sizes weights and the KV pool per GPU the way
  vLLM does (``total x gpu_memory_utilization - weights - activations - non-torch``, then
  ``// (block_size x KV bytes per token)``) and raises :class:`DoesNotFit` when there is no room; it builds the
  :class:`~.roofline.RooflineStepCost`.  ``efficiency=`` replaces the GPU's default factors; ``cost=`` any
  :class:`~.step_cost.StepCost` (e.g. a CPU calibration's ``StepCostModel``) replaces the roofline entirely.
* ``predict_workload`` runs the requests through :mod:`.scheduler` (continuous batching, ``max_num_seqs``,
  the token budget with chunked prefill, preemption, prefix caching in the deployment's pool).  Requests with
  ``spec_drafted``/``spec_accepted`` (:func:`attach_speculation`, from ``speculative.py``) decode
  speculatively.
* Each request's TTFT counts from when it was sent (the frontend's ``request_overhead_ms`` included), TPOT is
  ``(e2e - ttft) / (output - 1)`` (vLLM's), ITL the mean gap between the request's token-emitting steps
  (equal to TPOT without speculation; with it, a step emits ``1 + accepted`` tokens).
"""

from __future__ import annotations

import math
import itertools

import numpy as np
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvscope.harness.cachemodel.calibration import prefill_pairs
from kvscope.harness.cachemodel.gpus import Efficiency, GpuPreset, get_gpu
from kvscope.harness.cachemodel.kv_memory import GiB, dtype_bytes, kv_bytes_per_token
from kvscope.harness.cachemodel.model_config import ModelConfig, load_model_config
from kvscope.harness.cachemodel.roofline import RooflineStepCost, roofline_step_cost
from kvscope.harness.cachemodel.scheduler import SchedulerConfig, ScheduleRun, SessionTiming, run_scheduler
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.step_cost import StepCost

#: vLLM's CUDA block size (FlashAttention); the CPU backend's is 128.
GPU_BLOCK_SIZE = 16
#: Memory vLLM leaves outside torch's allocator and the KV cache: CUDA context, NCCL buffers, CUDA graphs
#: (an estimate; vLLM logs the real figure as "non-torch memory" and the graph pool at start-up).
NON_TORCH_GIB = 1.5


class DoesNotFit(ValueError):
    """The model's weights (or one request's KV) do not fit in the GPU memory vLLM may use."""


@dataclass(frozen=True)
class ServerSettings:
    """The vLLM server flags the prediction depends on (defaults: vLLM's OpenAI server on a GPU)."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = GPU_BLOCK_SIZE
    gpu_memory_utilization: float = 0.92
    #: ``--kv-cache-dtype``: auto (the model's dtype), fp8, ...
    kv_cache_dtype: str = "auto"
    #: Weights' dtype (None: the model's; fp8 for an fp8-quantized checkpoint: fp8 tensor cores where present).
    weight_dtype: str | None = None
    enable_chunked_prefill: bool = True
    #: ``--num-gpu-blocks-override``: the pool size instead of the memory arithmetic.
    num_gpu_blocks: int | None = None

    def scheduler_config(self, num_gpu_blocks: int | None) -> SchedulerConfig:
        return SchedulerConfig(block_size=self.block_size, num_gpu_blocks=num_gpu_blocks,
                               max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               enable_chunked_prefill=self.enable_chunked_prefill)


@dataclass(frozen=True)
class Deployment:
    """A model on a TP group of one GPU kind with its server settings: memory plan and step cost."""

    gpu: GpuPreset
    model: ModelConfig
    tp: int
    settings: ServerSettings
    efficiency: Efficiency
    weight_bytes_per_gpu: float
    kv_bytes_per_token_per_gpu: float
    activation_bytes_per_gpu: float
    available_kv_bytes_per_gpu: float
    #: vLLM's ``num_gpu_blocks`` (the null block included).
    num_gpu_blocks: int
    cost: StepCost

    @property
    def kv_cache_tokens(self) -> int:
        return (self.num_gpu_blocks - 1) * self.settings.block_size

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return self.settings.scheduler_config(self.num_gpu_blocks)

    def summary(self) -> dict:
        return {"gpu": self.gpu.key, "model": self.model.name, "tp": self.tp,
                "weight_gib_per_gpu": self.weight_bytes_per_gpu / GiB,
                "kv_bytes_per_token_per_gpu": self.kv_bytes_per_token_per_gpu,
                "activation_gib_per_gpu": self.activation_bytes_per_gpu / GiB,
                "available_kv_gib_per_gpu": self.available_kv_bytes_per_gpu / GiB,
                "num_gpu_blocks": self.num_gpu_blocks, "kv_cache_tokens": self.kv_cache_tokens}


def activation_bytes(model: ModelConfig, settings: ServerSettings, tp: int) -> float:
    """Peak activation memory of vLLM's profiling forward pass (``max_num_batched_tokens`` tokens): the MLP's
    gate/up output and a few hidden-state buffers per token, plus the sampler's fp32 logits and
    probabilities for ``max_num_seqs`` sequences (an estimate: vLLM measures it at start-up)."""
    tokens = settings.max_num_batched_tokens
    per_token = (2 * model.intermediate_size / tp + 4 * model.hidden_size) * 2
    logits = min(settings.max_num_seqs, tokens) * model.vocab_size * 4 * 2
    return tokens * per_token + logits


def plan_deployment(gpu: str | GpuPreset, model: str | ModelConfig, *, tp: int = 1,
                    settings: ServerSettings = ServerSettings(), efficiency: Efficiency | None = None,
                    cost: StepCost | None = None, max_request_tokens: int | None = None) -> Deployment:
    """Memory plan and step cost of ``model`` on ``tp`` GPUs of kind ``gpu``.  ValueError for an unknown GPU or
    model or a TP that does not divide the heads; :class:`DoesNotFit` when the weights leave no KV memory, or
    the pool cannot hold one request of ``max_request_tokens``."""
    g = gpu if isinstance(gpu, GpuPreset) else get_gpu(gpu)
    m = model if isinstance(model, ModelConfig) else load_model_config(model)
    m.check_tensor_parallel(tp)
    if not 0 < settings.gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization {settings.gpu_memory_utilization}: give a share in (0, 1]")
    eff = efficiency or g.efficiency
    kv_dtype = None if settings.kv_cache_dtype in ("auto", None) else settings.kv_cache_dtype
    weights = m.params_total * dtype_bytes(settings.weight_dtype or m.dtype) / tp
    act = activation_bytes(m, settings, tp)
    budget = g.visible_memory_bytes * settings.gpu_memory_utilization
    available = budget - weights - act - NON_TORCH_GIB * GiB
    per_token = kv_bytes_per_token(m.shape(), kv_dtype, tp)
    if settings.num_gpu_blocks is not None:
        blocks = settings.num_gpu_blocks
    else:
        if available <= 0:
            raise DoesNotFit(
                f"{m.name} does not fit on {g.key} with tp {tp}: weights {weights / GiB:.1f} GiB per GPU + "
                f"activations {act / GiB:.1f} + {NON_TORCH_GIB:g} GiB other exceed {budget / GiB:.1f} GiB "
                f"({settings.gpu_memory_utilization:g} of {g.visible_memory_bytes / GiB:.1f} GiB); "
                "raise --tp or use a larger GPU")
        blocks = int(available // (settings.block_size * per_token))
    if blocks < 2:
        raise DoesNotFit(f"{m.name} on {g.key} with tp {tp}: no room for a KV block after the weights")
    if max_request_tokens is not None and (blocks - 1) * settings.block_size < max_request_tokens:
        raise DoesNotFit(f"{m.name} on {g.key} with tp {tp}: the KV pool holds {(blocks - 1) * settings.block_size:,} "
                         f"tokens, fewer than the longest request's {max_request_tokens:,}; raise --tp or use "
                         "--kv-cache-dtype fp8")
    step = cost or roofline_step_cost(g, m, tp=tp, weight_dtype=settings.weight_dtype, kv_cache_dtype=kv_dtype,
                                      efficiency=eff, request_overhead_s=eff.request_overhead_ms / 1e3)
    return Deployment(g, m, tp, settings, eff, weights, per_token, act, max(available, 0.0), blocks, step)


# -- requests -------------------------------------------------------------------------------------------

def synthetic_requests(input_tokens: Sequence[int], output_tokens: Sequence[int],
                       arrivals_s: Sequence[float] | None = None, *, block_size: int = GPU_BLOCK_SIZE,
                       shared_prefix_tokens: int = 0, session_ids: Sequence[str] | None = None) -> list[SimRequest]:
    """Requests known by their lengths alone (a published benchmark's random or ShareGPT prompts): every block
    unique (no prefix hits), except the first ``shared_prefix_tokens`` which all requests share."""

    fresh = itertools.count(1 << 40)
    shared_blocks = shared_prefix_tokens // block_size
    shared = list(range(1, shared_blocks + 1))
    out = []
    for i, (p, o) in enumerate(zip(input_tokens, output_tokens)):
        n_full = (int(p) + max(int(o), 1) - 1) // block_size
        own = max(n_full - shared_blocks, 0)
        hashes = (shared[:n_full] + [next(fresh) for _ in range(own)])
        out.append(SimRequest(request_id=i, prompt_tokens=int(p), output_tokens=max(int(o), 1), hashes=hashes,
                              block_size=block_size, arrival_s=float(arrivals_s[i]) if arrivals_s is not None else 0.0,
                              session_id=None if session_ids is None else session_ids[i]))
    return out


def attach_speculation(requests: Sequence[SimRequest], per_request: dict[int, tuple[Sequence[int], Sequence[int]]]
                       ) -> list[SimRequest]:
    """The requests with their drafts and accepted counts per decode step (by request id; from
    ``speculative.simulate``'s ``RequestSpeculation.drafted``/``accepted``); others decode without drafts."""
    out = []
    for r in requests:
        got = per_request.get(r.request_id)
        out.append(r if got is None else replace(r, spec_drafted=[int(x) for x in got[0]],
                                                 spec_accepted=[int(x) for x in got[1]]))
    return out


# -- prediction -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RequestPrediction:
    """One request as the model served it (``prediction.json``'s rows are these fields). Times are NaN for a
    request that was never served; ``fits`` is False when it needs more KV blocks than the whole pool (vLLM
    rejects it)."""

    request_id: int
    session_id: str | None
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    arrival_s: float
    ttft_s: float
    tpot_s: float
    itl_s: float
    e2e_s: float
    preemptions: int
    fits: bool


@dataclass
class WorkloadPrediction:
    """Per-request predictions (input order) and the run's totals."""

    requests: list[RequestPrediction]
    makespan_s: float
    busy_s: float
    steps: int
    preemptions: int
    evictions: int
    kv_usage_mean: float
    kv_usage_max: float
    max_running: int
    concurrency: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests if r.fits)

    @property
    def token_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return sum(r.fits for r in self.requests) / self.makespan_s if self.makespan_s > 0 else 0.0

    def percentile(self, metric: str, q: float) -> float:

        vals = [getattr(r, metric) for r in self.requests if r.fits and not math.isnan(getattr(r, metric))]
        return float(np.percentile(vals, q)) if vals else math.nan

    def mean(self, metric: str) -> float:
        vals = [getattr(r, metric) for r in self.requests if r.fits and not math.isnan(getattr(r, metric))]
        return sum(vals) / len(vals) if vals else math.nan

    def goodput(self, ttft_slo_s: float | None, tpot_slo_s: float | None) -> tuple[float, float]:
        """(share of requests meeting both objectives, such requests per second)."""
        ok = [r for r in self.requests if r.fits and (ttft_slo_s is None or r.ttft_s <= ttft_slo_s)
              and (tpot_slo_s is None or math.isnan(r.tpot_s) or r.tpot_s <= tpot_slo_s)]
        n = len(self.requests)
        return (len(ok) / n if n else 0.0, len(ok) / self.makespan_s if self.makespan_s > 0 else 0.0)


def _decode_steps(r: SimRequest, output_tokens: int) -> int:
    """Token-emitting decode steps of a request (its drafts' acceptances, or one token a step)."""
    need = output_tokens - 1
    if need <= 0:
        return 0
    if r.spec_accepted is None:
        return need
    done = steps = 0
    for a in r.spec_accepted:
        if done >= need:
            break
        done += 1 + int(a)
        steps += 1
    return steps + max(need - done, 0)


def predict_run(requests: Sequence[SimRequest], config: SchedulerConfig, cost: StepCost, *,
                concurrency: int | None = None, time_scale: float = 1.0,
                arrivals_s: Sequence[float] | None = None) -> WorkloadPrediction:
    """One scheduler run: closed loop of ``concurrency`` sessions, pinned ``arrivals_s``, or (neither) the
    requests' own arrival times (open loop, sessions chained by their gaps)."""
    timing = SessionTiming(concurrency=concurrency, time_scale=time_scale,
                           arrivals_s=list(arrivals_s) if arrivals_s is not None else None)
    run = run_scheduler(requests, config, cost, timing)
    return _from_run(requests, run, concurrency)


def predict_workload(requests: Sequence[SimRequest], deployment: Deployment, *, concurrency: int | None = None,
                     time_scale: float = 1.0, arrivals_s: Sequence[float] | None = None) -> WorkloadPrediction:
    """:func:`predict_run` on the deployment's pool and step cost.  Requests hashed at another block size
    than the deployment's are refused (hash them at ``deployment.settings.block_size``)."""
    return predict_run(requests, deployment.scheduler_config, deployment.cost, concurrency=concurrency,
                       time_scale=time_scale, arrivals_s=arrivals_s)


def _from_run(requests: Sequence[SimRequest], run: ScheduleRun, concurrency: int | None) -> WorkloadPrediction:
    preds = []
    for req, r in zip(requests, run.results):
        ttft, e2e = r.ttft_s, r.e2e_s
        n = r.output_tokens
        tpot = (e2e - ttft) / (n - 1) if n > 1 and r.fits else math.nan
        steps = _decode_steps(req, n)
        itl = (e2e - ttft) / steps if steps and r.fits else math.nan
        preds.append(RequestPrediction(r.request_id, r.session_id, r.prompt_tokens, n, r.cached_tokens,
                                       r.arrival_s, ttft, tpot, itl, e2e, r.preemptions, r.fits))
    return WorkloadPrediction(preds, run.makespan_s, run.busy_s, run.steps, run.preemptions, run.evictions,
                              run.kv_usage_mean, run.kv_usage_max, run.max_running, concurrency)


def prefill_seconds(requests: Sequence[RequestPrediction], cost: StepCost, max_num_batched_tokens: int) -> float:
    """Marginal step time of the requests' uncached prompt tokens (each prefilled alone in budget-sized
    chunks, less the cost of an empty step): the input side of a cost split."""

    base = cost.step_s(0, 0, 0.0)
    total = 0.0
    for r in requests:
        done = min(r.cached_tokens, r.prompt_tokens - 1)
        while done < r.prompt_tokens:
            chunk = min(max_num_batched_tokens, r.prompt_tokens - done)
            total += cost.step_s(chunk, 1, 0.0, prefill_pairs(chunk, done)) - base
            done += chunk
    return total


__all__ = [
    "GPU_BLOCK_SIZE",
    "Deployment",
    "DoesNotFit",
    "RequestPrediction",
    "RooflineStepCost",
    "ServerSettings",
    "WorkloadPrediction",
    "activation_bytes",
    "attach_speculation",
    "plan_deployment",
    "predict_run",
    "predict_workload",
    "prefill_seconds",
    "synthetic_requests",
]
