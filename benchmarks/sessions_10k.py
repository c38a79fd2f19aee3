"""10,000 concurrent sessions held open by think-time timers (not threads), memory under 1 GB.

    .venv/bin/python benchmarks/sessions_10k.py [--sessions 10000] [--think-s 4] [--steps 3]

Open loop on the trace's own start times: every session starts within `--ramp-s`, then each waits `--think-s`
between its steps, so all sessions are alive at once, almost all of them asleep on an asyncio timer. Reports
peak RSS and the peak number of sessions open at once (from the records: first send to last answer). Writes
benchmarks/results/sessions_10k.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import REPO, MockServer, RssSampler, cores, machine  # noqa: E402


def peak_open_sessions(df) -> int:
    g = df.groupby("session_id").agg(start=("sent_s", "min"), end=("done_s", "max"))
    events = sorted([(t, 1) for t in g["start"]] + [(t, -1) for t in g["end"]])
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--think-s", type=float, default=4.0)
    ap.add_argument("--ramp-s", type=float, default=2.0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sessions_10k.json"))
    args = ap.parse_args()

    from kvscope.workloads.generate import synthetic_trace
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.results.records import read_records
    from kvscope.harness.replay.runner import replay

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-10k-"))
    trace_dir = synthetic_trace(args.sessions, steps=args.steps, think_time_s=args.think_s,
                                session_gap_s=args.ramp_s / args.sessions).write(tmp / "trace")
    threads_peak = [threading.active_count()]
    with MockServer(pin=cores()[1]) as mock:
        with RssSampler(0.1) as rss:
            before = rss.rss_mb()
            stop = threading.Event()

            def count_threads() -> None:
                while not stop.wait(0.2):
                    threads_peak[0] = max(threads_peak[0], threading.active_count())

            threading.Thread(target=count_threads, daemon=True).start()
            t0 = time.perf_counter()
            out = replay(trace_dir, tmp / "run", ReplayOptions(time_scale=1.0, progress=False), endpoints=[mock.endpoint])
            wall = time.perf_counter() - t0
            stop.set()
    df = read_records(tmp / "run")
    s = out.summary
    res = {"machine": machine(), "sessions": args.sessions, "requests": s["requests"]["sent"],
           "ok": s["requests"]["ok"], "wall_s": wall, "peak_open_sessions": peak_open_sessions(df),
           "rss_before_mb": before, "rss_peak_mb": rss.peak_mb, "target_peak_mb": 1024,
           "threads_peak": threads_peak[0], "when": time.strftime("%Y-%m-%d %H:%M:%S")}
    res["pass"] = res["rss_peak_mb"] < 1024 and res["peak_open_sessions"] >= 0.95 * args.sessions
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2))
    print(f"{res['requests']} requests ({res['ok']} ok), peak {res['peak_open_sessions']} sessions open at once, "
          f"{res['threads_peak']} threads; RSS before {before:.0f} MB, peak {rss.peak_mb:.0f} MB (target < 1024 MB) "
          f"-> {'PASS' if res['pass'] else 'FAIL'}")
    print(f"written {args.out}")
    return 0 if res["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
