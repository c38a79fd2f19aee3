"""Predicted TPOT of an n-gram server against vLLM CPU, through the speculative step model (issue 38).

The quickstart's n-gram server (k=4, prompt lookup 2-4, 16 MiB of KV, max_model_len 4096) is calibrated
(``kvscope.harness.replay.calibrate``: on a speculative server its decode samples carry the offline model's
drafts, and the fit has a cost per verifying sequence and per draft token); the quickstart's agent trace is
replayed closed loop at each concurrency (recorded mode, fresh prefix cache); each request's drafts and
accepted tokens come from the offline model on the tokens the server generated (the records'
``output_token_ids``); and the scheduler model, run on the trace with those steps and the calibration's costs,
predicts every request's TPOT. Printed per level: TPOT p50 (and mean) measured vs predicted, the relative
error, the acceptance, and the calibration's speculative coefficients.

Usage (starts one vLLM server; wrap in flock on a shared machine):
    flock /tmp/kvscope-vllm.lock .venv/bin/python benchmarks/speculative_tpot.py --model models/tiny-trained \
        [--levels 1,2,4] [--sessions 4] [--rounds 2] [--endpoint URL: a running server of this configuration]
Writes benchmarks/results/speculative_tpot.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: experiments/quickstart.yaml's ngram-k4 server and its workload
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
WORKLOAD = ["agent-coding", "--scale", "0.02", "--output-scale", "0.15", "--seed", "1", "--max-context", "2000"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the tiny model (kvscope model build-tiny [--train-steps 50])")
    ap.add_argument("--levels", default="1,2,4", help="closed-loop concurrencies, comma list")
    ap.add_argument("--sessions", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=1, help="calibrate and measure every level this many times")
    ap.add_argument("--endpoint", help="a running server of this configuration (else one is started)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "speculative_tpot.json"))
    args = ap.parse_args()

    from kvscope.harness.analysis.speculative import compare_tpot
    from kvscope.harness.replay.calibrate import calibrate_server
    from kvscope.harness.replay.validation import measure_level
    from kvscope.harness.serving.backend import Backend
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    work = Path(tempfile.mkdtemp(prefix="kvscope-spectpot-"))
    subprocess.run([str(Path(sys.executable).parent / "kvscope"), "workload", "generate", *WORKLOAD,
                    "--tokenizer", args.model, "--sessions", str(args.sessions), "--out", str(work / "trace"),
                    "--no-progress"], check=True)
    config = ServerConfig(model=args.model, served_model_name="tiny", max_model_len=4096,
                          kv_cache_memory_bytes="16M", startup_timeout_s=900, speculative_config=SPECULATIVE_CONFIG)
    server = None
    if args.endpoint is None:
        server = VllmServer(config, log_path=work / "server.log")
        server.start()
    endpoint = args.endpoint or server.endpoint
    levels = [int(x) for x in args.levels.split(",")]
    report: dict = {"model": args.model, "speculative_config": SPECULATIVE_CONFIG, "sessions": args.sessions,
                    "rounds": []}
    try:
        for rnd in range(args.rounds):
            t0 = time.perf_counter()
            cal = calibrate_server(Backend.create("vllm", config=config, endpoint=endpoint),
                                   work / f"calibration-{rnd}.json", client_priority_mode="auto")
            entry: dict = {"calibration_s": time.perf_counter() - t0, "load_average_1m": os.getloadavg()[0],
                           "calibration": {"fit_r2": cal.fit_r2, "speculation": cal.server.speculation,
                                           **cal.cost.model_dump()}, "levels": []}
            report["rounds"].append(entry)
            print(f"round {rnd}: calibrated in {entry['calibration_s']:.0f} s: R² {cal.fit_r2:.3f}, "
                  f"{len(cal.samples)} samples; plain decode step {1e3 * cal.cost_model().step_s(1, 1, 500):.2f} ms "
                  f"at 500 tokens, +{1e3 * cal.cost.per_spec_step_s:.2f} ms per verifying step, +"
                  f"{1e3 * cal.cost.per_draft_token_s:.2f} ms per draft token", flush=True)
            for c in levels:
                records, preempted, load = measure_level(work / "trace", endpoint, c, work / f"r{rnd}-c{c}",
                                                         client_priority_mode="auto")
                row = compare_tpot(work / "trace", records, cal, concurrency=c)
                row.update({"preemptions": preempted, "load_average_1m": load})
                entry["levels"].append(row)
                print(f"  concurrency {c}: TPOT p50 measured {row['measured_tpot_p50_ms']:.2f} ms, predicted "
                      f"{row['predicted_tpot_p50_ms']:.2f} ms ({row['tpot_p50_error']:+.1%}); mean "
                      f"{row['measured_tpot_mean_ms']:.2f} vs {row['predicted_tpot_mean_ms']:.2f} ms; "
                      f"{row['requests']} requests, {row['tokens_per_step']:.2f} tokens per decode step; "
                      f"without the speculative step costs {row['predicted_tpot_p50_no_spec_cost_ms']:.2f} ms; "
                      f"load {load:.1f}", flush=True)
    finally:
        if server is not None:
            server.stop()
    report["host_load_average_1m"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
