"""summary.json is assembled from one class per metric, found by tag: the layout and values of a summary, and a
metric registered here (one class) appearing at its tag."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from kvscope.harness.results import summary as S


def _records(n: int = 40, seed: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    err = np.where(rng.random(n) < 0.2, "http_503", None)
    return pd.DataFrame({
        "in_window": rng.random(n) < 0.9, "error_class": err, "attempt": rng.integers(0, 2, n),
        "http_status": np.where(err == None, 200, 503), "length_mismatch": rng.random(n) < 0.1,  # noqa: E711
        "output_tokens": rng.integers(1, 50, n), "prompt_tokens": rng.integers(100, 900, n),
        "ttft_s": rng.random(n), "tpot_s": np.where(rng.random(n) < 0.2, np.nan, rng.random(n) / 10),
        "itl_s": [list(rng.random(3) / 10) for _ in range(n)], "e2e_s": rng.random(n) + 1,
        "cached_tokens": rng.integers(0, 100, n).astype(float), "predicted_cached_tokens": rng.integers(0, 100, n) * 1.0,
    })


def test_summary_layout_and_values():
    rec = _records()
    deltas = {"prefix_cache_hit_rate": 0.5, "spec_decode_num_drafts": 10, "spec_acceptance_rate": 0.3}
    s = S.summarize(rec, deltas, 20.0, True, slo_ttft_ms=500, weights_random=True)
    assert list(s) == ["requests", "duration_s", "throughput", "latency", "goodput", "hit_rate", "speculative",
                       "data_quality", "server_deltas"]
    assert list(s["latency"]) == ["ttft_s", "tpot_s", "itl_s", "e2e_s"]
    ok = rec[rec.in_window & rec.error_class.isna()]
    assert s["requests"]["ok"] == len(ok) and s["requests"]["sent"] == len(rec)
    assert s["throughput"]["requests_per_s"] == pytest.approx(len(ok) / 20.0)
    assert s["latency"]["ttft_s"]["p50"] == pytest.approx(float(np.median(ok.ttft_s)))
    assert s["latency"]["itl_s"]["count"] == 3 * len(ok)
    assert s["goodput"]["requests_meeting_slo"] == int((ok.ttft_s * 1000 <= 500).sum())
    assert s["speculative"]["acceptance_rate"] == 0.3 and s["server_deltas"] == deltas
    empty = S.summarize(rec.iloc[0:0], {}, 0.0, None)
    assert empty["speculative"] is None and empty["throughput"]["requests_per_s"] is None
    assert empty["latency"]["ttft_s"]["count"] == 0


def test_a_registered_metric_appears_at_its_tag(monkeypatch):
    monkeypatch.setattr(S, "_METRICS", dict(S._METRICS))

    @S.summary_metric
    class MaxPrompt(S.SummaryMetric):
        tag = "throughput.max_prompt_tokens"
        output = int

        def compute(self, run):
            return int(run.ok["prompt_tokens"].max())

    rec = _records()
    s = S.summarize(rec, {}, 10.0, True)
    assert s["throughput"]["max_prompt_tokens"] == int(rec[rec.in_window & rec.error_class.isna()].prompt_tokens.max())
    with pytest.raises(ValueError, match="already registered"):
        S.summary_metric(type("Again", (S.SummaryMetric,), {"tag": "hit_rate", "output": int}))


def test_data_quality_flags_burst_answers_zero_gaps_a_saturated_client_and_coarse_scrapes():
    n = 10
    burst = np.arange(n) < 4  # 4 of 10 answers: every token in the first chunk
    rec = pd.DataFrame({
        "in_window": True, "error_class": None, "attempt": 0, "http_status": 200, "length_mismatch": False,
        "output_tokens": 20, "prompt_tokens": 100, "ttft_s": np.where(burst, 0.5, 0.1),
        "tpot_s": np.where(burst, 0.0, 0.02), "e2e_s": 0.5,
        "itl_s": [[0.0, 0.0] if b else [0.02, 0.02] for b in burst],
        "cached_tokens": 0.0, "predicted_cached_tokens": 0.0})
    dq = S.summarize(rec, {}, 10.0, True, client_cpu_utilization=0.95, scrape_times_s=(0.0, 5.0, 10.0),
                     scrape_interval_s=1.0)["data_quality"]
    assert dq["burst_share"] == pytest.approx(0.4) and dq["zero_gap_itl_share"] == pytest.approx(0.4)
    assert dq["ttft_s_without_bursts"]["count"] == 6 and dq["ttft_s_without_bursts"]["p90"] == pytest.approx(0.1)
    assert dq["scrape_gap_s"] == 5.0 and dq["client_saturated"]
    assert dq["flags"] == ["burst_deliveries", "zero_gap_itls", "client_saturated", "coarse_metrics_scrapes"]
    clean = S.summarize(rec[~burst], {}, 10.0, True, client_cpu_utilization=0.2,
                        scrape_times_s=tuple(np.arange(11.0)), scrape_interval_s=1.0)["data_quality"]
    assert clean["flags"] == [] and clean["burst_share"] == 0
