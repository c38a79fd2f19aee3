"""kvscope's replay client vs `vllm bench serve`, both against the same zero-latency mock, client on one core.

    .venv/bin/python benchmarks/client_overhead.py [--concurrency 1,16,64,256] [--requests 5000] [--no-vllm]

The mock (`python -m tests.doubles.faultserver --uvloop`) runs pinned to core 1; each client runs pinned to core 0
in its own process. kvscope runs the real `replay()` path (trace read, /metrics watch, prediction, a record per
request with every inter-token gap, Parquet compaction, summary) over a synthetic trace of sessions with
128-token prompts and 16 output tokens, zero think time, closed loop at each concurrency. `vllm bench serve`
runs its random dataset with the same lengths (`--ignore-eos`) at `--max-concurrency`. Prints a table and
writes benchmarks/results/client_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, REPO, MockServer, cores, machine  # noqa: E402

PROMPT, OUTPUT, STEPS = 128, 16, 4


def kvscope_client(trace: str, endpoint: str, concurrency: int, out: str, profile: str | None) -> None:
    """Child process: one replay, figures to `out`."""
    from kvscope.harness.replay.options import ReplayOptions
    from kvscope.harness.results.records import read_records
    from kvscope.harness.replay.runner import replay

    run_dir = Path(tempfile.mkdtemp(prefix="kvscope-bench-")) / "run"
    opts = ReplayOptions(concurrency=concurrency, time_scale=0.0, progress=False, reset_prefix_cache=False,
                         scrape_interval_s=1.0)
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    outcome = replay(trace, run_dir, opts, endpoints=[endpoint])
    if profile:
        prof.disable()
        prof.dump_stats(profile)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    s = outcome.summary
    df = read_records(run_dir)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    lat = s["latency"]
    res = {
        "requests": s["requests"]["sent"], "ok": s["requests"]["ok"], "failed": s["requests"]["failed"],
        "duration_s": s["duration_s"], "requests_per_s": s["throughput"]["requests_per_s"],
        "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
        "ttft_ms_p50": lat["ttft_s"]["p50"] * 1e3, "ttft_ms_p99": lat["ttft_s"]["p99"] * 1e3,
        "itl_ms_p50": lat["itl_s"]["p50"] * 1e3, "itl_ms_p99": lat["itl_s"]["p99"] * 1e3,
        "replay_wall_s": wall, "replay_cpu_s": cpu,
        "cpu_us_per_request": s["client"]["cpu_us_per_request"], "client_cpu_utilization": s["client"]["cpu_utilization"],
        "event_loop": s["client"]["event_loop"],
        "records_with_itl": int((df["itl_s"].map(len) == OUTPUT - 1).sum()),
    }
    Path(out).write_text(json.dumps(res))


def run_kvscope(trace: Path, endpoint: str, c: int, pin: list[str], profile: str | None = None) -> dict:
    out = Path(tempfile.mkdtemp()) / "res.json"
    cmd = [*pin, PY, __file__, "--_child", str(trace), endpoint, str(c), str(out)]
    if profile:
        cmd += ["--_profile", profile]
    subprocess.run(cmd, cwd=REPO, check=True)
    return json.loads(out.read_text())


def run_vllm(endpoint: str, c: int, n: int, tokenizer: Path, pin: list[str]) -> dict:
    d = Path(tempfile.mkdtemp(prefix="vllm-bench-"))
    cmd = [*pin, PY, str(REPO / "benchmarks" / "vllm_cli.py"), "bench", "serve", "--backend", "openai",
           "--base-url", endpoint, "--endpoint", "/v1/completions", "--model", "mock", "--tokenizer", str(tokenizer),
           "--dataset-name", "random", "--random-input-len", str(PROMPT), "--random-output-len", str(OUTPUT),
           "--num-prompts", str(n), "--max-concurrency", str(c), "--request-rate", "inf", "--ignore-eos",
           "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--result-dir", str(d), "--result-filename", "r.json", "--disable-tqdm", "--seed", "0"]
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    r = json.loads((d / "r.json").read_text())
    return {"requests": r.get("num_prompts", n), "ok": r.get("completed"), "duration_s": r.get("duration"),
            "requests_per_s": r.get("request_throughput"), "output_tokens_per_s": r.get("output_throughput"),
            "ttft_ms_p50": r.get("p50_ttft_ms"), "ttft_ms_p99": r.get("p99_ttft_ms"),
            "itl_ms_p50": r.get("p50_itl_ms"), "itl_ms_p99": r.get("p99_itl_ms"),
            "process_wall_s": time.perf_counter() - t0}


def tiny_tokenizer() -> Path:
    out = REPO / "benchmarks" / ".cache" / "tiny"
    if not (out / "tokenizer.json").exists():
        from kvscope.harness.model.tinymodel import build_tiny_model

        build_tiny_model(out, seed=0)
    return out


def main() -> int:
    if "--_child" in sys.argv:
        i = sys.argv.index("--_child")
        trace, endpoint, c, out = sys.argv[i + 1:i + 5]
        prof = sys.argv[sys.argv.index("--_profile") + 1] if "--_profile" in sys.argv else None
        kvscope_client(trace, endpoint, int(c), out, prof)
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,16,64,256")
    ap.add_argument("--requests", type=int, default=5000, help="requests per run (each tool, each concurrency)")
    ap.add_argument("--no-vllm", action="store_true", help="skip vllm bench serve")
    ap.add_argument("--repeat", type=int, default=1,
                    help="alternate the two clients N times per concurrency and keep each one's best run "
                         "(for shared, noisy machines); every run is kept in the JSON")
    ap.add_argument("--profile", metavar="FILE", help="cProfile the kvscope client at the highest concurrency")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "client_overhead.json"))
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    client_pin, server_pin = cores()

    from kvscope.workloads.generate import synthetic_trace

    tmp = Path(tempfile.mkdtemp(prefix="kvscope-bench-trace-"))
    n_sessions = max(args.requests // STEPS, max(levels))
    trace = synthetic_trace(n_sessions, steps=STEPS, prompt_tokens=PROMPT, output_tokens=OUTPUT).write(tmp / "t")
    tok = None if args.no_vllm else tiny_tokenizer()
    rows = []
    with MockServer(pin=server_pin) as mock:
        for c in levels:
            row: dict = {"concurrency": c, "runs": {"kvscope": [], "vllm_bench": []}}
            for rep in range(args.repeat):
                prof = args.profile if (args.profile and c == max(levels) and rep == 0) else None
                row["runs"]["kvscope"].append(run_kvscope(trace, mock.endpoint, c, client_pin, prof))
                if tok is not None:
                    try:
                        row["runs"]["vllm_bench"].append(run_vllm(mock.endpoint, c, args.requests, tok, client_pin))
                    except (RuntimeError, OSError) as exc:
                        row["runs"]["vllm_bench"].append({"error": str(exc)[-2000:]})
            for tool, runs in row["runs"].items():
                good = [r for r in runs if r.get("requests_per_s")]
                if good:
                    row[tool] = max(good, key=lambda r: r["requests_per_s"])
                elif runs:
                    row[tool] = runs[-1]
            k, v = row["kvscope"], row.get("vllm_bench") or {}
            if v.get("requests_per_s"):
                row["ratio_req_per_s"] = k["requests_per_s"] / v["requests_per_s"]
            rows.append(row)
            print(_line(row), flush=True)
    result = {"machine": machine(), "pinning": {"client": client_pin, "server": server_pin},
              "workload": {"prompt_tokens": PROMPT, "output_tokens": OUTPUT, "requests": args.requests,
                           "steps_per_session": STEPS, "streaming": True, "mock": "tests.doubles.faultserver --uvloop"},
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "repeat": args.repeat,
              "load_average": os.getloadavg(), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print(table(rows))
    print(f"\nwritten {args.out}")
    return 0


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _line(row: dict) -> str:
    k, v = row["kvscope"], row.get("vllm_bench") or {}
    return (f"c={row['concurrency']}: kvscope {_f(k['requests_per_s'])} req/s (cpu {_f(k['cpu_us_per_request'])} us/req)"
            f", vllm bench {_f(v.get('requests_per_s'))} req/s")


def table(rows: list[dict]) -> str:
    hdr = (f"{'conc':>5} | {'kvscope req/s':>13} {'tok/s':>8} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} "
           f"{'cpu us/req':>10} | {'vllm req/s':>10} {'TTFT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} | {'ratio':>5}")
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        k, v = r["kvscope"], r.get("vllm_bench") or {}
        out.append(
            f"{r['concurrency']:>5} | {_f(k['requests_per_s']):>13} {_f(k['output_tokens_per_s']):>8} "
            f"{_f(k['ttft_ms_p50'], '{:.2f}') + '/' + _f(k['ttft_ms_p99'], '{:.2f}'):>16} "
            f"{_f(k['itl_ms_p50'], '{:.3f}') + '/' + _f(k['itl_ms_p99'], '{:.3f}'):>15} "
            f"{_f(k['cpu_us_per_request']):>10} | {_f(v.get('requests_per_s')):>10} "
            f"{_f(v.get('ttft_ms_p50'), '{:.2f}') + '/' + _f(v.get('ttft_ms_p99'), '{:.2f}'):>16} "
            f"{_f(v.get('itl_ms_p50'), '{:.3f}') + '/' + _f(v.get('itl_ms_p99'), '{:.3f}'):>15} | "
            f"{_f(r.get('ratio_req_per_s'), '{:.2f}'):>5}")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
