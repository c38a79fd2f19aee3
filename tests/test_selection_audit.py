"""Every number of the report carries its selection, and the claims audit recomputes it from the records.

Each test builds the experiment on which the old pages pooled: a "TTFT p50 (median over workloads)", an SLO
share that mixed load levels, a hit-rate leader pooled over loads (the finding and the figure title named
different workloads), a habit's hit rates pooled over levels beside a TTFT verdict at one level, a concurrency
level's TTFT p90 over several workloads. On each, the sentence now names its workload and level, and the audit
(`analysis.audit`) recomputes every stated number from the request records and finds it written in the sentence.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kvscope.harness.analysis import audit as A
from kvscope.harness.analysis import common
from kvscope.harness.analysis import findings as F
from kvscope.harness.analysis.pages import concurrency, hit_rates, latency
from kvscope.harness.results.findings_file import FINDINGS_NAME
from kvscope.harness.results.selection import Selection, Statement, sorted_loads
from pydantic import ValidationError

from tests.test_findings import _cell, _results


def _pooled_experiment(tmp=None):
    """agent at c1 (fast, 50 % hit) and c2 (slow, 95 % hit), chat at c1 only (middling, 60 % hit)."""
    cells = [_cell("apc", "agent", "c1", hit=0.50, ttft_s=0.030),
             _cell("apc", "agent", "c2", hit=0.95, ttft_s=0.400, seed=1),
             _cell("apc", "chat", "c1", hit=0.60, ttft_s=0.200, seed=2)]
    return _results(cells, slo_ttft_ms=250, **({"tmp": tmp} if tmp else {}))


def _assert_audited(res, found):
    audit = A.audit_findings(res, found)
    assert audit.lines, "no statement to audit"
    assert not audit.failures, audit.summary()
    return audit


def test_a_selection_cannot_pool_workloads_or_loads_unless_it_is_a_distribution():
    with pytest.raises(ValidationError, match="pools them"):
        Selection(servers=("apc",), workloads=("agent", "chat"), loads=("c1",))
    with pytest.raises(ValidationError, match="pools them"):
        Selection(servers=("apc",), workloads=("agent",), loads=("c1", "c2"))
    one = Selection(servers=("apc",), workloads=("agent",), loads=("c2",), repeats=3)
    assert one.words() == "agent at c2 (3 repeats pooled) on apc"
    dist = Selection(servers=("apc", "off"), workloads=("a", "b"), loads=("c1", "c2", "c4"),
                     distribution_over=("server", "workload", "load"))
    assert "pooled over 2 workloads and 3 load levels (a distribution, not a comparison)" in dist.words()


def test_load_levels_sort_by_their_number_not_their_text():
    assert sorted_loads(["sweep-c5", "sweep-c12", "sweep-c4", "timestamps", "c2"]) == \
        ["c2", "sweep-c4", "sweep-c5", "sweep-c12", "timestamps"]
    res = _results([_cell("apc", "sweep", f"sweep-c{n}", hit=0.5, ttft_s=0.03) for n in (5, 12, 4)])
    assert common._load_order(res) == ["sweep-c4", "sweep-c5", "sweep-c12"]


def test_ttft_and_slo_shares_are_per_workload_at_a_named_level_and_recompute_from_the_records():
    """The old sentence was 'TTFT p50 at c1 (median over workloads): apc 115 ms' — a number of neither workload —
    and the SLO share was a mean over every cell's level (c1 and c2 together)."""
    res = _pooled_experiment()
    found = latency.latency_findings(res)
    ttft, share = found
    assert "median over workloads" not in ttft.sentence
    assert "agent at c1: apc 30 ms" in ttft.sentence and "chat at c1: apc 200 ms" in ttft.sentence
    # the SLO share at each workload's highest level: agent at c2 misses the 250 ms SLO, chat at c1 meets it
    assert "agent at c2: apc 0 %" in share.sentence and "chat at c1: apc 100 %" in share.sentence
    assert {st.selection.loads for st in share.statements} == {("c2",), ("c1",)}
    _assert_audited(res, found)


def test_the_hit_rate_leader_is_one_sentence_for_finding_and_title_at_stated_levels():
    """Pooled over loads, agent (50 % at c1, 95 % at c2) 'reused the most'; at the same, stated level, chat does."""
    res = _pooled_experiment()
    leader = hit_rates.hit_rate_leader(res)
    assert leader is not None
    assert "chat (c1) reuses the most, 60 %" in leader.sentence and "agent (c1) the least, 50 %" in leader.sentence
    [first, *_] = hit_rates.hit_rate_findings(res)
    assert first.sentence == leader.sentence  # the figure title (notebook) draws this same finding
    assert leader in A.figure_titles(res)
    _assert_audited(res, [leader])
    fig = hit_rates.hit_rate_figure_table(res)
    assert set(zip(fig["workload"], fig["load"])) == {("agent", "c1"), ("chat", "c1")}


def test_a_habit_states_the_hit_rates_at_the_level_of_its_ttft_verdict():
    """The habit's TTFT verdict is at c1; its hit rates were pooled over c1 and c2 (agent 72 % instead of 84 %)."""
    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.03),
                    _cell("apc", "agent", "c2", hit=0.60, ttft_s=0.05, seed=3),
                    _cell("apc", "agent-ts", "c1", hit=0.0, ttft_s=0.12, seed=1)])
    [f] = hit_rates.habit_findings(res, resamples=200)
    assert "at c1" in f.sentence and "from 84 % to 0 %" in f.sentence
    _assert_audited(res, [f])


def test_a_concurrency_level_is_never_pooled_over_workloads():
    """Old: one row per (server, load), its TTFT p90 over every workload's requests at that level."""
    cells = [_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.040, concurrency=1),
             _cell("apc", "agent", "c2", hit=0.8, ttft_s=0.300, concurrency=2, seed=1),
             _cell("apc", "chat", "c1", hit=0.8, ttft_s=0.050, concurrency=1, seed=2),
             _cell("apc", "chat", "c2", hit=0.8, ttft_s=0.100, concurrency=2, seed=3)]
    res = _results(cells, slo_ttft_ms=250)
    levels = concurrency.capacity_by_level(res)
    assert list(zip(levels["workload"], levels["load"])) == [("agent", "c1"), ("agent", "c2"), ("chat", "c1"),
                                                             ("chat", "c2")]
    found = {f.sentence.split(" on ")[1].split()[0]: f for f in concurrency.capacity_findings(res)}
    assert "holds load c1" in found["agent"].sentence and "holds load c2" in found["chat"].sentence
    _assert_audited(res, list(found.values()))


def test_the_audit_catches_a_number_from_other_records_and_a_sentence_that_does_not_write_it():
    res = _pooled_experiment()
    [ttft, _] = latency.latency_findings(res)
    agent_c2 = common.one_selection(res, "apc", "agent", "c2")
    wrong_records = ttft.model_copy(update={"statements": [
        ttft.statements[0].model_copy(update={"selection": agent_c2})]})  # 30 ms stated, the records say 400
    [line] = A.audit_findings(res, [wrong_records]).failures
    assert line.recomputed == pytest.approx(0.4, rel=0.15) and line.written
    unwritten = ttft.model_copy(update={"sentence": "TTFT p50 is low."})
    assert all(not line.written for line in A.audit_findings(res, [unwritten]).failures)
    bare = ttft.model_copy(update={"statements": []})
    assert A.audit_findings(res, [bare]).unaudited == [bare]


def test_the_audit_reads_a_rendered_reports_findings_files(tmp_path):
    """`audit_experiment` on a finished directory audits the findings.json files the report wrote."""
    res = _pooled_experiment(tmp=tmp_path)
    for page in ("latency", "hit_rates"):
        (tmp_path / "report" / "figures" / page).mkdir(parents=True)
        F.write_page_findings(res, page, tmp_path / "report" / "figures" / page, resamples=200)
    assert (tmp_path / "report" / "figures" / "latency" / FINDINGS_NAME).exists()
    found = A.report_findings(res)
    assert {f.notebook for f in found} >= {"latency", "hit_rates"}
    audit = _assert_audited(res, found)
    assert {line.metric for line in audit.lines} >= {"ttft_p50_s", "slo_share", "hit_rate"}


def test_a_statement_round_trips_through_the_findings_file():
    st = Statement(metric="slo_share", value=0.5, slo_ttft_ms=250.0,
                   selection=Selection(servers=("a",), workloads=("w",), loads=("c1",), repeats=2))
    assert Statement.model_validate_json(st.model_dump_json()) == st
    assert pd.notna(st.value)


#: A quickstart run recorded by `make demo` (tests/data/quickstart-20261205/README.md says what and how).
RECORDED_QUICKSTART = Path(__file__).parent / "data" / "quickstart-20261205"


def test_the_claims_audit_passes_on_the_quickstart(tmp_path):
    """The audit on the quickstart's own records, in CI: every page's findings computed now by the current code,
    every stated number recomputed from the records of the selection it names. ``KVSCOPE_AUDIT_EXPERIMENT``
    names another finished experiment directory to audit instead (a fresh quickstart's, say)."""
    given = os.environ.get("KVSCOPE_AUDIT_EXPERIMENT")
    audit = A.audit_experiment(given or RECORDED_QUICKSTART)
    print(audit.summary())
    assert not audit.failures, audit.summary()
    if not given:  # the recording's count: capacity, cost, habit, A/B and speculative numbers included
        metrics = {line.metric for line in audit.lines}
        assert len(audit.lines) >= 45 and metrics >= {"ttft_p90_s", "hit_rate", "slo_share", "sessions_in_flight",
                                                      "hit_rate_gain_pp", "output_throughput_change",
                                                      "self_hosted_usd_per_1000_sessions"}, audit.summary()


def _sweep_experiment(stated_c4_ttft_p90_s=None, stated_c4_in_flight=None):
    """A baseline sweep at levels 1 and 4 over four sessions of five requests; level 4 is slower (TTFT 15-30 ms)
    and level 1 fast (10-20 ms). Its experiment.json entry states what the records give unless told otherwise."""
    import numpy as np
    from kvscope.harness.analysis.capacity import mean_in_flight
    from tests.test_capacity_report import entry, results

    rows = []
    for level, base_s in ((1, 0.010), (4, 0.015)):
        for s in range(4):
            start = 0.0 if level == 4 else s * 1.0
            for step in range(5):
                ttft = base_s * (1 + (s * 5 + step) / 20)
                sent = start + step * 0.2
                rows.append({"cell": f"baseline__agent-sweep__sweep-c{level}__r0", "server": "baseline",
                             "workload": "agent-sweep", "load": f"sweep-c{level}", "repeat": 0,
                             "session_id": f"s{s}", "step": step, "prompt_tokens": 500, "cached_tokens": 0,
                             "output_tokens": 10, "ttft_s": ttft, "sent_s": sent, "done_s": sent + 0.15,
                             "error_class": None, "in_window": True})
    req = pd.DataFrame(rows)

    def level(n):
        r = req[req["load"] == f"sweep-c{n}"]
        return (float(np.percentile(r["ttft_s"], 90)),
                mean_in_flight(r["session_id"].tolist(), r["sent_s"].to_numpy(), r["done_s"].to_numpy()))
    (t1, f1), (t4, f4) = level(1), level(4)
    t4 = t4 if stated_c4_ttft_p90_s is None else stated_c4_ttft_p90_s
    f4 = f4 if stated_c4_in_flight is None else stated_c4_in_flight
    res = results([entry("baseline", [(1, t1, 0, f1), (4, t4, 0, f4)], 4.0, t1 * 1e3)])
    cells = req[["cell", "server", "workload", "load", "repeat"]].drop_duplicates().assign(status="ok")
    return res.__class__(root=res.root, experiment=res.experiment, cells=cells.reset_index(drop=True),
                         requests=req, metrics=pd.DataFrame()), (t1, t4, f4)


def test_a_capacity_sentence_is_audited_level_by_level_and_a_pooled_figure_is_caught():
    """The capacity sentence states every level's TTFT p90 and the capacity level's sessions in flight; each is
    recomputed from that level's records alone. A TTFT p90 taken over both levels' records (what a pooled
    read once gave) and an in-flight figure that is not the records' are failures."""
    from kvscope.harness.analysis.claims import capacity_claims

    res, (t1, t4, f4) = _sweep_experiment()
    found = [c.finding("capacity", "concurrency") for c in capacity_claims(res)]
    audit = _assert_audited(res, found)
    assert {(line.metric, line.selection) for line in audit.lines} == {
        ("ttft_p90_s", "agent-sweep at sweep-c1 on baseline"), ("ttft_p90_s", "agent-sweep at sweep-c4 on baseline"),
        ("sessions_in_flight", "agent-sweep at sweep-c4 on baseline")}
    pooled_p90 = float(np.percentile(res.requests["ttft_s"], 90))
    bad, _ = _sweep_experiment(stated_c4_ttft_p90_s=pooled_p90)
    wrong = A.audit_findings(bad, [c.finding("capacity", "concurrency") for c in capacity_claims(bad)]).failures
    assert [(w.metric, w.selection) for w in wrong] == [("ttft_p90_s", "agent-sweep at sweep-c4 on baseline")]
    bad, _ = _sweep_experiment(stated_c4_in_flight=f4 + 0.3)
    wrong = A.audit_findings(bad, [c.finding("capacity", "concurrency") for c in capacity_claims(bad)]).failures
    assert [w.metric for w in wrong] == ["sessions_in_flight"]


def test_a_habits_hit_rate_gain_is_audited_at_its_level_and_a_pooled_gain_is_caught():
    """"Avoid a timestamp: without it, hit rate 84 pp higher" — the gain is the reference's hit rate less the
    habit's at the verdict's level (c1); agent at c2 hits 60 %, so a gain over both levels would read 72 pp."""
    res = _results([_cell("apc", "agent", "c1", hit=0.84, ttft_s=0.03),
                    _cell("apc", "agent", "c2", hit=0.60, ttft_s=0.05, seed=3),
                    _cell("apc", "agent-ts", "c1", hit=0.0, ttft_s=0.12, seed=1)])
    [f] = hit_rates.habit_recommendations(res, resamples=200)
    assert "hit rate 84 pp higher" in f.sentence
    [line] = _assert_audited(res, [f]).lines
    assert line.metric == "hit_rate_gain_pp" and line.recomputed == pytest.approx(84.0)
    pooled = f.model_copy(update={"statements": [f.statements[0].model_copy(update={"value": 72.0})],
                                  "sentence": f.sentence.replace("84 pp", "72 pp")})
    [bad] = A.audit_findings(res, [pooled]).failures
    assert bad.written and bad.recomputed == pytest.approx(84.0)


def test_a_throughput_median_over_comparisons_is_audited_from_the_summaries():
    """A/B and prefix-caching sentences state the median over workload × load comparisons of B's output
    throughput against A's; the audit recomputes it from the cells' output tokens/s."""
    cells = [_cell("off", "agent", "c1", hit=0.8, ttft_s=0.06, caching=False, tok_per_s=100.0),
             _cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03, tok_per_s=120.0, seed=1),
             _cell("off", "chat", "c1", hit=0.5, ttft_s=0.06, caching=False, tok_per_s=100.0, seed=2),
             _cell("apc", "chat", "c1", hit=0.5, ttft_s=0.04, tok_per_s=140.0, seed=3),
             _cell("off", "code", "c1", hit=0.5, ttft_s=0.06, caching=False, tok_per_s=100.0, seed=4),
             _cell("apc", "code", "c1", hit=0.5, ttft_s=0.04, tok_per_s=190.0, seed=5)]
    res = _results(cells)
    found = hit_rates.prefix_caching_recommendations(res, resamples=200)
    [f] = found
    assert "output throughput 40 % higher with caching on (median of 3" in f.sentence
    [line] = _assert_audited(res, found).lines
    assert line.metric == "output_throughput_change" and line.recomputed == pytest.approx(0.40)
    # a mean over the comparisons (+50 %) is not the median the sentence names: caught
    mean = f.model_copy(update={"statements": [f.statements[0].model_copy(update={"value": 0.5})]})
    assert A.audit_findings(res, [mean]).failures


def test_self_hosted_cost_per_session_is_audited_from_durations_and_sessions():
    res = _results([_cell("apc", "agent", "c1", hit=0.8, ttft_s=0.03)])
    res.cells["duration_s"] = 90.0  # summary.json's figure
    sessions = res.requests["session_id"].nunique()
    sel = common.one_selection(res, "apc", "agent", "c1")
    truth = 0.5 * 90.0 / 3600.0 / sessions * 1000.0
    st = Statement(metric="self_hosted_usd_per_1000_sessions", value=truth, hourly_usd=0.5, selection=sel)
    assert A.recompute(res, st) == pytest.approx(truth)
    assert common.stated(st) == f"${truth:,.2f} per 1,000 sessions"
    twice = st.model_copy(update={"hourly_usd": 1.0})  # priced at another rate than the one stated
    assert A.recompute(res, twice) == pytest.approx(2 * truth)


def test_the_index_says_how_many_numbers_were_recomputed_and_lists_any_that_disagree(tmp_path):
    """The report's index carries the audit: "N numbers ... 0 disagree" on a sound report; a findings file
    whose TTFT was taken from other records is named there, with what the records give."""
    from kvscope.harness.report.summary import audit_html
    from kvscope.harness.results.findings_file import load_findings_file, write_findings_file

    res = _pooled_experiment(tmp=tmp_path)
    assert audit_html(res, tmp_path / "report") == ""  # nothing rendered: nothing to say
    page = tmp_path / "report" / "figures" / "latency"
    page.mkdir(parents=True)
    F.write_page_findings(res, "latency", page, resamples=200)
    sound = audit_html(res, tmp_path / "report")
    assert "Claims audit" in sound and ": 0 disagree." in sound and 'class="audit-ok"' in sound
    file = load_findings_file(page / FINDINGS_NAME)
    first = file.findings[0]
    moved = first.model_copy(update={"statements": [first.statements[0].model_copy(update={
        "selection": common.one_selection(res, "apc", "agent", "c2")})]})
    write_findings_file(page / FINDINGS_NAME, file.model_copy(update={"findings": [moved, *file.findings[1:]]}))
    wrong = audit_html(res, tmp_path / "report")
    assert ": 1 disagree." in wrong and 'class="warn"' in wrong and "agent at c2 on apc" in wrong
