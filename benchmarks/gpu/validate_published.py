"""Predict published vLLM GPU measurements with kvscope's scheduler model and a first-principles step cost.

Reads the raw points in ``benchmarks/gpu/points/`` (each with its source), builds each point's workload as a
request list, runs it through :func:`kvscope.harness.cachemodel.scheduler.run_scheduler` with a step cost from
the GPU's datasheet and the model's architecture, and compares predicted with published figures: TTFT
mean / median / p90 / p99, E2E mean / median, output throughput, per point, and the median absolute
percentage error per metric, separately for the calibration and the validation set (``points/split.yaml``,
fixed before any comparison).

Efficiency factors: ``--factors defaults`` uses the documented defaults of the step-cost model (gpus.yaml;
results in ``benchmarks/results/gpu_validation_defaults.*``); ``--factors calibrated`` (the default) fits them on the calibration points only (per GPU: achieved share of peak
FLOPs and of bandwidth; shared: per-step overhead and the frontend's per-request time) and applies them to the
validation points unchanged; the H200 has no calibration point and takes the H100's factors.

Workloads:

* LambdaLabs (vLLM 0.5.4): the published per-request input and output lengths, all sent at t=0; a request
  whose published output is 0 tokens (the stream returned no text) generates one token and counts with TTFT 0
  in the mean, as in the published figure;
* SGLang's vLLM 0.6.0 runs: ShareGPT-like (input, output) pairs drawn (seed 1) from the LambdaLabs Llama-3
  ShareGPT sample, outputs rescaled to the runs' mean output (194.3 tokens), Poisson arrivals at the stated rate
  (seed 1) or all at t=0;
* vLLM's latency benchmark: 8 requests of 32 input and 128 output tokens at t=0, no HTTP frontend.

The step cost, the KV pool and the request lists are kvscope's own (``gpu_predict.plan_deployment``,
``roofline.roofline_step_cost``, ``gpu_predict.synthetic_requests``); this script adds the workloads and the
frontend queue below.

Frontend: vLLM's API server tokenizes and queues requests on the engine's event loop, so a burst of N requests
reaches the scheduler only after about N times a per-request frontend time (the first TTFT of a 320-request
burst is about 1 s on both GPUs while a 2,048-token prefill takes tens of ms); requests whose frontend work
overlaps are released together at the end of that busy period.

Usage: ``python benchmarks/gpu/validate_published.py [--factors calibrated|defaults] [--out-json F]``
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
POINTS = HERE / "points"
RESULTS = REPO / "benchmarks" / "results"

from kvscope.harness.cachemodel.gpu_predict import (
    Deployment,
    ServerSettings,
    plan_deployment,
    synthetic_requests,
)
from kvscope.harness.cachemodel.gpus import Efficiency
from kvscope.harness.cachemodel.scheduler import SessionTiming, run_scheduler

BLOCK = 16

# --------------------------------------------------------------------------------------------------------------
# Hardware, models and the step cost: kvscope's own (gpus.yaml, model_configs/, roofline.RooflineStepCost).
# --------------------------------------------------------------------------------------------------------------

#: Published model id -> bundled config (Llama-3-8B/70B have Llama-3.1's shapes; only the RoPE scaling differs).
def model_key(model_id: str) -> str:
    m = model_id.lower()
    if "mixtral-8x7b" in m:
        return "mixtral-8x7b"
    if "mistral-7b" in m:
        return "mistral-7b"
    if "70b" in m:
        return "llama-3.1-70b"
    if "8b" in m:
        return "llama-3.1-8b"
    raise ValueError(f"no bundled model config for {model_id!r}")


DEFAULT_FACTORS = Efficiency()


def deployment(p: Point, f: Efficiency) -> Deployment:
    """The point's model on its GPUs with its server flags; the frontend time is queued by
    :func:`frontend_release`, so the step cost itself gets none (no double counting)."""
    eff = f.model_copy(update={"request_overhead_ms": 0.0})
    return plan_deployment(p.gpu, p.model, tp=p.tp, settings=p.settings, efficiency=eff)


# --------------------------------------------------------------------------------------------------------------
# Points and workloads.
# --------------------------------------------------------------------------------------------------------------


@dataclass
class Point:
    id: str
    source: str
    gpu: str
    tp: int
    model: str
    inputs: list[int]
    outputs: list[int]
    #: Send times (s); all zero for a burst.
    send_s: list[float]
    #: Requests that count with TTFT 0 in the published mean (published output 0).
    empty: list[bool]
    settings: ServerSettings
    http: bool
    published: dict[str, float]
    meta: dict[str, Any] = field(default_factory=dict)


def _lambdalabs() -> list[Point]:
    doc = json.loads((POINTS / "lambdalabs_vllm_benchmark.json").read_text())
    out = []
    for p in doc["points"]:
        pub = p["published"]
        model = model_key(p["model_id"])
        mbt = max(p["max_model_len"], 2048)
        cfg = ServerSettings(max_num_seqs=1024, max_num_batched_tokens=mbt, block_size=BLOCK,
                             gpu_memory_utilization=0.95, enable_chunked_prefill=False)
        n = len(p["input_lens"])
        measured = {
            "ttft_mean_ms": pub["mean_ttft_ms"], "ttft_median_ms": pub["median_ttft_ms"],
            "ttft_p99_ms": pub["p99_ttft_ms"], "e2e_mean_ms": pub["mean_latency_ms"],
            "e2e_median_ms": pub["median_latency_ms"], "output_throughput": pub["output_throughput"],
            "request_throughput": pub["request_throughput"],
        }
        if "ttfts_s" in pub:  # per-request TTFTs published: p90 as the client computes percentiles
            measured["ttft_p90_ms"] = float(np.percentile(np.array(pub["ttfts_s"]) * 1e3, 90))
        out.append(Point(p["id"], "lambdalabs", p["gpu"], p["tp"], model, list(p["input_lens"]),
                         [max(o, 1) for o in p["output_lens"]], [0.0] * n, [o == 0 for o in p["output_lens"]],
                         cfg, True, measured, {"published_output_tokens": sum(p["output_lens"])}))
    return out


SHAREGPT_MEAN_OUTPUT = 4132.37 / 21.27  # SGLang README, vLLM offline run: output tok/s / req/s


def _sharegpt_pairs() -> list[tuple[int, int]]:
    doc = json.loads((POINTS / "lambdalabs_vllm_benchmark.json").read_text())
    p = next(x for x in doc["points"] if x["id"] == "ll-h100-llama3-8b-n320")
    return [(i, o) for i, o in zip(p["input_lens"], p["output_lens"]) if o >= 4 and i >= 4]


def _sglang() -> list[Point]:
    doc = yaml.safe_load((POINTS / "sglang_benchmark_vllm_060.yaml").read_text())
    pairs = _sharegpt_pairs()
    scale = SHAREGPT_MEAN_OUTPUT / statistics.fmean(o for _, o in pairs)
    out = []
    for p in doc["points"]:
        rng = np.random.default_rng(1)
        n = p["num_prompts"]
        idx = rng.integers(0, len(pairs), n)
        inputs = [pairs[i][0] for i in idx]
        outputs = [max(1, round(pairs[i][1] * scale)) for i in idx]
        rate = p["request_rate"]
        if rate == "inf":
            send = [0.0] * n
        else:
            send = np.cumsum(rng.exponential(1.0 / float(rate), n)).tolist()
        model = model_key(p["model_id"])
        cfg = ServerSettings(max_num_seqs=256, max_num_batched_tokens=4096, block_size=BLOCK,
                             gpu_memory_utilization=0.9, enable_chunked_prefill=False)
        pub = p["published"]
        measured = {}
        for k_pub, k in [("median_e2e_ms", "e2e_median_ms"), ("median_ttft_ms", "ttft_median_ms"),
                         ("median_tpot_ms", "tpot_median_ms"), ("output_throughput", "output_throughput"),
                         ("request_throughput", "request_throughput")]:
            if k_pub in pub:
                measured[k] = float(pub[k_pub])
        out.append(Point(p["id"], "sglang", p["gpu"], p["tp"], model, inputs, outputs, send, [False] * n, cfg,
                         True, measured, {"request_rate": rate, "num_scheduler_steps": 10}))
    return out


def _vllm_latency() -> list[Point]:
    doc = yaml.safe_load((POINTS / "vllm_latency_benchmark.yaml").read_text())
    out = []
    for p in doc["points"]:
        b = p["batch_size"]
        model = "llama-3.1-8b"
        cfg = ServerSettings(max_num_seqs=256, max_num_batched_tokens=8192, block_size=BLOCK,
                             gpu_memory_utilization=0.9)
        out.append(Point(p["id"], "vllm-latency", p["gpu"], p["tp"], model, [p["input_len"]] * b,
                         [p["output_len"]] * b, [0.0] * b, [False] * b, cfg, False,
                         {"batch_latency_ms": float(p["published"]["mean_latency_ms"])}))
    return out


def load_points() -> list[Point]:
    return _lambdalabs() + _sglang() + _vllm_latency()


def load_split() -> dict[str, str]:
    doc = yaml.safe_load((POINTS / "split.yaml").read_text())
    return {**{i: "calibration" for i in doc["calibration"]}, **{i: "validation" for i in doc["validation"]}}


# --------------------------------------------------------------------------------------------------------------
# Prediction.
# --------------------------------------------------------------------------------------------------------------


def frontend_release(send_s: Sequence[float], frontend_s: float) -> list[float]:
    """When each request reaches the scheduler: the frontend serves requests one at a time (``frontend_s``
    each, in send order) and the engine does not step while it is busy, so every request of one busy period is
    released at the period's end."""
    n = len(send_s)
    if frontend_s <= 0:
        return list(send_s)
    order = sorted(range(n), key=lambda i: send_s[i])
    release = [0.0] * n
    group: list[int] = []
    busy_until = -math.inf
    for i in order:
        if group and send_s[i] > busy_until:
            for j in group:
                release[j] = busy_until
            group = []
        busy_until = max(busy_until, send_s[i]) + frontend_s
        group.append(i)
    for j in group:
        release[j] = busy_until
    return release


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else math.nan


def predict_point(p: Point, f: Efficiency) -> dict[str, float]:
    dep = deployment(p, f)
    release = frontend_release(p.send_s, f.request_overhead_ms / 1e3 if p.http else 0.0)
    reqs = synthetic_requests(p.inputs, p.outputs, release, block_size=BLOCK,
                              session_ids=[f"r{i}" for i in range(len(p.inputs))])
    run = run_scheduler(reqs, dep.scheduler_config, dep.cost, SessionTiming(arrivals_s=release))
    ttft, e2e, tpot = [], [], []
    for r, sent, empty in zip(run.results, p.send_s, p.empty):
        t_first = r.first_token_s - sent
        t_done = r.done_s - sent
        ttft.append(0.0 if empty else t_first)
        e2e.append(t_done)
        if r.output_tokens > 1:
            tpot.append((t_done - t_first) / (r.output_tokens - 1))
    nonempty_ttft = [t for t, e in zip(ttft, p.empty) if not e]
    duration = max(r.done_s for r in run.results) - min(p.send_s)
    out_tokens = p.meta.get("published_output_tokens", sum(p.outputs))
    pred = {
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft),
        "ttft_median_ms": 1e3 * _pct(ttft, 50),
        "ttft_p90_ms": 1e3 * _pct(ttft, 90),
        "ttft_p99_ms": 1e3 * _pct(ttft, 99),
        "ttft_nonempty_mean_ms": 1e3 * statistics.fmean(nonempty_ttft),
        "e2e_mean_ms": 1e3 * statistics.fmean(e2e),
        "e2e_median_ms": 1e3 * _pct(e2e, 50),
        "tpot_median_ms": 1e3 * _pct(tpot, 50) if tpot else math.nan,
        "output_throughput": out_tokens / duration,
        "request_throughput": len(p.inputs) / duration,
        "batch_latency_ms": 1e3 * duration,
        "preemptions": float(run.preemptions),
        "steps": float(run.steps),
    }
    return pred


#: Metrics compared, in table order; a point is compared on those it publishes.
METRICS = ["ttft_mean_ms", "ttft_median_ms", "ttft_p90_ms", "ttft_p99_ms", "e2e_mean_ms", "e2e_median_ms",
           "tpot_median_ms", "output_throughput", "request_throughput", "batch_latency_ms"]
#: The metrics the fit minimises (log error) on the calibration points.
FIT_METRICS = ["ttft_mean_ms", "ttft_median_ms", "ttft_p99_ms", "e2e_mean_ms", "e2e_median_ms", "output_throughput"]


def errors(p: Point, pred: dict[str, float]) -> dict[str, float]:
    return {m: (pred[m] - p.published[m]) / p.published[m] for m in METRICS if m in p.published}


# --------------------------------------------------------------------------------------------------------------
# Calibration: fit the factors on the calibration points only.
# --------------------------------------------------------------------------------------------------------------

_FIT_GPUS = ("h100-sxm", "a100-80gb-sxm")


def _unpack(x: Sequence[float]) -> dict[str, Efficiency]:
    """x (log space): per fitted GPU (mfu, bandwidth efficiency), then shared step overhead and frontend."""
    lim = lambda v: min(max(v, 0.01), 1.0)
    overhead, frontend = math.exp(x[-2]), math.exp(x[-1])
    out = {}
    for k, g in enumerate(_FIT_GPUS):
        out[g] = Efficiency(mfu=lim(math.exp(x[2 * k])), bandwidth_efficiency=lim(math.exp(x[2 * k + 1])),
                            step_overhead_ms=overhead, allreduce_latency_us=DEFAULT_FACTORS.allreduce_latency_us,
                            request_overhead_ms=frontend, source="fitted on the calibration split")
    return out


def factors_for(gpu: str, table: dict[str, Efficiency]) -> Efficiency:
    if gpu in table:
        return table[gpu]
    if gpu == "h200-sxm" and "h100-sxm" in table:  # same Hopper generation; no H200 calibration point
        return table["h100-sxm"]
    return DEFAULT_FACTORS


def calibrate(points: Sequence[Point]) -> tuple[dict[str, Efficiency], dict[str, Any]]:
    """Least squares on log(predicted / measured) over :data:`FIT_METRICS` of the calibration points, in log
    parameters (finite differences of 5 %: the scheduler model is piecewise constant in its inputs below that)."""
    from scipy.optimize import least_squares

    def residuals(x: Sequence[float]) -> list[float]:
        table = _unpack(x)
        out = []
        for p in points:
            pred = predict_point(p, factors_for(p.gpu, table))
            out += [math.log(max(pred[m], 1e-9) / p.published[m]) for m in FIT_METRICS if m in p.published]
        return out

    d = DEFAULT_FACTORS
    x0 = [math.log(d.mfu), math.log(d.bandwidth_efficiency)] * len(_FIT_GPUS)
    x0 += [math.log(d.step_overhead_ms), math.log(d.request_overhead_ms)]
    lo = [math.log(0.05), math.log(0.2)] * len(_FIT_GPUS) + [math.log(0.01), math.log(0.01)]
    hi = [0.0, 0.0] * len(_FIT_GPUS) + [math.log(50.0), math.log(50.0)]
    t0 = time.perf_counter()
    res = least_squares(residuals, x0, bounds=(lo, hi), diff_step=0.05, max_nfev=120)
    return _unpack(res.x), {"cost": float(res.cost), "evaluations": int(res.nfev),
                            "fit_s": round(time.perf_counter() - t0, 1), "points": [p.id for p in points],
                            "metrics": FIT_METRICS, "method": "scipy least_squares on log errors"}


# --------------------------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------------------------


def _median_abs(values: Sequence[float]) -> float | None:
    v = [abs(x) for x in values if not math.isnan(x)]
    return float(statistics.median(v)) if v else None


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for part in ("calibration", "validation"):
        sel = [r for r in rows if r["set"] == part]
        out[part] = {"points": len(sel)}
        for m in METRICS:
            errs = [r["error"][m] for r in sel if m in r["error"]]
            if errs:
                out[part][m] = {"median_abs_pct": round(100 * _median_abs(errs), 1), "n": len(errs)}
    return out


def markdown(rows: Sequence[dict[str, Any]], summary: dict[str, Any], factors: dict[str, Any]) -> str:
    cols = [("ttft_mean_ms", "TTFT mean ms"), ("ttft_median_ms", "TTFT p50 ms"), ("ttft_p90_ms", "TTFT p90 ms"),
            ("e2e_mean_ms", "E2E mean ms"), ("e2e_median_ms", "E2E p50 ms"), ("output_throughput", "out tok/s"),
            ("batch_latency_ms", "batch ms")]
    lines = ["| point | set | GPU | TP | model | " + " | ".join(c[1] for c in cols) + " |",
             "|---|---|---|---|---|" + "---|" * len(cols)]
    for r in rows:
        cells = []
        for m, _ in cols:
            if m in r["measured"]:
                cells.append(f"{r['predicted'][m]:.0f} / {r['measured'][m]:.0f} ({100 * r['error'][m]:+.0f}%)")
            else:
                cells.append("")
        lines.append(f"| {r['id']} | {r['set'][:3]} | {r['gpu']} | {r['tp']} | {r['model']} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: predicted / measured (error).", "",
              "| set | points | " + " | ".join(c[1] for c in cols) + " |",
              "|---|---|" + "---|" * len(cols)]
    for part, s in summary.items():
        cells = [f"{s[m]['median_abs_pct']}% (n={s[m]['n']})" if m in s else "" for m, _ in cols]
        lines.append(f"| {part} | {s['points']} | " + " | ".join(cells) + " |")
    lines += ["", "Median absolute percentage error per metric.", "", "Factors: `" + json.dumps(factors) + "`"]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--factors", choices=["calibrated", "defaults"], default="calibrated")
    ap.add_argument("--out-json", type=Path, help="default: benchmarks/results/gpu_validation[_defaults].json")
    ap.add_argument("--out-md", type=Path, help="default: beside --out-json, .md")
    args = ap.parse_args(argv)
    stem = "gpu_validation" + ("_defaults" if args.factors == "defaults" else "")
    args.out_json = args.out_json or RESULTS / f"{stem}.json"
    args.out_md = args.out_md or args.out_json.with_suffix(".md")

    points = load_points()
    split = load_split()
    missing = [p.id for p in points if p.id not in split]
    if missing:
        print(f"error: points missing from split.yaml: {', '.join(missing)}", file=sys.stderr)
        return 2
    calib = [p for p in points if split[p.id] == "calibration"]
    fit_info: dict[str, Any] = {}
    if args.factors == "calibrated":
        table, fit_info = calibrate(calib)
    else:
        table = {}
    rows = []
    for p in points:
        f = factors_for(p.gpu, table)
        pred = predict_point(p, f)
        rows.append({"id": p.id, "set": split[p.id], "source": p.source, "gpu": p.gpu, "tp": p.tp,
                     "model": p.model, "requests": len(p.inputs), "measured": p.published,
                     "predicted": {k: round(v, 3) for k, v in pred.items()}, "error": errors(p, pred),
                     "factors": f.model_dump()})
    summary = summarize(rows)
    factors_out = {g: f.model_dump() for g, f in table.items()}
    doc = {"kind": "gpu_validation", "version": 1, "factors_mode": args.factors, "factors": factors_out,
           "fit": fit_info, "summary": summary, "points": rows,
           "targets": {"validation_e2e_mean_median_abs_pct": 10, "validation_ttft_mean_median_abs_pct": 20}}
    args.out_json.parent.mkdir(parents=True, exist_ok=True)
    args.out_json.write_text(json.dumps(doc, indent=1) + "\n")
    md = markdown(rows, summary, factors_out)
    args.out_md.write_text(md)
    print(md)
    v = summary["validation"]
    for m, target in (("e2e_mean_ms", 10), ("ttft_mean_ms", 20)):
        got = v.get(m, {}).get("median_abs_pct")
        print(f"validation {m}: median |error| {got}% (target <= {target}%): "
              f"{'reached' if got is not None and got <= target else 'NOT reached'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
