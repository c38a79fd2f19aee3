"""A compared metric is one class: registered once (results/summary.py), it is in summary.json, the A/B verdict
table, the early-stopping rule, the A/B page's pivot and the claims; and "TTFT p50" is one number in all of
them (one percentile definition, the same requests)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import claims as C
from kvscope.harness.analysis import sequential as Q
from kvscope.harness.analysis.ab import Run, compare, run_statistics
from kvscope.harness.analysis.pages import ab_compare
from kvscope.harness.experiment.spec import RepeatsSpec
from kvscope.harness.results import summary as S
from kvscope.harness.results.summary import Use, compared_statistics

from tests.test_claims import _results, _spec_cells, traces  # noqa: F401 (traces: the claims' fixture)

ALL_USES = Use.VERDICT | Use.SEQUENTIAL | Use.PIVOT | Use.FOREST | Use.SPREAD | Use.HEADLINE


def _run_records(seed: int, n: int = 120, ttft_scale: float = 1.0) -> pd.DataFrame:
    """One run's records with what makes the statistics differ when two readers select differently: failed and
    out-of-window requests, a retry that succeeded, TPOTs missing (one-token answers), cached tokens unreported."""
    rng = np.random.default_rng(seed)
    err = np.where(rng.random(n) < 0.1, "http_503", None)
    attempt = np.where(rng.random(n) < 0.1, 1, 0)
    cached = rng.integers(0, 400, n).astype(float)
    cached[rng.random(n) < 0.15] = np.nan
    ttft = rng.lognormal(-3, 0.5, n) * ttft_scale
    return pd.DataFrame({
        "request_id": np.arange(n), "session_id": [f"s{k % 12}" for k in range(n)], "step": np.arange(n) // 12,
        "attempt": attempt, "in_window": rng.random(n) < 0.92, "error_class": err,
        "http_status": np.where(err == None, 200, 503), "length_mismatch": False,
        "prompt_tokens": rng.integers(400, 900, n), "cached_tokens": cached, "predicted_cached_tokens": cached,
        "output_tokens": rng.integers(1, 60, n), "ttft_s": ttft,
        "tpot_s": np.where(rng.random(n) < 0.2, np.nan, rng.lognormal(-5, 0.3, n)),
        "e2e_s": ttft + rng.lognormal(-1, 0.4, n), "itl_s": [[0.01, 0.02]] * n,
        "sent_s": np.sort(rng.random(n) * 30), "done_s": np.sort(rng.random(n) * 30) + 1.0,
    })


def _summary(records: pd.DataFrame) -> tuple[dict, object]:
    body = S.summarize(records, {}, 30.0, True)
    model = S.summary_file_model().model_validate({**body, "aborted": None, "server_facts": [], "client": {
        "cpu_s": 1.0, "cpu_utilization": 0.1, "cpu_us_per_request": 10.0, "event_loop": None,
        "stale_connection_resends": 0, "saturated": False, "note": None}})
    return body, model


def _figure(body: dict, stat: S.Statistic) -> float | None:
    """The statistic as summary.json states it, read from the JSON body by hand."""
    node = body
    for part in stat.metric.tag.split("."):
        node = node[part]
    if stat.percentile is not None:
        return node[f"p{stat.percentile}"]
    return node["server_per_request"] if stat.metric is S.HitRatesMetric else node


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_ab_engine_the_stopping_rule_and_summary_json_state_one_figure(seed):
    """Each verdict statistic of one run: the A/B engine's point estimate from that run alone (what a verdict
    and the repeat-spread panel use), the stopping rule's per-repeat value and summary.json's figure are one
    number, to the last bit (before, the A/B engine used inverted-CDF percentiles over first attempts, and a hit
    rate that counted unreported cached tokens as 0)."""
    records = _run_records(seed)
    body, model = _summary(records)
    point = run_statistics([Run("r", records, summary=model)]).set_index("metric")["value"]
    stats = compared_statistics(Use.VERDICT)
    assert {s.kind for s in stats} == {"percentile", "ratio", "per_run"}
    for stat in stats:
        figure = _figure(body, stat)
        assert figure is not None, stat.name
        assert point[stat.name] == figure, stat.name
        if Use.SEQUENTIAL in stat.uses:
            assert Q.run_statistic(model, stat.name) == figure, stat.name


def test_derived_lists_are_the_ones_the_analysis_kept_by_hand():
    """The registry reproduces the lists each reader once spelled (order included: it is the table's)."""
    def names(use: Use) -> list[str]:
        return [s.name for s in compared_statistics(use)]

    assert names(Use.VERDICT) == ["ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "tpot_p90_s",
                                  "e2e_p50_s", "e2e_p90_s", "output_tokens_per_s", "hit_rate"]
    assert Q.sequential_metrics() == ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s", "e2e_p50_s",
                                      "e2e_p90_s", "output_tokens_per_s", "hit_rate")
    assert ab_compare.pivot_metrics() == ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "e2e_p50_s",
                                          "output_tokens_per_s", "hit_rate")
    assert ab_compare.forest_metrics() == ("ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "e2e_p50_s",
                                           "output_tokens_per_s")
    assert ab_compare.spread_metrics() == ("ttft_p50_s", "tpot_p50_s", "e2e_p50_s", "output_tokens_per_s")
    higher = {s.name for s in compared_statistics() if s.metric.higher_is_better}
    assert higher == {"output_tokens_per_s", "hit_rate"}
    assert [s.display for s in compared_statistics(Use.PIVOT)] == ["TTFT p50", "TTFT p90", "TPOT p50", "e2e p50",
                                                                   "output throughput", "hit rate"]


def test_a_percentile_outside_summary_json_is_refused(monkeypatch):
    monkeypatch.setattr(S, "_METRICS", dict(S._METRICS))

    @S.summary_metric
    class P75(S._LatencyMetric):
        tag, column, name, header, compared = "latency.p75_s", "ttft_s", "p75_p{q}_s", "P75", {75: Use.VERDICT}

    with pytest.raises(ValueError, match="p75 is not among summary.json's percentiles"):
        compared_statistics()


def test_a_metric_registered_in_one_place_is_in_every_reader(monkeypatch, traces):  # noqa: F811
    """One class, registered here and nowhere else, shows up in summary.json, the A/B verdict table, the
    stopping rule (the spec accepts it, a repeat's value is read, a look decides it), the A/B page's pivot, and
    the speculative claim's list of what got worse."""
    monkeypatch.setattr(S, "_METRICS", dict(S._METRICS))

    @S.summary_metric
    class SlowStart(S._LatencyMetric):
        """Throwaway: the TTFT distribution again, under its own name."""

        tag, column = "slow_start_s", "ttft_s"
        name, header, noise_family, order = "slow_start_p{q}_s", "slow start", "ttft", 15
        compared = {50: ALL_USES}

    # summary.json
    records = _run_records(0)
    body, model = _summary(records)
    ok = records[records["in_window"] & records["error_class"].isna()]
    assert body["slow_start_s"]["p50"] == np.percentile(ok["ttft_s"], 50) == body["latency"]["ttft_s"]["p50"]
    # the stopping rule
    assert "slow_start_p50_s" in Q.sequential_metrics()
    RepeatsSpec(max=4, stop_early=True, metrics=["slow_start_p50_s"])
    assert Q.run_statistic(model, "slow_start_p50_s") == body["slow_start_s"]["p50"]
    a = {"slow_start_p50_s": [0.040, 0.041, 0.039]}
    b = {"slow_start_p50_s": [0.052, 0.053, 0.051]}
    assert Q.look(["slow_start_p50_s"], a, b, Q.SequentialRule(2, 3))["slow_start_p50_s"].word == "worse"
    # the A/B table (its own row, between TTFT and TPOT by its order), the pivot and the claims
    res = _results(traces, _spec_cells(traces, 3, [100.0, 101.0, 102.0], spec_ttft=0.08))
    table = ab_compare.ab_table(res, resamples=200)
    rows = table[table["metric"] == "slow_start_p50_s"]
    assert len(rows) == 1 and rows["verdict"].iloc[0] == "worse"
    metrics = list(dict.fromkeys(table["metric"]))
    assert metrics.index("ttft_p99_s") < metrics.index("slow_start_p50_s") < metrics.index("tpot_p50_s")
    assert "slow_start_p50_s" in ab_compare.verdict_pivot(table).columns
    [claim] = C.speculative_claims(res, table)
    assert "slow start p50 worse (decided)" in claim.worse
    # and a bootstrap of records alone (no summary) computes it too
    t = compare([Run("a", _run_records(1))], [Run("b", _run_records(2, ttft_scale=2.0))], resamples=100)
    assert "slow_start_p50_s" in set(t["metric"])
