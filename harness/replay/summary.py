"""Run summary from the records: throughput, latency percentiles, goodput, errors, and the three hit rates.

Everything here is computed from `requests.parquet` alone (plus the metrics deltas), so anyone can recompute
the summary from the published records and get the same numbers.

Each entry of summary.json is one :class:`SummaryMetric` class with a dotted ``tag`` (its place in the file:
``latency.ttft_s``, ``throughput.requests_per_s``, ``hit_rate``), registered with ``@summary_metric``, as in
AIPerf. :func:`summarize` builds one :class:`RunView` and fills the summary from the registry in registration
order, so adding a metric is one class in one file; the entries that are computed together (the request counts,
the three hit rates, goodput) stay one metric each, because their parts share one computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

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


@dataclass(frozen=True)
class RunView:
    """What every summary metric reads: the records, their measured window and the run's settings."""

    records: pd.DataFrame
    window: pd.DataFrame  # records inside the warm-up/cool-down window
    ok: pd.DataFrame  # successful requests in the window
    failed: pd.DataFrame  # failed requests in the window
    deltas: dict[str, Any]  # /metrics counter deltas over the run
    duration_s: float
    prefix_caching: bool | None
    slo_ttft_ms: float | None
    slo_tpot_ms: float | None
    weights_random: bool | None
    client_cpu_utilization: float | None = None  # the replay client's CPU seconds per wall second
    client_stalls: int | None = None  # times the client's event loop woke > CLIENT_STALL_S late (None: not probed)
    cache_not_reset: str | None = None  # why the prefix cache could not be emptied before the run (None: it was)
    scrape_times_s: tuple[float, ...] = ()  # when /metrics was scraped (s from the run's start, all endpoints)
    scrape_interval_s: float | None = None  # the scrape period asked for


CLIENT_SATURATED_CPU_SHARE = 0.9
"""Above this share of one core the replay client queues its own work, and latencies include that queueing."""
BURST_TOLERANCE = (0.001, 0.02)
"""An answer arrived in one burst when e2e − TTFT ≤ 1 ms + 2 % of e2e: its tokens came together, so TTFT is
the whole generation and TPOT/ITL say nothing about decoding."""
ZERO_GAP_ITL_S = 1e-4
"""Inter-token gaps below 0.1 ms: chunks read from one socket buffer, not separate decode steps."""


class SummaryMetric:
    """One entry of summary.json: ``tag`` is its dotted path in the file, ``compute`` its value."""

    tag: ClassVar[str]

    def compute(self, run: RunView) -> Any:
        raise NotImplementedError


_METRICS: dict[str, type[SummaryMetric]] = {}


def summary_metric(cls: type[SummaryMetric]) -> type[SummaryMetric]:
    """Register a metric under its ``tag``; summary.json lists metrics in registration order."""
    if cls.tag in _METRICS:
        raise ValueError(f"summary metric {cls.tag!r} is already registered by {_METRICS[cls.tag].__name__}")
    _METRICS[cls.tag] = cls
    return cls


def summary_metrics() -> dict[str, type[SummaryMetric]]:
    return dict(_METRICS)


@summary_metric
class RequestCounts(SummaryMetric):
    tag = "requests"

    def compute(self, run: RunView) -> dict[str, Any]:
        records, window, ok, failed = run.records, run.window, run.ok, run.failed
        return {
            "sent": int(len(records)),
            "in_window": int(len(window)),
            "ok": int(len(ok)),
            "failed": int(len(failed)),
            "error_rate": _ratio(len(failed), len(window)),
            "errors_by_class": {str(k): int(v) for k, v in failed["error_class"].value_counts().items()},
            "retries": int((records["attempt"] > 0).sum()) if len(records) else 0,
            "length_mismatch": int(ok["length_mismatch"].astype(bool).sum())
            if len(ok) and "length_mismatch" in ok else 0,
            "errors_by_status": {str(int(k)): int(v) for k, v in failed["http_status"].dropna().value_counts().items()},
        }


@summary_metric
class Duration(SummaryMetric):
    tag = "duration_s"

    def compute(self, run: RunView) -> float:
        return run.duration_s


@summary_metric
class RequestThroughput(SummaryMetric):
    tag = "throughput.requests_per_s"

    def compute(self, run: RunView) -> float | None:
        return _ratio(len(run.ok), run.duration_s)


@summary_metric
class OutputTokenThroughput(SummaryMetric):
    tag = "throughput.output_tokens_per_s"

    def compute(self, run: RunView) -> float | None:
        return _ratio(float(run.ok["output_tokens"].sum()), run.duration_s)


@summary_metric
class PromptTokenThroughput(SummaryMetric):
    tag = "throughput.prompt_tokens_per_s"

    def compute(self, run: RunView) -> float | None:
        return _ratio(float(run.ok["prompt_tokens"].sum()), run.duration_s)


@summary_metric
class TimeToFirstToken(SummaryMetric):
    tag = "latency.ttft_s"

    def compute(self, run: RunView) -> dict[str, float | None]:
        return _pcts(run.ok["ttft_s"].to_numpy(float))


@summary_metric
class TimePerOutputToken(SummaryMetric):
    tag = "latency.tpot_s"

    def compute(self, run: RunView) -> dict[str, float | None]:
        return _pcts(run.ok["tpot_s"].dropna().to_numpy(float))


@summary_metric
class InterTokenLatency(SummaryMetric):
    tag = "latency.itl_s"

    def compute(self, run: RunView) -> dict[str, float | None]:
        ok = run.ok
        return _pcts(np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_s"]]) if len(ok) else np.zeros(0))


@summary_metric
class EndToEndLatency(SummaryMetric):
    tag = "latency.e2e_s"

    def compute(self, run: RunView) -> dict[str, float | None]:
        return _pcts(run.ok["e2e_s"].to_numpy(float))


@summary_metric
class Goodput(SummaryMetric):
    tag = "goodput"

    def compute(self, run: RunView) -> dict[str, Any] | None:
        return goodput(run.ok, run.duration_s, run.slo_ttft_ms, run.slo_tpot_ms)


@summary_metric
class HitRates(SummaryMetric):
    tag = "hit_rate"

    def compute(self, run: RunView) -> dict[str, Any]:
        return hit_rates(run.ok, run.deltas, run.prefix_caching)


@summary_metric
class Speculative(SummaryMetric):
    tag = "speculative"

    def compute(self, run: RunView) -> dict[str, Any] | None:
        deltas = run.deltas
        if not (deltas and deltas.get("spec_decode_num_drafts")):
            return None
        return {
            "acceptance_rate": deltas.get("spec_acceptance_rate"),
            "mean_acceptance_length": deltas.get("spec_mean_acceptance_length"),
            "acceptance_by_position": deltas.get("spec_acceptance_by_position"),
            "drafts": deltas.get("spec_decode_num_drafts"),
            "weights_random": run.weights_random,
            "note": ("random weights: greedy output repeats itself, so n-gram drafts are accepted far more often "
                     "than with a real model") if run.weights_random else None,
        }


@summary_metric
class DataQuality(SummaryMetric):
    """Can the cell's latencies be trusted? Burst deliveries (TTFT ≈ e2e), zero-gap ITLs, a saturated client,
    a /metrics series too coarse for the run, plus TTFT and TPOT percentiles without the burst answers.
    ``flags`` names what is off (empty: nothing seen)."""

    tag = "data_quality"

    def compute(self, run: RunView) -> dict[str, Any]:
        ok = run.ok
        multi = ok[ok["output_tokens"] > 1] if len(ok) else ok
        abs_tol, rel_tol = BURST_TOLERANCE
        gap = (multi["e2e_s"] - multi["ttft_s"]).to_numpy(float) if len(multi) else np.zeros(0)
        burst = gap <= abs_tol + rel_tol * multi["e2e_s"].to_numpy(float) if len(multi) else np.zeros(0, bool)
        itl = np.concatenate([np.asarray(x, dtype=float) for x in ok["itl_s"]]) if len(ok) else np.zeros(0)
        steady = multi[~burst] if len(multi) else multi
        scrape_gaps = np.diff(np.unique(np.asarray(run.scrape_times_s, float)))
        scrape_gap_s = float(np.median(scrape_gaps)) if len(scrape_gaps) else None
        out: dict[str, Any] = {
            "burst_share": _ratio(int(burst.sum()), len(multi)),
            "zero_gap_itl_share": _ratio(int((itl < ZERO_GAP_ITL_S).sum()), len(itl)),
            "client_cpu_utilization": run.client_cpu_utilization,
            "client_saturated": bool(run.client_cpu_utilization is not None
                                     and run.client_cpu_utilization > CLIENT_SATURATED_CPU_SHARE),
            "scrape_interval_s": run.scrape_interval_s,
            "scrape_gap_s": scrape_gap_s,
            "scrapes": int(len(run.scrape_times_s)),
            "ttft_s_without_bursts": _pcts(steady["ttft_s"].to_numpy(float) if len(steady) else np.zeros(0)),
            "tpot_s_without_bursts": _pcts(steady["tpot_s"].dropna().to_numpy(float) if len(steady)
                                           else np.zeros(0)),
            "cache_not_reset": run.cache_not_reset,
        }
        flags = []
        if (out["burst_share"] or 0) > 0.2:
            flags.append("burst_deliveries")
        if (out["zero_gap_itl_share"] or 0) > 0.2:
            flags.append("zero_gap_itls")
        if out["client_saturated"]:
            flags.append("client_saturated")
        if run.client_stalls:
            flags.append("client_stalls")  # the client was held up: see summary.json client.stall_windows_s
        if run.cache_not_reset:
            flags.append("cache_not_reset")  # a warm cache: predicted != measured hits, TTFTs those of a warm cache
        if run.duration_s and (scrape_gap_s is None or run.duration_s / scrape_gap_s < 5):
            flags.append("coarse_metrics_scrapes")  # fewer than 5 scrapes over the run: no time series to read
        out["flags"] = flags
        return out


@summary_metric
class ServerDeltas(SummaryMetric):
    tag = "server_deltas"

    def compute(self, run: RunView) -> dict[str, Any] | None:
        return run.deltas or None


def summarize(records: pd.DataFrame, deltas: dict[str, Any], duration_s: float, prefix_caching: bool | None,
              slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None,
              weights_random: bool | None = None, client_cpu_utilization: float | None = None,
              client_stalls: int | None = None, cache_not_reset: str | None = None,
              scrape_times_s: tuple[float, ...] = (), scrape_interval_s: float | None = None) -> dict[str, Any]:
    """The summary.json body: every registered metric at its tag. Latency and hit statistics use successful
    requests inside the window."""
    window = records[records["in_window"].astype(bool)] if len(records) else records
    run = RunView(records=records, window=window, ok=window[window["error_class"].isna()],
                  failed=window[window["error_class"].notna()], deltas=deltas, duration_s=duration_s,
                  prefix_caching=prefix_caching, slo_ttft_ms=slo_ttft_ms, slo_tpot_ms=slo_tpot_ms,
                  weights_random=weights_random, client_cpu_utilization=client_cpu_utilization,
                  client_stalls=client_stalls, cache_not_reset=cache_not_reset,
                  scrape_times_s=tuple(scrape_times_s), scrape_interval_s=scrape_interval_s)
    summary: dict[str, Any] = {}
    for tag, metric in _METRICS.items():
        *parents, leaf = tag.split(".")
        node = summary
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = metric().compute(run)
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
