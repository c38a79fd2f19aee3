"""What each replay client priority costs: the client's own stalls, and the CPU it takes from a neighbour.

    .venv/bin/python benchmarks/client_priority.py [--modes normal,realtime,realtime-loop] [--seconds 6] [--rounds 2]

A CPU-bound neighbour (a Python busy loop, nice 0) and the replay client are pinned to the same core (core 0);
the mock server (`python -m tests.doubles.faultserver --uvloop`) runs on core 1. Two loads:

* ``light``: concurrency 4 against a mock that streams 16 tokens 2 ms apart: the client mostly sleeps, as in a
  replay against vLLM.
* ``saturating``: concurrency 64 against a zero-latency mock: the client alone would use its whole core.

Per mode and load: the replay's stalls (``summary.json client.stalls / stalled_s``: its event loop woke over
0.1 s late), requests/s, TTFT p99, the client's CPU share, and the CPU-seconds the neighbour got per wall second
of the replay (1.0 = the whole core). ``baseline`` runs the replay with no neighbour. Modes: ``normal``
(SCHED_OTHER), ``realtime`` (SCHED_FIFO priority 1, every replay thread: the old default ``auto``),
``realtime-loop`` (SCHED_FIFO on the event-loop thread only, its other threads normal). Prints a table and writes
benchmarks/results/client_priority.json.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, REPO, MockServer, cores, machine  # noqa: E402

LOADS = {"light": {"concurrency": 4, "itl_ms": 2.0}, "saturating": {"concurrency": 64, "itl_ms": 0.0}}
NEIGHBOUR = "import time\nend = time.time() + float(__import__('sys').argv[1])\nwhile time.time() < end:\n    pass\n"


def client(trace: str, endpoint: str, concurrency: int, mode: str, out: str, neighbour_pid: int) -> None:
    """Child process: one replay under `mode`, figures to `out`; the neighbour's CPU-seconds are read just
    before and after the replay, so the window is the one the priority applies to (imports excluded)."""
    from kvscope.harness.replay import runner
    from kvscope.harness.replay.options import ReplayOptions

    priority = "normal" if mode == "baseline" else mode
    if mode == "realtime-loop":  # only the event-loop thread real-time: what the priority was before threads_inherit
        from contextlib import contextmanager

        from kvscope.harness.replay import priority as prio

        real = prio.client_priority

        @contextmanager
        def loop_only(m, *, threads_inherit=False):
            with real("realtime", threads_inherit=False) as got:
                yield got

        runner.client_priority = loop_only
        priority = "realtime"
    run_dir = Path(tempfile.mkdtemp(prefix="kvscope-prio-")) / "run"
    opts = ReplayOptions(concurrency=concurrency, time_scale=0.0, progress=False, reset_prefix_cache=False,
                         scrape_interval_s=1.0, client_priority=priority)
    n0 = cpu_s(neighbour_pid) if neighbour_pid else None
    t0 = time.perf_counter()
    s = runner.replay(trace, run_dir, opts, endpoints=[endpoint]).summary
    wall = time.perf_counter() - t0
    share = None if n0 is None else (cpu_s(neighbour_pid) - n0) / wall
    c = s["client"]
    Path(out).write_text(json.dumps({
        "wall_s": wall, "neighbour_cpu_share": share, "duration_s": s["duration_s"], "requests": s["requests"]["ok"],
        "requests_per_s": s["throughput"]["requests_per_s"], "ttft_ms_p99": s["latency"]["ttft_s"]["p99"] * 1e3,
        "stalls": c["stalls"], "stalled_s": c["stalled_s"], "stall_max_s": c["stall_max_s"],
        "client_cpu_share": c["cpu_utilization"], "priority": c["priority"]}))


def cpu_s(pid: int) -> float:
    """user + system CPU-seconds of a running process (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_run(trace: Path, endpoint: str, load: str, mode: str, pin: list[str]) -> dict:
    out = Path(tempfile.mkdtemp()) / "res.json"
    neighbour = None
    if mode != "baseline":
        neighbour = subprocess.Popen([*pin, PY, "-c", NEIGHBOUR, "600"])
        time.sleep(0.5)  # running before the client starts
    try:
        subprocess.run([*pin, PY, __file__, "--_child", str(trace), endpoint, str(LOADS[load]["concurrency"]), mode,
                        str(out), str(neighbour.pid if neighbour else 0)], cwd=REPO, check=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    res = json.loads(out.read_text())
    res.update(load=load, mode=mode)
    return res


def main() -> int:
    if "--_child" in sys.argv:
        i = sys.argv.index("--_child")
        trace, endpoint, c, mode, out, neighbour = sys.argv[i + 1:i + 7]
        client(trace, endpoint, int(c), mode, out, int(neighbour))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="baseline,normal,realtime,realtime-loop")
    ap.add_argument("--loads", default="light,saturating")
    ap.add_argument("--seconds", type=float, default=6.0, help="rough length of each replay")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every (load, mode) this often, interleaved")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "client_priority.json"))
    args = ap.parse_args()
    client_pin, server_pin = cores()
    from kvscope.workloads.generate import synthetic_trace

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-prio-trace-"))
    rows = []
    for load in args.loads.split(","):
        spec = LOADS[load]
        # light: ~40 ms per request at 4 concurrent; saturating: ~2,000 requests/s on a core
        n_requests = int(args.seconds * (spec["concurrency"] / 0.04 if spec["itl_ms"] else 2000))
        steps = 8
        trace = synthetic_trace(max(n_requests // steps, spec["concurrency"]), steps=steps, prompt_tokens=128,
                                output_tokens=16).write(tmp / load)
        mock_args = ["--itl-ms", str(spec["itl_ms"])] if spec["itl_ms"] else []
        with MockServer(*mock_args, pin=server_pin) as mock:
            for r in range(args.rounds):
                for mode in args.modes.split(","):
                    res = one_run(trace, mock.endpoint, load, mode, client_pin)
                    res["round"] = r
                    rows.append(res)
                    nb = "-" if res["neighbour_cpu_share"] is None else f"{res['neighbour_cpu_share']:.2f}"
                    print(f"{load:>10} {mode:>13} r{r}: {res['requests_per_s']:8.1f} req/s  TTFT p99 "
                          f"{res['ttft_ms_p99']:7.1f} ms  stalls {res['stalls']:3d} ({res['stalled_s']:.2f} s)  "
                          f"client CPU {res['client_cpu_share']:.2f}  neighbour CPU {nb}  [{res['priority']}]",
                          flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"machine": machine(), "loads": LOADS, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
