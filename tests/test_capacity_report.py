"""The report's capacity sentences on constructed sweeps (no server): where the old report stated the wrong thing.

The quickstart's sweep recorded "baseline holds 5 concurrent agent-sweep sessions" where level 5 only ever had
4.1 sessions in flight (its 8-session trace ran dry), the footprint table and vLLM's own
``max_concurrency_at_max_len`` said 4 and 2 on the same page without a word on why, and the speculative
recommendation did not say that n-gram lowered the capacity. Each test builds that situation from an
experiment.json's records."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from kvscope.harness.analysis import claims as C
from kvscope.harness.analysis.pages import concurrency
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import CapacityEntry, ExperimentFile, ExperimentSpecCore, ServerEntry

# (load, TTFT p90 s, preemptions, mean sessions in flight): the quickstart's recorded sweeps (20261205-113415)
BASELINE_QUICKSTART = [(1, 0.0251, 0, 1.0), (5, 0.0312, 0, 4.10), (6, 0.1486, 2, 4.47), (7, 0.2753, 3, 5.44)]
NGRAM_QUICKSTART = [(1, 0.0231, 0, 1.0), (4, 0.0338, 0, 3.89), (5, 0.0313, 1, 4.16)]


def entry(server: str, levels, recorded_capacity: float | None, unloaded_ms: float) -> CapacityEntry:
    """A sweep's experiment.json entry as the old rule recorded it (``recorded_capacity``, its sentence)."""
    points = [{"load": float(c), "ttft_p90_s": t, "preemptions": float(p), "mean_sessions_in_flight": f,
               "cell": f"cells/{server}__agent-sweep__sweep-c{c}__r0"} for c, t, p, f in levels]
    return CapacityEntry.model_validate({
        "server": server, "workload": "agent-sweep", "kind": "concurrency", "slo_ttft_p90_ms": 3 * unloaded_ms,
        "capacity": recorded_capacity, "interpolated": None, "ceiling": "preemption",
        "under_driven": [float(c) for c, _, _, f in levels if f < 0.9 * c], "points": points,
        "sentence": f"{server} holds {recorded_capacity:g} concurrent agent-sweep sessions",
        "slo_ttft_p90": "3x_unloaded", "slo_unloaded_ttft_p90_ms": unloaded_ms,
        "slo_unloaded_source": "measured at concurrency 1"})


def facts(server: str) -> ServerEntry:
    return ServerEntry.model_validate({"config": {}, "log": f"servers/{server}.log", "facts": {
        "max_model_len": 4096, "block_size": 128, "num_blocks": 64, "kv_capacity_tokens": 8192,
        "max_concurrency": 2.0, "prefix_caching": True}})


def sweep_requests(sessions: int = 8, steps: int = 14) -> pd.DataFrame:
    """The sweep workload's records: sessions whose context grows ~125 tokens a step to ~1,800 tokens, each
    session's first prompt sharing nothing with another's (infinite-cache prediction 0 at step 0)."""
    rows = []
    for s in range(sessions):
        for step in range(steps):
            prompt = 300 + 115 * step + 3 * s
            rows.append({"cell": "baseline__agent-sweep__sweep-c1__r0", "server": "baseline",
                         "workload": "agent-sweep", "load": "sweep-c1", "repeat": 0, "session_id": f"s{s}",
                         "step": step, "prompt_tokens": prompt, "output_tokens": 12,
                         "predicted_cached_tokens": 0 if step == 0 else (prompt - 115) // 128 * 128,
                         "ttft_s": 0.02, "error_class": None, "in_window": True})
    return pd.DataFrame(rows)


def results(capacity: list[CapacityEntry], tmp: Path = Path("/nonexistent")) -> ExperimentResults:
    spec = ExperimentSpecCore.model_validate({"name": "t", "slo": {"ttft_ms": 250},
                                              "cost": {"pricing": ["anthropic-sonnet-5m"]}})
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                servers={"baseline": facts("baseline"), "ngram-k4": facts("ngram-k4")},
                                capacity=capacity)
    req = sweep_requests()
    cells = pd.DataFrame([{"cell": "baseline__agent-sweep__sweep-c1__r0", "server": "baseline",
                           "workload": "agent-sweep", "load": "sweep-c1", "repeat": 0, "status": "ok"}])
    return ExperimentResults(root=tmp, experiment=experiment, cells=cells, requests=req, metrics=pd.DataFrame())


def quickstart(with_driven_4: bool = False) -> ExperimentResults:
    base = list(BASELINE_QUICKSTART)
    if with_driven_4:
        base = sorted(base + [(4, 0.0300, 0, 3.89)])
    return results([entry("baseline", base, 5.0, 25.06), entry("ngram-k4", NGRAM_QUICKSTART, 4.0, 23.10)])


def test_the_report_never_credits_a_level_that_was_not_driven():
    """The recorded answer said "holds 5"; the report re-reads the levels: 5 had 4.1 of 5 sessions in flight,
    so it does not count, and it is named with the shortfall wherever the level appears."""
    claims = {c.key: c for c in C.capacity_claims(quickstart())}
    base = claims["capacity:baseline:agent-sweep"]
    assert base.value == "holds_1" and base.numbers["capacity_load"] == 1
    assert "holds 5" not in base.sentence
    assert ("5 met the SLO with only 4.1 sessions in flight on average (under-driven: below 4.5, the level less "
            "10 %), so it does not count") in base.sentence
    assert "c5 (TTFT p90 31 ms, 4.1 sessions in flight: under-driven)" in base.sentence
    # with the driven level 4 the planned search now measures, the answer is 4
    claims = {c.key: c for c in C.capacity_claims(quickstart(with_driven_4=True))}
    assert claims["capacity:baseline:agent-sweep"].value == "holds_4"
    caps = concurrency.capacity_predictions(quickstart(with_driven_4=True)).set_index("server")
    assert caps.loc["baseline", "measured_capacity"] == 4 and "measured 4" in caps.loc["baseline", "headline"]
    levels = concurrency.sweep_levels(quickstart()).set_index(["server", "load"])
    assert levels.loc[("baseline", 5.0), "under_driven"] and levels.loc[("baseline", 5.0), "meets_slo"]
    assert not levels.loc[("baseline", 5.0), "counts_toward_capacity"]
    assert levels.loc[("ngram-k4", 4.0), "counts_toward_capacity"]


def test_the_edge_says_how_far_inside_the_slo_and_which_criterion_decided():
    """n-gram's capacity of 4 rests on one preemption at 5 whose TTFT p90 is well inside its SLO: said so."""
    ngram = {c.key: c for c in C.capacity_claims(quickstart())}["capacity:ngram-k4:agent-sweep"]
    assert ngram.value == "holds_4"
    assert "(at 4: TTFT p90 34 ms, 36 ms under the SLO, 3.9 sessions in flight)" in ngram.sentence
    assert ("at 5 it preempts (1 preemption, TTFT p90 31 ms, 38 ms under the SLO, 4.2 sessions in flight "
            "(under-driven): the preemption criterion decided); each level ran once (one preemption decides this "
            "edge)") in ngram.sentence


def test_the_three_session_counts_of_the_page_are_reconciled_in_one_sentence():
    found = concurrency.capacity_findings(quickstart(with_driven_4=True))
    [why] = [f for f in found if f.sentence.startswith("Three session counts")]
    assert ("vLLM's max_concurrency_at_max_len (2) divides the 8,192-token KV pool by max_model_len (4,096 "
            "tokens), as if every session filled its window") in why.sentence
    fp = concurrency.session_footprint(quickstart())
    last = fp[fp["workload"] == "agent-sweep"].sort_values("step").iloc[-1]
    assert f"the footprint table ({last['sessions_that_fit']:.0f}) divides it" in why.sentence
    assert "sharing no prefix across sessions" in why.sentence
    assert "held 4 (baseline, preempting from c6) and 4 (ngram-k4, preempting from c5) driven sessions" in why.sentence
    assert why.numbers["max_concurrency_at_max_len"] == 2 and why.numbers["measured_capacity_baseline"] == 4


def test_the_speculative_recommendation_says_when_it_lowers_capacity():
    """Baseline driven at 5 (4.8 in flight), n-gram preempting at 5 with a higher TTFT p90: what gets worse names
    the capacity 5 → 4 and the TTFT p90 at 5; with equal capacities nothing is said."""
    base = [(1, 0.025, 0, 1.0), (5, 0.055, 0, 4.8), (6, 0.15, 2, 5.5)]
    ngram = [(1, 0.023, 0, 1.0), (4, 0.034, 0, 3.9), (5, 0.077, 1, 4.7)]
    res = results([entry("baseline", base, 5.0, 25.0), entry("ngram-k4", ngram, 4.0, 23.0)])
    [loss] = C._capacity_losses(res, "ngram-k4", "baseline")
    assert loss == ("capacity on agent-sweep 5 → 4 concurrent sessions (baseline → ngram-k4); at c5 it preempts, "
                    "TTFT p90 55 → 77 ms (+40 %) (one run per level)")
    ab = pd.DataFrame(columns=["A", "B", "metric", "verdict", "relative", "workload", "load"])
    assert loss in C._what_gets_worse(res, ab, "ngram-k4", "baseline")
    rec = C.speculative_recommendation(C.Claim("speculative:ngram-k4", "inconclusive", "",
                                               {"better": 0.0, "comparisons": 1.0,
                                                "median_throughput_change": 0.05}, loss))
    assert "it costs capacity on agent-sweep 5 → 4 concurrent sessions" in rec.sentence
    assert C._capacity_losses(quickstart(with_driven_4=True), "ngram-k4", "baseline") == []  # 4 and 4
