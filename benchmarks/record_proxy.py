"""TTFT added by the `kvscope record` proxy at 100 requests/s, against the zero-latency mock.

    .venv/bin/python benchmarks/record_proxy.py [--rate 100] [--requests 1000] [--rounds 3] [--tokenizer DIR]

The mock (`python -m tests.doubles.faultserver --uvloop`) and the proxy (`kvscope record`, its own
process) run pinned to core 1, the load generator to core 0. Open loop: streaming chat requests (a 3-message
history of ~2 KB, tools, 16 output tokens, `stream_options.include_usage`) at `--rate` per second on each path,
interleaved (direct, proxy, direct, …) so that noise on a shared machine hits both paths alike. TTFT = send to the first content chunk. Prints p50/p99 per path and p99(proxy) - p99(direct);
target: at most 1 ms added. Then stops the proxy (SIGINT) and times building the trace from the log.
Writes benchmarks/results/record_proxy.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import PY, REPO, MockServer, cores, machine

BODY = {"model": "mock", "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True},
        "tool_choice": "none",
        "tools": [{"type": "function", "function": {"name": "read_file", "description": "Read a file.",
                                                    "parameters": {"type": "object", "properties": {}}}}],
        "messages": [{"role": "system", "content": "You are a coding agent. " * 20},
                     {"role": "user", "content": "Fix the failing test. " * 10},
                     {"role": "tool", "content": "def f(x):\n    return x\n" * 40}]}


async def _one(client, url: str, body: bytes, ttft: list[float], errors: list[str]) -> None:
    res = await client.post_stream(url, body, headers={"X-Session-ID": "bench"})
    if res.ok and res.first_token_s is not None:
        ttft.append(res.first_token_s - res.sent_s)
    else:
        errors.append(f"{res.error_class}: {res.error}")


async def _load(direct_url: str, proxy_url: str, rate: float, n: int) -> tuple[list[float], list[float]]:
    """``n`` requests per path at ``rate`` per second per path, interleaved: direct, proxy, direct, …"""
    from kvscope.harness.serving.client import FastStreamClient

    body = json.dumps(BODY).encode()
    ttft: tuple[list[float], list[float]] = ([], [])
    errors: list[str] = []
    urls = (direct_url, proxy_url)
    async with FastStreamClient() as client:  # kvscope's own HTTP/1.1 client: the cheapest load generator
        for _ in range(20):  # warm both connection pools
            await _one(client, direct_url, body, [], errors)
            await _one(client, proxy_url, body, [], errors)
        tasks, t0 = [], time.perf_counter()
        for i in range(2 * n):
            delay = t0 + i / (2 * rate) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(client, urls[i % 2], body, ttft[i % 2], errors)))
        await asyncio.gather(*tasks)
    if errors:
        raise RuntimeError(f"{len(errors)} failed requests, first: {errors[0]}")
    return ttft


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1e3 if s else float("nan")


def _start_proxy(upstream: str, out: Path, pin: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*pin, PY, "-m", "kvscope.harness.cli.main", "record", "--upstream", upstream,
                             "--listen", "127.0.0.1:0", "--out", str(out), *_tok_args], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "recording on" not in line:
        raise RuntimeError(f"proxy did not start: {line!r}")
    return proc, line.split()[2]


_tok_args: list[str] = []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--requests", type=int, default=1000, help="per path per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer", default=os.environ.get("KVSCOPE_TEST_MODEL"),
                    help="model dir for building the trace after the run (the mock has no /tokenize)")
    args = ap.parse_args()
    if args.tokenizer:
        _tok_args.extend(["--tokenizer", args.tokenizer])
    client_pin, server_pin = cores()
    if client_pin:
        os.sched_setaffinity(0, {0})
    out = Path(tempfile.mkdtemp(prefix="kvscope-record-bench-")) / "rec"
    direct: list[float] = []
    proxied: list[float] = []
    with MockServer("--ttft-ms", "0", "--itl-ms", "0") as mock:
        proxy, url = _start_proxy(mock.endpoint, out, server_pin)
        try:
            import psutil

            cpu0 = psutil.Process(proxy.pid).cpu_times()
            for _ in range(args.rounds):
                d, p = asyncio.run(_load(mock.endpoint + "/v1/chat/completions", url + "/v1/chat/completions",
                                         args.rate, args.requests))
                direct += d
                proxied += p
            cpu1 = psutil.Process(proxy.pid).cpu_times()
            proxy_cpu_us = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) / max(1, len(proxied)) * 1e6
        finally:
            t0 = time.perf_counter()
            proxy.send_signal(signal.SIGINT)
            tail = proxy.communicate(timeout=600)[0]
            finalize_s = time.perf_counter() - t0
    res = {"machine": machine(), "rate_per_s": args.rate, "requests_per_path": len(direct),
           "direct_ttft_ms": {"p50": _pct(direct, 0.5), "p99": _pct(direct, 0.99)},
           "proxy_ttft_ms": {"p50": _pct(proxied, 0.5), "p99": _pct(proxied, 0.99)},
           "proxy_cpu_us_per_request": proxy_cpu_us, "load_average": os.getloadavg(), "finalize_s": finalize_s, "finalize_output": tail.strip()[-300:]}
    res["added_p99_ms"] = res["proxy_ttft_ms"]["p99"] - res["direct_ttft_ms"]["p99"]
    res["added_p50_ms"] = res["proxy_ttft_ms"]["p50"] - res["direct_ttft_ms"]["p50"]
    print(f"{'path':<8} {'n':>6} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    print(f"{'direct':<8} {len(direct):>6} {res['direct_ttft_ms']['p50']:>12.3f} {res['direct_ttft_ms']['p99']:>12.3f}")
    print(f"{'proxy':<8} {len(proxied):>6} {res['proxy_ttft_ms']['p50']:>12.3f} {res['proxy_ttft_ms']['p99']:>12.3f}")
    print(f"added by the proxy: p50 {res['added_p50_ms']:+.3f} ms, p99 {res['added_p99_ms']:+.3f} ms "
          f"(target <= 1 ms); proxy CPU {proxy_cpu_us:.0f} us/request; load average {os.getloadavg()[0]:.1f}; "
          f"trace built in {finalize_s:.1f} s: {tail.strip()[-160:]}")
    dest = REPO / "benchmarks" / "results" / "record_proxy.json"
    dest.parent.mkdir(exist_ok=True)
    dest.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
