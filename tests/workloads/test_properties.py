"""Hypothesis property tests over random specs, and one test per history policy showing its reuse effect."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats as sstats

from kvscope.workloads.generate import generate
from kvscope.workloads.spec import parse_spec
from kvscope.workloads.stats import ideal_hit_ratio

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _lognormal(median: float, sigma: float) -> dict:
    return {"kind": "lognormal", "median": median, "sigma": sigma}


@st.composite
def specs(draw, policies=None):
    kind = draw(st.sampled_from(["chat", "agent"]))
    data = {
        "seed": draw(st.integers(0, 10_000)),
        "sessions": {
            "kind": kind, "count": draw(st.integers(1, 6)),
            "chat": {"turns": draw(st.integers(1, 6)), "user_tokens": _lognormal(draw(st.integers(5, 300)), 0.8),
                     "output_tokens": draw(st.integers(1, 80)), "reasoning_tokens": draw(st.integers(0, 10))},
            "agent": {"calls": {"kind": "uniform", "low": 1, "high": draw(st.integers(1, 12))},
                      "tool_output_tokens": _lognormal(draw(st.integers(5, 400)), 1.0),
                      "tool_call_tokens": draw(st.integers(1, 50)), "reasoning_tokens": draw(st.integers(0, 20)),
                      "user_turn_probability": draw(st.floats(0, 0.5))},
            "policies": policies or [{"kind": "append_only"}],
        },
        "prefix": {"tenants": draw(st.integers(1, 3)), "system_tokens": draw(st.integers(1, 400)),
                   "tools_tokens": draw(st.integers(0, 400)), "tool_count": draw(st.integers(1, 5))},
        "arrival": {"kind": draw(st.sampled_from(["poisson", "gamma", "closed_loop", "all_at_once"])), "cv": 2.0},
    }
    return parse_spec(data)


@SETTINGS
@given(spec=specs())
def test_append_only_prompt_extends_parent_prompt_and_output(spec, source):
    tr = generate(spec, source)
    for r in tr.iter_requests():
        if r.parent_request_id < 0:
            assert r.transition == "first"
            continue
        parent = tr.prompt_token_ids(r.parent_request_id)
        out = tr.output_token_ids(r.parent_request_id)
        mine = tr.prompt_token_ids(r.request_id)
        assert np.array_equal(mine[: len(parent) + len(out)], np.concatenate([parent, out]))
        assert len(mine) > len(parent) + len(out)
        assert r.transition == "append"
        assert tr.requests.arrival_s[r.parent_request_id] <= r.arrival_s


@SETTINGS
@given(spec=specs(policies=[{"kind": "volatile_prefix", "tokens": 3, "position": 40}]))
def test_volatile_prefix_bounds_common_prefix(spec, source):
    tr = generate(spec, source)
    prompts = [tr.prompt_token_ids(i) for i in range(tr.num_requests)]
    for i, p in enumerate(prompts):
        for q in prompts[:i]:
            m = min(len(p), len(q))
            d = np.nonzero(p[:m] != q[:m])[0]
            lcp = int(d[0]) if len(d) else m
            assert lcp <= 40


@SETTINGS
@given(spec=specs(policies=[{"kind": "append_only"}, {"kind": "edit_turn", "probability": 0.5}]))
def test_same_seed_identical_different_seed_different(spec, source, tmp_path_factory):
    a, b = generate(spec, source), generate(spec, source)
    assert a.equals(b)
    d = tmp_path_factory.mktemp("det")
    a.write(d / "a")
    b.write(d / "b")
    for f in ("segments.parquet", "requests.parquet", "trace.json"):
        assert (d / "a" / f).read_bytes() == (d / "b" / f).read_bytes()
    c = generate(spec, source, seed=spec.seed + 1)
    assert not np.array_equal(a.seg_tokens[: min(len(a.seg_tokens), len(c.seg_tokens))],
                              c.seg_tokens[: min(len(a.seg_tokens), len(c.seg_tokens))])


def test_different_seed_same_distribution(source):
    spec = parse_spec({"sessions": {"kind": "agent", "count": 150, "agent": {
        "calls": {"kind": "uniform", "low": 5, "high": 15}, "tool_output_tokens": _lognormal(300, 1.0)}},
        "prefix": {"system_tokens": 50, "tools_tokens": 0}})
    a, b = generate(spec, source, seed=1), generate(spec, source, seed=2)
    assert not np.array_equal(a.seg_tokens[:1000], b.seg_tokens[:1000])
    sa = a.requests.prompt_tokens.diff().to_numpy()
    xa = np.diff(a.requests.sort_values(["session_id", "step"]).prompt_tokens.to_numpy())
    xb = np.diff(b.requests.sort_values(["session_id", "step"]).prompt_tokens.to_numpy())
    assert sstats.ks_2samp(xa[xa > 0], xb[xb > 0]).pvalue > 0.01
    assert abs(a.num_requests - b.num_requests) / a.num_requests < 0.1
    del sa


# ---------------------------------------------------------------------------------------- policies


def _agent(source, policies, calls=12, reasoning=0, count=3, **agent):
    spec = parse_spec({"sessions": {"kind": "agent", "count": count, "policies": policies,
                                    "agent": {"calls": calls, "tool_output_tokens": 200, "tool_call_tokens": 40,
                                              "reasoning_tokens": reasoning, **agent}},
                       "prefix": {"system_tokens": 400, "tools_tokens": 600, "tool_count": 6},
                       "arrival": {"kind": "poisson", "rate": 10.0}})
    return generate(spec, source, seed=3)


def _lcp_with_parent(tr, rid):
    p, q = tr.prompt_token_ids(tr.requests.parent_request_id[rid]), tr.prompt_token_ids(rid)
    m = min(len(p), len(q))
    d = np.nonzero(p[:m] != q[:m])[0]
    return int(d[0]) if len(d) else m


def test_policy_append_only_baseline(source):
    tr = _agent(source, [{"kind": "append_only"}])
    assert set(tr.requests.transition) == {"first", "append"}
    assert ideal_hit_ratio(tr, 16, per_session=True) > 0.85


def test_policy_volatile_prefix(source):
    base = _agent(source, [{"kind": "append_only"}])
    tr = _agent(source, [{"kind": "volatile_prefix", "tokens": 4, "position": 100}])
    later = tr.requests[tr.requests.parent_request_id >= 0].index
    assert all(_lcp_with_parent(tr, i) == 100 for i in later)
    assert ideal_hit_ratio(tr, 16) < 0.1 < ideal_hit_ratio(base, 16)
    kinds = [k for k, *_ in tr.segment_map(0)]
    assert kinds[:3] == ["system", "volatile", "system"]


def test_policy_edit_turn(source):
    tr = _agent(source, [{"kind": "edit_turn", "depth": 3, "tokens": 8, "probability": 1.0}])
    edits = tr.requests[tr.requests.transition == "edit"].index
    assert len(edits) > 0
    for i in edits:
        parent_len = tr.requests.prompt_tokens[tr.requests.parent_request_id[i]]
        assert parent_len / 2 <= _lcp_with_parent(tr, i) < parent_len
    assert ideal_hit_ratio(tr, 16, per_session=True) < ideal_hit_ratio(_agent(source, []), 16, per_session=True)


def test_policy_truncate_tool_outputs(source):
    tr = _agent(source, [{"kind": "truncate_tool_outputs", "keep_last": 2, "max_tokens": 10}])
    assert (tr.requests.transition == "edit").sum() > 0
    last = tr.requests[tr.requests.session_id == "s0"].iloc[-1]
    tool_lens = [n for k, _, n, _ in tr.segment_map(int(last.request_id)) if k == "tool_output"]
    assert tool_lens[:-3] and all(n == 10 for n in tool_lens[:-3]) and tool_lens[-1] == 200
    base = _agent(source, [])
    assert tr.requests.prompt_tokens.sum() < base.requests.prompt_tokens.sum()


def test_policy_sliding_window(source):
    tr = _agent(source, [{"kind": "sliding_window", "budget_tokens": 2500}])
    assert tr.requests.prompt_tokens.max() <= 2500
    resets = tr.requests[tr.requests.transition == "reset"].index
    assert len(resets) > 0
    assert all(_lcp_with_parent(tr, i) <= 1000 + 200 for i in resets)  # back to about the static prefix


def test_policy_compaction(source):
    tr = _agent(source, [{"kind": "compaction", "threshold_tokens": 2500, "summary_tokens": 300, "keep_last": 1}],
                calls=30)
    comp = tr.requests[tr.requests.transition == "compaction"]
    assert len(comp) > 0
    for i in comp.index:
        kinds = [k for k, *_ in tr.segment_map(i)]
        assert "summary" in kinds
        assert _lcp_with_parent(tr, i) == 1000  # system + tools survive, history does not
    assert tr.requests.prompt_tokens.max() <= 2500 + 300


def test_policy_reorder_tools(source):
    tr = _agent(source, [{"kind": "reorder_tools", "probability": 1.0}])
    later = tr.requests[tr.requests.parent_request_id >= 0].index
    assert all(_lcp_with_parent(tr, i) < 1000 for i in later)  # diverges inside the tool block
    assert all(_lcp_with_parent(tr, i) >= 400 for i in later)  # system prompt still shared
    assert (tr.requests.transition[later] != "append").all()


def test_policy_strip_reasoning(source):
    keep0 = _agent(source, [{"kind": "strip_reasoning"}], reasoning=50)
    for r in keep0.iter_requests():
        if r.parent_request_id >= 0:
            assert r.transition == "append"  # parent prompt is a prefix, the output is re-sent shorter
            assert keep0.output_segment_id(r.parent_request_id) not in r.prompt_segment_ids
    base = _agent(source, [], reasoning=50)
    assert keep0.requests.prompt_tokens.sum() < base.requests.prompt_tokens.sum()
    keep1 = _agent(source, [{"kind": "strip_reasoning", "keep_last": 1}], reasoning=50)
    assert (keep1.requests.transition == "edit").sum() > 0  # stripping older outputs edits cached history
    assert ideal_hit_ratio(keep1, 16, per_session=True) < ideal_hit_ratio(base, 16, per_session=True)


def test_generation_speed_100k_sessions(source):
    """~1,000 requests of agent sessions growing to ~100k tokens: seconds, not minutes."""
    import time

    spec = parse_spec({"sessions": {"kind": "agent", "count": 20, "agent": {
        "calls": 50, "tool_output_tokens": 1700, "tool_call_tokens": 150}},
        "prefix": {"system_tokens": 3000, "tools_tokens": 12000}})
    t = time.perf_counter()
    tr = generate(spec, source)
    assert time.perf_counter() - t < 10
    assert tr.num_requests == 1000 and tr.requests.prompt_tokens.max() > 90_000
    assert len(tr.seg_tokens) < 0.05 * tr.requests.prompt_tokens.sum()


def test_policy_drop_history(source):
    tr = _agent(source, [{"kind": "drop_history", "probability": 0.3, "fraction": 0.5}], calls=20)
    dropped = tr.requests[tr.requests.transition.isin(["reset", "edit"])].index
    assert (tr.requests.transition == "reset").sum() > 0
    assert all(_lcp_with_parent(tr, i) <= 1000 + 200 for i in dropped)  # back to about the static prefix
    base = _agent(source, [], calls=20)
    assert tr.requests.prompt_tokens.sum() < base.requests.prompt_tokens.sum()
