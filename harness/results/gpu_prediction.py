"""Predict a trace's serving on a named GPU and model (or a calibrated server) and shape it as a
``prediction.json`` (:mod:`.prediction_file`): the one implementation behind ``kvscope predict`` and an
experiment's ``predicted:`` configurations.

Why here: like the summary metrics that compute and shape ``summary.json``, this turns the cache model's
per-request output (:mod:`kvscope.harness.cachemodel.gpu_predict`) into the typed result file, with the load
curve, the eviction cliff, the SLO capacity and the GPU-hour cost read off it, so the command line and the
experiment runner cannot drift apart in what a "predicted capacity" means.  ``PredictOptions`` mirrors the
command's flags (same names, same defaults).
"""

from __future__ import annotations

import math
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvscope.harness.cachemodel import gpu_predict as gp
from kvscope.harness.cachemodel.capacity_model import prompt_blocks_only
from kvscope.harness.cachemodel.gpus import get_gpu
from kvscope.harness.cachemodel.kv_memory import dtype_bytes
from kvscope.harness.cachemodel.model_config import load_model_config
from kvscope.harness.cachemodel.roofline import roofline_step_cost
from kvscope.harness.cachemodel.spec_predict import DraftStepCost, parse_speculative, with_speculation
from kvscope.harness.cachemodel.trace_io import detect_kind, load_trace
from kvscope.harness.common.errors import ConfigError
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.results import prediction_file as pf
from kvscope.harness.results.loaders import load_calibration
from kvscope.workloads.trace import Trace

if TYPE_CHECKING:
    from kvscope.harness.results.prediction_file import PredictionFile

DEFAULT_CONCURRENCY_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_RATE_LEVELS = (0.25, 0.5, 1.0, 2.0, 4.0)


@dataclass(frozen=True)
class PredictOptions:
    """What to predict: the trace, the deployment, the load and the SLO (``kvscope predict``'s flags)."""

    trace: str
    gpu: str | None = None
    model: str | None = None
    tp: int = 1
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    gpu_memory_utilization: float = 0.92
    kv_cache_dtype: str = "auto"
    weight_dtype: str | None = None
    num_gpu_blocks: int | None = None
    no_chunked_prefill: bool = False
    mfu: float | None = None
    bandwidth_efficiency: float | None = None
    step_overhead_ms: float | None = None
    request_overhead_ms: float | None = None
    calibration: str | None = None
    speculative: str | None = None
    max_model_len: int | None = None
    #: Closed loop of this many sessions for the per-request prediction; None: the trace's own arrivals.
    concurrency: int | None = None
    levels: list[float] | None = None
    time_scale: float = 1.0
    mode: str = "live"
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    cliff_drop_pp: float = 5.0
    gpu_hour_usd: float | None = None
    provider: str | None = None
    jobs: int = 1
    #: Closed loop: the run summary, per-request figures and cost at the curve's SLO capacity (the loads already
    #: simulated) instead of at ``concurrency``, which then only needs to be one of the levels -- one pass over
    #: the curve answers "how many fit and what does that load cost" (``concurrency`` where nothing fits).
    summary_at_slo_capacity: bool = False
    #: A progress bar on stderr (only where stderr is a terminal).
    progress: bool = True


@dataclass(frozen=True)
class PredictedTrace:
    prediction: PredictionFile
    #: The speculative configuration's acceptance summary (None without ``speculative``).
    spec_summary: dict[str, Any] | None
    #: Seconds spent reading (and hashing) the trace.
    load_s: float


_RUN_AT = None  # the level runner a forked worker calls (set just before the pool forks)


def _timed(fn, level: float):
    t0 = time.process_time()
    return fn(level), time.process_time() - t0


def _timed_level(level: float):
    return _timed(_RUN_AT, level)


def predict_trace(o: PredictOptions) -> PredictedTrace:
    """Predict ``o.trace`` on the deployment ``o`` names; ValueError (unknown GPU/model, TP, does not fit) and
    ConfigError name the problem in one line."""

    t_start = time.perf_counter()
    progress = o.progress and sys.stderr.isatty()
    spec = parse_speculative(o.speculative) if o.speculative else None
    cal = None
    if o.calibration:
        cal = load_calibration(o.calibration)
    elif not (o.gpu and o.model):
        raise ConfigError("give --gpu and --model (or --calibration FILE for a calibrated server's step costs)")
    gpu = get_gpu(o.gpu) if o.gpu else None
    model = load_model_config(o.model) if o.model else None
    # -- deployment ------------------------------------------------------------------------------------
    base = gp.ServerSettings()
    if cal is not None:
        scfg = cal.scheduler_config(o.num_gpu_blocks)
        base = replace(base, block_size=scfg.block_size, max_num_seqs=scfg.max_num_seqs,
                       max_num_batched_tokens=scfg.max_num_batched_tokens)
    settings = replace(base, max_num_seqs=o.max_num_seqs or base.max_num_seqs,
                       max_num_batched_tokens=o.max_num_batched_tokens or base.max_num_batched_tokens,
                       block_size=o.block_size or base.block_size, gpu_memory_utilization=o.gpu_memory_utilization,
                       kv_cache_dtype=o.kv_cache_dtype, weight_dtype=o.weight_dtype,
                       enable_chunked_prefill=not o.no_chunked_prefill, num_gpu_blocks=o.num_gpu_blocks)
    if o.kv_cache_dtype != "auto":
        dtype_bytes(o.kv_cache_dtype)  # unknown dtype: ValueError naming the known ones
    dep = None
    if gpu is not None and model is not None:
        eff = gpu.efficiency.model_copy(update={k: v for k, v in {
            "mfu": o.mfu, "bandwidth_efficiency": o.bandwidth_efficiency, "step_overhead_ms": o.step_overhead_ms,
            "request_overhead_ms": o.request_overhead_ms}.items() if v is not None})
        if eff != gpu.efficiency:
            eff = eff.model_copy(update={"source": "command line overrides of " + gpu.efficiency.source})
        dep = gp.plan_deployment(gpu, model, tp=o.tp, settings=settings, efficiency=eff,
                                 cost=cal.cost_model() if cal is not None else None,
                                 max_request_tokens=None)
        cost = dep.cost
        config = dep.scheduler_config
    else:
        cost = cal.cost_model()  # type: ignore[union-attr]
        config = settings.scheduler_config(cal.scheduler_config(o.num_gpu_blocks).num_gpu_blocks)  # type: ignore[union-attr]
    # -- trace -----------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    if progress:
        print(f"reading {o.trace} (hashing prompts at block size {config.block_size}) ...", file=sys.stderr)
    tr = load_trace(o.trace, config.block_size)
    requests = tr.requests
    if not requests:
        raise ConfigError(f"{o.trace}: no requests")
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    if o.max_model_len is not None:
        too_long = sum(r.prompt_tokens + r.output_tokens > o.max_model_len for r in requests)
        if too_long:
            print(f"note: {too_long} requests exceed --max-model-len {o.max_model_len} and are left out", file=sys.stderr)
            requests = [r for r in requests if r.prompt_tokens + r.output_tokens <= o.max_model_len]
    usable_tokens = None if config.num_gpu_blocks is None else (config.num_gpu_blocks - 1) * config.block_size
    if dep is not None and usable_tokens is not None and usable_tokens < min(longest, o.max_model_len or longest) \
            and o.num_gpu_blocks is None and all(r.prompt_tokens + r.output_tokens > usable_tokens for r in requests):
        raise gp.DoesNotFit(f"{dep.model.name} on {dep.gpu.key} with tp {dep.tp}: the KV pool holds "
                            f"{usable_tokens:,} tokens, less than any request of the trace; raise --tp")
    if o.mode == "recorded":
        requests = prompt_blocks_only(requests, config.block_size)
    spec_summary = None
    if spec is not None:
        trace_obj = None
        if spec.method != "draft":
            if detect_kind(o.trace) != "kvscope":
                raise ConfigError(f"--speculative {spec.method}: needs a kvscope trace directory (its tokens); "
                                  f"{o.trace} is a {detect_kind(o.trace)} trace")

            trace_obj = Trace.read(o.trace)
        requests, spec_summary = with_speculation(requests, spec, trace_obj, o.max_model_len)
        draft_model = spec.params.get("draft_model")
        if draft_model:
            if dep is None:
                raise ConfigError("--speculative draft_model=...: needs --gpu and --model (the draft's cost is a roofline)")

            draft_cfg = load_model_config(draft_model)
            draft_cost = roofline_step_cost(dep.gpu, draft_cfg, tp=1, efficiency=dep.efficiency)
            cost = DraftStepCost(cost, draft_cost, spec.k)
    load_s = time.perf_counter() - t0
    sessions = len({r.session_id for r in requests}) if requests[0].session_id is not None else len(requests)
    closed = o.concurrency is not None
    if o.levels is not None:
        levels = o.levels
    elif closed:
        levels = [float(c) for c in DEFAULT_CONCURRENCY_LEVELS if c < sessions] + [float(min(sessions, 256))]
        levels = sorted(set(levels) | {float(o.concurrency)})
    else:
        levels = list(DEFAULT_RATE_LEVELS)
    # -- runs ------------------------------------------------------------------------------------------
    ttft_slo, tpot_slo = o.slo_ttft_ms / 1e3, o.slo_tpot_ms / 1e3

    def run_at(load: float) -> gp.WorkloadPrediction:
        if closed:
            return gp.predict_run(requests, config, cost, concurrency=int(load), time_scale=o.time_scale)
        return gp.predict_run(requests, config, cost, time_scale=o.time_scale / load)

    main_load = float(o.concurrency) if closed else 1.0
    runs: dict[float, gp.WorkloadPrediction] = {}
    points: dict[float, pf.LoadPoint] = {}

    def point(level: float, w: gp.WorkloadPrediction, secs: float) -> pf.LoadPoint:
        share, _ = w.goodput(ttft_slo, tpot_slo)
        p90, tpot50 = w.percentile("ttft_s", 90), w.percentile("tpot_s", 50)
        meets = (not math.isnan(p90) and p90 <= ttft_slo and (math.isnan(tpot50) or tpot50 <= tpot_slo)
                 and w.preemptions == 0)
        return pf.LoadPoint(load=level, token_hit_rate=w.token_hit_rate, ttft_p50_s=nan_to_none(w.percentile("ttft_s", 50)),
                            ttft_p90_s=nan_to_none(p90), tpot_p50_s=nan_to_none(tpot50),
                            e2e_p50_s=nan_to_none(w.percentile("e2e_s", 50)), output_tokens_per_s=w.output_tokens_per_s,
                            goodput_share=share, preemptions=w.preemptions, kv_usage_max=w.kv_usage_max,
                            meets_slo=meets, simulate_s=secs)

    def cliff_of(curve: list) -> float | None:
        return next((pt.load for pt in curve[1:]
                     if (curve[0].token_hit_rate - pt.token_hit_rate) * 100 > o.cliff_drop_pp), None)

    # Default levels stop once the curve has shown what it is for: a load past the SLO capacity and the
    # eviction cliff (the loads beyond both are the slowest to simulate and answer nothing new).
    adaptive = o.levels is None
    pending = sorted(set(levels) | {main_load})
    bar = None
    if progress:
        from tqdm import tqdm  # deferred: tqdm is heavy, only a progress bar needs it

        bar = tqdm(total=len(pending), desc="predict", unit="load level")
    jobs = min(o.jobs, len(pending))
    pool = None
    if jobs > 1:  # forked workers inherit the requests; each returns one level's prediction

        global _RUN_AT
        _RUN_AT = run_at
        pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
    try:
        while pending:
            batch, pending = pending[:max(jobs, 1)], pending[max(jobs, 1):]
            done = pool.map(_timed_level, batch) if pool is not None else (_timed(run_at, x) for x in batch)
            for level, (w, secs) in zip(batch, done):
                runs[level] = w
                points[level] = point(level, w, secs)
                if bar is not None:
                    bar.update()
            curve_so_far = [points[x] for x in sorted(points) if x in levels]
            if adaptive and curve_so_far and not curve_so_far[-1].meets_slo and cliff_of(curve_so_far) is not None:
                skipped = [x for x in pending if x != main_load]
                pending = [x for x in pending if x == main_load]
                if bar is not None:
                    bar.total -= len(skipped)
    finally:
        if pool is not None:
            pool.shutdown()
        if bar is not None:
            bar.close()
    main = runs[main_load]
    curve = [points[x] for x in sorted(points) if x in levels]
    cliff = cliff_of(curve)
    capacity = None
    for pt in curve:
        if not pt.meets_slo:
            break
        capacity = pt.load
    summary_load = main_load
    if o.summary_at_slo_capacity and closed and capacity is not None:
        summary_load = capacity
        main = runs[capacity]
    # -- cost ------------------------------------------------------------------------------------------
    from kvscope.harness.pricing.gpu_cost import gpu_hour_price, serving_cost

    serving = None
    price = None
    if o.gpu_hour_usd is not None:
        price = (o.gpu_hour_usd, "--gpu-hour-usd")
    elif gpu is not None:
        preset = gpu_hour_price(gpu.key, o.provider)
        if preset is None and o.provider:
            raise ConfigError(f"--provider {o.provider}: no GPU-hour price for {gpu.key} in pricing/gpu_prices.yaml")
        if preset is not None:
            price = (preset.usd_per_gpu_hour, f"{preset.provider}, {preset.as_of}: {preset.source}")
    if price is not None:
        num_gpus = dep.tp if dep is not None else 1
        serving = serving_cost(usd_per_gpu_hour=price[0], price_source=price[1], num_gpus=num_gpus,
                               makespan_s=main.makespan_s,
                               prefill_s=gp.prefill_seconds(main.requests, cost, config.max_num_batched_tokens),
                               busy_s=main.busy_s, input_tokens=main.prompt_tokens, output_tokens=main.output_tokens,
                               sessions=sessions)
    # -- file ------------------------------------------------------------------------------------------
    share, good_rps = main.goodput(ttft_slo, tpot_slo)
    run = pf.RunSummary(
        concurrency=int(summary_load) if closed else None, requests=len(main.requests), prompt_tokens=main.prompt_tokens,
        cached_tokens=main.cached_tokens, output_tokens=main.output_tokens, token_hit_rate=main.token_hit_rate,
        makespan_s=main.makespan_s, busy_s=main.busy_s, requests_per_s=main.requests_per_s,
        output_tokens_per_s=main.output_tokens_per_s,
        total_tokens_per_s=(main.prompt_tokens + main.output_tokens) / main.makespan_s if main.makespan_s else 0.0,
        ttft_mean_s=nan_to_none(main.mean("ttft_s")), ttft_p50_s=nan_to_none(main.percentile("ttft_s", 50)),
        ttft_p90_s=nan_to_none(main.percentile("ttft_s", 90)), ttft_p99_s=nan_to_none(main.percentile("ttft_s", 99)),
        tpot_mean_s=nan_to_none(main.mean("tpot_s")), tpot_p90_s=nan_to_none(main.percentile("tpot_s", 90)),
        itl_mean_s=nan_to_none(main.mean("itl_s")), e2e_mean_s=nan_to_none(main.mean("e2e_s")),
        e2e_p90_s=nan_to_none(main.percentile("e2e_s", 90)), preemptions=main.preemptions,
        kv_usage_mean=main.kv_usage_mean, kv_usage_max=main.kv_usage_max, goodput_share=share,
        goodput_requests_per_s=good_rps)
    if dep is not None:
        deployment = pf.Deployment(
            gpu=dep.gpu.key, gpu_name=dep.gpu.name, gpu_source=dep.gpu.source, model=dep.model.name,
            params_total=dep.model.params_total, params_active=dep.model.params_active, tp=dep.tp,
            weight_dtype=settings.weight_dtype or dep.model.dtype, kv_cache_dtype=settings.kv_cache_dtype,
            weight_gib_per_gpu=dep.weight_bytes_per_gpu / 2**30, kv_bytes_per_token_per_gpu=dep.kv_bytes_per_token_per_gpu,
            available_kv_gib_per_gpu=dep.available_kv_bytes_per_gpu / 2**30, num_gpu_blocks=dep.num_gpu_blocks,
            kv_cache_tokens=dep.kv_cache_tokens, block_size=settings.block_size, max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization)
    else:
        blocks = config.num_gpu_blocks or 0
        deployment = pf.Deployment(
            gpu="calibrated-server", gpu_name=str(cal.server.endpoint), gpu_source=o.calibration,  # type: ignore[union-attr]
            model="(the calibrated server's)", params_total=0, params_active=0, tp=1, weight_dtype="n/a",
            kv_cache_dtype="n/a", weight_gib_per_gpu=0.0, kv_bytes_per_token_per_gpu=0.0, available_kv_gib_per_gpu=0.0,
            num_gpu_blocks=blocks, kv_cache_tokens=max(blocks - 1, 0) * config.block_size, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization)
    if cal is not None:
        step_model = pf.StepModel(kind="calibration", source=o.calibration)
    else:
        e = dep.efficiency  # type: ignore[union-attr]
        step_model = pf.StepModel(kind="roofline", mfu=e.mfu, bandwidth_efficiency=e.bandwidth_efficiency,
                                  step_overhead_ms=e.step_overhead_ms, allreduce_latency_us=e.allreduce_latency_us,
                                  request_overhead_ms=e.request_overhead_ms, source=e.source)
    predict_s = time.perf_counter() - t_start
    out = pf.PredictionFile(
        trace=o.trace, load_kind="concurrency" if closed else "rate_multiplier", deployment=deployment,
        step_model=step_model, speculative=spec.label if spec else None,
        slo=pf.Slo(ttft_ms=o.slo_ttft_ms, tpot_ms=o.slo_tpot_ms), run=run, load_curve=curve,
        eviction_cliff_load=cliff, cliff_drop_pp=o.cliff_drop_pp, slo_capacity_load=capacity, cost=serving,
        requests=[pf.predicted_request(r) for r in main.requests],
        predict_s=predict_s)
    return PredictedTrace(out, spec_summary, load_s)


