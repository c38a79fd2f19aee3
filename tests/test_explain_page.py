"""The report's `explain` page as data: per-workload attribution across an experiment, its tidy frames and its
findings, on small experiments built on disk from generated traces (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import explain_experiment as X
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.explain import explain_trace
from kvscope.harness.results.findings_file import FINDINGS_NAME, load_findings_file
from kvscope.harness.results.loaders import ExperimentResults
from kvscope.harness.results.schemas import ExperimentFile, ExperimentSpecCore

B = 16


@pytest.fixture(scope="module")
def traces(tiny_model_dir, tmp_path_factory) -> Path:
    """<root>/traces/{agent,agent-ts,solo}: append-only, timestamped, and one append-only session alone."""
    from kvscope.workloads.generate import generate_from_file

    root = tmp_path_factory.mktemp("explain-exp")
    for name, spec, sessions in (("agent", "agent-coding", 2), ("agent-ts", "agent-coding-timestamped", 2),
                                 ("solo", "agent-coding", 1)):
        generate_from_file(spec, tiny_model_dir, seed=3, scale=0.02, sessions=sessions,
                           max_context=1500).write(root / "traces" / name)
    return root


def _cell(trace_dir: Path, workload: str, server: str, *, caching: bool = True, concurrency: int = 1,
          cached: list[int] | None = None, block_size: int = B) -> tuple[dict, pd.DataFrame]:
    """One cell replaying the workload's trace; its cached tokens are `cached` (default: the simulation's)."""
    name = f"{server}__{workload}__c{concurrency}__r0"
    n = json.loads((trace_dir / "trace.json").read_text())["num_requests"]
    if cached is None:
        sim = explain_trace(trace_dir, block_size)
        cached = [a.predicted_cached_tokens for a in sim.requests] if caching else [0] * n
    rec = pd.DataFrame({"cell": name, "server": server, "workload": workload, "request_id": np.arange(n),
                        "cached_tokens": cached, "prompt_tokens": 1000, "session_id": "s", "error_class": None,
                        "in_window": True})
    row = {"cell": name, "server": server, "workload": workload, "load": f"c{concurrency}", "repeat": 0,
           "status": "ok", "prefix_caching": caching, "speculative": False, "block_size": block_size,
           "concurrency": concurrency}
    return row, rec


def _results(root: Path, cells: list[tuple[dict, pd.DataFrame]]) -> ExperimentResults:
    spec = ExperimentSpecCore.model_validate({"name": "t"})
    workloads = {c["workload"] for c, _ in cells}
    experiment = ExperimentFile(experiment="t", run_id="r", spec=spec, spec_path="t.yaml", created_at=0.0,
                                traces={w: f"traces/{w}" for w in workloads})
    return ExperimentResults(root=root, experiment=experiment, cells=pd.DataFrame([c for c, _ in cells]),
                             requests=pd.concat([r for _, r in cells], ignore_index=True), metrics=pd.DataFrame())


def test_each_workload_is_explained_once_from_its_least_concurrent_caching_run(traces):
    t = traces / "traces"
    n = json.loads((t / "agent" / "trace.json").read_text())["num_requests"]
    res = _results(traces, [_cell(t / "agent", "agent", "apc", concurrency=4, cached=[0] * n),
                            _cell(t / "agent", "agent", "apc", concurrency=1),
                            _cell(t / "agent", "agent", "no-apc", caching=False),
                            _cell(t / "agent-ts", "agent-ts", "no-apc", caching=False)])
    by = {wx.workload: wx for wx in X.explain_workloads(res)}
    assert list(by) == ["agent", "agent-ts"]
    # the sequential caching run, not the concurrent one that hit nothing, nor the caching-off server
    assert by["agent"].observed_from == "apc__agent__c1__r0" and by["agent"].server == "apc"
    assert by["agent"].explanation.hit_rate > 0.6
    # no run with prefix caching: the infinite-cache simulation stands in, and the page says so
    assert by["agent-ts"].observed_from == X.SIMULATED and by["agent-ts"].server is None
    assert X.workload_frame(list(by.values())).set_index("workload").loc["agent-ts", "observed_from"] == X.SIMULATED


def test_timestamp_attribution_frames_and_headline_finding(traces):
    t = traces / "traces"
    res = _results(traces, [_cell(t / "agent", "agent", "apc"), _cell(t / "agent-ts", "agent-ts", "apc")])
    explained = X.explain_workloads(res)
    causes = X.cause_frame(explained)
    assert causes.groupby("workload")["share"].sum().round(9).eq(1).all()
    ts = causes[causes["workload"] == "agent-ts"].iloc[0]
    assert ts["cause"] == "volatile_field" and ts["share"] > 0.9 and ts["requests"] > 0
    assert ts["what_if_hit_rate"] > ts["hit_rate"] + 0.5  # removing the timestamp restores reuse
    wl = X.workload_frame(explained).set_index("workload")
    assert wl.loc["agent-ts", "recomputed_tokens"] == causes[causes["workload"] == "agent-ts"][
        "recomputed_tokens"].sum()
    assert wl.loc["agent-ts", "top_cause"] == "volatile_field"

    found = X.explain_findings(explained)
    assert 2 <= len(found) <= 4
    head = found[0]
    assert head.question == "habit" and head.notebook == "explain" and head.figure == "recomputed_by_cause"
    assert head.sentence.startswith("agent-ts: a volatile field (date, time or id), segment 1 (volatile) at token")
    assert f"causes {ts['share'] * 100:.0f} % of the" in head.sentence
    assert f"from {ts['hit_rate'] * 100:.0f} % to {ts['what_if_hit_rate'] * 100:.0f} %" in head.sentence
    assert all(f.question == "cache_break" for f in found[1:])  # one headline only
    assert X.recomputed_title(explained).startswith("agent-ts: volatile field causes")

    what_if = X.what_if_frame(explained)
    observed = what_if[(what_if["workload"] == "agent-ts") & (what_if["scenario"] == "as observed")]
    assert observed["hit_rate"].item() == pytest.approx(ts["hit_rate"])
    assert set(X.what_if_palette(what_if)) == set(what_if["scenario"])


def test_a_workload_with_nothing_recomputed_gets_a_sentence_not_a_bar(traces):
    res = _results(traces, [_cell(traces / "traces" / "solo", "solo", "apc")])
    explained = X.explain_workloads(res)
    assert explained[0].explanation.recomputed_tokens == 0
    assert len(X.cause_frame(explained)) == 0 and len(X.what_if_frame(explained)) == 0
    assert len(X.costliest_requests(explained)) == 0
    [f] = X.explain_findings(explained)
    assert f.sentence.startswith("Nothing recomputed in solo (hit rate ") and f.question == "cache_break"
    assert X.recomputed_title(explained) == "Nothing was recomputed"
    assert X.what_if_title(explained) == "No cause to remove"


def test_a_cached_prefix_the_server_did_not_hit_is_eviction(traces):
    t = traces / "traces" / "solo"
    sim = explain_trace(t, B)
    cached = [a.predicted_cached_tokens for a in sim.requests]
    victim = max(range(len(cached)), key=cached.__getitem__)
    lost = cached[victim]
    cached[victim] = 0
    explained = X.explain_workloads(_results(traces, [_cell(t, "solo", "apc", cached=cached)]))
    causes = X.cause_frame(explained)
    assert causes[["cause", "recomputed_tokens"]].values.tolist() == [["evicted", lost]]
    top = X.costliest_requests(explained).iloc[0]
    assert top["request_id"] == victim and top["cause"] == "evicted"
    # without the eviction the hit rate is the simulation's
    assert causes["what_if_hit_rate"].item() == pytest.approx(sim.hit_rate, abs=1e-6)


def test_page_findings_are_written_for_the_index(traces, tmp_path):
    t = traces / "traces"
    res = _results(traces, [_cell(t / "agent-ts", "agent-ts", "apc")])
    found = F.write_page_findings(res, "explain", tmp_path)
    saved = load_findings_file(tmp_path / FINDINGS_NAME)
    assert saved.notebook == "explain" and [f.sentence for f in saved.findings] == [f.sentence for f in found]
    assert saved.findings[0].question == "habit" and saved.findings[0].page == "explain.html"


def test_an_experiment_without_traces_says_there_is_nothing_to_attribute(tmp_path):
    res = _results(tmp_path, [({"cell": "x", "server": "apc", "workload": "gone", "status": "ok"},
                               pd.DataFrame({"cell": ["x"], "request_id": [0], "cached_tokens": [0]}))])
    assert X.explain_workloads(res) == []
    [f] = X.explain_findings([])
    assert "nothing to attribute" in f.sentence


def test_imported_transcript_puts_observed_provider_reads_beside_the_model(shared_data, tiny_model_dir, tmp_path):
    from kvscope.workloads.importers import import_claude_code

    sample = shared_data / "agent-traces/tracelab/example_sessions/claude/session.converted.jsonl"
    import_claude_code(sample, tiny_model_dir).write(tmp_path / "traces" / "cc")
    res = _results(tmp_path, [({"cell": "x", "server": "apc", "workload": "cc", "status": "ok",
                                "prefix_caching": False}, pd.DataFrame({"cell": ["x"], "request_id": [0]}))])
    explained = X.explain_workloads(res)
    per_request, agreements = X.provider_frame(explained)
    assert len(per_request) == 10 and per_request["observed_cache_read_tokens"].iloc[0] == 27217
    assert (per_request["preset"] == "anthropic-sonnet-5m").all()
    ag = X.agreement_frame(agreements).iloc[0]
    assert ag["workload"] == "cc" and ag["requests"] == 10 and ag["shares_compared"] == 10
    gap = (per_request["observed_share"] - per_request["predicted_share"]).abs().mean() * 100
    assert ag["mean_abs_share_gap_pp"] == pytest.approx(gap)
    sentence = [f.sentence for f in X.explain_findings(explained) if "provider" in f.sentence]
    assert sentence == [f"cc: the observed provider cache reads differ from the anthropic-sonnet-5m cache model's by "
                        f"{gap:.1f} percentage points on average over 10 requests (as shares of each side's prompt)."]


def test_unrelated_prompts_are_not_cache_breaks(tmp_path):
    """Prompts of random, unrelated ids share nothing with any predecessor: nothing was there to reuse, so
    nothing is recomputed and the page names no cause (before, a diverging first segment counted the whole
    prompt as recomputed)."""
    from kvscope.workloads.generate import synthetic_trace

    trace_dir = synthetic_trace(3, steps=3).write(tmp_path / "traces" / "random")
    ex = explain_trace(trace_dir, B)
    assert ex.recomputed_tokens == 0 and ex.causes == []
    assert all(a.cause is None for a in ex.requests)
