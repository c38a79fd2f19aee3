"""`kvscope explain --routing`: the cause model_switch (history recomputed because the session's previous step
ran on another model), what the other stickiness would save, decisions from a recorded run, and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvscope.harness.analysis.causes import Cause
from kvscope.harness.analysis.explain import explain_trace
from kvscope.harness.analysis.explain_routing import route_for_explain
from kvscope.harness.cachemodel import model_routing as M
from kvscope.harness.cli.main import main

from tests.offline.test_model_routing import write_trace

#: tool_output steps to the large model, the others to the small one: every step after the first switches.
ALTERNATING = {"models": [{"name": "small"}, {"name": "large"}],
               "policy": {"kind": "rule", "rules": [{"model": "large", "input_kind": ["tool_output"]}]}}


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    sessions = [[(30 + 7 * s + 11 * k, 5 + (3 * s + k) % 17) for k in range(6)] for s in range(5)]
    return write_trace(tmp_path_factory.mktemp("explain-route") / "trace", sessions)


def _causes(ex) -> dict[str, int]:
    return {c.cause: c.recomputed_tokens for c in ex.causes}


def test_switches_are_model_switch_not_eviction_and_match_the_routing_model(trace_dir):
    ex = explain_trace(trace_dir, 16, routing=ALTERNATING)
    routed = route_for_explain(trace_dir, ALTERNATING).routed
    switch = {r.request_id: r.model_switch_tokens for r in routed}
    assert sum(switch.values()) > 0
    # unbounded pools, append-only sessions: every token short of the single-cache hit is a switch's
    assert _causes(ex) == {Cause.MODEL_SWITCH: sum(switch.values())}
    for a in ex.requests:
        assert a.recomputed_tokens == switch[a.request_id]
        assert a.cached_tokens == routed[a.request_id].cached_tokens  # the serving model's pool stands in
        if switch[a.request_id]:
            assert a.cause == Cause.MODEL_SWITCH and "previous step on" in a.where
    # removing the cause gives back the single-cache hit rate (history kept where the session went)
    plain = explain_trace(trace_dir, 16)
    assert ex.causes[0].what_if_hit_rate == pytest.approx(plain.hit_rate)
    assert ex.hit_rate < plain.hit_rate


def test_all_small_routing_changes_nothing(trace_dir):
    plain = explain_trace(trace_dir, 16)
    ex = explain_trace(trace_dir, 16, routing={"policy": {"kind": "all-small"}})
    assert [a.recomputed_tokens for a in ex.requests] == [a.recomputed_tokens for a in plain.requests]
    assert [a.cached_tokens for a in ex.requests] == [a.cached_tokens for a in plain.requests]
    assert ex.routing["model_switch_tokens"] == 0 and ex.routing["other_stickiness"]["saves_usd"] == 0


def test_sticky_routing_saving_is_the_difference_of_the_two_stickinesses(trace_dir):
    ex = explain_trace(trace_dir, 16, routing=ALTERNATING)
    sticky = explain_trace(trace_dir, 16, routing={**ALTERNATING, "stickiness": "sticky-after-escalation"})
    o = ex.routing["other_stickiness"]
    assert o["stickiness"] == "sticky-after-escalation"
    assert o["model_switch_tokens"] == sticky.routing["model_switch_tokens"]
    assert o["saves_model_switch_tokens"] == ex.routing["model_switch_tokens"] - sticky.routing["model_switch_tokens"]
    assert o["saves_usd"] == pytest.approx(ex.routing["total_usd"] - sticky.routing["total_usd"])
    # sessions stay on the large model after their first tool output: switches only at that step
    assert 0 < sticky.routing["model_switch_tokens"] < ex.routing["model_switch_tokens"]
    assert _causes(sticky)[Cause.MODEL_SWITCH] == sticky.routing["model_switch_tokens"]


def test_a_recorded_runs_decisions_give_the_same_attribution_as_the_rule(trace_dir):
    rule = route_for_explain(trace_dir, ALTERNATING)
    records = pd.DataFrame({"request_id": [r.request_id for r in rule.routed] + [0],
                            "model": [r.model for r in rule.routed] + ["large"],
                            "error_class": [None] * len(rule.routed) + ["timeout"]})  # a failed retry is ignored
    recorded = route_for_explain(trace_dir, {"policy": {"kind": "recorded"}}, records=records)
    assert recorded.model_switch == rule.model_switch and recorded.cached_tokens == rule.cached_tokens


def _run(argv, capsys):
    rc = main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_names_model_switch_and_writes_routing(trace_dir, tmp_path, capsys):
    spec = tmp_path / "routing.yaml"
    spec.write_text(json.dumps(ALTERNATING))
    rc, out, _ = _run(["explain", str(trace_dir), "--routing", str(spec), "--no-progress",
                       "--json", str(tmp_path / "ex.json")], capsys)
    assert rc == 0
    table = out.split("cause ")[1]
    assert "model_switch" in table and "sticky-after-escalation would recompute" in out
    got = json.loads((tmp_path / "ex.json").read_text())
    assert {c["cause"] for c in got["causes"]} == {"model_switch"}
    assert got["routing"]["per_model"]["large"]["requests"] > 0


@pytest.mark.parametrize("case", ["unknown-model", "threshold", "labels-missing", "labels-extra",
                                  "labels-without-routing", "recorded-without-decisions"])
def test_cli_bad_routing_input_is_one_line_exit_2(trace_dir, tmp_path, capsys, case):
    n = len(M.load_routing_inputs(trace_dir, (16,)).facts)
    spec = tmp_path / "routing.yaml"
    labels = tmp_path / "labels.csv"
    argv = ["explain", str(trace_dir), "--no-progress", "--routing", str(spec)]
    policy = "{kind: cascade, label_column: passed}"
    ids = list(range(n))
    if case == "unknown-model":
        policy, needle = "{kind: rule, rules: [{model: gpt-9}]}", "unknown model 'gpt-9'"
    elif case == "threshold":
        policy, needle = "{kind: cascade, min_mean_logprob: 0.5}", "min_mean_logprob"
    elif case == "labels-missing":
        ids, needle = ids[:-3], "have no label"
    elif case == "labels-extra":
        ids, needle = ids + [n + 5], "not in the trace"
    elif case == "labels-without-routing":
        argv = argv[:3]
        needle = "--labels needs --routing"
    else:
        policy, needle = "{kind: recorded}", "recorded routing policy needs --labels"
    spec.write_text(f"policy: {policy}\n")
    if case != "recorded-without-decisions":
        labels.write_text("request_id,passed\n" + "".join(f"{i},pass\n" for i in ids))
        argv += ["--labels", str(labels)]
    rc, _out, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def _routed_run(trace_dir: Path, run: Path, spec: dict) -> Path:
    """A replay run directory as a routed replay leaves it: its manifest names the trace, its records carry each
    request's serving model and the servers' cached tokens (here: the routing model's, as if exact)."""
    from kvscope.harness.results.loaders import MANIFEST_NAME, write_result_file
    from kvscope.harness.results.records import PARQUET_NAME, RECORD_FIELDS
    from kvscope.harness.results.schemas import HostInfo, ManifestFile, TraceRef

    routed = route_for_explain(trace_dir, spec).routed
    run.mkdir(parents=True)
    write_result_file(run / MANIFEST_NAME, ManifestFile, ManifestFile(
        kvscope_version="t", vllm_version=None, trace=TraceRef(path=str(trace_dir), sha256="x", name=None, seed=None),
        options={}, endpoints=["http://small", "http://large"], server_config=None,
        host=HostInfo(hostname="h", platform="p", cpus=2), started_at=0.0, ended_at=1.0, aborted=None,
        prefix_cache_reset=None))
    rows = pd.DataFrame({f: None for f in RECORD_FIELDS}, index=range(len(routed)))
    rows = rows.assign(request_id=[r.request_id for r in routed], session_id=[str(r.session_id) for r in routed],
                       step=[r.step for r in routed], prompt_tokens=[r.prompt_tokens for r in routed],
                       cached_tokens=[r.cached_tokens for r in routed], output_tokens=[r.output_tokens for r in routed],
                       in_window=True, attempt=0, model=[r.model for r in routed])
    rows.to_parquet(run / PARQUET_NAME)
    return run


def test_a_routed_runs_measured_reads_and_recorded_decisions(trace_dir, tmp_path, capsys):
    run = _routed_run(trace_dir, tmp_path / "run", ALTERNATING)
    switch = sum(r.model_switch_tokens for r in route_for_explain(trace_dir, ALTERNATING).routed)
    # without --routing the run's per-model reads look like evictions from one cache
    rc, out, _ = _run(["explain", str(run), "--no-progress"], capsys)
    assert rc == 0 and "evicted" in out.split("cause ")[-1] and "model_switch" not in out
    # with the rule, or with the decisions the run recorded, they are model switches
    for spec in (ALTERNATING, {"policy": {"kind": "recorded"}}):
        f = tmp_path / "routing.json"
        f.write_text(json.dumps(spec))
        rc, out, _ = _run(["explain", str(run), "--routing", str(f), "--no-progress", "--json", str(tmp_path / "e.json")],
                          capsys)
        got = json.loads((tmp_path / "e.json").read_text())
        assert rc == 0 and {c["cause"]: c["recomputed_tokens"] for c in got["causes"]} == {"model_switch": switch}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), sessions=st.integers(1, 4), steps=st.integers(2, 6),
       kinds=st.sets(st.sampled_from(["task", "user", "tool_output"]), min_size=1),
       threshold=st.sampled_from([0, 60, 150]), sticky=st.booleans())
def test_every_rules_switch_tokens_are_attributed_to_model_switch(tmp_path_factory, seed, sessions, steps, kinds,
                                                                   threshold, sticky):
    """Any rule on any append-only trace: the attribution's model_switch total is the routing model's, request
    for request, and nothing of a routed shortfall is left as eviction (unbounded pools evict nothing)."""
    shape = [[(20 + (seed + 7 * s + 13 * k) % 50, 3 + (seed + s + k) % 9) for k in range(steps)]
             for s in range(sessions)]
    trace = write_trace(tmp_path_factory.mktemp("ms") / "t", shape, seed=seed)
    spec = {"policy": {"kind": "rule", "rules": [{"model": "large", "input_kind": sorted(kinds),
                                                  "min_prompt_tokens": threshold}]},
            "stickiness": "sticky-after-escalation" if sticky else "per-step"}
    ex = explain_trace(trace, 16, routing=spec)
    routed = {r.request_id: r.model_switch_tokens for r in route_for_explain(trace, spec).routed}
    causes = _causes(ex)
    assert causes.get(Cause.MODEL_SWITCH, 0) == sum(routed.values())
    assert Cause.EVICTED not in causes
    for a in ex.requests:
        assert a.recomputed_tokens == routed[a.request_id]
