"""The scheduler model (``kvscope capacity``) against real vLLM CPU, and its speed on the full-size preset.

Accuracy: start one vLLM CPU server with a small KV pool (``num_gpu_blocks_override``), calibrate it, then for
each concurrency level replay the agent trace closed-loop (recorded mode, fresh prefix cache) and compare:
replay-informed (the run's own ``sent_s`` -> cached tokens per request, share predicted exactly) and
predictive (trace + calibration only -> hit rate, TTFT p50, preemptions, cliff).  Speed: the predictive mode on
the full-size 100-session agent-coding preset, seconds per level.  Timings are noisy on a shared machine: the
load average is printed with every measurement.

Usage:
  python benchmarks/capacity_predict.py accuracy --trace TRACE [--blocks 64] [--levels 1,2,4,8,16,32]
  python benchmarks/capacity_predict.py speed --trace FULL_TRACE [--capacity-tokens 4e6] [--levels 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def accuracy(trace: str, blocks: int, levels: list[int], model_dir: str, out: str | None) -> list[dict]:
    import numpy as np

    from kvscope.harness.cachemodel.capacity_model import find_cliff, predict_levels
    from kvscope.harness.cachemodel.trace_io import load_trace
    from kvscope.harness.replay.calibrate import (calibrate_server, cost_model, measure_level,
                                                  replay_informed_match, scheduler_config)
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-capacity-"))
    print(f"runs in {tmp}", flush=True)
    server = VllmServer(ServerConfig(model=model_dir, served_model_name="tiny", max_model_len=2048,
                                     num_gpu_blocks_override=blocks, startup_timeout_s=300),
                        log_path=tmp / "server.log")
    server.start()
    rows = []
    try:
        cal = calibrate_server(server.endpoint, tmp / "calibration.json")
        print(f"calibration: {len(cal.samples)} samples, R2 {cal.fit_r2:.3f}, median rel. error "
              f"{cal.fit_median_rel_error:.1%}, cost {cal.cost.model_dump()}, load {cal.load_average_1m:.1f}")
        cfg = scheduler_config(cal)
        reqs = load_trace(trace, cfg.block_size).requests
        for c in levels:
            df, preempt, load = measure_level(trace, server.endpoint, c, tmp / f"run-c{c}")
            exact, n, _ = replay_informed_match(trace, df, cal)
            ok = df[df["error_class"].isna()]
            hit = float(ok["cached_tokens"].fillna(0).sum() / ok["prompt_tokens"].sum())
            pred = predict_levels(reqs, cfg, cost_model(cal), [c], time_scale=0.0)[0]
            row = {"concurrency": c, "requests": n, "replay_informed_exact": exact / n,
                   "hit_measured": hit, "hit_predicted": pred.token_hit_rate,
                   "ttft_p50_measured_s": float(np.median(ok["ttft_s"])), "ttft_p50_predicted_s": pred.ttft_p50_s,
                   "preemptions_measured": preempt, "preemptions_predicted": pred.preemptions,
                   "load_average_1m": load}
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.stop()

    class _R:  # find_cliff takes rows with .concurrency / .token_hit_rate
        def __init__(self, c, h):
            self.concurrency, self.token_hit_rate = c, h

    cliff_m = find_cliff([_R(r["concurrency"], r["hit_measured"]) for r in rows])
    cliff_p = find_cliff([_R(r["concurrency"], r["hit_predicted"]) for r in rows])
    print(f"\n{blocks} blocks x {cfg.block_size} tokens; trace {trace}")
    print("| conc | replay-informed exact | hit measured | hit predicted | TTFT p50 measured | TTFT p50 predicted "
          "| preempt. measured | preempt. predicted | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['replay_informed_exact']:.1%} | {r['hit_measured']:.1%} | "
              f"{r['hit_predicted']:.1%} | {r['ttft_p50_measured_s'] * 1e3:.0f} ms | "
              f"{r['ttft_p50_predicted_s'] * 1e3:.0f} ms | {r['preemptions_measured']:.0f} | "
              f"{r['preemptions_predicted']} | {r['load_average_1m']:.1f} |")
    print(f"cliff (hit > 5 pp below level {levels[0]}): measured {cliff_m}, predicted {cliff_p}")
    if out:
        Path(out).write_text(json.dumps({"rows": rows, "cliff_measured": cliff_m, "cliff_predicted": cliff_p},
                                        indent=1))
    return rows


def reanalyze(trace: str, run_root: str, measured_json: str | None) -> list[dict]:
    """Predictions of the current model for runs an earlier ``accuracy`` call measured (its temporary dir
    holds calibration.json and run-cN/): no server needed.  Preemption counts come from its --out JSON."""
    import numpy as np
    import pandas as pd

    from kvscope.harness.cachemodel.calibration import TimingSample, fit_cost_model
    from kvscope.harness.cachemodel.capacity_model import predict_levels
    from kvscope.harness.cachemodel.trace_io import load_trace
    from kvscope.harness.replay.calibrate import load_calibration, replay_informed_match, scheduler_config
    from kvscope.harness.results.schemas import CalibrationCost

    root = Path(run_root)
    cal = load_calibration(root / "calibration.json")
    samples = [TimingSample(x.steps, x.tokens, x.seq_steps, x.context_tokens, x.seconds, x.kind,
                            1.0 if x.kind == "prefill" else x.requests) for x in cal.samples]
    fit = fit_cost_model(samples)
    cal = cal.model_copy(update={"cost": CalibrationCost(**fit.model.as_dict()), "fit_r2": fit.r2})
    print(f"refit: {fit.model}, R2 {fit.r2:.3f}, median rel. error {fit.median_rel_error:.1%}")
    measured = {r["concurrency"]: r for r in json.loads(Path(measured_json).read_text())["rows"]} \
        if measured_json else {}
    cfg = scheduler_config(cal)
    reqs = load_trace(trace, cfg.block_size).requests
    rows = []
    for d in sorted((d for d in root.glob("run-c*") if (d / "requests.parquet").exists()),
                    key=lambda p: int(p.name[5:])):
        c = int(d.name[5:])
        df = pd.read_parquet(d / "requests.parquet")
        exact, n, _ = replay_informed_match(trace, df, cal)
        ok = df[df["error_class"].isna()]
        pred = predict_levels(reqs, cfg, cost_model_of(cal), [c], time_scale=0.0)[0]
        rows.append({"concurrency": c, "requests": n, "replay_informed_exact": exact / n,
                     "hit_measured": float(ok["cached_tokens"].fillna(0).sum() / ok["prompt_tokens"].sum()),
                     "hit_predicted": pred.token_hit_rate, "ttft_p50_measured_s": float(np.median(ok["ttft_s"])),
                     "ttft_p50_predicted_s": pred.ttft_p50_s,
                     "preemptions_measured": measured.get(c, {}).get("preemptions_measured", math.nan),
                     "preemptions_predicted": pred.preemptions,
                     "load_average_1m": measured.get(c, {}).get("load_average_1m", math.nan)})
    _table(rows, cfg, trace)
    return rows


def cost_model_of(cal):
    from kvscope.harness.replay.calibrate import cost_model

    return cost_model(cal)


def _table(rows: list[dict], cfg, trace: str) -> None:
    from kvscope.harness.cachemodel.capacity_model import find_cliff

    class _R:
        def __init__(self, c, h):
            self.concurrency, self.token_hit_rate = c, h

    cliff_m = find_cliff([_R(r["concurrency"], r["hit_measured"]) for r in rows])
    cliff_p = find_cliff([_R(r["concurrency"], r["hit_predicted"]) for r in rows])
    print(f"\n{cfg.num_gpu_blocks} blocks x {cfg.block_size} tokens; trace {trace}")
    print("| conc | replay-informed exact | hit measured | hit predicted | TTFT p50 measured | TTFT p50 predicted "
          "| preempt. measured | preempt. predicted | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['replay_informed_exact']:.1%} | {r['hit_measured']:.1%} | "
              f"{r['hit_predicted']:.1%} | {r['ttft_p50_measured_s'] * 1e3:.0f} ms | "
              f"{r['ttft_p50_predicted_s'] * 1e3:.0f} ms | {r['preemptions_measured']:.0f} | "
              f"{r['preemptions_predicted']} | {r['load_average_1m']:.1f} |")
    print(f"cliff (hit > 5 pp below level {rows[0]['concurrency']}): measured {cliff_m}, predicted {cliff_p}")


def speed(trace: str, capacity_tokens: float, levels: list[int], block_size: int) -> None:
    from kvscope.harness.cachemodel.calibration import StepCostModel
    from kvscope.harness.cachemodel.capacity_model import predict_levels
    from kvscope.harness.cachemodel.scheduler import SchedulerConfig
    from kvscope.harness.cachemodel.trace_io import load_trace

    t = time.perf_counter()
    tr = load_trace(trace, block_size)
    prompt = sum(r.prompt_tokens for r in tr.requests)
    print(f"read {trace}: {len(tr.requests)} requests, {prompt / 1e6:.0f} M prompt tokens, "
          f"{time.perf_counter() - t:.1f} s")
    cfg = SchedulerConfig(block_size, int(capacity_tokens) // block_size)
    cost = StepCostModel(0.01, 2e-5, 5e-4, 1e-8)  # a plausible GPU-ish step cost; speed barely depends on it
    for c in levels:  # CPU seconds are what one core would take; wall seconds depend on the host's load
        cpu0 = time.process_time()
        row = predict_levels(tr.requests, cfg, cost, [c], time_scale=1.0)[0]
        cpu = time.process_time() - cpu0
        print(f"concurrency {row.concurrency:>3}: {cpu:.1f} s CPU, {row.simulate_s:.1f} s wall  "
              f"hit {row.token_hit_rate:.1%}  preemptions {row.preemptions}  kv max {row.kv_usage_max:.0%}  "
              f"(load average {os.getloadavg()[0]:.1f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("accuracy")
    a.add_argument("--trace", required=True)
    a.add_argument("--blocks", type=int, default=64)
    a.add_argument("--levels", default="1,2,4,8,16,32")
    a.add_argument("--model", default=os.environ.get("KVSCOPE_TEST_MODEL", "/work/tools/tiny"))
    a.add_argument("--out", default=None)
    r = sub.add_parser("reanalyze")
    r.add_argument("--trace", required=True)
    r.add_argument("--runs", required=True, help="the temporary directory an accuracy call printed")
    r.add_argument("--measured", default=None, help="the accuracy call's --out JSON (preemption counts)")
    s = sub.add_parser("speed")
    s.add_argument("--trace", required=True)
    s.add_argument("--capacity-tokens", type=float, default=4e6)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--levels", default="1,8,32")
    args = ap.parse_args()
    levels = [int(x) for x in getattr(args, "levels", "1").split(",")]
    if args.what == "reanalyze":
        reanalyze(args.trace, args.runs, args.measured)
    elif args.what == "accuracy":
        accuracy(args.trace, args.blocks, levels, args.model, args.out)
    else:
        speed(args.trace, args.capacity_tokens, levels, args.block_size)


if __name__ == "__main__":
    main()
