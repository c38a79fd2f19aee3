"""Findings, caveats and the tables behind them, on small synthetic experiment results (no server)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis import common
from kvscope.harness.analysis.pages import ab_compare, concurrency, hit_rates, speculative
from kvscope.harness.results.findings_file import FINDINGS_NAME, load_findings_file
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentFile, ExperimentSpecCore, ModelEntry, ServerEntry

SESSIONS = 6
STEPS = 5


def _cell(server: str, workload: str, load: str, *, hit: float, ttft_s: float, caching: bool = True,
          speculative: bool = False, tok_per_s: float = 100.0, block_size: int = 16, concurrency: int = 1,
          acceptance: float | None = None, seed: int = 0) -> tuple[dict, pd.DataFrame]:
    """One cell: SESSIONS sessions of STEPS requests of 1,000 prompt tokens, `hit` of them cached, TTFT ≈ ttft_s."""
    rng = np.random.default_rng(seed)
    name = f"{server}__{workload}__{load}__r0"
    n = SESSIONS * STEPS
    ttft = ttft_s * np.exp(rng.normal(0, 0.05, n))
    rec = pd.DataFrame({
        "cell": name, "server": server, "workload": workload, "load": load, "repeat": 0,
        "session_id": [f"s{i // STEPS}" for i in range(n)], "request_id": np.arange(n), "step": np.arange(n) % STEPS,
        "prompt_tokens": 1000, "cached_tokens": int(1000 * hit) if caching else 0,
        "predicted_cached_tokens": int(1000 * hit) if caching else 0, "output_tokens": 20,
        "ttft_s": ttft, "tpot_s": 0.01, "e2e_s": ttft + 0.2, "itl_s": [[0.01] * 19] * n,
        "error_class": None, "in_window": True, "transition": "append"})
    row = {"cell": name, "server": server, "workload": workload, "load": load, "repeat": 0, "status": "ok",
           "prefix_caching": caching, "speculative": speculative, "requests": n,
           "would_hit": None if caching else hit, "output_tok_per_s": tok_per_s,
           "ttft_p50_s": float(np.median(ttft)), "tpot_p50_s": 0.01, "e2e_p50_s": float(np.median(ttft)) + 0.2,
           "block_size": block_size, "concurrency": concurrency, "spec_acceptance_rate": acceptance,
           "spec_mean_acceptance_length": None, "goodput_fraction": 1.0}
    return row, rec


def _results(cells: list[tuple[dict, pd.DataFrame]], slo_ttft_ms: float = 250, pricing: list[str] | None = None,
             tmp: Path = Path("/nonexistent"), model: dict | None = None) -> ExperimentResults:
    spec = ExperimentSpecCore.model_validate({"name": "t", "slo": {"ttft_ms": slo_ttft_ms},
                                              "cost": {"pricing": pricing or ["anthropic-sonnet-5m"]}})
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                model=ModelEntry.model_validate(model) if model else None)
    return ExperimentResults(root=tmp, experiment=experiment, cells=pd.DataFrame([c for c, _ in cells]),
                             requests=pd.concat([r for _, r in cells], ignore_index=True), metrics=pd.DataFrame())


# ---- habits ------------------------------------------------------------------------------------------------
def test_a_habit_sentence_carries_hit_rates_and_ttft_of_both_workloads():
    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.027),
                    _cell("apc", "agent-ts", "c1", hit=0.0, ttft_s=0.121, seed=1)])
    [f] = hit_rates.habit_findings(res, resamples=200)
    assert "from 84 % to 0 %" in f.sentence
    assert "TTFT p50 from 27 to 121 ms" in f.sentence
    assert f.numbers["hit_rate_reference"] == pytest.approx(0.84)
    assert f.numbers["hit_rate_habit"] == 0
    lo, hi = f.interval
    assert 0.08 < lo < hi < 0.11  # the TTFT difference, ~94 ms, inside its interval
    assert f.notebook == "hit_rates" and f.figure == "hit_rate_by_workload"


def test_a_habit_that_costs_nothing_says_so():
    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.030),
                    _cell("apc", "agent-quiet", "c1", hit=0.84, ttft_s=0.030, seed=1)])
    [f] = hit_rates.habit_findings(res, resamples=200)
    assert "costs nothing measurable" in f.sentence
    assert "84 % vs 84 %" in f.sentence


def test_habit_cost_words_compare_the_habit_with_its_reference_both_cached():
    f = hit_rates._habit_sentence("a timestamp at token 4", "agent", "agent-ts", "apc", "c1", 0.84, 0.0,
                          {"a": 0.027, "b": 0.121, "ci_low": 0.09, "ci_high": 0.1, "verdict": "worse"},
                          "anthropic-sonnet-5m", {"reference_usd_per_1000_sessions": 48.09,
                                                  "habit_usd_per_1000_sessions": 73.30, "change": 73.30 / 48.09 - 1})
    assert ("costs $73.30 vs $48.09 per 1,000 sessions on anthropic-sonnet-5m with caching (+52 % against agent)"
            in f.sentence)
    assert f.sentence.startswith("A timestamp at token 4")


def test_habit_pairs_take_the_longest_prefix_workload_as_reference():
    res = _results([_cell("apc", w, "c1", hit=0.5, ttft_s=0.03) for w in
                    ("agent", "agent-coding", "agent-coding-ts", "chat")])
    assert hit_rates.habit_pairs(res) == [("agent", "agent-coding"), ("agent-coding", "agent-coding-ts")]


# ---- capacity ----------------------------------------------------------------------------------------------
def test_a_one_load_experiment_says_capacity_is_not_measured():
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03)])
    [f] = concurrency.capacity_findings(res)
    assert f.sentence.startswith("Capacity is not measured: the experiment ran one load level (c1)")
    assert f.numbers["load_levels"] == 1


def test_capacity_is_the_highest_measured_load_meeting_the_slo():
    cells = [_cell("apc", "agent", f"c{c}", hit=0.8, ttft_s=t, concurrency=c)
             for c, t in ((1, 0.05), (2, 0.12), (4, 0.40), (8, 0.90))]
    cells += [_cell("fast", "agent", f"c{c}", hit=0.8, ttft_s=0.05, concurrency=c) for c in (1, 2, 4, 8)]
    found = {f.sentence.split()[0]: f for f in concurrency.capacity_findings(_results(cells, slo_ttft_ms=250))}
    assert found["apc"].numbers["capacity_load"] == 2
    assert "holds load c2 at TTFT p90 ≤ 250 ms" in found["apc"].sentence
    assert "at c8 TTFT p90 is" in found["apc"].sentence
    assert found["fast"].numbers["capacity_load"] == 8
    assert "ceiling was not reached" in found["fast"].sentence


def test_a_sweeps_recorded_capacity_is_the_answer_for_its_server():
    """The sweep decides with preemptions counted (analysis.capacity); the summary must not re-decide on TTFT
    alone and call a preempting level a pass."""
    cells = [_cell("apc", "agent", f"c{c}", hit=0.8, ttft_s=0.05, concurrency=c) for c in (1, 2, 4)]
    cells += [_cell("other", "agent", f"c{c}", hit=0.8, ttft_s=0.05, concurrency=c) for c in (1, 2, 4)]
    res = _results(cells, slo_ttft_ms=250)
    res.experiment.capacity = [SimpleNamespace(server="apc", capacity=2.0, slo_ttft_p90_ms=250.0,
                                               sentence="apc holds 2 concurrent agent sessions at TTFT p90 ≤ 250 ms; "
                                                        "at 4 it preempts")]
    found = {f.sentence.split()[0]: f for f in concurrency.capacity_findings(res)}
    assert found["apc"].sentence == "apc holds 2 concurrent agent sessions at TTFT p90 ≤ 250 ms; at 4 it preempts."
    assert found["apc"].numbers["capacity_load"] == 2
    assert "ceiling was not reached" in found["other"].sentence  # a server without a sweep: from the grid


def test_a_grid_level_that_preempts_fails_as_in_a_sweep():
    """One rule for grid levels and sweeps (analysis.capacity.point_meets_slo): a level whose TTFT meets the
    SLO but whose server preempted is not within capacity."""
    cells = [_cell("apc", "agent", f"c{c}", hit=0.8, ttft_s=0.05, concurrency=c) for c in (1, 2, 4)]
    res = _results(cells, slo_ttft_ms=250)
    res.metrics = pd.DataFrame([{"cell": f"apc__agent__c{c}__r0", "num_requests_running": c,
                                 "num_requests_waiting": 0, "kv_cache_usage": 0.5, "num_preemptions": p}
                                for c in (1, 2, 4) for p in ((0, 0) if c < 4 else (0, 7))])
    [f] = concurrency.capacity_findings(res)
    assert f.numbers["capacity_load"] == 2
    assert "holds load c2 at TTFT p90 ≤ 250 ms" in f.sentence and "at c4 it preempts (7 preemptions)" in f.sentence


def test_a_configuration_missing_the_slo_everywhere_says_so():
    cells = [_cell("slow", "agent", f"c{c}", hit=0.8, ttft_s=0.5, concurrency=c) for c in (1, 2)]
    [f] = concurrency.capacity_findings(_results(cells, slo_ttft_ms=250))
    assert "misses TTFT p90 ≤ 250 ms even at the lowest load" in f.sentence
    assert f.numbers["capacity_load"] is None


# ---- speculative decoding ----------------------------------------------------------------------------------
def test_speculative_decoding_without_decided_verdicts_is_not_said_to_pay():
    """+60 % at c1 on one run per side is a point estimate, not a verdict: the claim follows the verdicts
    (`analysis.claims`), and the recommendation says it is inconclusive."""
    cells = []
    for c, spec_tps in ((1, 160.0), (2, 120.0), (4, 90.0)):
        cells.append(_cell("base", "agent", f"c{c}", hit=0.8, ttft_s=0.03, tok_per_s=100.0))
        cells.append(_cell("ngram", "agent", f"c{c}", hit=0.8, ttft_s=0.03, tok_per_s=spec_tps, speculative=True,
                           acceptance=0.6))
    res = _results(cells)
    rec, f = speculative.speculative_findings(res, ab_compare.ab_table(res, resamples=200))
    assert f.sentence.startswith("ngram has no decided payoff against base")
    assert "3 of them ran once per side" in f.sentence
    assert f.claim == "speculative:ngram" and f.claim_value == "inconclusive"
    assert rec.question == "recommendation" and rec.sentence.startswith("ngram: inconclusive")


# ---- caveats -----------------------------------------------------------------------------------------------
def test_caveats_appear_only_where_the_data_shows_them():
    gpu = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03, block_size=16)])
    cpu = _results([_cell("apc", "agent", "c4", hit=0.8, ttft_s=0.03, block_size=128, concurrency=8)],
                   model={"path": "m", "tokenizer": "m", "weights_random": False, "card": {"train_steps": 50}})
    assert not [c for c in F.caveats(gpu) if "blocks" in c.sentence or "concurrency" in c.sentence]
    words = " ".join(c.sentence for c in F.caveats(cpu))
    assert "KV blocks are 128 tokens here" in words
    assert "6 sessions at concurrency 8" in words
    assert "trained for 50 steps" in words
    # 1,000-token prompts are below Anthropic's 1,024-token minimum
    assert "100 % below 1,024 tokens (anthropic-sonnet-5m)" in words


def test_a_cell_whose_client_was_held_up_gets_a_latency_caveat():
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03), _cell("apc", "agent", "c8", hit=0.5,
                                                                                 ttft_s=0.05, concurrency=8)])
    held = {"c1": (0.05, 0.05), "c8": (4.0, 1.5)}  # (stalled s, longest s) in 40 s runs: 0.1 % and 10 %

    def summary(stalled_s: float, longest_s: float) -> SimpleNamespace:
        return SimpleNamespace(duration_s=40.0, client=SimpleNamespace(stalled_s=stalled_s, stall_max_s=longest_s),
                               data_quality=SimpleNamespace(cache_not_reset=None))

    res.summaries = {f"apc__agent__{k}__r0": summary(*v) for k, v in held.items()}  # type: ignore[misc]
    found = [c for c in F.caveats(res) if "held up" in c.sentence]
    assert len(found) == 1 and found[0].notebook == "latency"
    assert "in 1 of 2 cell(s): 4.0 s of 80 s" in found[0].sentence and "longest 1.5 s" in found[0].sentence
    res.summaries = {k: summary(0.05, 0.05) for k in res.summaries}  # type: ignore[misc]
    assert not [c for c in F.caveats(res) if "held up" in c.sentence]


# ---- files and HTML ----------------------------------------------------------------------------------------
def test_page_findings_file_round_trips_and_the_index_summary_escapes_and_links(tmp_path):
    from kvscope.harness.report.summary import findings_html

    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.027),
                    _cell("apc", "agent-<b>x</b>", "c1", hit=0.0, ttft_s=0.121, seed=1),
                    _cell("other", "agent", "c1", hit=0.84, ttft_s=0.030, seed=2),
                    _cell("other", "agent-<b>x</b>", "c1", hit=0.0, ttft_s=0.121, seed=3)])
    for page in ("hit_rates", "ab_compare"):
        fig_dir = tmp_path / "figures" / page
        fig_dir.mkdir(parents=True)
        ab = ab_compare.ab_table(res, resamples=200) if page == "ab_compare" else None
        written = F.write_page_findings(res, page, fig_dir, ab=ab, resamples=200)
        assert load_findings_file(fig_dir / FINDINGS_NAME).findings == written
    assert (tmp_path / "figures" / "ab_compare" / "verdicts.csv").exists()
    page = findings_html(tmp_path, ["hit_rates", "ab_compare"])
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page
    assert '<a href="hit_rates.html">' in page and 'href="figures/hit_rates/hit_rate_by_workload.png"' in page
    assert re.search(r'<td class="v-(better|worse|equivalent|inconclusive|by_construction)">', page)
    assert 'href="figures/ab_compare/verdicts.csv"' in page


def test_findings_markdown_lists_caveats_last():
    md = F.findings_markdown([F.Finding(question="caveat", sentence="C.", notebook="latency"),
                              F.Finding(question="latency", sentence="L.", notebook="latency")])
    assert md.index("- L.") < md.index("*Caveat:* C.")


def test_server_palette_is_one_colour_per_server_in_order():
    res = _results([_cell(s, "agent", "c1", hit=0.5, ttft_s=0.03) for s in ("b", "a", "c")])
    pal = common.server_palette(res)
    assert list(pal) == ["b", "a", "c"] and len(set(pal.values())) == 3


# ---- tables ------------------------------------------------------------------------------------------------
def test_hit_by_workload_counts_each_request_once_when_loads_are_pooled_and_names_would_hit():
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03), _cell("apc", "agent", "c2", hit=0.8, ttft_s=0.03),
                    _cell("off", "agent", "c1", hit=0.7, ttft_s=0.03, caching=False)])
    t = common.hit_by_workload(res).set_index("server")
    assert t.loc["apc", "requests"] == SESSIONS * STEPS and t.loc["apc", "replays"] == 2
    assert t.loc["off", "measured"] == 0 and t.loc["off", "predicted_by_simulator"] == 0
    assert t.loc["off", "would_hit_with_caching"] == pytest.approx(0.7)
    assert t.loc["apc", "would_hit_with_caching"] == pytest.approx(0.8)


def test_speculation_vs_primer_uses_the_primer_formula():
    row, rec = _cell("ngram", "agent", "c1", hit=0.5, ttft_s=0.03, speculative=True, acceptance=0.5)
    row["spec_mean_acceptance_length"] = 1.5
    res = _results([(row, rec)])
    res.experiment.servers["ngram"] = ServerEntry(config={"speculative_config": {"num_speculative_tokens": 4}}, log="")
    [r] = speculative.speculation_vs_primer(res).to_dict("records")
    assert r["primer_tokens_per_pass"] == pytest.approx((1 - 0.5 ** 5) / 0.5)
    assert r["measured_minus_primer"] == pytest.approx(1.5 - 1.9375)


def test_capacity_planning_reads_its_gpus_from_data():
    from kvscope.harness.cachemodel.gpus import load_gpus

    names = [g.name for g in load_gpus()]
    assert "H200 141GB" in names
    plan = concurrency.capacity_planning(contexts=(8192,), models=("llama-3.1-8b",), kv_dtypes=("bfloat16",))
    assert plan["gpu"].tolist() == names
