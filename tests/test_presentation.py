"""Words and presentation the report shares across pages (issue 37, points 4 and 6), on constructed data:
one glossary, verdict directions in words, the primer's tokens per pass from the per-position rates, tables
without row numbers or float noise and with their raw keys explained, figures checked for legibility."""

from __future__ import annotations

from types import SimpleNamespace

import pandas as pd
import pytest
from kvscope.harness.analysis import claims as C
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.glossary import TERMS, load_words
from kvscope.harness.analysis.notebook import figure_layout_problems, plt, table_html
from kvscope.harness.analysis.pages import hit_rates, speculative
from kvscope.harness.primer.speculative import expected_tokens_per_pass
from kvscope.harness.results.schemas import ServerEntry

from tests.test_findings import _cell, _results


# ---- one glossary --------------------------------------------------------------------------------------------
def test_the_glossary_defines_each_word_once_and_the_index_shows_it():
    from kvscope.harness.report.render import glossary_html

    assert {"recomputed", "hit rate", "capacity", "evicted", "decided", "uncached"} <= set(TERMS)
    assert "New tokens are never recomputed" in TERMS["recomputed"]
    page = glossary_html()
    assert all(term in page for term in TERMS) and 'id="glossary"' in page
    assert load_words("sweep-c5") == "capacity sweep, 5 sessions in flight (closed loop)"


def test_the_hit_rate_page_calls_prompt_minus_cached_uncached_not_recomputed():
    """'Recomputed' excluded new tokens on explain and included them on hit rates (compaction 6,784 vs 30 × 1,055):
    the hit-rate page's column is now 'uncached' (new + recomputed), the glossary's word for it."""
    res = _results([_cell("apc", "agent", "c1", hit=0.5, ttft_s=0.03)])
    t = hit_rates.invalidation_cost(res)
    assert "mean_uncached_tokens" in t and not any("recomputed" in c for c in t.columns)
    assert t["mean_uncached_tokens"].iloc[0] == 500


# ---- verdicts in words ---------------------------------------------------------------------------------------
def test_a_verdict_direction_is_written_as_words_never_a_bare_sign():
    """Old: 'output throughput -1 % median (better 1, …)' — a minus beside 'better' reads backwards."""
    cells = [_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03, tok_per_s=99.0),
             _cell("off", "agent", "c1", hit=0.8, ttft_s=0.06, caching=False, tok_per_s=100.0, seed=1)]
    [f] = hit_rates.prefix_caching_recommendations(_results(cells), resamples=200)
    assert "% median" not in f.sentence and "TTFT p50 " in f.sentence
    assert "lower with caching on (median of 1; verdicts: " in f.sentence
    claim = C.Claim("speculative:ngram", "inconclusive", "s", {"better": 1.0, "comparisons": 4.0,
                                                              "median_throughput_change": -0.01})
    rec = C.speculative_recommendation(claim).sentence
    assert "output throughput 1 % lower (median)" in rec and "-1 %" not in rec


# ---- the primer's expectation from the per-position rates ---------------------------------------------------
def test_the_primer_uses_the_per_position_rates_and_matches_the_measured_length():
    """vLLM's per-position rates [0.9, 0.8, 0.6, 0.4] give 1 + Σ = 3.70 tokens per pass, the measured length; the
    aggregate rate (0.675) in the independence formula gives 2.96, a gap the page used to call dependence."""
    row, rec = _cell("ngram", "agent", "c1", hit=0.5, ttft_s=0.03, speculative=True, acceptance=0.675)
    row["spec_mean_acceptance_length"] = 3.7
    res = _results([(row, rec)])
    res.experiment.servers["ngram"] = ServerEntry(config={"speculative_config": {"num_speculative_tokens": 4}}, log="")
    res.summaries[row["cell"]] = SimpleNamespace(speculative=SimpleNamespace(acceptance_by_position=[0.9, 0.8, 0.6, 0.4]))
    [r] = speculative.speculation_vs_primer(res).to_dict("records")
    assert r["primer_basis"] == "per-position"
    assert r["primer_tokens_per_pass"] == pytest.approx(3.7) and r["measured_minus_primer"] == pytest.approx(0)
    assert r["independent_tokens_per_pass"] == pytest.approx(expected_tokens_per_pass(0.675, 4))
    assert r["independent_tokens_per_pass"] < 3.0
    assert r["conditional_acceptance"] == "0.90, 0.89, 0.75, 0.67"  # falling: the positions are not independent


def test_the_speculative_title_states_the_claims_median_not_a_mean_over_workloads():
    ab = pd.DataFrame({"A": "base", "B": "ngram", "metric": "output_tokens_per_s",
                       "verdict": ["better", "inconclusive", "inconclusive"], "relative": [0.9, 0.51, 0.2],
                       "workload": ["a", "b", "c"], "load": "c1", "runs_a": 2, "runs_b": 2})
    cells = [_cell("ngram", w, "c1", hit=0.5, ttft_s=0.03, speculative=True, seed=i) for i, w in enumerate("abc")]
    cells += [_cell("base", w, "c1", hit=0.5, ttft_s=0.03, seed=9 + i) for i, w in enumerate("abc")]
    title = speculative.throughput_title(_results(cells), ab)
    assert "ngram: output throughput 51 % higher (median of 3 workload × load comparisons; 1 decided better)" in title
    assert "on average" not in title


# ---- tables --------------------------------------------------------------------------------------------------
def test_a_table_drops_row_numbers_rounds_float_noise_and_explains_its_raw_keys():
    df = pd.DataFrame({"load": ["c2", "sweep-c5", "c4"], "output_tok_per_s": [1.0, 2.0, 3.0],
                       "diff_pp": [-2.22e-16, 1.5, 0.25]}).sort_values("diff_pp")  # index 0, 2, 1: row numbers
    html = table_html(df)
    assert "<th>0</th>" not in html and "<th>2</th>" not in html and "e-16" not in html
    assert "<td>0</td>" in html
    assert "<code>output_tok_per_s</code>: output tokens per second" in html
    assert "<code>sweep-c5</code>: capacity sweep, 5 sessions in flight" in html
    assert 'class="kvs-table">' in html  # a table that fits: headers break at underscores only, never mid-word
    wide = table_html(pd.DataFrame({f"usd_per_1000_sessions_metric_{i}": [1.2345] for i in range(30)}))
    assert 'class="kvs-table" data-wide>' in wide
    named = table_html(pd.DataFrame({"x": [1]}, index=pd.Index(["a"], name="workload")))
    assert "workload" in named  # a named index is data, kept


# ---- figures -------------------------------------------------------------------------------------------------
def test_the_figure_check_finds_overlapping_labels_a_legend_on_the_data_and_a_zoomed_share_axis():
    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot(range(12), [0.8278 + 0.00007 * i for i in range(12)], label="measured")
    ax.set_xticks(range(12))
    ax.set_xticklabels([f"sweep-c{i}-level" for i in range(12)])
    ax.set(ylabel="hit rate", title="crowded")
    ax.legend(loc="center")
    problems = figure_layout_problems(fig)
    assert any("x labels overlap" in p for p in problems)
    assert "crowded: the legend covers data" in problems
    assert any("starts at 0.828, not at zero" in p for p in problems)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.plot([1, 2, 4], [0.5, 0.6, 0.9], label="measured")
    ax.axhline(0.8, color="red", ls="--")  # a reference line under the legend is not data
    ax.set(ylim=(0, 1), ylabel="hit rate")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    assert figure_layout_problems(fig) == []
    plt.close(fig)


def test_a_long_generated_title_is_wrapped_to_its_figure_and_a_title_on_a_label_is_found():
    from kvscope.harness.analysis.notebook import wrap_title

    fig = plt.figure(figsize=(4, 3))
    fig.add_subplot()
    fig.suptitle("Latency per configuration, pooled over 4 workloads and 6 load levels (a distribution, not a "
                 "comparison); compare configurations per workload and load in TTFT by load level")
    assert "the figure title is wider than the figure" in figure_layout_problems(fig)
    wrap_title(fig)
    assert "\n" in fig._suptitle.get_text() and figure_layout_problems(fig) == []
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(12, 2.4))
    axes[1].set_ylabel("output tokens/s vs baseline (relative change), a label longer than its axes")
    fig.suptitle("Per workload")
    assert any(p.startswith("the figure title overlaps the y label") for p in figure_layout_problems(fig))
    plt.close(fig)


def test_the_ab_summary_names_metrics_in_words_and_changes_as_directions():
    """Old: 'output_tokens_per_s -1 % median (better 1, …)' — a raw key and a sign that reads against 'better'."""

    table = pd.DataFrame({"A": "base", "B": "ngram", "workload": ["a", "b"], "load": "c1",
                          "metric": "output_tokens_per_s", "verdict": ["better", "inconclusive"],
                          "relative": [-0.01, -0.01]})
    res = _results([_cell("base", "a", "c1", hit=0.5, ttft_s=0.03)])
    found = [f for f in F.page_findings(res, "ab_compare", resamples=200, ab=table) if f.question == "ab"]
    [f] = found
    assert "output_tokens_per_s" not in f.sentence and "% median" not in f.sentence
    assert "output throughput 1 % lower (median; verdicts: 1 better, 1 inconclusive)" in f.sentence


def test_habit_recommendations_and_the_index_pivot_write_directions_and_metric_names_in_words(tmp_path):
    """Old: 'without it, +84 pp hit rate (decided); -94 ms TTFT p50' and a pivot of 'ttft_p50_s' columns with
    'worse (+129 %)' and 'by_construction' cells."""
    from kvscope.harness.analysis.pages import ab_compare
    from kvscope.harness.report.summary import findings_html

    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.027),
                    _cell("apc", "agent-ts", "c1", hit=0.0, ttft_s=0.121, seed=1),
                    _cell("off", "agent", "c1", hit=0.84, ttft_s=0.060, caching=False, seed=2)])
    [rec] = hit_rates.habit_recommendations(res, resamples=200)
    assert "hit rate 84 pp higher" in rec.sentence and "TTFT p50 94 ms lower" in rec.sentence
    assert "+84 pp" not in rec.sentence and "-94 ms" not in rec.sentence
    fig = tmp_path / "figures" / "ab_compare"
    fig.mkdir(parents=True)
    F.write_page_findings(res, "ab_compare", fig, ab=ab_compare.ab_table(res, resamples=200), resamples=200)
    page = findings_html(tmp_path, ["ab_compare"])
    assert "<th>TTFT p50</th>" in page and "<th>ttft_p50_s</th>" not in page
    assert "% lower)" in page and not any(f"(+{n}" in page or f"(-{n}" in page for n in range(10))
    assert ">by construction" in page and ">by_construction" not in page


def test_the_figure_check_finds_a_series_missing_from_the_legend():
    """One panel's legend standing for all: the configuration only the other panel ran is in no legend."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3))
    axes[0].plot([1, 2], [1, 2], label="no-prefix-cache")
    axes[0].plot([1, 2], [2, 3], label="baseline")
    axes[1].plot([1, 2], [1, 3], label="baseline")
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.02, 1))
    assert figure_layout_problems(fig) == ["'no-prefix-cache' not in the legend"]
    plt.close(fig)


def test_point_labels_are_placed_only_where_they_fit_and_overlapping_ones_are_found():
    from kvscope.harness.analysis.notebook import annotate_points

    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax in axes:
        ax.plot([1, 1.01, 2], [1, 1.01, 2], "o")
    points = [(1, 1, "sweep-c4 · 100%"), (1.01, 1.01, "sweep-c5 · 100%"), (2, 2, "sweep-c7 · 84%")]
    for x, y, text in points:  # every label placed: the first two collide, the last leaves the panel
        axes[0].annotate(text, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    fig.canvas.draw()
    assert any("point labels overlap" in p for p in figure_layout_problems(fig))
    for t in list(axes[0].texts):
        t.remove()
    assert annotate_points(axes[1], points) == 1  # the second overlaps the first, the third leaves the panel
    assert figure_layout_problems(fig) == []
    plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(4, 2))
    axes[1].set_ylabel("TTFT p90 (ms), a label wide enough to reach the next panel")
    axes[1].yaxis.label.set_rotation(0)
    assert any("runs into another panel" in p for p in figure_layout_problems(fig))
    plt.close(fig)
