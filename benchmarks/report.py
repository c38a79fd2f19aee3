"""Benchmark: `kvscope report` on an experiment of 100,000 request records.

Builds a synthetic experiment directory with the real layout (traces from the workload generator, per-cell
`requests.parquet`, `summary.json` from the real summariser, `server_metrics.parquet`, `experiment.json`),
then times loading the results and the whole report (every notebook executed, HTML rendered).
The target: under 30 s in total with the defaults (the notebooks executed in parallel, one per CPU;
`KVSCOPE_REPORT_WORKERS=1` runs them one after another, which is how to compare notebooks before/after).
The machine may be shared, so beside wall times it records each notebook's CPU seconds (kernel + rendering,
from the report's progress lines) and the load average before and after.

    .venv/bin/python benchmarks/report.py [--records 100000] [--out benchmarks/results/report.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
PROGRESS_LINE = re.compile(r"^report: (?P<name>\S+) ok \([\d.]+ s, (?P<cpu>[\d.]+) s CPU\)$", re.M)
"""A notebook's progress line from `kvscope report`: 'report: latency ok (5.2 s, 4.9 s CPU)'."""
sys.path.insert(0, str(REPO))


def _records(trace, cell_meta: dict, rng: np.random.Generator, prefix_on: bool, spec_on: bool) -> pd.DataFrame:
    from kvscope.harness.cachemodel.simulator import predict_cached_tokens
    from kvscope.harness.results.records import RECORD_FIELDS

    req = trace.requests
    n = len(req)
    prompts = [trace.prompt_token_ids(i) for i in range(n)]
    outputs = [trace.output_token_ids(i) for i in range(n)]
    predicted = np.asarray(predict_cached_tokens(list(zip(prompts, outputs)), 128, None))
    cached = predicted if prefix_on else np.zeros(n, dtype=int)
    prompt_tokens = req["prompt_tokens"].to_numpy()
    out_tokens = np.maximum(req["output_tokens"].to_numpy(), 1)
    uncached = prompt_tokens - cached
    ttft = 0.01 + uncached / 20000 * rng.lognormal(0, 0.2, n)
    tpot = (0.004 if not spec_on else 0.003) * rng.lognormal(0, 0.3, n)
    e2e = ttft + tpot * (out_tokens - 1)
    sent = np.cumsum(rng.exponential(0.02, n))
    itl = [list(rng.exponential(t, max(int(o) - 1, 0)).astype(float)) for t, o in zip(tpot, out_tokens)]
    df = pd.DataFrame({
        "request_id": req["request_id"].to_numpy(), "session_id": req["session_id"].to_numpy(),
        "step": req["step"].to_numpy(), "attempt": 0, "endpoint_index": 0, "mode": "recorded",
        "transition": req["transition"].to_numpy(), "scheduled_s": sent, "sent_s": sent,
        "first_token_s": sent + ttft, "done_s": sent + e2e, "ttft_s": ttft,
        "tpot_s": np.where(out_tokens > 1, tpot, np.nan), "e2e_s": e2e, "itl_s": itl, "chunk_tokens": [[]] * n,
        "prompt_tokens": prompt_tokens, "server_prompt_tokens": prompt_tokens, "cached_tokens": cached,
        "predicted_cached_tokens": predicted, "output_tokens": out_tokens, "planned_output_tokens": out_tokens,
        "finish_reason": "length", "http_status": 200, "error_class": None, "error": None, "in_window": True,
        "length_mismatch": False, "output_text_head": " the cache block token prefix",
    })
    return df[RECORD_FIELDS]


def build_experiment(root: Path, records: int, tokenizer: Path) -> Path:
    from kvscope.harness.results.summary import summarize
    from kvscope.harness.results.loaders import write_result_file
    from kvscope.harness.results.schemas import ExperimentFile, SummaryFile
    from kvscope.workloads.generate import generate_from_file

    rng = np.random.default_rng(0)
    run = root / "bench" / "r1"
    (run / "cells").mkdir(parents=True)
    servers = {"baseline": (True, False), "no-prefix-cache": (False, False), "ngram-k4": (True, True),
               "no-prefix-cache-ngram-k4": (False, True)}
    workloads = ["agent-coding", "chat"]
    loads = ["c1", "c4"]
    per_cell = records // (len(servers) * len(workloads) * len(loads))
    traces = {}
    for w in workloads:
        sessions = 40
        while True:
            tr = generate_from_file(w, tokenizer, seed=1, scale=0.02, sessions=sessions, max_context=3000)
            if tr.num_requests >= per_cell or sessions > 20000:
                break
            sessions = int(sessions * per_cell / max(tr.num_requests, 1) * 1.1) + 1
        tdir = run / "traces" / w
        tr.write(tdir)
        traces[w] = tr
    cells = {}
    total = 0
    for s, (prefix_on, spec_on) in servers.items():
        for w in workloads:
            for load in loads:
                name = f"{s}__{w}__{load}__r0"
                cdir = run / "cells" / name
                cdir.mkdir()
                df = _records(traces[w], {}, rng, prefix_on, spec_on).head(per_cell)
                total += len(df)
                df.to_parquet(cdir / "requests.parquet", index=False)
                dur = float(df["done_s"].max())
                t = np.linspace(0, dur, 60)
                pd.DataFrame({"t_s": t, "endpoint_index": 0, "num_requests_running": rng.integers(0, 5, 60),
                              "num_requests_waiting": 0, "kv_cache_usage": rng.random(60) * 0.5,
                              "num_preemptions": 0.0, "prefix_cache_queries": np.cumsum(rng.random(60)),
                              "prefix_cache_hits": np.cumsum(rng.random(60))}).to_parquet(
                    cdir / "server_metrics.parquet", index=False)
                deltas = {"prefix_cache_queries": float(df["prompt_tokens"].sum()),
                          "prefix_cache_hits": float(df["cached_tokens"].sum()),
                          "prefix_cache_hit_rate": float(df["cached_tokens"].sum() / df["prompt_tokens"].sum())}
                if spec_on:
                    deltas.update({"spec_decode_num_drafts": 1000.0, "spec_acceptance_rate": 0.3,
                                   "spec_mean_acceptance_length": 1.9,
                                   "spec_acceptance_by_position": [0.5, 0.3, 0.2, 0.1]})
                summary = summarize(df, deltas, dur, prefix_on)
                summary["server_facts"] = [{"block_size": 128, "num_blocks": 256, "kv_capacity_tokens": 32768,
                                            "prefix_caching": prefix_on, "speculative_enabled": spec_on}]
                summary["aborted"] = None
                summary["client"] = {"cpu_s": 0.0, "cpu_utilization": None, "cpu_us_per_request": None,
                                     "event_loop": None, "stale_connection_resends": 0, "saturated": False,
                                     "note": None}
                write_result_file(cdir / "summary.json", SummaryFile, summary)
                cells[name] = {"server": s, "workload": w, "load": load, "repeat": 0, "status": "ok",
                               "dir": f"cells/{name}"}
    manifest = {"experiment": "bench", "run_id": "r1", "cells": cells, "traces": {w: f"traces/{w}" for w in workloads},
                "servers": {s: {"facts": {"block_size": 128, "num_blocks": 256, "kv_capacity_tokens": 32768,
                                          "prefix_caching": p}} for s, (p, _) in servers.items()},
                "model": {"path": str(tokenizer), "tokenizer": str(tokenizer), "card": None, "weights_random": True},
                "spec": {"name": "bench"}, "spec_path": "bench.yaml", "created_at": time.time()}
    for srv in manifest["servers"].values():
        srv.update(config={}, log="servers/none.log")
    write_result_file(run / "experiment.json", ExperimentFile, manifest)
    print(f"built {len(cells)} cells, {total:,} request records in {run}", flush=True)
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "report.json"))
    ap.add_argument("--keep", action="store_true", help="keep the synthetic experiment directory")
    args = ap.parse_args()
    from kvscope.harness.model.tinymodel import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="kvscope-report-bench-") as tmp:
        root = Path(tmp)
        model = root / "model"
        build_tiny_model(model, seed=0)
        t0 = time.perf_counter()
        run = build_experiment(root, args.records, model)
        t_build = time.perf_counter() - t0

        from kvscope.harness.results.loaders import load_results

        t0 = time.perf_counter()
        res = load_results(run)
        t_load = time.perf_counter() - t0
        n = len(res.requests)

        load_before = os.getloadavg()
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "kvscope.harness.cli.main", "report", str(run)], capture_output=True, text=True)
        t_report = time.perf_counter() - t0
        load_after = os.getloadavg()
        cpu_per_nb = {m["name"]: float(m["cpu"]) for m in PROGRESS_LINE.finditer(r.stdout)}
        from kvscope.harness.report.render import report_workers
        from kvscope.harness.results.loaders import load_report_file

        report_file = run / "report" / "report.json"
        status = [e.model_dump() for e in load_report_file(report_file).notebooks] if report_file.exists() else []
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:])
        per_nb = {s["notebook"]: s["seconds"] for s in status}
        result = {
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "load_average_1_5_15_before": [round(x, 2) for x in load_before],
            "load_average_1_5_15_after": [round(x, 2) for x in load_after],
            "records": n, "build_s": round(t_build, 2), "load_results_s": round(t_load, 2),
            "report_total_s": round(t_report, 2), "notebook_seconds": per_nb, "notebook_cpu_seconds": cpu_per_nb,
            "notebooks_ok": all(s["ok"] for s in status) and bool(status),
            "workers": report_workers(len(per_nb) or 1),
            # notebook seconds summed over the pool / the report's wall time: > 1 when notebooks overlap
            "parallel_overlap": round(sum(per_nb.values()) / t_report, 3) if t_report else None,
        }
        if args.keep:
            import shutil

            keep = REPO / "benchmarks" / "results" / "report-experiment"
            shutil.rmtree(keep, ignore_errors=True)
            shutil.copytree(run, keep)
    print(f"\n{'records':>10} {'load_results s':>15} {'report s':>9} {'notebooks s (sum)':>18} {'workers':>8} "
          f"{'all ok':>7}")
    print(f"{result['records']:>10,} {result['load_results_s']:>15} {result['report_total_s']:>9} "
          f"{sum(per_nb.values()):>18.1f} {result['workers']:>8} {str(result['notebooks_ok']):>7}")
    for k, v in per_nb.items():
        print(f"  {k:<12} {v:6.1f} s wall {cpu_per_nb.get(k, float('nan')):6.1f} s CPU")
    print(f"  CPU summed over notebooks: {sum(cpu_per_nb.values()):.1f} s; load average (1/5/15 min) before "
          f"{result['load_average_1_5_15_before']}, after {result['load_average_1_5_15_after']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")
    return 0 if result["notebooks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
