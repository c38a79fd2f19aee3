"""Run summary from the records: throughput, latency percentiles, goodput, errors, and the three hit rates.

Everything here is computed from `requests.parquet` alone (plus the metrics deltas), so anyone can recompute
the summary from the published records and get the same numbers.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from kvscope.harness.results.goodput import goodput

PERCENTILES = (50, 90, 95, 99)


def _pcts(values: np.ndarray) -> dict[str, float | None]:
    values = values[~np.isnan(values)] if len(values) else values
    if not len(values):
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    out: dict[str, float | None] = {"count": int(len(values)), "mean": float(np.mean(values))}
    for p, v in zip(PERCENTILES, np.percentile(values, PERCENTILES)):
        out[f"p{p}"] = float(v)
    return out


def latency_stats(ok: pd.DataFrame) -> dict[str, Any]:
    itl = np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_s"]]) if len(ok) else np.zeros(0)
    return {
        "ttft_s": _pcts(ok["ttft_s"].to_numpy(float)),
        "tpot_s": _pcts(ok["tpot_s"].dropna().to_numpy(float)),
        "itl_s": _pcts(itl),
        "e2e_s": _pcts(ok["e2e_s"].to_numpy(float)),
    }


def _ratio(num: float, den: float) -> float | None:
    return float(num) / float(den) if den else None


def hit_rates(ok: pd.DataFrame, deltas: dict[str, Any], prefix_caching: bool | None) -> dict[str, Any]:
    """Hit rate three ways. With prefix caching off the server should report 0 for every request, so that is
    the prediction checked request by request; the simulator's figure becomes `would_hit`."""
    prompt = float(ok["prompt_tokens"].sum())
    server = ok["cached_tokens"].dropna()
    simulated = ok["predicted_cached_tokens"].dropna()
    server_rate = _ratio(float(server.sum()), float(ok.loc[server.index, "prompt_tokens"].sum()))
    simulated_rate = _ratio(float(simulated.sum()), float(ok.loc[simulated.index, "prompt_tokens"].sum()))
    metrics_rate = deltas.get("prefix_cache_hit_rate") if deltas else None
    both = ok.dropna(subset=["cached_tokens", "predicted_cached_tokens"])
    caching_off = prefix_caching is False
    expected = 0 if caching_off else both["predicted_cached_tokens"]
    mismatches = int((both["cached_tokens"] != expected).sum())
    predicted_rate = (0.0 if simulated_rate is not None else None) if caching_off else simulated_rate
    out: dict[str, Any] = {
        "prompt_tokens": int(prompt),
        "server_cached_tokens": int(server.sum()),
        "predicted_cached_tokens": 0 if caching_off else int(simulated.sum()),
        "server_per_request": server_rate,
        "predicted": predicted_rate,
        "metrics_counters": metrics_rate,
        "metrics_hits": deltas.get("prefix_cache_hits") if deltas else None,
        "metrics_queries": deltas.get("prefix_cache_queries") if deltas else None,
        "predicted_minus_server": None if predicted_rate is None or server_rate is None else predicted_rate - server_rate,
        "server_minus_metrics": None if metrics_rate is None or server_rate is None else server_rate - metrics_rate,
        "requests_compared": int(len(both)),
        "requests_predicted_exactly": int(len(both) - mismatches),
    }
    if caching_off:
        out["would_hit"] = simulated_rate
        out["would_hit_cached_tokens"] = int(simulated.sum())
    return out


def summarize(records: pd.DataFrame, deltas: dict[str, Any], duration_s: float, prefix_caching: bool | None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              weights_random: bool | None = None) -> dict[str, Any]:
    """The summary.json body. Latency and hit statistics use successful requests inside the window."""
    window = records[records["in_window"].astype(bool)] if len(records) else records
    ok = window[window["error_class"].isna()]
    failed = window[window["error_class"].notna()]
    errors_by_class = {str(k): int(v) for k, v in failed["error_class"].value_counts().items()}
    out_tokens = float(ok["output_tokens"].sum())
    summary: dict[str, Any] = {
        "requests": {
            "sent": int(len(records)),
            "in_window": int(len(window)),
            "ok": int(len(ok)),
            "failed": int(len(failed)),
            "error_rate": _ratio(len(failed), len(window)),
            "errors_by_class": errors_by_class,
            "retries": int((records["attempt"] > 0).sum()) if len(records) else 0,
            "length_mismatch": int(ok["length_mismatch"].astype(bool).sum())
            if len(ok) and "length_mismatch" in ok else 0,
            "errors_by_status": {str(int(k)): int(v) for k, v in failed["http_status"].dropna().value_counts().items()},
        },
        "duration_s": duration_s,
        "throughput": {
            "requests_per_s": _ratio(len(ok), duration_s),
            "output_tokens_per_s": _ratio(out_tokens, duration_s),
            "prompt_tokens_per_s": _ratio(float(ok["prompt_tokens"].sum()), duration_s),
        },
        "latency": latency_stats(ok),
        "goodput": goodput(ok, duration_s, slo_ttft_ms, slo_tpot_ms),
        "hit_rate": hit_rates(ok, deltas, prefix_caching),
        "speculative": None,
        "server_deltas": deltas or None,
    }
    if deltas and deltas.get("spec_decode_num_drafts"):
        summary["speculative"] = {
            "acceptance_rate": deltas.get("spec_acceptance_rate"),
            "mean_acceptance_length": deltas.get("spec_mean_acceptance_length"),
            "acceptance_by_position": deltas.get("spec_acceptance_by_position"),
            "drafts": deltas.get("spec_decode_num_drafts"),
            "weights_random": weights_random,
            "note": ("random weights: greedy output repeats itself, so n-gram drafts are accepted far more often "
                     "than with a real model") if weights_random else None,
        }
    return _clean(summary)


def _clean(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, np.generic):
        return _clean(x.item())
    return x
