"""Plain-argument function behind ``kvscope cost``; returns a JSON-able dict."""

from __future__ import annotations

from kvscope.harness.cachemodel.trace_io import detect_kind, load_trace
from kvscope.harness.pricing.cost import run_cost
from kvscope.harness.pricing.provider_cache import load_preset, simulate_provider
from kvscope.workloads.prefix import DEFAULT_BLOCK_SIZE


def cost_report(path: str, pricing: str) -> dict:
    """Provider cost of a run dir (measured hits) or of a trace (provider cache model)."""
    cfg = load_preset(pricing)
    kind = detect_kind(path)
    if kind == "run":
        out = run_cost(path, cfg.pricing)
        out.update(source="run", preset=cfg.name)
        return out
    # Unit of the hashes: the native block of block-id traces, else the granularity (at most 64 tokens).
    native = {"mooncake": 512, "kvtester": 64}.get(kind)
    unit = native or (min(cfg.granularity_tokens, 64) if cfg.granularity_tokens > 1 else DEFAULT_BLOCK_SIZE)
    tr = load_trace(path, unit)
    _, summary = simulate_provider(tr.requests, cfg)
    summary.update(source="trace", trace_kind=kind, unit_tokens=unit, as_of=cfg.as_of, source_url=cfg.source)
    return summary
