"""The report's words, defined once: every page uses these meanings and the index shows them.

Why one module. Two pages once meant two things by one word: "recomputed" excluded a prompt's new tokens on
the explain page and included them on the hit-rate page (compaction: 6,784 tokens against 30 × 1,055), so the
same habit cost two different amounts. Each term here has one definition; a page that needs another quantity
names it with another word (``uncached``), and tables explain their raw column keys from :data:`COLUMNS`.
"""

from __future__ import annotations

import re

__all__ = ["COLUMNS", "TERMS", "column_words", "load_words"]

#: The terms every page uses, in the index's order.
TERMS: dict[str, str] = {
    "hit rate": "cached prompt tokens / prompt tokens, token-weighted over the requests of one configuration, "
                "workload and load level (repeats pooled, and said so). New tokens count in the prompt, so no "
                "workload reaches 100 %.",
    "new tokens": "prompt tokens no earlier request of the trace had (the user's message, a tool's output): "
                  "computed once whatever the cache does.",
    "recomputed": "prompt tokens an earlier request already had (its prompt, or the output the history carries) "
                  "that were computed again because the cache did not serve them. New tokens are never "
                  "recomputed; prompt tokens not served from the cache are 'uncached' (new + recomputed).",
    "uncached": "prompt tokens the server computed in prefill: prompt − cached = new + recomputed.",
    "evicted": "tokens an infinite cache would have served from blocks that were cached and then dropped from "
               "the KV pool; tokens the pool never held are not evicted.",
    "capacity": "the highest load level (concurrent sessions) of one configuration on one workload at which "
                "TTFT p90 meets the SLO with no preemption, among the levels that were measured and driven "
                "(at least 90 % of the level's sessions in flight). Each level runs once; the TTFT p90's 95 % "
                "interval over its sessions says whether a repeat could move the edge.",
    "decided": "an A/B verdict of better, worse or equivalent: its 95 % interval (sessions resampled within "
               "repeats) lies beyond the margin, or inside it. 'better' follows the metric's direction (lower "
               "TTFT, higher throughput). Otherwise inconclusive; a verdict with one run a side is inconclusive.",
    "load level": "c5: a closed loop holding 5 sessions in flight; sweep-c5: the capacity sweep's level of 5; "
                  "r0.5: open-loop arrivals, 0.5 sessions per second; timestamps: the trace's own start times.",
    "pooled": "a figure over several workloads or load levels: a distribution, said in its title, never a "
              "comparison between configurations.",
}

#: Raw column keys as words (tables show the keys: they are what a reader filters on in the CSVs).
COLUMNS: dict[str, str] = {
    "output_tok_per_s": "output tokens per second of the cell",
    "output_tokens_per_s": "output tokens per second (A/B metric)",
    "by_construction": "a verdict fixed by the set-up (e.g. hit rate with caching off is 0), not measured",
    "ttft_p50_ms": "time to first token, median (ms)", "ttft_p90_ms": "time to first token, 90th percentile (ms)",
    "ttft_p90_s": "time to first token, 90th percentile (s)",
    "ttft_p90_ci_low_ms": "lower end of the TTFT p90's 95 % interval over the level's sessions (ms)",
    "ttft_p90_ci_high_ms": "upper end of the TTFT p90's 95 % interval over the level's sessions (ms)",
    "goodput_fraction": "share of requests meeting the SLO", "goodput_req_per_s": "requests per second meeting the SLO",
    "measured": "hit rate the server reported", "predicted_by_simulator": "hit rate kvscope's simulator predicts",
    "would_hit_with_caching": "hit rate the same traffic would get with prefix caching on",
    "hit_server": "hit rate from the server's per-request cached tokens", "hit_metrics": "hit rate from /metrics",
    "hit_predicted": "predicted hit rate", "would_hit": "hit rate with caching on (simulated)",
    "mean_uncached_tokens": "prompt tokens computed in prefill per request (new + recomputed)",
    "sessions_that_fit": "sessions of this context the smallest KV cache holds at once",
    "max_concurrency_at_max_len": "vLLM's figure: requests of max_model_len that fit in the KV cache",
    "meets_slo": "TTFT p90 within the SLO and no preemption", "repeats": "repeats pooled in the row",
    "replays": "cells pooled in the row", "load_value": "the load level's number",
}


def column_words(columns) -> dict[str, str]:
    """The glossary entries of ``columns`` that have one (for a table's legend)."""
    return {str(c): COLUMNS[str(c)] for c in columns if str(c) in COLUMNS}


def load_words(load: str) -> str:
    """A load label in words: ``sweep-c5`` -> ``capacity sweep, 5 sessions in flight``."""
    m = re.fullmatch(r"(sweep-)?c(\d+)", str(load))
    if m:
        return f"{'capacity sweep, ' if m.group(1) else ''}{m.group(2)} sessions in flight (closed loop)"
    m = re.fullmatch(r"r(\d+\.?\d*)", str(load))
    if m:
        return f"open loop, {m.group(1)} sessions per second"
    return "the trace's own start times" if load == "timestamps" else str(load)
