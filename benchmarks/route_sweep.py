"""Offline model routing: wall time of evaluating >= 100 rule variants on the agent-coding preset.

    .venv/bin/python benchmarks/route_sweep.py --tokenizer models/tiny [--work /tmp/kvscope-route] [--check 5]

Generates `agent-coding` (the preset's own size: 20 sessions, ~840 requests, ~65 M prompt tokens) once into
--work, then times, in this process: reading and hashing the trace at the two models' block sizes (16 and 32),
building the pairwise-prefix index, and evaluating every variant of the rule grid (prompt-length thresholds x 7
input-kind sets x 2 stickiness modes, default 8 x 7 x 2 = 112) with per-model pricing. The goal is the
evaluation in <= 30 s on a 2-core machine. `--check N` also runs N variants through the exact pool simulator and
asserts the fast path gave the same per-request predictions (and prints how long the simulator took).
Results: benchmarks/results/route_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(REPO / "models" / "tiny-trained"), help="model dir with tokenizer.json")
    ap.add_argument("--work", default="/tmp/kvscope-route", help="where the trace is generated (reused)")
    ap.add_argument("--thresholds", default="0,10000,20000,40000,60000,80000,120000,160000")
    ap.add_argument("--check", type=int, default=3, help="variants also run through the pool simulator")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "route_sweep.json"))
    a = ap.parse_args()

    from kvscope.harness.cachemodel.model_routing import evaluate, load_routing_inputs, load_spec
    from kvscope.harness.pricing.model_routing import rule_grid, sweep

    trace = Path(a.work) / "agent-coding"
    if not (trace / "trace.json").is_file():
        subprocess.run([str(Path(sys.executable).with_name("kvscope")), "workload", "generate", "agent-coding",
                        "--tokenizer", a.tokenizer, "--out", str(trace), "--no-progress"], check=True)
    models = {"models": [{"name": "small", "block_size": 16}, {"name": "large", "block_size": 32}]}
    t0 = time.perf_counter()
    inputs = load_routing_inputs(trace, [16, 32])
    t_read = time.perf_counter() - t0
    t1 = time.perf_counter()
    inputs.index(16)
    inputs.index(32)
    t_index = time.perf_counter() - t1
    variants = rule_grid(["small", "large"], [int(x) for x in a.thresholds.split(",")])
    t2 = time.perf_counter()
    rows = sweep(models, variants, inputs)
    t_eval = time.perf_counter() - t2
    check_s = 0.0
    for v in variants[: a.check]:
        spec = load_spec({**models, **v})
        t = time.perf_counter()
        exact = evaluate(spec, inputs, fast=False)
        check_s += time.perf_counter() - t
        assert exact == evaluate(spec, inputs, fast=True), f"fast path differs from the simulator on {v}"
    result = {"trace": "agent-coding (preset size)", "requests": len(inputs.facts),
              "prompt_tokens": sum(f.prompt_tokens for f in inputs.facts), "variants": len(variants),
              "distinct_outcomes": len(rows),
              "read_and_hash_s": round(t_read, 2), "index_s": round(t_index, 2), "evaluate_s": round(t_eval, 2),
              "per_variant_ms": round(1000 * t_eval / len(variants), 1), "total_s": round(t_read + t_index + t_eval, 2),
              "simulator_checked_variants": a.check,
              "simulator_per_variant_s": round(check_s / a.check, 2) if a.check else None,
              "best": {k: rows[0][k] for k in ("variant", "stickiness", "usd_per_1k_sessions", "token_hit_ratio",
                                               "large_share")}}
    print(f"{len(variants)} rule variants ({len(rows)} distinct outcomes) on agent-coding ({result['requests']} requests, "
          f"{result['prompt_tokens'] / 1e6:.1f} M prompt tokens): read+hash {t_read:.1f} s, index {t_index:.2f} s, "
          f"evaluate {t_eval:.1f} s ({result['per_variant_ms']} ms/variant); total {result['total_s']} s")
    if a.check:
        print(f"pool simulator: {result['simulator_per_variant_s']} s/variant; {a.check} variants identical")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
