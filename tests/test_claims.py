"""The report's claims (eviction, speculative payoff, capacity), its recommendations and its per-session hit
rates, on small experiments built in a temporary directory (generated traces, typed cell tables, no server).

Each test builds the situation in which the report used to state the wrong thing: a KV-usage gauge at 40 %
beside a pool that evicted, a speculative "pays off" beside inconclusive verdicts, a capacity "at none of the
measured loads" that hid that one level was measured, a what-if that held only for an infinite cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import claims as C
from kvscope.harness.analysis import explain_experiment as X
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.explain import explain_trace
from kvscope.harness.analysis.pages import ab_compare, concurrency, hit_rates, speculative
from kvscope.harness.results.findings_file import Finding
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import CapacityEntry, ExperimentFile, ExperimentSpecCore

B = 16
RESAMPLES = 200


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> Path:
    """<root>/traces/{agent,agent-ts}: the same coding sessions, append-only and with a timestamp at the top."""
    from kvscope.workloads.generate import generate_from_file

    root = tmp_path_factory.mktemp("claims-exp")
    for name, spec in (("agent", "agent-coding"), ("agent-ts", "agent-coding-timestamped")):
        generate_from_file(spec, tiny_model_dir, seed=3, scale=0.02, sessions=3,
                           max_context=1500).write(root / "traces" / name)
    return root


def _trace_cell(root: Path, workload: str, server: str, *, cached: list[int] | None = None, repeat: int = 0,
                caching: bool = True, num_blocks: int | None = None, ttft_s: float = 0.05,
                tok_per_s: float = 100.0, speculative: bool = False, seed: int = 0) -> tuple[dict, pd.DataFrame]:
    """One cell replaying the workload's trace one request at a time; cached tokens `cached` (default: the
    infinite-cache simulation's, i.e. no eviction)."""
    tdir = root / "traces" / workload
    meta = json.loads((tdir / "trace.json").read_text())
    n = meta["num_requests"]
    sim = explain_trace(tdir, B)
    if cached is None:
        cached = [a.predicted_cached_tokens for a in sim.requests] if caching else [0] * n
    rng = np.random.default_rng(seed)
    ttft = ttft_s * np.exp(rng.normal(0, 0.05, n))
    name = f"{server}__{workload}__c1__r{repeat}"
    sessions = [a.session_id for a in sim.requests]
    rec = pd.DataFrame({"cell": name, "server": server, "workload": workload, "load": "c1", "repeat": repeat,
                        "request_id": np.arange(n), "session_id": sessions, "step": [a.step for a in sim.requests],
                        "prompt_tokens": [a.prompt_tokens for a in sim.requests], "cached_tokens": cached,
                        "predicted_cached_tokens": cached, "output_tokens": 20, "ttft_s": ttft, "tpot_s": 0.01,
                        "e2e_s": ttft + 0.2, "itl_s": [[0.01] * 19] * n, "sent_s": np.arange(n, dtype=float),
                        "done_s": np.arange(n) + 0.5, "error_class": None, "in_window": True,
                        "transition": "append"})
    row = {"cell": name, "server": server, "workload": workload, "load": "c1", "repeat": repeat, "status": "ok",
           "prefix_caching": caching, "speculative": speculative, "requests": n, "block_size": B,
           "num_blocks": num_blocks, "concurrency": 1, "output_tok_per_s": tok_per_s,
           "ttft_p50_s": float(np.median(ttft)), "tpot_p50_s": 0.01, "e2e_p50_s": float(np.median(ttft)) + 0.2,
           "itl_p99_s": 0.01, "goodput_fraction": 1.0, "would_hit": None}
    return row, rec


def _results(root: Path, cells: list[tuple[dict, pd.DataFrame]], metrics: pd.DataFrame | None = None,
             capacity: list[CapacityEntry] | None = None) -> ExperimentResults:
    spec = ExperimentSpecCore.model_validate({"name": "t", "slo": {"ttft_ms": 250},
                                              "cost": {"pricing": ["anthropic-sonnet-5m"]}})
    workloads = {c["workload"] for c, _ in cells}
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                traces={w: f"traces/{w}" for w in workloads}, capacity=capacity or [])
    return ExperimentResults(root=root, experiment=experiment, cells=pd.DataFrame([c for c, _ in cells]),
                             requests=pd.concat([r for _, r in cells], ignore_index=True),
                             metrics=pd.DataFrame() if metrics is None else metrics)


def _low_gauge(res: ExperimentResults) -> pd.DataFrame:
    """A KV-usage gauge that never passed 41 % and no preemption: what made the old caveat say "no eviction"."""
    return pd.DataFrame([{"cell": c, "t_s": float(t), "num_requests_running": 1, "num_requests_waiting": 0,
                          "kv_cache_usage": 0.2 + 0.07 * t, "num_preemptions": 0}
                         for c in res.cells["cell"] for t in range(4)])


def _evicting(traces: Path, workload: str = "agent") -> list[int]:
    """The infinite-cache hits with every fourth hit lost: a pool that evicted."""
    sim = explain_trace(traces / "traces" / workload, B)
    return [0 if i % 4 == 3 else a.predicted_cached_tokens for i, a in enumerate(sim.requests)]


def _by_claim(found: list[Finding]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in found:
        if f.claim is not None:
            out.setdefault(f.claim, set()).add(str(f.claim_value))
    return out


# ---- eviction ------------------------------------------------------------------------------------------------
def test_eviction_is_read_from_evictions_not_from_the_kv_usage_gauge(traces):
    """The gauge stayed at 41 % and nothing preempted, yet the server hit less than an infinite cache: the
    concurrency caveat and the explain page now both say the pool evicted (the old caveat said it never had to)."""
    res = _results(traces, [_trace_cell(traces, "agent", "apc", cached=_evicting(traces))])
    res.metrics = _low_gauge(res)
    claim = C.eviction_claim(res)
    assert claim is not None and claim.value == "evicted" and claim.numbers["evicted_tokens"] > 0
    conc = F.page_findings(res, "concurrency")
    expl = F.page_findings(res, "explain")
    words = " ".join(f.sentence for f in conc + expl)
    assert "never had to evict" not in words and "No eviction" not in words
    assert "The KV pool evicted cached prefixes" in words and "does not show this" in words  # the gauge, named
    assert _by_claim(conc + expl) == {"eviction": {"evicted"}}
    assert any(f.claim == "eviction" for f in conc) and any(f.claim == "eviction" for f in expl)


def test_a_pool_that_served_every_prefix_says_no_eviction_on_both_pages(traces):
    res = _results(traces, [_trace_cell(traces, "agent", "apc")])
    res.metrics = _low_gauge(res)
    found = F.page_findings(res, "concurrency") + F.page_findings(res, "explain")
    assert _by_claim(found) == {"eviction": {"none"}}
    assert "never had to evict" in " ".join(f.sentence for f in found)


def test_eviction_by_cell_counts_what_an_infinite_cache_would_have_served(traces):
    cached = _evicting(traces)
    res = _results(traces, [_trace_cell(traces, "agent", "apc", cached=cached),
                            _trace_cell(traces, "agent", "off", caching=False)])
    ev = C.eviction_by_cell(res)
    assert ev["server"].tolist() == ["apc"]  # a server without caching evicts nothing it cached
    ideal = [a.predicted_cached_tokens for a in explain_trace(traces / "traces" / "agent", B).requests]
    assert ev["evicted_tokens"].iloc[0] == sum(i - c for i, c in zip(ideal, cached))


# ---- the what-if ---------------------------------------------------------------------------------------------
def test_the_what_if_says_its_cache_and_gives_the_pool_figure_and_the_measured_sibling(traces):
    """An infinite cache's gain is not what a small pool keeps: with the run's pool known, the sentence gives
    both, and the reference workload's measured hit rate beside them."""
    res = _results(traces, [_trace_cell(traces, "agent", "apc", num_blocks=12),
                            _trace_cell(traces, "agent-ts", "apc", num_blocks=12, cached=None)])
    explained = X.explain_workloads(res)
    ts = next(wx for wx in explained if wx.workload == "agent-ts")
    top = ts.explanation.causes[0]
    assert top.cause == "volatile_field"
    assert top.what_if_hit_rate_pool is not None and top.what_if_hit_rate_pool < top.what_if_hit_rate
    sentence = X.cause_sentence(ts, explained)
    assert "with an infinite cache" in sentence and "at this run's KV pool of 12 blocks" in sentence
    assert "agent, the same sessions without it, measured" in sentence
    # without a pool size only the infinite cache is claimed, and said
    res2 = _results(traces, [_trace_cell(traces, "agent-ts", "apc")])
    [wx] = X.explain_workloads(res2)
    assert wx.explanation.causes[0].what_if_hit_rate_pool is None
    assert "with an infinite cache" in X.cause_sentence(wx) and "KV pool" not in X.cause_sentence(wx)


# ---- speculative payoff --------------------------------------------------------------------------------------
def _spec_cells(traces: Path, repeats: int, spec_tps: list[float], spec_ttft: float) -> list:
    cells = []
    for r in range(repeats):
        cells.append(_trace_cell(traces, "agent", "base", repeat=r, tok_per_s=100.0 + r, seed=r))
        cells.append(_trace_cell(traces, "agent", "ngram", repeat=r, tok_per_s=spec_tps[r], speculative=True,
                                 ttft_s=spec_ttft, seed=10 + r))
    return cells


def test_speculative_payoff_follows_the_verdicts_not_the_point_estimate(traces):
    """+60 % throughput on one run per side is no decided payoff (the old sentence said "pays off"); what got
    worse (TTFT p50 +40 %) is named."""
    res = _results(traces, _spec_cells(traces, 1, [160.0], spec_ttft=0.07))
    ab = ab_compare.ab_table(res, resamples=RESAMPLES)
    [claim] = C.speculative_claims(res, ab)
    assert claim.value == "inconclusive"
    found = speculative.speculative_findings(res, ab)
    words = " ".join(f.sentence for f in found)
    assert "pays off" not in words.replace("no decided payoff", "")
    assert "ran once per side" in words and re.search(r"What gets worse: TTFT p50 \d+ % higher on agent", words)
    [rec] = [f for f in found if f.question == "recommendation"]
    assert rec.sentence.startswith("ngram: inconclusive") and "only if throughput-bound" in rec.sentence
    assert _by_claim(found) == {"speculative:ngram": {"inconclusive"}}


def test_speculative_decoding_pays_where_the_throughput_verdicts_are_decided_better(traces):
    res = _results(traces, _spec_cells(traces, 3, [160.0, 161.0, 162.0], spec_ttft=0.05))
    ab = ab_compare.ab_table(res, resamples=RESAMPLES)
    [claim] = C.speculative_claims(res, ab)
    assert claim.value == "pays" and "pays off" in claim.sentence
    rec = C.speculative_recommendation(claim)
    assert rec.sentence.startswith("Use ngram:") and rec.claim_value == "pays"


# ---- capacity ------------------------------------------------------------------------------------------------
def _capacity_entry(levels_measured: list[tuple[float, float, float]]) -> CapacityEntry:
    """baseline on agent: measured levels (load, TTFT p90 s, preemptions) against 250 ms; the model predicts
    TTFT p90 = 100 ms x concurrency (passing up to 2, the first failure at 3) and an eviction cliff at 6."""
    pred = [{"load": float(c), "hit_rate": 0.8 if c < 6 else 0.6, "ttft_p50_s": 0.05, "ttft_p90_s": 0.1 * c,
             "e2e_p50_s": 0.3, "preemptions": 0.0 if c < 6 else 2.0, "kv_usage_max": 0.5,
             "preemptions_p50": 0.0 if c < 6 else 2.0} for c in range(1, 9)]
    points = [{"load": c, "ttft_p90_s": t, "preemptions": p, "mean_sessions_in_flight": c, "cell": None}
              for c, t, p in levels_measured]
    return CapacityEntry.model_validate({
        "server": "baseline", "workload": "agent", "kind": "concurrency", "slo_ttft_p90_ms": 250.0,
        "capacity": None, "interpolated": None, "ceiling": None, "under_driven": [], "points": points,
        "sentence": "baseline meets TTFT p90 ≤ 250 ms at none of the measured loads on agent",
        "predicted": {"capacity": 2.0, "cliff": 6.0, "levels": pred, "sentence": "", "fit_r2": 0.95}})


def test_capacity_when_the_first_level_fails_says_what_was_measured_and_what_is_predicted(traces, tmp_path):
    entry = _capacity_entry([(1.0, 0.479, 0.0)])
    res = _results(traces, [_trace_cell(traces, "agent", "baseline")], capacity=[entry])
    [f] = [f for f in concurrency.capacity_findings(res) if f.claim]
    assert f.claim == "capacity:baseline:agent" and f.claim_value == "none_measured"
    assert "only c1 (TTFT p90 479 ms) was measured" in f.sentence
    assert "the sweep stops at the first failing level" in f.sentence
    assert "predicts a capacity of c2, the first failing level at c3 and a KV eviction cliff at c6" in f.sentence
    assert f.figure == "predicted_vs_measured"
    # the index states the same sentence, from the page's findings file
    from kvscope.harness.report.summary import findings_html

    fig = tmp_path / "figures" / "concurrency"
    fig.mkdir(parents=True)
    F.write_page_findings(res, "concurrency", fig)
    assert "only c1 (TTFT p90 479 ms) was measured" in findings_html(tmp_path, ["concurrency"])


def test_predicted_vs_measured_keeps_a_sweep_without_a_prediction_and_marks_the_kv_ceiling(traces):
    entry = _capacity_entry([(1.0, 0.1, 0.0), (2.0, 0.2, 0.0), (3.0, 0.2, 1.0)])
    bare = entry.model_copy(update={"server": "ngram", "predicted": None})
    res = _results(traces, [_trace_cell(traces, "agent", "baseline")], capacity=[entry, bare])
    pm = concurrency.predicted_vs_measured(res)
    assert set(pm[pm["server"] == "ngram"]["source"]) == {"measured"}
    caps = concurrency.capacity_predictions(res).set_index("server")
    assert caps.loc["baseline", "measured_kv_ceiling"] == 3 and caps.loc["baseline", "predicted_cliff"] == 6


# ---- one story across pages ----------------------------------------------------------------------------------
def test_every_page_states_one_value_per_claim_and_the_index_renders_them(traces, tmp_path):
    """Render every page that speaks about eviction, speculative payoff or capacity for one constructed
    experiment: each claim has one value wherever it appears, and the index shows the recommendations first."""
    from kvscope.harness.report.summary import findings_html

    cells = _spec_cells(traces, 1, [160.0], spec_ttft=0.07)
    cells[0] = _trace_cell(traces, "agent", "base", cached=_evicting(traces))
    cells += [_trace_cell(traces, "agent-ts", "base", ttft_s=0.12, seed=5),
              _trace_cell(traces, "agent-ts", "ngram", ttft_s=0.12, speculative=True, seed=6)]
    res = _results(traces, cells, capacity=[_capacity_entry([(1.0, 0.479, 0.0)])])
    res.metrics = _low_gauge(res)
    ab = ab_compare.ab_table(res, resamples=RESAMPLES)
    found: list[Finding] = []
    order = ["hit_rates", "concurrency", "speculative", "explain", "ab_compare"]
    for page in order:
        fig = tmp_path / "figures" / page
        fig.mkdir(parents=True)
        found += F.write_page_findings(res, page, fig, ab=ab if page in ("speculative", "ab_compare") else None,
                                       resamples=RESAMPLES)
    claims = _by_claim(found)
    assert {k: v for k, v in claims.items() if len(v) > 1} == {}
    assert claims["eviction"] == {"evicted"} and claims["speculative:ngram"] == {"inconclusive"}
    assert claims["capacity:baseline:agent"] == {"none_measured"}
    assert C.contradictions(found) == {}
    page = findings_html(tmp_path, order)
    assert page.index("Recommendations") < page.index("What each history habit costs")
    assert "never had to evict" not in page and "ngram pays off" not in page
    assert "Avoid a timestamp" in page or "inconclusive" in page


def test_contradictions_are_found_across_pages():
    a = Finding(question="caveat", sentence="No eviction.", notebook="concurrency", claim="eviction",
                claim_value="none")
    b = Finding(question="cache_break", sentence="Evicted.", notebook="explain", claim="eviction",
                claim_value="evicted")
    assert C.contradictions([a, b]) == {"eviction": {"concurrency": "none", "explain": "evicted"}}
    assert C.contradictions([a, a.model_copy(update={"notebook": "explain"})]) == {}


# ---- recommendations and per-session hit rates ---------------------------------------------------------------
def test_a_habit_recommendation_needs_a_decided_verdict(traces):
    res = _results(traces, [_trace_cell(traces, "agent", "apc", repeat=r, seed=r) for r in range(3)]
                   + [_trace_cell(traces, "agent-ts", "apc", repeat=r, ttft_s=0.15, seed=20 + r) for r in range(3)])
    [rec] = hit_rates.habit_recommendations(res, resamples=RESAMPLES)
    assert rec.question == "recommendation" and rec.claim == "habit:agent-ts" and rec.claim_value == "avoid"
    assert rec.sentence.startswith("Avoid a timestamp") and "(decided)" in rec.sentence
    # one run per side: the TTFT verdict stays inconclusive and is said to be
    once = _results(traces, [_trace_cell(traces, "agent", "apc", seed=1),
                             _trace_cell(traces, "agent-ts", "apc", ttft_s=0.15, seed=2)])
    [rec] = hit_rates.habit_recommendations(once, resamples=RESAMPLES)
    assert re.search(r"TTFT p50 \d+ ms lower \(inconclusive\)", rec.sentence) or rec.claim_value == "inconclusive"


def test_session_hit_rates_are_one_row_per_session_and_their_spread_beside_the_pooled_rate(traces):
    res = _results(traces, [_trace_cell(traces, "agent", "apc")])
    per = hit_rates.session_hit_rates(res)
    r = res.requests
    assert len(per) == r["session_id"].nunique()
    for row in per.itertuples():
        s = r[r["session_id"] == row.session_id]
        assert row.hit_rate == pytest.approx(s["cached_tokens"].sum() / s["prompt_tokens"].sum())
    [spread] = hit_rates.session_hit_rate_spread(res).to_dict("records")
    assert spread["sessions"] == len(per)
    assert spread["min"] <= spread["median"] <= spread["max"]
    assert spread["pooled"] == pytest.approx(r["cached_tokens"].sum() / r["prompt_tokens"].sum())


def test_a_what_if_short_of_the_reference_says_the_rest_is_new_tokens():
    """The demo's compaction: undoing the edit gives 72 %, agent-coding measured 86 %; the rest is not a cache
    break but new tokens (28 % of compaction's prompt tokens against 14 %), and the sentence says so. Where the
    what-if reaches the reference, nothing is added."""
    from kvscope.harness.analysis.explain import Explanation

    def wx(name, cached, recomputed):
        return X.WorkloadExplanation(name, Explanation([], [], 128, 10_000, cached, recomputed), "cell", "apc")

    compaction, reference = wx("agent-compaction", 6_500, 700), wx("agent", 8_600, 0)
    assert X.new_token_share(compaction.explanation) == pytest.approx(0.28)
    words = X._rest_of_gap(compaction, reference, 0.72)
    assert words == ("; the rest of the gap to 86 % is not recomputation: 28 % of agent-compaction's prompt tokens "
                     "are new (no earlier request had them, so no cache serves them: text the habit rewrites is new "
                     "once) against 14 % of agent's")
    assert X._rest_of_gap(compaction, reference, 0.855) == ""  # within a point of the reference
    assert X._rest_of_gap(wx("agent-ts", 0, 8_900), reference, 0.89) == ""  # the what-if passes it
