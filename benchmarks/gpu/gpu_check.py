"""The prepared GPU check: replay an agent trace on a real vLLM server at several concurrency levels and compare
each request's measured TTFT, end-to-end time and cached tokens with kvscope's prediction of the same run.

Two paths, one code:

* ``--device gpu`` (``benchmarks/gpu/validate.sh`` on a lent GPU): a model of a real architecture (the bundled
  ``llama-3.1-8b`` config.json; random weights, vLLM's ``--load-format dummy``: timing does not depend on weight
  values and no hub is needed; the tokenizer is the project's own, from the tiny-model build), vLLM's CUDA
  build, and the step cost from first principles (``roofline_step_cost`` on the detected GPU's preset and its
  documented efficiency defaults, or ``--factors FILE``);
* ``--device cpu`` (CI): the tiny model on vLLM CPU (or ``--endpoint`` of a running server, e.g. the test
  suite's shared one) and the step cost a CPU calibration of that server fits (``measure_samples`` +
  ``fit_cost_model``, what ``kvscope capacity --server`` does).

Both then replay the same kind of trace (``agent-coding``, closed loop, no think time) with ``kvscope replay``'s
runner (``measure_level``) and predict each level with the scheduler model on the server's own KV pool
(block size and block count as the server reports them): per request, predicted vs measured TTFT, E2E and
cached tokens; per level the median absolute percentage errors, the share of requests whose cached tokens
are predicted exactly, and mean TTFT / E2E / throughput predicted vs measured.  Results go to
``OUT/gpu_check.json`` (and a line per level on stdout).

Usage: ``python benchmarks/gpu/gpu_check.py --out DIR [--device gpu|cpu] [--endpoint URL --model-dir DIR]
[--levels 1,4,16,64] [--sessions N]``.  Exit 2 with one line on bad input (no server, unknown GPU, ...).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Replay levels and trace size: sized so the GPU path (server start included) stays well under 8 minutes.
GPU_LEVELS = (1, 4, 16, 64)
CPU_LEVELS = (1, 4)


class CheckError(Exception):
    """Bad input or an unusable environment: one line, exit 2."""


def detect_gpu() -> str:
    """The preset id of the first visible NVIDIA GPU (nvidia-smi's name), e.g. ``h100-sxm``."""
    from kvscope.harness.cachemodel.gpus import load_gpus

    if not shutil.which("nvidia-smi"):
        raise CheckError("no nvidia-smi: no GPU visible (use --device cpu, or --gpu ID with --endpoint)")
    name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                          text=True, check=False).stdout.splitlines()[0].strip().lower()
    for key in ("h200", "h100", "a100", "l40s", "b200", "l4"):
        if key in name:
            for g in load_gpus():
                if g.key.startswith(key) or key in [a.lower() for a in g.aliases]:
                    return g.key
    raise CheckError(f"GPU {name!r} has no preset in gpus.yaml; pass --gpu ID")


def build_real_architecture(out_dir: Path, model: str = "llama-3.1-8b") -> Path:
    """A model directory vLLM can serve with ``--load-format dummy``: the project's tokenizer (tiny-model build)
    and the bundled ``config.json`` of ``model`` (the real architecture; weights are vLLM's random ones)."""
    from kvscope.harness.cachemodel.model_config import MODEL_CONFIGS_DIR
    from kvscope.harness.model.tinymodel import build_tiny_model

    build_tiny_model(out_dir, seed=0)
    cfg = json.loads((MODEL_CONFIGS_DIR / f"{model}.json").read_text())
    tiny = json.loads((out_dir / "config.json").read_text())
    # The tokenizer's special ids; the vocabulary stays the real model's (a larger embedding than the
    # tokenizer uses is what padded vocabularies look like to vLLM).
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        cfg[k] = tiny.get(k)
    cfg.pop("_name_or_path", None)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out_dir / "model.safetensors").unlink(missing_ok=True)
    return out_dir


def start_server(model_dir: Path, device: str, log_dir: Path, max_model_len: int):
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    fields: dict[str, Any] = {"model": str(model_dir), "served_model_name": "check", "max_model_len": max_model_len,
                              "startup_timeout_s": 420}
    if device == "gpu":
        fields.update(enforce_eager=False, gpu_memory_utilization=0.9, extra_args=["--load-format", "dummy"])
    else:
        fields.update(kv_cache_memory_bytes="32M")
    server = VllmServer(ServerConfig(**fields), log_path=log_dir / "server.log")
    server.start()
    return server


def cpu_cost(endpoint: str, rounds: int):
    """The CPU path's step cost: the library's calibration of this server (fewer rounds than ``kvscope
    capacity --server`` where CI time matters)."""
    from kvscope.harness.cachemodel.calibration import fit_cost_model, median_of_repeats
    from kvscope.harness.replay.calibrate import measure_samples
    from kvscope.harness.results.schemas import CalibrationServer
    from kvscope.harness.serving.backend import endpoint_facts

    facts = endpoint_facts(endpoint)
    server = CalibrationServer(endpoint=endpoint, model=facts.model, block_size=facts.block_size,
                               num_gpu_blocks=facts.num_blocks, max_num_seqs=128, max_num_batched_tokens=2048,
                               max_model_len=facts.max_model_len)
    fit = fit_cost_model(median_of_repeats(measure_samples(endpoint, facts.model or "default", server,
                                                           rounds=rounds)))
    return fit.model, {"kind": "cpu-calibration", "r2": fit.r2, "median_rel_error": fit.median_rel_error,
                       "coefficients": fit.model.as_dict()}


def gpu_cost(gpu: str, model_dir: Path, factors: Path | None):
    from kvscope.harness.cachemodel.gpus import Efficiency, get_gpu
    from kvscope.harness.cachemodel.model_config import load_model_config
    from kvscope.harness.cachemodel.roofline import roofline_step_cost

    g = get_gpu(gpu)
    eff = Efficiency.model_validate(json.loads(factors.read_text())) if factors else g.efficiency
    cost = roofline_step_cost(g, load_model_config(model_dir / "config.json"), efficiency=eff,
                              request_overhead_s=eff.request_overhead_ms / 1e3)
    return cost, {"kind": "roofline", "gpu": g.key, "efficiency": eff.model_dump()}


def _pct_err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas if meas and meas > 0 and not math.isnan(pred) else math.nan


def _median(values: Sequence[float]) -> float | None:
    v = [x for x in values if x is not None and not math.isnan(x)]
    return float(statistics.median(v)) if v else None


def compare_level(trace_dir: Path, df, config, cost, concurrency: int) -> dict[str, Any]:
    """The scheduler model's run of the trace at ``concurrency`` against the measured records, per request."""
    from kvscope.harness.cachemodel.capacity_model import prompt_blocks_only
    from kvscope.harness.cachemodel.gpu_predict import predict_run
    from kvscope.harness.cachemodel.trace_io import load_trace

    reqs = prompt_blocks_only(load_trace(trace_dir, config.block_size).requests, config.block_size)
    pred = predict_run(reqs, config, cost, concurrency=concurrency, time_scale=0.0)
    by_id = {p.request_id: p for p in pred.requests}
    rows = []
    ok = df[df["error_class"].isna()] if "error_class" in df else df
    for rec in ok.itertuples():
        p = by_id.get(int(rec.request_id))
        if p is None or rec.ttft_s is None or math.isnan(rec.ttft_s):
            continue
        rows.append({"request_id": int(rec.request_id), "ttft_s": [round(p.ttft_s, 5), round(float(rec.ttft_s), 5)],
                     "e2e_s": [round(p.e2e_s, 5), round(float(rec.e2e_s), 5)],
                     "cached_tokens": [int(p.cached_tokens), int(rec.cached_tokens or 0)]})
    if not rows:
        raise CheckError(f"concurrency {concurrency}: no request of the run could be compared")
    meas_span = float(ok["done_s"].max() - ok["sent_s"].min())
    out_tokens = float(ok["output_tokens"].sum())
    return {
        "concurrency": concurrency,
        "requests": len(rows),
        "ttft_median_abs_pct": round(100 * _median([_pct_err(*r["ttft_s"]) for r in rows]), 1),
        "e2e_median_abs_pct": round(100 * _median([_pct_err(*r["e2e_s"]) for r in rows]), 1),
        "cached_exact_share": round(sum(r["cached_tokens"][0] == r["cached_tokens"][1] for r in rows) / len(rows), 4),
        "ttft_mean_s": [round(statistics.fmean(r["ttft_s"][0] for r in rows), 4),
                        round(statistics.fmean(r["ttft_s"][1] for r in rows), 4)],
        "e2e_mean_s": [round(statistics.fmean(r["e2e_s"][0] for r in rows), 4),
                       round(statistics.fmean(r["e2e_s"][1] for r in rows), 4)],
        "output_tokens_per_s": [round(sum(p.output_tokens for p in pred.requests) / pred.makespan_s, 1),
                                round(out_tokens / meas_span, 1)],
        "per_request": rows,
    }


def run_check(out: Path, device: str, endpoint: str | None, model_dir: Path | None, levels: Sequence[int],
              sessions: int, scale: float, factors: Path | None, gpu: str | None, calibration_rounds: int,
              max_model_len: int, budget_s: float | None = None) -> dict[str, Any]:
    from kvscope.harness.cachemodel.scheduler import SchedulerConfig
    from kvscope.harness.replay.validation import measure_level
    from kvscope.harness.serving.backend import endpoint_facts
    from kvscope.workloads.generate import generate_from_file

    out.mkdir(parents=True, exist_ok=True)
    if device == "gpu":
        gpu = gpu or detect_gpu()  # before any build: no GPU is a one-line error at once
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    if model_dir is None:
        if endpoint:
            raise CheckError("--endpoint needs --model-dir (the served model's directory, for its tokenizer)")
        model_dir = out / "model"
        if device == "gpu":
            build_real_architecture(model_dir)
        else:
            from kvscope.harness.model.tinymodel import build_tiny_model

            build_tiny_model(model_dir, seed=0)
    timings["model_s"] = time.perf_counter() - t0
    server = None
    try:
        if endpoint is None:
            t = time.perf_counter()
            server = start_server(model_dir, device, out, max_model_len)
            endpoint = server.endpoint
            timings["server_start_s"] = time.perf_counter() - t
        facts = endpoint_facts(endpoint)
        if not facts.block_size or not facts.num_blocks:
            raise CheckError(f"{endpoint}: the server does not report its KV block size and block count")
        t = time.perf_counter()
        if device == "gpu":
            cost, cost_info = gpu_cost(gpu, model_dir, factors)
        else:
            cost, cost_info = cpu_cost(endpoint, calibration_rounds)
        timings["cost_s"] = time.perf_counter() - t
        config = SchedulerConfig(block_size=facts.block_size, num_gpu_blocks=facts.num_blocks,
                                 max_num_seqs=256 if device == "gpu" else 128,
                                 max_num_batched_tokens=8192 if device == "gpu" else 2048)
        traces: dict[int, Path] = {}

        def trace_for(c: int) -> Path:
            """The trace a level replays: ``sessions`` sessions, or (0) two per concurrency slot, so every level
            runs a similar time (the agent-coding preset at scale 0.02 has ~70 requests a session)."""
            n = sessions or max(2, 2 * c)
            if n not in traces:
                traces[n] = out / ("trace" if sessions else f"trace-{n}")
                generate_from_file("agent-coding", model_dir, seed=5, scale=scale, sessions=n,
                                   max_context=max_model_len - 200, output_scale=0.1).write(traces[n])
            return traces[n]

        results: list[dict[str, Any]] = []
        skipped: list[int] = []

        def save() -> dict[str, Any]:
            """gpu_check.json as it stands: written after every level, so a run stopped by its time limit
            still leaves the levels it finished."""
            doc = {"kind": "gpu_check", "version": 1, "device": device, "gpu": gpu,
                   "endpoint_started": server is not None, "model_dir": str(model_dir),
                   "server": {"block_size": facts.block_size, "num_gpu_blocks": facts.num_blocks,
                              "max_model_len": facts.max_model_len},
                   "cost": cost_info,
                   "trace": {"preset": "agent-coding", "sessions": sessions or "2 per concurrency slot",
                             "scale": scale},
                   "levels": results, "levels_skipped_for_time": skipped,
                   "timings_s": {k: round(v, 1) for k, v in timings.items()},
                   "total_s": round(time.perf_counter() - t0, 1)}
            (out / "gpu_check.json").write_text(json.dumps(doc, indent=1) + "\n")
            return doc

        for c in levels:
            if budget_s and results and time.perf_counter() - t0 > budget_s:
                skipped.append(c)  # past the time budget: the levels done are the result
                continue
            t = time.perf_counter()
            trace_dir = trace_for(c)
            df, preempted, load = measure_level(trace_dir, endpoint, c, out / f"run-c{c}", client_priority_mode="auto")
            level = compare_level(trace_dir, df, config, cost, c)
            level.update(preemptions_measured=preempted, load_average=round(load, 2),
                         wall_s=round(time.perf_counter() - t, 1))
            results.append(level)
            save()
            print(f"c={c}: {level['requests']} requests, TTFT median |err| {level['ttft_median_abs_pct']}%, "
                  f"E2E median |err| {level['e2e_median_abs_pct']}%, cached exact {level['cached_exact_share']:.1%}, "
                  f"mean TTFT pred/meas {level['ttft_mean_s']}, mean E2E {level['e2e_mean_s']}, "
                  f"tok/s {level['output_tokens_per_s']}", flush=True)
        doc = save()
    finally:
        if server is not None:
            server.stop()
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the trace, runs and gpu_check.json")
    ap.add_argument("--device", choices=["gpu", "cpu"], default="gpu")
    ap.add_argument("--endpoint", help="a running vLLM server instead of starting one (needs --model-dir)")
    ap.add_argument("--model-dir", type=Path, help="the served model's directory (tokenizer, config.json)")
    ap.add_argument("--gpu", help="GPU preset id (default: detected with nvidia-smi)")
    ap.add_argument("--factors", type=Path, help="efficiency factors (JSON of gpus.yaml's efficiency fields)")
    ap.add_argument("--levels", help="comma-separated concurrency levels")
    ap.add_argument("--sessions", type=int, help="agent sessions in every level's trace (default: GPU two per "
                    "concurrency slot, CPU 4)")
    ap.add_argument("--scale", type=float, default=0.02, help="trace length scale (agent-coding preset)")
    ap.add_argument("--calibration-rounds", type=int, default=3, help="CPU path: rounds of each timed shape")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no further level after this many seconds (default: GPU 330, CPU none)")
    args = ap.parse_args(argv)
    import httpx
    from kvscope.harness.common.errors import KvscopeError

    gpu_mode = args.device == "gpu"
    levels = [int(x) for x in args.levels.split(",")] if args.levels else list(GPU_LEVELS if gpu_mode else CPU_LEVELS)
    sessions = args.sessions or (0 if gpu_mode else 4)
    max_len = args.max_model_len or (8192 if gpu_mode else 2048)
    try:
        if any(c < 1 for c in levels):
            raise CheckError(f"--levels {args.levels}: concurrency levels must be positive integers")
        run_check(args.out, args.device, args.endpoint, args.model_dir, levels, sessions, args.scale, args.factors,
                  args.gpu, args.calibration_rounds, max_len,
                  args.budget_s if args.budget_s is not None else (330.0 if gpu_mode else None))
    except (CheckError, KvscopeError, httpx.HTTPError, ValueError, OSError) as exc:
        # bad input, a dead or refused server: one line; what was measured so far stays under --out
        print(f"error: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
