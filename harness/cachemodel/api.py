"""Plain-argument functions behind ``kvscope simulate | kv-memory``; each returns a JSON-able dict."""

from __future__ import annotations

import json
import math
import time
from typing import Sequence

from kvscope.harness.cachemodel.ideal import ideal_prefix_hit
from kvscope.harness.cachemodel.kv_memory import kv_memory_report as _report
from kvscope.harness.cachemodel.simulator import ServiceModel, SimConfig, simulate
from kvscope.harness.cachemodel.trace_io import load_trace


def _config(block_size: int, num_gpu_blocks: int | None, capacity_tokens: float | None) -> SimConfig:
    if num_gpu_blocks is not None and capacity_tokens is not None:
        raise ValueError("give --num-gpu-blocks or --capacity-tokens, not both")
    if capacity_tokens is not None:
        return SimConfig.from_capacity_tokens(block_size, capacity_tokens)
    return SimConfig(block_size=block_size, num_gpu_blocks=num_gpu_blocks)


def simulate_trace(trace: str, *, block_size: int | None = None, num_gpu_blocks: int | None = None,
                   capacity_tokens: float | None = None, replicas: int = 1, routing: str = "round-robin",
                   mode: str = "sequential", per_request: str | None = None, ideal: bool | None = None,
                   prefill_tokens_per_s: float = 5000.0, decode_tokens_per_s: float = 50.0) -> dict:
    """Predict vLLM prefix-cache hits for a trace (``None`` capacity = infinite cache)."""
    t0 = time.perf_counter()
    tr = load_trace(trace, block_size)
    t1 = time.perf_counter()
    cfg = _config(tr.block_size, num_gpu_blocks, capacity_tokens)
    res = simulate(tr.requests, cfg, replicas=replicas, routing=routing, mode=mode,
                   service=ServiceModel(prefill_tokens_per_s, decode_tokens_per_s))
    t2 = time.perf_counter()
    out = {"trace": str(trace), "trace_kind": tr.kind, "native_block_size": tr.native_block_size, **res.summary()}
    if ideal is None:  # by default only with an infinite cache, where it is the comparable figure
        ideal = cfg.num_gpu_blocks is None
    if ideal:
        out["ideal_uncapped"] = ideal_prefix_hit(tr.requests)
    if per_request:
        with open(per_request, "w") as f:
            for r in res.results:
                f.write(json.dumps(r.as_dict()) + "\n")
        out["per_request_file"] = per_request
    out["timing_s"] = {"read": t1 - t0, "simulate": t2 - t1}
    return out


def capacity_sweep(trace: str, capacities_tokens: Sequence[float], *, block_size: int | None = None) -> dict:
    """Hit ratio vs KV capacity (sequential, one replica), plus the infinite-cache value."""
    tr = load_trace(trace, block_size)
    rows = []
    for cap in list(capacities_tokens) + [math.inf]:
        cfg = SimConfig(tr.block_size, None) if math.isinf(cap) else SimConfig.from_capacity_tokens(tr.block_size, cap)
        s = simulate(tr.requests, cfg).summary()
        rows.append({"capacity_tokens": None if math.isinf(cap) else cap, "num_gpu_blocks": cfg.num_gpu_blocks,
                     "token_hit_ratio": s["token_hit_ratio"], "cached_tokens": s["cached_tokens"]})
    return {"trace": str(trace), "block_size": tr.block_size, "prompt_tokens": s["prompt_tokens"],
            "requests": s["requests"], "sweep": rows}


def kv_memory_report(**kw) -> dict:
    """See :func:`kvscope.harness.cachemodel.kv_memory.kv_memory_report` (imported lazily: pydantic is slow to load)."""
    return _report(**kw)


__all__ = ["simulate_trace", "capacity_sweep", "kv_memory_report"]
