"""The report's routing page: the offline what-if on an experiment's own traces (cost, latency, switches, sticky
recovery, verdicts, a recommendation only from decided verdicts), and the page rendered by the report and
checked in the system Chromium, on an experiment built on disk (no server)."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
from kvscope.harness.analysis.pages import routing as P
from kvscope.harness.cachemodel import model_routing as M
from kvscope.harness.results.loaders import EXPERIMENT_NAME, load_results, write_result_file
from kvscope.harness.results.records import JSONL_NAME, RequestRecord
from kvscope.harness.results.schemas import CellEntry, ExperimentFile, ExperimentSpecCore

from tests.offline.test_model_routing import write_trace
from tests.test_report_browser import require_chromium

#: ms of TTFT per uncached prompt token and fixed, in the constructed runs
MS_PER_TOKEN, OVERHEAD_MS, TPOT_MS = 0.5, 20.0, 10.0


def build_experiment(root: Path, sessions: int = 8) -> Path:
    """An experiment directory as the runner leaves it, without a server: one workload's trace and one cell whose
    records are the trace on one cache (the simulator's cached tokens) with TTFT linear in the uncached tokens."""
    shape = [[(30 + 7 * s + 11 * k, 5 + (3 * s + k) % 17) for k in range(6)] for s in range(sessions)]
    trace = write_trace(root / "traces" / "agent", shape)
    routed = M.evaluate(M.load_spec({"policy": {"kind": "all-small"}}), M.load_routing_inputs(trace, [16]))
    cell = "baseline__agent__c1__r0"
    cdir = root / "cells" / cell
    cdir.mkdir(parents=True)
    with open(cdir / JSONL_NAME, "wb") as f:
        for r in routed:
            ttft = (OVERHEAD_MS + MS_PER_TOKEN * (r.prompt_tokens - r.cached_tokens)) / 1000
            f.write(RequestRecord(request_id=r.request_id, session_id=str(r.session_id), step=r.step, sent_s=0.0,
                                  ttft_s=ttft, tpot_s=TPOT_MS / 1000, e2e_s=ttft + r.output_tokens * TPOT_MS / 1000,
                                  prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                                  output_tokens=r.output_tokens, planned_output_tokens=r.output_tokens).to_json_line())
    write_result_file(root / EXPERIMENT_NAME, ExperimentFile, ExperimentFile(
        experiment="routing-test", run_id="r", spec=ExperimentSpecCore(name="routing-test"), spec_path="t.yaml",
        created_at=0.0, traces={"agent": "traces/agent"},
        cells={cell: CellEntry(server="baseline", workload="agent", load="c1", repeat=0, status="ok",
                               dir=f"cells/{cell}")}))
    return root


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    return build_experiment(tmp_path_factory.mktemp("routing-exp"))


@pytest.fixture(scope="module")
def whatifs(experiment):
    res = load_results(experiment)
    return res, *P.routing_whatifs(res)


def test_the_latency_fit_recovers_the_runs_ttft_line(experiment):
    fit = P.latency_fit(load_results(experiment))
    assert fit.s_per_uncached_token * 1000 == pytest.approx(MS_PER_TOKEN)
    assert fit.overhead_s * 1000 == pytest.approx(OVERHEAD_MS) and fit.tpot_s * 1000 == pytest.approx(TPOT_MS)


def test_every_policy_is_priced_and_the_fixed_ones_bound_the_rules(whatifs):
    _res, table, per_session = whatifs
    t = table.set_index("policy")
    assert len(t) == 8 and set(t["workload"]) == {"agent"}
    small, large = t.loc["all-small"], t.loc["all-large"]
    assert small["large_share"] == 0 and large["large_share"] == 1
    assert small["model_switch_tokens"] == large["model_switch_tokens"] == 0
    for name, row in t.iterrows():
        # per-session costs add up to the policy's bill
        assert sum(per_session[("agent", name)].values()) * 1000 / row["sessions"] == pytest.approx(
            row["usd_per_1000_sessions"])
        assert small["usd_per_1000_sessions"] <= row["usd_per_1000_sessions"] + 1e-12
    # the large model is 3x slower per token in the what-if, with the same cache as the small one alone
    assert large["ttft_p50_ms"] > small["ttft_p50_ms"] and large["ttft_p90_ms"] > small["ttft_p90_ms"]
    assert large["token_hit_ratio"] == pytest.approx(small["token_hit_ratio"])
    cascade = t[t.index.str.startswith("cascade")]
    assert (cascade["escalation_rate"] > 0).all() and (cascade["wasted_tokens"] > 0).all()


def test_switches_cost_hit_rate_and_sticky_routing_recovers_part_of_it(whatifs):
    _res, table, _ = whatifs
    rec = P.sticky_recovery(table).set_index("policy")
    tool = rec.loc["tool output → large"]
    assert tool["lost_pp"] > 0 and 0 < tool["recovered_pp"]
    t = table.set_index("policy")
    per, sticky = t.loc["tool output → large"], t.loc["tool output → large, sticky"]
    assert sticky["model_switch_tokens"] < per["model_switch_tokens"]
    assert tool["recovered_pp"] == pytest.approx(100 * (sticky["token_hit_ratio"] - per["token_hit_ratio"]))


def test_verdicts_and_a_recommendation_only_from_decided_ones(whatifs):
    _res, table, per_session = whatifs
    v = P.cost_verdicts(table, per_session).set_index("policy")
    assert "all-large" not in v.index
    assert v.loc["all-small", "verdict"] == "better" and v.loc["all-small", "ci_high"] < 0
    found = P.recommendation(table, v.reset_index(), P.sticky_recovery(table))
    [rec] = found
    decided = set(v[(v["verdict"] == "better")].index) - {"all-small"}
    assert decided, v
    cheapest = table[table["policy"].isin(decided)].sort_values("usd_per_1000_sessions").iloc[0]
    assert f"route {cheapest['policy']}" in rec.sentence and rec.numbers["saving"] > 0
    # the index gets one line: how many workloads have a decided policy, and which
    [line] = P.index_recommendation(table, v.reset_index())
    assert line.question == "recommendation" and line.numbers == {"workloads": 1.0, "decided": 1.0}
    assert f"agent: {cheapest['policy']} (" in line.sentence
    # with every verdict undecided, nothing is recommended, on the page or on the index
    undecided = v.reset_index().assign(verdict="inconclusive")
    [none] = P.recommendation(table, undecided, P.sticky_recovery(table))
    assert "nothing is recommended" in none.sentence and "route " not in none.sentence
    [none] = P.index_recommendation(table, undecided)
    assert "nothing is recommended" in none.sentence and none.numbers["decided"] == 0


def test_too_few_sessions_decide_nothing(tmp_path):
    res = load_results(build_experiment(tmp_path / "two", sessions=2))
    table, per_session = P.routing_whatifs(res)
    v = P.cost_verdicts(table, per_session)
    assert set(v["verdict"]) == {"inconclusive"} and (v["sessions"] == 2).all()
    # all-small is still cheaper in every session: the point estimate says so, the verdict does not decide it
    assert v.set_index("policy").loc["all-small", "ci_high"] < 0


def test_without_measured_latency_cost_is_still_priced(experiment, tmp_path):
    res = load_results(experiment)
    res = type(res)(root=res.root, experiment=res.experiment, cells=pd.DataFrame(), requests=pd.DataFrame(),
                    metrics=pd.DataFrame())
    table, _ = P.routing_whatifs(res)
    assert len(table) == 8 and table["ttft_p50_ms"].isna().all() and table["usd_per_1000_sessions"].gt(0).all()
    assert not math.isnan(table["token_hit_ratio"].iloc[0])


def test_an_experiment_without_traces_has_nothing_to_route(experiment):
    from kvscope.harness.analysis.registry import PageContext

    res = load_results(experiment)
    res.experiment = res.experiment.model_copy(update={"traces": {}})
    table, per_session = P.routing_whatifs(res)
    assert not len(table) and per_session == {}
    assert P._routing_page(PageContext(res)) == []


def test_the_page_renders_in_the_report_and_in_chromium(tmp_path):
    from kvscope.harness.report.browser import check_report_pages
    from kvscope.harness.report.render import render_report
    from kvscope.harness.results.loaders import load_report_file

    root = build_experiment(tmp_path / "exp")
    index = render_report(root, notebooks=["routing"], progress=False)
    [entry] = load_report_file(index.parent).notebooks
    assert entry.ok, entry.error
    assert {"figures/routing/routing_cost_latency.png", "figures/routing/routing_switch_penalty.png"} <= set(
        entry.figures), entry.figures
    require_chromium()
    [page] = check_report_pages(index.parent, [index.parent / "routing.html"])
    assert not page.problems, page.problems
    assert page.images >= 2
    text = page.visible_text
    assert "agent: route " in text and "sticky routing changes its hit rate by +" in text, text[:3000]
    assert "Verdicts" in text and "all-large" in text
