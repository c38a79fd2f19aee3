"""`kvscope explain` and `kvscope speculate` on the full agent-coding preset and on a 100 k-request trace: wall
time, peak memory (RSS as the kernel saw it, `/usr/bin/time -v`) and throughput of each whole command.

    .venv/bin/python benchmarks/explain_speculate_scale.py --tokenizer models/tiny
    .venv/bin/python benchmarks/explain_speculate_scale.py --tokenizer models/tiny --small   # a quick check

The two traces, generated once into --work and reused:

* `agent-coding` at the preset's own size (its default scale and sessions: ~620 M prompt tokens), the trace
  `benchmarks/speculate_speed.py` times speculate on;
* a 100 k-request trace: `agent-coding-timestamped` at --scale 0.02 (a timestamp in every system prompt, so every
  request breaks the cache: explain's heaviest case) with enough sessions for --requests requests (~69 a
  session; the count printed is the one generated).

explain's stated throughput is `EXPLAIN_PROMPT_TOKENS_PER_S` and `EXPLAIN_REQUESTS_PER_S`
(`harness/analysis/explain.py`: the estimate it prints before a long run); each explain line says whether the
run met it. speculate runs its default methods (ngram x2, suffix, oracle). `--small` generates 20 sessions
of each (a check that the script works, not a figure). Results go to benchmarks/results/explain_speculate_scale.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SESSION_REQUESTS = 69  # agent-coding-timestamped at --scale 0.02: 346,346 requests in 5,000 sessions


def _kvscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvscope.harness.cli.main", *args]


def generate(work: Path, name: str, preset: str, extra: list[str], tokenizer: str) -> Path:
    trace = work / name
    if not (trace / "trace.json").is_file():
        subprocess.run(_kvscope("workload", "generate", preset, "--tokenizer", tokenizer, "--out", str(trace),
                                "--no-progress", "--allow-large", *extra), check=True, cwd=REPO)
    return trace


def timed(args: list[str]) -> tuple[float, float, str]:
    """(wall s, peak RSS GB, stdout) of one command under /usr/bin/time -v."""
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", *args], capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    return wall, rss_kb * 1024 / 1e9, r.stdout


def trace_size(trace: Path) -> tuple[int, int]:
    meta = json.loads((trace / "trace.json").read_text())
    import pyarrow.parquet as pq

    prompt = int(pq.read_table(trace / "requests.parquet", columns=["prompt_tokens"]).column(0).to_numpy().sum())
    return int(meta["num_requests"]), prompt


def main() -> int:
    from kvscope.harness.analysis.explain import (
        EXPLAIN_PROMPT_TOKENS_PER_S,
        EXPLAIN_REQUESTS_PER_S,
        EXPLAIN_STARTUP_S,
    )

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="models/tiny")
    ap.add_argument("--requests", type=int, default=100_000, help="requests of the second trace (default 100000)")
    ap.add_argument("--work", default="/tmp/kvscope-explain-speculate-bench")
    ap.add_argument("--small", action="store_true", help="20 sessions of each trace: check the script only")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sessions = 20 if args.small else math.ceil(args.requests / SESSION_REQUESTS)
    traces = {
        "agent-coding (preset)": generate(work, "agent-coding-small" if args.small else "agent-coding", "agent-coding",
                                          ["--sessions", "20"] if args.small else [], args.tokenizer),
        f"timestamped x{sessions}": generate(work, f"timestamped-{sessions}", "agent-coding-timestamped",
                                                       ["--scale", "0.02", "--sessions", str(sessions)],
                                                       args.tokenizer),
    }
    print(f"stated explain throughput: {EXPLAIN_PROMPT_TOKENS_PER_S / 1e6:g} M prompt tokens/s or "
          f"{EXPLAIN_REQUESTS_PER_S:g} requests/s, whichever takes longer, after {EXPLAIN_STARTUP_S:g} s to start")
    print(f"{'trace':<22} {'requests':>9} {'prompt M':>9} {'command':<10} {'wall s':>8} {'peak GB':>8} "
          f"{'req/s':>8} {'M tok/s':>8}  stated")
    rows = []
    for label, trace in traces.items():
        n, prompt = trace_size(trace)
        for command in ("explain", "speculate"):
            cmd = _kvscope(command, str(trace), "--no-progress")
            if command == "explain":
                cmd += ["--json", str(work / f"{trace.name}-explain.json")]
            wall, peak_gb, _ = timed(cmd)
            stated = ""
            if command == "explain":
                budget_s = EXPLAIN_STARTUP_S + max(prompt / EXPLAIN_PROMPT_TOKENS_PER_S, n / EXPLAIN_REQUESTS_PER_S)
                stated = f"{'met' if wall <= budget_s else 'NOT met'} ({budget_s:.0f} s allowed)"
            rows.append({"trace": label, "path": str(trace), "requests": n, "prompt_tokens": prompt,
                         "command": command, "wall_s": round(wall, 2), "peak_rss_gb": round(peak_gb, 3),
                         "requests_per_s": round(n / wall, 1), "prompt_tokens_per_s": round(prompt / wall),
                         "stated": stated or None})
            print(f"{label:<22} {n:>9,} {prompt / 1e6:>9.1f} {command:<10} {wall:>8.1f} {peak_gb:>8.2f} "
                  f"{n / wall:>8.0f} {prompt / wall / 1e6:>8.2f}  {stated}", flush=True)
    if not args.small:
        out = REPO / "benchmarks" / "results" / "explain_speculate_scale.json"
        out.write_text(json.dumps({"created_at": time.time(), "rows": rows}, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
