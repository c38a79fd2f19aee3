"""The A/B verdicts detect real shifts and stay quiet on noise."""

import numpy as np
import pandas as pd

from kvscope.harness.analysis.ab import compare_runs


def _run(rng, n=400, ttft_scale=1.0, hit=0.8, seed_noise=0.05):
    prompt = rng.integers(500, 3000, n)
    base_ttft = rng.lognormal(-3, 0.4, n)
    return pd.DataFrame({
        "request_id": np.arange(n), "attempt": 0, "in_window": True, "error_class": None,
        "ttft_s": base_ttft * ttft_scale * rng.lognormal(0, seed_noise, n),
        "tpot_s": rng.lognormal(-5, 0.2, n), "e2e_s": base_ttft * 3, "prompt_tokens": prompt,
        "cached_tokens": (prompt * hit).astype(int), "output_tokens": 32,
        "sent_s": np.arange(n) * 0.01, "done_s": np.arange(n) * 0.01 + 0.05,
    })


def test_same_traffic_twice_is_not_significant():
    rng = np.random.default_rng(0)
    a = _run(np.random.default_rng(1))
    b = a.copy()
    b["ttft_s"] = a["ttft_s"] * rng.lognormal(0, 0.05, len(a))
    t = compare_runs(a, b, resamples=500).set_index("metric")
    assert t.loc["ttft_p50_s", "verdict"] == "no significant difference"
    assert t.loc["hit_rate", "verdict"] == "no significant difference"


def test_slower_and_less_cached_b_is_worse_and_faster_b_is_better():
    a = _run(np.random.default_rng(1))
    slow = a.copy()
    slow["ttft_s"] = a["ttft_s"] * 1.3
    slow["cached_tokens"] = (a["prompt_tokens"] * 0.5).astype(int)
    t = compare_runs(a, slow, resamples=500).set_index("metric")
    assert t.loc["ttft_p50_s", "verdict"] == "worse" and t.loc["ttft_p50_s", "ci_low"] > 0
    assert t.loc["hit_rate", "verdict"] == "worse" and t.loc["hit_rate", "ci_high"] < 0
    assert t.loc["cost_prefill_units_per_request", "verdict"] == "worse"
    t2 = compare_runs(slow, a, resamples=500).set_index("metric")
    assert t2.loc["ttft_p50_s", "verdict"] == "better" and t2.loc["hit_rate", "verdict"] == "better"


def test_tiny_but_consistent_shift_is_below_the_minimum_effect():
    a = _run(np.random.default_rng(1), seed_noise=0.0)
    b = a.copy()
    b["ttft_s"] = a["ttft_s"] * 1.02  # 2 %: the interval excludes 0, the effect is below 5 %
    t = compare_runs(a, b, resamples=300).set_index("metric")
    assert t.loc["ttft_p50_s", "ci_low"] > 0
    assert t.loc["ttft_p50_s", "verdict"] == "no significant difference"
