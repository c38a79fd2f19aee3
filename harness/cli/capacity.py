"""``kvscope capacity``: the predicted load curve, eviction cliff and SLO capacity of a trace on a server,
from the scheduler model (no GPU time beyond the calibration), registered by ``kvscope.harness.cli.main``."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from kvscope.harness.cachemodel.calibration import MIN_FIT_R2
from kvscope.harness.cachemodel.capacity_model import (
    DEFAULT_CLIFF_DROP_PP,
    DEFAULT_TIMING_CV,
    ENSEMBLE_RUNS,
    ENSEMBLE_TOKEN_BUDGET,
)
from kvscope.harness.cli import argtypes
from kvscope.harness.cli.common import add_parser
from kvscope.harness.common.errors import ConfigError, KvscopeError
from kvscope.harness.common.numbers import nan_to_none
from kvscope.harness.replay.calibrate import calibrate_server
from kvscope.harness.serving.backend import load_backend


def _levels(s: str) -> list[int]:
    try:
        out = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--levels: {s!r} is not a comma list of integers (e.g. 1,2,4,8)")
    if not out or any(x <= 0 for x in out) or out != sorted(set(out)):
        raise argparse.ArgumentTypeError(f"--levels: {s!r}: give increasing positive integers, e.g. 1,2,4,8")
    return out


def _slo(s: str):
    from kvscope.harness.analysis.capacity import parse_ttft_slo  # deferred: keeps `kvscope --help` fast

    try:
        return parse_ttft_slo(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_subcommands(subparsers: "argparse._SubParsersAction") -> None:
    p = add_parser(subparsers, "capacity", "predict the concurrency curve, eviction cliff and capacity of a trace",
                   "Run TRACE through a step-level model of vLLM V1's scheduler (queues, max_num_seqs, chunked "
                   "prefill, block allocation, preemption, prefix-cache eviction) at each closed-loop "
                   "concurrency level, with step times from a calibration of the target server. --server "
                   "CONFIG starts that server, measures it (a few dozen requests) and saves the calibration; "
                   "--calibration FILE reuses one.")
    p.add_argument("trace", metavar="TRACE", help="a kvscope trace directory (or any trace `simulate` reads)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--server", metavar="CONFIG", help="server config YAML: start it and calibrate first")
    src.add_argument("--calibration", metavar="FILE", help="a calibration.json written by an earlier run")
    p.add_argument("--save-calibration", metavar="FILE", default="calibration.json",
                   help="with --server: where the calibration is written (default calibration.json)")
    p.add_argument("--client-priority", choices=["normal", "realtime", "auto"], default="normal",
                   help="with --server: the calibration client's CPU scheduling, as in replay (default normal; "
                   "realtime: SCHED_FIFO, auto: realtime where permitted); use the replays' choice")
    p.add_argument("--slo-ttft-p90", "--slo-ttft-ms", dest="slo_ttft", type=_slo, default="2000", metavar="SLO",
                   help="TTFT p90 objective for the capacity: milliseconds (2000, 2000ms) or a multiple of the "
                   "server's unloaded TTFT p90, i.e. the predicted lowest level's (3x_unloaded); default 2000 ms")
    p.add_argument("--levels", type=_levels, default=[1, 2, 4, 8, 16, 32],
                   help="comma list of concurrency levels (default 1,2,4,8,16,32)")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiplies think times and tool latencies, as in replay (default 1; 0: none)")
    p.add_argument("--mode", choices=["recorded", "live"], default="recorded",
                   help="as in replay: recorded (prompts carry the trace's assistant tokens, so output blocks "
                   "never hit; what `kvscope replay` measures by default) or live (they carry the model's own)")
    p.add_argument("--num-gpu-blocks", type=argtypes.num_gpu_blocks, default=None,
                   help="override the calibrated server's num_gpu_blocks (what-if KV capacity)")
    p.add_argument("--cliff-drop-pp", type=float, default=DEFAULT_CLIFF_DROP_PP,
                   help="hit-rate drop (percentage points below the lowest level) that marks the cliff")
    p.add_argument("--runs", type=argtypes.positive_int, default=None, metavar="N",
                   help="runs of the model per level that comes near a full KV pool, each with the host's "
                   "timing noise (the calibration's timing_cv); their means and the preemption spread are "
                   f"reported (default {ENSEMBLE_RUNS}, fewer for traces over "
                   f"{ENSEMBLE_TOKEN_BUDGET / ENSEMBLE_RUNS / 1e6:g} M prompt tokens; 1: one noise-free run)")
    p.add_argument("--min-fit-r2", type=float, default=MIN_FIT_R2,
                   help="refuse a calibration whose step-cost fit explains less than this share of the timing "
                   f"variance (default {MIN_FIT_R2:g}; a loaded host gives fits near or below 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="also write the curve and verdicts as JSON")
    p.set_defaults(func=_cmd_capacity)


def _calibrate(config_path: str, out: str, client_priority: str = "normal"):
    backend = load_backend(config_path)
    backend.start()
    try:
        cal = calibrate_server(backend, out, client_priority_mode=client_priority)  # type: ignore[arg-type]
    finally:
        backend.stop()
    return cal, backend.speculative_decoding()


def _cmd_capacity(args: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.analysis.capacity_prediction import (
        CalibrationFitError,
        predict_curve,
        predicted_capacity,
    )
    from kvscope.harness.results.loaders import load_calibration  # deferred: keeps `kvscope --help` fast

    if args.time_scale < 0:
        raise ConfigError(f"--time-scale: {args.time_scale} is negative; give 0 or more")
    if isinstance(args.slo_ttft, str):  # the default, not run through the type
        args.slo_ttft = _slo(args.slo_ttft)
    speculative = False
    if args.server:
        cal, speculative = _calibrate(args.server, args.save_calibration, args.client_priority)
        print(f"calibrated {cal.server.endpoint}: {len(cal.samples)} samples, R² {cal.fit_r2:.3f}, "
              f"load average {cal.load_average_1m:.1f}; saved {args.save_calibration}")
    else:
        cal = load_calibration(args.calibration)
    t0 = time.perf_counter()
    try:
        curve = predict_curve(args.trace, cal, args.levels, num_gpu_blocks=args.num_gpu_blocks,
                              time_scale=args.time_scale, mode=args.mode, ensemble_runs=args.runs,
                              min_fit_r2=args.min_fit_r2)
    except CalibrationFitError:
        source = args.save_calibration if args.server else args.calibration
        load = "" if cal.load_average_1m is None else f", load average {cal.load_average_1m:.1f} while measuring"
        raise KvscopeError(
            f"calibration {source}: the step-cost fit is too poor to predict from (R² {cal.fit_r2:.2f} < "
            f"--min-fit-r2 {args.min_fit_r2:g}, median error {cal.fit_median_rel_error:.0%}{load}); "
            + ("the model takes one token per decode step, and this server decodes speculatively "
               f"(speculative_config in {args.server})" if speculative else
               "calibrate again on a quiet host or lower --min-fit-r2")) from None
    rows, cfg = curve.rows, curve.config
    found, cliff = predicted_capacity(rows, args.slo_ttft, cliff_drop_pp=args.cliff_drop_pp)
    capacity = None if found.capacity is None else int(found.capacity)
    print(f"{'conc':>5} {'hit':>7} {'ttft p50':>9} {'ttft p90':>9} {'e2e p50':>9} {'preemptions':>16} "
          f"{'kv mean':>8} {'kv max':>7} {'runs':>5} {'sim s':>6}")
    for r in rows:
        spread = f" ({r.preemptions_p10:.0f}-{r.preemptions_p90:.0f})" if r.preemptions_p90 > r.preemptions_p10 else ""
        print(f"{r.concurrency:>5} {r.token_hit_rate:>7.1%} {r.ttft_p50_s * 1e3:>7.0f}ms {r.ttft_p90_s * 1e3:>7.0f}ms "
              f"{r.e2e_p50_s:>8.2f}s {f'{r.preemptions:.1f}{spread}':>16} {r.kv_usage_mean:>8.0%} "
              f"{r.kv_usage_max:>7.0%} {r.runs:>5} {r.simulate_s:>6.2f}")
    blocks = "infinite" if cfg.num_gpu_blocks is None else f"{cfg.num_gpu_blocks} blocks"
    print(f"server model: block size {cfg.block_size}, {blocks}, max_num_seqs {cfg.max_num_seqs}, "
          f"max_num_batched_tokens {cfg.max_num_batched_tokens}")
    print(f"eviction cliff (hit rate > {args.cliff_drop_pp:g} pp below level {rows[0].concurrency}): "
          + (f"at concurrency {cliff}" if cliff else "none within the levels"))
    print(f"capacity ({found.slo_text()}, no preemption in the median run): "
          + (f"{capacity} concurrent sessions" if capacity else f"below {rows[0].concurrency}"))
    if any(r.runs > 1 for r in rows):
        print(f"levels near a full pool: the mean of {max(r.runs for r in rows)} runs with timing noise (cv "
              f"{cal.timing_cv if cal.timing_cv is not None else DEFAULT_TIMING_CV:.2f}); preemptions: mean "
              "(10th-90th percentile of the runs)")
    print(f"predicted in {time.perf_counter() - t0:.1f} s")
    if args.json:
        def clean(d: dict) -> dict:
            return {k: nan_to_none(v) for k, v in d.items()}

        with open(args.json, "w") as f:
            json.dump({"trace": args.trace, "calibration": cal.model_dump(exclude={"samples"}),
                       "slo_ttft_ms": found.slo_ttft_p90_ms, "slo_ttft_p90": args.slo_ttft.text,
                       "slo_unloaded_ttft_p90_ms": found.slo_unloaded_ttft_p90_ms, "cliff_concurrency": cliff,
                       "capacity_concurrency": capacity, "levels": [clean(asdict(r)) for r in rows]}, f, indent=1)
    return 0
