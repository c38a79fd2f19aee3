"""Predict published vLLM GPU measurements with kvscope's scheduler model and a first-principles step cost.

Reads the raw points in ``benchmarks/gpu/points/`` (each with its source), builds each point's workload as a
request list, runs it through :func:`kvscope.harness.cachemodel.scheduler.run_scheduler` with a step cost from
the GPU's datasheet and the model's architecture, and compares predicted with published figures: TTFT
mean / median / p90 / p99, E2E mean / median, output throughput, per point, and the median absolute
percentage error per metric, separately for the calibration and the validation set (``points/split.yaml``,
fixed before any comparison).

Efficiency factors: ``--factors defaults`` uses the documented defaults of the step-cost model;
``--factors calibrated`` (the default) fits them on the calibration points only (per GPU: achieved share of peak
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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
POINTS = HERE / "points"
RESULTS = REPO / "benchmarks" / "results"

from kvscope.harness.cachemodel.scheduler import SchedulerConfig, SessionTiming, run_scheduler  # noqa: E402
from kvscope.harness.cachemodel.sim_types import SimRequest  # noqa: E402

BLOCK = 16
GiB = 2**30

# --------------------------------------------------------------------------------------------------------------
# Hardware and models.  Figures as in shared/docs/gpu-prediction.md (datasheets, dense): used only until the
# step-cost model of kvscope (branch gpu) provides them; see ``step_cost_for``.
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    key: str
    bf16_tflops: float
    bandwidth_gb_s: float
    memory_gib: float
    interconnect_gb_s: float


GPUS = {
    "h100-sxm": Gpu("h100-sxm", 989.5, 3350, 80, 450),
    "h200-sxm": Gpu("h200-sxm", 989.5, 4800, 141, 450),
    "a100-80gb-sxm": Gpu("a100-80gb-sxm", 312, 2039, 80, 300),
}


@dataclass(frozen=True)
class Model:
    key: str
    total_params: float
    active_params: float
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int


MODELS = {
    "llama-3-8b": Model("llama-3-8b", 8.03e9, 8.03e9, 32, 32, 8, 128, 4096),
    "mistral-7b": Model("mistral-7b", 7.25e9, 7.25e9, 32, 32, 8, 128, 4096),
    "llama-3-70b": Model("llama-3-70b", 70.55e9, 70.55e9, 80, 64, 8, 128, 8192),
    "mixtral-8x7b": Model("mixtral-8x7b", 46.70e9, 12.88e9, 32, 32, 8, 128, 4096),
}


def model_key(model_id: str) -> str:
    m = model_id.lower()
    if "mixtral-8x7b" in m:
        return "mixtral-8x7b"
    if "mistral-7b" in m:
        return "mistral-7b"
    if "70b" in m:
        return "llama-3-70b"
    if "8b" in m:
        return "llama-3-8b"
    raise ValueError(f"no model shape for {model_id!r}")


@dataclass(frozen=True)
class Factors:
    """Efficiency factors of one GPU (names as in the step-cost model's ``Efficiency``) plus the frontend."""

    mfu: float = 0.5
    bandwidth_efficiency: float = 0.8
    step_overhead_ms: float = 2.0
    allreduce_latency_us: float = 8.0
    #: Frontend time per request (HTTP, tokenization, queueing on the engine's loop); 0 offline.
    frontend_ms: float = 0.0


DEFAULT_FACTORS = Factors()


class RooflineStepCost:
    """One engine step: ``max(compute, memory) + TP all-reduces + overhead``.

    compute: 2 x active params per scheduled token plus attention, 4 x heads x head_dim per (query, key) pair
    per layer (prefill pairs and the decodes' context), at ``mfu`` of the dense peak; memory: the weights once
    per step (all experts of a MoE: a batch of any size touches nearly all of them) plus the decodes' KV read,
    at ``bandwidth_efficiency`` of the datasheet bandwidth; all-reduce: two per layer over ``hidden`` values of
    every token, ring traffic 2 (tp-1)/tp, plus a fixed latency each.  Duck-types
    :class:`~kvscope.harness.cachemodel.calibration.StepCostModel` for the scheduler model.
    """

    request_overhead_s = 0.0

    def __init__(self, gpu: Gpu, model: Model, tp: int, f: Factors) -> None:
        self.gpu, self.model, self.tp, self.f = gpu, model, tp, f
        self.flops = gpu.bf16_tflops * 1e12 * f.mfu
        self.bw = gpu.bandwidth_gb_s * 1e9 * f.bandwidth_efficiency
        self.weight_bytes = 2 * model.total_params / tp
        self.flops_per_token = 2 * model.active_params / tp
        heads = model.heads / tp
        self.attn_flops_per_pair = 4 * heads * model.head_dim * model.layers
        kv_heads = max(1, math.ceil(model.kv_heads / tp))
        self.kv_bytes_per_token = 2 * model.layers * kv_heads * model.head_dim * 2
        self.per_context_token_s = self.kv_bytes_per_token / self.bw
        self.overhead_s = f.step_overhead_ms / 1e3
        if tp > 1:
            self.ar_bytes_per_token = 2 * model.layers * model.hidden * 2 * 2 * (tp - 1) / tp
            self.ar_fixed_s = 2 * model.layers * f.allreduce_latency_us / 1e6
        else:
            self.ar_bytes_per_token = 0.0
            self.ar_fixed_s = 0.0
        self.link = gpu.interconnect_gb_s * 1e9

    def step_s(self, tokens: int, seqs: int, context_tokens: float, prefill_pairs: float = 0.0) -> float:
        compute = (self.flops_per_token * tokens + self.attn_flops_per_pair * (prefill_pairs + context_tokens)) / self.flops
        memory = (self.weight_bytes + self.kv_bytes_per_token * context_tokens) / self.bw
        allreduce = self.ar_fixed_s + self.ar_bytes_per_token * tokens / self.link
        return max(compute, memory) + allreduce + self.overhead_s


def step_cost_for(gpu: str, model: str, tp: int, f: Factors) -> RooflineStepCost:
    return RooflineStepCost(GPUS[gpu], MODELS[model], tp, f)


def num_gpu_blocks(gpu: str, model: str, tp: int, util: float, non_kv_gib: float = 2.0) -> int:
    """vLLM's KV pool: what ``util`` of the memory leaves after the weights and activations (``non_kv_gib``)."""
    g, m = GPUS[gpu], MODELS[model]
    free = g.memory_gib * GiB * util - 2 * m.total_params / tp - non_kv_gib * GiB
    kv_heads = max(1, math.ceil(m.kv_heads / tp))
    per_tok = 2 * m.layers * kv_heads * m.head_dim * 2
    return max(int(free // (BLOCK * per_tok)), 1)


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
    config: SchedulerConfig
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
        cfg = SchedulerConfig(block_size=BLOCK, max_num_seqs=1024, max_num_batched_tokens=mbt,
                              enable_chunked_prefill=False,
                              num_gpu_blocks=num_gpu_blocks(p["gpu"], model, p["tp"], 0.95))
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
        cfg = SchedulerConfig(block_size=BLOCK, max_num_seqs=256, max_num_batched_tokens=4096,
                              enable_chunked_prefill=False,
                              num_gpu_blocks=num_gpu_blocks(p["gpu"], model, p["tp"], 0.9))
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
        model = "llama-3-8b"
        cfg = SchedulerConfig(block_size=BLOCK, max_num_seqs=256, max_num_batched_tokens=8192,
                              num_gpu_blocks=num_gpu_blocks(p["gpu"], model, p["tp"], 0.9))
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


def _requests(p: Point, release: Sequence[float]) -> list[SimRequest]:
    rng = np.random.default_rng(7)
    reqs = []
    for i, (n_in, n_out) in enumerate(zip(p.inputs, p.outputs)):
        n_blocks = n_in // BLOCK
        hashes = [int(h) for h in rng.integers(1, 2**62, n_blocks)]  # unique: no prefix shared between prompts
        reqs.append(SimRequest(i, n_in, n_out, hashes, BLOCK, session_id=f"r{i}", arrival_s=release[i]))
    return reqs


def _pct(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, float), q)) if len(values) else math.nan


def predict_point(p: Point, f: Factors) -> dict[str, float]:
    cost = step_cost_for(p.gpu, p.model, p.tp, f)
    release = frontend_release(p.send_s, f.frontend_ms / 1e3 if p.http else 0.0)
    reqs = _requests(p, release)
    timing = SessionTiming(arrivals_s=release)
    run = run_scheduler(reqs, p.config, cost, timing)
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
FIT_METRICS = ["ttft_mean_ms", "e2e_mean_ms", "output_throughput"]


def errors(p: Point, pred: dict[str, float]) -> dict[str, float]:
    return {m: (pred[m] - p.published[m]) / p.published[m] for m in METRICS if m in p.published}


# --------------------------------------------------------------------------------------------------------------
# Calibration: fit the factors on the calibration points only.
# --------------------------------------------------------------------------------------------------------------

_FIT_GPUS = ("h100-sxm", "a100-80gb-sxm")


def _unpack(x: Sequence[float]) -> dict[str, Factors]:
    """x (log space): per fitted GPU (mfu, bandwidth efficiency), then shared step overhead and frontend."""
    lim = lambda v: min(max(v, 0.01), 1.0)  # noqa: E731
    overhead, frontend = math.exp(x[-2]), math.exp(x[-1])
    out = {}
    for k, g in enumerate(_FIT_GPUS):
        out[g] = Factors(lim(math.exp(x[2 * k])), lim(math.exp(x[2 * k + 1])), overhead,
                         DEFAULT_FACTORS.allreduce_latency_us, frontend)
    return out


def factors_for(gpu: str, table: dict[str, Factors]) -> Factors:
    if gpu in table:
        return table[gpu]
    if gpu == "h200-sxm" and "h100-sxm" in table:  # same Hopper generation; no H200 calibration point
        return table["h100-sxm"]
    return DEFAULT_FACTORS


def calibrate(points: Sequence[Point]) -> tuple[dict[str, Factors], dict[str, Any]]:
    from scipy.optimize import minimize

    def loss(x: Sequence[float]) -> float:
        table = _unpack(x)
        total = 0.0
        for p in points:
            pred = predict_point(p, factors_for(p.gpu, table))
            for m in FIT_METRICS:
                if m in p.published and pred[m] > 0:
                    total += math.log(pred[m] / p.published[m]) ** 2
        return total

    x0 = [math.log(DEFAULT_FACTORS.mfu), math.log(DEFAULT_FACTORS.bandwidth_efficiency)] * len(_FIT_GPUS)
    x0 += [math.log(DEFAULT_FACTORS.step_overhead_ms), math.log(3.0)]
    t0 = time.perf_counter()
    res = minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 600, "xatol": 1e-3, "fatol": 1e-5})
    return _unpack(res.x), {"loss": float(res.fun), "iterations": int(res.nit), "fit_s": time.perf_counter() - t0,
                            "points": [p.id for p in points], "metrics": FIT_METRICS}


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
    ap.add_argument("--out-json", type=Path, default=RESULTS / "gpu_validation.json")
    ap.add_argument("--out-md", type=Path, default=RESULTS / "gpu_validation.md")
    args = ap.parse_args(argv)

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
        table = {g: DEFAULT_FACTORS for g in GPUS}
    rows = []
    for p in points:
        f = factors_for(p.gpu, table)
        pred = predict_point(p, f)
        rows.append({"id": p.id, "set": split[p.id], "source": p.source, "gpu": p.gpu, "tp": p.tp,
                     "model": p.model, "requests": len(p.inputs), "measured": p.published,
                     "predicted": {k: round(v, 3) for k, v in pred.items()}, "error": errors(p, pred),
                     "factors": asdict(f)})
    summary = summarize(rows)
    factors_out = {g: asdict(f) for g, f in table.items()}
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
