"""What the report's charts, cost framing and verdict table state, on small constructed experiments where the old
code stated the wrong thing: a throughput summed across workloads, a habit priced against "no caching", output
tokens in an input $/Mtok, a "saves" title over a cost increase, a capacity plan without its tp degree, a verdict
resting on an outlier repeat without a flag, a forest axis stretched by one row, a table cut by pandas."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import common
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.ab import outlier_repeats
from kvscope.harness.analysis.notebook import table_html
from kvscope.harness.analysis.pages import ab_compare, concurrency, cost, hit_rates
from kvscope.workloads.trace import TraceBuilder

from tests.test_findings import _cell, _results


# ---- latency against throughput: like for like ------------------------------------------------------------
def test_latency_throughput_is_per_workload_and_never_sums_cells_of_different_workloads():
    """Old: c2's point summed the cells of three workloads (one of them at 0 % hit) while c1 was one workload, so
    the chart said a configuration "delivers the most tokens/s" at c2 by the sum alone."""
    cells = [_cell("apc", "sweep", "c1", hit=0.8, ttft_s=0.03, tok_per_s=100.0),
             _cell("apc", "coding", "c2", hit=0.8, ttft_s=0.03, tok_per_s=80.0),
             _cell("apc", "coding-ts", "c2", hit=0.0, ttft_s=0.05, tok_per_s=40.0, seed=1),
             _cell("apc", "sweep", "c2", hit=0.8, ttft_s=0.04, tok_per_s=60.0, seed=2)]
    t = common.latency_throughput(_results(cells))
    got = {(r.workload, r.load): r.output_tok_per_s for r in t.itertuples()}
    assert got == {("sweep", "c1"): 100.0, ("sweep", "c2"): 60.0, ("coding", "c2"): 80.0, ("coding-ts", "c2"): 40.0}
    assert t["output_tok_per_s"].max() == 100.0  # never 180 (the c2 cells summed)
    assert set(t.columns) >= {"goodput_req_per_s", "goodput_fraction", "ttft_p90_ms", "repeats"}


def test_latency_throughput_averages_repeats_of_one_cell():
    cells = []
    for k, tps in enumerate((90.0, 110.0)):
        row, rec = _cell("apc", "sweep", "c1", hit=0.8, ttft_s=0.03, tok_per_s=tps, seed=k)
        row["repeat"], row["cell"] = k, f"apc__sweep__c1__r{k}"
        cells.append((row, rec.assign(repeat=k, cell=row["cell"])))
    [r] = common.latency_throughput(_results(cells)).itertuples()
    assert (r.output_tok_per_s, r.repeats) == (100.0, 2)


# ---- cost framing ------------------------------------------------------------------------------------------
SYSTEM_TOKENS = 1500  # above every preset's minimum cacheable prefix
STEP_TOKENS = 300


def _write_trace(path: Path, sessions: int, steps: int, timestamp: bool, seed: int) -> None:
    """Append-only agent sessions on a shared system prompt; ``timestamp``: a fresh token at the very start of
    every request (nothing after it can be read from a cache)."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    system = b.add_segment(rng.integers(100, 5000, SYSTEM_TOKENS).astype(np.int32), "system")
    clock = 0
    for s in range(sessions):
        history: list[int] = []
        parent = -1
        for step in range(steps):
            history.append(b.add_segment(rng.integers(100, 5000, STEP_TOKENS).astype(np.int32), "user"))
            head = [b.add_segment(np.array([5000 + clock], np.int32), "volatile")] if timestamp else []
            clock += 1
            parent = b.add_request(session_id=f"s{s}", step=step, parent_request_id=parent,
                                   arrival_s=float(10 * s + step), prompt_segment_ids=head + [system, *history],
                                   output_tokens=50, think_time_s=1.0,
                                   transition="first" if step == 0 else "append")
    b.build({"name": path.name}).write(path)


@pytest.fixture(scope="module")
def priced(tmp_path_factory):
    """An experiment whose append-only workload and its timestamped habit have traces on disk."""
    root = tmp_path_factory.mktemp("priced")
    for name, ts in (("agent", False), ("agent-ts", True)):
        _write_trace(root / "traces" / name, sessions=4, steps=5, timestamp=ts, seed=0)
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03),
                    _cell("apc", "agent-ts", "c1", hit=0.0, ttft_s=0.06, seed=1)],
                   pricing=["anthropic-sonnet-5m", "openai-gpt-4.1"], tmp=root)
    res.experiment.traces.update({"agent": "traces/agent", "agent-ts": "traces/agent-ts"})
    return res


def test_a_habit_is_priced_against_its_append_only_reference_not_against_no_caching(priced):
    pc = cost.provider_costs(priced, ["anthropic-sonnet-5m"]).set_index("workload")
    ref, hab = pc.loc["agent", "usd_per_1000_sessions"], pc.loc["agent-ts", "usd_per_1000_sessions"]
    change = cost.habit_cost_change(priced, "agent", "agent-ts", "anthropic-sonnet-5m")
    assert change == pytest.approx({"reference_usd_per_1000_sessions": ref, "habit_usd_per_1000_sessions": hab,
                                    "change": hab / ref - 1})
    # the old framing's number (the habit against no caching) is a different one
    assert change["change"] != pytest.approx(pc.loc["agent-ts", "caching_change"], abs=0.02)
    [f] = hit_rates.habit_findings(priced, resamples=100)
    assert f"costs ${hab:,.2f} vs ${ref:,.2f} per 1,000 sessions on anthropic-sonnet-5m" in f.sentence
    assert f"({(hab / ref - 1) * 100:+.0f} % against agent)" in f.sentence
    assert "no caching" not in f.sentence
    assert f.numbers["cost_change_vs_reference"] == pytest.approx(hab / ref - 1)
    table = cost.habit_costs(priced, ["anthropic-sonnet-5m"])
    assert table[["habit", "reference"]].values.tolist() == [["agent-ts", "agent"]]
    sentences = [x.sentence for x in F.page_findings(priced, "cost")]
    assert any(s.startswith(f"agent-ts costs ${hab:,.2f} vs ${ref:,.2f} per 1,000 sessions of agent") for s in sentences)


def test_input_dollars_per_million_input_tokens_leave_output_out(priced):
    """Old: the input metric divided the whole bill, output included, by the input tokens. With nothing read from
    the cache and no write premium (the timestamped habit on OpenAI) it must be exactly the list input price."""
    from kvscope.harness.pricing.provider_cache import load_preset

    pc = cost.provider_costs(priced, ["openai-gpt-4.1"]).set_index("workload")
    price = load_preset("openai-gpt-4.1").pricing.input_per_mtok
    assert pc.loc["agent-ts", "cache_read_ratio"] == 0
    assert pc.loc["agent-ts", "input_usd_per_mtok_input"] == pytest.approx(price)
    assert pc.loc["agent-ts", "input_usd_per_mtok_input_no_cache"] == pytest.approx(price)
    total_per_input = pc.loc["agent-ts", "cost_usd"] / pc.loc["agent-ts", "input_tokens"] * 1e6
    assert total_per_input > price * 1.01  # what the old metric reported
    assert pc.loc["agent", "input_usd_per_mtok_input"] < price  # cache reads make the input side cheaper


def test_the_cost_title_says_dearer_when_caching_costs_more():
    """Old: "Caching saves least on … (-48 %)" over a 48 % increase."""
    pc = pd.DataFrame({"workload": ["a", "a-ts"], "preset": ["p", "p"], "caching_change": [-0.3, 0.48]})
    title = cost.caching_change_title(pc)
    assert "costs 48 % more than no caching on a-ts with p" in title and "saves" not in title
    saving = cost.caching_change_title(pc.assign(caching_change=[-0.6, -0.3]))
    assert saving == "Caching saves least on a-ts with p: 30 % cheaper than no caching"


def test_self_hosted_cost_carries_the_hourly_rate_it_follows_from():
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03, tok_per_s=500.0)])
    [row] = cost.self_hosted_costs(res, hourly_usd=3.5, hardware="one H100 80GB").to_dict("records")
    assert (row["hourly_usd"], row["hardware"]) == (3.5, "one H100 80GB")
    assert row["usd_per_mtok_output"] == pytest.approx(3.5 / 3600 / 500 * 1e6)


def test_the_capacity_plan_keeps_the_tensor_parallel_degree():
    plan = concurrency.capacity_planning(contexts=(8192,), models=("llama-3.1-8b", "llama-3.1-70b"),
                                         kv_dtypes=("bfloat16",))
    pivot = concurrency.capacity_planning_pivot(plan)
    assert "tp" in pivot.index.names
    assert {(m, tp) for m, tp, *_ in pivot.index} == {("llama-3.1-8b", 1), ("llama-3.1-70b", 4)}


# ---- outlier repeats ---------------------------------------------------------------------------------------
def test_the_outlier_rule_needs_three_repeats_and_a_real_gap():
    assert outlier_repeats([17.6, 17.8, 28.7]).tolist() == [False, False, True]
    assert outlier_repeats([17.6, 28.7]).tolist() == [False, False]  # two: neither is the odd one
    assert outlier_repeats([17.6, 17.61, 18.5]).tolist() == [False] * 3  # 5 % off: noise, however small the MAD
    assert outlier_repeats([17.6, math.nan, 17.7, 40.0]).tolist() == [False, False, False, True]


def _repeats(server: str, tpot_s: list[float], tok_per_s: float) -> list:
    out = []
    for k, tpot in enumerate(tpot_s):
        row, rec = _cell(server, "agent", "c2", hit=0.8, ttft_s=0.03, tok_per_s=tok_per_s, seed=10 * k + len(server))
        name = f"{server}__agent__c2__r{k}"
        row.update(repeat=k, cell=name, tpot_p50_s=tpot)
        out.append((row, rec.assign(repeat=k, cell=name, tpot_s=tpot)))
    return out


@pytest.fixture(scope="module")
def noisy():
    """B's repeat 1 ran on a busy host: its TPOT is 28.7 ms against 17.6 ms in the other repeats."""
    return _results(_repeats("base", [0.0175, 0.0176, 0.0177], 100.0) + _repeats("ngram", [0.0176, 0.0287, 0.0175], 140.0))


def test_an_outlier_repeat_is_flagged_with_its_cell_and_metric(noisy):
    spread = ab_compare.repeat_spread(noisy)
    bad = spread[spread["outlier"]]
    assert set(zip(bad["server"], bad["repeat"], bad["metric"])) >= {("ngram", 1, "tpot_p50_s")}
    assert not len(bad[bad["server"] == "base"])
    row = bad[(bad["metric"] == "tpot_p50_s")].iloc[0]
    assert row["value"] == pytest.approx(0.0287) and row["median"] == pytest.approx(0.0176)


def test_a_verdict_resting_on_an_outlier_repeat_carries_a_flag_and_the_page_a_host_noise_caveat(noisy):
    table = ab_compare.ab_table(noisy, resamples=200)
    tpot = table[table["metric"] == "tpot_p50_s"].iloc[0]
    assert tpot["data_quality"].startswith("outlier repeat: B r1 +63 % vs median")
    assert (table[table["metric"] == "hit_rate"]["data_quality"] == "").all()
    pivot = ab_compare.verdict_pivot(table)
    assert pivot.iloc[0]["tpot_p50_s"].endswith(" ⚑")
    assert not pivot.iloc[0]["hit_rate"].endswith("⚑")
    caveats = [f for f in F.page_findings(noisy, "ab_compare", ab=table) if f.question == "caveat"]
    [c] = [f for f in caveats if "outlier" in f.sentence or "far from the other repeats" in f.sentence]
    assert "ngram · agent · c2 repeat 1: tpot_p50_s 28.7 ms against a median of 17.6 ms" in c.sentence
    assert "host was busy" in c.sentence


def test_repeats_that_agree_flag_nothing():
    res = _results(_repeats("base", [0.0175, 0.0176, 0.0177], 100.0) + _repeats("ngram", [0.0170, 0.0172, 0.0171], 140.0))
    assert not ab_compare.repeat_spread(res)["outlier"].any()
    assert not any("far from the other repeats" in f.sentence for f in F.page_findings(res, "ab_compare", resamples=100))


# ---- forest plot and tables --------------------------------------------------------------------------------
def test_the_forest_axis_is_not_stretched_by_one_huge_interval():
    """Old: the axis ran to +600 % for one row and squashed every other row to a dot."""
    rows = [{"A": "a", "B": "b", "workload": "w", "load": "c1", "metric": m, "a": 0.1, "diff": d, "ci_low": lo,
             "ci_high": hi, "verdict": "inconclusive", "data_quality": ""}
            for m, d, lo, hi in (("ttft_p50_s", 0.01, -0.005, 0.02), ("tpot_p50_s", 0.3, 0.1, 0.6),
                                 ("e2e_p50_s", -0.02, -0.03, -0.01))]
    v, limit = ab_compare.forest_rows(pd.DataFrame(rows))
    assert limit == ab_compare.FOREST_MAX_PCT
    assert v["clipped_high"].tolist() == [False, True, False] and v["hi_pct"].iloc[1] == pytest.approx(600)
    v, limit = ab_compare.forest_rows(pd.DataFrame([rows[0], rows[2]]))
    assert limit == pytest.approx(34.5) and not v["clipped_high"].any()  # 1.15 x the widest interval end (-30 %)


def test_the_forest_bars_are_never_negative_when_the_interval_misses_the_estimate():
    """Found by the integration run: a bootstrap interval that does not contain the point estimate made matplotlib
    refuse the figure ("'xerr' must not contain negative values") and the whole A/B page failed."""
    rows = [{"A": "a", "B": "b", "workload": "w", "load": "c1", "metric": "ttft_p50_s", "a": 0.1, "diff": d,
             "ci_low": lo, "ci_high": hi, "verdict": "inconclusive", "data_quality": ""}
            for d, lo, hi in ((0.02, -0.01, 0.01), (-0.02, -0.01, 0.01), (0.9, 0.01, 0.02), (0.01, None, None))]
    v, limit = ab_compare.forest_rows(pd.DataFrame(rows))
    assert (v["err_low_pct"] >= 0).all() and (v["err_high_pct"] >= 0).all()
    assert v["err_low_pct"].iloc[0] == pytest.approx(30) and v["err_high_pct"].iloc[0] == 0  # bar from the point
    assert v["plot_pct"].abs().max() <= limit


def test_a_table_shows_every_row_and_column_escaped_with_wrapping_headers():
    df = pd.DataFrame({f"column_number_{i}": np.arange(100) * i for i in range(25)})
    df["server"] = "<script>x</script>"
    html = table_html(df)
    assert html.count("<tr") == 100 + 1 and "rows ×" not in html
    assert "&lt;script&gt;x&lt;/script&gt;" in html and "<script>" not in html
    assert "column_<wbr>number_<wbr>24" in html and 'class="kvs-table"' in html
    ids = table_html(pd.DataFrame({"cell": ["base__agent-coding__c2__r0"], "why": ["a long reason, " * 4]}))
    assert "<td>base_<wbr>_<wbr>agent-coding_<wbr>_<wbr>c2_<wbr>_<wbr>r0</td>" in ids and 'class="kvs-prose"' in ids


def test_the_findings_file_carries_the_flag_to_the_index_pivot(noisy, tmp_path):
    from kvscope.harness.report.summary import findings_html
    from kvscope.harness.results.findings_file import FINDINGS_NAME, load_findings_file

    fig = tmp_path / "figures" / "ab_compare"
    fig.mkdir(parents=True)
    F.write_page_findings(noisy, "ab_compare", fig, ab=ab_compare.ab_table(noisy, resamples=200))
    cells = {v.metric: v for v in load_findings_file(fig / FINDINGS_NAME).verdicts}
    assert cells["tpot_p50_s"].data_quality.startswith("outlier repeat: B r1")
    assert cells["hit_rate"].data_quality is None
    page = findings_html(tmp_path, ["ab_compare"])
    assert page.count("⚑</span>") == 1  # the tpot verdict only (the caveat names the mark too)
    assert "<table" not in table_html(pd.DataFrame()) and "no data" in table_html(pd.DataFrame())
