"""Memory over a long replay: 10,000 requests at 256 concurrent sessions against the mock, RSS sampled throughout.

    .venv/bin/python benchmarks/longrun_memory.py [--requests 10000] [--concurrency 256]

Target (issue #7): growth under 200 MB. Records stream to disk, the /metrics series spools to disk, and nothing
per request is kept in memory beyond the in-flight requests. Writes benchmarks/results/longrun_memory.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, MockServer, RssSampler, cores, machine  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="requests per session")
    ap.add_argument("--ttft-ms", type=float, default=2.0)
    ap.add_argument("--itl-ms", type=float, default=0.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "longrun_memory.json"))
    args = ap.parse_args()

    from kvscope.workloads.generate import synthetic_trace
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.replay.runner import replay

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-longrun-"))
    n_sessions = max(args.requests // args.steps, args.concurrency)
    trace_dir = synthetic_trace(n_sessions, steps=args.steps).write(tmp / "trace")
    gc.collect()
    with MockServer("--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms), pin=cores()[1]) as mock:
        with RssSampler(0.1) as rss:
            before = rss.rss_mb()
            t0 = time.perf_counter()
            out = replay(trace_dir, tmp / "run", ReplayOptions(concurrency=args.concurrency, time_scale=0.0,
                                                               progress=False, scrape_interval_s=0.2),
                         endpoints=[mock.endpoint])
            wall = time.perf_counter() - t0
        after = rss.rss_mb()
    s = out.summary
    res = {"machine": machine(), "requests": s["requests"]["sent"], "ok": s["requests"]["ok"],
           "concurrency": args.concurrency, "wall_s": wall, "requests_per_s": s["throughput"]["requests_per_s"],
           "rss_before_mb": before, "rss_after_mb": after, "rss_peak_mb": rss.peak_mb,
           "growth_peak_mb": rss.peak_mb - before, "growth_after_mb": after - before, "target_growth_mb": 200,
           "metrics_rows": len(__import__("pandas").read_parquet(tmp / "run" / "server_metrics.parquet")),
           "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    res["pass"] = res["growth_peak_mb"] < 200 and res["requests"] == args.requests
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{res['requests']} requests ({res['ok']} ok) at {args.concurrency} sessions in {wall:.1f} s "
          f"({res['requests_per_s']:.0f} req/s)")
    print(f"RSS before {before:.0f} MB, after {after:.0f} MB, peak {rss.peak_mb:.0f} MB: growth "
          f"{res['growth_peak_mb']:.0f} MB (target < 200 MB) -> {'PASS' if res['pass'] else 'FAIL'}")
    print(f"written {args.out}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
