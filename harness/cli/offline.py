"""``kvscope simulate | kv-memory | cost``, registered by ``kvscope.harness.cli.main``.

Imports are lazy so that ``kvscope --help`` and ``simulate`` start fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvscope.harness.cli import argtypes
from kvscope.harness.cachemodel.kv_memory import kv_memory_report
from kvscope.harness.cachemodel.routing import POLICIES
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def add_subcommands(subparsers: "argparse._SubParsersAction") -> None:
    p = subparsers.add_parser(
        "simulate",
        help="predict vLLM prefix-cache hits for a trace (no GPU needed)",
        description="Replay a trace through a model of vLLM V1's prefix cache (chained block hashes, "
        "hit cap at (P-1)//B, physical block pool with vLLM's free-queue eviction) and report the hits "
        "vLLM should report. TRACE: a kvscope trace dir, a token JSONL (prompt_token_ids, ...), a Mooncake "
        "JSONL or a kv-cache-tester folder/tarball.",
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--block-size", type=argtypes.block_size, default=None,
                   help="KV block size in tokens (default: the trace's native size, 16 for token traces)")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--num-gpu-blocks", type=argtypes.num_gpu_blocks, default=None,
                     help="vLLM's num_gpu_blocks (null block included, so N-1 usable); default infinite")
    cap.add_argument("--capacity-tokens", type=str, default=None,
                     help="vLLM's 'KV cache size: T tokens' (= num_gpu_blocks * block size); a comma list "
                     "(1e5,1e6,...) prints the hit-ratio curve")
    p.add_argument("--replicas", type=argtypes.positive_int, default=1, help="number of vLLM replicas")
    p.add_argument("--routing", default="round-robin", choices=POLICIES, type=lambda s: s.replace("_", "-"),
                   help="how requests are spread over replicas")
    p.add_argument("--mode", default="sequential", choices=["sequential", "timed"],
                   help="sequential: one request at a time (exact); timed: overlap by arrival time")
    p.add_argument("--per-request", metavar="FILE", default=None,
                   help="write one JSON line per request (cached_tokens, in input order)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_simulate)

    k = subparsers.add_parser(
        "kv-memory",
        help="KV-cache bytes per token and how many sequences fit",
        description="KV bytes per token = 2 x layers x KV heads/TP x head_dim x dtype bytes (sliding-window "
        "layers capped at the window); with --memory-gib, the number of concurrent sequences of --context "
        "tokens that fit and vLLM's block count.",
    )
    src = k.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a Hugging Face config.json (or model dir)")
    src.add_argument("--preset", help="a named model shape (llama-3.1-8b, llama-3.1-70b, llama-2-7b, ...)")
    k.add_argument("--context", type=int, default=8192, help="tokens per sequence (default 8192)")
    k.add_argument("--kv-dtype", default=None, help="KV cache dtype: bf16, fp16, fp8, ... (default: model dtype)")
    k.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    k.add_argument("--memory-gib", type=float, default=None, help="KV memory budget per GPU in GiB")
    k.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="block size for the vLLM block count")
    k.add_argument("--json", action="store_true", help="print JSON instead of a table")
    k.set_defaults(func=_cmd_kv_memory)

    c = subparsers.add_parser(
        "cost",
        help="provider cost split into uncached, cache-write, cache-read and output tokens",
        description="For a run dir, bill the measured hits (requests.parquet) under a provider's prices; for "
        "a trace, run the provider prompt-cache model (TTL, minimum prefix, granularity, breakpoints).",
    )
    c.add_argument("path", metavar="TRACE_OR_RUN")
    c.add_argument("--pricing", required=True, help="preset name (see harness/offline/presets) or a YAML file")
    c.add_argument("--json", action="store_true", help="print JSON instead of a table")
    c.set_defaults(func=_cmd_cost)


def _print(d: dict, as_json: bool, keys: list[str] | None = None) -> None:
    if as_json:
        json.dump(d, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return
    for key in keys or list(d):
        if key in d and not isinstance(d[key], (dict, list)):
            v = d[key]
            sys.stdout.write(f"{key:28s} {v:.4f}\n" if isinstance(v, float) else f"{key:28s} {v}\n")


def _cmd_simulate(a: argparse.Namespace) -> int:
    # deferred: keeps `kvscope --help` fast
    from kvscope.harness.cachemodel.api import capacity_sweep, simulate_trace

    caps = _floats(a.capacity_tokens) if a.capacity_tokens else None
    if caps is not None and len(caps) > 1:
        d = capacity_sweep(a.trace, caps, block_size=a.block_size)
        if a.json:
            _print(d, True)
        else:
            print(f"{'capacity_tokens':>16s} {'num_gpu_blocks':>14s} {'token_hit_ratio':>15s}")
            for r in d["sweep"]:
                cap = "inf" if r["capacity_tokens"] is None else f"{r['capacity_tokens']:.3g}"
                nb = "-" if r["num_gpu_blocks"] is None else str(r["num_gpu_blocks"])
                print(f"{cap:>16s} {nb:>14s} {r['token_hit_ratio']:>15.4f}")
        return 0
    d = simulate_trace(a.trace, block_size=a.block_size, num_gpu_blocks=a.num_gpu_blocks,
                       capacity_tokens=caps[0] if caps else None, replicas=a.replicas, routing=a.routing,
                       mode=a.mode, per_request=a.per_request)
    if a.json:
        _print(d, True)
        return 0
    _print(d, False, ["trace_kind", "requests", "prompt_tokens", "cached_tokens", "token_hit_ratio",
                      "block_size", "num_gpu_blocks", "capacity_tokens", "mode", "replicas", "routing"])
    if "ideal_uncapped" in d:
        print(f"{'ideal_uncapped_hit_ratio':28s} {d['ideal_uncapped']['token_hit_ratio']:.4f}")
    if d["replicas"] > 1:
        for r in d["per_replica"]:
            print(f"  replica {r['replica']}: {r['requests']} requests, hit ratio {r['token_hit_ratio']:.4f}")
    return 0


def _cmd_kv_memory(a: argparse.Namespace) -> int:
    d = kv_memory_report(config=a.config, preset=a.preset, context=a.context, kv_dtype=a.kv_dtype, tp=a.tp,
                         memory_gib=a.memory_gib, block_size=a.block_size)
    _print(d, a.json)
    return 0


def _cmd_cost(a: argparse.Namespace) -> int:
    from kvscope.harness.pricing.api import cost_report  # deferred: keeps `kvscope --help` fast

    d = cost_report(a.path, a.pricing)
    if not a.json:
        d = {k: v for k, v in d.items() if k != "per_session"}
    _print(d, a.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m kvscope.harness.cli.offline`` (the same commands as ``kvscope``)."""
    parser = argparse.ArgumentParser(prog="kvscope")
    sub = parser.add_subparsers(dest="command", required=True)
    add_subcommands(sub)
    a = parser.parse_args(argv)
    return a.func(a)


if __name__ == "__main__":
    raise SystemExit(main())
