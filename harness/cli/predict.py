"""``kvscope predict``: a trace's serving on a named GPU and model, from the hardware and the model's
config.json (no GPU needed): per-request TTFT/TPOT/ITL/E2E and cached tokens, the load curve, eviction cliff,
SLO capacity and cost; registered by ``kvscope.harness.cli.main``."""

from __future__ import annotations

import argparse
import math
import sys

from kvscope.harness.cli import argtypes
from kvscope.harness.cli.common import add_parser

DEFAULT_CONCURRENCY_LEVELS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEFAULT_RATE_LEVELS = (0.25, 0.5, 1.0, 2.0, 4.0)


def _levels(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of numbers (e.g. 1,2,4,8)") from None
    if not out or any(x <= 0 for x in out) or out != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"{text!r}: give increasing positive numbers, e.g. 1,2,4,8")
    return out


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number in (0, 1]") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"got {text}; allowed: a share in (0, 1]")
    return v


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    p = add_parser(
        subparsers, "predict", "predict TTFT, TPOT, capacity and cost of a trace on a named GPU and model",
        "Run TRACE through the step-level model of vLLM's scheduler (continuous batching, max_num_seqs, chunked\n"
        "prefill, preemption, prefix caching in the GPU's KV pool) with step times from first principles: the\n"
        "GPU's datasheet (gpus.yaml) and the model's config.json (bundled or a local file), or from a CPU\n"
        "calibration (--calibration). Every figure is predicted; the factors used are in the output file.\n\n"
        "examples:\n"
        "  kvscope predict traces/agent --gpu h100-sxm --model llama-3.1-8b --concurrency 8\n"
        "  kvscope predict traces/agent --gpu h200-sxm --model llama-3.1-70b --tp 4 --kv-cache-dtype fp8\n"
        "  kvscope predict traces/agent --gpu h100 --model path/to/config.json --speculative ngram:k=4,min=2,max=4")
    p.add_argument("trace", metavar="TRACE", nargs="?", help="a kvscope trace directory (or any trace `simulate` reads)")
    p.add_argument("--gpu", default=None, help="GPU preset id (see --list); required unless --calibration")
    p.add_argument("--model", default=None,
                   help="bundled model name (see --list) or a config.json path; required unless --calibration")
    p.add_argument("--list", action="store_true", help="list the GPU presets and bundled models, then exit")
    p.add_argument("--tp", type=argtypes.positive_int, default=1, help="tensor-parallel size (default 1)")
    p.add_argument("--max-num-seqs", type=argtypes.positive_int, default=None, help="default 256")
    p.add_argument("--max-num-batched-tokens", type=argtypes.positive_int, default=None, help="default 8192")
    p.add_argument("--block-size", type=argtypes.block_size, default=None, help="default 16 (CUDA)")
    p.add_argument("--gpu-memory-utilization", type=_fraction, default=0.92, help="default 0.92")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype), fp8, bfloat16, ...")
    p.add_argument("--weight-dtype", default=None,
                   help="weights' dtype (default: the config's); fp8 for an fp8 checkpoint (fp8 tensor cores)")
    p.add_argument("--num-gpu-blocks", type=argtypes.num_gpu_blocks, default=None,
                   help="KV pool size in blocks instead of the memory arithmetic (vLLM's override)")
    p.add_argument("--no-chunked-prefill", action="store_true", help="disable chunked prefill")
    eff = p.add_argument_group("step model (defaults: the GPU's in gpus.yaml)")
    eff.add_argument("--mfu", type=_fraction, default=None, help="achieved share of the dense peak FLOPs")
    eff.add_argument("--bandwidth-efficiency", type=_fraction, default=None,
                     help="achieved share of the memory bandwidth")
    eff.add_argument("--step-overhead-ms", type=argtypes.non_negative_float, default=None,
                     help="engine time per step no GPU work hides")
    eff.add_argument("--request-overhead-ms", type=argtypes.non_negative_float, default=None,
                     help="frontend time per request (HTTP, tokenization)")
    eff.add_argument("--calibration", metavar="FILE", default=None,
                     help="step costs from a calibration.json (kvscope capacity --server ...) instead of the "
                     "roofline: the CPU path; its server's block size and pool unless overridden")
    p.add_argument("--speculative", default=None, metavar="SPEC",
                   help="ngram[:k=4,min=2,max=4] | suffix[:depth=24] | oracle[:k=4] | "
                   "draft:k=4,acceptance=0.7[,draft_model=NAME] (acceptance from the tokens, except draft)")
    p.add_argument("--max-model-len", type=argtypes.positive_int, default=None,
                   help="drafts stop there (speculation), and longer requests are refused")
    load = p.add_argument_group("load")
    load.add_argument("--concurrency", type=argtypes.positive_int, default=None,
                      help="closed loop of N sessions for the per-request prediction; default: the trace's own "
                      "arrival times (open loop)")
    load.add_argument("--levels", type=_levels, default=None,
                      help="load curve: concurrency levels (closed loop, default 1,2,4,...,256 up to the "
                      "sessions) or, open loop, multiples of the trace's request rate (default 0.25,0.5,1,2,4)")
    load.add_argument("--time-scale", type=argtypes.non_negative_float, default=1.0,
                      help="multiplies think times and tool latencies, as in replay (default 1)")
    load.add_argument("--mode", choices=["recorded", "live"], default="live",
                      help="live (default: prompts carry the model's own output, which the trace's output "
                      "tokens stand for) or recorded (output blocks never hit), as in replay")
    slo = p.add_argument_group("SLO and cost")
    slo.add_argument("--slo-ttft-ms", type=argtypes.positive_float, default=2000.0, help="default 2000")
    slo.add_argument("--slo-tpot-ms", type=argtypes.positive_float, default=100.0, help="default 100")
    slo.add_argument("--cliff-drop-pp", type=argtypes.positive_float, default=5.0,
                     help="hit-rate drop (points below the lowest load) that marks the eviction cliff")
    slo.add_argument("--gpu-hour-usd", type=argtypes.positive_float, default=None,
                     help="price per GPU-hour (default: the GPU's first preset in pricing/gpu_prices.yaml)")
    slo.add_argument("--provider", default=None, help="which provider's GPU-hour price preset to use")
    p.add_argument("--out", metavar="FILE", default=None, help="write the prediction (prediction.json format)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_predict)


def _list() -> int:
    from kvscope.harness.cachemodel.gpus import load_gpus
    from kvscope.harness.cachemodel.model_config import bundled_models, load_model_config

    print(f"{'GPU':<15} {'memory':>7} {'HBM TB/s':>8} {'bf16 TF':>8} {'fp8 TF':>7} {'link GB/s':>9}  source")
    for g in load_gpus():
        print(f"{g.key:<15} {g.memory_gib:>5g}GB {(g.bandwidth_gb_s or 0) / 1e3:>8.2f} {g.bf16_tflops or 0:>8.0f} "
              f"{g.fp8_tflops or 0:>7.0f} {g.interconnect_gb_s or 0:>9.0f}  {g.source or ''}")
    print(f"\n{'model':<16} {'params':>8} {'active':>8} {'layers':>6} {'heads':>5} {'kv':>3} {'hd':>4} {'vocab':>7}")
    for name in bundled_models():
        m = load_model_config(name)
        print(f"{name:<16} {m.params_total / 1e9:>7.2f}B {m.params_active / 1e9:>7.2f}B {m.num_layers:>6} "
              f"{m.num_attention_heads:>5} {m.num_kv_heads:>3} {m.head_dim:>4} {m.vocab_size:>7}")
    return 0


def _nan_none(v: float) -> float | None:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def _cmd_predict(a: argparse.Namespace) -> int:
    import time

    from kvscope.harness.common.errors import ConfigError

    if a.list:
        return _list()
    if a.trace is None:
        raise ConfigError("predict: give a TRACE (or --list)")
    t_start = time.perf_counter()
    try:
        return _predict(a, t_start)
    except ConfigError:
        raise
    except ValueError as exc:  # unknown GPU/model, bad config.json, TP, does not fit: one line, exit 2
        raise ConfigError(str(exc)) from None


def _predict(a: argparse.Namespace, t_start: float) -> int:
    import time
    from dataclasses import replace

    from kvscope.harness.cachemodel import gpu_predict as gp
    from kvscope.harness.cachemodel.capacity_model import prompt_blocks_only
    from kvscope.harness.cachemodel.gpus import get_gpu
    from kvscope.harness.cachemodel.model_config import load_model_config
    from kvscope.harness.cachemodel.spec_predict import DraftStepCost, parse_speculative, with_speculation
    from kvscope.harness.cachemodel.trace_io import detect_kind, load_trace
    from kvscope.harness.common.errors import ConfigError
    from kvscope.harness.results import prediction_file as pf

    progress = not a.no_progress and sys.stderr.isatty()
    spec = parse_speculative(a.speculative) if a.speculative else None
    cal = None
    if a.calibration:
        from kvscope.harness.results.loaders import load_calibration

        cal = load_calibration(a.calibration)
    elif not (a.gpu and a.model):
        raise ConfigError("give --gpu and --model (or --calibration FILE for a calibrated server's step costs)")
    gpu = get_gpu(a.gpu) if a.gpu else None
    model = load_model_config(a.model) if a.model else None
    # -- deployment ------------------------------------------------------------------------------------
    base = gp.ServerSettings()
    if cal is not None:
        scfg = cal.scheduler_config(a.num_gpu_blocks)
        base = replace(base, block_size=scfg.block_size, max_num_seqs=scfg.max_num_seqs,
                       max_num_batched_tokens=scfg.max_num_batched_tokens)
    settings = replace(base, max_num_seqs=a.max_num_seqs or base.max_num_seqs,
                       max_num_batched_tokens=a.max_num_batched_tokens or base.max_num_batched_tokens,
                       block_size=a.block_size or base.block_size, gpu_memory_utilization=a.gpu_memory_utilization,
                       kv_cache_dtype=a.kv_cache_dtype, weight_dtype=a.weight_dtype,
                       enable_chunked_prefill=not a.no_chunked_prefill, num_gpu_blocks=a.num_gpu_blocks)
    if a.kv_cache_dtype != "auto":
        from kvscope.harness.cachemodel.kv_memory import dtype_bytes

        dtype_bytes(a.kv_cache_dtype)  # unknown dtype: ValueError naming the known ones
    dep = None
    if gpu is not None and model is not None:
        eff = gpu.efficiency.model_copy(update={k: v for k, v in {
            "mfu": a.mfu, "bandwidth_efficiency": a.bandwidth_efficiency, "step_overhead_ms": a.step_overhead_ms,
            "request_overhead_ms": a.request_overhead_ms}.items() if v is not None})
        if eff != gpu.efficiency:
            eff = eff.model_copy(update={"source": "command line overrides of " + gpu.efficiency.source})
        dep = gp.plan_deployment(gpu, model, tp=a.tp, settings=settings, efficiency=eff,
                                 cost=cal.cost_model() if cal is not None else None,
                                 max_request_tokens=None)
        cost = dep.cost
        config = dep.scheduler_config
    else:
        cost = cal.cost_model()  # type: ignore[union-attr]
        config = settings.scheduler_config(cal.scheduler_config(a.num_gpu_blocks).num_gpu_blocks)  # type: ignore[union-attr]
    # -- trace -----------------------------------------------------------------------------------------
    t0 = time.perf_counter()
    if progress:
        print(f"reading {a.trace} (hashing prompts at block size {config.block_size}) ...", file=sys.stderr)
    tr = load_trace(a.trace, config.block_size)
    requests = tr.requests
    if not requests:
        raise ConfigError(f"{a.trace}: no requests")
    longest = max(r.prompt_tokens + r.output_tokens for r in requests)
    if a.max_model_len is not None:
        too_long = sum(r.prompt_tokens + r.output_tokens > a.max_model_len for r in requests)
        if too_long:
            print(f"note: {too_long} requests exceed --max-model-len {a.max_model_len} and are left out", file=sys.stderr)
            requests = [r for r in requests if r.prompt_tokens + r.output_tokens <= a.max_model_len]
    usable_tokens = None if config.num_gpu_blocks is None else (config.num_gpu_blocks - 1) * config.block_size
    if dep is not None and usable_tokens is not None and usable_tokens < min(longest, a.max_model_len or longest) \
            and a.num_gpu_blocks is None and all(r.prompt_tokens + r.output_tokens > usable_tokens for r in requests):
        raise gp.DoesNotFit(f"{dep.model.name} on {dep.gpu.key} with tp {dep.tp}: the KV pool holds "
                            f"{usable_tokens:,} tokens, less than any request of the trace; raise --tp")
    if a.mode == "recorded":
        requests = prompt_blocks_only(requests, config.block_size)
    spec_summary = None
    if spec is not None:
        trace_obj = None
        if spec.method != "draft":
            if detect_kind(a.trace) != "kvscope":
                raise ConfigError(f"--speculative {spec.method}: needs a kvscope trace directory (its tokens); "
                                  f"{a.trace} is a {detect_kind(a.trace)} trace")
            from kvscope.workloads.trace import Trace

            trace_obj = Trace.read(a.trace)
        requests, spec_summary = with_speculation(requests, spec, trace_obj, a.max_model_len)
        draft_model = spec.params.get("draft_model")
        if draft_model:
            if dep is None:
                raise ConfigError("--speculative draft_model=...: needs --gpu and --model (the draft's cost is a roofline)")
            from kvscope.harness.cachemodel.roofline import roofline_step_cost

            draft_cfg = load_model_config(draft_model)
            draft_cost = roofline_step_cost(dep.gpu, draft_cfg, tp=1, efficiency=dep.efficiency)
            cost = DraftStepCost(cost, draft_cost, spec.k)
    load_s = time.perf_counter() - t0
    sessions = len({r.session_id for r in requests}) if requests[0].session_id is not None else len(requests)
    closed = a.concurrency is not None
    if a.levels is not None:
        levels = a.levels
    elif closed:
        levels = [float(c) for c in DEFAULT_CONCURRENCY_LEVELS if c < sessions] + [float(min(sessions, 256))]
        levels = sorted(set(levels) | {float(a.concurrency)})
    else:
        levels = list(DEFAULT_RATE_LEVELS)
    # -- runs ------------------------------------------------------------------------------------------
    ttft_slo, tpot_slo = a.slo_ttft_ms / 1e3, a.slo_tpot_ms / 1e3

    def run_at(load: float) -> gp.WorkloadPrediction:
        if closed:
            return gp.predict_run(requests, config, cost, concurrency=int(load), time_scale=a.time_scale)
        return gp.predict_run(requests, config, cost, time_scale=a.time_scale / load)

    main_load = float(a.concurrency) if closed else 1.0
    todo = sorted(set(levels) | {main_load})
    it = todo
    if progress:
        from tqdm import tqdm

        it = tqdm(todo, desc="predict", unit="load level")
    runs: dict[float, gp.WorkloadPrediction] = {}
    for level in it:
        runs[level] = run_at(level)
    main = runs[main_load]
    curve = []
    for level in levels:
        w = runs[level]
        share, _ = w.goodput(ttft_slo, tpot_slo)
        p90, tpot50 = w.percentile("ttft_s", 90), w.percentile("tpot_s", 50)
        meets = (not math.isnan(p90) and p90 <= ttft_slo and (math.isnan(tpot50) or tpot50 <= tpot_slo)
                 and w.preemptions == 0)
        curve.append(pf.LoadPoint(load=level, token_hit_rate=w.token_hit_rate, ttft_p50_s=_nan_none(w.percentile("ttft_s", 50)),
                                  ttft_p90_s=_nan_none(p90), tpot_p50_s=_nan_none(tpot50),
                                  e2e_p50_s=_nan_none(w.percentile("e2e_s", 50)),
                                  output_tokens_per_s=w.output_tokens_per_s, goodput_share=share,
                                  preemptions=w.preemptions, kv_usage_max=w.kv_usage_max, meets_slo=meets))
    cliff = next((pt.load for pt in curve[1:] if (curve[0].token_hit_rate - pt.token_hit_rate) * 100 > a.cliff_drop_pp),
                 None)
    capacity = None
    for pt in curve:
        if not pt.meets_slo:
            break
        capacity = pt.load
    # -- cost ------------------------------------------------------------------------------------------
    from kvscope.harness.pricing.gpu_cost import gpu_hour_price, serving_cost

    serving = None
    price = None
    if a.gpu_hour_usd is not None:
        price = (a.gpu_hour_usd, "--gpu-hour-usd")
    elif gpu is not None:
        preset = gpu_hour_price(gpu.key, a.provider)
        if preset is None and a.provider:
            raise ConfigError(f"--provider {a.provider}: no GPU-hour price for {gpu.key} in pricing/gpu_prices.yaml")
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
        concurrency=a.concurrency, requests=len(main.requests), prompt_tokens=main.prompt_tokens,
        cached_tokens=main.cached_tokens, output_tokens=main.output_tokens, token_hit_rate=main.token_hit_rate,
        makespan_s=main.makespan_s, busy_s=main.busy_s, requests_per_s=main.requests_per_s,
        output_tokens_per_s=main.output_tokens_per_s,
        total_tokens_per_s=(main.prompt_tokens + main.output_tokens) / main.makespan_s if main.makespan_s else 0.0,
        ttft_mean_s=_nan_none(main.mean("ttft_s")), ttft_p50_s=_nan_none(main.percentile("ttft_s", 50)),
        ttft_p90_s=_nan_none(main.percentile("ttft_s", 90)), ttft_p99_s=_nan_none(main.percentile("ttft_s", 99)),
        tpot_mean_s=_nan_none(main.mean("tpot_s")), tpot_p90_s=_nan_none(main.percentile("tpot_s", 90)),
        itl_mean_s=_nan_none(main.mean("itl_s")), e2e_mean_s=_nan_none(main.mean("e2e_s")),
        e2e_p90_s=_nan_none(main.percentile("e2e_s", 90)), preemptions=main.preemptions,
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
            gpu="calibrated-server", gpu_name=str(cal.server.endpoint), gpu_source=a.calibration,  # type: ignore[union-attr]
            model="(the calibrated server's)", params_total=0, params_active=0, tp=1, weight_dtype="n/a",
            kv_cache_dtype="n/a", weight_gib_per_gpu=0.0, kv_bytes_per_token_per_gpu=0.0, available_kv_gib_per_gpu=0.0,
            num_gpu_blocks=blocks, kv_cache_tokens=max(blocks - 1, 0) * config.block_size, block_size=config.block_size,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            gpu_memory_utilization=settings.gpu_memory_utilization)
    if cal is not None:
        step_model = pf.StepModel(kind="calibration", source=a.calibration)
    else:
        e = dep.efficiency  # type: ignore[union-attr]
        step_model = pf.StepModel(kind="roofline", mfu=e.mfu, bandwidth_efficiency=e.bandwidth_efficiency,
                                  step_overhead_ms=e.step_overhead_ms, allreduce_latency_us=e.allreduce_latency_us,
                                  request_overhead_ms=e.request_overhead_ms, source=e.source)
    predict_s = time.perf_counter() - t_start
    out = pf.PredictionFile(
        trace=a.trace, load_kind="concurrency" if closed else "rate_multiplier", deployment=deployment,
        step_model=step_model, speculative=spec.label if spec else None,
        slo=pf.Slo(ttft_ms=a.slo_ttft_ms, tpot_ms=a.slo_tpot_ms), run=run, load_curve=curve,
        eviction_cliff_load=cliff, cliff_drop_pp=a.cliff_drop_pp, slo_capacity_load=capacity, cost=serving,
        requests=[pf.PredictedRequest(request_id=r.request_id, session_id=r.session_id, prompt_tokens=r.prompt_tokens,
                                      output_tokens=r.output_tokens, cached_tokens=r.cached_tokens,
                                      arrival_s=r.arrival_s, ttft_s=_nan_none(r.ttft_s), tpot_s=_nan_none(r.tpot_s),
                                      itl_s=_nan_none(r.itl_s), e2e_s=_nan_none(r.e2e_s), preemptions=r.preemptions,
                                      fits=r.fits) for r in main.requests],
        predict_s=predict_s)
    _print(out, spec_summary, load_s)
    if a.out:
        pf.write_prediction_file(a.out, out)
        print(f"wrote {a.out}")
    return 0


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}ms"


def _print(p, spec_summary: dict | None, load_s: float) -> None:
    d, r, s = p.deployment, p.run, p.step_model
    print(f"PREDICTED {d.model} on {d.tp} x {d.gpu} ({d.gpu_name}): weights {d.weight_gib_per_gpu:.1f} GiB/GPU, "
          f"KV {d.kv_bytes_per_token_per_gpu / 1024:.0f} KiB/token/GPU ({d.kv_cache_dtype}), pool "
          f"{d.num_gpu_blocks:,} blocks x {d.block_size} = {d.kv_cache_tokens:,} tokens; max_num_seqs "
          f"{d.max_num_seqs}, max_num_batched_tokens {d.max_num_batched_tokens}")
    if s.kind == "roofline":
        print(f"step model: roofline, mfu {s.mfu:g}, bandwidth efficiency {s.bandwidth_efficiency:g}, step overhead "
              f"{s.step_overhead_ms:g} ms, request overhead {s.request_overhead_ms:g} ms ({s.source})")
    else:
        print(f"step model: calibration {s.source}")
    if spec_summary:
        print("speculative: " + ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in spec_summary.items()))
    load = f"concurrency {r.concurrency}" if r.concurrency else "the trace's arrival times"
    print(f"at {load}: {r.requests:,} requests, hit rate {r.token_hit_rate:.1%}, TTFT mean {_ms(r.ttft_mean_s)} "
          f"p90 {_ms(r.ttft_p90_s)}, TPOT mean {_ms(r.tpot_mean_s)}, ITL mean {_ms(r.itl_mean_s)}, E2E mean "
          f"{(r.e2e_mean_s or 0):.2f}s; {r.output_tokens_per_s:,.0f} output tok/s, goodput {r.goodput_share:.1%} "
          f"({r.goodput_requests_per_s:.3g} req/s), preemptions {r.preemptions}, KV max {r.kv_usage_max:.0%}")
    unit = "conc" if p.load_kind == "concurrency" else "rate x"
    print(f"{unit:>7} {'hit':>6} {'ttft p50':>9} {'ttft p90':>9} {'tpot p50':>9} {'out tok/s':>10} {'good':>5} "
          f"{'preempt':>7} {'kv max':>6} slo")
    for pt in p.load_curve:
        print(f"{pt.load:>7g} {pt.token_hit_rate:>6.1%} {_ms(pt.ttft_p50_s):>9} {_ms(pt.ttft_p90_s):>9} "
              f"{_ms(pt.tpot_p50_s):>9} {pt.output_tokens_per_s:>10,.0f} {pt.goodput_share:>5.0%} {pt.preemptions:>7} "
              f"{pt.kv_usage_max:>6.0%} {'yes' if pt.meets_slo else 'no'}")
    print(f"eviction cliff (hit rate > {p.cliff_drop_pp:g} pp below the lowest load): "
          + (f"at {p.eviction_cliff_load:g}" if p.eviction_cliff_load is not None else "none within the loads"))
    print(f"SLO capacity (TTFT p90 <= {p.slo.ttft_ms:g} ms, TPOT p50 <= {p.slo.tpot_ms:g} ms, no preemption): "
          + (f"{p.slo_capacity_load:g}" if p.slo_capacity_load is not None else "below the lowest load"))
    c = p.cost
    if c is not None:
        def usd(v):
            return "-" if v is None else f"${v:,.3f}"
        print(f"cost at ${c.usd_per_gpu_hour:g}/GPU-hour x {c.num_gpus} ({c.price_source}): {c.gpu_hours:,.1f} GPU-hours, "
              f"{usd(c.total_usd)}; per 1M input tokens {usd(c.usd_per_mtok_input)}, per 1M output tokens "
              f"{usd(c.usd_per_mtok_output)} (input share of GPU time {c.input_time_share:.0%}), per 1,000 sessions "
              f"{usd(c.usd_per_1000_sessions)}")
    print(f"predicted in {p.predict_s:.1f} s (trace read in {load_s:.1f} s)")
