"""`kvscope explain` on generated traces of growing size: wall time and peak memory (RSS) of the whole command.

    .venv/bin/python benchmarks/explain_scale.py --tokenizer models/tiny --sessions 300 5000

Each trace is `agent-coding-timestamped` at --scale 0.02 (a timestamp in every system prompt: every request
breaks the cache, so every request gets a cause and a what-if patch, the heaviest case), generated once into
--work and reused. Each explain runs as its own process under `/usr/bin/time -v` (peak RSS as the kernel saw it),
printed in MiB and in decimal GB (the budget: 5,000 sessions well under 2 GB). It writes the attribution as JSON
(`--json`), so the figure includes the output step.

What a run holds at its peak (the end of the attribution pass; benchmarks/README.md has the figures): the trace
(segment ids as int32 views of one flat array), the chain index of the infinite-cache simulation and predecessor
search (12 bytes a distinct block chain), the attribution rows and the packed what-if patches; see the module
docstrings of `harness/analysis/explain.py` and `harness/cachemodel/chain_index.py` for why.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path


def _kvscope() -> str:
    return str(Path(sys.executable).with_name("kvscope"))


def run(sessions: int, tokenizer: str, work: Path, preset: str, scale: float) -> dict:
    trace = work / f"{preset}-{sessions}"
    if not (trace / "trace.json").is_file():
        subprocess.run([_kvscope(), "workload", "generate", preset, "--tokenizer", tokenizer, "--sessions",
                        str(sessions), "--scale", str(scale), "--out", str(trace), "--no-progress", "--allow-large"],
                       check=True)
    t = time.perf_counter()
    r = subprocess.run(["/usr/bin/time", "-v", _kvscope(), "explain", str(trace), "--no-progress",
                        "--json", str(work / f"explain-{sessions}.json")], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if r.returncode:
        raise SystemExit(r.stderr[-2000:])
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr).group(1))
    head = r.stdout.splitlines()[0]
    return {"sessions": sessions, "wall_s": wall, "peak_rss_mb": rss_kb / 1024, "peak_rss_gb": rss_kb * 1024 / 1e9,
            "peak_rss_kb": rss_kb, "summary": head}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default="models/tiny")
    ap.add_argument("--sessions", type=int, nargs="+", default=[300, 5000])
    ap.add_argument("--preset", default="agent-coding-timestamped")
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--work", default="/tmp/kvscope-explain-bench")
    args = ap.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"{'sessions':>8} {'wall s':>8} {'peak RSS MiB':>12} {'GB':>6}  summary")
    for n in args.sessions:
        r = run(n, args.tokenizer, work, args.preset, args.scale)
        print(f"{r['sessions']:>8} {r['wall_s']:>8.1f} {r['peak_rss_mb']:>12.0f} {r['peak_rss_gb']:>6.2f}  "
              f"{r['summary']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
