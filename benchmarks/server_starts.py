"""Wall time of vLLM CPU server starts: one after another, and launched side by side (as the test suite's
`SharedServers` pool and an experiment's `servers_up: all` do).

A vLLM CPU start is a chain of single-threaded imports (API server, engine core, worker process), so on a
2-core machine a second start launched beside the first mostly fills the idle core. The servers are the test
suite's shared configurations (default, n-gram without prefix caching, 64 blocks) on the tiny model.

Usage (starts real vLLM servers: take the machine's lock)::

    flock /tmp/kvscope-vllm.lock .venv/bin/python benchmarks/server_starts.py --model /work/models/tiny [--servers 3]

Prints seconds per mode and writes JSON under ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import machine

CONFIGS = [
    {},
    {"enable_prefix_caching": False,
     "speculative_config": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 4}},
    {"num_gpu_blocks_override": 64},
]


def _servers(model: Path, n: int, work: Path) -> list:
    from kvscope.harness.serving.server import ServerConfig, VllmServer

    out = []
    for i in range(n):
        cfg = ServerConfig(model=str(model), served_model_name="tiny", max_model_len=2048,
                           kv_cache_memory_bytes="32M", startup_timeout_s=900, **CONFIGS[i % len(CONFIGS)])
        out.append(VllmServer(cfg, log_path=work / f"server-{i}-{time.monotonic_ns()}.log"))
    return out


def one_after_another(model: Path, n: int, work: Path) -> float:
    servers = _servers(model, n, work)
    t0 = time.perf_counter()
    try:
        for s in servers:
            s.start()
        return time.perf_counter() - t0
    finally:
        for s in servers:
            s.stop()


def side_by_side(model: Path, n: int, work: Path) -> float:
    servers = _servers(model, n, work)
    t0 = time.perf_counter()
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.finish_start()
        return time.perf_counter() - t0
    finally:
        for s in servers:
            s.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path(os.environ.get("KVSCOPE_TEST_MODEL") or REPO / "models" / "tiny"))
    ap.add_argument("--servers", type=int, default=3, help="servers started per mode (default 3)")
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="kvscope-starts-") as d:
        work = Path(d)
        side_s = side_by_side(args.model, args.servers, work)
        seq_s = one_after_another(args.model, args.servers, work)
    load_after = os.getloadavg()[0]
    print(f"{args.servers} vLLM CPU server starts: one after another {seq_s:.1f} s, side by side {side_s:.1f} s "
          f"(load average {load_before:.1f} before, {load_after:.1f} after)")
    out = REPO / "benchmarks" / "results" / "server_starts.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"servers": args.servers, "one_after_another_s": round(seq_s, 1),
                               "side_by_side_s": round(side_s, 1), "load_average": [load_before, load_after],
                               "machine": machine()}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
