"""Model routing offline: policies, one exact simulator pool per model, escalations, switches, the fast path,
the CLI and its bad-input errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvscope.harness.cachemodel import model_routing as M
from kvscope.harness.cachemodel.sim_types import SimRequest
from kvscope.harness.cachemodel.simulator import SimConfig, simulate
from kvscope.harness.cli.main import main
from kvscope.workloads.trace import TraceBuilder

KINDS = ("task", "tool_output", "user")


def write_trace(path: Path, sessions: list[list[tuple[int, int]]], system_tokens: int = 40, seed: int = 0) -> Path:
    """Append-only sessions after one shared system prompt; each step adds ``new`` random tokens (its input
    kind cycles task → tool_output → user) and answers ``out`` tokens."""
    rng = np.random.default_rng(seed)
    b = TraceBuilder()
    system = b.add_segment(rng.integers(10, 8000, system_tokens).astype(np.int32), "system")
    t = 0.0
    for si, steps in enumerate(sessions):
        ids = [system]
        parent = -1
        for step, (new, out) in enumerate(steps):
            kind = "task" if step == 0 else KINDS[1 + step % 2]
            ids = ids + [b.add_segment(rng.integers(10, 8000, new).astype(np.int32), kind)]
            oid = b.add_segment(rng.integers(10, 8000, out).astype(np.int32), "assistant")
            prompt_tokens = sum(b.segment_len(s) for s in ids)
            parent = b.add_request(session_id=f"s{si}", step=step, parent_request_id=parent, arrival_s=t,
                                   prompt_segment_ids=list(ids), prompt_tokens=prompt_tokens, output_segment_id=oid,
                                   output_tokens=out, max_tokens=out, input_kind=kind,
                                   transition="first" if step == 0 else "append")
            ids = ids + [oid]
            t += 1.0
    b.build({"name": "routing-test"}).write(path)
    return path


@pytest.fixture(scope="module")
def trace_dir(tmp_path_factory) -> Path:
    sessions = [[(30 + 7 * s + 11 * k, 5 + (3 * s + k) % 17) for k in range(6)] for s in range(5)]
    return write_trace(tmp_path_factory.mktemp("route") / "trace", sessions)


def _spec(policy: dict, stickiness: str = "per-step", small: dict | None = None, large: dict | None = None):
    return M.load_spec({"models": [{"name": "small", **(small or {})}, {"name": "large", **(large or {})}],
                        "policy": policy, "stickiness": stickiness})


def _inputs(trace_dir: Path, *block_sizes: int) -> M.RoutingInputs:
    return M.load_routing_inputs(trace_dir, block_sizes or (16,))


def _sub(reqs: list[SimRequest], keep: list[int], prompt_only: set[int] = frozenset()) -> list[SimRequest]:
    """The requests one model sees, in order; a discarded attempt keeps only its prompt blocks."""
    out = []
    for i in keep:
        r = reqs[i]
        out.append(M._attempt_request(r, i not in prompt_only))
    return out


# ------------------------------------------------------------------------------------- equal to the simulator

@pytest.mark.parametrize("blocks", [None, 40])
def test_all_small_is_the_single_pool_simulator_exactly(trace_dir, blocks):
    inp = _inputs(trace_dir, 16)
    spec = _spec({"kind": "all-small"}, small={"num_gpu_blocks": blocks})
    expected = simulate(inp.requests_by_block[16], SimConfig(16, blocks)).cached_tokens
    assert [r.cached_tokens for r in M.evaluate(spec, inp, fast=False)] == expected
    if blocks is None:
        assert [r.cached_tokens for r in M.evaluate(spec, inp, fast=True)] == expected
    else:
        with pytest.raises(ValueError, match="unbounded pools only"):
            M.evaluate(spec, inp, fast=True)
    assert all(r.model == "small" and r.model_switch_tokens == 0 for r in M.evaluate(spec, inp))


def test_a_switch_pays_a_full_prefill_on_the_other_pool_and_stickiness_recovers_it(trace_dir):
    inp = _inputs(trace_dir, 16, 32)
    # steps >= 3 go to the large model (block size 32): step 3 of every session starts cold there
    policy = {"kind": "rule", "rules": [{"model": "large", "min_step": 3}]}
    spec = _spec(policy, large={"block_size": 32})
    routed = M.evaluate(spec, inp, fast=False)
    large_ids = [i for i, r in enumerate(routed) if r.model == "large"]
    small_ids = [i for i, r in enumerate(routed) if r.model == "small"]
    sim_large = simulate(_sub(inp.requests_by_block[32], large_ids), SimConfig(32, None)).cached_tokens
    sim_small = simulate(_sub(inp.requests_by_block[16], small_ids), SimConfig(16, None)).cached_tokens
    assert [routed[i].cached_tokens for i in large_ids] == sim_large
    assert [routed[i].cached_tokens for i in small_ids] == sim_small
    first_on_large = [r for r in routed if r.step == 3]
    assert [r.cached_tokens for r in first_on_large] == [0] + [32] * (len(first_on_large) - 1)  # system prompt only
    for r in first_on_large:
        parent = routed[r.request_id - 1]  # sessions run one after another in this trace
        # the small pool held the parent's prompt and answer, the start of this prompt, block for block
        small_had = min((parent.prompt_tokens + parent.output_tokens - 1) // 16, (r.prompt_tokens - 1) // 16) * 16
        assert r.model_switch_tokens == small_had - r.cached_tokens > 0
    assert all(r.model_switch_tokens == 0 for r in routed if r.step > 3)  # stays on large: no switch

    # a rule that bounces between models: per-step pays at every switch, sticky stays and pays once
    bounce = {"kind": "rule", "rules": [{"model": "large", "input_kind": ["tool_output"]}]}
    per_step = M.evaluate(_spec(bounce), inp, fast=False)
    sticky = M.evaluate(_spec(bounce, "sticky-after-escalation"), inp, fast=False)
    assert sum(r.model_switch_tokens for r in sticky) < sum(r.model_switch_tokens for r in per_step)
    assert sum(r.cached_tokens for r in sticky) > sum(r.cached_tokens for r in per_step)
    for r in sticky:  # kinds by step: task, user, tool_output (→ large), user, tool_output, user
        if r.step == 2:
            assert r.model == "large" and r.reason.startswith("rule 0") and r.model_switch_tokens > 0
        if r.step >= 3:
            assert r.model == "large" and r.reason == "sticky: session on large since step 2"
            assert r.model_switch_tokens == 0
    large_ids = [i for i, r in enumerate(sticky) if r.model == "large"]
    assert [sticky[i].cached_tokens for i in large_ids] == simulate(
        _sub(inp.requests_by_block[16], large_ids), SimConfig(16, None)).cached_tokens


def test_a_cascade_escalation_is_two_attempts_and_the_large_attempt_matches_the_simulator(trace_dir):
    inp = _inputs(trace_dir, 16)
    spec = _spec({"kind": "cascade", "max_output_tokens": 12})
    attempts = M.route_requests(inp.facts, spec)
    escalated = [a for a in attempts if len(a) == 2]
    assert escalated and all(a[0].model == "small" and not a[0].served and a[1].model == "large" and a[1].served
                             for a in escalated)
    assert all(f.output_tokens > 12 for a, f in zip(attempts, inp.facts) if len(a) == 2)
    routed = M.evaluate(spec, inp, fast=False)
    large_ids = [i for i, a in enumerate(attempts) if a[-1].model == "large"]
    small_ids = [i for i, a in enumerate(attempts) if a[0].model == "small"]
    reqs = inp.requests_by_block[16]
    assert [routed[i].cached_tokens for i in large_ids] == simulate(_sub(reqs, large_ids), SimConfig(16, None)).cached_tokens
    # the small pool saw every request; the escalated ones without their (discarded) answers
    sim_small = simulate(_sub(reqs, small_ids, prompt_only=set(large_ids)), SimConfig(16, None)).cached_tokens
    got_small = [routed[i].small_attempt_cached_tokens if routed[i].escalated else routed[i].cached_tokens
                 for i in small_ids]
    assert got_small == sim_small
    for i in large_ids:
        r = routed[i]
        assert r.escalated and r.small_attempt_model == "small"
        assert r.wasted_prefill_tokens == r.prompt_tokens - r.small_attempt_cached_tokens
        assert r.wasted_output_tokens == r.output_tokens
    t = M.totals(routed, spec.model_names)
    assert t["per_model"]["small"]["attempts"] == len(routed)
    assert t["per_model"]["large"]["attempts"] == len(large_ids) == t["escalations"]
    assert t["prompt_tokens_sent"] == sum(r.prompt_tokens for r in routed) + sum(routed[i].prompt_tokens for i in large_ids)


def test_cascade_reads_labels_and_logprobs(trace_dir, tmp_path):
    inp0 = _inputs(trace_dir, 16)
    ids = [f.request_id for f in inp0.facts]
    labels = tmp_path / "labels.csv"
    labels.write_text("request_id,passed,mean_logprob\n" + "".join(
        f"{i},{'fail' if i % 3 == 0 else 'pass'},{-0.1 * (i % 7)}\n" for i in ids))
    inp = M.load_routing_inputs(trace_dir, [16], labels)
    by_label = M.route_requests(inp.facts, _spec({"kind": "cascade", "label_column": "passed"}))
    assert [len(a) == 2 for a in by_label] == [i % 3 == 0 for i in ids]
    assert "passed='fail'" in by_label[0][1].reason
    by_lp = M.route_requests(inp.facts, _spec({"kind": "cascade", "min_mean_logprob": -0.35}))
    assert [len(a) == 2 for a in by_lp] == [-0.1 * (i % 7) < -0.35 for i in ids]


policies = st.one_of(
    st.just({"kind": "all-large"}),
    st.builds(lambda t, k, s: {"kind": "rule", "rules": [{"model": "large", "input_kind": k, "min_prompt_tokens": t,
                                                          "min_step": s}]},
              st.integers(0, 300), st.lists(st.sampled_from(KINDS), min_size=1, max_size=3, unique=True),
              st.integers(0, 4)),
    st.builds(lambda n: {"kind": "cascade", "max_output_tokens": n}, st.integers(1, 25)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(policy=policies, stickiness=st.sampled_from(M.STICKINESS), large_block=st.sampled_from([16, 32]),
       sessions=st.lists(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30)), min_size=1, max_size=5),
                         min_size=1, max_size=4), seed=st.integers(0, 3))
def test_fast_path_equals_the_pool_simulator(tmp_path_factory, policy, stickiness, large_block, sessions, seed):
    path = write_trace(tmp_path_factory.mktemp("h") / "t", sessions, system_tokens=17 + seed * 9, seed=seed)
    inp = M.load_routing_inputs(path, [16, large_block])
    spec = _spec(policy, stickiness, large={"block_size": large_block})
    assert M.evaluate(spec, inp, fast=True) == M.evaluate(spec, inp, fast=False)


# ------------------------------------------------------------------------------------------------- specs

@pytest.mark.parametrize("data, needle", [
    ({"policy": {"kind": "rule", "rules": [{"model": "huge"}]}}, "unknown model 'huge'"),
    ({"policy": {"kind": "cascade", "min_mean_logprob": 0.5}}, "min_mean_logprob"),
    ({"policy": {"kind": "cascade"}}, "needs a check"),
    ({"policy": {"kind": "coin-flip"}}, "coin-flip"),
    ({"policy": {"kind": "all-small"}, "stickiness": "forever"}, "stickiness"),
    ({"models": [{"name": "a"}, {"name": "a"}], "policy": {"kind": "all-small"}}, "repeat"),
])
def test_bad_specs_are_one_line_errors(data, needle):
    with pytest.raises(Exception) as exc:
        M.load_spec(data, "spec.yaml")
    msg = str(exc.value)
    assert needle in msg and "\n" not in msg and msg.startswith("spec.yaml")


def test_a_registered_policy_is_accepted_by_the_spec():
    @M.model_routing_policy("test-by-session")
    class BySession(M.ModelRoutingPolicy):
        def decide(self, req, models):
            return M.Route(models[int(req.session_id[1:]) % len(models)], "session parity")

    spec = M.load_spec({"policy": {"kind": "test-by-session"}})
    assert isinstance(spec.policy, BySession)
    facts = [M.RequestFacts(0, "s1", 0, "task", 10, 2), M.RequestFacts(1, "s2", 0, "task", 10, 2)]
    assert [a[0].model for a in M.route_requests(facts, spec)] == ["large", "small"]


# --------------------------------------------------------------------------------------------------- CLI

def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_policy_writes_per_request_and_json(trace_dir, tmp_path, capsys):
    pr, js = tmp_path / "pr.jsonl", tmp_path / "s.json"
    rc, out, err = _run(["route", str(trace_dir), "--policy", "cascade", "--cascade-max-output-tokens", "12",
                         "--per-request", str(pr), "--json", str(js), "--no-progress"], capsys)
    assert rc == 0, err
    assert "escalations" in out and "model_switch" in out and "$ per 1,000 sessions" in out
    rows = [json.loads(line) for line in pr.read_text().splitlines()]
    d = json.loads(js.read_text())
    assert len(rows) == d["requests"] and sum(r["escalated"] for r in rows) == d["escalations"] > 0
    sticky = M.evaluate(_spec({"kind": "cascade", "max_output_tokens": 12}, "sticky-after-escalation"),
                        _inputs(trace_dir, 16), fast=False)
    assert [(r["other_stickiness_model"], r["other_stickiness_cached_tokens"]) for r in rows] == [
        (r.model, r.cached_tokens) for r in sticky]
    assert d["other_stickiness"]["stickiness"] == "sticky-after-escalation"
    assert d["per_model"]["large"]["preset"] == "anthropic-sonnet-5m"
    assert d["usd_per_1k_sessions"] == pytest.approx(d["total_usd"] * 1000 / d["sessions"])


def test_cli_sweep_ranks_variants_by_cost(trace_dir, tmp_path, capsys):
    js = tmp_path / "sweep.json"
    rc, out, err = _run(["route", str(trace_dir), "--sweep", "--thresholds", "0,100,200", "--json", str(js),
                         "--no-progress"], capsys)
    assert rc == 0, err
    d = json.loads(js.read_text())
    assert d["variants"] == 3 * 7 * 2
    costs = [r["usd_per_1k_sessions"] for r in d["rows"]]
    assert costs == sorted(costs)
    assert "rule variants" in out


def _labels(trace_dir: Path, tmp_path: Path, ids: list[int]) -> Path:
    p = tmp_path / "labels.csv"
    p.write_text("request_id,passed\n" + "".join(f"{i},pass\n" for i in ids))
    return p


@pytest.mark.parametrize("case", ["unknown-model", "threshold", "labels-extra", "labels-missing", "preset",
                                  "column", "not-a-trace", "bad-kind", "stray-flag"])
def test_cli_bad_input_is_one_line_exit_2(trace_dir, tmp_path, capsys, case):
    n = len(_inputs(trace_dir).facts)
    argv = ["route", str(trace_dir), "--no-progress"]
    if case == "unknown-model":
        spec = tmp_path / "spec.yaml"
        spec.write_text("policy: {kind: rule, rules: [{model: gpt-9}]}\n")
        argv += ["--spec", str(spec)]
        needle = "unknown model 'gpt-9'"
    elif case == "threshold":
        argv += ["--policy", "cascade", "--cascade-min-logprob", "0.5"]
        needle = "min_mean_logprob"
    elif case == "labels-extra":
        argv += ["--policy", "cascade", "--cascade-label", "passed",
                 "--labels", str(_labels(trace_dir, tmp_path, list(range(n + 1))))]
        needle = "not in the trace"
    elif case == "labels-missing":
        argv += ["--policy", "cascade", "--cascade-label", "passed",
                 "--labels", str(_labels(trace_dir, tmp_path, list(range(n - 2))))]
        needle = "have no label"
    elif case == "preset":
        argv += ["--large-pricing", "no-such-provider"]
        needle = "unknown pricing preset"
    elif case == "column":
        argv += ["--policy", "cascade", "--cascade-label", "verdict"]
        needle = "column 'verdict'"
    elif case == "not-a-trace":
        f = tmp_path / "x.jsonl"
        f.write_text(json.dumps({"prompt_token_ids": [1, 2, 3]}) + "\n")
        argv[1] = str(f)
        needle = "kvscope trace directory"
    elif case == "stray-flag":
        argv += ["--policy", "all-large", "--cascade-max-output-tokens", "10"]
        needle = "--cascade-max-output-tokens needs --policy cascade"
    else:
        argv += ["--policy", "rule", "--rule-input-kind", "email"]
        needle = "allowed"
    if case == "bad-kind":  # argparse rejects the flag itself: exit 2 with a usage line and the message
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err.strip().splitlines()[-1]
        return
    rc, _out, err = _run(argv, capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and needle in lines[0] and "Traceback" not in err, err


def test_cost_bills_hits_as_reads_misses_as_writes_and_wasted_attempts_on_the_small_model(trace_dir):
    from kvscope.harness.pricing.model_routing import evaluate_policy

    inp = _inputs(trace_dir, 16)
    spec = _spec({"kind": "cascade", "max_output_tokens": 12}, small={"pricing": "deepseek-v3.2"},
                 large={"pricing": "seed-illustrative"})
    ev = evaluate_policy(spec, inp, fast=False)
    small = sum((r.prompt_tokens - r.cached_tokens) * 0.28 + r.cached_tokens * 0.028 + r.output_tokens * 0.42
                for r in ev.routed if r.model == "small")
    wasted = sum(r.wasted_prefill_tokens * 0.28 + r.small_attempt_cached_tokens * 0.028 + r.wasted_output_tokens * 0.42
                 for r in ev.routed if r.escalated)
    large = sum((r.prompt_tokens - r.cached_tokens) * 3.75 + r.cached_tokens * 0.3 + r.output_tokens * 15
                for r in ev.routed if r.model == "large")
    assert ev.cost["per_model"]["small"]["total_usd"] == pytest.approx((small + wasted) / 1e6)
    assert ev.cost["per_model"]["large"]["total_usd"] == pytest.approx(large / 1e6)
    assert ev.cost["wasted_attempts_usd"] == pytest.approx(wasted / 1e6)
    assert wasted > 0 and large > 0
    assert M.model_switch_tokens(ev.routed) == {str(r.request_id): r.model_switch_tokens for r in ev.routed
                                                if r.model_switch_tokens}


def test_recorded_decisions_replay_a_cascade_attempt_for_attempt(trace_dir, tmp_path, capsys):
    inp0 = _inputs(trace_dir, 16)
    cascade = _spec({"kind": "cascade", "max_output_tokens": 12})
    expected = M.evaluate(cascade, inp0, fast=False)
    rec = tmp_path / "decisions.jsonl"
    rec.write_text("".join(json.dumps({"request_id": r.request_id, "model": r.model, "escalated": r.escalated}) + "\n"
                           for r in expected))
    inp = M.load_routing_inputs(trace_dir, [16], rec)
    recorded = M.evaluate(_spec({"kind": "recorded", "escalated_column": "escalated"}), inp, fast=False)
    assert [(r.model, r.escalated, r.cached_tokens, r.small_attempt_cached_tokens, r.model_switch_tokens)
            for r in recorded] == [(r.model, r.escalated, r.cached_tokens, r.small_attempt_cached_tokens,
                                    r.model_switch_tokens) for r in expected]
    bad = tmp_path / "bad.csv"
    bad.write_text("request_id,model\n" + "".join(f"{r.request_id},{'medium' if r.request_id == 4 else 'small'}\n"
                                                   for r in expected))
    rc, _out, err = _run(["route", str(trace_dir), "--policy", "recorded", "--labels", str(bad), "--no-progress"],
                         capsys)
    assert rc == 2 and err.strip().count("\n") == 0 and "request 4: model='medium'" in err


def test_three_models_each_pool_sees_exactly_its_requests(trace_dir):
    inp = _inputs(trace_dir, 16, 32, 64)
    spec = M.load_spec({"models": [{"name": "s", "block_size": 16}, {"name": "m", "block_size": 32, "num_gpu_blocks": 12},
                                   {"name": "l", "block_size": 64}],
                        "policy": {"kind": "rule", "rules": [{"model": "m", "input_kind": ["user"]},
                                                             {"model": "l", "input_kind": ["tool_output"]}]}})
    routed = M.evaluate(spec, inp)
    assert {r.model for r in routed} == {"s", "m", "l"}
    for name, bs, blocks in (("s", 16, None), ("m", 32, 12), ("l", 64, None)):
        ids = [i for i, r in enumerate(routed) if r.model == name]
        assert [routed[i].cached_tokens for i in ids] == simulate(_sub(inp.requests_by_block[bs], ids),
                                                                  SimConfig(bs, blocks)).cached_tokens
